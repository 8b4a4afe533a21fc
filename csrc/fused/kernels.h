// The dispatcher's kernels of the planned fused ops (kernels.cpp) and their autograd (autograd.cpp), and the
// Python planner they ask on a key's first call (planned.h).
#pragma once

#include <pybind11/pybind11.h>

namespace fastmesh {
namespace fused {

// The Python planner: planner(op_name, args) -> (result, plan or None), plan = (split, pieces, decision id), with
// op_name one of planned.h's names and args the op's arguments in schema order. Held for the life of the process.
void set_planner(pybind11::object planner);

}  // namespace fused
}  // namespace fastmesh

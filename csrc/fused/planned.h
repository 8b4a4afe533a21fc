// The fused ops' steady state: a call whose key was planned before runs its C++ schedule with the remembered plan,
// no Python on the way. The key is everything the plan and the argument checks depend on: the op, the group (its
// name, its object and size), every tensor's dtype, device, sizes and strides, every option, and the intra-op
// thread count. The first call of a key goes to the Python planner (fastmesh/ops/plans.py, registered with
// set_planner): it checks the arguments, agrees the plan with the other ranks, runs the call, and returns the plan
// to remember (or none: a plan that holds for this call only). Errors a call can meet once planned (a failed
// transfer) still come from the schedule.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>

#include "fastmesh/pipeline.h"
#include "process_group.h"

namespace fastmesh {
namespace fused {

// The ops that are planned per call, each with its slot for the latest decision (planned_decision).
enum class PlannedOp : int {
  kAllGatherMatmul,
  kMatmulReduceScatter,
  kMatmulAllReduce,
  kMatmulAllGather,
  kAllGatherScaledMatmul,
  kScaledMatmulReduceScatter,
  kScaledMatmulAllReduce,
  kCount,
};

// The op's name as the Python planner knows it ("all_gather_matmul"); nullptr for none.
const char* planned_op_name(PlannedOp op);
// The op named `name`, or kCount.
PlannedOp planned_op_named(c10::string_view name);

// A call's key, built field by field; the group is resolved once, here, for the schedule too.
class CallKey {
 public:
  CallKey(PlannedOp op, c10::string_view group_name, const char* op_name);
  CallKey& tensor(const at::Tensor& t);
  CallKey& tensors(at::TensorList ts);
  CallKey& value(int64_t v);
  CallKey& text(c10::string_view s);

  PlannedOp op() const { return op_; }
  const Group& group() const { return group_; }
  const std::string& bytes() const { return bytes_; }

 private:
  void append(int64_t v) { bytes_.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

  PlannedOp op_;
  Group group_;
  std::string bytes_;
};

struct RememberedPlan {
  pipeline::Split split = pipeline::Split::kRows;
  int64_t pieces = 0;
  int64_t decision = -1;  // the Python planner's id of the decision (plans.last_decision)
};

// The plan remembered for `key`, if any (never while the memo is off); taking it makes it the op's latest decision.
std::optional<RememberedPlan> remembered_plan(const CallKey& key);
void remember_plan(const CallKey& key, const RememberedPlan& plan);

// Python's controls (fastmesh/ops/plans.py): forget every plan; turn the memo off (every call asks the planner:
// FASTMESH_SHAPE_CHECK=every, plans.override) or on; the id of the latest decision of an op (-1: none).
void forget_plans();
void set_plan_memo(bool enabled);
int64_t planned_decision(PlannedOp op);
void set_planned_decision(PlannedOp op, int64_t decision);

}  // namespace fused
}  // namespace fastmesh

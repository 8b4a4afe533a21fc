// The dispatcher's CPU and CUDA kernels of the planned fused ops. A call whose key was planned before runs its
// C++ schedule with the remembered plan (planned.h); the first call of a key goes to the Python planner, which
// checks the arguments, agrees the plan with the other ranks, runs the call and returns the plan to remember.
#include "kernels.h"

#include <ATen/core/Tensor.h>
#include <pybind11/stl.h>
#include <torch/library.h>
#include <torch/python.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fused_ops.h"
#include "planned.h"

namespace fastmesh {
namespace fused {
namespace {

using GatherResult = std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>>;
using ScaledGatherResult = std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::vector<at::Tensor>>;

// Leaked on purpose: a Python object must not be released after the interpreter is gone.
pybind11::object* planner = nullptr;

// What the Python planner is given for a schema's argument: strings and lists as Python builds them.
template <typename T>
const T& for_python(const T& value) {
  return value;
}
std::string for_python(c10::string_view text) { return std::string(text); }
std::vector<at::Tensor> for_python(at::TensorList tensors) { return tensors.vec(); }

// The first call of `key`: the Python planner runs it and says which plan to remember.
template <typename Result, typename... Args>
Result plan_in_python(const CallKey& key, const Args&... args) {
  pybind11::gil_scoped_acquire gil;
  TORCH_CHECK(planner != nullptr, "fastmesh::", planned_op_name(key.op()),
              ": no planner is registered (import fastmesh.ops before calling the op)");
  const pybind11::tuple answer = (*planner)(planned_op_name(key.op()), pybind11::make_tuple(for_python(args)...));
  const pybind11::object plan = answer[1];
  if (!plan.is_none()) {
    const auto [split, pieces, decision] = plan.cast<std::tuple<std::string, int64_t, int64_t>>();
    RememberedPlan remembered;
    TORCH_CHECK(pipeline::parse_split(split, &remembered.split), "fastmesh: the planner returned split ", split);
    remembered.pieces = pieces;
    remembered.decision = decision;
    remember_plan(key, remembered);
    set_planned_decision(key.op(), decision);
  }
  return answer[0].template cast<Result>();
}

// keep_gathered only says what autograd saves (csrc/fused/autograd.cpp): the same schedule and plan either way.
GatherResult all_gather_matmul_kernel(const at::Tensor& a_shard, at::TensorList bs, int64_t gather_dim,
                                      c10::string_view group_name, bool return_a, int64_t pieces,
                                      bool /*keep_gathered*/) {
  CallKey key(PlannedOp::kAllGatherMatmul, group_name, "fastmesh::all_gather_matmul");
  key.tensor(a_shard).tensors(bs).value(gather_dim).value(return_a).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a, plan->pieces,
                             pipeline::split_name(plan->split));
  }
  return plan_in_python<GatherResult>(key, a_shard, bs, gather_dim, group_name, return_a, pieces);
}

at::Tensor matmul_reduce_scatter_kernel(const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                                        c10::string_view reduce_op, c10::string_view group_name, int64_t pieces) {
  CallKey key(PlannedOp::kMatmulReduceScatter, group_name, "fastmesh::matmul_reduce_scatter");
  key.tensor(a).tensor(b).value(scatter_dim).text(reduce_op).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, plan->pieces,
                                 pipeline::split_name(plan->split));
  }
  return plan_in_python<at::Tensor>(key, a, b, scatter_dim, reduce_op, group_name, pieces);
}

at::Tensor matmul_all_reduce_kernel(const at::Tensor& a, const at::Tensor& b, c10::string_view reduce_op,
                                    c10::string_view group_name, int64_t pieces) {
  CallKey key(PlannedOp::kMatmulAllReduce, group_name, "fastmesh::matmul_all_reduce");
  key.tensor(a).tensor(b).text(reduce_op).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return matmul_all_reduce(a, b, reduce_op, group_name, plan->pieces, pipeline::split_name(plan->split));
  }
  return plan_in_python<at::Tensor>(key, a, b, reduce_op, group_name, pieces);
}

at::Tensor matmul_all_gather_kernel(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                    int64_t pieces) {
  CallKey key(PlannedOp::kMatmulAllGather, group_name, "fastmesh::matmul_all_gather");
  key.tensor(a).tensor(b).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return matmul_all_gather(a, b, group_name, plan->pieces, pipeline::split_name(plan->split));
  }
  return plan_in_python<at::Tensor>(key, a, b, group_name, pieces);
}

ScaledGatherResult all_gather_scaled_matmul_kernel(const at::Tensor& a_shard, const at::Tensor& a_scale,
                                                   at::TensorList bs, at::TensorList b_scales, int64_t gather_dim,
                                                   c10::string_view group_name, at::ScalarType out_dtype, bool return_a,
                                                   int64_t pieces) {
  CallKey key(PlannedOp::kAllGatherScaledMatmul, group_name, "fastmesh::all_gather_scaled_matmul");
  key.tensor(a_shard).tensor(a_scale).tensors(bs).tensors(b_scales).value(gather_dim);
  key.value(static_cast<int64_t>(out_dtype)).value(return_a).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return all_gather_scaled_matmul(a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype, return_a,
                                    plan->pieces, pipeline::split_name(plan->split));
  }
  return plan_in_python<ScaledGatherResult>(key, a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype,
                                            return_a, pieces);
}

at::Tensor scaled_matmul_reduce_scatter_kernel(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                               const at::Tensor& b_scale, int64_t scatter_dim,
                                               c10::string_view reduce_op, c10::string_view group_name,
                                               at::ScalarType out_dtype, int64_t pieces) {
  CallKey key(PlannedOp::kScaledMatmulReduceScatter, group_name, "fastmesh::scaled_matmul_reduce_scatter");
  key.tensor(a).tensor(a_scale).tensor(b).tensor(b_scale).value(scatter_dim).text(reduce_op);
  key.value(static_cast<int64_t>(out_dtype)).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return scaled_matmul_reduce_scatter(a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name, out_dtype,
                                        plan->pieces, pipeline::split_name(plan->split));
  }
  return plan_in_python<at::Tensor>(key, a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name, out_dtype, pieces);
}

at::Tensor scaled_matmul_all_reduce_kernel(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                           const at::Tensor& b_scale, c10::string_view reduce_op,
                                           c10::string_view group_name, at::ScalarType out_dtype, int64_t pieces) {
  CallKey key(PlannedOp::kScaledMatmulAllReduce, group_name, "fastmesh::scaled_matmul_all_reduce");
  key.tensor(a).tensor(a_scale).tensor(b).tensor(b_scale).text(reduce_op);
  key.value(static_cast<int64_t>(out_dtype)).value(pieces);
  if (const auto plan = remembered_plan(key)) {
    return scaled_matmul_all_reduce(a, a_scale, b, b_scale, reduce_op, group_name, out_dtype, plan->pieces,
                                    pipeline::split_name(plan->split));
  }
  return plan_in_python<at::Tensor>(key, a, a_scale, b, b_scale, reduce_op, group_name, out_dtype, pieces);
}

// This rank's block of t's columns. An op, not a slice: a slice would put the rank into a traced backward, and
// ranks that share inductor's caches (one machine) would load each other's compiled graphs.
at::Tensor rank_columns(const at::Tensor& t, c10::string_view group_name) {
  const Group group = resolve_group(group_name, "fastmesh::rank_columns");
  const int64_t n = t.size(-1) / group->getSize();
  return t.narrow(-1, group->getRank() * n, n).clone(at::MemoryFormat::Contiguous);
}

}  // namespace

void set_planner(pybind11::object planner_object) {
  pybind11::object* previous = planner;
  planner = new pybind11::object(std::move(planner_object));
  delete previous;
}

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) {
  m.impl("all_gather_matmul", all_gather_matmul_kernel);
  m.impl("matmul_reduce_scatter", matmul_reduce_scatter_kernel);
  m.impl("matmul_all_reduce", matmul_all_reduce_kernel);
  m.impl("matmul_all_gather", matmul_all_gather_kernel);
  m.impl("all_gather_scaled_matmul", all_gather_scaled_matmul_kernel);
  m.impl("scaled_matmul_reduce_scatter", scaled_matmul_reduce_scatter_kernel);
  m.impl("scaled_matmul_all_reduce", scaled_matmul_all_reduce_kernel);
}

TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) {
  m.impl("all_gather_matmul", all_gather_matmul_kernel);
  m.impl("matmul_reduce_scatter", matmul_reduce_scatter_kernel);
  m.impl("matmul_all_reduce", matmul_all_reduce_kernel);
  m.impl("matmul_all_gather", matmul_all_gather_kernel);
  m.impl("all_gather_scaled_matmul", all_gather_scaled_matmul_kernel);
  m.impl("scaled_matmul_reduce_scatter", scaled_matmul_reduce_scatter_kernel);
  m.impl("scaled_matmul_all_reduce", scaled_matmul_all_reduce_kernel);
}

TORCH_LIBRARY_IMPL(fastmesh, CompositeExplicitAutograd, m) { m.impl("rank_columns", rank_columns); }

}  // namespace fused
}  // namespace fastmesh

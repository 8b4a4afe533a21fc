// Autograd of the high-precision fused ops, in C++ so that a call pays no Python for it: the formulas of
// fastmesh/ops/fused_collectives.py, matmul_all_reduce.py and matmul_all_gather.py (their module docstrings). Each
// forward runs the op below autograd; each backward calls the fused ops (and torch's functional collectives where
// no matmul is left to fuse) through the dispatcher. The FP8 ops take quantized data and have no autograd: the
// Python fronts' fp8= option differentiates them.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "process_group.h"

namespace fastmesh {
namespace fused {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using GatherResult = std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// keep_gathered tells this file's autograd what to save. Below autograd the kernels ignore it; the op's unfused trace
// under torch.compile passes it on to the partitioner (fastmesh/ops/backward_gathers.py), so it is passed down.
GatherResult call_all_gather_matmul(const at::Tensor& a_shard, at::TensorList bs, int64_t gather_dim,
                                    c10::string_view group_name, bool return_a, int64_t pieces, bool keep_gathered) {
  static const auto op =
      typed_op<GatherResult(const at::Tensor&, at::TensorList, int64_t, c10::string_view, bool, int64_t, bool)>(
          "fastmesh::all_gather_matmul");
  return op.call(a_shard, bs, gather_dim, group_name, return_a, pieces, keep_gathered);
}

at::Tensor call_matmul_reduce_scatter(const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                                      c10::string_view reduce_op, c10::string_view group_name, int64_t pieces) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, c10::string_view, c10::string_view, int64_t)>(
          "fastmesh::matmul_reduce_scatter");
  return op.call(a, b, scatter_dim, reduce_op, group_name, pieces);
}

at::Tensor call_matmul_all_reduce(const at::Tensor& a, const at::Tensor& b, c10::string_view reduce_op,
                                  c10::string_view group_name, int64_t pieces) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, c10::string_view, int64_t)>(
          "fastmesh::matmul_all_reduce");
  return op.call(a, b, reduce_op, group_name, pieces);
}

at::Tensor call_matmul_all_gather(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                  int64_t pieces) {
  static const auto op = typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t)>(
      "fastmesh::matmul_all_gather");
  return op.call(a, b, group_name, pieces);
}

at::Tensor call_rank_columns(const at::Tensor& t, c10::string_view group_name) {
  static const auto op = typed_op<at::Tensor(const at::Tensor&, c10::string_view)>("fastmesh::rank_columns");
  return op.call(t, group_name);
}

// torch's functional collectives, called boxed: their schemas' C++ types differ across torch 2.11-2.14 (the group
// name is a str, then Any).
at::Tensor call_functional(const char* name, std::vector<c10::IValue> stack) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

at::Tensor wait(const at::Tensor& t) { return call_functional("_c10d_functional::wait_tensor", {t}); }

int64_t group_size(c10::string_view group_name, const char* op) { return resolve_group(group_name, op)->getSize(); }

// An all-gather in flight: torch's functional all-gather, which stacks the ranks' tensors along dim 0, started and
// not yet waited for, so that other work (a multiply, other collectives of the group) runs while it travels.
class PendingGather {
 public:
  PendingGather(const at::Tensor& t, int64_t dim, c10::string_view group_name, const char* op)
      : dim_(dim), world_(group_size(group_name, op)) {
    stacked_ =
        call_functional("_c10d_functional::all_gather_into_tensor", {t.contiguous(), world_, std::string(group_name)});
  }

  // Every rank's t concatenated along dim in rank order.
  at::Tensor gathered() const {
    const at::Tensor stacked = wait(stacked_);
    return dim_ == 0 ? stacked : at::cat(stacked.chunk(world_, 0), dim_);
  }

 private:
  int64_t dim_, world_;
  at::Tensor stacked_;
};

at::Tensor all_gather(const at::Tensor& t, int64_t dim, c10::string_view group_name, const char* op) {
  return PendingGather(t, dim, group_name, op).gathered();
}

// Block `rank` of t along `dim`, summed over the ranks (torch's functional reduce-scatter, which scatters dim 0).
at::Tensor reduce_scatter_sum(const at::Tensor& t, int64_t dim, c10::string_view group_name, const char* op) {
  const int64_t world = group_size(group_name, op);
  const at::Tensor stacked = dim == 0 ? t : at::cat(t.chunk(world, dim), 0);
  return wait(call_functional("_c10d_functional::reduce_scatter_tensor",
                              {stacked.contiguous(), std::string("sum"), world, std::string(group_name)}));
}

// t as a matrix, leading dims flattened; the row count computed (reshape(-1, 0) is ambiguous for an empty last dim).
// Symbolic sizes, not sizes(): under torch.compile a concrete size would specialize the traced graph to it.
at::Tensor as_matrix(const at::Tensor& t) {
  const c10::SymIntArrayRef sizes = t.sym_sizes();
  c10::SymInt rows = 1;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) rows = rows * sizes[i];
  return t.reshape_symint({rows, sizes.back()});
}

// The operands of the one matmul + reduce-scatter that gives the gathered input's gradient, for the defined output
// gradients `grads` ((G_i, i) pairs): [G_1 .. G_n] @ [b_1 .. b_n].T equals sum_i G_i @ b_i.T. The bs are
// concatenated in the layout they have (typically w.t() views of row-major weights): no transposing copy, and no
// transposes materialized into a cat, which inductor's CPU code gets wrong for 16-bit dtypes
// (docs/design/fused-collectives.md).
std::pair<at::Tensor, at::Tensor> input_grad_operands(const variable_list& bs,
                                                      const std::vector<std::pair<at::Tensor, size_t>>& grads) {
  if (grads.size() == 1) return {grads[0].first, bs[grads[0].second].t()};
  std::vector<at::Tensor> gs, chosen, chosen_t;
  bool transposes_contiguous = true;
  for (const auto& [g, i] : grads) {
    gs.push_back(g);
    chosen.push_back(bs[i]);
    chosen_t.push_back(bs[i].t());
    transposes_contiguous = transposes_contiguous && chosen_t.back().is_contiguous();
  }
  const at::Tensor b_t = transposes_contiguous ? at::cat(chosen_t, 0) : at::cat(chosen, 1).t();
  return {at::cat(gs, -1), b_t};
}

constexpr const char* kAllGatherMatmul = "fastmesh::all_gather_matmul";
constexpr const char* kMatmulReduceScatter = "fastmesh::matmul_reduce_scatter";

// all_gather_matmul: grad a_shard = matmul_reduce_scatter(cat(G_i, -1), cat(bs, 1).T, d); grad b_i = a.T @ G_i. A
// gradient of the returned a itself is added before one plain reduce-scatter (nothing is left to fuse a matmul into).
//
// What the bs' gradients keep (docs/design/fused-collectives.md, "Saved for backward"): this rank's shard, gathered
// again in backward, as Megatron-LM's sequence parallelism does; the gathered a (W times larger) only with
// keep_gathered. The second gather starts before the input gradient's fused multiply + reduce-scatter and travels
// during it; the weight gradients then are one multiply each on the whole gathered a, as with the gathered a kept,
// so both give bitwise the same gradients. (Gathering along the weight gradient's contraction instead, fused into
// its multiply, would split that contraction into W partial products: other sums, and W output-sized partials to
// add.)
class AllGatherMatmul : public torch::autograd::Function<AllGatherMatmul> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a_shard, at::TensorList bs, int64_t gather_dim,
                               c10::string_view group_name, bool return_a, int64_t pieces, bool keep_gathered) {
    bool bs_need_grad = false;
    for (const at::Tensor& b : bs) bs_need_grad = bs_need_grad || b.requires_grad();
    const bool keep = keep_gathered && bs_need_grad;
    GatherResult result;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      result = call_all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a || keep, pieces, keep);
    }
    auto& [a_full, outs] = result;
    // Unused outputs (typically the gathered a, returned only for this backward) get no gradient rather than
    // zeros: no dead reduce-scatter term.
    ctx->set_materialize_grads(false);
    ctx->saved_data["gather_dim"] = gather_dim % a_shard.dim();
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["pieces"] = pieces;
    ctx->saved_data["returned_a"] = return_a;
    ctx->saved_data["kept_gathered"] = keep;
    ctx->saved_data["bs_need_grad"] = bs_need_grad;
    variable_list saved{bs_need_grad ? (keep ? *a_full : a_shard) : at::Tensor()};
    if (a_shard.requires_grad()) saved.insert(saved.end(), bs.begin(), bs.end());
    ctx->save_for_backward(saved);
    // The gathered a first where it is returned (a custom Function's outputs must be defined tensors).
    variable_list out;
    if (return_a) out.push_back(*a_full);
    out.insert(out.end(), outs.begin(), outs.end());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& a_saved = saved[0];
    const variable_list bs(saved.begin() + 1, saved.end());
    const int64_t dim = ctx->saved_data["gather_dim"].toInt();
    const std::string group_name = ctx->saved_data["group_name"].toStringRef();
    const size_t first_out = ctx->saved_data["returned_a"].toBool() ? 1 : 0;
    const size_t num_bs = grad_outputs.size() - first_out;
    const at::Tensor grad_a_full = first_out ? grad_outputs[0] : at::Tensor();
    std::vector<std::pair<at::Tensor, size_t>> grads;
    for (size_t i = 0; i < num_bs; ++i) {
      if (grad_outputs[first_out + i].defined()) grads.emplace_back(grad_outputs[first_out + i], i);
    }
    variable_list result(1 + num_bs + 5);  // a_shard, each b, then the five non-tensor arguments
    const bool bs_grads = ctx->saved_data["bs_need_grad"].toBool() && !grads.empty();
    std::optional<PendingGather> regather;
    if (bs_grads && !ctx->saved_data["kept_gathered"].toBool()) {
      regather.emplace(a_saved.detach(), dim, group_name, kAllGatherMatmul);
    }
    if (ctx->needs_input_grad(0) && (!grads.empty() || grad_a_full.defined())) {
      if (grad_a_full.defined()) {
        at::Tensor total = grad_a_full;
        for (const auto& [g, i] : grads) total = total + at::matmul(g, bs[i].t());
        result[0] = reduce_scatter_sum(total, dim, group_name, kAllGatherMatmul);
      } else {
        const auto [grad_c, b_t] = input_grad_operands(bs, grads);
        result[0] = call_matmul_reduce_scatter(grad_c, b_t, dim, "sum", group_name, ctx->saved_data["pieces"].toInt());
      }
    }
    if (bs_grads) {
      const at::Tensor a_rows_t = as_matrix(regather ? regather->gathered() : a_saved).t();
      for (const auto& [g, i] : grads) result[1 + i] = at::mm(a_rows_t, as_matrix(g));
    }
    return result;
  }
};

// matmul_reduce_scatter: grad_c, [grad a] = all_gather_matmul(G (/W for avg), [b.T], d, return_a=need b);
// grad b = a.T @ grad_c.
class MatmulReduceScatter : public torch::autograd::Function<MatmulReduceScatter> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                               c10::string_view reduce_op, c10::string_view group_name, int64_t pieces) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = call_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, pieces);
    }
    ctx->saved_data["scatter_dim"] = scatter_dim % a.dim();
    ctx->saved_data["avg"] = reduce_op == "avg";
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["pieces"] = pieces;
    ctx->save_for_backward({b.requires_grad() ? a : at::Tensor(), a.requires_grad() ? b : at::Tensor()});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1];
    const bool need_a = ctx->needs_input_grad(0), need_b = ctx->needs_input_grad(1);
    const int64_t dim = ctx->saved_data["scatter_dim"].toInt();
    const std::string group_name = ctx->saved_data["group_name"].toStringRef();
    at::Tensor grad_out = grad_outputs[0];
    if (ctx->saved_data["avg"].toBool()) grad_out = grad_out / group_size(group_name, kMatmulReduceScatter);
    variable_list result(6);
    at::Tensor grad_c;
    if (need_a) {
      auto [gathered, outs] = call_all_gather_matmul(grad_out.contiguous(), {b.t()}, dim, group_name, need_b,
                                                     ctx->saved_data["pieces"].toInt(), false);
      result[0] = outs[0];
      if (gathered) grad_c = *gathered;
    } else if (need_b) {
      grad_c = all_gather(grad_out, dim, group_name, kMatmulReduceScatter);
    }
    if (need_b) result[1] = at::mm(as_matrix(a).t(), as_matrix(grad_c));
    return result;
  }
};

// The local gradients of a product whose result is replicated (its gradient is the same on every rank):
// grad a = G @ b.T, grad b = a.T @ G.
variable_list local_product_grads(AutogradContext* ctx, const at::Tensor& grad, size_t num_arguments) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor &a = saved[0], &b = saved[1];
  variable_list result(num_arguments);
  if (ctx->needs_input_grad(0)) result[0] = at::matmul(grad, b.t());
  if (ctx->needs_input_grad(1)) result[1] = at::mm(as_matrix(a).t(), as_matrix(grad));
  return result;
}

// matmul_all_reduce: the result is replicated, so its gradient is too: local gradients, no communication
// (avg: G / W).
class MatmulAllReduce : public torch::autograd::Function<MatmulAllReduce> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                               c10::string_view reduce_op, c10::string_view group_name, int64_t pieces) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = call_matmul_all_reduce(a, b, reduce_op, group_name, pieces);
    }
    ctx->saved_data["divisor"] = reduce_op == "avg" ? group_size(group_name, "fastmesh::matmul_all_reduce") : 1;
    ctx->save_for_backward({b.requires_grad() ? a : at::Tensor(), a.requires_grad() ? b : at::Tensor()});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const int64_t divisor = ctx->saved_data["divisor"].toInt();
    return local_product_grads(ctx, divisor == 1 ? grad_outputs[0] : grad_outputs[0] / divisor, 5);
  }
};

// matmul_all_gather: the result is replicated; each rank keeps its own column block G_r of its gradient (no
// communication): grad a = G_r @ b.T, grad b = a.T @ G_r.
class MatmulAllGather : public torch::autograd::Function<MatmulAllGather> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                               c10::string_view group_name, int64_t pieces) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = call_matmul_all_gather(a, b, group_name, pieces);
    }
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->save_for_backward({b.requires_grad() ? a : at::Tensor(), a.requires_grad() ? b : at::Tensor()});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor mine = call_rank_columns(grad_outputs[0], ctx->saved_data["group_name"].toStringRef());
    return local_product_grads(ctx, mine, 4);
  }
};

// Whether a call records a backward: a custom Function's node and context cost host time a call without gradients
// need not pay.
bool records_backward(const at::Tensor& a, at::TensorList bs = {}) {
  if (!at::GradMode::is_enabled()) return false;
  if (a.requires_grad()) return true;
  for (const at::Tensor& b : bs) {
    if (b.requires_grad()) return true;
  }
  return false;
}

GatherResult all_gather_matmul_autograd(const at::Tensor& a_shard, at::TensorList bs, int64_t gather_dim,
                                        c10::string_view group_name, bool return_a, int64_t pieces,
                                        bool keep_gathered) {
  if (!records_backward(a_shard, bs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a, pieces, keep_gathered);
  }
  variable_list out = AllGatherMatmul::apply(a_shard, bs, gather_dim, group_name, return_a, pieces, keep_gathered);
  if (!return_a) return {std::nullopt, out};
  return {out[0], variable_list(out.begin() + 1, out.end())};
}

at::Tensor matmul_reduce_scatter_autograd(const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                                          c10::string_view reduce_op, c10::string_view group_name, int64_t pieces) {
  if (!records_backward(a, {b})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, pieces);
  }
  return MatmulReduceScatter::apply(a, b, scatter_dim, reduce_op, group_name, pieces)[0];
}

at::Tensor matmul_all_reduce_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view reduce_op,
                                      c10::string_view group_name, int64_t pieces) {
  if (!records_backward(a, {b})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_matmul_all_reduce(a, b, reduce_op, group_name, pieces);
  }
  return MatmulAllReduce::apply(a, b, reduce_op, group_name, pieces)[0];
}

at::Tensor matmul_all_gather_autograd(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name,
                                      int64_t pieces) {
  if (!records_backward(a, {b})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_matmul_all_gather(a, b, group_name, pieces);
  }
  return MatmulAllGather::apply(a, b, group_name, pieces)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(fastmesh, Autograd, m) {
  m.impl("all_gather_matmul", all_gather_matmul_autograd);
  m.impl("matmul_reduce_scatter", matmul_reduce_scatter_autograd);
  m.impl("matmul_all_reduce", matmul_all_reduce_autograd);
  m.impl("matmul_all_gather", matmul_all_gather_autograd);
}

}  // namespace fused
}  // namespace fastmesh

// fastmesh::scaled_matmul: the scaled multiply of the FP8 fused ops (scaled.h), alone and local: what a
// column-parallel linear with a replicated input (plain TP) runs in FP8, where there is nothing to gather.
#include <ATen/ops/zeros.h>

#include <vector>

#include "blocks.h"
#include "fused_ops.h"
#include "scaled.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::scaled_matmul";

}  // namespace

at::Tensor scaled_matmul(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
                         at::ScalarType out_dtype) {
  const Scalings scalings = check_scaled_operands(a, a_scale, b, b_scale, out_dtype, kOp);
  std::vector<int64_t> out_sizes(a.sizes().begin(), a.sizes().end());
  out_sizes.back() = b.size(1);
  if (a.numel() == 0 || b.numel() == 0) return at::zeros(out_sizes, a.options().dtype(out_dtype));
  const ScaledB b_operand = prepare_b(b, b_scale, scalings, a.scalar_type(), out_dtype, b.size(1));
  return scaled_mm(rows_view(a.contiguous()), scale_rows(a_scale), b_operand, out_dtype).view(out_sizes);
}

}  // namespace fused
}  // namespace fastmesh

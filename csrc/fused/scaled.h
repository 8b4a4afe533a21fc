// FP8 operands of the scaled fused ops: argument checks and the scaled multiply both ops use.
//
// An FP8 operand is its data (float8_e4m3fn / float8_e5m2) and its dequantization scale (float32) in a
// layout torch._scaled_mm takes: tensor-wise (0-d) or row-wise (one per row of a: [..., 1]; one per
// column of b: [1, N]). Block-wise scales are not supported by _scaled_mm on every backend and are
// rejected here.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <string>
#include <utility>
#include <vector>

#include "fastmesh/checks.h"

namespace fastmesh {
namespace fused {

// The scale of `data`: float32 on data's device, 0-d or `rowwise_sizes`. Returns whether it is row-wise.
inline bool check_scale(const at::Tensor& scale, const at::Tensor& data, std::vector<int64_t> rowwise_sizes,
                        const char* op, const std::string& arg, const std::string& data_arg) {
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, op, ": ", arg, " must be float32, got ",
                   torch_dtype_name(scale.scalar_type()));
  TORCH_CHECK_VALUE(scale.device() == data.device(), op, ": ", arg, " must be on ", data_arg, "'s device ",
                    data.device(), ", got ", scale.device());
  const bool rowwise = scale.dim() > 0;
  TORCH_CHECK_VALUE(!rowwise || scale.sizes() == at::IntArrayRef(rowwise_sizes), op, ": ", arg,
                    " must be tensor-wise (shape []) or row-wise (shape ", at::IntArrayRef(rowwise_sizes),
                    "), got shape ", scale.sizes());
  return rowwise;
}

// Checked with the arguments, before any transfer starts: a multiply that fails half-way through a
// pipeline leaves the other ranks waiting for pieces that never come (until the group's timeout).
inline void check_scales_supported(bool rowwise, const at::Device& device, const char* op) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
  // Rather than _scaled_mm's internal assert.
  TORCH_CHECK_NOT_IMPLEMENTED(!rowwise || !device.is_cpu(), op,
                              ": row-wise FP8 scales on CPU need torch >= 2.13 "
                              "(torch ",
                              TORCH_VERSION, "'s CPU _scaled_mm takes tensor-wise scales only)");
#endif
}

inline void check_out_dtype(at::ScalarType out_dtype, const char* op) {
  TORCH_CHECK_TYPE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, op,
                   ": out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got ",
                   torch_dtype_name(out_dtype));
}

// An FP8 matrix b ([K, N]) that multiplies `a` (K = a's last dim): dtype, device, rows. `rows_of` names K in
// the message ("a's last dim").
inline void check_scaled_b(const at::Tensor& b, const at::Tensor& a, const char* op, const std::string& b_arg,
                           const char* a_arg, const char* rows_of) {
  check_tensor(b, op, b_arg, kFp8Dtypes, 2, 2);
  TORCH_CHECK_VALUE(b.device() == a.device(), op, ": ", b_arg, " must be on ", a_arg, "'s device ", a.device(),
                    ", got ", b.device());
  TORCH_CHECK_VALUE(b.size(0) == a.size(-1), op, ": ", b_arg, " must have ", a.size(-1), " rows (", rows_of,
                    "), got shape ", b.sizes());
}

// The scale of an FP8 `a` ([..., K]): tensor-wise or one per row ([..., 1]). Returns whether it is row-wise.
inline bool check_a_scale(const at::Tensor& a_scale, const at::Tensor& a, const char* op, const std::string& scale_arg,
                          const std::string& a_arg) {
  std::vector<int64_t> rowwise_sizes(a.sizes().begin(), a.sizes().end());
  rowwise_sizes.back() = 1;
  return check_scale(a_scale, a, std::move(rowwise_sizes), op, scale_arg, a_arg);
}

// The scale of an FP8 `b` ([K, N]): tensor-wise or one per column ([1, N]). Returns whether it is row-wise.
inline bool check_b_scale(const at::Tensor& b_scale, const at::Tensor& b, const char* op, const std::string& scale_arg,
                          const std::string& b_arg) {
  return check_scale(b_scale, b, {1, b.size(1)}, op, scale_arg, b_arg);
}

// Which scales of a scaled multiply are row-wise.
struct ScaleLayout {
  bool a_rowwise;
  bool b_rowwise;
};

// The FP8 operands of a scaled a @ b (a [..., K], b [K, N], each with its scale) and the product's out_dtype: the
// checks every scaled op of one a and one b makes, before any transfer starts.
inline ScaleLayout check_scaled_operands(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                         const at::Tensor& b_scale, at::ScalarType out_dtype, const char* op) {
  check_tensor(a, op, "a", kFp8Dtypes, 1);
  check_scaled_b(b, a, op, "b", "a", "a's last dim");
  const bool a_rowwise = check_a_scale(a_scale, a, op, "a_scale", "a");
  const bool b_rowwise = check_b_scale(b_scale, b, op, "b_scale", "b");
  check_scales_supported(a_rowwise || b_rowwise, a.device(), op);
  check_out_dtype(out_dtype, op);
  return {a_rowwise, b_rowwise};
}

// _scaled_mm wants 2-D scales with the standard strides. A size-1 dim may carry any stride (a reshape in a
// compiled graph gives 0) and contiguous() keeps it: such a tensor already counts as contiguous.
inline at::Tensor with_standard_strides(const at::Tensor& scale) {
  if (scale.stride(1) == 1 && scale.stride(0) == scale.size(1)) return scale;
  return scale.clone(at::MemoryFormat::Contiguous);
}

// (a_rows * a_scale) @ (b * b_scale) in `out_dtype`, through torch._scaled_mm, which wants both scales
// tensor-wise or both row-wise: a tensor-wise scale beside a row-wise one is expanded.
//
// On CPU, tensor-wise scales go the row-wise way too (expanded), where torch has it (>= 2.13): torch's CPU
// _scaled_mm hands tensor-wise FP8 to oneDNN, whose FP8 matmul on CPUs with AVX512-FP16 is its reference
// implementation (measured: 10 s for [2048, 2048] x [2048, 32], against 0.03 s row-wise), and applies scale_a before
// the products and scale_b after them, so that (a * scale_a) @ b can overflow where the result is finite
// (tests/test_hostile_values.py). Row-wise, it dequantizes both operands and multiplies in fp32. Where torch has
// no row-wise CPU form, both tensor-wise scales are applied after the products, as one product of the two.
inline at::Tensor scaled_mm(const at::Tensor& a_rows, const at::Tensor& a_scale, const at::Tensor& b,
                            const at::Tensor& b_scale, at::ScalarType out_dtype, at::Tensor* out = nullptr) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
  constexpr bool kRowwiseOnCpu = false;
#else
  constexpr bool kRowwiseOnCpu = true;
#endif
  const bool cpu = a_rows.device().is_cpu();
  const bool rowwise = a_scale.dim() > 0 || b_scale.dim() > 0 || (cpu && kRowwiseOnCpu);
  const bool scales_after = !rowwise && cpu;
  const at::Tensor sa = rowwise        ? with_standard_strides(a_scale.expand({a_rows.size(0), 1}))
                        : scales_after ? at::ones({}, a_scale.options())
                                       : a_scale;
  const at::Tensor sb = rowwise        ? with_standard_strides(b_scale.expand({1, b.size(1)}))
                        : scales_after ? a_scale.mul(b_scale)
                                       : b_scale;
  if (out) return at::_scaled_mm_out(*out, a_rows, b, sa, sb, std::nullopt, std::nullopt, out_dtype, false);
  return at::_scaled_mm(a_rows, b, sa, sb, std::nullopt, std::nullopt, out_dtype, false);
}

// The piece count of an FP8 op: `pieces` as given, except that the automatic count (0) on CPU is one piece per
// rank block: torch's CPU _scaled_mm converts all of b to float on every call, so every extra piece repeats
// that conversion (measured: docs/design/fp8.md).
inline int64_t scaled_pieces(int64_t pieces, const at::Device& device) {
  return pieces == 0 && device.is_cpu() ? 1 : pieces;
}

// The same into `block` ([B, rows, N], B * rows == a_rows' rows): written in place when it is one
// contiguous matrix, else through a temporary.
inline void scaled_mm_into(at::Tensor block, const at::Tensor& a_rows, const at::Tensor& a_scale, const at::Tensor& b,
                           const at::Tensor& b_scale) {
  at::Tensor matrix = block.size(0) == 1 ? block.select(0, 0) : at::Tensor();
  if (matrix.defined() && matrix.is_contiguous()) {
    scaled_mm(a_rows, a_scale, b, b_scale, block.scalar_type(), &matrix);
  } else {
    block.copy_(scaled_mm(a_rows, a_scale, b, b_scale, block.scalar_type()).view(block.sizes()));
  }
}

}  // namespace fused
}  // namespace fastmesh

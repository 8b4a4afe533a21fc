// FP8 operands of the scaled fused ops: argument checks and the scaled multiply every scaled op uses.
//
// An FP8 operand is its data (float8_e4m3fn / float8_e5m2) and its dequantization scale (x ~= data * scale) in
// one of these layouts, for a [..., K] (the first operand) and b [K, N] (the second):
//
//   layout       a's scale             b's scale                      scale dtype
//   tensor-wise  []                    []                             float32
//   row-wise     [..., 1]              [1, N] (one per column)        float32
//   MX           [..., K/32]           [K/32, N]                      float8_e8m0fnu (32 | K)
//   block        [..., ceil(K/128)]    [ceil(K/128), ceil(N/128)]     float32 (1x128 a, 128x128 b)
//
// Tensor-wise and row-wise operands multiply through torch._scaled_mm, and so do block-scaled ones where torch
// multiplies that form on the device (block_scaled_mm_runs: 1x128 a and 128x128 b on SM90). Otherwise an operand
// with block scales (MX or block) makes the multiply dequantize both operands to the product's dtype and multiply
// those: torch's CPU _scaled_mm takes no block scales, and its CUDA MX form (SM100) wants scales swizzled into
// 128x4 tiles, which is not wired here (docs/design/fp8.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <string>
#include <utility>
#include <vector>

#include "blocks.h"
#include "fastmesh/checks.h"
#include "fastmesh/mx_math.h"

#if FASTMESH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace fastmesh {
namespace fused {

enum class Scaling { kTensorwise, kRowwise, kMx, kBlock };

inline bool has_block_scales(Scaling s) { return s == Scaling::kMx || s == Scaling::kBlock; }

// Elements per block scale (float32) along a blocked dim; MX (E8M0) scales cover kMxBlock (mx_math.h).
constexpr int64_t kScaleBlock = 128;

inline int64_t scale_groups(int64_t size, int64_t block) { return (size + block - 1) / block; }

// The shapes a scale of one operand may have (tensor-wise is always []).
struct ScaleShapes {
  std::vector<int64_t> rowwise, mx, block;
};

// The scale of `data`: on data's device, one of `shapes` for its dtype. `k` is the operand's contraction dim
// (MX needs 32 | k).
inline Scaling check_scale(const at::Tensor& scale, const at::Tensor& data, const ScaleShapes& shapes, int64_t k,
                           const char* op, const std::string& arg, const std::string& data_arg) {
  const at::ScalarType dtype = scale.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kFloat8_e8m0fnu, op, ": ", arg,
                   " must be float32 (tensor-wise, row-wise or block scales) or float8_e8m0fnu (MX scales), got ",
                   torch_dtype_name(dtype));
  TORCH_CHECK_VALUE(scale.device() == data.device(), op, ": ", arg, " must be on ", data_arg, "'s device ",
                    data.device(), ", got ", scale.device());
  if (dtype == at::kFloat8_e8m0fnu) {
    TORCH_CHECK_VALUE(k % kMxBlock == 0, op, ": ", arg, " is an MX scale (float8_e8m0fnu): ", data_arg,
                      "'s contraction dim must be a multiple of ", kMxBlock, ", got ", k);
    TORCH_CHECK_VALUE(scale.sizes() == at::IntArrayRef(shapes.mx), op, ": ", arg, " must have shape ",
                      at::IntArrayRef(shapes.mx), " (MX: one scale per ", kMxBlock, " elements along K), got ",
                      scale.sizes());
    return Scaling::kMx;
  }
  if (scale.dim() == 0) return Scaling::kTensorwise;
  if (scale.sizes() == at::IntArrayRef(shapes.rowwise)) return Scaling::kRowwise;
  TORCH_CHECK_VALUE(scale.sizes() == at::IntArrayRef(shapes.block), op, ": ", arg,
                    " must be tensor-wise (shape []), row-wise (shape ", at::IntArrayRef(shapes.rowwise),
                    ") or block (shape ", at::IntArrayRef(shapes.block), "), got shape ", scale.sizes());
  return Scaling::kBlock;
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

// The scale of an FP8 `a` ([..., K]).
inline Scaling check_a_scale(const at::Tensor& a_scale, const at::Tensor& a, const char* op,
                             const std::string& scale_arg, const std::string& a_arg) {
  const int64_t k = a.size(-1);
  std::vector<int64_t> lead(a.sizes().begin(), a.sizes().end() - 1);
  ScaleShapes shapes{lead, lead, lead};
  shapes.rowwise.push_back(1);
  shapes.mx.push_back(k / kMxBlock);
  shapes.block.push_back(scale_groups(k, kScaleBlock));
  return check_scale(a_scale, a, shapes, k, op, scale_arg, a_arg);
}

// The scale of an FP8 `b` ([K, N]).
inline Scaling check_b_scale(const at::Tensor& b_scale, const at::Tensor& b, const char* op,
                             const std::string& scale_arg, const std::string& b_arg) {
  const int64_t k = b.size(0), n = b.size(1);
  const ScaleShapes shapes{{1, n}, {k / kMxBlock, n}, {scale_groups(k, kScaleBlock), scale_groups(n, kScaleBlock)}};
  return check_scale(b_scale, b, shapes, k, op, scale_arg, b_arg);
}

// The scales of a scaled multiply.
struct Scalings {
  Scaling a, b;
  // Whether a's scale follows its rows (row-wise or block scales: sliced with the rows).
  bool a_per_row() const { return a != Scaling::kTensorwise; }
  bool dequantizes() const { return has_block_scales(a) || has_block_scales(b); }
  bool needs_rowwise_scaled_mm() const { return !dequantizes() && (a == Scaling::kRowwise || b == Scaling::kRowwise); }
};

// The FP8 operands of a scaled a @ b (a [..., K], b [K, N], each with its scale) and the product's out_dtype: the
// checks every scaled op of one a and one b makes, before any transfer starts.
inline Scalings check_scaled_operands(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                      const at::Tensor& b_scale, at::ScalarType out_dtype, const char* op) {
  check_tensor(a, op, "a", kFp8Dtypes, 1);
  check_scaled_b(b, a, op, "b", "a", "a's last dim");
  const Scalings scalings{check_a_scale(a_scale, a, op, "a_scale", "a"), check_b_scale(b_scale, b, op, "b_scale", "b")};
  check_scales_supported(scalings.needs_rowwise_scaled_mm(), a.device(), op);
  check_out_dtype(out_dtype, op);
  return scalings;
}

// Whether torch._scaled_mm multiplies these block-scaled operands itself, rather than both being dequantized: the
// DeepSeek form (1x128 a, 128x128 b), which torch hands to cuBLAS (>= 12.9) on SM90 only. The conditions are
// cuBLAS's for that form, kept to what it documents: float8_e4m3fn data, a bfloat16 product, 16-byte aligned
// scale strides (b's column-major [K/128, N/128] scale: K a multiple of 512; a's column-major [M, K/128] scale: M a
// multiple of 4, which block_scaled_mm pads to), and b's column slices (`column_part` wide: N, or N / world when a
// reduce-scatter scatters the columns) covering whole 128-column blocks.
inline bool block_scaled_mm_runs(const Scalings& scalings, at::ScalarType a_dtype, const at::Tensor& b,
                                 at::ScalarType out_dtype, int64_t column_part) {
  if (scalings.a != Scaling::kBlock || scalings.b != Scaling::kBlock || !b.device().is_cuda()) return false;
#if FASTMESH_WITH_CUDA && defined(CUDART_VERSION) && CUDART_VERSION >= 12090
  return at::cuda::getDeviceProperties(b.device().index())->major == 9 && a_dtype == at::kFloat8_e4m3fn &&
         b.scalar_type() == at::kFloat8_e4m3fn && out_dtype == at::kBFloat16 && b.size(0) % (4 * kScaleBlock) == 0 &&
         column_part > 0 && column_part % kScaleBlock == 0;
#else
  return false;
#endif
}

// a's scale as a matrix beside a's rows ([rows, 1] or [rows, groups]); a tensor-wise scale as it is.
inline at::Tensor scale_rows(const at::Tensor& a_scale) {
  return a_scale.dim() == 0 ? a_scale : rows_view(a_scale.contiguous());
}

// data * scale in `dtype`, each scale element covering its block of the matrix `data` (a size-1 dim of the
// scale covers the whole dim). Exact in float32; MX scales are powers of two, so bfloat16 keeps them exact too
// (barring the format's range), while block float32 scales round once to `dtype`.
inline at::Tensor dequantize(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
  at::Tensor values = data.to(at::kFloat);
  at::Tensor s = scale.to(at::kFloat);
  if (s.dim() == 0) return values.mul_(s).to(dtype);
  const int64_t block = scale.scalar_type() == at::kFloat8_e8m0fnu ? kMxBlock : kScaleBlock;
  // Where the blocks tile a dim exactly, a blocked dim of `values` is split into (groups, block) and the scale
  // broadcast over the block: no expanded copy of the scale. A partial last block (block scales) expands it.
  std::vector<int64_t> value_sizes, scale_sizes;
  for (int64_t d = 0; d < 2; ++d) {
    const int64_t n = data.size(d), groups = s.size(d);
    if (groups == 1 || groups == n) {
      value_sizes.push_back(n);
      scale_sizes.push_back(groups);
    } else if (n == groups * block) {
      value_sizes.insert(value_sizes.end(), {groups, block});
      scale_sizes.insert(scale_sizes.end(), {groups, 1});
    } else {
      s = s.repeat_interleave(block, d).narrow(d, 0, n);
      value_sizes.push_back(n);
      scale_sizes.push_back(n);
    }
  }
  // Splitting a dim keeps any layout a view (b is column-major): `values` is dequantized in place.
  values.view(value_sizes).mul_(s.reshape(scale_sizes));
  return values.to(dtype);
}

// _scaled_mm wants 2-D scales with the standard strides. A size-1 dim may carry any stride (a reshape in a
// compiled graph gives 0) and contiguous() keeps it: such a tensor already counts as contiguous.
inline at::Tensor with_standard_strides(const at::Tensor& scale) {
  if (scale.stride(1) == 1 && scale.stride(0) == scale.size(1)) return scale;
  return scale.clone(at::MemoryFormat::Contiguous);
}

// b as the scaled multiply takes it: FP8 data with its tensor-wise or row-wise scale, for torch._scaled_mm; FP8
// data with its 128x128 scale column-major (`block`), for torch._scaled_mm's block form; or, when either operand
// has block scales that torch does not multiply, b dequantized to the product's dtype (scale undefined), once per
// op call rather than once per piece.
struct ScaledB {
  at::Tensor data, scale;
  bool block = false;

  bool dequantized() const { return !scale.defined(); }

  // Columns [first, first + count) of b (block: whole 128-column blocks, block_scaled_mm_runs' column_part).
  ScaledB columns(int64_t first, int64_t count) const {
    const at::Tensor part = data.narrow(1, first, count);
    if (dequantized() || scale.dim() == 0) return {part, scale};
    if (!block) return {part, scale.narrow(1, first, count)};
    TORCH_INTERNAL_ASSERT(first % kScaleBlock == 0 && count % kScaleBlock == 0);
    return {part, scale.narrow(1, first / kScaleBlock, count / kScaleBlock), true};
  }
};

// `a_dtype` and `column_part`: block_scaled_mm_runs'.
inline ScaledB prepare_b(const at::Tensor& b, const at::Tensor& b_scale, const Scalings& scalings,
                         at::ScalarType a_dtype, at::ScalarType out_dtype, int64_t column_part) {
  if (!scalings.dequantizes()) return {b, b_scale};
  if (block_scaled_mm_runs(scalings, a_dtype, b, out_dtype, column_part)) {
    // cuBLAS reads the 128x128 scale with the N blocks outermost: [K/128, N/128] column-major.
    return {b, b_scale.t().contiguous().t(), true};
  }
  return {dequantize(b, b_scale, out_dtype), at::Tensor()};
}

// a_rows ([M, K] FP8, 1x128 scales `a_scale` [M, K/128]) @ b (block) through torch._scaled_mm. cuBLAS reads a's
// scale with M innermost, its stride 16-byte aligned: column-major, M padded to a multiple of 4 (zero rows, whose
// products are dropped).
inline at::Tensor block_scaled_mm(const at::Tensor& a_rows, const at::Tensor& a_scale, const ScaledB& b,
                                  at::ScalarType out_dtype, at::Tensor* out) {
  const int64_t m = a_rows.size(0), padded = (m + 3) / 4 * 4;
  at::Tensor a = a_rows;
  at::Tensor scale_columns = at::empty({a_scale.size(1), padded}, a_scale.options());  // [K/128, M]
  scale_columns.narrow(1, 0, m).copy_(a_scale.t());
  if (padded != m) {
    a = at::zeros({padded, a_rows.size(1)}, a_rows.options());
    a.narrow(0, 0, m).copy_(a_rows);
    scale_columns.narrow(1, m, padded - m).fill_(1);
  }
  const at::Tensor sa = scale_columns.t();
  if (out && padded == m) {
    return at::_scaled_mm_out(*out, a, b.data, sa, b.scale, std::nullopt, std::nullopt, out_dtype, false);
  }
  const at::Tensor product =
      at::_scaled_mm(a, b.data, sa, b.scale, std::nullopt, std::nullopt, out_dtype, false).narrow(0, 0, m);
  return out ? out->copy_(product) : product;
}

// (a_rows * a_scale) @ (b * b_scale) in `out_dtype`. A dequantized b (block scales) is multiplied by a_rows
// dequantized the same way. Otherwise through torch._scaled_mm, which wants both scales tensor-wise or both
// row-wise: a tensor-wise scale beside a row-wise one is expanded.
//
// On CPU, tensor-wise scales go the row-wise way too (expanded), where torch has it (>= 2.13): torch's CPU
// _scaled_mm hands tensor-wise FP8 to oneDNN, whose FP8 matmul on CPUs with AVX512-FP16 is its reference
// implementation (measured: 10 s for [2048, 2048] x [2048, 32], against 0.03 s row-wise), and applies scale_a before
// the products and scale_b after them, so that (a * scale_a) @ b can overflow where the result is finite
// (tests/test_hostile_values.py). Row-wise, it dequantizes both operands and multiplies in fp32. Where torch has
// no row-wise CPU form, both tensor-wise scales are applied after the products, as one product of the two.
inline at::Tensor scaled_mm(const at::Tensor& a_rows, const at::Tensor& a_scale, const ScaledB& b,
                            at::ScalarType out_dtype, at::Tensor* out = nullptr) {
  if (b.dequantized()) {
    const at::Tensor a = dequantize(a_rows, a_scale, out_dtype);
    return out ? at::mm_out(*out, a, b.data) : at::mm(a, b.data);
  }
  if (b.block) return block_scaled_mm(a_rows, a_scale, b, out_dtype, out);
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
  constexpr bool kRowwiseOnCpu = false;
#else
  constexpr bool kRowwiseOnCpu = true;
#endif
  const at::Tensor& b_scale = b.scale;
  const bool cpu = a_rows.device().is_cpu();
  const bool rowwise = a_scale.dim() > 0 || b_scale.dim() > 0 || (cpu && kRowwiseOnCpu);
  const bool scales_after = !rowwise && cpu;
  const at::Tensor sa = rowwise        ? with_standard_strides(a_scale.expand({a_rows.size(0), 1}))
                        : scales_after ? at::ones({}, a_scale.options())
                                       : a_scale;
  const at::Tensor sb = rowwise        ? with_standard_strides(b_scale.expand({1, b.data.size(1)}))
                        : scales_after ? a_scale.mul(b_scale)
                                       : b_scale;
  if (out) return at::_scaled_mm_out(*out, a_rows, b.data, sa, sb, std::nullopt, std::nullopt, out_dtype, false);
  return at::_scaled_mm(a_rows, b.data, sa, sb, std::nullopt, std::nullopt, out_dtype, false);
}

// The piece count of an FP8 op: `pieces` as given, except that the automatic count (0) on CPU is one piece per
// rank block: torch's CPU _scaled_mm converts all of b to float on every call, so every extra piece repeats
// that conversion (measured: docs/design/fp8.md).
inline int64_t scaled_pieces(int64_t pieces, const at::Device& device) {
  return pieces == 0 && device.is_cpu() ? 1 : pieces;
}

// The same into `block` ([B, rows, N], B * rows == a_rows' rows): written in place when it is one
// contiguous matrix, else through a temporary.
inline void scaled_mm_into(at::Tensor block, const at::Tensor& a_rows, const at::Tensor& a_scale, const ScaledB& b) {
  at::Tensor matrix = block.size(0) == 1 ? block.select(0, 0) : at::Tensor();
  if (matrix.defined() && matrix.is_contiguous()) {
    scaled_mm(a_rows, a_scale, b, block.scalar_type(), &matrix);
  } else {
    block.copy_(scaled_mm(a_rows, a_scale, b, block.scalar_type()).view(block.sizes()));
  }
}

// A tensor's elements as raw bytes, flat: gloo has no float8 types (the data and E8M0 scales travel as bytes).
inline at::Tensor flat_bytes(const at::Tensor& t) { return t.view({-1}).view(at::kByte); }

}  // namespace fused
}  // namespace fastmesh

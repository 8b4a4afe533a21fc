// CPU kernel of fastmesh::mx_quantize_native: the MX cast (blocks of 32 along the last dim, E8M0 scales), with
// an optional column-wise cast (blocks of 32 along the rows) into data_t, equal bit for bit to
// kernels/mx_reference.py (NaN is written as 0x7F). The scale math is fastmesh/mx_math.h, shared with the CUDA
// kernel; the cast loops are the FP8 quantize's (cast_loops.h).
//
// One pass over stripes of 32 rows (x read as a row-major [m, k] matrix): each row's block maxima, then its cast,
// while the row is in L1; with transpose, then the stripe's column maxima (the stripe is still in L2) and the cast
// of each of its column tiles into a small buffer, written transposed.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cast_loops.h"
#include "fastmesh/fp8_checks.h"
#include "fastmesh/mx_math.h"
#include "magnitude.h"

namespace fastmesh {
namespace cpu {
namespace {

constexpr const char* kOp = "fastmesh::mx_quantize";
// Columns of the transposed cast per tile: a 32 x 256 byte buffer, written as 256 rows of 32 bytes.
constexpr int64_t kTileCols = 256;

struct MxOutputs {
  uint8_t* data;
  uint8_t* scale;              // biased E8M0 exponents, [m, k / 32]
  float* amax;                 // [m, k / 32]
  uint8_t* data_t = nullptr;   // [k, m]
  uint8_t* scale_t = nullptr;  // [k, m / 32]
};

template <MxRounding kRounding>
using RoundingTag = std::integral_constant<MxRounding, kRounding>;
using Floor = RoundingTag<MxRounding::kFloor>;
using Rceil = RoundingTag<MxRounding::kRceil>;

// scale[i] and q[i] of n blocks whose largest magnitudes are amax[i], in two loops: with q computed from the bits
// in the same loop, GCC threads mx_multiplier's tests of the bits back into mx_scale_bits' selects and the loop
// stays scalar under RCEIL (1.8 ns per block vs 0.6 vectorized, AVX-512). One cloned function per (format,
// rounding), so that the rounding is no runtime test either.
template <Fp8Format kFormat, MxRounding kRounding>
FASTMESH_ALWAYS_INLINE void block_scales_impl(const float* amax, int64_t n, uint8_t* __restrict scale,
                                              float* __restrict q) {
  for (int64_t i = 0; i < n; ++i) scale[i] = mx_scale_bits(amax[i], kFormat, kRounding);
  for (int64_t i = 0; i < n; ++i) q[i] = mx_multiplier(scale[i], kRounding);
}

#define FASTMESH_DEFINE_BLOCK_SCALES(FormatTag, RoundTag)                                                              \
  FASTMESH_CPU_CLONES void block_scales(const float* amax, int64_t n, uint8_t* scale, float* q, FormatTag, RoundTag) { \
    block_scales_impl<FormatTag::value, RoundTag::value>(amax, n, scale, q);                                           \
  }
FASTMESH_DEFINE_BLOCK_SCALES(E4M3, Floor)
FASTMESH_DEFINE_BLOCK_SCALES(E4M3, Rceil)
FASTMESH_DEFINE_BLOCK_SCALES(E5M2, Floor)
FASTMESH_DEFINE_BLOCK_SCALES(E5M2, Rceil)
#undef FASTMESH_DEFINE_BLOCK_SCALES

// amax[i], scale[i] and q[i] of n blocks whose largest magnitudes (as bits of the input's width) are `maxes`.
template <typename scalar_t, typename Tag>
void block_scales(const bits_t<scalar_t>* maxes, int64_t n, MxRounding rounding, float* amax, uint8_t* scale,
                  float* q) {
  write_amax<scalar_t>(maxes, n, amax);
  if (rounding == MxRounding::kFloor) {
    block_scales(amax, n, scale, q, Tag{}, Floor{});
  } else {
    block_scales(amax, n, scale, q, Tag{}, Rceil{});
  }
}

template <typename scalar_t, typename Tag>
void cast_stripe(Panel<const scalar_t> stripe, int64_t row0, int64_t m, MxRounding rounding, const MxOutputs& out,
                 std::vector<bits_t<scalar_t>>& maxes, std::vector<float>& q) {
  const int64_t k = stripe.cols, blocks = k / kMxBlock;
  // Rows, one at a time (its block maxima, then its cast, while the row is in L1): blocks of 32 along k.
  maxes.resize(std::max(blocks, k));
  q.resize(std::max(blocks, k));
  for (int64_t r = 0; r < stripe.rows; ++r) {
    const auto row = stripe.sub(r, 0, 1, k);
    const int64_t first = (row0 + r) * blocks;
    max_magnitude_blocks(as_bits(row), kMxBlock, maxes.data());
    block_scales<scalar_t, Tag>(maxes.data(), blocks, rounding, out.amax + first, out.scale + first, q.data());
    // The next row's reads overlap this row's cast (quantize_overlapped).
    const auto next = r + 1 < stripe.rows ? stripe.sub(r + 1, 0, 1, k) : stripe.sub(0, 0, 0, k);
    quantize_overlapped<scalar_t, Tag>(row, kMxBlock, q.data(), blocks,
                                       Panel<uint8_t>{out.data + (row0 + r) * k, 1, k, k}, next);
  }
  if (out.data_t == nullptr) return;

  // Columns: this stripe is one block of 32 rows for every column.
  maxes.assign(k, bits_t<scalar_t>{0});
  max_magnitude_columns(as_bits(stripe), maxes.data());
  const int64_t block = row0 / kMxBlock, blocks_t = m / kMxBlock;
  std::vector<float> amax_t(k);  // what the op does not return: the columns' amax
  std::vector<uint8_t> scale_t(k);
  block_scales<scalar_t, Tag>(maxes.data(), k, rounding, amax_t.data(), scale_t.data(), q.data());
  for (int64_t c = 0; c < k; ++c) out.scale_t[c * blocks_t + block] = scale_t[c];
  uint8_t tile[kMxBlock * kTileCols];
  for (int64_t c0 = 0; c0 < k; c0 += kTileCols) {
    const int64_t cols = std::min(kTileCols, k - c0);
    quantize_columns(stripe.sub(0, c0, kMxBlock, cols), q.data() + c0, Panel<uint8_t>{tile, kMxBlock, cols, cols},
                     Tag{});
    for (int64_t c = 0; c < cols; ++c) {
      uint8_t* row_t = out.data_t + (c0 + c) * m + row0;
      for (int64_t r = 0; r < kMxBlock; ++r) row_t[r] = tile[r * cols + c];
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> mx_quantize_cpu(
    const at::Tensor& x, at::ScalarType dtype, c10::string_view rounding, bool transpose) {
  const MxCall call = check_mx_args(x, dtype, rounding, transpose, kOp);
  const Rows rows = call.rows;
  const auto float_options = x.options().dtype(at::kFloat);
  std::vector<int64_t> scale_sizes(x.sizes().begin(), x.sizes().end());
  scale_sizes.back() /= kMxBlock;
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor scale = at::empty(scale_sizes, x.options().dtype(at::kFloat8_e8m0fnu));
  at::Tensor amax = at::empty(scale_sizes, float_options);  // every block's is written
  std::optional<at::Tensor> data_t, scale_t;
  if (transpose) {
    data_t = at::empty({rows.k, rows.m}, x.options().dtype(dtype));
    scale_t = at::empty({rows.k, rows.m / kMxBlock}, x.options().dtype(at::kFloat8_e8m0fnu));
  }
  if (x.numel() == 0) return {data, scale, amax, data_t, scale_t};

  MxOutputs out{static_cast<uint8_t*>(data.mutable_data_ptr()), static_cast<uint8_t*>(scale.mutable_data_ptr()),
                amax.mutable_data_ptr<float>()};
  if (transpose) {
    out.data_t = static_cast<uint8_t*>(data_t->mutable_data_ptr());
    out.scale_t = static_cast<uint8_t*>(scale_t->mutable_data_ptr());
  }
  dispatch_float_input(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const Panel<const scalar_t> matrix = matrix_panel(x.const_data_ptr<scalar_t>(), rows);
    const int64_t stripes = ceil_div(rows.m, kMxBlock);
    const int64_t grain = std::max<int64_t>(1, kGrainSize / (kMxBlock * rows.k));
    at::parallel_for(0, stripes, grain, [&](int64_t begin, int64_t end) {
      std::vector<bits_t<scalar_t>> maxes;
      std::vector<float> q;
      for (int64_t s = begin; s < end; ++s) {
        const int64_t row0 = s * kMxBlock;
        const auto stripe = matrix.sub(row0, 0, std::min(kMxBlock, rows.m - row0), rows.k);
        if (call.format == Fp8Format::kE4M3FN) {
          cast_stripe<scalar_t, E4M3>(stripe, row0, rows.m, call.rounding, out, maxes, q);
        } else {
          cast_stripe<scalar_t, E5M2>(stripe, row0, rows.m, call.rounding, out, maxes, q);
        }
      }
    });
  });
  return {data, scale, amax, data_t, scale_t};
}

}  // namespace
}  // namespace cpu
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) { m.impl("mx_quantize_native", &fastmesh::cpu::mx_quantize_cpu); }

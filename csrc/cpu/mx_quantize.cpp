// CPU kernel of fastmesh::mx_quantize_native: the MX cast (blocks of 32 along the last dim, E8M0 scales), with
// an optional column-wise cast (blocks of 32 along the rows) into data_t, equal bit for bit to
// kernels/mx_reference.py (NaN is written as 0x7F). The scale math is fastmesh/mx_math.h, shared with the CUDA
// kernel; the cast loops are the FP8 quantize's (cast_loops.h).
//
// Without transpose: one pass over x in chunks of 4 KB (the blocks are runs of 32 consecutive elements), each
// chunk's block maxima, then its cast, while the chunk is in L1. With transpose: one pass over regions of 128
// rows x 1024 columns (in L2), as the FP8 cast's transposed pass (fp8_quantize.cpp): the rows' blocks and cast,
// then each column's four 32-row blocks and their cast into 128 x 128 tiles, written transposed, so that every
// row of data_t gets 128 contiguous bytes at a time rather than 32-byte pieces a page apart (measured:
// docs/fp8.md).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
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
// A region of the transposed pass: 4 MX blocks of rows by 8 tiles of columns.
constexpr int64_t kRegionRows = 4 * kMxBlock;
constexpr int64_t kTileCols = kFp8Block;
constexpr int64_t kRegionCols = 8 * kTileCols;
static_assert(kRegionRows <= kFp8Block, "transpose_tile takes at most kFp8Block rows");

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

// Bytes of x per chunk of the pass without transpose, in L1 from the block maxima to the cast. Measured on x of
// [2048, 8192], one thread (AMD EPYC VM): 4 KB beat 2 and 8 KB for fp32 by 5-15%; 2 KB of bf16 cost 15% in cache.
constexpr int64_t kChunkBytes = 4096;

// Without transpose the blocks are runs of 32 consecutive elements of x (k is a multiple of 32), so the pass is
// flat: chunk by chunk, the blocks' maxima, their scales, then the cast while the chunk is in L1. x is read once,
// in order, so the hardware prefetchers keep the reads ahead of the cast; prefetching the next chunk in software
// (quantize_overlapped) made it slower (docs/fp8.md).
template <typename scalar_t, typename Tag>
void cast_chunks(const scalar_t* x, int64_t blocks, MxRounding rounding, const MxOutputs& out) {
  constexpr int64_t kChunkBlocks = kChunkBytes / (kMxBlock * static_cast<int64_t>(sizeof(scalar_t)));
  at::parallel_for(0, ceil_div(blocks, kChunkBlocks), std::max<int64_t>(1, kGrainSize / (kChunkBlocks * kMxBlock)),
                   [&](int64_t begin, int64_t end) {
                     bits_t<scalar_t> maxes[kChunkBlocks];
                     float q[kChunkBlocks];
                     for (int64_t c = begin; c < end; ++c) {
                       const int64_t first = c * kChunkBlocks, n = std::min(kChunkBlocks, blocks - first);
                       const Panel<const scalar_t> chunk{x + first * kMxBlock, 1, n * kMxBlock, n * kMxBlock};
                       max_magnitude_blocks(as_bits(chunk), kMxBlock, maxes);
                       block_scales<scalar_t, Tag>(maxes, n, rounding, out.amax + first, out.scale + first, q);
                       quantize_panel(chunk, kMxBlock, q, n,
                                      Panel<uint8_t>{out.data + first * kMxBlock, 1, chunk.cols, chunk.cols}, Tag{});
                     }
                   });
}

template <typename scalar_t>
struct RegionScratch {
  bits_t<scalar_t> maxes[kRegionRows * kRegionCols / kMxBlock];  // per row and block, then per column
  float q[kRegionRows * kRegionCols / kMxBlock];                 // data: per row and block
  float amax_cols[kRegionCols];                                  // what the op does not return: columns' amax
  uint8_t scale_cols[kRegionCols];
  float q_cols[kRegionRows / kMxBlock][kRegionCols];    // data_t: per 32-row block and column
  alignas(64) uint8_t staged[kRegionRows * kTileCols];  // a tile cast with q_cols, before its transposition
};

// The region of x at rows [row0, row0 + rows) (a multiple of 32 rows: transpose needs 32 | m) and columns
// [col0, col0 + cols) of an [m, k] x.
template <typename scalar_t, typename Tag>
void cast_region(Panel<const scalar_t> region, int64_t row0, int64_t col0, int64_t m, int64_t k, MxRounding rounding,
                 const MxOutputs& out, RegionScratch<scalar_t>& scratch, Panel<const scalar_t> next) {
  const int64_t rows = region.rows, cols = region.cols, blocks = cols / kMxBlock, row_blocks = k / kMxBlock;
  // Rows: blocks of 32 along k.
  max_magnitude_blocks(as_bits(region), kMxBlock, scratch.maxes);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = (row0 + r) * row_blocks + col0 / kMxBlock;
    block_scales<scalar_t, Tag>(scratch.maxes + r * blocks, blocks, rounding, out.amax + first, out.scale + first,
                                scratch.q + r * blocks);
  }
  quantize_overlapped<scalar_t, Tag>(region, kMxBlock, scratch.q, blocks,
                                     Panel<uint8_t>{out.data + row0 * k + col0, rows, cols, k}, next);

  // Columns: the region holds `rows / 32` blocks of every column.
  const int64_t blocks_t = m / kMxBlock;
  for (int64_t b = 0; b < rows / kMxBlock; ++b) {
    std::fill_n(scratch.maxes, cols, bits_t<scalar_t>{0});
    max_magnitude_columns(as_bits(region.sub(b * kMxBlock, 0, kMxBlock, cols)), scratch.maxes);
    block_scales<scalar_t, Tag>(scratch.maxes, cols, rounding, scratch.amax_cols, scratch.scale_cols,
                                scratch.q_cols[b]);
    uint8_t* scale_t = out.scale_t + col0 * blocks_t + row0 / kMxBlock + b;
    for (int64_t c = 0; c < cols; ++c) scale_t[c * blocks_t] = scratch.scale_cols[c];
  }
  for (int64_t tile_col = 0; tile_col < cols; tile_col += kTileCols) {
    const int64_t tile_cols = std::min(kTileCols, cols - tile_col);
    for (int64_t b = 0; b < rows / kMxBlock; ++b) {
      quantize_mx_columns(region.sub(b * kMxBlock, tile_col, kMxBlock, tile_cols), scratch.q_cols[b] + tile_col,
                          Panel<uint8_t>{scratch.staged + b * kMxBlock * kTileCols, kMxBlock, tile_cols, kTileCols},
                          Tag{});
    }
    transpose_tile(Panel<const uint8_t>{scratch.staged, rows, tile_cols, kTileCols},
                   out.data_t + (col0 + tile_col) * m + row0, m);
  }
}

template <typename scalar_t, typename Tag>
void cast_regions(Panel<const scalar_t> matrix, MxRounding rounding, const MxOutputs& out) {
  const int64_t m = matrix.rows, k = matrix.cols;
  const int64_t per_stripe = ceil_div(k, kRegionCols), regions = ceil_div(m, kRegionRows) * per_stripe;
  const auto region_at = [&](int64_t i) {
    const int64_t row0 = i / per_stripe * kRegionRows, col0 = i % per_stripe * kRegionCols;
    return matrix.sub(row0, col0, std::min(kRegionRows, m - row0), std::min(kRegionCols, k - col0));
  };
  at::parallel_for(0, regions, 1, [&](int64_t begin, int64_t end) {
    auto scratch = std::make_unique<RegionScratch<scalar_t>>();
    for (int64_t i = begin; i < end; ++i) {
      const auto next = i + 1 < regions ? region_at(i + 1) : matrix.sub(0, 0, 0, 0);
      cast_region<scalar_t, Tag>(region_at(i), i / per_stripe * kRegionRows, i % per_stripe * kRegionCols, m, k,
                                 rounding, out, *scratch, next);
    }
    finish_row_stores();
  });
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
    const auto cast = [&](auto format) {
      using Tag = decltype(format);
      if (transpose) {
        cast_regions<scalar_t, Tag>(matrix, call.rounding, out);
      } else {
        cast_chunks<scalar_t, Tag>(matrix.data, rows.m * rows.k / kMxBlock, call.rounding, out);
      }
    };
    if (call.format == Fp8Format::kE4M3FN) {
      cast(E4M3{});
    } else {
      cast(E5M2{});
    }
  });
  return {data, scale, amax, data_t, scale_t};
}

// The CPU kernel of fastmesh::mx_quantize, the triton_op users call (fastmesh/ops/mx_quantize.py), as
// fp8_quantize_op_cpu (cpu/fp8_quantize.cpp) is fastmesh::fp8_quantize's: no Python on a CPU call.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mx_quantize_op_cpu(const at::Tensor& x,
                                                                                          at::ScalarType dtype,
                                                                                          c10::string_view rounding,
                                                                                          bool transpose) {
  auto [data, scale, amax, data_t, scale_t] = mx_quantize_cpu(x.contiguous(), dtype, rounding, transpose);
  if (!transpose) {
    data_t = at::empty({0}, x.options().dtype(dtype));
    scale_t = at::empty({0}, x.options().dtype(at::kFloat8_e8m0fnu));
  }
  return {data, scale, amax, *data_t, *scale_t};
}

}  // namespace
}  // namespace cpu
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) {
  m.impl("mx_quantize_native", &fastmesh::cpu::mx_quantize_cpu);
  m.impl("mx_quantize", &fastmesh::cpu::mx_quantize_op_cpu);
}

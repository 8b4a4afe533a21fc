// The FP8 cast loops of the CPU kernels (defined in fp8_quantize.cpp, compiled per ISA), shared by
// fastmesh::fp8_quantize_native and fastmesh::mx_quantize_native.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fastmesh/fp8_math.h"
#include "magnitude.h"

namespace fastmesh {
namespace cpu {

template <Fp8Format kFormat>
using FormatTag = std::integral_constant<Fp8Format, kFormat>;
using E4M3 = FormatTag<Fp8Format::kE4M3FN>;
using E5M2 = FormatTag<Fp8Format::kE5M2>;

// quantize_panel: out[r, c] = fp8(x[r, c] * q[r * q_stride + c / block]).
// quantize_columns: out[r, c] = fp8(x[r, c] * q[c]).
// quantize_mx_columns: the same for MX multipliers q and at most kFp8Block columns; returns how many columns went
// through the fp32 loop (bf16: those its 16-bit lanes leave to it; other inputs: all).
#define FASTMESH_DECLARE_QUANTIZE_LOOPS(scalar_t, Tag)                                                              \
  void quantize_panel(Panel<const scalar_t> x, int64_t block, const float* q, int64_t q_stride, Panel<uint8_t> out, \
                      Tag);                                                                                         \
  void quantize_columns(Panel<const scalar_t> x, const float* q, Panel<uint8_t> out, Tag);                          \
  int64_t quantize_mx_columns(Panel<const scalar_t> x, const float* q, Panel<uint8_t> out, Tag);
FASTMESH_DECLARE_QUANTIZE_LOOPS(float, E4M3)
FASTMESH_DECLARE_QUANTIZE_LOOPS(float, E5M2)
FASTMESH_DECLARE_QUANTIZE_LOOPS(c10::BFloat16, E4M3)
FASTMESH_DECLARE_QUANTIZE_LOOPS(c10::BFloat16, E5M2)
FASTMESH_DECLARE_QUANTIZE_LOOPS(c10::Half, E4M3)
FASTMESH_DECLARE_QUANTIZE_LOOPS(c10::Half, E5M2)
#undef FASTMESH_DECLARE_QUANTIZE_LOOPS

// The bf16 MX lanes of quantize_panel on their own, for tests (fastmesh._C.mx_bf16_lanes): out[i] =
// fp8(x[i] * q[i / 32]) for n blocks of bf16 bits, or false where the lanes leave the blocks to the fp32 loop.
bool quantize_mx_bf16_lanes(const uint16_t* x, const float* q, int64_t n, uint8_t* out, E4M3);
bool quantize_mx_bf16_lanes(const uint16_t* x, const float* q, int64_t n, uint8_t* out, E5M2);

// dst[c * dst_ld + r] = src[r, c] for a tile of at most kFp8Block x kFp8Block bytes, every row of dst written
// with non-temporal stores where aligned; a thread that wrote any fences with finish_row_stores() when it is done.
void transpose_tile(Panel<const uint8_t> src, uint8_t* dst, int64_t dst_ld);
void finish_row_stores();

// Elements cast between two rounds of prefetching (see quantize_overlapped); a multiple of kFp8Block (and so of
// kMxBlock).
constexpr int64_t kSliceElements = 1024;
constexpr int64_t kCacheLine = 64;

template <typename T>
void prefetch_panel(Panel<const T> x) {
  for (int64_t r = 0; r < x.rows; ++r) {
    const char* begin = reinterpret_cast<const char*>(x.row(r));
    const char* end = begin + x.cols * static_cast<int64_t>(sizeof(T));
    for (const char* line = begin; line < end; line += kCacheLine) __builtin_prefetch(line);
  }
}

// quantize_panel(x, ...) slice by slice, each slice preceded by a prefetch of the same slice of `next`
// (clipped to its extent), the panel whose amax the caller computes next. The amax of a group must be
// known before its cast, so a pass alternates a memory-bound amax with a compute-bound cast; the
// hardware prefetchers stop when the reads stop, so without this the next panel's memory reads would
// not overlap the current cast. Slices start at multiples of kSliceElements columns, which `block` and
// q's layout must allow (block a multiple of it or not smaller than x.cols).
template <typename scalar_t, typename Tag>
void quantize_overlapped(Panel<const scalar_t> x, int64_t block, const float* q, int64_t q_stride, Panel<uint8_t> out,
                         Panel<const scalar_t> next) {
  const int64_t slice_cols = std::min(x.cols, kSliceElements);
  const int64_t slice_rows = std::max<int64_t>(1, kSliceElements / x.cols);
  for (int64_t r = 0; r < x.rows; r += slice_rows) {
    const int64_t rows = std::min(slice_rows, x.rows - r);
    for (int64_t c = 0; c < x.cols; c += slice_cols) {
      const int64_t cols = std::min(slice_cols, x.cols - c);
      if (r < next.rows && c < next.cols) {
        prefetch_panel(next.sub(r, c, std::min(rows, next.rows - r), std::min(cols, next.cols - c)));
      }
      quantize_panel(x.sub(r, c, rows, cols), block, q + r * q_stride + c / block, q_stride, out.sub(r, c, rows, cols),
                     Tag{});
    }
  }
}

}  // namespace cpu
}  // namespace fastmesh

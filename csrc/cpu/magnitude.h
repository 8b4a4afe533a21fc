// CPU building blocks shared by fastmesh::amax and fastmesh::fp8_quantize_native: row-major panels,
// the raw-bits magnitude reductions (defined in amax.cpp), the per-group amax built on them, and the
// input checks and dtype dispatch both ops use.
//
// The reductions work on the input's own bits (see fastmesh/amax_math.h): integer-only loops that
// compilers vectorize, with NaN winning and inf propagating exactly as in torch.amax(x.abs()).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fastmesh/bits.h"
#include "fastmesh/fp8_layout.h"

// target_clones compiles a function for AVX-512, AVX2 and baseline x86-64 and picks one when the
// library loads, from the CPU it runs on. Not every compiler clones templates, so it goes on plain
// functions (overloads per type) that inline the templated loop bodies. A build may define it (e.g.
// empty, for baseline code only) to test one of the variants on a machine that would pick another.
#ifndef FASTMESH_CPU_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTMESH_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTMESH_CPU_CLONES
#endif
#endif

// For the small helpers of the cloned loops: inlined into each clone, so compiled for its ISA.
#if defined(__GNUC__)
#define FASTMESH_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FASTMESH_ALWAYS_INLINE inline
#endif

namespace fastmesh {
namespace cpu {

// Elements per parallel task: large enough that a task outweighs at::parallel_for's scheduling cost.
constexpr int64_t kGrainSize = 1 << 16;

// `rows` x `cols` elements, row r starting at data + r * ld.
template <typename T>
struct Panel {
  T* data;
  int64_t rows;
  int64_t cols;
  int64_t ld;

  T* row(int64_t r) const { return data + r * ld; }
  Panel sub(int64_t row0, int64_t col0, int64_t num_rows, int64_t num_cols) const {
    return {row(row0) + col0, num_rows, num_cols, ld};
  }
};

template <typename T>
Panel<const T> read_only(Panel<T> x) {
  return {x.data, x.rows, x.cols, x.ld};
}

template <typename T>
Panel<const T> matrix_panel(const T* data, Rows rows) {
  return {data, rows.m, rows.k, rows.k};
}

// out[r * ceil(cols / block) + b] = the largest magnitude (as bits) in row r over columns
// [b * block, min((b + 1) * block, cols)).
void max_magnitude_blocks(Panel<const uint16_t> x, int64_t block, uint16_t* out);
void max_magnitude_blocks(Panel<const uint32_t> x, int64_t block, uint32_t* out);

// acc[c] = max(acc[c], the largest magnitude (as bits) in column c).
void max_magnitude_columns(Panel<const uint16_t> x, uint16_t* acc);
void max_magnitude_columns(Panel<const uint32_t> x, uint32_t* acc);

// Calls fn(scalar_t{}) for the input dtypes the kernels read (fp32, bf16, fp16).
template <typename Fn>
void dispatch_float_input(at::ScalarType dtype, Fn&& fn) {
  AT_DISPATCH_SWITCH(dtype, "fastmesh_cpu",
                     AT_DISPATCH_CASE(at::kFloat, [&] { fn(scalar_t{}); }) AT_DISPATCH_CASE(
                         at::kBFloat16, [&] { fn(scalar_t{}); }) AT_DISPATCH_CASE(at::kHalf, [&] { fn(scalar_t{}); }));
}

template <typename scalar_t>
using bits_t = typename BitsOf<scalar_t>::type;

template <typename scalar_t>
Panel<const bits_t<scalar_t>> as_bits(Panel<const scalar_t> x) {
  return {reinterpret_cast<const bits_t<scalar_t>*>(x.data), x.rows, x.cols, x.ld};
}

template <typename scalar_t>
float to_float(bits_t<scalar_t> bits) {
  return BitsOf<scalar_t>::to_float(bits);
}

template <typename scalar_t>
void write_amax(const bits_t<scalar_t>* bits, int64_t n, float* amax) {
  for (int64_t i = 0; i < n; ++i) amax[i] = to_float<scalar_t>(bits[i]);
}

// max |x| over a whole [m, k] matrix, split over threads.
template <typename scalar_t>
float tensor_amax(Panel<const scalar_t> x) {
  using bits = bits_t<scalar_t>;
  const int64_t numel = x.rows * x.cols;
  const Panel<const scalar_t> flat{x.data, 1, numel, numel};
  const bits result = at::parallel_reduce(
      0, numel, kGrainSize, bits{0},
      [&](int64_t begin, int64_t end, bits acc) {
        bits range_max;
        max_magnitude_blocks(as_bits(flat.sub(0, begin, 1, end - begin)), end - begin, &range_max);
        return max_bits(acc, range_max);
      },
      [](bits a, bits b) { return max_bits(a, b); });
  return to_float<scalar_t>(result);
}

// The largest magnitude (as bits) of each 128-column tile of a stripe of rows: column maxima first
// (rows read in order, no horizontal reduction per row), then 128-wide maxima of those. `columns` is
// scratch for x.cols values.
template <typename Bits>
void tile_max_bits(Panel<const Bits> x, Bits* columns, Bits* tiles) {
  std::fill_n(columns, x.cols, Bits{0});
  max_magnitude_columns(x, columns);
  max_magnitude_blocks(Panel<const Bits>{columns, 1, x.cols, x.cols}, kFp8Block, tiles);
}

// Per-group amax of a non-empty x ([m, k]) in the scale layout of `granularity`: the reference's
// group_amax. (An empty x has only empty groups, whose amax is 0.)
template <typename scalar_t>
void group_amax(Panel<const scalar_t> x, Granularity granularity, float* out) {
  using bits = bits_t<scalar_t>;
  const Rows rows{x.rows, x.cols};
  const Rows grid = group_grid(granularity, rows);
  if (granularity == Granularity::kTensorwise) {
    out[0] = tensor_amax(x);
    return;
  }
  const int64_t block = group_extent(granularity, rows).k;
  if (granularity != Granularity::kBlock128x128) {
    // Rows are independent groups of 1 x block elements.
    at::parallel_for(0, x.rows, std::max<int64_t>(1, kGrainSize / x.cols), [&](int64_t begin, int64_t end) {
      std::vector<bits> maxes((end - begin) * grid.k);
      max_magnitude_blocks(as_bits(x.sub(begin, 0, end - begin, x.cols)), block, maxes.data());
      write_amax<scalar_t>(maxes.data(), maxes.size(), out + begin * grid.k);
    });
    return;
  }
  // 128 x 128 tiles; a task covers a stripe and a few tiles so that every thread has work.
  constexpr int64_t kTilesPerTask = 8;
  const int64_t tasks_per_stripe = ceil_div(grid.k, kTilesPerTask);
  at::parallel_for(0, grid.m * tasks_per_stripe, 1, [&](int64_t begin, int64_t end) {
    std::vector<bits> columns(kTilesPerTask * kFp8Block);
    std::vector<bits> tiles(kTilesPerTask);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t stripe = task / tasks_per_stripe, tile0 = task % tasks_per_stripe * kTilesPerTask;
      const int64_t row0 = stripe * kFp8Block, col0 = tile0 * kFp8Block;
      const auto panel =
          x.sub(row0, col0, std::min(kFp8Block, x.rows - row0), std::min(kTilesPerTask * kFp8Block, x.cols - col0));
      tile_max_bits(as_bits(panel), columns.data(), tiles.data());
      write_amax<scalar_t>(tiles.data(), ceil_div(panel.cols, kFp8Block), out + stripe * grid.k + tile0);
    }
  });
}

}  // namespace cpu
}  // namespace fastmesh

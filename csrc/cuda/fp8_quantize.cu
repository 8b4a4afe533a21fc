// CUDA kernels of fastmesh::fp8_quantize_native, and the per-group amax of fastmesh::amax.
//
// Semantics: kernels/fp8_reference.py (the oracle) and fastmesh/fp8_math.h, whose element math
// (quant_scale_from_amax, cast_to_fp8_bits) every kernel here calls, so the GPU produces the bits the
// CPU build is tested for. Products are written __fmul_rn and reciprocals __fdiv_rn so that no flag or
// contraction can change them.
//
// Kernels, by granularity (x viewed as row-major [M, K]; 256 threads a block; grids sized from the SM
// count and the kernel's occupancy, work taken in grid-stride loops):
//   tensorwise    current scaling: two passes, launch_tensor_amax_bits (amax.cu: atomicMax of fp32
//                 bits) then tensorwise_cast_kernel, which reads the amax from device memory (no host
//                 sync). Given amax: the cast pass only. Given scale: the cast pass also reduces the
//                 amax it returns (one pass).
//   rowwise       rows of at most 32 vectors: segment_kernel (a power-of-two group of lanes per row);
//                 longer rows: row_kernel (a warp per row up to 32 * kRowCache vectors, else a block),
//                 the first kRowCache vectors of each thread held in registers between the amax and the
//                 cast, the rest re-read while the row is still in L1/L2.
//   block1x128    segment_kernel: one 128-column group per 128 / (elements per vector) lanes, i.e. a
//                 warp per group for fp32 and a half warp for 16-bit inputs.
//   block128x128  tile_kernel: a block per 128 x 128 tile, held in registers (64 elements a thread).
// transpose=True always goes through tile_kernel, which writes data_t through a shared-memory tile so
// that both outputs are written in full 128-byte lines:
//   tensorwise / block128x128: data_t = data^T (same bytes), scale_t the same / transposed scale;
//   block1x128: the tile holds the 1x128 groups of x and of x^T: row and column maxima in one read;
//   rowwise: a first tile_kernel pass (block1x128 mode, no outputs) atomicMaxes row and column maxima,
//            a second one casts (two reads of x, as the contract allows).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fastmesh/bits.h"
#include "fastmesh/fp8_checks.h"
#include "fastmesh/fp8_layout.h"
#include "fastmesh/fp8_math.h"
#include "fp8_cuda.h"
#include "vector_io.cuh"

namespace fastmesh {
namespace {

constexpr const char* kOp = "fastmesh::fp8_quantize";

constexpr int kTile = static_cast<int>(kFp8Block);
// Vectors per thread the row kernel keeps in registers between its amax and its cast.
constexpr int kRowCache = 4;

// Max over the block, returned to every thread. Every thread of the block must call it.
__device__ __forceinline__ uint32_t block_max(uint32_t value, uint32_t* scratch) {
  value = lanes_max(value, kWarpSize);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = value;
  __syncthreads();
  value = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) value = max_bits(value, scratch[w]);
  __syncthreads();  // scratch is free again
  return value;
}

// ---------------------------------------------------------------------------------------------------
// Scales. Every group's q comes from exactly one source (the contract's cases (a), (b), (c)).
// ---------------------------------------------------------------------------------------------------

struct ScaleSource {
  const float* given_scale = nullptr;  // (c) dequantization scale per group: q = 1 / scale
  const float* given_amax = nullptr;   // (b) amax per group (or tensorwise (a): the first pass's result)
  float fp8_max = 0.0f;
  bool power_of_two = false;
};

__device__ __forceinline__ float group_quant_scale(const ScaleSource& source, int64_t group, float amax) {
  if (source.given_scale != nullptr) return __fdiv_rn(1.0f, source.given_scale[group]);
  const float from = source.given_amax != nullptr ? source.given_amax[group] : amax;
  return quant_scale_from_amax(from, source.fp8_max, source.power_of_two);
}

// The amax a group returns: a copy of the given one (case (b)), else the computed one.
__device__ __forceinline__ float reported_amax(const ScaleSource& source, int64_t group, float amax) {
  return source.given_amax != nullptr ? source.given_amax[group] : amax;
}

__device__ __forceinline__ float dequant_scale(float q) { return __fdiv_rn(1.0f, q); }

struct GroupOutputs {
  uint8_t* data = nullptr;  // null: amax only (fastmesh::amax)
  float* scale = nullptr;   // null: not wanted
  float* amax = nullptr;
};

// ---------------------------------------------------------------------------------------------------
// tensorwise: the cast pass over the flat tensor.
// ---------------------------------------------------------------------------------------------------

template <typename scalar_t, Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads)
    tensorwise_cast_kernel(const scalar_t* __restrict__ x, int64_t numel, bool aligned, ScaleSource source,
                           uint8_t* __restrict__ data, float* __restrict__ scale, uint32_t* __restrict__ amax_bits) {
  using L = Lanes<scalar_t>;
  using pack_t = typename L::fp8_pack_t;
  __shared__ uint32_t scratch[kWarps];
  const float q = group_quant_scale(source, 0, 0.0f);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = dequant_scale(q);

  uint32_t acc = 0;
  const int64_t num_vectors = aligned ? numel / L::kPerVector : 0;
  const auto* vectors = reinterpret_cast<const uint4*>(x);
  auto* packs = reinterpret_cast<pack_t*>(data);
  constexpr int64_t kStep = static_cast<int64_t>(kThreads) * kUnroll;
  for (int64_t base = blockIdx.x * kStep; base < num_vectors; base += gridDim.x * kStep) {
    uint4 v[kUnroll];
    load_step(vectors, base, num_vectors, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < num_vectors) {
        acc = accumulate_max<scalar_t>(acc, v[u]);
        packs[i] = cast_vector<scalar_t, kFormat>(v[u], q);
      }
    }
  }
  // The tail, or the whole tensor when x is not 16-byte aligned: one element per thread and step.
  const auto* raw = reinterpret_cast<const typename L::bits_t*>(x);
  for (int64_t i = num_vectors * L::kPerVector + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const auto bits = raw[i];
    acc = L::word_max(acc, static_cast<uint32_t>(bits) & L::kMagnitudeMask);
    data[i] = cast_to_fp8_bits<kFormat>(__fmul_rn(L::to_float(bits), q));
  }
  if (amax_bits != nullptr) {  // given scale: the returned amax comes from this same pass
    const uint32_t block = block_max(L::word_to_fp32_bits(acc), scratch);
    if (threadIdx.x == 0) atomicMax(amax_bits, block);
  }
}

// ---------------------------------------------------------------------------------------------------
// Row segments of at most 32 vectors, one vector per lane: block1x128, and rowwise with short rows.
// A group is cols [c * group_cols, min((c + 1) * group_cols, K)) of one row; lanes_per_group (a power of
// two) consecutive lanes hold it, kThreads / lanes_per_group groups per pass, kUnroll passes per step.
// ---------------------------------------------------------------------------------------------------

template <typename scalar_t, Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads)
    segment_kernel(const scalar_t* __restrict__ x, int64_t m, int64_t k, int64_t group_cols, int64_t groups_per_row,
                   int lanes_per_group, bool aligned, ScaleSource source, GroupOutputs out) {
  using L = Lanes<scalar_t>;
  const int64_t num_groups = m * groups_per_row;
  const int groups_per_pass = kThreads / lanes_per_group;
  const int lane = static_cast<int>(threadIdx.x) % lanes_per_group;
  const int slot = static_cast<int>(threadIdx.x) / lanes_per_group;
  // Every group full length (K a multiple of group_cols): group g starts at element g * group_cols.
  const bool flat = groups_per_row * group_cols == k;
  const int64_t step = static_cast<int64_t>(groups_per_pass) * kUnroll;
  for (int64_t base = blockIdx.x * step; base < num_groups; base += gridDim.x * step) {
    uint4 v[kUnroll];
    int64_t offset[kUnroll];
    int64_t valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t group = base + u * groups_per_pass + slot;
      int64_t start = group * group_cols;
      int64_t end = start + group_cols;
      if (!flat) {
        const int64_t row = group / groups_per_row;
        const int64_t col = (group - row * groups_per_row) * group_cols;
        start = row * k + col;
        end = row * k + (col + group_cols < k ? col + group_cols : k);
      }
      offset[u] = start + static_cast<int64_t>(lane) * L::kPerVector;
      valid[u] = group < num_groups ? end - offset[u] : 0;
      v[u] = load_vector(x, offset[u], valid[u], aligned);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t group = base + u * groups_per_pass + slot;
      const uint32_t bits = lanes_max(L::word_to_fp32_bits(accumulate_max<scalar_t>(0u, v[u])), lanes_per_group);
      if (group < num_groups) {
        const float amax = float_from_bits(bits);
        const float q = group_quant_scale(source, group, amax);
        if (out.data != nullptr) {
          store_fp8(out.data, offset[u], cast_vector<scalar_t, kFormat>(v[u], q), valid[u], aligned);
        }
        if (lane == 0) {
          if (out.scale != nullptr) out.scale[group] = dequant_scale(q);
          out.amax[group] = reported_amax(source, group, amax);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// rowwise, rows of more than 32 vectors: lanes_per_row = 32 (a warp per row) or kThreads (a block).
// ---------------------------------------------------------------------------------------------------

template <typename scalar_t, Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads)
    row_kernel(const scalar_t* __restrict__ x, int64_t m, int64_t k, int lanes_per_row, bool aligned,
               ScaleSource source, GroupOutputs out) {
  using L = Lanes<scalar_t>;
  constexpr int kN = L::kPerVector;
  __shared__ uint32_t scratch[kWarps];
  const int rows_per_pass = kThreads / lanes_per_row;
  const int lane = static_cast<int>(threadIdx.x) % lanes_per_row;
  const int slot = static_cast<int>(threadIdx.x) / lanes_per_row;
  const int64_t vectors_per_row = (k + kN - 1) / kN;
  // The loop bounds are the same for the whole block, so block_max can synchronize inside it.
  for (int64_t base = blockIdx.x * static_cast<int64_t>(rows_per_pass); base < m;
       base += static_cast<int64_t>(gridDim.x) * rows_per_pass) {
    const int64_t row = base + slot;
    const int64_t row_start = row * k;
    const int64_t row_valid = row < m ? k : 0;  // a padding row (past M) reads nothing
    uint4 v[kRowCache];
    uint32_t acc = 0;
#pragma unroll
    for (int c = 0; c < kRowCache; ++c) {
      const int64_t col = (lane + static_cast<int64_t>(c) * lanes_per_row) * kN;
      v[c] = load_vector(x, row_start + col, row_valid - col, aligned);
    }
#pragma unroll
    for (int c = 0; c < kRowCache; ++c) acc = accumulate_max<scalar_t>(acc, v[c]);
    for (int64_t vi = lane + static_cast<int64_t>(kRowCache) * lanes_per_row; vi < vectors_per_row;
         vi += lanes_per_row) {
      const int64_t col = vi * kN;
      acc = accumulate_max<scalar_t>(acc, load_vector(x, row_start + col, row_valid - col, aligned));
    }
    uint32_t bits = L::word_to_fp32_bits(acc);
    bits = lanes_per_row > kWarpSize ? block_max(bits, scratch) : lanes_max(bits, lanes_per_row);
    if (row < m) {
      const float amax = float_from_bits(bits);
      const float q = group_quant_scale(source, row, amax);
      if (out.data != nullptr) {
#pragma unroll
        for (int c = 0; c < kRowCache; ++c) {
          const int64_t col = (lane + static_cast<int64_t>(c) * lanes_per_row) * kN;
          store_fp8(out.data, row_start + col, cast_vector<scalar_t, kFormat>(v[c], q), row_valid - col, aligned);
        }
        // Beyond the register cache: read again, from L1/L2 (the block read it moments ago).
        for (int64_t vi = lane + static_cast<int64_t>(kRowCache) * lanes_per_row; vi < vectors_per_row;
             vi += lanes_per_row) {
          const int64_t col = vi * kN;
          const uint4 again = load_vector(x, row_start + col, row_valid - col, aligned);
          store_fp8(out.data, row_start + col, cast_vector<scalar_t, kFormat>(again, q), row_valid - col, aligned);
        }
      }
      if (lane == 0) {
        if (out.scale != nullptr) out.scale[row] = dequant_scale(q);
        out.amax[row] = reported_amax(source, row, amax);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// 128 x 128 tiles: block128x128, and every transposed output.
//
// Thread t holds the vector column vc = t % kVecPerRow of the rows 4 * quad + i (i < 4) for the quads
// t / kVecPerRow + p * kQuadsPerPass (p < kPasses): 64 elements of the tile in registers, and four
// consecutive rows of each column, which become one 32-bit word of x^T (4 FP8 bytes). The words go to
// shared memory, a row of x^T per 32 words, at word index quad ^ ((c >> 2) & 31) in row c: writes (a
// warp spans 32 distinct quad/column pairs) and reads (a warp reads one row of x^T) then hit 32
// distinct banks. Each warp writes 16 rows of x^T, 128 bytes a row.
// ---------------------------------------------------------------------------------------------------

enum class TileMode : int {
  kTensorwise,    // one q for the tensor (computed before, or given); data_t = data^T
  kRowwise,       // q per row of x and per column of x, from precomputed row / column amax
  kBlock1x128,    // q per 1x128 group of x (tile row) and of x^T (tile column), reduced here
  kBlock128x128,  // q per tile; data_t = data^T
};

struct TileArgs {
  int64_t m = 0;
  int64_t k = 0;
  int64_t tiles_m = 0;
  int64_t tiles_k = 0;
  bool aligned = false;    // 16-byte loads of x and whole-vector stores to data
  bool aligned_t = false;  // 4-byte stores to data_t (M % 4 == 0)
  ScaleSource source;
  GroupOutputs out;
  uint8_t* data_t = nullptr;  // null: no transposed output
  float* scale_t = nullptr;
  uint32_t* amax_bits = nullptr;    // kTensorwise with a given scale: atomicMax of the returned amax
  const float* row_amax = nullptr;  // kRowwise: per row of x
  const float* col_amax = nullptr;  // kRowwise: per column of x
  uint32_t* row_bits = nullptr;     // kBlock1x128 with out.data == null: atomicMax of row maxima ...
  uint32_t* col_bits = nullptr;     // ... and of column maxima (the first pass of rowwise + transpose)
};

// Blocks per SM the tile kernel is compiled for: a block holds its tile until the cast, so overlap of
// one block's loads with another's arithmetic needs several resident blocks. 16-bit inputs hold 32
// registers of tile a thread and fit three blocks (80 registers) without spilling, except in the
// per-line modes, which also keep the tile for the second cast; fp32 holds 64 and fits two.
template <typename scalar_t, TileMode kMode>
constexpr int kTileBlocksPerSm =
    sizeof(scalar_t) == 2 && (kMode == TileMode::kTensorwise || kMode == TileMode::kBlock128x128) ? 3 : 2;

template <typename scalar_t, Fp8Format kFormat, TileMode kMode>
__global__ void __launch_bounds__(kThreads, (kTileBlocksPerSm<scalar_t, kMode>))
    tile_kernel(const scalar_t* __restrict__ x, TileArgs args) {
  using L = Lanes<scalar_t>;
  using pack_t = typename L::fp8_pack_t;
  constexpr int kN = L::kPerVector;
  constexpr int kVecPerRow = kTile / kN;                // threads across a tile row: 16 or 32
  constexpr int kQuadsPerPass = kThreads / kVecPerRow;  // 16 or 8
  constexpr int kPasses = kTile / 4 / kQuadsPerPass;    // 2 or 4
  constexpr bool kPerLine = kMode == TileMode::kRowwise || kMode == TileMode::kBlock1x128;
  static_assert(kPasses * kQuadsPerPass * 4 == kTile, "the threads must cover the tile");

  __shared__ uint32_t transposed[kTile * kTile / 4];
  __shared__ uint32_t column_part[kMode == TileMode::kBlock1x128 ? kWarps * kTile : 1];
  __shared__ uint32_t row_max[kMode == TileMode::kBlock1x128 ? kTile : 1];
  __shared__ float row_q[kPerLine ? kTile : 1];
  __shared__ float column_q[kPerLine ? kTile : 1];
  __shared__ uint32_t scratch[kWarps];

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int vc = tid % kVecPerRow;
  const int quad0 = tid / kVecPerRow;
  const int64_t num_tiles = args.tiles_m * args.tiles_k;
  const bool amax_only = args.out.data == nullptr;

  float tensor_q = 1.0f;
  uint32_t tensor_acc = 0;
  if constexpr (kMode == TileMode::kTensorwise) {
    tensor_q = group_quant_scale(args.source, 0, 0.0f);
    if (blockIdx.x == 0 && tid == 0) {
      *args.out.scale = dequant_scale(tensor_q);
      if (args.scale_t != nullptr) *args.scale_t = dequant_scale(tensor_q);
    }
  }

  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t tm = tile / args.tiles_k;
    const int64_t tk = tile - tm * args.tiles_k;
    const int64_t row0 = tm * kTile;
    const int64_t col0 = tk * kTile;
    const int64_t col = col0 + static_cast<int64_t>(vc) * kN;
    const int64_t col_valid = args.k - col;

    uint4 v[kPasses][4];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t row = row0 + 4 * (quad0 + p * kQuadsPerPass) + i;
        v[p][i] = load_vector(x, row * args.k + col, row < args.m ? col_valid : 0, args.aligned);
      }
    }

    float q = tensor_q;  // the q of data's bytes when it is one per tile
    if constexpr (kMode == TileMode::kTensorwise) {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
#pragma unroll
        for (int i = 0; i < 4; ++i) tensor_acc = accumulate_max<scalar_t>(tensor_acc, v[p][i]);
      }
    } else if constexpr (kMode == TileMode::kBlock128x128) {
      uint32_t acc = 0;
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc = accumulate_max<scalar_t>(acc, v[p][i]);
      }
      const float amax = float_from_bits(block_max(L::word_to_fp32_bits(acc), scratch));
      const int64_t group = tm * args.tiles_k + tk;
      q = group_quant_scale(args.source, group, amax);
      if (tid == 0) {
        args.out.amax[group] = reported_amax(args.source, group, amax);
        if (args.out.scale != nullptr) args.out.scale[group] = dequant_scale(q);
        if (args.scale_t != nullptr) args.scale_t[tk * args.tiles_m + tm] = dequant_scale(q);
      }
      if (amax_only) continue;  // uniform; block_max left the block synchronized
    } else {
      // Per line: thread t < kTile settles row t of the tile, thread kTile + t its column t.
      const bool is_row = tid < kTile;
      const int line = tid % kTile;
      const int64_t row = row0 + line;
      const int64_t column = col0 + line;
      const bool exists = is_row ? row < args.m : column < args.k;
      float amax = 0.0f;
      uint32_t bits = 0;
      if constexpr (kMode == TileMode::kBlock1x128) {
        uint32_t column_words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t r = lanes_max(L::word_to_fp32_bits(accumulate_max<scalar_t>(0u, v[p][i])), kVecPerRow);
            if (vc == 0) row_max[4 * (quad0 + p * kQuadsPerPass) + i] = r;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              column_words[w] = L::word_max(column_words[w], L::word(v[p][i], w) & L::kMagnitudeMask);
            }
          }
        }
        // Columns: combine the quads of a warp (16-bit inputs: two quads per warp), then across warps.
#pragma unroll
        for (int j = 0; j < kN; ++j) {
          const uint32_t w = column_words[j / L::kPerWord];
          const auto magnitude =
              static_cast<typename L::bits_t>(L::kPerWord == 2 ? (w >> (16 * (j % 2))) & 0xffffu : w);
          uint32_t c = float_to_bits(L::to_float(magnitude));
#pragma unroll
          for (int offset = kVecPerRow; offset < kWarpSize; offset *= 2) {
            c = max_bits(c, __shfl_xor_sync(0xffffffffu, c, offset));
          }
          if (lane < kVecPerRow) column_part[warp * kTile + vc * kN + j] = c;
        }
        __syncthreads();
        if (is_row) {
          bits = row_max[line];
        } else {
#pragma unroll
          for (int w = 0; w < kWarps; ++w) bits = max_bits(bits, column_part[w * kTile + line]);
        }
        amax = float_from_bits(bits);
      } else {  // kRowwise: the first pass left the maxima in device memory
        if (exists) amax = is_row ? args.row_amax[row] : args.col_amax[column];
      }

      if (amax_only) {
        // First pass of rowwise + transpose: publish the maxima, cast nothing.
        if (exists) atomicMax(is_row ? args.row_bits + row : args.col_bits + column, bits);
        __syncthreads();  // row_max / column_part are rewritten by the next tile
        continue;
      }
      const float line_q = quant_scale_from_amax(amax, args.source.fp8_max, args.source.power_of_two);
      if (exists) {
        if constexpr (kMode == TileMode::kBlock1x128) {
          if (is_row) {
            const int64_t group = row * args.tiles_k + tk;
            args.out.amax[group] = amax;
            args.out.scale[group] = dequant_scale(line_q);
          } else if (args.scale_t != nullptr) {
            args.scale_t[column * args.tiles_m + tm] = dequant_scale(line_q);
          }
        } else {
          if (is_row && tk == 0) {
            args.out.scale[row] = dequant_scale(line_q);
          } else if (!is_row && tm == 0 && args.scale_t != nullptr) {
            args.scale_t[column] = dequant_scale(line_q);
          }
        }
      }
      (is_row ? row_q : column_q)[line] = line_q;
      __syncthreads();
    }

    // data, straight from registers.
    pack_t packs[kPasses][4];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int local_row = 4 * (quad0 + p * kQuadsPerPass) + i;
        const int64_t row = row0 + local_row;
        if constexpr (kPerLine) q = row_q[local_row];
        packs[p][i] = cast_vector<scalar_t, kFormat>(v[p][i], q);
        store_fp8(args.out.data, row * args.k + col, packs[p][i], row < args.m ? col_valid : 0, args.aligned);
      }
    }

    if (args.data_t != nullptr) {
      if constexpr (kPerLine) {  // x^T's groups are this tile's columns: cast again with their q
        float qc[kN];
#pragma unroll
        for (int j = 0; j < kN; ++j) qc[j] = column_q[vc * kN + j];
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
#pragma unroll
          for (int i = 0; i < 4; ++i) packs[p][i] = cast_vector<scalar_t, kFormat>(v[p][i], qc);
        }
      }
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int quad = quad0 + p * kQuadsPerPass;
#pragma unroll
        for (int j = 0; j < kN; ++j) {
          uint32_t word = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) word |= static_cast<uint32_t>((packs[p][i] >> (8 * j)) & 0xffu) << (8 * i);
          const int c = vc * kN + j;
          transposed[c * (kTile / 4) + (quad ^ ((c >> 2) & 31))] = word;
        }
      }
      __syncthreads();
      const int64_t row = row0 + 4 * lane;  // the 4 rows of x (bytes of a data_t row) this lane writes
#pragma unroll 4
      for (int r = 0; r < kTile / kWarps; ++r) {
        const int c = warp * (kTile / kWarps) + r;
        const int64_t column = col0 + c;
        if (column < args.k) {
          const uint32_t word = transposed[c * (kTile / 4) + (lane ^ ((c >> 2) & 31))];
          store_fp8(args.data_t, column * args.m + row, word, args.m - row, args.aligned_t);
        }
      }
    }
    if (kPerLine || args.data_t != nullptr) __syncthreads();  // shared memory is rewritten by the next tile
  }

  if constexpr (kMode == TileMode::kTensorwise) {
    if (args.amax_bits != nullptr) {
      const uint32_t block = block_max(L::word_to_fp32_bits(tensor_acc), scratch);
      if (tid == 0) atomicMax(args.amax_bits, block);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Empty x: every group has no element (amax 0, q 1, unless given).
// ---------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    empty_groups_kernel(int64_t groups, int64_t groups_t, ScaleSource source, bool t_from_source,
                        float* __restrict__ scale, float* __restrict__ amax, float* __restrict__ scale_t) {
  const int64_t count = groups > groups_t ? groups : groups_t;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; g < count;
       g += static_cast<int64_t>(gridDim.x) * kThreads) {
    if (g < groups) {
      scale[g] = dequant_scale(group_quant_scale(source, g, 0.0f));
      amax[g] = reported_amax(source, g, 0.0f);
    }
    if (g < groups_t) {
      const float q = t_from_source ? group_quant_scale(source, g, 0.0f)
                                    : quant_scale_from_amax(0.0f, source.fp8_max, source.power_of_two);
      scale_t[g] = dequant_scale(q);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------------

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename Fn>
void dispatch_input(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      fn(TypeTag<float>{});
      break;
    case at::kBFloat16:
      fn(TypeTag<c10::BFloat16>{});
      break;
    case at::kHalf:
      fn(TypeTag<c10::Half>{});
      break;
    default:
      TORCH_CHECK_TYPE(false, kOp, ": x must be float32, bfloat16 or float16, got ", dtype);
  }
}

template <Fp8Format kFormat>
using FormatTag = std::integral_constant<Fp8Format, kFormat>;

template <typename Fn>
void dispatch_format(Fp8Format format, Fn&& fn) {
  if (format == Fp8Format::kE4M3FN) {
    fn(FormatTag<Fp8Format::kE4M3FN>{});
  } else {
    fn(FormatTag<Fp8Format::kE5M2>{});
  }
}

int next_power_of_two(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

template <typename scalar_t>
constexpr int per_vector() {
  return Lanes<scalar_t>::kPerVector;
}

template <typename scalar_t, Fp8Format kFormat>
void launch_tensorwise_cast(const at::Tensor& x, const ScaleSource& source, at::Tensor& data, at::Tensor& scale,
                            uint32_t* amax_bits) {
  const auto kernel = tensorwise_cast_kernel<scalar_t, kFormat>;
  static const int resident = resident_blocks(kernel);
  const int64_t numel = x.numel();
  const bool aligned = aligned16(x.const_data_ptr()) && aligned16(data.const_data_ptr());
  const int64_t work = (numel / per_vector<scalar_t>() + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  kernel<<<grid_size(resident, work), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<scalar_t>(), numel, aligned, source, static_cast<uint8_t*>(data.mutable_data_ptr()),
      scale.mutable_data_ptr<float>(), amax_bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// rowwise / block1x128 without transpose (and their amax): group_cols = K for rowwise, 128 for 1x128.
template <typename scalar_t, Fp8Format kFormat>
void launch_row_groups(const at::Tensor& x, Rows rows, int64_t group_cols, const ScaleSource& source,
                       const GroupOutputs& out) {
  constexpr int kN = per_vector<scalar_t>();
  const bool aligned =
      aligned16(x.const_data_ptr()) && (out.data == nullptr || aligned16(out.data)) && rows.k % kN == 0;
  const int64_t vectors_per_group = (std::min(group_cols, rows.k) + kN - 1) / kN;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (vectors_per_group <= kWarpSize) {
    const auto kernel = segment_kernel<scalar_t, kFormat>;
    static const int resident = resident_blocks(kernel);
    const int lanes = next_power_of_two(vectors_per_group);
    const int64_t groups_per_row = (rows.k + group_cols - 1) / group_cols;
    const int64_t groups_per_step = static_cast<int64_t>(kThreads / lanes) * kUnroll;
    const int64_t work = (rows.m * groups_per_row + groups_per_step - 1) / groups_per_step;
    kernel<<<grid_size(resident, work), kThreads, 0, stream>>>(x.const_data_ptr<scalar_t>(), rows.m, rows.k, group_cols,
                                                               groups_per_row, lanes, aligned, source, out);
  } else {
    const auto kernel = row_kernel<scalar_t, kFormat>;
    static const int resident = resident_blocks(kernel);
    const int lanes = vectors_per_group <= static_cast<int64_t>(kWarpSize) * kRowCache ? kWarpSize : kThreads;
    const int64_t rows_per_pass = kThreads / lanes;
    kernel<<<grid_size(resident, (rows.m + rows_per_pass - 1) / rows_per_pass), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), rows.m, rows.k, lanes, aligned, source, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, Fp8Format kFormat, TileMode kMode>
void launch_tile(const at::Tensor& x, Rows rows, TileArgs args) {
  const auto kernel = tile_kernel<scalar_t, kFormat, kMode>;
  static const int resident = resident_blocks(kernel);
  args.m = rows.m;
  args.k = rows.k;
  args.tiles_m = ceil_div(rows.m, kTile);
  args.tiles_k = ceil_div(rows.k, kTile);
  args.aligned = aligned16(x.const_data_ptr()) && (args.out.data == nullptr || aligned16(args.out.data)) &&
                 rows.k % per_vector<scalar_t>() == 0;
  args.aligned_t = args.data_t != nullptr && reinterpret_cast<uintptr_t>(args.data_t) % 4 == 0 && rows.m % 4 == 0;
  kernel<<<grid_size(resident, args.tiles_m * args.tiles_k), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<scalar_t>(), args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const float* float_ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; }
uint32_t* bits_ptr(at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.mutable_data_ptr()); }

using QuantizeResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>;

QuantizeResult fp8_quantize_cuda(const at::Tensor& x, at::ScalarType dtype, c10::string_view granularity_arg,
                                 const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& amax,
                                 bool transpose, bool power_of_two) {
  const QuantizeCall call = check_quantize_args(x, dtype, granularity_arg, scale, amax, transpose, power_of_two, kOp);
  const Fp8Format format = call.format;
  const Granularity granularity = call.granularity;
  const std::vector<int64_t>& sizes = call.layout;

  const c10::cuda::CUDAGuard guard(x.device());
  const Rows rows = as_rows(x);
  const auto floats = x.options().dtype(at::kFloat);
  const at::Tensor given_scale = scale.has_value() ? scale->contiguous() : at::Tensor();
  const at::Tensor given_amax = amax.has_value() ? amax->contiguous() : at::Tensor();
  ScaleSource source;
  source.given_scale = float_ptr(given_scale);
  source.given_amax = float_ptr(given_amax);
  source.fp8_max = fp8_max(format);
  source.power_of_two = power_of_two;

  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor scale_out = at::empty(sizes, floats);
  at::Tensor amax_out;
  std::optional<at::Tensor> data_t;
  std::optional<at::Tensor> scale_t;
  if (transpose) {
    const std::array<int64_t, 2> sizes_t = {rows.k, rows.m};
    data_t = at::empty({rows.k, rows.m}, x.options().dtype(dtype));
    scale_t = at::empty(scale_sizes(granularity, at::IntArrayRef(sizes_t.data(), sizes_t.size())), floats);
  }
  uint8_t* data_ptr = static_cast<uint8_t*>(data.mutable_data_ptr());
  uint8_t* data_t_ptr = data_t.has_value() ? static_cast<uint8_t*>(data_t->mutable_data_ptr()) : nullptr;
  float* scale_t_ptr = scale_t.has_value() ? scale_t->mutable_data_ptr<float>() : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream();

  if (x.numel() == 0) {
    amax_out = at::empty(sizes, floats);
    const int64_t groups = scale_out.numel();
    const int64_t groups_t = scale_t.has_value() ? scale_t->numel() : 0;
    const int64_t count = std::max(groups, groups_t);
    if (count > 0) {
      const auto blocks = static_cast<unsigned>(std::min<int64_t>((count + kThreads - 1) / kThreads, 1024));
      empty_groups_kernel<<<blocks, kThreads, 0, stream>>>(
          groups, groups_t, source, granularity == Granularity::kTensorwise, scale_out.mutable_data_ptr<float>(),
          amax_out.mutable_data_ptr<float>(), scale_t_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return {data, scale_out, amax_out, data_t, scale_t};
  }

  dispatch_input(x.scalar_type(), [&](auto input_tag) {
    using scalar_t = typename decltype(input_tag)::type;
    dispatch_format(format, [&](auto format_tag) {
      constexpr Fp8Format kFormat = decltype(format_tag)::value;
      switch (granularity) {
        case Granularity::kTensorwise: {
          // Zero-initialized: the identity of the atomicMax over fp32 bits.
          amax_out = given_amax.defined() ? given_amax.clone() : at::zeros({}, floats);
          uint32_t* amax_bits = given_amax.defined() ? nullptr : bits_ptr(amax_out);
          if (!given_amax.defined() && !given_scale.defined()) {
            launch_tensor_amax_bits(x, amax_bits);  // pass 1; pass 2 reads q's amax from device memory
            source.given_amax = amax_out.const_data_ptr<float>();
            amax_bits = nullptr;
          }
          if (!transpose) {
            launch_tensorwise_cast<scalar_t, kFormat>(x, source, data, scale_out, amax_bits);
          } else {
            TileArgs args;
            args.source = source;
            args.out = GroupOutputs{data_ptr, scale_out.mutable_data_ptr<float>(), nullptr};
            args.data_t = data_t_ptr;
            args.scale_t = scale_t_ptr;
            args.amax_bits = amax_bits;
            launch_tile<scalar_t, kFormat, TileMode::kTensorwise>(x, rows, args);
          }
          break;
        }
        case Granularity::kRowwise: {
          if (!transpose) {
            amax_out = at::empty(sizes, floats);
            launch_row_groups<scalar_t, kFormat>(
                x, rows, std::max<int64_t>(rows.k, 1), source,
                GroupOutputs{data_ptr, scale_out.mutable_data_ptr<float>(), amax_out.mutable_data_ptr<float>()});
          } else {
            // Pass 1: row maxima (the returned amax) and column maxima, by atomicMax from every tile.
            amax_out = at::zeros(sizes, floats);
            at::Tensor column_amax = at::zeros({rows.k}, floats);
            TileArgs first;
            first.row_bits = bits_ptr(amax_out);
            first.col_bits = bits_ptr(column_amax);
            launch_tile<scalar_t, Fp8Format::kE4M3FN, TileMode::kBlock1x128>(x, rows, first);
            TileArgs second;
            second.source = source;
            second.out = GroupOutputs{data_ptr, scale_out.mutable_data_ptr<float>(), nullptr};
            second.data_t = data_t_ptr;
            second.scale_t = scale_t_ptr;
            second.row_amax = amax_out.const_data_ptr<float>();
            second.col_amax = column_amax.const_data_ptr<float>();
            launch_tile<scalar_t, kFormat, TileMode::kRowwise>(x, rows, second);
          }
          break;
        }
        case Granularity::kBlock1x128: {
          amax_out = at::empty(sizes, floats);
          const GroupOutputs out{data_ptr, scale_out.mutable_data_ptr<float>(), amax_out.mutable_data_ptr<float>()};
          if (!transpose) {
            launch_row_groups<scalar_t, kFormat>(x, rows, kTile, source, out);
          } else {
            TileArgs args;
            args.source = source;
            args.out = out;
            args.data_t = data_t_ptr;
            args.scale_t = scale_t_ptr;
            launch_tile<scalar_t, kFormat, TileMode::kBlock1x128>(x, rows, args);
          }
          break;
        }
        case Granularity::kBlock128x128: {
          amax_out = at::empty(sizes, floats);
          TileArgs args;
          args.source = source;
          args.out = GroupOutputs{data_ptr, scale_out.mutable_data_ptr<float>(), amax_out.mutable_data_ptr<float>()};
          args.data_t = data_t_ptr;
          args.scale_t = scale_t_ptr;
          launch_tile<scalar_t, kFormat, TileMode::kBlock128x128>(x, rows, args);
          break;
        }
      }
    });
  });
  return {data, scale_out, amax_out, data_t, scale_t};
}

}  // namespace

at::Tensor group_amax_cuda(const at::Tensor& input, Granularity granularity) {
  TORCH_CHECK(granularity != Granularity::kTensorwise, "group_amax_cuda: tensorwise has its own kernel");
  at::Tensor out = at::empty(scale_sizes(granularity, input.sizes()), input.options().dtype(at::kFloat));
  if (input.numel() == 0) return out.zero_();  // groups without elements: amax 0
  const Rows rows = as_rows(input);
  const GroupOutputs outputs{nullptr, nullptr, out.mutable_data_ptr<float>()};
  // The format does not matter for an amax; one instantiation serves every format.
  dispatch_input(input.scalar_type(), [&](auto input_tag) {
    using scalar_t = typename decltype(input_tag)::type;
    switch (granularity) {
      case Granularity::kRowwise:
        launch_row_groups<scalar_t, Fp8Format::kE4M3FN>(input, rows, std::max<int64_t>(rows.k, 1), ScaleSource{},
                                                        outputs);
        break;
      case Granularity::kBlock1x128:
        launch_row_groups<scalar_t, Fp8Format::kE4M3FN>(input, rows, kTile, ScaleSource{}, outputs);
        break;
      default: {
        TileArgs args;
        args.out = outputs;
        launch_tile<scalar_t, Fp8Format::kE4M3FN, TileMode::kBlock128x128>(input, rows, args);
      }
    }
  });
  return out;
}

}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) { m.impl("fp8_quantize_native", &fastmesh::fp8_quantize_cuda); }

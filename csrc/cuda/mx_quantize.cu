// CUDA kernels of fastmesh::mx_quantize_native: the MX cast, and with transpose the column-wise MX cast, equal bit
// for bit to kernels/mx_reference.py through fastmesh/mx_math.h (the scale rules) and fastmesh/fp8_math.h (the
// cast), which the CPU build tests.
//
// Without transpose (x 16-byte aligned): mx_flat_kernel streams x as 16-byte vectors, the kernels of
// fp8_quantize.cu do (vector_io.cuh). An MX block is 32 / (elements per vector) consecutive vectors, so 4 (16-bit
// inputs) or 8 (fp32) consecutive lanes hold one, reduce its max with lane shuffles, and each writes its vector's
// FP8 bytes in one store; kUnroll vectors a thread are in flight before the first is used.
//
// With transpose (or an unaligned x): mx_tile_kernel, a block of 32 x 32 threads per 32 x 32 tile of x (as
// row-major [M, K]; 32 divides K), tiles taken in a grid-stride loop: thread (tx, ty) holds element
// (row0 + ty, col0 + tx), so warp ty holds one MX block of row ty, reduced with one warp max of the magnitude bits.
// The tile goes through shared memory, and warp ty takes column ty: its max, its scale and its 32 casts, written
// along data_t's row (coalesced). One element a thread: on an H200 it moved 12-16% of copy bandwidth
// (bench/gpu_check_fp8.py, 2026-12-04, when it also served the casts without transpose); the Triton kernel is the
// default on CUDA.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "fastmesh/bits.h"
#include "fastmesh/fp8_checks.h"
#include "fastmesh/fp8_math.h"
#include "fastmesh/mx_math.h"
#include "vector_io.cuh"

namespace fastmesh {
namespace {

constexpr const char* kOp = "fastmesh::mx_quantize";
constexpr int kTile = static_cast<int>(kMxBlock);

struct MxArgs {
  int64_t m, k;
  MxRounding rounding;
  uint8_t* data;
  uint8_t* scale;
  float* amax;
  uint8_t* data_t;   // nullptr without transpose
  uint8_t* scale_t;  // [k, m / 32]
};

template <typename scalar_t, Fp8Format kFormat, bool kTranspose>
__global__ void __launch_bounds__(kTile* kTile) mx_tile_kernel(const scalar_t* __restrict__ x, MxArgs args) {
  __shared__ float tile[kTile][kTile + 1];  // +1: the column reads of the transpose hit 32 different banks
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles_k = args.k / kTile;
  const int64_t num_tiles = (args.m + kTile - 1) / kTile * tiles_k;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int64_t row_tile = t / tiles_k, column_tile = t - row_tile * tiles_k;
    const int64_t row0 = row_tile * kTile, col0 = column_tile * kTile;
    const int64_t row = row0 + ty, col = col0 + tx;
    const bool in_rows = row < args.m;
    const float value = in_rows ? static_cast<float>(x[row * args.k + col]) : 0.0f;

    // The row's block: the warp's max of |value| bits (NaN above inf, as everywhere in fastmesh).
    const unsigned magnitude = float_to_bits(value) & 0x7fffffffu;
    const float amax = float_from_bits(__reduce_max_sync(0xffffffffu, magnitude));
    const uint8_t bits = mx_scale_bits(amax, kFormat, args.rounding);
    if (in_rows) {
      const int64_t block = row * tiles_k + column_tile;
      if (tx == 0) {
        args.scale[block] = bits;
        args.amax[block] = amax;
      }
      args.data[row * args.k + col] = cast_to_fp8_bits<kFormat>(__fmul_rn(value, mx_multiplier(bits, args.rounding)));
    }
    if constexpr (kTranspose) {
      tile[ty][tx] = value;
      __syncthreads();
      // Warp ty: column col0 + ty, lane tx its row row0 + tx (transpose: 32 divides m, every row exists).
      const float v = tile[tx][ty];
      const float column_amax = float_from_bits(__reduce_max_sync(0xffffffffu, float_to_bits(v) & 0x7fffffffu));
      const uint8_t column_bits = mx_scale_bits(column_amax, kFormat, args.rounding);
      const int64_t c = col0 + ty;
      if (tx == 0) args.scale_t[c * (args.m / kTile) + row_tile] = column_bits;
      args.data_t[c * args.m + row0 + tx] =
          cast_to_fp8_bits<kFormat>(__fmul_rn(v, mx_multiplier(column_bits, args.rounding)));
      __syncthreads();  // every column read of this tile is done before the next tile is written
    }
  }
}

// The cast without transpose, x and data 16-byte aligned: `lanes` (32 / elements per vector) consecutive threads
// per MX block, blocks in order along the flat tensor (32 divides K, so no block crosses a row).
template <typename scalar_t, Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads) mx_flat_kernel(const scalar_t* __restrict__ x, MxArgs args) {
  using L = Lanes<scalar_t>;
  using pack_t = typename L::fp8_pack_t;
  constexpr int kLanes = static_cast<int>(kMxBlock) / L::kPerVector;
  static_assert(kThreads % kLanes == 0 && kWarpSize % kLanes == 0, "a block's lanes must sit in one warp");
  const int64_t num_vectors = args.m * (args.k / L::kPerVector);
  const auto* vectors = reinterpret_cast<const uint4*>(x);
  auto* packs = reinterpret_cast<pack_t*>(args.data);
  const bool first_lane = threadIdx.x % kLanes == 0;
  constexpr int64_t kStep = static_cast<int64_t>(kThreads) * kUnroll;
  // The loop bound is the same for every thread of a block, so whole warps take part in each shuffle.
  for (int64_t base = blockIdx.x * kStep; base < num_vectors; base += gridDim.x * kStep) {
    uint4 v[kUnroll];
    load_step(vectors, base, num_vectors, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;  // a block's lanes are all in range or all out
      const uint32_t amax_bits = lanes_max(L::word_to_fp32_bits(accumulate_max<scalar_t>(0u, v[u])), kLanes);
      if (i < num_vectors) {
        const uint8_t bits = mx_scale_bits(float_from_bits(amax_bits), kFormat, args.rounding);
        packs[i] = cast_vector<scalar_t, kFormat>(v[u], mx_multiplier(bits, args.rounding));
        if (first_lane) {
          args.scale[i / kLanes] = bits;
          args.amax[i / kLanes] = float_from_bits(amax_bits);
        }
      }
    }
  }
}

template <typename scalar_t, Fp8Format kFormat>
void launch(const at::Tensor& x, const MxArgs& args) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto* input = x.const_data_ptr<scalar_t>();
  if (args.data_t == nullptr && aligned16(input) && aligned16(args.data)) {
    const auto kernel = mx_flat_kernel<scalar_t, kFormat>;
    static const int resident = resident_blocks(kernel);
    const int64_t vectors = args.m * (args.k / Lanes<scalar_t>::kPerVector);
    const int64_t work = (vectors + kThreads * kUnroll - 1) / (kThreads * kUnroll);
    kernel<<<grid_size(resident, work), kThreads, 0, stream>>>(input, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // 2 blocks of 1024 threads fill an SM's 2048 thread slots; the tiles beyond the grid are looped over.
  const int64_t tiles = (args.m + kTile - 1) / kTile * (args.k / kTile);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles, 2 * sms)));
  const dim3 threads(kTile, kTile);
  if (args.data_t != nullptr) {
    mx_tile_kernel<scalar_t, kFormat, true><<<grid, threads, 0, stream>>>(input, args);
  } else {
    mx_tile_kernel<scalar_t, kFormat, false><<<grid, threads, 0, stream>>>(input, args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_format(const at::Tensor& x, Fp8Format format, const MxArgs& args) {
  if (format == Fp8Format::kE4M3FN) {
    launch<scalar_t, Fp8Format::kE4M3FN>(x, args);
  } else {
    launch<scalar_t, Fp8Format::kE5M2>(x, args);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> mx_quantize_cuda(
    const at::Tensor& x, at::ScalarType dtype, c10::string_view rounding, bool transpose) {
  const MxCall call = check_mx_args(x, dtype, rounding, transpose, kOp);
  const c10::cuda::CUDAGuard guard(x.device());
  const Rows rows = call.rows;
  std::vector<int64_t> scale_sizes(x.sizes().begin(), x.sizes().end());
  scale_sizes.back() /= kMxBlock;
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  at::Tensor scale = at::empty(scale_sizes, x.options().dtype(at::kFloat8_e8m0fnu));
  at::Tensor amax = at::empty(scale_sizes, x.options().dtype(at::kFloat));  // every block's is written
  std::optional<at::Tensor> data_t, scale_t;
  if (transpose) {
    data_t = at::empty({rows.k, rows.m}, x.options().dtype(dtype));
    scale_t = at::empty({rows.k, rows.m / kMxBlock}, x.options().dtype(at::kFloat8_e8m0fnu));
  }
  if (x.numel() == 0) return {data, scale, amax, data_t, scale_t};
  const MxArgs args{rows.m,
                    rows.k,
                    call.rounding,
                    static_cast<uint8_t*>(data.mutable_data_ptr()),
                    static_cast<uint8_t*>(scale.mutable_data_ptr()),
                    amax.mutable_data_ptr<float>(),
                    transpose ? static_cast<uint8_t*>(data_t->mutable_data_ptr()) : nullptr,
                    transpose ? static_cast<uint8_t*>(scale_t->mutable_data_ptr()) : nullptr};
  switch (x.scalar_type()) {
    case at::kFloat:
      launch_format<float>(x, call.format, args);
      break;
    case at::kBFloat16:
      launch_format<c10::BFloat16>(x, call.format, args);
      break;
    default:
      launch_format<c10::Half>(x, call.format, args);
  }
  return {data, scale, amax, data_t, scale_t};
}

}  // namespace
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) { m.impl("mx_quantize_native", &fastmesh::mx_quantize_cuda); }

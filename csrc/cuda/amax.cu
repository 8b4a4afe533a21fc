// CUDA kernels of fastmesh::amax: max(|x|) per FP8 scaling group, in fp32, in the scale layout.
//
// tensorwise (here): threads reduce the raw bits of a grid-stride slice (16-byte vector loads where the
// data is aligned), warps combine with shuffles, and each block publishes its result as fp32 bits with
// one atomicMax (see fastmesh/amax_math.h for why that unsigned order is the numeric one, NaN
// included). The same kernel is the first pass of tensorwise FP8 current scaling (fp8_quantize.cu).
// rowwise / block1x128 / block128x128: the group kernels of fp8_quantize.cu with the cast switched off,
// so the amax all-reduced across ranks is exactly the one the quantize kernels compute.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "fastmesh/bits.h"
#include "fastmesh/fp8_checks.h"
#include "fastmesh/fp8_layout.h"
#include "fp8_cuda.h"

namespace fastmesh {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kVectorBytes = 16;

__device__ __forceinline__ uint32_t warp_max(uint32_t value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = max_bits(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

template <typename scalar_t>
__global__ void amax_kernel(const scalar_t* __restrict__ data, int64_t numel, uint32_t* __restrict__ out_bits) {
  using bits_t = typename BitsOf<scalar_t>::type;
  constexpr int kPerVector = kVectorBytes / sizeof(bits_t);
  const auto* raw = reinterpret_cast<const bits_t*>(data);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;

  bits_t acc = 0;
  int64_t vectorized = 0;
  if (reinterpret_cast<uintptr_t>(raw) % kVectorBytes == 0) {
    vectorized = numel / kPerVector;
    const auto* vectors = reinterpret_cast<const uint4*>(raw);
    for (int64_t v = thread; v < vectorized; v += stride) {
      const uint4 packed = vectors[v];
      const auto* lanes = reinterpret_cast<const bits_t*>(&packed);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) acc = max_bits(acc, magnitude_bits(lanes[j]));
    }
    vectorized *= kPerVector;
  }
  for (int64_t i = vectorized + thread; i < numel; i += stride) acc = max_bits(acc, magnitude_bits(raw[i]));

  // From here on, fp32 bits: every block's result must be comparable in one word for atomicMax.
  uint32_t value = float_to_bits(BitsOf<scalar_t>::to_float(acc));
  __shared__ uint32_t warp_results[kThreads / kWarpSize];
  value = warp_max(value);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) warp_results[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = warp_max(lane < kThreads / kWarpSize ? warp_results[lane] : 0u);
    if (lane == 0) atomicMax(out_bits, value);
  }
}

template <typename scalar_t>
void launch_amax(const at::Tensor& input, uint32_t* out_bits) {
  const int64_t numel = input.numel();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // A few blocks per SM keep loads in flight; more would only add atomics.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((numel + kThreads - 1) / kThreads, 4LL * sms));
  amax_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      input.const_data_ptr<scalar_t>(), numel, out_bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor amax_cuda(const at::Tensor& x, c10::string_view granularity) {
  check_tensor(x, "fastmesh::amax", "x", kFloatInputs);
  const Granularity parsed = parse_granularity(granularity);
  check_granularity_dims(x, parsed, granularity, "fastmesh::amax");
  const c10::cuda::CUDAGuard guard(x.device());
  // The reductions are order-independent, so a contiguous copy changes nothing but speed.
  const at::Tensor input = x.contiguous();
  if (parsed != Granularity::kTensorwise) return group_amax_cuda(input, parsed);
  // Zero is the identity: the bits of +0.0, the smallest magnitude.
  at::Tensor out_bits = at::zeros({}, x.options().dtype(at::kInt));
  if (input.numel() > 0) {
    launch_tensor_amax_bits(input, reinterpret_cast<uint32_t*>(out_bits.mutable_data_ptr<int32_t>()));
  }
  return out_bits.view(at::kFloat);
}

}  // namespace

void launch_tensor_amax_bits(const at::Tensor& input, uint32_t* out_bits) {
  AT_DISPATCH_SWITCH(input.scalar_type(), "fastmesh_amax_cuda",
                     AT_DISPATCH_CASE(at::kFloat, [&] { launch_amax<float>(input, out_bits); })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] { launch_amax<c10::BFloat16>(input, out_bits); })
                             AT_DISPATCH_CASE(at::kHalf, [&] { launch_amax<c10::Half>(input, out_bits); }));
}

}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) { m.impl("amax", &fastmesh::amax_cuda); }

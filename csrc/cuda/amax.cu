// CUDA kernel of fastmesh::amax: max(|x|) over all elements, in fp32.
//
// Each thread reduces a grid-stride slice, warps combine with shuffles, and each block publishes its
// result with one atomicMax on the bit pattern (see fastmesh/amax_math.h for why that order is the
// numeric one, NaN included).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "fastmesh/amax_math.h"
#include "fastmesh/checks.h"

namespace fastmesh {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;

__device__ __forceinline__ uint32_t warp_max_bits(uint32_t value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = max_bits(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

template <typename scalar_t>
__global__ void amax_kernel(const scalar_t* __restrict__ data, int64_t numel, uint32_t* __restrict__ out) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    acc = max_bits(acc, abs_bits(static_cast<float>(data[i])));
  }
  __shared__ uint32_t warp_results[kThreads / kWarpSize];
  acc = warp_max_bits(acc);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) warp_results[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / kWarpSize ? warp_results[lane] : 0u;
    acc = warp_max_bits(acc);
    if (lane == 0) atomicMax(out, acc);
  }
}

at::Tensor amax_cuda(const at::Tensor& x) {
  check_float_input(x, "fastmesh::amax", "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  // Zero is the identity: bits of +0.0, the smallest magnitude.
  at::Tensor out_bits = at::zeros({}, x.options().dtype(at::kInt));
  const int64_t numel = input.numel();
  if (numel > 0) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 4LL * sms);
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "fastmesh_amax_cuda", [&] {
      amax_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          input.const_data_ptr<scalar_t>(), numel, reinterpret_cast<uint32_t*>(out_bits.mutable_data_ptr<int32_t>()));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out_bits.view(at::kFloat);
}

}  // namespace
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) {
  m.impl("amax", &fastmesh::amax_cuda);
}

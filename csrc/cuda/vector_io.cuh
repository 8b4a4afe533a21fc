// Vector access, lane reductions and grid sizing shared by the streaming CUDA kernels of the FP8 casts
// (fp8_quantize.cu) and the MX cast (mx_quantize.cu): 16-byte loads of any input dtype seen as words of raw bits,
// packed FP8 stores, and grids sized from the SM count and the kernel's occupancy.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fastmesh/bits.h"
#include "fastmesh/fp8_math.h"

namespace fastmesh {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kVectorBytes = 16;
// 16-byte loads each thread issues before using the first, in the streaming kernels: with a few blocks
// per SM this keeps enough bytes in flight to cover DRAM latency.
constexpr int kUnroll = 4;

// ---------------------------------------------------------------------------------------------------
// Element access: a 16-byte vector of scalar_t as four 32-bit words of raw bits.
// ---------------------------------------------------------------------------------------------------

template <typename scalar_t>
struct Lanes {
  using bits_t = typename BitsOf<scalar_t>::type;
  static constexpr int kPerVector = kVectorBytes / static_cast<int>(sizeof(bits_t));
  static constexpr int kPerWord = 4 / static_cast<int>(sizeof(bits_t));
  static constexpr uint32_t kMagnitudeMask = kPerWord == 2 ? 0x7fff7fffu : 0x7fffffffu;
  using fp8_pack_t = std::conditional_t<kPerVector == 8, uint64_t, uint32_t>;  // the vector as FP8 bytes

  static __device__ __forceinline__ uint32_t word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
  }

  // Per-element max of two words of magnitudes. For 16-bit inputs this is the packed unsigned max
  // (one VIMNMX per two elements on sm_90): the order of amax_math.h's max_bits, lane by lane.
  static __device__ __forceinline__ uint32_t word_max(uint32_t a, uint32_t b) {
    if constexpr (kPerWord == 2) {
      return __vmaxu2(a, b);
    } else {
      return max_bits(a, b);
    }
  }

  static __device__ __forceinline__ float to_float(bits_t bits) {
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      return float_from_bits(static_cast<uint32_t>(bits) << 16);  // bf16 is the top half of an fp32
    } else {
      return BitsOf<scalar_t>::to_float(bits);
    }
  }

  // fp32 bits of the largest magnitude in a word of magnitudes (the result of word_max reductions).
  static __device__ __forceinline__ uint32_t word_to_fp32_bits(uint32_t magnitudes) {
    if constexpr (kPerWord == 2) {
      const auto low = static_cast<bits_t>(magnitudes & 0xffffu);
      const auto high = static_cast<bits_t>(magnitudes >> 16);
      return float_to_bits(to_float(max_bits(low, high)));
    } else {
      return magnitudes;
    }
  }

  // Element j of the vector, as fp32 (exact).
  static __device__ __forceinline__ float element(const uint4& v, int j) {
    const uint32_t w = word(v, j / kPerWord);
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      return float_from_bits(j % 2 == 1 ? (w & 0xffff0000u) : (w << 16));
    } else if constexpr (kPerWord == 2) {
      return to_float(static_cast<bits_t>(j % 2 == 1 ? (w >> 16) : (w & 0xffffu)));
    } else {
      return float_from_bits(w);
    }
  }
};

// Running per-element max of magnitudes over whole vectors, as a word (see Lanes::word_max).
template <typename scalar_t>
__device__ __forceinline__ uint32_t accumulate_max(uint32_t acc, const uint4& v) {
  using L = Lanes<scalar_t>;
  acc = L::word_max(acc, v.x & L::kMagnitudeMask);
  acc = L::word_max(acc, v.y & L::kMagnitudeMask);
  acc = L::word_max(acc, v.z & L::kMagnitudeMask);
  return L::word_max(acc, v.w & L::kMagnitudeMask);
}

// The kPerVector elements at x[offset...], of which the first `valid` exist (others read as +0, the
// identity of the amax). 16-byte load when allowed, element loads otherwise (odd shapes, edges).
template <typename scalar_t>
__device__ __forceinline__ uint4 load_vector(const scalar_t* __restrict__ x, int64_t offset, int64_t valid,
                                             bool aligned) {
  using L = Lanes<scalar_t>;
  using bits_t = typename L::bits_t;
  if (aligned && valid >= L::kPerVector) {
    return __ldg(reinterpret_cast<const uint4*>(x + offset));
  }
  uint32_t words[4] = {0u, 0u, 0u, 0u};
  const bits_t* raw = reinterpret_cast<const bits_t*>(x) + offset;
#pragma unroll
  for (int j = 0; j < L::kPerVector; ++j) {
    if (j < valid) {
      words[j / L::kPerWord] |= static_cast<uint32_t>(raw[j]) << (16 * (j % L::kPerWord));
    }
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Store the first `valid` of the FP8 bytes packed in `bytes` at out[offset...]: one store when allowed.
template <typename pack_t>
__device__ __forceinline__ void store_fp8(uint8_t* __restrict__ out, int64_t offset, pack_t bytes, int64_t valid,
                                          bool aligned) {
  constexpr int kBytes = static_cast<int>(sizeof(pack_t));
  if (aligned && valid >= kBytes) {
    *reinterpret_cast<pack_t*>(out + offset) = bytes;
    return;
  }
#pragma unroll
  for (int j = 0; j < kBytes; ++j) {
    if (j < valid) out[offset + j] = static_cast<uint8_t>(bytes >> (8 * j));
  }
}

// data = cast_to_fp8(x * q), element by element, packed little-endian.
template <typename scalar_t, Fp8Format kFormat>
__device__ __forceinline__ typename Lanes<scalar_t>::fp8_pack_t cast_vector(const uint4& v, float q) {
  using L = Lanes<scalar_t>;
  using pack_t = typename L::fp8_pack_t;
  pack_t out = 0;
#pragma unroll
  for (int j = 0; j < L::kPerVector; ++j) {
    out |= static_cast<pack_t>(cast_to_fp8_bits<kFormat>(__fmul_rn(L::element(v, j), q))) << (8 * j);
  }
  return out;
}

// The same with one q per element (the columns of a tile, for x^T's row-like groups).
template <typename scalar_t, Fp8Format kFormat>
__device__ __forceinline__ typename Lanes<scalar_t>::fp8_pack_t cast_vector(
    const uint4& v, const float (&q)[Lanes<scalar_t>::kPerVector]) {
  using L = Lanes<scalar_t>;
  using pack_t = typename L::fp8_pack_t;
  pack_t out = 0;
#pragma unroll
  for (int j = 0; j < L::kPerVector; ++j) {
    out |= static_cast<pack_t>(cast_to_fp8_bits<kFormat>(__fmul_rn(L::element(v, j), q[j]))) << (8 * j);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Reductions of fp32 bits (non-negative: max_bits is the numeric max, NaN above inf).
// ---------------------------------------------------------------------------------------------------

// This thread's kUnroll vectors of the grid-stride step at `base` (zeros past num_vectors), all loaded before any
// is used; vector u of the step is base + u * kThreads + threadIdx.x.
__device__ __forceinline__ void load_step(const uint4* __restrict__ vectors, int64_t base, int64_t num_vectors,
                                          uint4 (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads + threadIdx.x;
    v[u] = i < num_vectors ? __ldg(vectors + i) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Max over each aligned group of `width` lanes (a power of two <= 32); every lane gets its group's.
__device__ __forceinline__ uint32_t lanes_max(uint32_t value, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    value = max_bits(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// Blocks of `kernel` one SM holds at once. Callers compute it once per kernel (a function-local
// static): a process with GPUs of different kinds gets grids sized for the first one, which changes
// the speed, not the results.
template <typename Kernel>
int resident_blocks(Kernel kernel) {
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
  return std::max(blocks, 1);
}

// Blocks for `work` independent pieces: at most what the SMs hold at once (the kernels loop over the rest).
inline unsigned grid_size(int resident_per_sm, int64_t work) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(work, sms * resident_per_sm)));
}

inline bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % kVectorBytes == 0; }

}  // namespace fastmesh

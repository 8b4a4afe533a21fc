// Element math of the abs-max reduction, shared by the CPU and CUDA kernels so that the CPU build
// tests exactly the code the GPU runs.
//
// The reduction works on the IEEE-754 bit pattern of |x|: with the sign bit cleared, the unsigned
// order of the bits is the numeric order of the magnitudes, +inf (0x7f800000) sorts above every
// finite value and every NaN (exponent all ones, mantissa non-zero) sorts above +inf. An unsigned
// max therefore yields the largest magnitude, propagates inf, and lets any NaN win, which matches
// torch.amax(x.abs()). On the GPU it also makes the cross-block combine a single atomicMax.
#pragma once

#include <cstdint>
#include <cstring>

#include "fastmesh/macros.h"

namespace fastmesh {

constexpr uint32_t kFloatSignMask = 0x7fffffffu;

// The bit pattern of |x|, canonicalised so that NaNs compare above +inf.
FASTMESH_HOST_DEVICE FASTMESH_INLINE uint32_t abs_bits(float x) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(x);
#else
  std::memcpy(&bits, &x, sizeof(bits));
#endif
  return bits & kFloatSignMask;
}

FASTMESH_HOST_DEVICE FASTMESH_INLINE float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

FASTMESH_HOST_DEVICE FASTMESH_INLINE uint32_t max_bits(uint32_t a, uint32_t b) {
  return a > b ? a : b;
}

}  // namespace fastmesh

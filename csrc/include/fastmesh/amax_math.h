// Element math of the abs-max reduction, shared by the CPU and CUDA kernels so that the CPU build
// tests exactly the code the GPU runs.
//
// The reduction works on the raw IEEE-754 bits of the input, in its own width (16 bits for bf16 and
// fp16, 32 for fp32). With the sign bit cleared, the unsigned order of the bits is the numeric order
// of the magnitudes, +inf sorts above every finite value and every NaN (exponent all ones, mantissa
// non-zero) sorts above +inf. An unsigned max therefore yields the largest magnitude, propagates inf,
// and lets any NaN win, which matches torch.amax(x.abs()); it is integer-only, so it vectorizes without
// converting a single element, and on the GPU the cross-block combine is one atomicMax.
#pragma once

#include <cstdint>
#include <cstring>

#include "fastmesh/macros.h"

namespace fastmesh {

// |x| as bits: the sign bit of the input's own width cleared.
template <typename Bits>
FASTMESH_HOST_DEVICE FASTMESH_INLINE Bits magnitude_bits(Bits raw) {
  return static_cast<Bits>(raw & static_cast<Bits>(static_cast<Bits>(~Bits{0}) >> 1));
}

template <typename Bits>
FASTMESH_HOST_DEVICE FASTMESH_INLINE Bits max_bits(Bits a, Bits b) {
  return a > b ? a : b;
}

FASTMESH_HOST_DEVICE FASTMESH_INLINE uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
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

}  // namespace fastmesh

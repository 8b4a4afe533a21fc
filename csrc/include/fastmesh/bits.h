// The raw-bits view of the floating-point types fastmesh kernels read.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "fastmesh/amax_math.h"
#include "fastmesh/macros.h"

namespace fastmesh {

template <typename scalar_t>
struct BitsOf;

template <>
struct BitsOf<float> {
  using type = uint32_t;
  static FASTMESH_HOST_DEVICE FASTMESH_INLINE float to_float(uint32_t bits) { return float_from_bits(bits); }
};

template <>
struct BitsOf<c10::BFloat16> {
  using type = uint16_t;
  static FASTMESH_HOST_DEVICE FASTMESH_INLINE float to_float(uint16_t bits) {
    return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  }
};

template <>
struct BitsOf<c10::Half> {
  using type = uint16_t;
  static FASTMESH_HOST_DEVICE FASTMESH_INLINE float to_float(uint16_t bits) {
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
};

}  // namespace fastmesh

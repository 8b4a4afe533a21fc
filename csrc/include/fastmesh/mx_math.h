// Scale math of the MX cast (OCP Microscaling, MXFP8), shared by the CPU and CUDA kernels and mirrored,
// formula for formula, by kernels/mx_reference.py (the rules are stated there). A block of 32 elements has one
// E8M0 scale 2^e, stored as the biased exponent e + 127 (0xFF: NaN); its elements are cast as
// cast_to_fp8(x * mx_multiplier(bits)). Integer operations on the fp32 bits only: every backend gives the
// same bits, and loops over blocks vectorize.
#pragma once

#include <cstdint>

#include "fastmesh/amax_math.h"
#include "fastmesh/fp8_math.h"
#include "fastmesh/macros.h"

namespace fastmesh {

constexpr int64_t kMxBlock = 32;
constexpr uint32_t kE8M0Bias = 127;
constexpr uint32_t kE8M0Nan = 0xFF;

// "floor": the spec's rule, e = floor(log2(amax)) - emax; "rceil": e = ceil(log2(amax / fp8_max)).
enum class MxRounding : int { kFloor = 0, kRceil = 1 };

// The exponent of the format's largest power of two: 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15.
FASTMESH_HOST_DEVICE FASTMESH_INLINE constexpr int32_t fp8_emax(Fp8Format format) {
  return format == Fp8Format::kE4M3FN ? 8 : 15;
}

FASTMESH_HOST_DEVICE FASTMESH_INLINE int32_t clamp_exponent(int32_t e, int32_t lo, int32_t hi) {
  return e < lo ? lo : (e > hi ? hi : e);
}

// The biased E8M0 exponent of a block whose largest magnitude is `amax` (fp32, NaN if the block has one).
FASTMESH_HOST_DEVICE FASTMESH_INLINE uint8_t mx_scale_bits(float amax, Fp8Format format, MxRounding rounding) {
  constexpr int32_t kBias = static_cast<int32_t>(kE8M0Bias);
  if (rounding == MxRounding::kFloor) {
    // amax's exponent field: a zero or subnormal amax counts as 2^-127, an infinite one as 2^128.
    const uint32_t bits = float_to_bits(amax) & 0x7fffffffu;
    const int32_t e = static_cast<int32_t>(bits >> 23) - kBias - fp8_emax(format);
    const uint32_t biased = static_cast<uint32_t>(clamp_exponent(e, -kBias, kBias + 1) + kBias);
    return static_cast<uint8_t>(bits > 0x7f800000u ? kE8M0Nan : biased);
  }
  const uint32_t d = float_to_bits(amax / fp8_max(format)) & 0x7fffffffu;  // IEEE division, rounded to nearest
  const int32_t field = static_cast<int32_t>(d >> 23);
  const uint32_t mantissa = d & 0x7fffffu;
  // ceil(log2(d)), exactly: a normal d's exponent, plus one unless d is a power of two; a subnormal d
  // (m * 2^-149, 0 < m < 2^23) lies in (2^-127, 2^-126) when m > 2^22, else at or below 2^-127.
  const int32_t e = field != 0 ? field - kBias + (mantissa != 0) : (mantissa > (1u << 22) ? -126 : -kBias);
  const uint32_t biased = static_cast<uint32_t>(clamp_exponent(e, -kBias, kBias) + kBias);
  return static_cast<uint8_t>(d > 0x7f800000u ? kE8M0Nan : (d == 0x7f800000u ? 0xFEu : biased));
}

// The multiplier the block's elements are cast with: 1 / scale as each rule defines it. "floor" divides by
// max(2^e, 2^-126) (so 2^126 for the biased exponent 0) and by infinity for NaN (0: NaN elements stay NaN);
// "rceil" multiplies by 2^-e, 1 for the biased exponent 0, 2^-127 for 0xFE, NaN for 0xFF. A multiplication by
// an exact power of two rounds as the division does.
FASTMESH_HOST_DEVICE FASTMESH_INLINE float mx_multiplier(uint8_t bits, MxRounding rounding) {
  const uint32_t b = bits;
  // 2^(127 - b) for 1 <= b <= 253 is normal: biased fp32 exponent 254 - b; 2^-127 is the subnormal 0x00400000.
  const float power = b <= 253u ? float_from_bits((254u - b) << 23) : float_from_bits(0x00400000u);
  if (rounding == MxRounding::kFloor) {
    return b == 0u ? float_from_bits(253u << 23) : (b == kE8M0Nan ? 0.0f : power);
  }
  return b == 0u ? 1.0f : (b == kE8M0Nan ? float_from_bits(0x7fc00000u) : power);
}

}  // namespace fastmesh

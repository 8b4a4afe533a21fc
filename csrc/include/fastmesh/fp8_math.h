// Element math of FP8 cast-and-scale, shared by the CPU and CUDA kernels (and mirrored, formula for
// formula, by the plain-PyTorch reference in kernels/fp8_reference.py), so that the CPU build tests
// exactly the code the GPU runs.
//
// Conventions (the op contract, see fastmesh/ops/fp8_quantize.py):
//   q     = quant_scale_from_amax(amax)      the multiplier applied to x, fp32
//   data  = cast_to_fp8(x * q)               one fp32 multiply, then a saturating RNE cast
//   scale = 1 / q                            the dequantization scale returned: x ~= data * scale
// With a given (delayed) dequantization scale s, q = 1 / s.
//
// The casts are written with integer operations on the fp32 bits, branch-free, so that compilers
// vectorize them and every backend (host compiler, nvcc) produces the same bits.
#pragma once

#include <cstdint>

#include "fastmesh/amax_math.h"
#include "fastmesh/macros.h"

namespace fastmesh {

enum class Fp8Format : int { kE4M3FN = 0, kE5M2 = 1 };

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kFloatMax = 3.40282346638528859812e+38f;

FASTMESH_HOST_DEVICE FASTMESH_INLINE constexpr float fp8_max(Fp8Format format) {
  return format == Fp8Format::kE4M3FN ? kE4M3Max : kE5M2Max;
}

// The multiplier q that maps a group whose largest magnitude is `amax` onto the FP8 range.
//   amax == 0         -> 1 (an all-zero group: data 0, scale 1, both finite)
//   fp8_max / amax    -> rounded to nearest fp32; a tiny (subnormal) amax that overflows the division
//                        is clamped to FLT_MAX so that the scale stays finite
//   amax == inf       -> 0 (scale inf: the group dequantizes to non-finite values, as it should)
//   amax is NaN       -> NaN (the whole group becomes NaN)
//   power_of_two      -> rounded down to a power of two (mantissa bits cleared); exact to invert
// Selects instead of branches, so that a loop over many groups vectorizes (the division also runs for
// amax == 0, giving inf, which the last select replaces).
FASTMESH_HOST_DEVICE FASTMESH_INLINE float quant_scale_from_amax(float amax, float max_value, bool power_of_two) {
  float q = max_value / amax;
  q = q > kFloatMax ? kFloatMax : q;
  // Where it is selected, q is normal (q >= 448 / FLT_MAX > FLT_MIN), so clearing the mantissa floors it to 2^k.
  const float floored = float_from_bits(float_to_bits(q) & 0xff800000u);
  q = power_of_two && q > 0.0f && q <= kFloatMax ? floored : q;
  return amax == 0.0f ? 1.0f : q;
}

// fp32 -> FP8 with round-to-nearest-even and saturation to +-max (infinities included); NaN -> 0x7F.
// Returns the FP8 bit pattern.
//
// The magnitude is clamped to the largest finite FP8 value, then rounded to FP8 precision by one fp32
// addition: adding 2^(e + 23 - mantissa_bits), where 2^e is the magnitude's binade (at least the smallest
// normal FP8 binade, so that subnormal results round at the subnormal spacing), leaves exactly the bits
// FP8 keeps in the sum's mantissa, rounded to nearest even by the fp32 adder; a carry moves into the next
// binade by itself. The sum's low bits then hold the rounded magnitude in FP8 ulps of that binade (the
// implicit leading one included, as 2^mantissa_bits), so adding (e - e_min) << mantissa_bits gives the
// code. Only integer and fp32 operations without branches: compilers vectorize it and every backend
// produces the same bits. It equals the exact round-to-nearest-even cast for all 2^32 inputs (checked
// exhaustively, both formats).
template <Fp8Format kFormat>
FASTMESH_HOST_DEVICE FASTMESH_INLINE uint8_t cast_to_fp8_bits(float value) {
  constexpr bool kE4M3 = kFormat == Fp8Format::kE4M3FN;
  constexpr int kMantissaBits = kE4M3 ? 3 : 2;
  constexpr int kMinExponent = kE4M3 ? -6 : -14;  // of the smallest normal FP8 value
  constexpr int kDropBits = 23 - kMantissaBits;
  constexpr uint32_t kMaxBits = kE4M3 ? 0x43e00000u : 0x47600000u;  // fp32 bits of 448, 57344
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + kMinExponent) << 23;
  constexpr uint32_t kMinNormalCode = static_cast<uint32_t>(127 + kMinExponent) << kMantissaBits;

  const uint32_t bits = float_to_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  // On bits, since magnitudes order like their bit patterns; NaN clamps too and is replaced at the end.
  const uint32_t clamped = magnitude < kMaxBits ? magnitude : kMaxBits;
  const uint32_t binade = max_bits(clamped & 0x7f800000u, kMinNormalBits);
  const uint32_t rounder = binade + (static_cast<uint32_t>(kDropBits) << 23);
  const uint32_t sum = float_to_bits(float_from_bits(clamped) + float_from_bits(rounder));
  const uint32_t code = (sum - rounder) + (binade >> kDropBits) - kMinNormalCode;
  // NaN -> 0x7F: its code (that of the clamped max) is below 0x7F, and its sign is dropped. Integer
  // selects only, so that the fp32 addition above is never moved under a condition: compilers may not
  // speculate an addition that could raise an FP exception, and could then vectorize a loop of casts
  // only with AVX-512 masking.
  const bool is_nan = magnitude > 0x7f800000u;
  const uint32_t sign = is_nan ? 0u : (bits >> 24) & 0x80u;
  return static_cast<uint8_t>(max_bits(code, is_nan ? 0x7fu : 0u) | sign);
}

FASTMESH_HOST_DEVICE FASTMESH_INLINE uint8_t cast_to_fp8_bits(float value, Fp8Format format) {
  return format == Fp8Format::kE4M3FN ? cast_to_fp8_bits<Fp8Format::kE4M3FN>(value)
                                      : cast_to_fp8_bits<Fp8Format::kE5M2>(value);
}

}  // namespace fastmesh

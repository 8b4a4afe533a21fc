// CPU kernel of fastmesh::fp8_quantize_native: FP8 cast-and-scale at every granularity, with an
// optional transposed copy, equal bit for bit to kernels/fp8_reference.py (NaN is written as 0x7F).
//
// The element math is fastmesh/fp8_math.h, shared with the CUDA kernel; x is read as a row-major
// [m, k] matrix. Passes over x:
//   tensorwise               current scaling: an amax pass, then a cast pass. Given scale or amax: one
//                            pass (the amax of a given-scale call is taken span by span, in cache)
//   rowwise, block1x128      one pass over batches of rows: the groups' amaxes, then the cast, while the
//                            batch is in L1
//   block128x128, transpose  one pass over regions of 128 rows x 1024 columns (kept in L2): the amaxes
//                            of the groups inside, the cast, and with transpose the transposed 128 x 128
//                            tiles, so that every row of data_t is written 128 contiguous bytes at a time
//   rowwise + transpose      an amax pass for the row and column amaxes, then the region pass
// Each cast overlaps the memory reads of the next batch or region (quantize_overlapped).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cast_loops.h"
#include "fastmesh/fp8_checks.h"
#include "fastmesh/fp8_math.h"
#include "magnitude.h"

namespace fastmesh {
namespace cpu {
namespace {

constexpr const char* kOp = "fastmesh::fp8_quantize";
// Bytes of x per batch of rows (rowwise, block1x128): the batch is read twice, for the amax and for
// the cast, and the second read should hit L1.
constexpr int64_t kBatchBytes = 16 * 1024;
// Elements per span of the tensorwise pass with a given scale, for the same reason.
constexpr int64_t kFlatSpan = 8 * 1024;
// Columns of a region (block128x128, transpose): 128 rows of 1024 columns stay in L2 between passes.
constexpr int64_t kRegionCols = 8 * kFp8Block;

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Element loops. The cast is branch-free integer/fp32 code, so these vectorize; each is compiled per
// ISA (FASTMESH_CPU_CLONES) through one plain overload per (input dtype, FP8 format).

template <typename scalar_t, Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE void quantize_run(const scalar_t* x, int64_t n, float q, uint8_t* __restrict out) {
  const auto* raw = reinterpret_cast<const bits_t<scalar_t>*>(x);
  for (int64_t i = 0; i < n; ++i) out[i] = cast_to_fp8_bits<kFormat>(to_float<scalar_t>(raw[i]) * q);
}

// Two of MX's 32-wide blocks: one 64-element loop, the multiplier selected per half. It runs as fast as a row-wide
// loop, where a 32-element loop per block spends a third of its time between blocks (measured: 7.5 vs 11 ns per
// block of bf16, AVX-512).
template <typename scalar_t, Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE void quantize_mx_pair(const scalar_t* x, float q0, float q1, uint8_t* __restrict out) {
  const auto* raw = reinterpret_cast<const bits_t<scalar_t>*>(x);
  for (int64_t i = 0; i < 2 * kMxBlock; ++i) {
    out[i] = cast_to_fp8_bits<kFormat>(to_float<scalar_t>(raw[i]) * (i < kMxBlock ? q0 : q1));
  }
}

// n MX blocks through quantize_mx_pair (and the last odd one through a 32-wide quantize_run).
template <typename scalar_t, Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE void quantize_mx_blocks(const scalar_t* x, const float* q, int64_t n, uint8_t* __restrict out) {
  int64_t b = 0;
  for (; b + 2 <= n; b += 2) quantize_mx_pair<scalar_t, kFormat>(x + b * kMxBlock, q[b], q[b + 1], out + b * kMxBlock);
  if (b < n) quantize_run<scalar_t, kFormat>(x + b * kMxBlock, kMxBlock, q[b], out + b * kMxBlock);
}

// bf16 times a power of two, cast on the bits. With q = 2^t, x * q is exact in fp32 unless it is tiny, so its
// bits are x's with t added to the exponent field, and the cast only has to round bf16's 7 mantissa bits to FP8's:
// 16-bit integer lanes, fixed shifts, no widening and no multiply. MX multipliers are such powers of two.
// shift_exponent's k is the product's FP8 biased exponent minus x's bf16 one.
template <Fp8Format kFormat>
struct Bf16Shift {
  static constexpr bool kE4M3 = kFormat == Fp8Format::kE4M3FN;
  static constexpr int kDropBits = kE4M3 ? 4 : 5;  // bf16's 7 mantissa bits less FP8's
  static constexpr int kFp8Bias = kE4M3 ? 7 : 15;
  static constexpr int16_t kMaxCode = kE4M3 ? 0x7e : 0x7b;  // 448, 57344
  // The rounded sum that saturates to kMaxCode: below bit 7 + kDropBits, where the cast puts the sign.
  static constexpr int16_t kMaxSum = (kMaxCode << kDropBits) | ((1 << kDropBits) - 1);
  static_assert(kMaxSum < (0x80 << kDropBits), "the sign's bit must be free");
  static constexpr int32_t kNone = 1;  // no shift_exponent: q is not 2^t with k <= 0

  // k for q = 2^t (biased fp32 exponent t + 127, no mantissa), or kNone. k <= 0 keeps every bf16 subnormal below
  // FP8's normal range, where the lanes below reject it.
  static FASTMESH_ALWAYS_INLINE int32_t shift_exponent(float q) {
    const uint32_t bits = float_to_bits(q);
    const int32_t field = static_cast<int32_t>(bits >> 23);
    const int32_t k = field - 254 + kFp8Bias;
    return (bits & 0x807fffffu) == 0 && field >= 1 && k <= 0 ? k : kNone;
  }

  // The FP8 code of the bf16 bits x times 2^k, step = k * 128 (k in the exponent field), exact where the code is
  // normal, zero or saturated. A lane's rejection state: below_normal gets its sign bit set where a non-zero
  // magnitude falls below FP8's normal range (variable shifts would round it, which most ISAs lack on 16-bit lanes),
  // largest is the largest magnitude (inf and NaN are those from 0x7f80 on). 16-bit adds, logic and maxima only,
  // which AVX2 has too.
  static FASTMESH_ALWAYS_INLINE uint8_t cast(uint16_t x, uint16_t step, int16_t& below_normal, int16_t& largest) {
    const auto magnitude = static_cast<int16_t>(x & 0x7fff);
    largest = largest > magnitude ? largest : magnitude;
    // FP8's exponent and bf16's mantissa (0 for a zero), rounded to nearest even by the dropped bits. The exponent
    // is below 1 (no normal FP8 code) where shifted < 1 << 7.
    const auto shifted = static_cast<int16_t>(static_cast<uint16_t>(magnitude) + step);
    // The sign bits of shifted - (1 << 7) and of ~(magnitude - 1): an and and an or, not two compares and a select.
    below_normal |= static_cast<int16_t>(shifted - (1 << 7)) & ~static_cast<int16_t>(magnitude - 1);
    const int16_t bits = shifted > 0 ? shifted : 0;
    const int16_t odd = (bits >> kDropBits) & 1;
    const auto sum = static_cast<int16_t>(bits + ((1 << (kDropBits - 1)) - 1) + odd);
    // x's sign just above the saturated sum, so that the rounding's shift leaves code and sign in the low byte: one
    // narrowing per vector, where OR-ing the sign into the narrowed code took two.
    const auto word =
        static_cast<uint16_t>((sum < kMaxSum ? sum : kMaxSum) | ((x >> (8 - kDropBits)) & (0x80 << kDropBits)));
    return static_cast<uint8_t>(word >> kDropBits);
  }

  static FASTMESH_ALWAYS_INLINE bool rejects(int16_t below_normal, int16_t largest) {
    return below_normal < 0 || largest >= 0x7f80;
  }
};

// A row's MX blocks go to quantize_mx_blocks_shifted this many at a time.
constexpr int64_t kMxGroup = 8;

// out[i] = cast_to_fp8_bits(x[i] * q[i / 32]), bit for bit, for the bf16 bits of n MX blocks, two at a time as in
// quantize_mx_pair (a last odd block through quantize_mx_blocks), in Bf16Shift's lanes; false (out then holds
// garbage, for quantize_mx_blocks to overwrite) when a multiplier has no shift_exponent or a lane rejects. In
// torch.randn bf16 that is one group of 8 blocks in 40-43 for e4m3fn (rceil-floor, counted through
// fastmesh._C.mx_bf16_lanes), none for e5m2.
//
// The rejections are gathered per lane and tested once per call: a horizontal OR per pair of blocks took about a
// third of the pairs' time.
template <Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE bool quantize_mx_blocks_shifted(const uint16_t* x, const float* q, int64_t n,
                                                       uint8_t* __restrict out) {
  using Shift = Bf16Shift<kFormat>;
  int16_t below_normal[2 * kMxBlock] = {}, largest[2 * kMxBlock] = {};
  int64_t b = 0;
  for (; b + 2 <= n; b += 2) {
    const int32_t k0 = Shift::shift_exponent(q[b]), k1 = Shift::shift_exponent(q[b + 1]);
    if (k0 == Shift::kNone || k1 == Shift::kNone) return false;
    const uint16_t* pair = x + b * kMxBlock;
    uint8_t* pair_out = out + b * kMxBlock;
    // The steps as 16-bit scalars: a broadcast per block (k per element was widened and permuted).
    const auto step0 = static_cast<uint16_t>(k0 * 128), step1 = static_cast<uint16_t>(k1 * 128);
    for (int64_t i = 0; i < 2 * kMxBlock; ++i) {
      pair_out[i] = Shift::cast(pair[i], i < kMxBlock ? step0 : step1, below_normal[i], largest[i]);
    }
  }
  int16_t any_below = 0, any_largest = 0;
  for (int64_t i = 0; i < 2 * kMxBlock; ++i) {
    any_below |= below_normal[i];
    any_largest = any_largest > largest[i] ? any_largest : largest[i];
  }
  if (Shift::rejects(any_below, any_largest)) return false;
  quantize_mx_blocks<c10::BFloat16, kFormat>(reinterpret_cast<const c10::BFloat16*>(x) + b * kMxBlock, q + b, n - b,
                                             out + b * kMxBlock);
  return true;
}

// out[r, c] = fp8(x[r, c] * q[r * q_stride + c / block])
template <typename scalar_t, Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE void quantize_panel_impl(Panel<const scalar_t> x, int64_t block, const float* q,
                                                int64_t q_stride, Panel<uint8_t> out) {
  const int64_t blocks = ceil_div(x.cols, block);
  for (int64_t r = 0; r < x.rows; ++r) {
    int64_t b = 0;
    if (block == kMxBlock) {
      for (const int64_t full = x.cols / kMxBlock; b < full; b += kMxGroup) {
        const int64_t n = std::min(kMxGroup, full - b);
        const scalar_t* in = x.row(r) + b * kMxBlock;
        const float* group_q = q + r * q_stride + b;
        uint8_t* group_out = out.row(r) + b * kMxBlock;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (quantize_mx_blocks_shifted<kFormat>(reinterpret_cast<const uint16_t*>(in), group_q, n, group_out)) {
            continue;
          }
        }
        quantize_mx_blocks<scalar_t, kFormat>(in, group_q, n, group_out);
      }
    }
    for (; b < blocks; ++b) {
      const int64_t col0 = b * block, n = std::min(block, x.cols - col0);
      const scalar_t* in = x.row(r) + col0;
      uint8_t* row_out = out.row(r) + col0;
      // A constant trip count for full 128-wide blocks: straight vector loops without remainder code.
      if (n == kFp8Block) {
        quantize_run<scalar_t, kFormat>(in, kFp8Block, q[r * q_stride + b], row_out);
      } else {
        quantize_run<scalar_t, kFormat>(in, n, q[r * q_stride + b], row_out);
      }
    }
  }
}

// out[r, c] = fp8(x[r, c] * q[c])
template <typename scalar_t, Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE void quantize_columns_impl(Panel<const scalar_t> x, const float* q, Panel<uint8_t> out) {
  for (int64_t r = 0; r < x.rows; ++r) {
    const auto* raw = reinterpret_cast<const bits_t<scalar_t>*>(x.row(r));
    uint8_t* __restrict row_out = out.row(r);
    for (int64_t c = 0; c < x.cols; ++c) row_out[c] = cast_to_fp8_bits<kFormat>(to_float<scalar_t>(raw[c]) * q[c]);
  }
}

// out[r, c] = fp8(x[r, c] * q[c]) for the bf16 bits of at most kFp8Block columns, one Bf16Shift lane per column,
// and the columns whose multiplier has no shift_exponent or whose lane rejects cast again by the fp32 loop; returns
// how many those were. The transposed MX pass casts each column's 32-row block so.
template <Fp8Format kFormat, int64_t kMaxCols = kFp8Block>
FASTMESH_ALWAYS_INLINE int64_t quantize_columns_shifted(Panel<const c10::BFloat16> x, const float* q,
                                                        Panel<uint8_t> out) {
  using Shift = Bf16Shift<kFormat>;
  uint16_t step[kMaxCols];
  int16_t below_normal[kMaxCols] = {}, largest[kMaxCols];
  const int64_t cols = x.cols;
  for (int64_t c = 0; c < cols; ++c) {
    const int32_t k = Shift::shift_exponent(q[c]);
    step[c] = static_cast<uint16_t>(k * 128);
    largest[c] = k == Shift::kNone ? int16_t{0x7fff} : int16_t{0};  // a lane rejected from the start
  }
  const auto cast_rows = [&](int64_t n) {
    for (int64_t r = 0; r < x.rows; ++r) {
      const auto* row = reinterpret_cast<const uint16_t*>(x.row(r));
      uint8_t* __restrict row_out = out.row(r);
      for (int64_t c = 0; c < n; ++c) row_out[c] = Shift::cast(row[c], step[c], below_normal[c], largest[c]);
    }
  };
  // A constant trip count for full tiles: straight vector loops without remainder code.
  if (cols == kMaxCols) {
    cast_rows(kMaxCols);
  } else {
    cast_rows(cols);
  }
  bool any_rejected = false;
  for (int64_t c = 0; c < cols; ++c) any_rejected |= Shift::rejects(below_normal[c], largest[c]);
  if (!any_rejected) return 0;
  int64_t recast = 0;
  for (int64_t c = 0; c < cols; ++c) {
    if (!Shift::rejects(below_normal[c], largest[c])) continue;
    quantize_columns_impl<c10::BFloat16, kFormat>(x.sub(0, c, x.rows, 1), q + c, out.sub(0, c, out.rows, 1));
    ++recast;
  }
  return recast;
}

template <typename scalar_t, Fp8Format kFormat>
FASTMESH_ALWAYS_INLINE int64_t quantize_mx_columns_impl(Panel<const scalar_t> x, const float* q, Panel<uint8_t> out) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return quantize_columns_shifted<kFormat>(x, q, out);
  } else {
    quantize_columns_impl<scalar_t, kFormat>(x, q, out);
    return x.cols;
  }
}

#define FASTMESH_DEFINE_QUANTIZE_LOOPS(scalar_t, Tag)                                                                 \
  FASTMESH_CPU_CLONES void quantize_panel(Panel<const scalar_t> x, int64_t block, const float* q, int64_t q_stride,   \
                                          Panel<uint8_t> out, Tag) {                                                  \
    quantize_panel_impl<scalar_t, Tag::value>(x, block, q, q_stride, out);                                            \
  }                                                                                                                   \
  FASTMESH_CPU_CLONES void quantize_columns(Panel<const scalar_t> x, const float* q, Panel<uint8_t> out, Tag) {       \
    quantize_columns_impl<scalar_t, Tag::value>(x, q, out);                                                           \
  }                                                                                                                   \
  FASTMESH_CPU_CLONES int64_t quantize_mx_columns(Panel<const scalar_t> x, const float* q, Panel<uint8_t> out, Tag) { \
    return quantize_mx_columns_impl<scalar_t, Tag::value>(x, q, out);                                                 \
  }
FASTMESH_DEFINE_QUANTIZE_LOOPS(float, E4M3)
FASTMESH_DEFINE_QUANTIZE_LOOPS(float, E5M2)
FASTMESH_DEFINE_QUANTIZE_LOOPS(c10::BFloat16, E4M3)
FASTMESH_DEFINE_QUANTIZE_LOOPS(c10::BFloat16, E5M2)
FASTMESH_DEFINE_QUANTIZE_LOOPS(c10::Half, E4M3)
FASTMESH_DEFINE_QUANTIZE_LOOPS(c10::Half, E5M2)
#undef FASTMESH_DEFINE_QUANTIZE_LOOPS

#define FASTMESH_DEFINE_MX_BF16_LANES(Tag)                                                                           \
  FASTMESH_CPU_CLONES bool quantize_mx_bf16_lanes(const uint16_t* x, const float* q, int64_t n, uint8_t* out, Tag) { \
    return quantize_mx_blocks_shifted<Tag::value>(x, q, n, out);                                                     \
  }
FASTMESH_DEFINE_MX_BF16_LANES(E4M3)
FASTMESH_DEFINE_MX_BF16_LANES(E5M2)
#undef FASTMESH_DEFINE_MX_BF16_LANES

namespace {

// 16 bytes; element-wise vector constructors from two such vectors compile to byte shuffles (punpck*)
// with GCC and Clang alike, without intrinsics.
using Bytes16 = uint8_t __attribute__((vector_size(16)));

FASTMESH_ALWAYS_INLINE Bytes16 interleave_low(Bytes16 a, Bytes16 b) {
  return Bytes16{a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3], a[4], b[4], a[5], b[5], a[6], b[6], a[7], b[7]};
}

FASTMESH_ALWAYS_INLINE Bytes16 interleave_high(Bytes16 a, Bytes16 b) {
  return Bytes16{a[8],  b[8],  a[9],  b[9],  a[10], b[10], a[11], b[11],
                 a[12], b[12], a[13], b[13], a[14], b[14], a[15], b[15]};
}

// A 16 x 16 byte transpose in registers: a round that interleaves row i with row i + 8 (into rows 2i
// and 2i + 1) rotates the 8-bit (row, column) index of every byte left by one bit, so four rounds swap
// row and column.
FASTMESH_ALWAYS_INLINE void transpose_16x16(const uint8_t* src, int64_t src_ld, uint8_t* dst, int64_t dst_ld) {
  Bytes16 rows[16];
  for (int i = 0; i < 16; ++i) std::memcpy(&rows[i], src + i * src_ld, sizeof(Bytes16));
  for (int round = 0; round < 4; ++round) {
    Bytes16 next[16];
    for (int i = 0; i < 8; ++i) {
      next[2 * i] = interleave_low(rows[i], rows[i + 8]);
      next[2 * i + 1] = interleave_high(rows[i], rows[i + 8]);
    }
    std::memcpy(rows, next, sizeof(rows));
  }
  for (int i = 0; i < 16; ++i) std::memcpy(dst + i * dst_ld, &rows[i], sizeof(Bytes16));
}

// dst[0, n) = src[0, n). Full aligned 16-byte pieces are written with non-temporal stores: data_t is
// written in short row pieces far apart, and ordinary stores would first read every one of its cache
// lines from memory (x86; a plain copy elsewhere). Callers fence with finish_row_stores().
FASTMESH_ALWAYS_INLINE void store_row(const uint8_t* src, int64_t n, uint8_t* dst) {
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const int64_t full = n / 16 * 16;
    for (int64_t i = 0; i < full; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    std::memcpy(dst + full, src + full, n - full);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace

// Orders the non-temporal stores of store_row before what the thread does next.
void finish_row_stores() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// dst[c * dst_ld + r] = src[r, c] for a tile of at most kFp8Block x kFp8Block bytes. The transpose goes
// through an L1 buffer, so that every row of dst is then written with whole contiguous stores rather
// than 16-byte pieces spread over many cache lines at once.
FASTMESH_CPU_CLONES void transpose_tile(Panel<const uint8_t> src, uint8_t* dst, int64_t dst_ld) {
  alignas(64) uint8_t buffer[kFp8Block * kFp8Block];
  const int64_t full_rows = src.rows / 16 * 16, full_cols = src.cols / 16 * 16;
  for (int64_t r = 0; r < full_rows; r += 16) {
    for (int64_t c = 0; c < full_cols; c += 16) {
      transpose_16x16(src.row(r) + c, src.ld, buffer + c * kFp8Block + r, kFp8Block);
    }
  }
  for (int64_t r = 0; r < src.rows; ++r) {
    for (int64_t c = r < full_rows ? full_cols : 0; c < src.cols; ++c) buffer[c * kFp8Block + r] = src.row(r)[c];
  }
  for (int64_t c = 0; c < src.cols; ++c) store_row(buffer + c * kFp8Block, src.rows, dst + c * dst_ld);
}

namespace {

// q[i] for n groups: 1 / given_scale[i] if given_scale, else from amax[i] (quant_scale_from_amax).
FASTMESH_CPU_CLONES void group_multipliers(const float* given_scale, const float* amax, int64_t n, float max_value,
                                           bool power_of_two, float* __restrict q) {
  if (given_scale != nullptr) {
    for (int64_t i = 0; i < n; ++i) q[i] = 1.0f / given_scale[i];
  } else {
    for (int64_t i = 0; i < n; ++i) q[i] = quant_scale_from_amax(amax[i], max_value, power_of_two);
  }
}

FASTMESH_CPU_CLONES void reciprocals(const float* q, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = 1.0f / q[i];
}

// ---------------------------------------------------------------------------------------------------
// Scales and the passes.

// Where the multiplier q of a group comes from: (c) a given dequantization scale, else (a, b) an amax:
// the given one, or the op's amax output once a pass has filled it.
struct ScaleRule {
  float fp8_max;
  bool power_of_two;
  const float* given_scale;
  const float* amax;

  // q of groups [group0, group0 + n).
  void multipliers(int64_t group0, int64_t n, float* q) const {
    if (given_scale != nullptr) {
      group_multipliers(given_scale + group0, nullptr, n, fp8_max, power_of_two, q);
    } else {
      group_multipliers(nullptr, amax + group0, n, fp8_max, power_of_two, q);
    }
  }
  // q from amaxes gathered by the caller (current scaling).
  void multipliers_from(const float* group_amax, int64_t n, float* q) const {
    group_multipliers(nullptr, group_amax, n, fp8_max, power_of_two, q);
  }
};

template <typename scalar_t>
struct Job {
  Panel<const scalar_t> x;  // [m, k]
  Granularity granularity;
  Rows grid;          // groups of x along m and k
  ScaleRule rule;     // for the groups of x
  float* amax;        // amax of the groups of x (the op's output)
  bool compute_amax;  // whether the cast pass computes `amax` (else it is known before)
  uint8_t* data;      // [m, k]
  // transpose=True only: data_t [k, m] and, for rowwise and block1x128, the groups of x^T (for the
  // other granularities data_t is the transpose of data).
  uint8_t* data_t;
  Rows grid_t;
  ScaleRule rule_t;
  float* amax_t;
};

template <typename scalar_t>
Panel<uint8_t> data_panel(const Job<scalar_t>& job) {
  return {job.data, job.x.rows, job.x.cols, job.x.cols};
}

// tensorwise without transpose. The multiplier is known before the pass: a given scale, or an amax that
// was given or computed by a first pass.
template <typename scalar_t, typename Tag>
void quantize_flat(const Job<scalar_t>& job) {
  using bits = bits_t<scalar_t>;
  const int64_t numel = job.x.rows * job.x.cols;
  const Panel<const scalar_t> x{job.x.data, 1, numel, numel};
  const Panel<uint8_t> out{job.data, 1, numel, numel};
  float q;
  job.rule.multipliers(0, 1, &q);
  const bits amax = at::parallel_reduce(
      0, numel, kGrainSize, bits{0},
      [&](int64_t begin, int64_t end, bits acc) {
        for (int64_t col0 = begin; col0 < end; col0 += kFlatSpan) {
          const int64_t cols = std::min(kFlatSpan, end - col0);
          const auto span = x.sub(0, col0, 1, cols);
          if (!job.compute_amax) {
            quantize_panel(span, cols, &q, 0, out.sub(0, col0, 1, cols), Tag{});
            continue;
          }
          bits span_amax;
          max_magnitude_blocks(as_bits(span), cols, &span_amax);
          acc = max_bits(acc, span_amax);
          const auto next = x.sub(0, col0 + cols, 1, std::min(kFlatSpan, numel - col0 - cols));
          quantize_overlapped<scalar_t, Tag>(span, numel, &q, 0, out.sub(0, col0, 1, cols), next);
        }
        return acc;
      },
      [](bits a, bits b) { return max_bits(a, b); });
  if (job.compute_amax) job.amax[0] = to_float<scalar_t>(amax);
}

// rowwise and block1x128 without transpose: a batch of rows holds whole groups.
template <typename scalar_t, typename Tag>
void quantize_rows(const Job<scalar_t>& job) {
  const auto& x = job.x;
  const int64_t block = group_extent(job.granularity, {x.rows, x.cols}).k;
  const int64_t blocks = job.grid.k;
  const int64_t batch = std::max<int64_t>(1, kBatchBytes / (x.cols * static_cast<int64_t>(sizeof(scalar_t))));
  at::parallel_for(0, x.rows, std::max<int64_t>(1, kGrainSize / x.cols), [&](int64_t begin, int64_t end) {
    std::vector<bits_t<scalar_t>> maxes(batch * blocks);
    std::vector<float> q(batch * blocks);
    for (int64_t row0 = begin; row0 < end; row0 += batch) {
      const auto rows = x.sub(row0, 0, std::min(batch, end - row0), x.cols);
      const int64_t group0 = row0 * blocks, groups = rows.rows * blocks;
      if (job.compute_amax) {
        max_magnitude_blocks(as_bits(rows), block, maxes.data());
        write_amax<scalar_t>(maxes.data(), groups, job.amax + group0);
      }
      job.rule.multipliers(group0, groups, q.data());
      const int64_t next0 = row0 + rows.rows;
      const auto next = x.sub(next0, 0, std::min(batch, x.rows - next0), x.cols);
      quantize_overlapped<scalar_t, Tag>(rows, block, q.data(), blocks, data_panel(job).sub(row0, 0, rows.rows, x.cols),
                                         next);
    }
  });
}

// Per-task buffers of the region pass.
template <typename scalar_t>
struct RegionScratch {
  bits_t<scalar_t> maxes[kFp8Block * (kRegionCols / kFp8Block)];  // per row and tile, or per column
  bits_t<scalar_t> tile_maxes[kRegionCols / kFp8Block];
  float q[kFp8Block * (kRegionCols / kFp8Block)];  // data: per tile, row, or (row, tile)
  float amax_cols[kRegionCols];                    // data_t (block1x128): amax of each column's group
  float q_cols[kRegionCols];                       // data_t: the multiplier of each column
  uint8_t staged[kFp8Block * kFp8Block];           // a tile quantized with q_cols, before its transposition
};

template <typename scalar_t>
Panel<const scalar_t> region_panel(Panel<const scalar_t> x, int64_t stripe, int64_t col0) {
  const int64_t row0 = stripe * kFp8Block;
  return x.sub(row0, col0, std::min(kFp8Block, x.rows - row0), std::min(kRegionCols, x.cols - col0));
}

// How the multipliers of a region's data are laid out: element (r, c) uses q[r * q_stride + c / block].
struct QLayout {
  int64_t block;
  int64_t q_stride;
};

// Fills scratch.q with the multipliers of the region's data, computing (and writing) the amaxes of the
// groups inside the region. `region_amax` gets the region's largest magnitude where that is a partial
// amax (tensorwise with a given scale: a max over the regions).
template <typename scalar_t>
QLayout region_multipliers(const Job<scalar_t>& job, int64_t stripe, int64_t col0, Panel<const scalar_t> region,
                           RegionScratch<scalar_t>& scratch, bits_t<scalar_t>& region_amax) {
  const int64_t row0 = stripe * kFp8Block, tile0 = col0 / kFp8Block, tiles = ceil_div(region.cols, kFp8Block);
  if (job.granularity == Granularity::kTensorwise) {
    if (job.compute_amax) {
      tile_max_bits(as_bits(region), scratch.maxes, scratch.tile_maxes);
      for (int64_t t = 0; t < tiles; ++t) region_amax = max_bits(region_amax, scratch.tile_maxes[t]);
    }
    job.rule.multipliers(0, 1, scratch.q);
    return {region.cols, 0};
  }
  if (job.granularity == Granularity::kRowwise) {  // with transpose; the row amaxes come from the amax pass
    job.rule.multipliers(row0, region.rows, scratch.q);
    return {region.cols, 1};
  }
  if (job.granularity == Granularity::kBlock1x128) {
    if (job.compute_amax) max_magnitude_blocks(as_bits(region), kFp8Block, scratch.maxes);
    for (int64_t r = 0; r < region.rows; ++r) {
      const int64_t group0 = (row0 + r) * job.grid.k + tile0;
      if (job.compute_amax) write_amax<scalar_t>(scratch.maxes + r * tiles, tiles, job.amax + group0);
      job.rule.multipliers(group0, tiles, scratch.q + r * tiles);
    }
    return {kFp8Block, tiles};
  }
  // block128x128: the region's 128 x 128 tiles.
  const int64_t group0 = stripe * job.grid.k + tile0;
  if (job.compute_amax) {
    tile_max_bits(as_bits(region), scratch.maxes, scratch.tile_maxes);
    write_amax<scalar_t>(scratch.tile_maxes, tiles, job.amax + group0);
  }
  job.rule.multipliers(group0, tiles, scratch.q);
  return {kFp8Block, 0};
}

// Fills scratch.q_cols with the multipliers of the groups of x^T over the region's columns: whole
// columns (rowwise, amaxes from the amax pass) or the stripe's 128-row piece of each column
// (block1x128, computed and written here).
template <typename scalar_t>
void region_column_multipliers(const Job<scalar_t>& job, int64_t stripe, int64_t col0, Panel<const scalar_t> region,
                               RegionScratch<scalar_t>& scratch) {
  if (job.granularity == Granularity::kRowwise) {
    job.rule_t.multipliers(col0, region.cols, scratch.q_cols);
    return;
  }
  std::fill_n(scratch.maxes, region.cols, bits_t<scalar_t>{0});
  max_magnitude_columns(as_bits(region), scratch.maxes);
  write_amax<scalar_t>(scratch.maxes, region.cols, scratch.amax_cols);
  for (int64_t c = 0; c < region.cols; ++c) job.amax_t[(col0 + c) * job.grid_t.k + stripe] = scratch.amax_cols[c];
  job.rule_t.multipliers_from(scratch.amax_cols, region.cols, scratch.q_cols);
}

// Writes the region's part of data_t, tile by tile (a tile is in L1 while it is transposed).
template <typename scalar_t, typename Tag>
void transpose_region(const Job<scalar_t>& job, int64_t stripe, int64_t col0, Panel<const scalar_t> region,
                      Panel<uint8_t> region_out, RegionScratch<scalar_t>& scratch) {
  // Where the groups of x^T are those of x transposed, data_t is data transposed.
  const bool same_groups = job.granularity == Granularity::kTensorwise || job.granularity == Granularity::kBlock128x128;
  if (!same_groups) region_column_multipliers(job, stripe, col0, region, scratch);
  for (int64_t tile_col = 0; tile_col < region.cols; tile_col += kFp8Block) {
    const int64_t cols = std::min(kFp8Block, region.cols - tile_col);
    uint8_t* tile_t = job.data_t + (col0 + tile_col) * job.x.rows + stripe * kFp8Block;
    Panel<uint8_t> quantized = region_out.sub(0, tile_col, region.rows, cols);
    if (!same_groups) {
      quantized = {scratch.staged, region.rows, cols, kFp8Block};
      quantize_columns(region.sub(0, tile_col, region.rows, cols), scratch.q_cols + tile_col, quantized, Tag{});
    }
    transpose_tile(read_only(quantized), tile_t, job.x.rows);
  }
}

// block128x128, and every granularity with transpose: regions of up to 128 rows x kRegionCols.
template <typename scalar_t, typename Tag>
void quantize_regions(const Job<scalar_t>& job) {
  using bits = bits_t<scalar_t>;
  const int64_t regions_per_stripe = ceil_div(job.x.cols, kRegionCols);
  const int64_t regions = ceil_div(job.x.rows, kFp8Block) * regions_per_stripe;
  const auto region_at = [&](int64_t i) {
    return region_panel(job.x, i / regions_per_stripe, i % regions_per_stripe * kRegionCols);
  };
  const bits amax = at::parallel_reduce(
      0, regions, 1, bits{0},
      [&](int64_t begin, int64_t end, bits acc) {
        auto scratch = std::make_unique<RegionScratch<scalar_t>>();
        for (int64_t i = begin; i < end; ++i) {
          const int64_t stripe = i / regions_per_stripe, col0 = i % regions_per_stripe * kRegionCols;
          const auto region = region_at(i);
          const auto region_out = data_panel(job).sub(stripe * kFp8Block, col0, region.rows, region.cols);
          const QLayout layout = region_multipliers(job, stripe, col0, region, *scratch, acc);
          const auto next = i + 1 < regions ? region_at(i + 1) : job.x.sub(0, 0, 0, 0);
          quantize_overlapped<scalar_t, Tag>(region, layout.block, scratch->q, layout.q_stride, region_out, next);
          if (job.data_t != nullptr) transpose_region<scalar_t, Tag>(job, stripe, col0, region, region_out, *scratch);
        }
        finish_row_stores();
        return acc;
      },
      [](bits a, bits b) { return max_bits(a, b); });
  if (job.granularity == Granularity::kTensorwise && job.compute_amax) job.amax[0] = to_float<scalar_t>(amax);
}

// rowwise with transpose: the amax of every row (groups of x) and of every column (groups of x^T).
template <typename scalar_t>
void row_and_column_amax(const Job<scalar_t>& job) {
  using bits = bits_t<scalar_t>;
  const auto& x = job.x;
  const int64_t batch = std::max<int64_t>(1, kBatchBytes / (x.cols * static_cast<int64_t>(sizeof(scalar_t))));
  // One partial column maximum per thread (parallel_reduce runs one task per thread).
  const std::vector<bits> columns = at::parallel_reduce(
      0, x.rows, ceil_div(x.rows, at::get_num_threads()), std::vector<bits>(x.cols, 0),
      [&](int64_t begin, int64_t end, std::vector<bits> acc) {
        std::vector<bits> row_amax(batch);
        for (int64_t row0 = begin; row0 < end; row0 += batch) {
          const auto rows = x.sub(row0, 0, std::min(batch, end - row0), x.cols);
          max_magnitude_blocks(as_bits(rows), x.cols, row_amax.data());
          max_magnitude_columns(as_bits(rows), acc.data());
          write_amax<scalar_t>(row_amax.data(), rows.rows, job.amax + row0);
        }
        return acc;
      },
      [](std::vector<bits> a, const std::vector<bits>& b) {
        for (size_t c = 0; c < a.size(); ++c) a[c] = max_bits(a[c], b[c]);
        return a;
      });
  write_amax<scalar_t>(columns.data(), x.cols, job.amax_t);
}

template <typename scalar_t, typename Tag>
void run_passes(Job<scalar_t> job) {
  const bool transpose = job.data_t != nullptr;
  if (job.compute_amax && job.rule.given_scale == nullptr) {
    // Current scaling where a group spans the whole tensor or a whole column: amaxes first.
    if (job.granularity == Granularity::kTensorwise) {
      job.amax[0] = tensor_amax(job.x);
      job.compute_amax = false;
    } else if (job.granularity == Granularity::kRowwise && transpose) {
      row_and_column_amax(job);
      job.compute_amax = false;
    }
  }
  if (transpose || job.granularity == Granularity::kBlock128x128) {
    quantize_regions<scalar_t, Tag>(job);
  } else if (job.granularity == Granularity::kTensorwise) {
    quantize_flat<scalar_t, Tag>(job);
  } else {
    quantize_rows<scalar_t, Tag>(job);
  }
}

// scale = 1 / q for every group, once every amax is known.
void write_scales(const ScaleRule& rule, at::Tensor& scale) {
  std::vector<float> q(scale.numel());
  rule.multipliers(0, scale.numel(), q.data());
  reciprocals(q.data(), scale.numel(), scale.mutable_data_ptr<float>());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> fp8_quantize_cpu(
    const at::Tensor& x, at::ScalarType dtype, c10::string_view granularity, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& amax, bool transpose, bool power_of_two) {
  const QuantizeCall call = check_quantize_args(x, dtype, granularity, scale, amax, transpose, power_of_two, kOp);
  const Fp8Format format = call.format;
  const Granularity parsed = call.granularity;
  const auto& layout = call.layout;

  const Rows rows = as_rows(x);
  const auto float_options = x.options().dtype(at::kFloat);
  // Groups without elements (an empty x) have amax 0.
  const auto new_amax = [&](at::IntArrayRef sizes) {
    return x.numel() == 0 ? at::zeros(sizes, float_options) : at::empty(sizes, float_options);
  };
  const at::Tensor given_scale = scale.has_value() ? scale->contiguous() : at::Tensor();
  at::Tensor amax_out = amax.has_value() ? amax->clone(at::MemoryFormat::Contiguous) : new_amax(layout);
  at::Tensor scale_out = at::empty(layout, float_options);
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  const ScaleRule rule{fp8_max(format), power_of_two,
                       given_scale.defined() ? given_scale.const_data_ptr<float>() : nullptr,
                       amax_out.const_data_ptr<float>()};

  std::optional<at::Tensor> data_t, scale_t;
  at::Tensor amax_t;  // amax of the groups of x^T where they differ from the transposed groups of x
  const Rows rows_t{rows.k, rows.m};
  const bool own_groups_t = transpose && (parsed == Granularity::kRowwise || parsed == Granularity::kBlock1x128);
  if (transpose) data_t = at::empty({rows.k, rows.m}, x.options().dtype(dtype));
  if (own_groups_t) amax_t = new_amax(scale_sizes(parsed, {rows.k, rows.m}));
  const ScaleRule rule_t{rule.fp8_max, power_of_two, nullptr,
                         amax_t.defined() ? amax_t.const_data_ptr<float>() : nullptr};

  if (x.numel() > 0) {
    dispatch_float_input(x.scalar_type(), [&](auto tag) {
      using scalar_t = decltype(tag);
      const Job<scalar_t> job{matrix_panel(x.const_data_ptr<scalar_t>(), rows),
                              parsed,
                              group_grid(parsed, rows),
                              rule,
                              amax_out.mutable_data_ptr<float>(),
                              !amax.has_value(),
                              static_cast<uint8_t*>(data.mutable_data_ptr()),
                              transpose ? static_cast<uint8_t*>(data_t->mutable_data_ptr()) : nullptr,
                              group_grid(parsed, rows_t),
                              rule_t,
                              amax_t.defined() ? amax_t.mutable_data_ptr<float>() : nullptr};
      if (format == Fp8Format::kE4M3FN) {
        run_passes<scalar_t, E4M3>(job);
      } else {
        run_passes<scalar_t, E5M2>(job);
      }
    });
  }

  write_scales(rule, scale_out);
  if (own_groups_t) {
    scale_t = at::empty(amax_t.sizes(), float_options);
    write_scales(rule_t, *scale_t);
  } else if (transpose) {
    // Always a copy: outputs must not alias, and the transpose of a [n, 1] scale is already contiguous.
    scale_t =
        parsed == Granularity::kTensorwise ? scale_out.clone() : scale_out.t().clone(at::MemoryFormat::Contiguous);
  }
  return {data, scale_out, amax_out, data_t, scale_t};
}

// The CPU kernel of fastmesh::fp8_quantize, the triton_op users call (fastmesh/ops/fp8_quantize.py): its Python body
// serves CUDA (Triton, or the CUDA C++ kernel) and tracing; a CPU call runs this, no Python. As that body: x read as
// a contiguous copy where it is strided, empty data_t and scale_t without transpose (its schema has no optional
// outputs).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_op_cpu(
    const at::Tensor& x, at::ScalarType dtype, c10::string_view granularity, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& amax, bool transpose, bool power_of_two) {
  auto [data, scale_out, amax_out, data_t, scale_t] =
      fp8_quantize_cpu(x.contiguous(), dtype, granularity, scale, amax, transpose, power_of_two);
  if (!transpose) {
    data_t = at::empty({0}, x.options().dtype(dtype));
    scale_t = at::empty({0}, x.options().dtype(at::kFloat));
  }
  return {data, scale_out, amax_out, *data_t, *scale_t};
}

}  // namespace
}  // namespace cpu
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) {
  m.impl("fp8_quantize_native", &fastmesh::cpu::fp8_quantize_cpu);
  m.impl("fp8_quantize", &fastmesh::cpu::fp8_quantize_op_cpu);
}

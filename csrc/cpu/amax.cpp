// CPU kernel of fastmesh::amax: max(|x|) per scaling group, in fp32, in the scale layout; and the
// raw-bits magnitude reductions it shares with the FP8 quantize kernel (declared in magnitude.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <utility>

#include "fastmesh/fp8_checks.h"
#include "magnitude.h"

namespace fastmesh {
namespace cpu {
namespace {

template <typename Bits>
FASTMESH_ALWAYS_INLINE Bits max_magnitude(const Bits* x, int64_t n) {
  Bits acc = 0;
  for (int64_t i = 0; i < n; ++i) acc = max_bits(acc, magnitude_bits(x[i]));
  return acc;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define FASTMESH_HAS_SHUFFLEVECTOR 1
#endif
#endif

#ifdef FASTMESH_HAS_SHUFFLEVECTOR
// The largest magnitudes of four consecutive MX blocks at once. Reducing one block at a time costs a log2(lanes)
// chain of shuffles per block; here each block's 32 magnitudes are first folded onto one 32-byte vector of L
// lanes, then pairs of vectors are folded onto one (their 16-byte halves, then their 8-byte pieces), so that
// the shuffles are shared by four blocks. Measured per block, AVX2 and AVX-512 alike: 0.7 ns instead of 1.1-1.5
// for 16-bit inputs, 1.5 instead of 1.6 for fp32 (whose 4 loads per block dominate).
//
// The helpers take and return vectors wider than some clones' registers; they are always inlined, so no call
// passes one and the ABI note GCC gives for such signatures does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <typename Bits>
struct Vec32;
template <>
struct Vec32<uint16_t> {
  typedef uint16_t type __attribute__((vector_size(32)));
};
template <>
struct Vec32<uint32_t> {
  typedef uint32_t type __attribute__((vector_size(32)));
};

// Shuffle indices into concat(a, b), of L lanes each, for output lane j; `high` picks the other half.
// fold_halves: a's 16-byte halves, then b's: lanes [0, L/2) from a, [L/2, L) from b.
template <int L, bool kHigh>
constexpr int half_lane(int j) {
  return (j < L / 2 ? j : L + j - L / 2) + (kHigh ? L / 2 : 0);
}
// fold_quarters: within each 16-byte half, a's 8-byte piece, then b's.
template <int L, bool kHigh>
constexpr int quarter_lane(int j) {
  const int within = j % (L / 2);
  return (within < L / 4 ? 0 : L) + j / (L / 2) * (L / 2) + (kHigh ? L / 4 : 0) + within % (L / 4);
}

template <typename V>
FASTMESH_ALWAYS_INLINE V max_lanes(V a, V b) {
  return a > b ? a : b;
}

template <int L, typename V, int... J>
FASTMESH_ALWAYS_INLINE V fold_halves(V a, V b, std::integer_sequence<int, J...>) {
  return max_lanes(__builtin_shufflevector(a, b, half_lane<L, false>(J)...),
                   __builtin_shufflevector(a, b, half_lane<L, true>(J)...));
}

template <int L, typename V, int... J>
FASTMESH_ALWAYS_INLINE V fold_quarters(V a, V b, std::integer_sequence<int, J...>) {
  return max_lanes(__builtin_shufflevector(a, b, quarter_lane<L, false>(J)...),
                   __builtin_shufflevector(a, b, quarter_lane<L, true>(J)...));
}

// Every lane of each aligned group of S lanes gets the group's maximum.
template <int S, typename V, int... J>
FASTMESH_ALWAYS_INLINE V fold_groups(V a, std::integer_sequence<int, J...> lanes) {
  a = max_lanes(a, __builtin_shufflevector(a, a, (J ^ (S / 2))...));
  if constexpr (S > 2) a = fold_groups<S / 2>(a, lanes);
  return a;
}

// One block's 32 magnitudes folded onto one vector. Loaded by value: a vector assembled in memory from
// narrower stores would stall on store forwarding.
template <typename Bits, typename V>
FASTMESH_ALWAYS_INLINE V block_lanes(const Bits* x, V mask) {
  constexpr int kLanes = sizeof(V) / sizeof(Bits);
  V acc = V{};
  for (int p = 0; p < kMxBlock / kLanes; ++p) {
    V v;
    std::memcpy(&v, x + p * kLanes, sizeof(V));
    acc = max_lanes(acc, v & mask);
  }
  return acc;
}

// out[i] = the largest magnitude of x[32 i, 32 i + 32) for i < 4.
template <typename Bits>
FASTMESH_ALWAYS_INLINE void max_magnitude_4_mx_blocks(const Bits* x, Bits* out) {
  using V = typename Vec32<Bits>::type;
  constexpr int L = sizeof(V) / sizeof(Bits);
  constexpr auto lanes = std::make_integer_sequence<int, L>{};
  const V mask = V{} + magnitude_bits(static_cast<Bits>(~Bits{0}));
  const V pair01 = fold_halves<L>(block_lanes(x, mask), block_lanes(x + kMxBlock, mask), lanes);
  const V pair23 = fold_halves<L>(block_lanes(x + 2 * kMxBlock, mask), block_lanes(x + 3 * kMxBlock, mask), lanes);
  // Groups of L/4 lanes: blocks 0, 2, 1, 3.
  const V maxima = fold_groups<L / 4>(fold_quarters<L>(pair01, pair23, lanes), lanes);
  out[0] = maxima[0];
  out[1] = maxima[L / 2];
  out[2] = maxima[L / 4];
  out[3] = maxima[3 * L / 4];
}
#pragma GCC diagnostic pop
#endif

template <typename Bits>
FASTMESH_ALWAYS_INLINE void max_magnitude_blocks_impl(Panel<const Bits> x, int64_t block, Bits* out) {
  const int64_t blocks = ceil_div(x.cols, block);
  for (int64_t r = 0; r < x.rows; ++r) {
    int64_t b = 0;
#ifdef FASTMESH_HAS_SHUFFLEVECTOR
    if (block == kMxBlock) {
      for (; (b + 4) * kMxBlock <= x.cols; b += 4) {
        max_magnitude_4_mx_blocks(x.row(r) + b * kMxBlock, out + r * blocks + b);
      }
    }
#endif
    for (; b < blocks; ++b) {
      const Bits* in = x.row(r) + b * block;
      const int64_t n = std::min(block, x.cols - b * block);
      // A constant trip count for full 128-wide (and MX's 32-wide) blocks: straight vector loops without
      // remainder code.
      out[r * blocks + b] = n == kFp8Block  ? max_magnitude(in, kFp8Block)
                            : n == kMxBlock ? max_magnitude(in, kMxBlock)
                                            : max_magnitude(in, n);
    }
  }
}

template <typename Bits>
FASTMESH_ALWAYS_INLINE void max_magnitude_columns_impl(Panel<const Bits> x, Bits* __restrict acc) {
  for (int64_t r = 0; r < x.rows; ++r) {
    const Bits* row = x.row(r);
    for (int64_t c = 0; c < x.cols; ++c) acc[c] = max_bits(acc[c], magnitude_bits(row[c]));
  }
}

}  // namespace

FASTMESH_CPU_CLONES void max_magnitude_blocks(Panel<const uint16_t> x, int64_t block, uint16_t* out) {
  max_magnitude_blocks_impl(x, block, out);
}
FASTMESH_CPU_CLONES void max_magnitude_blocks(Panel<const uint32_t> x, int64_t block, uint32_t* out) {
  max_magnitude_blocks_impl(x, block, out);
}
FASTMESH_CPU_CLONES void max_magnitude_columns(Panel<const uint16_t> x, uint16_t* acc) {
  max_magnitude_columns_impl(x, acc);
}
FASTMESH_CPU_CLONES void max_magnitude_columns(Panel<const uint32_t> x, uint32_t* acc) {
  max_magnitude_columns_impl(x, acc);
}

namespace {

at::Tensor amax_cpu(const at::Tensor& x, c10::string_view granularity) {
  constexpr const char* kOp = "fastmesh::amax";
  check_tensor(x, kOp, "x", kFloatInputs);
  const Granularity parsed = parse_granularity(granularity);
  check_granularity_dims(x, parsed, granularity, kOp);
  const auto sizes = scale_sizes(parsed, x.sizes());
  const auto options = x.options().dtype(at::kFloat);
  if (x.numel() == 0) return at::zeros(sizes, options);
  // The reduction is order-independent, so a contiguous copy changes nothing but speed.
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty(sizes, options);
  dispatch_float_input(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    group_amax(matrix_panel(input.const_data_ptr<scalar_t>(), as_rows(input)), parsed, out.mutable_data_ptr<float>());
  });
  return out;
}

}  // namespace
}  // namespace cpu
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) { m.impl("amax", &fastmesh::cpu::amax_cpu); }

// CPU kernel of fastmesh::amax: max(|x|) per scaling group, in fp32, in the scale layout; and the
// raw-bits magnitude reductions it shares with the FP8 quantize kernel (declared in magnitude.h).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

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

template <typename Bits>
FASTMESH_ALWAYS_INLINE void max_magnitude_blocks_impl(Panel<const Bits> x, int64_t block, Bits* out) {
  const int64_t blocks = ceil_div(x.cols, block);
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
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

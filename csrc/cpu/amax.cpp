// CPU kernel of fastmesh::amax: max(|x|) over all elements, in fp32.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fastmesh/bits.h"
#include "fastmesh/checks.h"

namespace fastmesh {
namespace {

// Elements per task: large enough that a task outweighs at::parallel_for's scheduling cost.
constexpr int64_t kGrainSize = 1 << 16;

// The inner loops are integer-only (see amax_math.h), so the compiler vectorizes them; target_clones
// compiles each for AVX-512, AVX2 and baseline x86-64 and picks one at load time from the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTMESH_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTMESH_CPU_CLONES
#endif

FASTMESH_CPU_CLONES uint16_t max_magnitude_bits16(const uint16_t* raw, int64_t n, uint16_t acc) {
  for (int64_t i = 0; i < n; ++i) acc = max_bits(acc, magnitude_bits(raw[i]));
  return acc;
}

FASTMESH_CPU_CLONES uint32_t max_magnitude_bits32(const uint32_t* raw, int64_t n, uint32_t acc) {
  for (int64_t i = 0; i < n; ++i) acc = max_bits(acc, magnitude_bits(raw[i]));
  return acc;
}

inline uint16_t max_magnitude_bits(const uint16_t* raw, int64_t n, uint16_t acc) {
  return max_magnitude_bits16(raw, n, acc);
}
inline uint32_t max_magnitude_bits(const uint32_t* raw, int64_t n, uint32_t acc) {
  return max_magnitude_bits32(raw, n, acc);
}

template <typename scalar_t>
float amax_contiguous(const at::Tensor& input) {
  using bits_t = typename BitsOf<scalar_t>::type;
  const auto* raw = reinterpret_cast<const bits_t*>(input.const_data_ptr<scalar_t>());
  const bits_t result = at::parallel_reduce(
      0, input.numel(), kGrainSize, bits_t{0},
      [&](int64_t begin, int64_t end, bits_t identity) { return max_magnitude_bits(raw + begin, end - begin, identity); },
      [](bits_t a, bits_t b) { return max_bits(a, b); });
  return BitsOf<scalar_t>::to_float(result);
}

at::Tensor amax_cpu(const at::Tensor& x) {
  check_float_input(x, "fastmesh::amax", "x");
  // The reduction is order-independent, so a contiguous copy changes nothing but speed.
  const at::Tensor input = x.contiguous();
  float result = 0.0f;
  AT_DISPATCH_SWITCH(input.scalar_type(), "fastmesh_amax_cpu",
      AT_DISPATCH_CASE(at::kFloat, [&] { result = amax_contiguous<float>(input); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { result = amax_contiguous<c10::BFloat16>(input); })
      AT_DISPATCH_CASE(at::kHalf, [&] { result = amax_contiguous<c10::Half>(input); }));
  at::Tensor out = at::empty({}, x.options().dtype(at::kFloat));
  *out.mutable_data_ptr<float>() = result;
  return out;
}

}  // namespace
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) {
  m.impl("amax", &fastmesh::amax_cpu);
}

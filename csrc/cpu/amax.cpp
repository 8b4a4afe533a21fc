// CPU kernel of fastmesh::amax: max(|x|) over all elements, in fp32.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fastmesh/amax_math.h"
#include "fastmesh/checks.h"

namespace fastmesh {
namespace {

// Elements per task: large enough that a task outweighs at::parallel_for's scheduling cost.
constexpr int64_t kGrainSize = 1 << 15;

template <typename scalar_t>
uint32_t amax_bits_range(const scalar_t* data, int64_t begin, int64_t end) {
  uint32_t acc = 0;
  for (int64_t i = begin; i < end; ++i) {
    acc = max_bits(acc, abs_bits(static_cast<float>(data[i])));
  }
  return acc;
}

at::Tensor amax_cpu(const at::Tensor& x) {
  check_float_input(x, "fastmesh::amax", "x");
  // The reduction is order-independent, so a contiguous copy changes nothing but speed.
  const at::Tensor input = x.contiguous();
  uint32_t result = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "fastmesh_amax_cpu", [&] {
    const scalar_t* data = input.const_data_ptr<scalar_t>();
    result = at::parallel_reduce(
        0, input.numel(), kGrainSize, uint32_t{0},
        [&](int64_t begin, int64_t end, uint32_t identity) {
          return max_bits(identity, amax_bits_range(data, begin, end));
        },
        [](uint32_t a, uint32_t b) { return max_bits(a, b); });
  });
  at::Tensor out = at::empty({}, x.options().dtype(at::kFloat));
  *out.mutable_data_ptr<float>() = float_from_bits(result);
  return out;
}

}  // namespace
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) {
  m.impl("amax", &fastmesh::amax_cpu);
}

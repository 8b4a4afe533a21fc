// Host-side geometry of FP8 scaling groups, shared by the CPU and CUDA kernels.
//
// Every granularity is defined on x viewed as a row-major [M, K] matrix (leading dims flattened):
//   tensorwise    one group                      scale []
//   rowwise       one group per row              scale [..., 1]
//   block1x128    1 x 128 groups along K         scale [..., ceil(K/128)]
//   block128x128  128 x 128 tiles                scale [ceil(M/128), ceil(K/128)]
// The transposed output is the same quantization applied to x^T ([K, M]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <vector>

#include "fastmesh/fp8_math.h"

namespace fastmesh {

constexpr int64_t kFp8Block = 128;

enum class Granularity : int { kTensorwise = 0, kRowwise = 1, kBlock1x128 = 2, kBlock128x128 = 3 };

inline Granularity parse_granularity(c10::string_view name) {
  if (name == "tensorwise") return Granularity::kTensorwise;
  if (name == "rowwise") return Granularity::kRowwise;
  if (name == "block1x128") return Granularity::kBlock1x128;
  if (name == "block128x128") return Granularity::kBlock128x128;
  TORCH_CHECK_VALUE(false, "granularity must be one of 'tensorwise', 'rowwise', 'block1x128', 'block128x128', got '",
                    std::string(name), "'");
}

inline Fp8Format parse_fp8_format(at::ScalarType dtype) {
  if (dtype == at::kFloat8_e4m3fn) return Fp8Format::kE4M3FN;
  if (dtype == at::kFloat8_e5m2) return Fp8Format::kE5M2;
  TORCH_CHECK_TYPE(false, "dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// x as [M, K]: a 0-d tensor is one element.
struct Rows {
  int64_t m;
  int64_t k;
};

inline Rows as_rows(const at::Tensor& x) {
  if (x.dim() == 0) return {1, 1};
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  return {m, x.size(-1)};
}

// The extent of one scaling group of an [m, k] matrix, in rows and columns.
inline Rows group_extent(Granularity granularity, Rows rows) {
  switch (granularity) {
    case Granularity::kTensorwise:
      return {std::max<int64_t>(rows.m, 1), std::max<int64_t>(rows.k, 1)};
    case Granularity::kRowwise:
      return {1, std::max<int64_t>(rows.k, 1)};
    case Granularity::kBlock1x128:
      return {1, kFp8Block};
    case Granularity::kBlock128x128:
      return {kFp8Block, kFp8Block};
  }
  return {1, 1};
}

// Number of groups along M and along K.
inline Rows group_grid(Granularity granularity, Rows rows) {
  const Rows extent = group_extent(granularity, rows);
  return {ceil_div(rows.m, extent.m), ceil_div(rows.k, extent.k)};
}

// Shape of the scale (and amax) tensor for x of shape `sizes`.
inline std::vector<int64_t> scale_sizes(Granularity granularity, at::IntArrayRef sizes) {
  std::vector<int64_t> out;
  if (granularity == Granularity::kTensorwise) return out;
  if (granularity == Granularity::kBlock128x128) {
    int64_t m = 1;
    for (size_t d = 0; d + 1 < sizes.size(); ++d) m *= sizes[d];
    return {ceil_div(m, kFp8Block), ceil_div(sizes.back(), kFp8Block)};
  }
  out.assign(sizes.begin(), sizes.end() - 1);
  out.push_back(granularity == Granularity::kRowwise ? 1 : ceil_div(sizes.back(), kFp8Block));
  return out;
}

}  // namespace fastmesh

// The pipelined all-gather + matmul (all_gather_matmul.cpp), for the Python CUDA kernel that falls back to
// it where the Triton consumer GEMM does not apply.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fastmesh {
namespace fused {

std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> all_gather_matmul(
    const at::Tensor& a_shard, at::TensorList bs, int64_t gather_dim, c10::string_view group_name, bool return_a,
    int64_t chunks);

}  // namespace fused
}  // namespace fastmesh

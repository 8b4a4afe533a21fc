// The fused collectives' C++ schedules (and their local scaled multiply), each with its argument checks. The ops'
// dispatcher kernels (kernels.cpp) call them with a key's remembered plan; a key's first call, planned in Python
// (fastmesh/ops/plans.py), calls them through fastmesh._C (csrc/module.cpp), or, on CUDA, the Triton consumer GEMM.
//
// `pieces` is the pipeline's piece count (0: chosen from the sizes) and `split` what a piece cuts
// ("rows", "columns" for the reduce-scatters, "none" for no pieces: the unfused sequence; pipeline.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fastmesh {
namespace fused {

std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> all_gather_matmul(const at::Tensor& a_shard,
                                                                                 at::TensorList bs, int64_t gather_dim,
                                                                                 c10::string_view group_name,
                                                                                 bool return_a, int64_t pieces,
                                                                                 c10::string_view split);

at::Tensor matmul_reduce_scatter(const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                                 c10::string_view reduce_op, c10::string_view group_name, int64_t pieces,
                                 c10::string_view split);

// The all-reduce of a @ b over the group; split "rows" (pieces of the product's rows) or "none".
at::Tensor matmul_all_reduce(const at::Tensor& a, const at::Tensor& b, c10::string_view reduce_op,
                             c10::string_view group_name, int64_t pieces, c10::string_view split);

// Every rank's a @ b, concatenated along the last dim in rank order; split "rows" or "none".
at::Tensor matmul_all_gather(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name, int64_t pieces,
                             c10::string_view split);

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::vector<at::Tensor>> all_gather_scaled_matmul(
    const at::Tensor& a_shard, const at::Tensor& a_scale, at::TensorList bs, at::TensorList b_scales,
    int64_t gather_dim, c10::string_view group_name, at::ScalarType out_dtype, bool return_a, int64_t pieces,
    c10::string_view split);

at::Tensor scaled_matmul_reduce_scatter(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                        const at::Tensor& b_scale, int64_t scatter_dim, c10::string_view reduce_op,
                                        c10::string_view group_name, at::ScalarType out_dtype, int64_t pieces,
                                        c10::string_view split);

// The FP8 form of matmul_all_reduce: scaled multiplies into out_dtype, the product reduced in out_dtype.
at::Tensor scaled_matmul_all_reduce(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                    const at::Tensor& b_scale, c10::string_view reduce_op, c10::string_view group_name,
                                    at::ScalarType out_dtype, int64_t pieces, c10::string_view split);

// The scaled multiply alone, local: (deq(a) @ deq(b)).to(out_dtype).
at::Tensor scaled_matmul(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
                         at::ScalarType out_dtype);

}  // namespace fused
}  // namespace fastmesh

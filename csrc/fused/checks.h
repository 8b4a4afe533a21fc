// Argument checks of the fused collectives; the wording matches fastmesh/ops/fused_collectives.py, which
// runs the same checks before a call reaches the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <string>

#include "fastmesh/checks.h"
#include "fastmesh/pipeline.h"

namespace fastmesh {
namespace fused {

inline void check_like(const at::Tensor& t, const at::Tensor& reference, const char* op, const std::string& arg,
                       const char* reference_arg) {
  TORCH_CHECK_TYPE(t.scalar_type() == reference.scalar_type(), op, ": ", arg, " must have ", reference_arg, "'s dtype ",
                   torch_dtype_name(reference.scalar_type()), ", got ", torch_dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == reference.device(), op, ": ", arg, " must be on ", reference_arg, "'s device ",
                    reference.device(), ", got ", t.device());
}

// `dim` in [-ndim, ndim), returned non-negative.
inline int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op, const char* arg, const char* tensor_arg) {
  TORCH_CHECK_VALUE(dim >= -ndim && dim < ndim, op, ": ", arg, " must be in [", -ndim, ", ", ndim - 1, "] for ",
                    tensor_arg, " with ", ndim, " dim(s), got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

inline void check_scattered_divisible(int64_t scattered, int64_t world, int64_t scatter_dim, const char* op) {
  TORCH_CHECK_VALUE(scattered % world == 0, op, ": the scattered dim ", scatter_dim, " of a @ b has size ", scattered,
                    ", which is not divisible by the group size ", world);
}

// a [..., K] by b [K, N] of one matmul dtype, on one device.
inline void check_matmul_operands(const at::Tensor& a, const at::Tensor& b, const char* op) {
  check_tensor(a, op, "a", kMatmulDtypes, 1);
  check_tensor(b, op, "b", kMatmulDtypes, 2, 2);
  check_like(b, a, op, "b", "a");
  TORCH_CHECK_VALUE(b.size(0) == a.size(-1), op, ": b must have ", a.size(-1), " rows (a's last dim), got shape ",
                    b.sizes());
}

inline void check_reduce_op(c10::string_view reduce_op, const char* op) {
  TORCH_CHECK_VALUE(reduce_op == "sum" || reduce_op == "avg", op, ": reduce_op must be \"sum\" or \"avg\", got \"",
                    std::string(reduce_op), '"');
}

inline void check_pieces(int64_t pieces, const char* op) {
  TORCH_CHECK_VALUE(pieces >= 0, op, ": pieces must be an int >= 0 (0 picks the count from the shapes), got ", pieces);
}

// The call's schedule (fastmesh/pipeline.h): "rows", "columns" or "none".
inline pipeline::Split check_split(c10::string_view split, const char* op) {
  pipeline::Split out;
  TORCH_CHECK_VALUE(pipeline::parse_split(std::string(split), &out), op,
                    ": split must be \"rows\", \"columns\" or \"none\", got \"", std::string(split), '"');
  return out;
}

}  // namespace fused
}  // namespace fastmesh

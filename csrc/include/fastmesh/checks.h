// Input checks shared by every kernel file: one wording for the errors users see.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace fastmesh {

// Floating-point inputs fastmesh kernels read: fp32, bf16, fp16.
inline void check_float_input(const at::Tensor& x, const char* op, const char* arg) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
      op, ": ", arg, " must be float32, bfloat16 or float16, got ", dtype);
}

}  // namespace fastmesh

// Input checks shared by every kernel file: one wording for the errors users see.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <string>

namespace fastmesh {

// A dtype as Python spells it ("torch.float32"), so that C++ and Python errors read the same.
inline std::string torch_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    default: {
      std::string name = c10::toString(dtype);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

// Floating-point inputs fastmesh kernels read: fp32, bf16, fp16.
inline void check_float_input(const at::Tensor& x, const char* op, const char* arg) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": ", arg,
                   " must be float32, bfloat16 or float16, got ", dtype);
}

}  // namespace fastmesh

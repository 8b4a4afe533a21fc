// Input checks shared by every kernel file: one wording for the errors users see, that of
// fastmesh/ops/_checks.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <limits>
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
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    case at::kByte:
      return "torch.uint8";
    case at::kChar:
      return "torch.int8";
    case at::kShort:
      return "torch.int16";
    default: {
      std::string name = c10::toString(dtype);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

// The dtype sets of fastmesh/ops/_checks.py: what FP8 quantize casts from, the high-precision fused ops'
// operands, FP8 data.
inline constexpr at::ScalarType kFloatInputs[] = {at::kFloat, at::kBFloat16, at::kHalf};
inline constexpr at::ScalarType kMatmulDtypes[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble};
inline constexpr at::ScalarType kFp8Dtypes[] = {at::kFloat8_e4m3fn, at::kFloat8_e5m2};

// `dtypes` as errors list them: "float32, bfloat16 or float16" (_checks.dtype_names).
inline std::string dtype_names(c10::ArrayRef<at::ScalarType> dtypes) {
  std::string out;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i > 0) out += i + 1 == dtypes.size() ? " or " : ", ";
    out += torch_dtype_name(dtypes[i]).substr(std::string("torch.").size());
  }
  return out;
}

// `t` is a dense tensor of one of `dtypes` with min_dim..max_dim dims, else a TypeError (dtype) or ValueError
// naming `arg` (_checks.check_tensor; devices are checked against another argument where they must match).
inline void check_tensor(const at::Tensor& t, const char* op, const std::string& arg,
                         c10::ArrayRef<at::ScalarType> dtypes, int64_t min_dim = 0,
                         int64_t max_dim = std::numeric_limits<int64_t>::max()) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK_TYPE(std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end(), op, ": ", arg, " must be ",
                   dtype_names(dtypes), ", got ", torch_dtype_name(dtype));
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", arg, " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK_VALUE(t.dim() >= min_dim && t.dim() <= max_dim, op, ": ", arg, " must have ",
                    min_dim == max_dim ? std::to_string(min_dim) : "at least " + std::to_string(min_dim),
                    " dim(s), got shape ", t.sizes());
}

}  // namespace fastmesh

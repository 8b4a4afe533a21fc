// Argument checks of the FP8 kernels, shared by the CPU and CUDA entry points so that both devices
// reject a call the same way, with the wording of fastmesh/ops/_checks.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <vector>

#include "fastmesh/checks.h"
#include "fastmesh/fp8_layout.h"
#include "fastmesh/mx_math.h"

namespace fastmesh {

// x must have at least 1 dim for rowwise / block1x128 and 2 for block128x128.
inline void check_granularity_dims(const at::Tensor& x, Granularity granularity, c10::string_view name,
                                   const char* op) {
  const int64_t min_dims =
      granularity == Granularity::kTensorwise ? 0 : (granularity == Granularity::kBlock128x128 ? 2 : 1);
  TORCH_CHECK_VALUE(x.dim() >= min_dims, op, ": granularity '", std::string(name), "' needs x with at least ", min_dims,
                    " dim(s), got shape ", x.sizes());
}

// A given scale or amax: float32, on x's device, in the scale layout.
inline void check_group_tensor(const std::optional<at::Tensor>& given, const char* arg, const at::Tensor& x,
                               c10::string_view granularity, at::IntArrayRef layout, const char* op) {
  if (!given.has_value()) return;
  TORCH_CHECK_TYPE(given->scalar_type() == at::kFloat, op, ": ", arg, " must be float32, got ",
                   torch_dtype_name(given->scalar_type()));
  TORCH_CHECK_VALUE(given->device() == x.device(), op, ": ", arg, " must be on x's device ", x.device(), ", got ",
                    given->device());
  TORCH_CHECK_VALUE(given->sizes() == layout, op, ": ", arg, " must have shape ", layout, " for granularity '",
                    std::string(granularity), "' and x of shape ", x.sizes(), ", got ", given->sizes());
}

// What a validated fp8_quantize call asks for.
struct QuantizeCall {
  Fp8Format format;
  Granularity granularity;
  std::vector<int64_t> layout;  // shape of scale and amax
  bool given;                   // a scale or an amax was passed
};

inline QuantizeCall check_quantize_args(const at::Tensor& x, at::ScalarType dtype, c10::string_view granularity,
                                        const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& amax,
                                        bool transpose, bool power_of_two, const char* op) {
  check_tensor(x, op, "x", kFloatInputs);
  QuantizeCall call{parse_fp8_format(dtype), parse_granularity(granularity), {}, false};
  check_granularity_dims(x, call.granularity, granularity, op);
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": x must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE(!(scale.has_value() && amax.has_value()), op,
                    ": pass at most one of scale= (delayed scaling) and amax= (a precomputed amax)");
  call.layout = scale_sizes(call.granularity, x.sizes());
  check_group_tensor(scale, "scale", x, granularity, call.layout, op);
  check_group_tensor(amax, "amax", x, granularity, call.layout, op);
  TORCH_CHECK_VALUE(!(scale.has_value() && power_of_two), op,
                    ": power_of_two applies to computed scales; with scale= the given scale is used as is");
  call.given = scale.has_value() || amax.has_value();
  if (transpose) {
    TORCH_CHECK_VALUE(x.dim() >= 2, op, ": transpose=True needs x with at least 2 dims, got shape ", x.sizes());
    TORCH_CHECK_VALUE(
        !call.given || call.granularity == Granularity::kTensorwise || call.granularity == Granularity::kBlock128x128,
        op, ": transpose=True with a given scale or amax needs granularity 'tensorwise' or 'block128x128', got '",
        std::string(granularity), "'");
  }
  return call;
}

// What a validated mx_quantize call asks for: x as [m, k], k (and with transpose m) a multiple of 32.
struct MxCall {
  Fp8Format format;
  MxRounding rounding;
  Rows rows;
};

inline MxCall check_mx_args(const at::Tensor& x, at::ScalarType dtype, c10::string_view rounding, bool transpose,
                            const char* op) {
  check_tensor(x, op, "x", kFloatInputs);
  const Fp8Format format = parse_fp8_format(dtype);
  TORCH_CHECK_VALUE(rounding == "floor" || rounding == "rceil", op,
                    ": scale_rounding must be 'floor' or 'rceil', got '", std::string(rounding), "'");
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": granularity 'mx' needs x with at least 1 dim(s), got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.size(-1) % kMxBlock == 0, op, ": granularity 'mx' needs x's last dim to be a multiple of ",
                    kMxBlock, " (one scale per ", kMxBlock, " elements), got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": x must be contiguous, got strides ", x.strides());
  const Rows rows = as_rows(x);
  if (transpose) {
    TORCH_CHECK_VALUE(x.dim() >= 2, op, ": transpose=True needs x with at least 2 dims, got shape ", x.sizes());
    TORCH_CHECK_VALUE(rows.m % kMxBlock == 0, op,
                      ": transpose=True with granularity 'mx' needs x's rows (the product of ",
                      "every dim but the last, ", rows.m, ") to be a multiple of ", kMxBlock,
                      " (the columns are cast in blocks of ", kMxBlock, " rows), got shape ", x.sizes());
  }
  return {format, rounding == "floor" ? MxRounding::kFloor : MxRounding::kRceil, rows};
}

}  // namespace fastmesh

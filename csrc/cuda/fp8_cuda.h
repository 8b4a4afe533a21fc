// Entry points shared by the CUDA translation units of the FP8 / amax kernels (not a public header).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "fastmesh/fp8_layout.h"

namespace fastmesh {

// atomicMax of max|input| (as fp32 bits) into *out_bits, on the current stream; input contiguous,
// non-empty, float32/bfloat16/float16, on the current device. Defined in amax.cu.
void launch_tensor_amax_bits(const at::Tensor& input, uint32_t* out_bits);

// Per-group max|x| in the scale layout for rowwise, block1x128 and block128x128 (fastmesh::amax);
// input contiguous, with the dims the granularity needs, on the current device. Defined in fp8_quantize.cu.
at::Tensor group_amax_cuda(const at::Tensor& input, Granularity granularity);

}  // namespace fastmesh

// Registration of the fused collectives: one device-agnostic implementation over c10d serves as the CPU
// and the CUDA kernel of each op.
#pragma once

#include <torch/library.h>

#define FASTMESH_FUSED_KERNEL(name, function)                      \
  TORCH_LIBRARY_IMPL(fastmesh, CPU, m) { m.impl(name, &function); } \
  TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) { m.impl(name, &function); }

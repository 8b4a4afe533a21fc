// Registration of the fused collectives: one device-agnostic implementation over c10d serves as the CPU
// and the CUDA kernel of each op. all_gather_matmul registers only its CPU kernel here: its CUDA kernel is
// registered from Python (fastmesh/ops/fused_collectives.py), which picks the Triton chunk-waiting GEMM
// or this pipeline (exposed as _C.all_gather_matmul_pipelined, csrc/module.cpp).
#pragma once

#include <torch/library.h>

#define FASTMESH_FUSED_CPU_KERNEL(name, function) \
  TORCH_LIBRARY_IMPL(fastmesh, CPU, m) { m.impl(name, &function); }

#define FASTMESH_FUSED_KERNEL(name, function)   \
  FASTMESH_FUSED_CPU_KERNEL(name, function)     \
  TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) { m.impl(name, &function); }

"""fastmesh's custom ops: schemas (``_library``), fake impls, autograd and Python fronts."""

from fastmesh.ops import (
    _library,  # noqa: F401  (defines the schemas on import)
    scaled_matmul,  # noqa: F401  (registers fastmesh::scaled_matmul's kernels)
)
from fastmesh.ops.amax import amax
from fastmesh.ops.fp8_quantize import Float8Quantized, quantize
from fastmesh.ops.fused_collectives import all_gather_matmul, matmul_reduce_scatter
from fastmesh.ops.matmul_all_gather import matmul_all_gather
from fastmesh.ops.matmul_all_reduce import matmul_all_reduce
from fastmesh.ops.plans import connect_kernels

connect_kernels()  # after the op modules: their planned runs are registered

__all__ = [
    "Float8Quantized",
    "all_gather_matmul",
    "amax",
    "matmul_all_gather",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "quantize",
]

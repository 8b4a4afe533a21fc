"""fastmesh's custom ops: schemas (``_library``), fake impls, autograd and Python fronts."""

from fastmesh.ops import _library
from fastmesh.ops.amax import amax
from fastmesh.ops.fp8 import Float8Quantized, quantize

__all__ = ["Float8Quantized", "amax", "quantize"]

"""FP8: the quantize front (``fastmesh.fp8.quantize``) and recipe state (config, delayed scaling)."""

from fastmesh.fp8.config import Float8Config
from fastmesh.fp8.delayed import DelayedScaling
from fastmesh.ops.fp8_quantize import Float8Quantized, quantize

__all__ = ["DelayedScaling", "Float8Config", "Float8Quantized", "quantize"]

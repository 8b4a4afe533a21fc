"""``fastmesh::mx_quantize``: the MX cast (OCP Microscaling, MXFP8) in one pass; ``fastmesh.fp8.quantize(x,
granularity="mx")`` calls it.

Blocks of 32 consecutive elements along x's last dim (which 32 must divide) share one power-of-two scale, stored as
E8M0 (``torch.float8_e8m0fnu``); the elements are cast to FP8 with round-to-nearest-even and saturation.
``scale_rounding`` picks the scale: ``"floor"`` (the spec's: ``2**(floor(log2(amax)) - emax)``, emax 8 for e4m3fn,
15 for e5m2) or ``"rceil"`` (``2**ceil(log2(amax / fp8_max))``, cuBLAS's and Transformer Engine's);
``kernels/mx_reference.py`` states every rule, special values included, and the kernels equal it bit for bit.
Plain-PyTorch equivalent (floor, finite x; ``e8m0`` the biased exponent in a byte)::

    blocks = x.float().unflatten(-1, (-1, 32))
    e = (((blocks.abs().amax(-1).view(torch.int32) >> 23) & 0xFF) - 127 - emax).clamp(-127, 128)
    data = (blocks / torch.exp2(e.float()).clamp(min=2**-126).unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(dtype)
    scale = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)          # x ~= data * 2**e per block

Shapes (x as ``[M, K]``, leading dims flattened)::

    data [..., K] (x's shape)   scale, amax [..., K/32]   data_t [K, M]   scale_t [K, M/32]   (transpose: 32 | M)

``data_t``/``scale_t`` are the column-wise MX cast (blocks of 32 rows) of the 2-D x, written in the same pass, as
the backward needs; the op returns empty tensors without ``transpose``. Not differentiable. Errors: TypeError for a
wrong type or dtype, ValueError for a shape 32 does not divide or a wrong rounding. CPU runs C++; CUDA runs the
Triton kernel (``kernels/mx_quantize.py``) or, with ``FASTMESH_FP8_CUDA_IMPL=cuda``, CUDA C++.
"""

from __future__ import annotations

import logging
import math

import torch

from fastmesh import settings
from fastmesh._log import log_once
from fastmesh.kernels.formats import mx_shapes
from fastmesh.ops._checks import FLOAT_INPUTS, MX_BLOCK, SCALE_ROUNDINGS, check_fp8_dtype, check_tensor
from fastmesh.ops._library import below_autograd, qualified_name, signature

logger = logging.getLogger(__name__)

_OP = "fastmesh::mx_quantize"


def check_mx_args(x: torch.Tensor, dtype: torch.dtype, scale_rounding: str, transpose: bool, op: str = _OP) -> None:
    check_tensor(x, op, "x", FLOAT_INPUTS)
    check_fp8_dtype(dtype, op)
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"{op}: scale_rounding must be 'floor' or 'rceil', got {scale_rounding!r}")
    if x.dim() < 1:
        raise ValueError(f"{op}: granularity 'mx' needs x with at least 1 dim(s), got shape {list(x.shape)}")
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"{op}: granularity 'mx' needs x's last dim to be a multiple of {MX_BLOCK} (one scale per {MX_BLOCK} "
            f"elements), got shape {list(x.shape)}"
        )
    if transpose:
        if x.dim() < 2:
            raise ValueError(f"{op}: transpose=True needs x with at least 2 dims, got shape {list(x.shape)}")
        rows = math.prod(x.shape[:-1])
        if rows % MX_BLOCK:
            raise ValueError(
                f"{op}: transpose=True with granularity 'mx' needs x's rows (the product of every dim but the last, "
                f"{rows}) to be a multiple of {MX_BLOCK} (the columns are cast in blocks of {MX_BLOCK} rows), got "
                f"shape {list(x.shape)}"
            )


def _log_path_once(path: str) -> None:
    log_once(logger, logging.INFO, ("mx_quantize", path), "fastmesh.fp8 MX cast runs the %s implementation", path)


def _mx_quantize_body(
    x: torch.Tensor, dtype: torch.dtype, scale_rounding: str = "floor", transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_mx_args(x, dtype, scale_rounding, transpose)
    x = x.contiguous()  # the kernels read x as a row-major [M, K] matrix
    if x.device.type == "cuda" and settings.get("FASTMESH_FP8_CUDA_IMPL") == "triton":
        from torch.library import wrap_triton

        from fastmesh.kernels import mx_quantize as triton_kernels

        _log_path_once("Triton")
        result = triton_kernels.quantize(x, dtype, scale_rounding, transpose, wrap=wrap_triton)
    else:
        _log_path_once(f"C++ ({x.device.type})")
        result = torch.ops.fastmesh.mx_quantize_native(x, dtype, scale_rounding, transpose)
    data, scale, amax, data_t, scale_t = result
    if data_t is None:
        data_t, scale_t = x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float8_e8m0fnu)
    return data, scale, amax, data_t, scale_t


# torch 2.11 infers the schema from the body's annotations; a test checks it is the one in _library.
mx_quantize_op = torch.library.triton_op(
    qualified_name("mx_quantize"), _mx_quantize_body, mutates_args=(), schema=signature("mx_quantize")
)


@torch.library.register_fake(qualified_name("mx_quantize_native"))
def _mx_quantize_native_fake(x, dtype, scale_rounding="floor", transpose=False):
    check_mx_args(x, dtype, scale_rounding, transpose, op="fastmesh::mx_quantize_native")
    scale_shape, data_t_shape, scale_t_shape = mx_shapes(x.shape)
    data = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    scale = x.new_empty(scale_shape, dtype=torch.float8_e8m0fnu)
    amax = x.new_empty(scale_shape, dtype=torch.float32)
    if not transpose:
        return data, scale, amax, None, None
    return data, scale, amax, x.new_empty(data_t_shape, dtype=dtype), x.new_empty(scale_t_shape, dtype=scale.dtype)


# The op users reach: on CPU it runs csrc/cpu/mx_quantize.cpp's kernel directly (no Python); the body above serves
# CUDA and tracing.
_MX_QUANTIZE = torch.ops.fastmesh.mx_quantize.default


def mx_quantize(x: torch.Tensor, dtype: torch.dtype, scale_rounding: str = "floor", transpose: bool = False):
    """The op on one tensor: ``(data, scale, amax, data_t, scale_t)``, the last two None without ``transpose``."""
    with below_autograd():
        data, scale, amax, data_t, scale_t = _MX_QUANTIZE(
            x.detach() if x.requires_grad else x, dtype, scale_rounding, transpose
        )
    return (data, scale, amax, data_t, scale_t) if transpose else (data, scale, amax, None, None)

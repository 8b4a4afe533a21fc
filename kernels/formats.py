"""The FP8 formats and their scaling groups, in the one place the kernels and the ops read them: the FP8 dtypes and
their largest finite values, the granularities and their block size, MX's block and scale roundings, and the shapes
of the scales each granularity gives (the layouts ``torch._scaled_mm`` takes)."""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # the largest finite value of each
GRANULARITIES = ("tensorwise", "rowwise", "block1x128", "block128x128")
BLOCK = 128  # the block granularities' edge
# MXFP8 (fastmesh/ops/mx_quantize.py): blocks of MX_BLOCK along the last dim, E8M0 scales, rounded per SCALE_ROUNDINGS.
MX = "mx"
MX_BLOCK = 32
SCALE_ROUNDINGS = ("floor", "rceil")


def scale_shape(shape: torch.Size | tuple[int, ...], granularity: str) -> tuple[int, ...]:
    """Shape of the scale (and amax) of an x of ``shape`` for one of GRANULARITIES."""
    shape = tuple(shape)
    last = shape[-1] if shape else 1
    if granularity == "tensorwise":
        return ()
    if granularity == "rowwise":
        return shape[:-1] + (1,)
    if granularity == "block1x128":
        return shape[:-1] + (-(-last // BLOCK),)
    if granularity == "block128x128":
        return (-(-math.prod(shape[:-1]) // BLOCK), -(-last // BLOCK))
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def mx_shapes(shape: torch.Size | tuple[int, ...]) -> tuple[tuple, tuple, tuple]:
    """The MX cast's shapes for an x of ``shape`` (as ``[M, K]``): (scale's, data_t's, scale_t's)."""
    rows = math.prod(shape[:-1])
    return (*shape[:-1], shape[-1] // MX_BLOCK), (shape[-1], rows), (shape[-1], rows // MX_BLOCK)

"""Plain-PyTorch reference of FP8 cast-and-scale: the oracle for tests and benchmarks.

It follows the op contract of ``fastmesh.ops.fp8_quantize`` formula for formula, with ordinary torch ops and no
fastmesh code, so that every kernel (C++, CUDA, Triton) can be compared with it bit for bit:

* per scaling group, ``amax = max |x|`` in fp32 (NaN wins, inf propagates, 0 for an empty group);
* ``q = fp8_max / amax`` in fp32, 1 where ``amax == 0``, FLT_MAX where the division overflows, rounded
  down to a power of two with ``power_of_two``; with a given dequantization scale ``s``, ``q = 1 / s``;
* ``data = saturate(x.float() * q)`` cast with round-to-nearest-even; ``scale = 1 / q``.

Only the NaN bit pattern may differ from a kernel: torch keeps the sign of a NaN, the kernels write
``0x7F``. Compare with :func:`fp8_bits_equal`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
GRANULARITIES = ("tensorwise", "rowwise", "block1x128", "block128x128")
BLOCK = 128
FLOAT32_MAX = torch.finfo(torch.float32).max


class Quantized(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    data_t: torch.Tensor | None
    scale_t: torch.Tensor | None


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the 2-D ``[M, K]`` matrix the granularities are defined on (leading dims flattened)."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def scale_shape(shape: torch.Size | tuple[int, ...], granularity: str) -> tuple[int, ...]:
    shape = tuple(shape)
    if granularity == "tensorwise":
        return ()
    if granularity == "rowwise":
        return shape[:-1] + (1,)
    if granularity == "block1x128":
        return shape[:-1] + (math.ceil(shape[-1] / BLOCK),)
    if granularity == "block128x128":
        return (math.ceil(math.prod(shape[:-1]) / BLOCK), math.ceil(shape[-1] / BLOCK))
    raise ValueError(f"unknown granularity {granularity!r}")


def _group_sizes(granularity: str, rows: int, cols: int) -> tuple[int, int]:
    """(rows, cols) of one scaling group of an ``[rows, cols]`` matrix."""
    return {
        "tensorwise": (max(rows, 1), max(cols, 1)),
        "rowwise": (1, max(cols, 1)),
        "block1x128": (1, BLOCK),
        "block128x128": (BLOCK, BLOCK),
    }[granularity]


def _grid(granularity: str, rows: int, cols: int) -> tuple[int, int]:
    """Number of scaling groups along rows and along columns (a group may hold no element)."""
    group_rows, group_cols = _group_sizes(granularity, rows, cols)
    grid = (math.ceil(rows / group_rows), math.ceil(cols / group_cols))
    if granularity == "tensorwise":
        return (1, 1)
    if granularity == "rowwise":
        return (grid[0], 1)
    return grid


def group_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """max |x| per scaling group, fp32, in the layout of the scale."""
    x2 = as_rows(x).float().abs()
    rows, cols = x2.shape
    group_rows, group_cols = _group_sizes(granularity, rows, cols)
    grid = _grid(granularity, rows, cols)
    padded = x2.new_zeros(grid[0] * group_rows, grid[1] * group_cols)
    padded[:rows, :cols] = x2
    tiles = padded.reshape(grid[0], group_rows, grid[1], group_cols)
    amax = tiles.amax(dim=(1, 3)) if tiles.numel() else torch.zeros(grid)
    return amax.reshape(scale_shape(x.shape, granularity))


def quant_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    # A tensor numerator: `float / tensor` would compute reciprocal(amax) * max, rounding twice.
    q = torch.where(amax == 0, torch.ones_like(amax), torch.full_like(amax, FP8_MAX[dtype]) / amax)
    q = torch.where(q > FLOAT32_MAX, torch.full_like(q, FLOAT32_MAX), q)
    if power_of_two:
        floored = (q.view(torch.int32) & torch.tensor(0xFF800000 - 2**32, dtype=torch.int32)).view(torch.float32)
        q = torch.where((q > 0) & (q <= FLOAT32_MAX), floored, q)
    return q


def _expand(per_group: torch.Tensor, granularity: str, rows: int, cols: int) -> torch.Tensor:
    """Broadcast a per-group tensor (scale layout) to every element of the ``[rows, cols]`` matrix."""
    group_rows, group_cols = _group_sizes(granularity, rows, cols)
    g = per_group.reshape(_grid(granularity, rows, cols))
    return g.repeat_interleave(group_rows, 0).repeat_interleave(group_cols, 1)[:rows, :cols]


def saturating_cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> FP8, round-to-nearest-even, saturating at +-max (infinities too); NaN stays NaN."""
    limit = FP8_MAX[dtype]
    return values.clamp(-limit, limit).to(dtype)


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    transpose: bool = False,
    power_of_two: bool = False,
) -> Quantized:
    """Reference of ``fastmesh::fp8_quantize`` (see the module docstring)."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    local_amax = group_amax(x, granularity)
    if scale is not None:
        q = torch.reciprocal(scale.float())
        out_amax = local_amax
    else:
        out_amax = local_amax if amax is None else amax.float().clone()
        q = quant_scale_from_amax(out_amax, dtype, power_of_two)
    values = x2.float() * _expand(q, granularity, rows, cols)
    data = saturating_cast(values, dtype).reshape(x.shape)
    data_t = scale_t = None
    if transpose:
        given_t = None if scale is None else (scale.t() if granularity == "block128x128" else scale)
        amax_t = None if amax is None else (amax.t() if granularity == "block128x128" else amax)
        transposed = quantize(x2.t().contiguous(), dtype, granularity, given_t, amax_t, False, power_of_two)
        data_t, scale_t = transposed.data, transposed.scale
    return Quantized(data, torch.reciprocal(q), out_amax, data_t, scale_t)


def fp8_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise: same FP8 bits, or both NaN (kernels write NaN as 0x7F whatever its sign)."""
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    return (a == e) | (torch.isnan(actual.float()) & torch.isnan(expected.float()))

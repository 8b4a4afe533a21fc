"""Triton kernels of FP8 cast-and-scale (``fastmesh::fp8_quantize`` on CUDA), and their launchers.

The contract is that of :func:`fastmesh.kernels.fp8_reference.quantize`, bit for bit (NaN bytes aside:
the kernels write the hardware's canonical NaN). Per scaling group, on ``x`` viewed as ``[M, K]``::

    amax  = max |x|                                   fp32, NaN wins (an integer max of the magnitude bits)
    q     = quant_scale_from_amax(amax)               fp8_max / amax correctly rounded; 1 if amax == 0;
                                                      FLT_MAX if that overflows; mantissa cleared
                                                      with power_of_two      (csrc/.../fp8_math.h)
          | 1 / given_scale                           correctly rounded, power_of_two ignored
    data  = fp8(clamp(float(x) * q, -fp8_max, fp8_max))   one fp32 multiply, native RNE cast
    scale = 1 / q

Shapes: those of the op (``fastmesh/ops/fp8_quantize.py``; :func:`scale_shape`). :func:`quantize` and
:func:`amax` check their arguments (TypeError / ValueError) and take ``wrap``, applied to each kernel before its
launch (the op passes ``torch.library.wrap_triton``; tests under ``TRITON_INTERPRET=1`` pass nothing). Which
kernels run for each granularity, and why: ``docs/design/fp8.md``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from fastmesh.kernels.formats import BLOCK, FP8_MAX, GRANULARITIES, scale_shape

from fastmesh._log import log_once

logger = logging.getLogger("fastmesh.kernels.fp8_quantize")

__all__ = ["FP8_MAX", "GRANULARITIES", "Quantized", "amax", "quantize", "scale_shape"]


# Compile-time codes of the kernels' constexpr switches.
_TENSORWISE, _ROWWISE, _BLOCK1X128, _BLOCK128X128 = range(4)
_GRANULARITY_CODE = {name: code for code, name in enumerate(GRANULARITIES)}
_SOURCE_CURRENT, _SOURCE_AMAX, _SOURCE_SCALE = range(3)
# What _amax_tiles_kernel writes per tile: nothing, one value, one per row, one per column.
_REDUCE_NONE, _REDUCE_TILE, _REDUCE_ROWS, _REDUCE_COLS = range(4)

_FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
_ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
# 0xff800000 as int32: sign and exponent of an fp32, mantissa cleared.
_EXPONENT_MASK: tl.constexpr = tl.constexpr(-8388608)

# Elements per program of the streaming kernels.
_FLAT_BLOCK = 4096
# The flat amax kernel runs at most this many programs (each loops over several blocks), so that the
# combine is a bounded number of atomics on one word rather than one per block.
_FLAT_MAX_PROGRAMS = 1024
# Rowwise: at 8192 a row of 8192 is one block held in registers between its amax and its cast (one read of x); at
# 4096 it was two sweeps. H200, 8192 x 8192 bf16 (bench/gpu_check_fp8.py --sweep, 2026-12-04): 0.051 ms (94% of
# copy) against 0.061 ms.
_ROW_BLOCK = 8192
_TRANSPOSE_TILE = 64
_BLOCK1X128_ROWS = 32
# Warps of a tile program: _LARGE_TILE_WARPS for tiles of 8192 elements or more (the 128 x 128 ones), 4 below. On an
# H200 the transposed 128 x 128 casts ran at 35% (1x128) and 59% (128x128) of copy (2026-12-04); the GPU check
# sweeps it.
_LARGE_TILE_WARPS = 8


class Quantized(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    data_t: torch.Tensor | None
    scale_t: torch.Tensor | None


# ------------------------------------------------------------------------------------------------
# Element math (mirrors csrc/include/fastmesh/fp8_math.h)
# ------------------------------------------------------------------------------------------------


@triton.jit
def _load(ptr, offsets, mask):
    """Load, widen to fp32 exactly, and return (value, |value| as int32 bits).

    The bits order like the magnitudes (NaN above +inf), so their integer max is the abs-max."""
    raw = tl.load(ptr + offsets, mask=mask, other=0)
    if raw.dtype == tl.bfloat16:
        # bf16 is the top half of an fp32: widen by shifting the bits. Exact by construction (the
        # hardware conversion is the same shift), and the Triton interpreter's bf16 -> fp32
        # conversion flushes bf16 subnormals to zero.
        value = (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        value = raw.to(tl.float32)
    return value, value.to(tl.int32, bitcast=True) & _ABS_MASK


@triton.jit
def _quant_scale_from_amax(amax, FP8_MAX: tl.constexpr, POWER_OF_TWO: tl.constexpr):
    # div_rn: `/` on fp32 is an approximate division on the GPU; the contract is IEEE division.
    q = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax)
    q = tl.where(q > _FLT_MAX, _FLT_MAX, q)
    if POWER_OF_TWO:
        floored = (q.to(tl.int32, bitcast=True) & _EXPONENT_MASK).to(tl.float32, bitcast=True)
        q = tl.where((q > 0.0) & (q <= _FLT_MAX), floored, q)
    return tl.where(amax == 0.0, 1.0, q)


@triton.jit
def _reciprocal(x):
    """1 / x, correctly rounded: q from a given scale, and the returned scale from q."""
    return tl.math.div_rn(tl.zeros_like(x) + 1.0, x)


@triton.jit
def _cast(value, q, FP8_MAX: tl.constexpr, FP8: tl.constexpr):
    """fp8(saturate(value * q)): one fp32 multiply, then the native round-to-nearest-even cast."""
    value = value * q
    # Comparisons, not tl.minimum/maximum: a NaN compares false and passes through to the cast
    # (PTX min/max would return the other operand).
    value = tl.where(value > FP8_MAX, FP8_MAX, value)
    value = tl.where(value < -FP8_MAX, -FP8_MAX, value)
    return value.to(FP8)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _program_tile(tiles_k, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_K] tile of an [M, K] matrix cut into tiles, tiles_k per row of tiles:
    (its tile row, its tile column, its rows, its columns, which rows are < M, which columns are < K)."""
    pid = tl.program_id(0)
    pid_m = (pid // tiles_k).to(tl.int64)
    pid_k = (pid % tiles_k).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    return pid_m, pid_k, rows, cols, rows < M, cols < K


@triton.jit
def _amax_flat_kernel(x_ptr, amax_bits_ptr, numel, blocks_per_program, BLOCK: tl.constexpr):
    """amax_bits[0] = max over all of x of |x| bits (amax_bits zero-initialized)."""
    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(blocks_per_program):
        offsets = (pid * blocks_per_program + i) * BLOCK + lanes
        _, bits = _load(x_ptr, offsets, offsets < numel)
        acc = tl.maximum(acc, bits)
    tl.atomic_max(amax_bits_ptr, tl.max(acc, axis=0))


@triton.jit
def _amax_tiles_kernel(
    x_ptr,
    out_ptr,
    out2_ptr,
    M,
    K,
    tiles_k,
    out_stride_m,
    out_stride_k,
    out2_stride_m,
    out2_stride_k,
    REDUCE: tl.constexpr,
    REDUCE2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per-group |x| bits of [BLOCK_M, BLOCK_K] tiles, atomically maxed into zero-initialized int32
    outputs. out reduces the tile (REDUCE_TILE), its rows (REDUCE_ROWS) or its columns (REDUCE_COLS);
    out2 (REDUCE2) its columns or nothing. Element (group_m, group_k) of an output sits at
    group_m * stride_m + group_k * stride_k, where a group index is the tile's along a reduced axis
    and the row / column otherwise."""
    pid_m, pid_k, rows, cols, row_ok, col_ok = _program_tile(tiles_k, M, K, BLOCK_M, BLOCK_K)
    _, bits = _load(x_ptr, rows[:, None] * K + cols[None, :], row_ok[:, None] & col_ok[None, :])
    if REDUCE == 1:
        tl.atomic_max(out_ptr + pid_m * out_stride_m + pid_k * out_stride_k, tl.max(tl.max(bits, axis=1), axis=0))
    elif REDUCE == 2:
        tl.atomic_max(out_ptr + rows * out_stride_m + pid_k * out_stride_k, tl.max(bits, axis=1), mask=row_ok)
    elif REDUCE == 3:
        tl.atomic_max(out_ptr + pid_m * out_stride_m + cols * out_stride_k, tl.max(bits, axis=0), mask=col_ok)
    if REDUCE2 == 3:
        tl.atomic_max(out2_ptr + pid_m * out2_stride_m + cols * out2_stride_k, tl.max(bits, axis=0), mask=col_ok)


@triton.jit
def _rowwise_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    amax_ptr,
    given_ptr,
    M,
    K,
    SOURCE: tl.constexpr,
    POWER_OF_TWO: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    """Rowwise quantization of BLOCK_M rows: amax of each row, then its cast (no transpose)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    lanes = tl.arange(0, BLOCK_K)
    fp8 = data_ptr.dtype.element_ty
    if SINGLE_BLOCK:
        # The whole row fits one block: one load, kept in registers for the cast.
        offsets = rows[:, None] * K + lanes[None, :]
        mask = row_ok[:, None] & (lanes < K)[None, :]
        value, bits = _load(x_ptr, offsets, mask)
        amax_bits = tl.max(bits, axis=1)
    else:
        amax_bits = tl.zeros([BLOCK_M], dtype=tl.int32)
        if SOURCE != 1:
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + lanes
                _, bits = _load(x_ptr, rows[:, None] * K + cols[None, :], row_ok[:, None] & (cols < K)[None, :])
                amax_bits = tl.maximum(amax_bits, tl.max(bits, axis=1))
    if SOURCE == 1:
        amax = tl.load(given_ptr + rows, mask=row_ok, other=0.0)
        q = _quant_scale_from_amax(amax, FP8_MAX, POWER_OF_TWO)
    else:
        amax = amax_bits.to(tl.float32, bitcast=True)
        if SOURCE == 2:
            q = _reciprocal(tl.load(given_ptr + rows, mask=row_ok, other=1.0))
        else:
            q = _quant_scale_from_amax(amax, FP8_MAX, POWER_OF_TWO)
    tl.store(amax_ptr + rows, amax, mask=row_ok)
    tl.store(scale_ptr + rows, _reciprocal(q), mask=row_ok)
    if SINGLE_BLOCK:
        tl.store(data_ptr + offsets, _cast(value, q[:, None], FP8_MAX, fp8), mask=mask)
    else:
        # Second sweep over the rows, just read: served from cache.
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + lanes
            mask = row_ok[:, None] & (cols < K)[None, :]
            offsets = rows[:, None] * K + cols[None, :]
            value, _ = _load(x_ptr, offsets, mask)
            tl.store(data_ptr + offsets, _cast(value, q[:, None], FP8_MAX, fp8), mask=mask)


@triton.jit
def _quantize_tiles_kernel(
    x_ptr,
    data_ptr,
    data_t_ptr,
    scale_ptr,
    scale_t_ptr,
    amax_bits_ptr,
    given_ptr,
    col_amax_bits_ptr,
    M,
    K,
    tiles_k,
    groups_k,
    groups_m,
    GRANULARITY: tl.constexpr,
    SOURCE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    POWER_OF_TWO: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Quantize one [BLOCK_M, BLOCK_K] tile of x ([M, K]) into data (and data_t = [K, M]).

    groups_k / groups_m: 128-groups along K / along M (the row strides of the block scales and of
    their transposes). amax_bits_ptr: the returned amax as int32 bits (zero-initialized where
    combined with atomics).
    tensorwise:   one group; its amax is read from amax_bits (current scaling: _amax_flat_kernel
                  ran first), or derived from given (amax or scale).
    rowwise:      transpose with current scaling only; row amax in amax_bits, column amax in
                  col_amax_bits (both from _amax_tiles_kernel).
    block1x128:   BLOCK_K == 128; with transpose also BLOCK_M == 128 (column groups of 128 rows).
    block128x128: BLOCK_M == BLOCK_K == 128, one group per program.
    """
    pid_m, pid_k, rows, cols, row_ok, col_ok = _program_tile(tiles_k, M, K, BLOCK_M, BLOCK_K)
    mask = row_ok[:, None] & col_ok[None, :]
    value, bits = _load(x_ptr, rows[:, None] * K + cols[None, :], mask)
    fp8 = data_ptr.dtype.element_ty
    first = (pid_m == 0) & (pid_k == 0)

    if GRANULARITY == 0 or GRANULARITY == 3:
        # One multiplier for the whole tile, shared by data and data_t.
        if GRANULARITY == 0:
            group = 0
        else:
            group = pid_m * groups_k + pid_k
        if SOURCE == 1:
            amax = tl.load(given_ptr + group)
            q = _quant_scale_from_amax(amax, FP8_MAX, POWER_OF_TWO)
            if GRANULARITY == 0:
                tl.store(amax_bits_ptr, amax.to(tl.int32, bitcast=True), mask=first)
            else:
                tl.store(amax_bits_ptr + group, amax.to(tl.int32, bitcast=True))
        elif SOURCE == 0 and GRANULARITY == 0:
            q = _quant_scale_from_amax(tl.load(amax_bits_ptr).to(tl.float32, bitcast=True), FP8_MAX, POWER_OF_TWO)
        else:
            amax_bits = tl.max(tl.max(bits, axis=1), axis=0)
            if GRANULARITY == 0:
                tl.atomic_max(amax_bits_ptr, amax_bits)
            else:
                tl.store(amax_bits_ptr + group, amax_bits)
            if SOURCE == 2:
                q = _reciprocal(tl.load(given_ptr + group))
            else:
                q = _quant_scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FP8_MAX, POWER_OF_TWO)
        scale = _reciprocal(q)
        if GRANULARITY == 0:
            tl.store(scale_ptr, scale, mask=first)
            if TRANSPOSE:
                tl.store(scale_t_ptr, scale, mask=first)
        else:
            tl.store(scale_ptr + group, scale)
            if TRANSPOSE:
                tl.store(scale_t_ptr + pid_k * groups_m + pid_m, scale)
        data = _cast(value, q, FP8_MAX, fp8)
        tl.store(data_ptr + rows[:, None] * K + cols[None, :], data, mask=mask)
        if TRANSPOSE:
            tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(data), mask=tl.trans(mask))
    else:
        # Row groups (rowwise: whole rows; block1x128: the tile's 128 columns) and, for the
        # transpose, column groups (whole columns; block1x128: the tile's 128 rows of a column).
        if GRANULARITY == 1:
            row_amax = tl.load(amax_bits_ptr + rows, mask=row_ok, other=0).to(tl.float32, bitcast=True)
            q_rows = _quant_scale_from_amax(row_amax, FP8_MAX, POWER_OF_TWO)
            tl.store(scale_ptr + rows, _reciprocal(q_rows), mask=row_ok & (pid_k == 0))
        else:
            groups = rows * groups_k + pid_k
            if SOURCE == 1:
                row_amax = tl.load(given_ptr + groups, mask=row_ok, other=0.0)
                q_rows = _quant_scale_from_amax(row_amax, FP8_MAX, POWER_OF_TWO)
                tl.store(amax_bits_ptr + groups, row_amax.to(tl.int32, bitcast=True), mask=row_ok)
            else:
                row_amax_bits = tl.max(bits, axis=1)
                tl.store(amax_bits_ptr + groups, row_amax_bits, mask=row_ok)
                if SOURCE == 2:
                    q_rows = _reciprocal(tl.load(given_ptr + groups, mask=row_ok, other=1.0))
                else:
                    q_rows = _quant_scale_from_amax(row_amax_bits.to(tl.float32, bitcast=True), FP8_MAX, POWER_OF_TWO)
            tl.store(scale_ptr + groups, _reciprocal(q_rows), mask=row_ok)
        tl.store(data_ptr + rows[:, None] * K + cols[None, :], _cast(value, q_rows[:, None], FP8_MAX, fp8), mask=mask)
        if TRANSPOSE:
            if GRANULARITY == 1:
                col_amax = tl.load(col_amax_bits_ptr + cols, mask=col_ok, other=0).to(tl.float32, bitcast=True)
                q_cols = _quant_scale_from_amax(col_amax, FP8_MAX, POWER_OF_TWO)
                tl.store(scale_t_ptr + cols, _reciprocal(q_cols), mask=col_ok & (pid_m == 0))
            else:
                col_amax = tl.max(bits, axis=0).to(tl.float32, bitcast=True)
                q_cols = _quant_scale_from_amax(col_amax, FP8_MAX, POWER_OF_TWO)
                tl.store(scale_t_ptr + cols * groups_m + pid_m, _reciprocal(q_cols), mask=col_ok)
            data_t = _cast(value, q_cols[None, :], FP8_MAX, fp8)
            tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(data_t), mask=tl.trans(mask))


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _rows_cols(shape: torch.Size) -> tuple[int, int]:
    """``x`` as ``[M, K]`` (leading dims flattened; a 0-d tensor is one element)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _row_blocks(k: int) -> tuple[int, int]:
    """(rows, columns) of a rowwise block: whole rows up to _ROW_BLOCK columns, several short rows."""
    block_k = min(triton.next_power_of_2(max(k, 1)), _ROW_BLOCK)
    return max(1, min(64, _ROW_BLOCK // block_k)), block_k


def _tile_warps(block_m: int, block_k: int) -> int:
    return _LARGE_TILE_WARPS if block_m * block_k >= 8192 else 4


def _launcher(kernel, wrap: Callable | None):
    return kernel if wrap is None else wrap(kernel)


def _unused(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A stand-in for a pointer argument the specialization never touches. Never another argument:
    traced under wrap_triton without a driver, every pointer counts as written, and one tensor
    passed twice would be cloned twice and written back twice."""
    return torch.empty(1, dtype=dtype, device=device)


def _check_given(name: str, given: torch.Tensor, x: torch.Tensor, expected: tuple[int, ...], granularity: str):
    if given.dtype != torch.float32:
        raise TypeError(f"fastmesh.kernels.fp8_quantize: {name} must be float32, got {given.dtype}")
    if given.device != x.device:
        raise ValueError(f"fastmesh.kernels.fp8_quantize: {name} must be on {x.device}, got {given.device}")
    if tuple(given.shape) != expected:
        raise ValueError(
            f"fastmesh.kernels.fp8_quantize: {name} must have shape {list(expected)} for granularity "
            f"{granularity!r}, got {list(given.shape)}"
        )


def amax(x: torch.Tensor, granularity: str = "tensorwise", *, wrap: Callable | None = None) -> torch.Tensor:
    """max |x| per scaling group, float32, in the layout of the scale (``fp8_reference.group_amax``).

    NaN wins and inf propagates; a group with no elements has amax 0.
    """
    if granularity not in _GRANULARITY_CODE:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    x = x.contiguous()
    m, k = _rows_cols(x.shape)
    out_bits = torch.zeros(scale_shape(x.shape, granularity), dtype=torch.int32, device=x.device)
    if x.numel() == 0:
        return out_bits.view(torch.float32)
    if granularity == "tensorwise":
        blocks = _cdiv(x.numel(), _FLAT_BLOCK)
        programs = min(blocks, _FLAT_MAX_PROGRAMS)
        _launcher(_amax_flat_kernel, wrap)[(programs,)](
            x, out_bits, x.numel(), _cdiv(blocks, programs), BLOCK=_FLAT_BLOCK
        )
        return out_bits.view(torch.float32)
    if granularity == "rowwise":
        block_m, block_k = _row_blocks(k)
        reduce, strides = _REDUCE_ROWS, (1, 0)
    elif granularity == "block1x128":
        block_m, block_k = _BLOCK1X128_ROWS, BLOCK
        reduce, strides = _REDUCE_ROWS, (_cdiv(k, BLOCK), 1)
    else:
        block_m, block_k = BLOCK, BLOCK
        reduce, strides = _REDUCE_TILE, (_cdiv(k, BLOCK), 1)
    tiles_k = _cdiv(k, block_k)
    _launcher(_amax_tiles_kernel, wrap)[(_cdiv(m, block_m) * tiles_k,)](
        x,
        out_bits,
        _unused(torch.int32, x.device),
        m,
        k,
        tiles_k,
        strides[0],
        strides[1],
        0,
        0,
        REDUCE=reduce,
        REDUCE2=_REDUCE_NONE,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=_tile_warps(block_m, block_k),
    )
    return out_bits.view(torch.float32)


def _quantize_transpose_by_copy(x, dtype, granularity, scale, amax, power_of_two, wrap) -> Quantized:
    """transpose=True for tensorwise / block128x128 with a float32 or float16 x: the cast of x, then the cast of a
    transposed copy of x under the same multipliers (its amax, or the given scale, transposed for 128 x 128).

    The one-pass kernel's transposed store (one multiplier per tile) wrote wrong data_t bytes for float32 inputs on
    an H200 under triton 3.6 (bench/gpu_check_fp8.py, 2026-12-04: a quarter to a third of [2112, 4224]; bfloat16
    and the per-row / per-column branch were right); the cause is not found, so these inputs take two passes."""
    log_once(
        logger,
        logging.WARNING,
        ("transpose-by-copy", granularity, x.dtype),
        "fastmesh.kernels.fp8_quantize: transpose=True with granularity %r and %s input casts x, then a transposed "
        "copy of x (the one-pass transposed store is wrong for these inputs on an H200 with triton 3.6; see "
        "docs/fp8.md)",
        granularity,
        x.dtype,
    )
    rows = x.reshape(_rows_cols(x.shape))
    first = quantize(rows, dtype, granularity, scale, amax, False, power_of_two, wrap=wrap)

    def transposed(t):
        return t if t is None or t.dim() == 0 else t.t().contiguous()

    # The same multipliers: a given scale stays given; otherwise the amax (given or just computed) is given.
    given_scale, given_amax = (transposed(scale), None) if scale is not None else (None, transposed(first.amax))
    columns = rows.t().contiguous()
    second = quantize(columns, dtype, granularity, given_scale, given_amax, False, power_of_two, wrap=wrap)
    return Quantized(first.data.reshape(x.shape), first.scale, first.amax, second.data, second.scale)


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    transpose: bool = False,
    power_of_two: bool = False,
    *,
    wrap: Callable | None = None,
) -> Quantized:
    """FP8 cast-and-scale of ``x`` (the contract of ``fp8_reference.quantize``, bit for bit).

    Args:
        x: float32 / bfloat16 / float16, any shape (made contiguous); granularities act on x as [M, K].
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: ``"tensorwise"``, ``"rowwise"``, ``"block1x128"`` or ``"block128x128"``.
        scale: a given dequantization scale (float32, scale layout): q = 1 / scale.
        amax: a given amax (float32, scale layout): q = quant_scale_from_amax(amax); returned as is.
        transpose: also quantize x2d^T ([K, M]) with the same granularity (data_t, scale_t).
        power_of_two: round q down to a power of two (ignored with a given scale).
        wrap: applied to each kernel before its launch (``torch.library.wrap_triton`` in the op).

    Returns:
        ``Quantized(data, scale, amax, data_t, scale_t)``:

        =========  ======================================  =========================================
        data       x.shape, dtype                          fp8(saturate(x * q))
        scale      scale_shape(x.shape, granularity), f32  1 / q per group
        amax       same as scale                           max |x| per group (the given one if given)
        data_t     [K, M], dtype, or None                  quantization of x2d^T
        scale_t    scale layout of [K, M], or None         tensorwise: [] ; 128x128: scale^T
        =========  ======================================  =========================================
    """
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if granularity not in _GRANULARITY_CODE:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if scale is not None and amax is not None:
        raise ValueError("give at most one of scale and amax")
    if transpose and x.dim() < 2:
        raise ValueError(f"transpose needs x.dim() >= 2, got {x.dim()}")
    gran = _GRANULARITY_CODE[granularity]
    given = scale if scale is not None else amax
    source = _SOURCE_SCALE if scale is not None else _SOURCE_AMAX if amax is not None else _SOURCE_CURRENT
    if transpose and given is not None and gran in (_ROWWISE, _BLOCK1X128):
        raise ValueError(
            f"transpose with a given scale or amax needs granularity 'tensorwise' or "
            f"'block128x128', got {granularity!r}"
        )
    x = x.contiguous()
    m, k = _rows_cols(x.shape)
    s_shape = scale_shape(x.shape, granularity)
    if given is not None:
        _check_given("scale" if scale is not None else "amax", given, x, s_shape, granularity)
        given = given.contiguous()
    if transpose and gran in (_TENSORWISE, _BLOCK128X128) and x.dtype != torch.bfloat16:
        return _quantize_transpose_by_copy(x, dtype, granularity, scale, amax, power_of_two, wrap)
    fp8_max = FP8_MAX[dtype]
    device = x.device

    data = torch.empty(x.shape, dtype=dtype, device=device)
    scale_out = torch.empty(s_shape, dtype=torch.float32, device=device)
    data_t = scale_t = None
    if transpose:
        data_t = torch.empty((k, m), dtype=dtype, device=device)
        scale_t = torch.empty(scale_shape((k, m), granularity), dtype=torch.float32, device=device)
    # The returned amax, as int32 bits: zero (the bits of +0.0, the identity of the max) where it is
    # combined with atomics.
    atomic_amax = (gran == _TENSORWISE and source != _SOURCE_AMAX) or (gran == _ROWWISE and transpose)
    amax_bits = (torch.zeros if atomic_amax else torch.empty)(s_shape, dtype=torch.int32, device=device)
    given_arg = given if given is not None else _unused(torch.float32, device)
    common = dict(POWER_OF_TWO=bool(power_of_two), FP8_MAX=fp8_max)

    if gran == _ROWWISE and not transpose:
        if m > 0:
            block_m, block_k = _row_blocks(k)
            _launcher(_rowwise_kernel, wrap)[(_cdiv(m, block_m),)](
                x,
                data,
                scale_out,
                amax_bits.view(torch.float32),
                given_arg,
                m,
                k,
                SOURCE=source,
                BLOCK_M=block_m,
                BLOCK_K=block_k,
                SINGLE_BLOCK=k <= block_k,
                **common,
            )
        return Quantized(data, scale_out, amax_bits.view(torch.float32), None, None)

    col_amax_bits = None
    if gran == _TENSORWISE:
        if transpose:
            block_m = block_k = _TRANSPOSE_TILE
            tile_m, tile_k = m, k
        else:
            # Elementwise once the multiplier is known: stream x as one long row.
            block_m, block_k = 1, _FLAT_BLOCK
            tile_m, tile_k = 1, x.numel()
        if source == _SOURCE_CURRENT and x.numel() > 0:
            blocks = _cdiv(x.numel(), _FLAT_BLOCK)
            programs = min(blocks, _FLAT_MAX_PROGRAMS)
            _launcher(_amax_flat_kernel, wrap)[(programs,)](
                x, amax_bits, x.numel(), _cdiv(blocks, programs), BLOCK=_FLAT_BLOCK
            )
    elif gran == _ROWWISE:  # with transpose, current scaling
        block_m = block_k = _TRANSPOSE_TILE
        tile_m, tile_k = m, k
        col_amax_bits = torch.zeros((k,), dtype=torch.int32, device=device)
        tiles_k = _cdiv(k, block_k)
        if x.numel() > 0:
            _launcher(_amax_tiles_kernel, wrap)[(_cdiv(m, block_m) * tiles_k,)](
                x,
                amax_bits,
                col_amax_bits,
                m,
                k,
                tiles_k,
                1,
                0,
                0,
                1,
                REDUCE=_REDUCE_ROWS,
                REDUCE2=_REDUCE_COLS,
                BLOCK_M=block_m,
                BLOCK_K=block_k,
            )
    elif gran == _BLOCK1X128:
        block_m, block_k = (BLOCK if transpose else _BLOCK1X128_ROWS), BLOCK
        tile_m, tile_k = m, k
    else:
        block_m = block_k = BLOCK
        tile_m, tile_k = m, k

    tiles_m, tiles_k = _cdiv(tile_m, block_m), _cdiv(tile_k, block_k)
    if gran in (_TENSORWISE, _ROWWISE):
        # Groups with no elements still get their scale (1): with M == 0 or K == 0 one row / column
        # of tiles (all masked) writes the scales of the other dimension.
        tiles_m, tiles_k = max(tiles_m, 1), max(tiles_k, 1)
    programs = tiles_m * tiles_k
    if programs > 0:
        if not transpose:
            data_t_arg, scale_t_arg = _unused(dtype, device), _unused(torch.float32, device)
        else:
            data_t_arg, scale_t_arg = data_t, scale_t
        if col_amax_bits is None:
            col_amax_bits = _unused(torch.int32, device)
        _launcher(_quantize_tiles_kernel, wrap)[(programs,)](
            x,
            data,
            data_t_arg,
            scale_out,
            scale_t_arg,
            amax_bits,
            given_arg,
            col_amax_bits,
            tile_m,
            tile_k,
            tiles_k,
            _cdiv(k, BLOCK),
            _cdiv(m, BLOCK),
            GRANULARITY=gran,
            SOURCE=source,
            TRANSPOSE=bool(transpose),
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            num_warps=_tile_warps(block_m, block_k),
            **common,
        )
    return Quantized(data, scale_out, amax_bits.view(torch.float32), data_t, scale_t)

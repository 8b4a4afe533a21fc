"""Triton kernels of the MX cast (MXFP8; ``fastmesh::mx_quantize`` on CUDA), and its launcher.

The contract is that of :func:`fastmesh.kernels.mx_reference.quantize_mx`, bit for bit (NaN bytes aside: the
kernel writes the hardware's canonical NaN). On ``x`` viewed as ``[M, K]``, per block of 32 consecutive elements
of a row (and with ``transpose``, of 32 consecutive rows of a column)::

    amax  = max |x|                        fp32, NaN wins (an integer max of the magnitude bits)
    bits  = mx_scale_bits(amax)            the biased E8M0 exponent, "floor" or "rceil"   (csrc/.../mx_math.h)
    data  = fp8(clamp(float(x) * mx_multiplier(bits), -fp8_max, fp8_max))   one fp32 multiply, native RNE cast

Without ``transpose`` the blocks are consecutive runs of 32 elements of the flat x: one program casts
``_FLAT_BLOCKS`` of them, a ``[_FLAT_BLOCKS, 32]`` tile whose rows are the blocks (no reshape, so no layout change
between the load, the block max and the store). With ``transpose`` one program per ``[BLOCK_M, BLOCK_K]`` tile
(both multiples of 32) reads x once and writes data, scale and amax, data_t (through ``tl.trans``) and scale_t.
Shapes: those of the op (``fastmesh/ops/mx_quantize.py``): data x's shape, scale (E8M0) and amax (fp32)
``[..., K/32]``, data_t ``[K, M]``, scale_t ``[K, M/32]`` (``formats.mx_shapes``). :func:`quantize` takes the
op's arguments, which the op checks first (as the FP8 cast kernels' ``quantize`` does), and ``wrap``, applied to the
kernel before its launch (the op passes ``torch.library.wrap_triton``; tests under ``TRITON_INTERPRET=1`` pass
nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from fastmesh.kernels.formats import MX_BLOCK, mx_shapes
from fastmesh.kernels.fp8_quantize import FP8_MAX, Quantized, _cast, _cdiv, _launcher, _load, _program_tile

__all__ = ["quantize"]

# fp8_emax of mx_math.h: the exponent of the format's largest power of two (448 = 1.75 * 2^8).
_EMAX = {dtype: math.frexp(fp8_max)[1] - 1 for dtype, fp8_max in FP8_MAX.items()}
# Work per program, from `bench/gpu_check_fp8.py --impl triton --sweep` on an H200 (2026-12-04, 8192 x 8192 bf16,
# CUDA-graph times): flat 128 blocks 0.051 ms (100% of copy) against 0.054 at 256 and 0.059 at 512; the
# transposed tile 32 x 128 0.161 ms against 0.275 at 64 x 128 and 0.308 at 64 x 256.
_FLAT_BLOCKS = 128
_FLAT_WARPS = 8
_BLOCK_M = 32
_BLOCK_K = 128
# Warps of a transposed tile program (up to 32 x 128); the GPU check sweeps it (the tile ran at 42% of copy).
_TRANSPOSE_WARPS = 4

_E8M0_BIAS: tl.constexpr = tl.constexpr(127)
_E8M0_NAN: tl.constexpr = tl.constexpr(0xFF)
_ABS_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
_FP32_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)


# ------------------------------------------------------------------------------------------------
# Scale math (mirrors csrc/include/fastmesh/mx_math.h, formula for formula)
# ------------------------------------------------------------------------------------------------


@triton.jit
def _clamp_exponent(e, lo: tl.constexpr, hi: tl.constexpr):
    return tl.where(e < lo, lo, tl.where(e > hi, hi, e))


@triton.jit
def _mx_scale_bits(amax, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """mx_scale_bits: the biased E8M0 exponent (int32, 0-255) of blocks whose largest magnitude is ``amax``."""
    if not RCEIL:
        # amax's exponent field: a zero or subnormal amax counts as 2^-127, an infinite one as 2^128.
        bits = amax.to(tl.int32, bitcast=True) & _ABS_MASK
        e = (bits >> 23) - _E8M0_BIAS - EMAX
        biased = _clamp_exponent(e, -127, 128) + _E8M0_BIAS
        result = tl.where(bits > _FP32_INF_BITS, _E8M0_NAN, biased)
    else:
        # div_rn: `/` on fp32 is an approximate division on the GPU; the rule is on the IEEE quotient.
        d = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX).to(tl.int32, bitcast=True) & _ABS_MASK
        field = d >> 23
        mantissa = d & 0x7FFFFF
        # ceil(log2(d)), exactly: a normal d's exponent, plus one unless d is a power of two; a subnormal d
        # (m * 2^-149, 0 < m < 2^23) lies in (2^-127, 2^-126) when m > 2^22, else at or below 2^-127.
        subnormal = tl.where(mantissa > (1 << 22), -126, -127)
        e = tl.where(field != 0, field - _E8M0_BIAS + (mantissa != 0).to(tl.int32), subnormal)
        biased = _clamp_exponent(e, -127, 127) + _E8M0_BIAS
        result = tl.where(d > _FP32_INF_BITS, _E8M0_NAN, tl.where(d == _FP32_INF_BITS, 0xFE, biased))
    return result


@triton.jit
def _mx_multiplier(b, RCEIL: tl.constexpr):
    """mx_multiplier: what the elements of a block with E8M0 bits ``b`` (int32) are multiplied by."""
    # Built from fp32 bits, as the header does: 2^-127 is subnormal and NaN has no literal.
    power = tl.where(
        b <= 253,
        ((254 - b) << 23).to(tl.float32, bitcast=True),
        (tl.zeros_like(b) + 0x00400000).to(tl.float32, bitcast=True),
    )
    if not RCEIL:
        at_zero = (tl.zeros_like(b) + (253 << 23)).to(tl.float32, bitcast=True)
        result = tl.where(b == 0, at_zero, tl.where(b == _E8M0_NAN, 0.0, power))
    else:
        nan = (tl.zeros_like(b) + 0x7FC00000).to(tl.float32, bitcast=True)
        result = tl.where(b == 0, 1.0, tl.where(b == _E8M0_NAN, nan, power))
    return result


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _mx_flat_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    amax_ptr,
    num_blocks,
    RCEIL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The MX cast of BLOCKS consecutive 32-element blocks of the flat x (num_blocks in all); scale_ptr a uint8 view."""
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    block_ok = blocks < num_blocks
    offsets = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = tl.broadcast_to(block_ok[:, None], [BLOCKS, 32])
    value, bits = _load(x_ptr, offsets, mask)
    amax_bits = tl.max(bits, axis=1)
    e8m0 = _mx_scale_bits(amax_bits.to(tl.float32, bitcast=True), FP8_MAX, EMAX, RCEIL)
    data = _cast(value, _mx_multiplier(e8m0, RCEIL)[:, None], FP8_MAX, data_ptr.dtype.element_ty)
    tl.store(data_ptr + offsets, data, mask=mask)
    tl.store(scale_ptr + blocks, e8m0.to(tl.uint8), mask=block_ok)
    tl.store(amax_ptr + blocks, amax_bits.to(tl.float32, bitcast=True), mask=block_ok)


@triton.jit
def _mx_transpose_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    amax_ptr,
    data_t_ptr,
    scale_t_ptr,
    M,
    K,
    tiles_k,
    RCEIL: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The MX cast of one [BLOCK_M, BLOCK_K] tile of x ([M, K], 32 | K and 32 | M), by rows and by columns.

    scale_ptr / scale_t_ptr: uint8 views of the E8M0 outputs. Rows past M load as 0, so a column block
    with no row of x has amax 0; every store of them is masked."""
    pid_m, pid_k, rows, cols, row_ok, col_ok = _program_tile(tiles_k, M, K, BLOCK_M, BLOCK_K)
    mask = row_ok[:, None] & col_ok[None, :]
    value, bits = _load(x_ptr, rows[:, None] * K + cols[None, :], mask)
    fp8 = data_ptr.dtype.element_ty

    # Row blocks: 32 consecutive columns of a row.
    row_amax_bits = tl.max(tl.reshape(bits, [BLOCK_M, BLOCK_K // 32, 32]), axis=2)
    row_e8m0 = _mx_scale_bits(row_amax_bits.to(tl.float32, bitcast=True), FP8_MAX, EMAX, RCEIL)
    row_q = _mx_multiplier(row_e8m0, RCEIL)
    data = _cast(tl.reshape(value, [BLOCK_M, BLOCK_K // 32, 32]), row_q[:, :, None], FP8_MAX, fp8)
    data = tl.reshape(data, [BLOCK_M, BLOCK_K])
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], data, mask=mask)
    block_cols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    blocks = rows[:, None] * (K // 32) + block_cols[None, :]
    block_mask = row_ok[:, None] & (block_cols < K // 32)[None, :]
    tl.store(scale_ptr + blocks, row_e8m0.to(tl.uint8), mask=block_mask)
    tl.store(amax_ptr + blocks, row_amax_bits.to(tl.float32, bitcast=True), mask=block_mask)

    # Column blocks: 32 consecutive rows of a column, cast from the same registers.
    col_amax_bits = tl.max(tl.reshape(bits, [BLOCK_M // 32, 32, BLOCK_K]), axis=1)
    col_e8m0 = _mx_scale_bits(col_amax_bits.to(tl.float32, bitcast=True), FP8_MAX, EMAX, RCEIL)
    col_q = _mx_multiplier(col_e8m0, RCEIL)
    data_t = _cast(tl.reshape(value, [BLOCK_M // 32, 32, BLOCK_K]), col_q[:, None, :], FP8_MAX, fp8)
    data_t = tl.reshape(data_t, [BLOCK_M, BLOCK_K])
    tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(data_t), mask=tl.trans(mask))
    block_rows = pid_m * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)
    blocks_t = cols[None, :] * (M // 32) + block_rows[:, None]
    block_t_mask = (block_rows < M // 32)[:, None] & col_ok[None, :]
    tl.store(scale_t_ptr + blocks_t, col_e8m0.to(tl.uint8), mask=block_t_mask)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------


def _tile(k: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): powers of two, multiples of 32, no wider than K needs."""
    return _BLOCK_M, min(_BLOCK_K, max(MX_BLOCK, triton.next_power_of_2(k)))


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    scale_rounding: str = "floor",
    transpose: bool = False,
    *,
    wrap: Callable | None = None,
) -> Quantized:
    """The MX cast of ``x`` (the contract of ``mx_reference.quantize_mx``, bit for bit).

    Args:
        x: float32 / bfloat16 / float16, 32 dividing its last dim (made contiguous); with ``transpose`` at
            least 2-D, 32 dividing its rows (the product of every dim but the last).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_rounding: ``"floor"`` (the OCP spec's) or ``"rceil"``.
        transpose: also cast the columns of x as [M, K] (data_t, scale_t).
        wrap: applied to the kernel before its launch (``torch.library.wrap_triton`` in the op).

    Returns:
        ``Quantized(data, scale, amax, data_t, scale_t)``: data x's shape in ``dtype``, scale
        (``torch.float8_e8m0fnu``) and amax (float32) ``[..., K/32]``; data_t ``[K, M]`` and scale_t
        ``[K, M/32]`` with ``transpose``, else None.
    """
    x = x.contiguous()
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    scale_shape, data_t_shape, scale_t_shape = mx_shapes(x.shape)
    device = x.device
    data = torch.empty(x.shape, dtype=dtype, device=device)
    # E8M0 written as its bytes: the kernel (and the interpreter) see a uint8 view.
    scale = torch.empty(scale_shape, dtype=torch.float8_e8m0fnu, device=device)
    amax = torch.empty(scale_shape, dtype=torch.float32, device=device)
    data_t = scale_t = None
    if transpose:
        data_t = torch.empty(data_t_shape, dtype=dtype, device=device)
        scale_t = torch.empty(scale_t_shape, dtype=torch.float8_e8m0fnu, device=device)
    rule = dict(RCEIL=scale_rounding == "rceil", FP8_MAX=FP8_MAX[dtype], EMAX=_EMAX[dtype])
    if x.numel() > 0 and not transpose:
        num_blocks = x.numel() // MX_BLOCK
        _launcher(_mx_flat_kernel, wrap)[(_cdiv(num_blocks, _FLAT_BLOCKS),)](
            x,
            data,
            scale.view(torch.uint8),
            amax,
            num_blocks,
            **rule,
            BLOCKS=_FLAT_BLOCKS,
            num_warps=_FLAT_WARPS,
        )
    elif x.numel() > 0:
        block_m, block_k = _tile(k)
        tiles_k = _cdiv(k, block_k)
        _launcher(_mx_transpose_kernel, wrap)[(_cdiv(m, block_m) * tiles_k,)](
            x,
            data,
            scale.view(torch.uint8),
            amax,
            data_t,
            scale_t.view(torch.uint8),
            m,
            k,
            tiles_k,
            **rule,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            num_warps=_TRANSPOSE_WARPS,
        )
    return Quantized(data, scale, amax, data_t, scale_t)

"""Plain-PyTorch reference of the MX cast (OCP Microscaling v1.0, MXFP8): the oracle for tests and benchmarks.

Written from the spec with ordinary torch ops and no fastmesh code. x is cut into blocks of 32 consecutive
elements along its last dim (which 32 must divide); each block shares one power-of-two scale ``2**e``, stored as
E8M0 (``torch.float8_e8m0fnu``: the biased exponent ``e + 127`` in one byte, 0xFF for NaN), and its elements are
cast to FP8 as ``saturate(x / 2**e)``. With ``amax`` the block's largest magnitude (fp32; NaN wins):

* ``"floor"`` (the spec's own rule): ``e = floor(log2(amax)) - emax``, ``emax`` the exponent of the FP8
  format's largest power of two (8 for e4m3fn: 448 = 1.75 * 2**8; 15 for e5m2), read off amax's fp32 exponent
  field (so a subnormal or zero amax counts as 2**-127 and an infinite one as 2**128), clamped to [-127, 128],
  and 0xFF where amax is NaN. The data are ``x / max(2**e, 2**-126)`` (an fp32 division; 2**-127 is no normal
  number).
* ``"rceil"`` (cuBLAS's and Transformer Engine's rule): ``e = ceil(log2(amax / fp8_max))`` of the fp32
  quotient, exactly (an exponent rounded up whenever its mantissa is not zero), clamped to [-127, 127]; 0xFF
  where amax is NaN, 0xFE where it is infinite. The data are ``x * r`` with ``r = 2**-e``, except ``r = 1`` for
  the biased exponent 0, 2**-127 for 0xFE and NaN for 0xFF.

In both, the FP8 cast rounds to nearest even and saturates at the format's max (infinities included); NaN
stays NaN. So a NaN block dequantizes to NaN everywhere; an infinite one keeps its infinities saturated at the
format's max beside a finite scale (the spec leaves that case to implementations; torchao's ``to_mx`` does
the same). ``transpose=True`` also casts the columns of the 2-D x (blocks of 32 along dim 0), as the backward
needs: ``quantize_mx(x.t().contiguous())``.
"""

from __future__ import annotations

import torch
from fastmesh.kernels.fp8_reference import Quantized, saturating_cast

MX_BLOCK = 32
ROUNDINGS = ("floor", "rceil")
E8M0_BIAS = 127
E8M0_NAN = 0xFF
EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each block of 32 along the last dim, fp32, ``[..., K/32]``."""
    blocks = x.float().abs().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    return blocks.amax(-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])


def _fp32_exponent_field(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.int32) >> 23) & 0xFF


def scale_bits(amax: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The biased E8M0 exponent of each block's scale (int32, 0-255)."""
    if rounding == "floor":
        e = _fp32_exponent_field(amax) - E8M0_BIAS - EMAX[dtype]
        bits = e.clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
        return torch.where(amax.isnan(), E8M0_NAN, bits)
    if rounding != "rceil":
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    descale = amax / FP8_MAX[dtype]
    field = _fp32_exponent_field(descale)
    mantissa = descale.view(torch.int32) & 0x7FFFFF
    # ceil(log2(d)): a normal d's exponent, plus one unless d is a power of two; a subnormal d (m * 2**-149 with
    # 0 < m < 2**23) lies in (2**-127, 2**-126) when m > 2**22, else at or below 2**-127 (clamped: -127).
    normal = field - E8M0_BIAS + (mantissa != 0).int()
    subnormal = torch.where(mantissa > 2**22, -126, -E8M0_BIAS)
    e = torch.where(field == 0, torch.where(mantissa == 0, -E8M0_BIAS, subnormal), normal)
    bits = e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return torch.where(descale.isnan(), E8M0_NAN, torch.where(descale.isinf(), 0xFE, bits))


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0 ** exponent in fp32, exactly (subnormal results included)."""
    return torch.pow(2.0, exponent.double()).float()


def scaled_values(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The fp32 values the FP8 cast rounds: ``x`` scaled per block by the rule of ``bits``, saturated, x's shape."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    b = bits.unsqueeze(-1)
    if rounding == "floor":
        scale = torch.where(b == E8M0_NAN, torch.inf, _pow2(b - E8M0_BIAS)).clamp(min=2.0**-126)
        values = blocks / scale
    else:
        r = torch.where(b == 0, 1.0, _pow2(E8M0_BIAS - b))
        r = torch.where(b == 0xFE, 2.0**-127, torch.where(b == E8M0_NAN, torch.nan, r))
        values = blocks * r
    return values.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).reshape(x.shape)


def quantize_mx(x: torch.Tensor, dtype: torch.dtype, rounding: str = "floor", transpose: bool = False) -> Quantized:
    """The MX cast of ``x`` (``[..., K]``, 32 dividing K): data (x's shape), scale (E8M0, ``[..., K/32]``),
    amax (fp32, per block), and with ``transpose`` the cast of the columns of x as ``[M, K]`` (leading dims
    flattened): ``[K, M]``, ``[K, M/32]``."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"the last dim must be a multiple of {MX_BLOCK}, got shape {list(x.shape)}")
    amax = block_amax(x)
    bits = scale_bits(amax, dtype, rounding)
    data = saturating_cast(scaled_values(x, bits, dtype, rounding), dtype)
    data_t = scale_t = None
    if transpose:
        transposed = quantize_mx(x.reshape(-1, x.shape[-1]).t().contiguous(), dtype, rounding)
        data_t, scale_t = transposed.data, transposed.scale
    return Quantized(data, bits.to(torch.uint8).view(torch.float8_e8m0fnu), amax, data_t, scale_t)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data * 2**e`` per block, fp32 (NaN where the scale is NaN)."""
    bits = scale.view(torch.uint8).int().unsqueeze(-1)
    factor = torch.where(bits == E8M0_NAN, torch.nan, _pow2(bits - E8M0_BIAS))
    blocks = data.float().reshape(*data.shape[:-1], data.shape[-1] // MX_BLOCK, MX_BLOCK)
    return (blocks * factor).reshape(data.shape)

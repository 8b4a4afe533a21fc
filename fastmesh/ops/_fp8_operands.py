"""The FP8 operands of the scaled fused ops, shared by their modules (``fused_collectives_fp8.py``,
``matmul_all_reduce.py``).

An FP8 operand is its data (float8_e4m3fn / float8_e5m2) and its dequantization scale (``x ~= data * scale``, each
scale covering its block) in one of these layouts, for ``a [..., K]`` (first operand) and ``b [K, N]`` (second)::

    layout       a's scale             b's scale                    scale dtype
    tensor-wise  []                    []                           float32
    row-wise     [..., 1]              [1, N] (one per column)      float32
    MX           [..., K/32]           [K/32, N]                    float8_e8m0fnu (32 | K)
    block        [..., ceil(K/128)]    [ceil(K/128), ceil(N/128)]   float32 (1x128 a, 128x128 b)

Tensor-wise and row-wise operands multiply through ``torch._scaled_mm``, and so do 1x128 a x 128x128 b block scales
where torch runs that form (SM90, ``csrc/fused/scaled.h``); otherwise, with MX or block scales on either operand,
both are dequantized to the product's dtype and multiplied (``docs/design/fp8.md``).
Here:

- the checks every scaled op makes on its operands and ``out_dtype``, in the wording of ``csrc/fused/scaled.h``
  (``check_scaled_operands`` for one ``a`` and one ``b``; ``check_scaled_b``, ``check_a_scale``,
  ``check_b_scale`` and ``check_out_dtype`` for the ops that take several ``b``);
- ``has_block_scales``, ``block_scaled_mm_runs`` and ``dequantizes``: which path a multiply of those layouts takes
  (``log_multiply`` says it);
- the fronts' ``fp8=`` option: ``check_config``, and the current-scaling quantization of a high-precision ``a``
  (``quantize_rows``) and ``b`` (``quantize_columns``) into those operands, and back (``dequantize``).
"""

from __future__ import annotations

import logging

import torch

from fastmesh import _cpp_lib
from fastmesh._log import log_once
from fastmesh.ops._checks import FLOAT_INPUTS, FP8_DTYPES, MX, MX_BLOCK, check_tensor
from fastmesh.ops.fp8_config import Float8Config
from fastmesh.ops.fp8_quantize import fp8_quantize
from fastmesh.ops.mx_quantize import mx_quantize

logger = logging.getLogger(__name__)

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The fronts' fp8= granularities: a's and b's quantization for each (b along its output columns).
GRANULARITIES = ("tensorwise", "rowwise", "mx", "block1x128")
_B_GRANULARITY = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mx": "mx", "block1x128": "block128x128"}
E8M0 = torch.float8_e8m0fnu
SCALE_BLOCK = 128  # elements per block scale (1x128 / 128x128); MX blocks are MX_BLOCK


# ---- checks (the wording of csrc/fused/scaled.h) ----


def _check_scale(scale, data, shapes: dict, k: int, op: str, arg: str, data_arg: str) -> str:
    """Which layout ``scale`` has (``shapes``: the row-wise, MX and block shapes for ``data``); ``k`` is data's
    contraction dim."""
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float32, E8M0):
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(
            f"{op}: {arg} must be float32 (tensor-wise, row-wise or block scales) or float8_e8m0fnu (MX scales), "
            f"got {got}"
        )
    check_tensor(scale, op, arg, (torch.float32, E8M0), device=data.device, device_of=data_arg)
    if scale.dtype == E8M0:
        if k % MX_BLOCK:
            raise ValueError(
                f"{op}: {arg} is an MX scale (float8_e8m0fnu): {data_arg}'s contraction dim must be a multiple of "
                f"{MX_BLOCK}, got {k}"
            )
        if list(scale.shape) != shapes["mx"]:
            raise ValueError(
                f"{op}: {arg} must have shape {shapes['mx']} (MX: one scale per {MX_BLOCK} elements along K), "
                f"got {list(scale.shape)}"
            )
        return "mx"
    if scale.dim() == 0:
        return "tensorwise"
    if list(scale.shape) == shapes["rowwise"]:
        return "rowwise"
    if list(scale.shape) != shapes["block"]:
        raise ValueError(
            f"{op}: {arg} must be tensor-wise (shape []), row-wise (shape {shapes['rowwise']}) or block (shape "
            f"{shapes['block']}), got shape {list(scale.shape)}"
        )
    return "block"


def _groups(size: int, block: int) -> int:
    return -(-size // block)


def check_a_scale(scale, a, op: str, arg: str = "a_scale", a_arg: str = "a") -> str:
    """The scale of an FP8 ``a`` (``[..., K]``) in one of the module's layouts; returns which
    (``"tensorwise"``, ``"rowwise"``, ``"mx"``, ``"block"``)."""
    lead, k = list(a.shape[:-1]), a.shape[-1]
    shapes = {"rowwise": lead + [1], "mx": lead + [k // MX_BLOCK], "block": lead + [_groups(k, SCALE_BLOCK)]}
    return _check_scale(scale, a, shapes, k, op, arg, a_arg)


def check_b_scale(scale, b, op: str, arg: str = "b_scale", b_arg: str = "b") -> str:
    """The scale of an FP8 ``b`` (``[K, N]``) in one of the module's layouts; returns which."""
    k, n = b.shape
    shapes = {
        "rowwise": [1, n],
        "mx": [k // MX_BLOCK, n],
        "block": [_groups(k, SCALE_BLOCK), _groups(n, SCALE_BLOCK)],
    }
    return _check_scale(scale, b, shapes, k, op, arg, b_arg)


def check_scaled_b(b, a, op: str, b_arg: str = "b", a_arg: str = "a", rows_of: str = "a's last dim") -> None:
    """An FP8 ``b`` (``[K, N]``) that multiplies ``a``: dtype, a's device, K rows (``rows_of`` names K)."""
    check_tensor(b, op, b_arg, FP8_DTYPES, min_dim=2, max_dim=2, device=a.device, device_of=a_arg)
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{op}: {b_arg} must have {a.shape[-1]} rows ({rows_of}), got shape {list(b.shape)}")


def check_out_dtype(out_dtype, op: str) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}")


def check_scaled_operands(a, a_scale, b, b_scale, out_dtype, op: str) -> tuple[str, str]:
    """The FP8 operands of a scaled ``a @ b`` (``a [..., K]``, ``b [K, N]``, each with its scale) and the
    product's ``out_dtype``. Returns a's and b's scale layouts."""
    check_tensor(a, op, "a", FP8_DTYPES, min_dim=1)
    check_scaled_b(b, a, op)
    layouts = check_a_scale(a_scale, a, op), check_b_scale(b_scale, b, op)
    check_out_dtype(out_dtype, op)
    return layouts


def has_block_scales(*layouts: str) -> bool:
    """Whether either operand of a multiply with these scale layouts (the checks' results) has MX or block
    scales: more than torch._scaled_mm's tensor-wise and row-wise forms."""
    return any(layout in ("mx", "block") for layout in layouts)


def block_scaled_mm_runs(a_dtype, b: torch.Tensor, layouts: tuple[str, str], out_dtype, column_part=None) -> bool:
    """Whether the scaled ops multiply ``a`` (of ``a_dtype``) by ``b`` with these scale layouts through
    torch._scaled_mm's 1x128 x 128x128 block form (``block_scaled_mm_runs`` in ``csrc/fused/scaled.h``: SM90,
    float8_e4m3fn, a bfloat16 product, K a multiple of 512, column slices of whole 128-column blocks).
    ``column_part``: the width of the column slices of b the op multiplies (default: all of b's columns)."""
    part = b.shape[1] if column_part is None else column_part
    return layouts == ("block", "block") and _cpp_lib.load().block_scaled_mm_runs(a_dtype, b, out_dtype, part)


def dequantizes(a_dtype, b: torch.Tensor, layouts: tuple[str, str], out_dtype, column_part=None) -> bool:
    """Whether that multiply dequantizes both operands and multiplies those (block scales torch does not take)."""
    return has_block_scales(*layouts) and not block_scaled_mm_runs(a_dtype, b, layouts, out_dtype, column_part)


def log_multiply(op: str, a_dtype, b: torch.Tensor, layouts: tuple[str, str], out_dtype, column_part=None) -> None:
    """Says, once per op, device, layouts and path, how a multiply of block-scaled operands runs
    (``block_scaled_mm_runs``' arguments)."""
    if not has_block_scales(*layouts):
        return
    native = block_scaled_mm_runs(a_dtype, b, layouts, out_dtype, column_part)
    if native:
        message = "%s: %s a and %s b scales on %s: torch._scaled_mm's 1x128 x 128x128 block-scaled form"
    else:
        message = (
            "%s: %s a and %s b scales on %s: dequantize-and-multiply in the product's dtype (torch._scaled_mm takes "
            "block scales only as 1x128 a x 128x128 b, on SM90: float8_e4m3fn, bfloat16 out, K a multiple of 512, "
            "column slices of whole 128-column blocks; docs/design/fp8.md)"
        )
    device = b.device.type
    log_once(logger, logging.INFO, (op, device, *layouts, native), message, op, *layouts, device)


# ---- the fronts' fp8= option ----


def check_config(config, op: str, dtype: torch.dtype | None = None) -> Float8Config:
    """``fp8=``: a ``Float8Config`` of current scaling, granularity one of ``GRANULARITIES``; ``dtype`` (the
    operands', where known) one FP8 casts from."""
    if not isinstance(config, Float8Config):
        raise TypeError(f"{op}: fp8 must be a fastmesh.fp8.Float8Config, got {type(config).__name__}")
    if config.granularity not in GRANULARITIES:
        raise ValueError(
            f"{op}: fp8 granularity must be one of {', '.join(map(repr, GRANULARITIES))} (a's quantization; b is "
            f"quantized alike along its output columns, or 128x128 for 'block1x128'), got {config.granularity!r}"
        )
    if dtype is not None and dtype not in FLOAT_INPUTS:
        raise TypeError(
            f"{op}: fp8= quantizes operands of dtype {', '.join(map(str, FLOAT_INPUTS))}, got {dtype}; "
            "leave fp8 out to multiply in that dtype"
        )
    if config.scaling != "current":
        raise ValueError(
            f"{op}: fp8= quantizes with current scaling; for delayed scaling quantize with your scales "
            "and call torch.ops.fastmesh.all_gather_scaled_matmul / scaled_matmul_reduce_scatter"
        )
    return config


def check_fp8_contraction(config: Float8Config, k: int, n: int, backward_in_fp8: bool, op: str) -> None:
    """MX blocks run along the contraction dim, which 32 must divide: K forward, and N (the product's columns)
    in an FP8 dgrad. Checked in the forward, so that a backward does not fail half-way."""
    if config.granularity != MX:
        return
    if k % MX_BLOCK:
        raise ValueError(
            f"{op}: fp8 granularity 'mx' needs the contraction dim (K = {k}) to be a multiple of {MX_BLOCK}"
        )
    if backward_in_fp8:
        check_fp8_dgrad_columns(config, n, op)


def check_fp8_dgrad_columns(config: Float8Config, n: int, op: str) -> None:
    """An FP8 dgrad in MX blocks contracts over the product's columns (N), which 32 must then divide."""
    if config.granularity == MX and n % MX_BLOCK:
        raise ValueError(
            f"{op}: fp8 granularity 'mx' with backward_in_fp8 needs the product's columns (N = {n}, the dgrad's "
            f"contraction dim) to be a multiple of {MX_BLOCK}; pass backward_in_fp8=False or pad N"
        )


def fp8_dgrad_possible(config: Float8Config, a: torch.Tensor) -> bool:
    """Whether a backward may take a's gradient in FP8 (called in a front, outside the autograd Function, whose
    forward runs with grad mode off). Without a gradient to take (no_grad, inference, a frozen activation), the
    dgrad's MX constraint on N does not apply."""
    return config.backward_in_fp8 and torch.is_grad_enabled() and a.requires_grad


def _quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str, config: Float8Config):
    """The casts below quantize's front: the config's options were checked when it was made."""
    if granularity == MX:
        data, scale, *_ = mx_quantize(x, dtype, config.scale_rounding or "floor")
        return data, scale
    q = fp8_quantize(x, dtype, granularity, power_of_two=config.power_of_two)
    return q.data, q.scale


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, config: Float8Config):
    """x ([..., K]) quantized per the config along its rows: data and a's scale layout (tensor-wise
    ``[]``, row-wise ``[..., 1]``, MX ``[..., K/32]``, block ``[..., ceil(K/128)]``)."""
    return _quantize(x, dtype, config.granularity, config)


def quantize_columns(b: torch.Tensor, dtype: torch.dtype, config: Float8Config):
    """b ([K, N]) quantized along its output columns (tensor-wise: one scale; row-wise: one per column; MX: blocks
    of 32 along K; 'block1x128': 128x128 blocks):
    column-major data and b's scale layout (``[]``, ``[1, N]``, ``[K/32, N]``, ``[ceil(K/128), ceil(N/128)]``),
    the layout _scaled_mm takes for its second operand where it takes one."""
    data, scale = _quantize(b.t(), dtype, _B_GRANULARITY[config.granularity], config)
    return data.t(), scale.t()

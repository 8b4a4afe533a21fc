"""The FP8 operands of the scaled fused ops, shared by their modules (``fused_collectives_fp8.py``,
``matmul_all_reduce.py``).

An FP8 operand is its data (float8_e4m3fn / float8_e5m2) and its dequantization scale (float32,
``x ~= data.float() * scale``) in a layout ``torch._scaled_mm`` takes: tensor-wise (0-d), or row-wise: one per row
of ``a`` (``[..., 1]``), one per column of ``b`` (``[1, N]``). Here:

- the checks every scaled op makes on its operands and ``out_dtype``, in the wording of ``csrc/fused/scaled.h``
  (``check_scaled_operands`` for one ``a`` and one ``b``; ``check_scaled_b``, ``check_a_scale``,
  ``check_b_scale`` and ``check_out_dtype`` for the ops that take several ``b``);
- ``scale_granularity``: a scale's layout, as the plans' keys name it;
- the fronts' ``fp8=`` option: ``check_config``, and the current-scaling quantization of a high-precision ``a``
  (``quantize_rows``) and ``b`` (``quantize_columns``) into those operands, and back (``dequantize``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fastmesh.ops._checks import FP8_DTYPES, check_tensor
from fastmesh.ops.fp8_quantize import quantize

if TYPE_CHECKING:  # fastmesh.fp8 (the recipes layer) sits above the ops
    from fastmesh.fp8.config import Float8Config

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRANULARITIES = ("tensorwise", "rowwise")


# ---- checks (the wording of csrc/fused/scaled.h) ----


def _check_scale(scale, data, rowwise_shape, op: str, arg: str, data_arg: str) -> bool:
    check_tensor(scale, op, arg, (torch.float32,), device=data.device, device_of=data_arg)
    rowwise = scale.dim() > 0
    if rowwise and list(scale.shape) != list(rowwise_shape):
        raise ValueError(
            f"{op}: {arg} must be tensor-wise (shape []) or row-wise (shape {list(rowwise_shape)}), "
            f"got shape {list(scale.shape)}"
        )
    return rowwise


def check_a_scale(scale, a, op: str, arg: str = "a_scale", a_arg: str = "a") -> bool:
    """The scale of an FP8 ``a`` (``[..., K]``): float32 on a's device, ``[]`` or ``[..., 1]``. Returns whether
    it is row-wise."""
    return _check_scale(scale, a, list(a.shape[:-1]) + [1], op, arg, a_arg)


def check_b_scale(scale, b, op: str, arg: str = "b_scale", b_arg: str = "b") -> bool:
    """The scale of an FP8 ``b`` (``[K, N]``): float32 on b's device, ``[]`` or ``[1, N]``. Returns whether it
    is row-wise (one per column)."""
    return _check_scale(scale, b, [1, b.shape[1]], op, arg, b_arg)


def check_scaled_b(b, a, op: str, b_arg: str = "b", a_arg: str = "a", rows_of: str = "a's last dim") -> None:
    """An FP8 ``b`` (``[K, N]``) that multiplies ``a``: dtype, a's device, K rows (``rows_of`` names K)."""
    check_tensor(b, op, b_arg, FP8_DTYPES, min_dim=2, max_dim=2, device=a.device, device_of=a_arg)
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{op}: {b_arg} must have {a.shape[-1]} rows ({rows_of}), got shape {list(b.shape)}")


def check_out_dtype(out_dtype, op: str) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}")


def check_scaled_operands(a, a_scale, b, b_scale, out_dtype, op: str) -> tuple[bool, bool]:
    """The FP8 operands of a scaled ``a @ b`` (``a [..., K]``, ``b [K, N]``, each with its scale) and the
    product's ``out_dtype``. Returns whether a's and b's scales are row-wise."""
    check_tensor(a, op, "a", FP8_DTYPES, min_dim=1)
    check_scaled_b(b, a, op)
    a_rowwise = check_a_scale(a_scale, a, op)
    b_rowwise = check_b_scale(b_scale, b, op)
    check_out_dtype(out_dtype, op)
    return a_rowwise, b_rowwise


def scale_granularity(scale: torch.Tensor) -> str:
    """``"rowwise"`` or ``"tensorwise"``: the layout of a checked scale, as a plan's key names it."""
    return "rowwise" if scale.dim() > 0 else "tensorwise"


# ---- the fronts' fp8= option ----


def check_config(config, op: str) -> Float8Config:
    """``fp8=``: a ``Float8Config`` of current scaling, tensor-wise or row-wise."""
    from fastmesh.fp8.config import Float8Config

    if not isinstance(config, Float8Config):
        raise TypeError(f"{op}: fp8 must be a fastmesh.fp8.Float8Config, got {type(config).__name__}")
    if config.granularity not in GRANULARITIES:
        raise ValueError(
            f"{op}: fp8 granularity must be 'tensorwise' or 'rowwise' (the scale layouts "
            f"torch._scaled_mm takes on every backend), got {config.granularity!r}"
        )
    if config.scaling != "current":
        raise ValueError(
            f"{op}: fp8= quantizes with current scaling; for delayed scaling quantize with your scales "
            "and call torch.ops.fastmesh.all_gather_scaled_matmul / scaled_matmul_reduce_scatter"
        )
    return config


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, config: Float8Config):
    """x ([..., K]) quantized per row (or tensor-wise): data and scale in _scaled_mm's layout for its first operand."""
    q = quantize(x.detach(), dtype=dtype, granularity=config.granularity, power_of_two=config.power_of_two)
    return q.data, q.scale


def quantize_columns(b: torch.Tensor, dtype: torch.dtype, config: Float8Config):
    """b ([K, N]) quantized per column (or tensor-wise): column-major data and a [1, N] (or 0-d) scale, the
    layout _scaled_mm takes for its second operand."""
    data, scale = quantize_rows(b.t(), dtype, config)
    return data.t(), scale.t()


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale`` in ``dtype``."""
    return (data.float() * scale).to(dtype)

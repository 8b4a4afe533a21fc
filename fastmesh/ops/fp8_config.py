"""FP8 configuration: which FP8 formats, scaling granularity and scaling mode a layer uses. The fused ops' ``fp8=``
takes it, so it lives with the ops; ``fastmesh.fp8.Float8Config`` is this class."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmesh.ops._checks import GRANULARITIES, MX, SCALE_ROUNDINGS, check_bool, check_fp8_dtype

SCALINGS = ("current", "delayed")
AMAX_COMPUTE = ("max", "most_recent")


@dataclass(frozen=True)
class Float8Config:
    """How a layer quantizes to FP8 (frozen: a config is shared, never mutated).

    Keyword Args:
        dtype: format of forward operands (activations, weights). Default ``torch.float8_e4m3fn``.
        grad_dtype: format of gradients in the backward. Default ``torch.float8_e5m2`` (wider range).
        granularity: ``"tensorwise"``, ``"rowwise"``, ``"block1x128"``, ``"block128x128"`` or ``"mx"`` (MXFP8:
            blocks of 32 along the contraction dim, E8M0 scales). The fused ops and TP styles take
            ``"tensorwise"``, ``"rowwise"``, ``"mx"`` and ``"block1x128"`` (weights then in 128x128 blocks).
        scaling: ``"current"`` (scale from this tensor's amax, every call) or ``"delayed"`` (scale from an
            amax history, :class:`fastmesh.fp8.DelayedScaling`; tensorwise only). The fused ops' and the TP
            styles' ``fp8=`` take ``"current"``; delayed scaling is for your own ``quantize`` calls and the
            ``torch.ops.fastmesh`` scaled ops.
        power_of_two: round scales down to powers of two (not with ``"mx"``, whose scales are powers of two).
        scale_rounding: ``"mx"`` only: ``"floor"`` (the OCP spec's rule, the default) or ``"rceil"``.
        backward_in_fp8: run the backward matmuls in FP8 (``grad_dtype``) rather than high precision.
        history_len, amax_compute, margin: delayed scaling's history length, reduction over the history
            (``"max"`` or ``"most_recent"``) and margin (the scale is divided by ``2**margin``).
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e5m2
    granularity: str = "tensorwise"
    scaling: str = "current"
    power_of_two: bool = False
    backward_in_fp8: bool = True
    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    scale_rounding: str | None = None

    def __post_init__(self):
        for name in ("dtype", "grad_dtype"):
            check_fp8_dtype(getattr(self, name), "Float8Config", name)
        for name in ("power_of_two", "backward_in_fp8"):
            check_bool(getattr(self, name), "Float8Config", name)
        if self.granularity not in GRANULARITIES + (MX,):
            raise ValueError(
                f"Float8Config: granularity must be one of {GRANULARITIES + (MX,)}, got {self.granularity!r}"
            )
        if self.granularity == MX and self.power_of_two:
            raise ValueError(
                "Float8Config: power_of_two does not apply to granularity 'mx' (its scales are powers of two)"
            )
        if self.scale_rounding is not None and self.granularity != MX:
            raise ValueError(
                f"Float8Config: scale_rounding applies to granularity 'mx', got granularity {self.granularity!r}"
            )
        if self.scale_rounding not in (None,) + SCALE_ROUNDINGS:
            raise ValueError(
                f"Float8Config: scale_rounding must be one of {SCALE_ROUNDINGS}, got {self.scale_rounding!r}"
            )
        if self.scaling not in SCALINGS:
            raise ValueError(f"Float8Config: scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.scaling == "delayed" and self.granularity != "tensorwise":
            raise ValueError(
                "Float8Config: delayed scaling keeps one amax history per tensor; it needs "
                f"granularity='tensorwise', got {self.granularity!r}"
            )
        check_history(self.history_len, self.amax_compute, self.margin, "Float8Config")


def check_history(history_len: int, amax_compute: str, margin: int, owner: str) -> None:
    if not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"{owner}: history_len must be an int >= 1, got {history_len!r}")
    if amax_compute not in AMAX_COMPUTE:
        raise ValueError(f"{owner}: amax_compute must be one of {AMAX_COMPUTE}, got {amax_compute!r}")
    if not isinstance(margin, int) or margin < 0:
        raise ValueError(f"{owner}: margin must be an int >= 0, got {margin!r}")

"""Delayed scaling: the scale of this step comes from the amax of earlier steps.

The quantize op returns the amax of the tensor it just cast, in the same pass, so updating the history
and counting overflows needs no extra read of the data and no host sync.
"""

from __future__ import annotations

import torch

from fastmesh.fp8.config import check_history
from fastmesh.ops._checks import FP8_MAX, check_fp8_dtype
from fastmesh.ops.fp8_quantize import Float8Quantized, fp8_quantize

# The smallest normal fp32 value, 2^-126: its reciprocal (the multiplier the op applies) is finite, and a kernel
# that flushes denormals to zero keeps it. From 2^-128 down the multiplier is inf, and zeros become NaN.
MIN_SCALE = torch.finfo(torch.float32).tiny
# Half an FP8 step above fp8_max: scaled magnitudes up to these round to +-fp8_max anyway, beyond them the cast
# clamps (saturates), which is what ``overflows`` counts.
OVERFLOW_ABOVE = {torch.float8_e4m3fn: 464.0, torch.float8_e5m2: 61440.0}


class DelayedScaling:
    """An amax history for one tensor and the tensor-wise scale it implies.

    ``scale() = amax_h / fp8_max * 2**margin`` where ``amax_h`` is the history's max (``"max"``) or its
    newest entry (``"most_recent"``); an all-zero history gives scale 1 (as the op does for amax 0), a tiny
    one at least 2^-126 (so the op's multiplier ``1 / scale`` stays finite).

    A stale scale saturates: values beyond ``scale * fp8_max`` are cast to +-fp8_max (e5m2 too), and
    :meth:`quantize` counts the step in ``overflows`` (a 0-d int64 tensor on the history's device, added to
    on the device, no host sync): a step counts when its amax times ``1 / scale`` is beyond half an FP8 step
    above fp8_max (464 for e4m3fn, 61440 for e5m2: up to there it rounds to fp8_max anyway), an inf included,
    or when its amax is NaN (a NaN hides the infinities beside it, which saturate). A non-finite amax enters
    the history: while it is in the window the scale is NaN or inf, and every step dequantizes to NaN rather
    than to finite wrong values.

    Args:
        history_len: number of past amaxes kept (>= 1).
        amax_compute: ``"max"`` or ``"most_recent"``.
        margin: the scale is multiplied by ``2**margin`` (headroom for growing values).
        dtype: the FP8 format the scale is for.
        device: where the history and the overflow count live (the tensors' device).

    Example::

        >>> recipe = DelayedScaling(history_len=16)
        >>> qx = recipe.quantize(x)          # scale from history, then history updated with qx.amax
        >>> recipe.overflows                 # tensor(0): no step saturated so far
    """

    def __init__(
        self,
        history_len: int = 16,
        amax_compute: str = "max",
        margin: int = 0,
        dtype: torch.dtype = torch.float8_e4m3fn,
        device: torch.device | str | None = None,
    ):
        check_history(history_len, amax_compute, margin, "DelayedScaling")
        check_fp8_dtype(dtype, "DelayedScaling")
        self.amax_compute = amax_compute
        self.margin = margin
        self.dtype = dtype
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.overflows = torch.zeros((), dtype=torch.int64, device=device)

    def scale(self) -> torch.Tensor:
        """The dequantization scale (0-d float32) for the next quantize."""
        amax = self.amax_history.max() if self.amax_compute == "max" else self.amax_history[0]
        # Divided before the margin multiplies, so that a huge finite amax does not overflow to an inf scale.
        scale = (amax / FP8_MAX[self.dtype] * 2.0**self.margin).clamp(min=MIN_SCALE)
        return torch.where(amax == 0, torch.ones_like(scale), scale)

    def update(self, amax: torch.Tensor) -> None:
        """Record a new tensor-wise amax (0-d) as the newest entry, dropping the oldest."""
        if amax.shape != ():
            raise ValueError(f"DelayedScaling.update: amax must be 0-d (tensor-wise), got shape {list(amax.shape)}")
        self.amax_history = torch.cat([amax.reshape(1).to(self.amax_history), self.amax_history[:-1]])

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> Float8Quantized:
        """Quantize ``x`` tensor-wise with the delayed scale, count an overflow, then record its amax."""
        scale = self.scale()
        result = fp8_quantize(x, self.dtype, "tensorwise", scale=scale, transpose=transpose)
        # The op multiplies by this same fp32 reciprocal: this is the largest scaled magnitude the cast met.
        overflowed = (result.amax * torch.reciprocal(scale) > OVERFLOW_ABOVE[self.dtype]) | result.amax.isnan()
        self.overflows += overflowed.to(self.overflows.device)
        self.update(result.amax)
        return result

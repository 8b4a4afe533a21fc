"""Delayed scaling: the scale of this step comes from the amax of earlier steps.

The quantize op returns the amax of the tensor it just cast, in the same pass, so updating the history
needs no extra read of the data.
"""

from __future__ import annotations

import torch

from fastmesh.fp8.config import check_history
from fastmesh.ops._checks import FP8_MAX, check_fp8_dtype
from fastmesh.ops.fp8_quantize import Float8Quantized, fp8_quantize


class DelayedScaling:
    """An amax history for one tensor and the tensor-wise scale it implies.

    ``scale() = 2**margin * amax_h / fp8_max`` where ``amax_h`` is the history's max (``"max"``) or its
    newest entry (``"most_recent"``); an all-zero history gives scale 1 (as the op does for amax 0).

    Args:
        history_len: number of past amaxes kept (>= 1).
        amax_compute: ``"max"`` or ``"most_recent"``.
        margin: the scale is multiplied by ``2**margin`` (headroom for growing values).
        dtype: the FP8 format the scale is for.
        device: where the history lives (the tensors' device).

    Example::

        >>> recipe = DelayedScaling(history_len=16)
        >>> qx = recipe.quantize(x)          # scale from history, then history updated with qx.amax
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

    def scale(self) -> torch.Tensor:
        """The dequantization scale (0-d float32) for the next quantize."""
        amax = self.amax_history.max() if self.amax_compute == "max" else self.amax_history[0]
        scale = amax * (2.0**self.margin) / FP8_MAX[self.dtype]
        return torch.where(amax == 0, torch.ones_like(scale), scale)

    def update(self, amax: torch.Tensor) -> None:
        """Record a new tensor-wise amax (0-d) as the newest entry, dropping the oldest."""
        if amax.shape != ():
            raise ValueError(f"DelayedScaling.update: amax must be 0-d (tensor-wise), got shape {list(amax.shape)}")
        self.amax_history = torch.cat([amax.reshape(1).to(self.amax_history), self.amax_history[:-1]])

    def quantize(self, x: torch.Tensor, transpose: bool = False) -> Float8Quantized:
        """Quantize ``x`` tensor-wise with the delayed scale, then record its amax."""
        result = fp8_quantize(x, self.dtype, "tensorwise", scale=self.scale(), transpose=transpose)
        self.update(result.amax)
        return result

"""Fused tensor-parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``."""

from fastmesh.parallel.plan import fused
from fastmesh.parallel.style import FusedColwiseParallel, FusedRowwiseParallel

__all__ = ["FusedColwiseParallel", "FusedRowwiseParallel", "fused"]

"""Plain-PyTorch references of the fused collectives, with autograd: what fastmesh's fused ops must equal.

``all_gather_matmul`` is an all-gather followed by matmuls, ``matmul_reduce_scatter`` a matmul followed by a
reduce-scatter, through torch's functional collectives (differentiable, traceable): :func:`all_gather` and
:func:`reduce_scatter`, which the library defines (``fastmesh/ops/_collectives.py``) and this oracle imports.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmesh.ops._collectives import all_gather, reduce_scatter

__all__ = ["all_gather", "all_gather_matmul", "matmul_reduce_scatter", "reduce_scatter"]


def all_gather_matmul(
    a_shard: torch.Tensor, bs: Sequence[torch.Tensor], gather_dim: int, group_name: str, return_a: bool = False
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    a = all_gather(a_shard, gather_dim, group_name)
    return (a if return_a else None), [a @ b for b in bs]


def matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str
) -> torch.Tensor:
    return reduce_scatter(a @ b, scatter_dim, group_name, reduce_op)

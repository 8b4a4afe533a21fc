"""Plain-PyTorch references of the fused collectives, with autograd: what fastmesh's fused ops must equal.

``all_gather_matmul`` is an all-gather followed by matmuls, ``matmul_reduce_scatter`` a matmul followed by a
reduce-scatter, through torch's functional collectives (differentiable, traceable). The tests compare the
fused ops with these, and the fused ops' backward uses :func:`all_gather` / :func:`reduce_scatter` where no
matmul is left to fuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

# torch 2.14 names the differentiable collectives *_single_autograd and deprecates *_tensor_autograd,
# the only names torch 2.11 has.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd


def all_gather(t: torch.Tensor, gather_dim: int, group_name: str) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``gather_dim`` in rank order; backward: a sum reduce-scatter."""
    # Non-negative: torch's functional all-gather fails on some negative gather dims (torch 2.14, 2 ranks: a
    # [1, 4, 3] shard along -3 or -1, a [1, 2, 3, 3] one along -4 or -1 raise in its view; the same dims counted
    # from 0 work).
    return _all_gather(t, gather_dim % t.dim(), group_name)


def reduce_scatter(t: torch.Tensor, scatter_dim: int, group_name: str, reduce_op: str = "sum") -> torch.Tensor:
    """Block ``rank`` of ``t`` along ``scatter_dim``, summed (``"avg"``: averaged) over the ranks."""
    out = _reduce_scatter(t, "sum", scatter_dim % t.dim(), group_name)
    # Averaged after the sum: gloo has no AVG reduction.
    return out / _resolve_process_group(group_name).size() if reduce_op == "avg" else out


def all_gather_matmul(
    a_shard: torch.Tensor, bs: Sequence[torch.Tensor], gather_dim: int, group_name: str, return_a: bool = False
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    a = all_gather(a_shard, gather_dim, group_name)
    return (a if return_a else None), [a @ b for b in bs]


def matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str
) -> torch.Tensor:
    return reduce_scatter(a @ b, scatter_dim, group_name, reduce_op)

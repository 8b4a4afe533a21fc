"""The plain collectives fastmesh's Python code calls, in one place, with the torch 2.11-2.14 shims.

* :func:`all_gather`, :func:`reduce_scatter`: differentiable and traceable (torch's functional collectives
  with autograd), by ``group_name``; the fused ops' backward uses them where no matmul is left to fuse.
* :func:`traced_all_gather`, :func:`traced_reduce_scatter`: the ``_c10d_functional`` ops themselves, no autograd:
  what inductor schedules (and fastmesh's compile pass matches) in a traced graph; :func:`started_all_gather`, the
  gather waited for later.
* :func:`traced_all_reduce`: the same for a sum / avg all-reduce.
* :func:`all_reduce`: a functional all-reduce, waited for.
* :data:`all_gather_into`, :data:`reduce_scatter_into`: c10d calls into preallocated buffers, by ProcessGroup.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _get_group_size_by_name

# torch 2.14 names these *_single (*_single_autograd) and deprecates the old names, the only ones torch 2.11 has.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_c10d = torch.ops._c10d_functional


def _world(group_name: str) -> int:
    # By name, as torch's functional collectives ask: dynamo traces this (an autograd.Function's backward calls it).
    return _get_group_size_by_name(group_name)


def all_gather(t: torch.Tensor, gather_dim: int, group_name: str) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``gather_dim`` in rank order; backward: a sum reduce-scatter."""
    # Non-negative: torch's functional all-gather fails on some negative gather dims (torch 2.14, 2 ranks: a
    # [1, 4, 3] shard along -3 or -1, a [1, 2, 3, 3] one along -4 or -1 raise in its view; the same dims counted
    # from 0 work).
    return _all_gather_autograd(t, gather_dim % t.dim(), group_name)


def reduce_scatter(t: torch.Tensor, scatter_dim: int, group_name: str, reduce_op: str = "sum") -> torch.Tensor:
    """Block ``rank`` of ``t`` along ``scatter_dim``, summed (``"avg"``: averaged) over the ranks."""
    out = _reduce_scatter_autograd(t, "sum", scatter_dim % t.dim(), group_name)
    # Averaged after the sum: gloo has no AVG reduction.
    return out / _world(group_name) if reduce_op == "avg" else out


def traced_all_gather(t: torch.Tensor, gather_dim: int, group_name: str) -> torch.Tensor:
    """:func:`all_gather` as ``_c10d_functional`` ops (not differentiable)."""
    return started_all_gather(t, gather_dim, group_name)()


def started_all_gather(t: torch.Tensor, gather_dim: int, group_name: str) -> Callable[[], torch.Tensor]:
    """:func:`traced_all_gather` started now, its result waited for by calling what this returns: the transfer
    travels while the caller runs other work (a multiply, other collectives of the group)."""
    world, dim = _world(group_name), gather_dim % t.dim()
    pending = _c10d.all_gather_into_tensor(t.contiguous(), world, group_name)

    def gathered() -> torch.Tensor:
        stacked = _c10d.wait_tensor(pending)
        return stacked if dim == 0 else torch.cat(stacked.chunk(world, 0), dim)  # c10d stacks the ranks along dim 0

    return gathered


def traced_reduce_scatter(t: torch.Tensor, scatter_dim: int, group_name: str, reduce_op: str = "sum") -> torch.Tensor:
    """:func:`reduce_scatter` as ``_c10d_functional`` ops (not differentiable)."""
    world, dim = _world(group_name), scatter_dim % t.dim()
    stacked = t if dim == 0 else torch.cat(t.chunk(world, dim), 0)  # rank j's block at rows j
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(stacked.contiguous(), "sum", world, group_name))
    return out / world if reduce_op == "avg" else out


def traced_all_reduce(t: torch.Tensor, group_name: str, reduce_op: str = "sum") -> torch.Tensor:
    """``t`` summed (``"avg"``: averaged) over the group as ``_c10d_functional`` ops (not differentiable)."""
    out = _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "sum", group_name))
    return out / _world(group_name) if reduce_op == "avg" else out


def all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """``t`` reduced with ``op`` (``"sum"``, ``"max"`` ...) over the group, waited for."""
    return _c10d.wait_tensor(_c10d.all_reduce(t, op, group_name))

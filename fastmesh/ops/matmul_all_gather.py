"""Fused matmul + all-gather of the product's columns: ``fastmesh::matmul_all_gather``, the gather of one piece of
the product's rows overlapped with the multiply of the next (a column-parallel linear whose output is made
replicated: the LM head's logits).

Plain-PyTorch equivalent (``W`` the size of the group named by ``group_name``)::

    c = a @ b
    parts = [torch.empty_like(c) for _ in range(W)]
    dist.all_gather(parts, c, group)
    result = torch.cat(parts, dim=-1)    # rank j's product is column block j, the same on every rank

Shapes (``...`` any leading dims; every rank passes the same shapes)::

    a [..., K]   b [K, n]   (n: this rank's columns)   result [..., W * n]

Autograd: the result is replicated, and its gradient ``G`` is taken to be the same on every rank, as DTensor
takes a ``Replicate()`` tensor's (torch's ``ColwiseParallel(output_layouts=Replicate())``); each rank keeps
its own column block ``G_r = G[..., r * n:(r + 1) * n]``, no communication::

    grad a = G_r @ b.T          # this rank's part of a's gradient (a column-parallel input's: partial)
    grad b = a.flatten(0, -2).T @ G_r.flatten(0, -2)

Plans (``docs/plans.md``): pieces of the product's rows, each gathered while the next is multiplied, or
``unfused``. Errors: TypeError / ValueError naming the argument, before any transfer, as
``csrc/fused/checks.h``.
"""

from __future__ import annotations

import torch

from fastmesh import _cpp_lib
from fastmesh.mesh import group_name as _group_name_of
from fastmesh.ops import _dtensor, plans, traced_unfused
from fastmesh.ops._checks import check_is_tensor
from fastmesh.ops._collectives import traced_all_gather
from fastmesh.ops._fused_common import (
    check_matmul_operands,
    check_pieces,
    check_same_shapes,
    group_size,
    is_plain,
    plain_options,
    resolve_group,
)
from fastmesh.ops._library import qualified_name

_OP = "fastmesh::matmul_all_gather"
_ALL_GATHER = torch.ops.fastmesh.matmul_all_gather.default


def _check(a, b, pieces) -> None:
    check_matmul_operands(a, b, _OP)
    check_pieces(pieces, _OP)


def _gathered_shape(a, b, world: int) -> list:
    return list(a.shape[:-1]) + [world * b.shape[1]]


@torch.library.register_fake(qualified_name("matmul_all_gather"))
def _matmul_all_gather_fake(a, b, group_name, pieces=0):
    traced_unfused.register_once()  # being traced: inductor may trace an unfused plan as its collective
    world = group_size(group_name, _OP)
    _check(a, b, pieces)
    return a.new_empty(_gathered_shape(a, b, world))


def plan_call(a, b, group_name: str) -> plans.Call:
    """The planner's view of a matmul_all_gather call (also asked under compile, on fake tensors)."""
    group = resolve_group(group_name, _OP)
    return plans.product_call(_OP, "product_all_gather", group, group_name, a, b.shape[1], a.dtype)


@plans.planned_run("matmul_all_gather")
def _matmul_all_gather_planned(a, b, group_name, pieces=0):
    world = group_size(group_name, _OP)
    _check(a, b, pieces)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.matmul_all_gather(a, b, group_name, plan.pieces, plan.split)

    if world == 1:
        return plans.run_unplanned(run)
    product = a.new_empty(()).expand(list(a.shape[:-1]) + [b.shape[1]])
    check_same_shapes(group_name, _OP, {"a @ b": product, "a": a, "b": b}, pieces=pieces)
    if a.numel() == 0 or b.numel() == 0:
        return plans.run_unplanned(run)
    call = plan_call(a, b, group_name)
    return plans.run_planned(call, run, plans.decide(call, pieces, run))


@traced_unfused.trace("matmul_all_gather")
def _matmul_all_gather_traced(a, b, group_name, pieces=0):
    if not traced_unfused.plans_unfused(lambda: plan_call(a, b, group_name), pieces, a, b):
        return NotImplemented
    return traced_all_gather(a @ b, -1, group_name)


@torch.library.register_fake(qualified_name("rank_columns"))
def _rank_columns_fake(t, group_name):
    return t.new_empty(list(t.shape[:-1]) + [t.shape[-1] // group_size(group_name, _OP)])


# Kernels of rank_columns and autograd of matmul_all_gather: csrc/fused/kernels.cpp, csrc/fused/autograd.cpp.


def matmul_all_gather(a: torch.Tensor, b: torch.Tensor, *, group=None, pieces: int | None = None) -> torch.Tensor:
    """Multiply ``a @ b`` and all-gather every rank's product along its columns, overlapped.

    Equivalent to (see the module docstring for shapes and autograd)::

        c = a @ b
        parts = [torch.empty_like(c) for _ in range(W)]
        dist.all_gather(parts, c, group=group)
        return torch.cat(parts, dim=-1)

    Args:
        a: ``[..., K]``, float32 / bfloat16 / float16 / float64: a column-parallel layer's (replicated) input. A
            ``Replicate()`` DTensor on a 1-D mesh (with ``b`` plain or ``Shard(1)``) gives a ``Replicate()``
            DTensor result, and a ``Partial()`` gradient for ``a`` (each rank's columns' part).
        b: ``[K, n]``, a's dtype and device: this rank's columns of the weight (``w.t()`` of its rows).
        group: ``ProcessGroup``, 1-D ``DeviceMesh``, ``(mesh, axis_name)``, group name, or ``None`` for the
            default group.
        pieces: pipeline pieces of the product's rows (``None``: the call's plan, ``docs/plans.md``; 1: one
            multiply, then one all-gather).

    Returns:
        ``[..., W * n]``: every rank's product, rank ``j``'s in column block ``j``; the same on every rank.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> logits = fastmesh.matmul_all_gather(h, w_out_shard.t(), group=mesh["tp"])   # [B, S, vocab]
    """
    if is_plain(a) and is_plain(b) and plain_options(pieces=pieces):
        name = _group_name_of(group)  # the steady state, as fastmesh.all_gather_matmul's
        try:
            return _ALL_GATHER(a, b, name, 0 if pieces is None else pieces)
        except RuntimeError:
            _check_front(a, b, 0 if pieces is None else pieces)
            raise
    pieces = 0 if pieces is None else pieces
    _check_front(a, b, pieces)
    if _dtensor.is_dtensor(a) or _dtensor.is_dtensor(b):
        return _dtensor.matmul_all_gather(matmul_all_gather, a, b, group, pieces)
    return _ALL_GATHER(a, b, _group_name_of(group), pieces)


def _check_front(a, b, pieces) -> None:
    """What the op's schema would refuse less clearly than these errors; the rest the op checks."""
    check_is_tensor(a, _OP, "a")
    check_is_tensor(b, _OP, "b")
    check_pieces(pieces, _OP)

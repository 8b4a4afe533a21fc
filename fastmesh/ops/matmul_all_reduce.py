"""Fused matmul + all-reduce: ``fastmesh::matmul_all_reduce``, the all-reduce of one piece of the product's rows
overlapped with the multiply of the next (the row-parallel linear of TP without sequence parallelism).

Plain-PyTorch equivalent (``W`` the size of the group named by ``group_name``)::

    c = a @ b
    dist.all_reduce(c, group)            # "avg": then c / W
    result = c                           # the same on every rank

Shapes (``...`` any leading dims; every rank passes the same shapes)::

    a [..., K]   (K: this rank's part of the contraction)   b [K, N]   result [..., N]

Autograd (``G`` the gradient of the replicated result, the same on every rank; ``/ W`` for avg)::

    grad a = G @ b.T                                   # no communication
    grad b = a.flatten(0, -2).T @ G.flatten(0, -2)

FP8 form ``fastmesh::scaled_matmul_all_reduce(a, a_scale, b, b_scale, reduce_op, group_name, out_dtype)``:
``all_reduce((deq(a, a_scale) @ deq(b, b_scale)).to(out_dtype))`` with the scale layouts of
``_fp8_operands.py``; the front's ``fp8=`` quantizes (current scaling), its backward runs in the input
dtype. Plans (``docs/plans.md``): pieces of the product's rows, each all-reduced while the next is multiplied, or
``unfused``. Errors: TypeError / ValueError naming the argument, before any transfer, as ``csrc/fused/checks.h``.
"""

from __future__ import annotations

import torch

from fastmesh import _cpp_lib
from fastmesh.mesh import group_name as _group_name_of
from fastmesh.ops import _dtensor, autocast, plans, traced_unfused
from fastmesh.ops._checks import check_is_tensor
from fastmesh.ops._collectives import traced_all_reduce
from fastmesh.ops._fp8_operands import (
    check_config,
    check_fp8_contraction,
    check_scaled_operands,
    log_multiply,
    quantize_columns,
    quantize_rows,
)
from fastmesh.ops._fused_common import (
    as_matrix,
    check_matmul_operands,
    check_pieces,
    check_reduce_op,
    check_same_shapes,
    group_size,
    is_plain,
    plain_options,
    resolve_group,
    resolve_pieces,
)
from fastmesh.ops._library import qualified_name
from fastmesh.ops.fp8_config import Float8Config

_OP = "fastmesh::matmul_all_reduce"
_SOP = "fastmesh::scaled_matmul_all_reduce"
_FRONT = "fastmesh.matmul_all_reduce"
_ALL_REDUCE = torch.ops.fastmesh.matmul_all_reduce.default
_SCALED_ALL_REDUCE = torch.ops.fastmesh.scaled_matmul_all_reduce.default


def _check_matmul_all_reduce(a, b, reduce_op, pieces) -> None:
    check_matmul_operands(a, b, _OP)
    check_reduce_op(reduce_op, _OP)
    check_pieces(pieces, _OP)


def _check_scaled(a, a_scale, b, b_scale, reduce_op, out_dtype, pieces) -> tuple[str, str]:
    """a's and b's scale layouts."""
    layouts = check_scaled_operands(a, a_scale, b, b_scale, out_dtype, _SOP)
    check_reduce_op(reduce_op, _SOP)
    check_pieces(pieces, _SOP)
    return layouts


def _product_shape(a, b) -> list:
    return list(a.shape[:-1]) + [b.shape[1]]


@torch.library.register_fake(qualified_name("matmul_all_reduce"))
def _matmul_all_reduce_fake(a, b, reduce_op, group_name, pieces=0):
    traced_unfused.register_once()  # being traced: inductor may trace an unfused plan as its collective
    group_size(group_name, _OP)
    _check_matmul_all_reduce(a, b, reduce_op, pieces)
    return a.new_empty(_product_shape(a, b))


@torch.library.register_fake(qualified_name("scaled_matmul_all_reduce"))
def _scaled_matmul_all_reduce_fake(a, a_scale, b, b_scale, reduce_op, group_name, out_dtype, pieces=0):
    group_size(group_name, _SOP)
    _check_scaled(a, a_scale, b, b_scale, reduce_op, out_dtype, pieces)
    return a.new_empty(_product_shape(a, b), dtype=out_dtype)


def plan_call(a, b, group_name: str) -> plans.Call:
    """The planner's view of a matmul_all_reduce call (also asked under compile, on fake tensors)."""
    return plans.product_call(_OP, "all_reduce", resolve_group(group_name, _OP), group_name, a, b.shape[1], a.dtype)


def scaled_plan_call(
    a, a_scale, b, b_scale, group_name: str, out_dtype, layouts: tuple[str, str] | None = None
) -> plans.Call:
    """The planner's view of a scaled_matmul_all_reduce call; ``layouts``: the scales' layouts where the caller
    has checked them."""
    scales = (("scales", ",".join(layouts or check_scaled_operands(a, a_scale, b, b_scale, out_dtype, _SOP))),)
    return plans.product_call(
        _SOP, "all_reduce", resolve_group(group_name, _SOP), group_name, a, b.shape[1], out_dtype, scales
    )


@plans.planned_run("matmul_all_reduce")
def _matmul_all_reduce_planned(a, b, reduce_op, group_name, pieces=0):
    world = group_size(group_name, _OP)
    _check_matmul_all_reduce(a, b, reduce_op, pieces)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.matmul_all_reduce(a, b, reduce_op, group_name, plan.pieces, plan.split)

    if world == 1:
        return plans.run_unplanned(run)
    operands = {"a @ b": a.new_empty(()).expand(_product_shape(a, b)), "a": a, "b": b}
    check_same_shapes(group_name, _OP, operands, reduce_op=reduce_op, pieces=pieces)
    if a.numel() == 0 or b.numel() == 0:
        return plans.run_unplanned(run)
    call = plan_call(a, b, group_name)
    return plans.run_planned(call, run, plans.decide(call, pieces, run))


@traced_unfused.trace("matmul_all_reduce")
def _matmul_all_reduce_traced(a, b, reduce_op, group_name, pieces=0):
    if not traced_unfused.plans_unfused(lambda: plan_call(a, b, group_name), pieces, a, b):
        return NotImplemented
    return traced_all_reduce(a @ b, group_name, reduce_op)


@plans.planned_run("scaled_matmul_all_reduce")
def _scaled_matmul_all_reduce_planned(a, a_scale, b, b_scale, reduce_op, group_name, out_dtype, pieces=0):
    world = group_size(group_name, _SOP)
    layouts = _check_scaled(a, a_scale, b, b_scale, reduce_op, out_dtype, pieces)
    log_multiply(_SOP, a.dtype, b, layouts, out_dtype)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.scaled_matmul_all_reduce(
            a, a_scale, b, b_scale, reduce_op, group_name, out_dtype, plan.pieces, plan.split
        )

    if world == 1:
        return plans.run_unplanned(run)
    product = a.new_empty((), dtype=out_dtype).expand(_product_shape(a, b))
    check_same_shapes(group_name, _SOP, {"a @ b": product, "a": a, "b": b}, reduce_op=reduce_op, pieces=pieces)
    if a.numel() == 0 or b.numel() == 0:
        return plans.run_unplanned(run)
    call = scaled_plan_call(a, a_scale, b, b_scale, group_name, out_dtype, layouts)
    return plans.run_planned(call, run, plans.decide(call, pieces, run))


def _local_grads(ctx, grad_out, need_a: bool, need_b: bool):
    """(grad a, grad b) of the FP8 front: the result is replicated, so its gradient is too, and each rank's operands
    get theirs locally (the high-precision op's formula, csrc/fused/autograd.cpp)."""
    a, b = ctx.saved_tensors
    if ctx.avg:
        grad_out = grad_out / group_size(ctx.group_name, _OP)
    grad_a = grad_out @ b.t() if need_a else None
    grad_b = as_matrix(a).t() @ as_matrix(grad_out) if need_b else None
    return grad_a, grad_b


def _all_reduce_fp8(config, group_name, reduce_op, pieces, a, b):
    """The front's ``fp8=`` forward: a quantized along its rows, b alike along its output columns (``quantize_rows``
    / ``quantize_columns``), then the scaled op."""
    a_data, a_scale = quantize_rows(a, config.dtype, config)
    b_data, b_scale = quantize_columns(b, config.dtype, config)
    return _SCALED_ALL_REDUCE(a_data, a_scale, b_data, b_scale, reduce_op, group_name, a.dtype, pieces)


class _Float8MatmulAllReduce(torch.autograd.Function):
    """The front's ``fp8=`` path with a backward: as the high-precision op's (local, in the input dtype: no transfer
    to shrink)."""

    @staticmethod
    def forward(ctx, config, group_name, reduce_op, pieces, a, b):
        ctx.avg, ctx.group_name = reduce_op == "avg", group_name
        ctx.save_for_backward(a, b)
        return _all_reduce_fp8(config, group_name, reduce_op, pieces, a, b)

    @staticmethod
    def backward(ctx, grad_out):
        return None, None, None, None, *_local_grads(ctx, grad_out, *ctx.needs_input_grad[4:6])


def matmul_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    group=None,
    reduce_op: str = "sum",
    pieces: int | None = None,
    fp8: Float8Config | None = None,
    chunks: int | None = None,
) -> torch.Tensor:
    """Multiply ``a @ b`` and all-reduce the product over the group, overlapped.

    Equivalent to (see the module docstring for shapes and autograd)::

        c = a @ b
        dist.all_reduce(c, group=group)          # reduce_op "avg": c / W afterwards
        return c

    Args:
        a: this rank's ``[..., K]`` operand (a row-parallel layer's input, its contraction dim sharded),
            float32 / bfloat16 / float16 / float64. A ``DTensor`` on a 1-D mesh placed ``Shard(-1)`` (with
            ``b`` plain or ``Shard(0)``) gives a ``Replicate()`` DTensor result.
        b: ``[K, N]``, a's dtype and device: this rank's rows of the weight.
        group: ``ProcessGroup``, 1-D ``DeviceMesh``, ``(mesh, axis_name)``, group name, or ``None`` for the
            default group.
        reduce_op: ``"sum"`` or ``"avg"``.
        pieces: pipeline pieces of the product's rows (``None``: the call's plan, ``docs/plans.md``; 1: one
            multiply, then one all-reduce).
        fp8: a :class:`fastmesh.fp8.Float8Config` (current scaling; tensor-wise, row-wise, MX or block1x128)
            to multiply in FP8 (the product is reduced in a's dtype; the backward runs in a's dtype).
        chunks: deprecated alias of ``pieces`` (warns).

    Returns:
        ``[..., N]``: the reduced product, the same on every rank.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> y = fastmesh.matmul_all_reduce(h_shard, w2_t_shard, group=mesh["tp"])   # [B, S, D] on every rank
    """
    if chunks is not None:
        pieces = resolve_pieces(pieces, chunks, _FRONT)
    if fp8 is None and is_plain(a) and is_plain(b) and plain_options(pieces=pieces):
        name = _group_name_of(group)  # the steady state, as fastmesh.all_gather_matmul's
        try:
            return _ALL_REDUCE(a, b, reduce_op, name, 0 if pieces is None else pieces)
        except RuntimeError:
            _check_front(a, b, reduce_op, 0 if pieces is None else pieces)
            raise
    pieces = 0 if pieces is None else pieces
    _check_front(a, b, reduce_op, pieces)
    if _dtensor.is_dtensor(a) or _dtensor.is_dtensor(b):
        return _dtensor.matmul_all_reduce(matmul_all_reduce, a, b, group, reduce_op, pieces, fp8)
    name = _group_name_of(group)
    if fp8 is not None:
        a, b = autocast.cast((a, b))
        config = check_config(fp8, _FRONT, a.dtype)
        try:
            check_fp8_contraction(config, b.shape[0], b.shape[1], False, _FRONT)
            if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
                return _all_reduce_fp8(config, name, reduce_op, pieces, a, b)  # no backward to record
            return _Float8MatmulAllReduce.apply(config, name, reduce_op, pieces, a, b)
        except (RuntimeError, TypeError, ValueError):  # as fastmesh.all_gather_matmul's fp8 path
            group_size(name, _OP)
            _check_matmul_all_reduce(a, b, reduce_op, pieces)
            raise
    return _ALL_REDUCE(a, b, reduce_op, name, pieces)


def _check_front(a, b, reduce_op, pieces) -> None:
    """What the op's schema would refuse less clearly than these errors; the rest the op checks."""
    check_is_tensor(a, _OP, "a")
    check_is_tensor(b, _OP, "b")
    check_reduce_op(reduce_op, _OP)
    check_pieces(pieces, _OP)

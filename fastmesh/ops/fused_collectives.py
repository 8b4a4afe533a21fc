"""Fused all-gather + matmul and matmul + reduce-scatter: ``fastmesh::all_gather_matmul`` and
``fastmesh::matmul_reduce_scatter``, the transfer of one piece overlapped with the multiply of another.

Plain-PyTorch equivalents (``W`` the size of the group named by ``group_name``; ``d`` the gather / scatter dim)::

    all_gather_matmul:      a = torch.cat(all_gather(a_shard), dim=d)              # shards in rank order
                            result = (a if return_a else None), [a @ b for b in bs]
    matmul_reduce_scatter:  result = reduce_scatter(a @ b, d, reduce_op)  # rank j: block j along d, summed

Shapes (``...`` any leading dims; ``S`` the size at dim ``d``; every rank passes the same shapes)::

    op                     input                 weights             outputs
    all_gather_matmul      a_shard [..S.., K]    bs[i] [K, N_i]      a [..W*S.., K], result[1][i] [..W*S.., N_i]
      d the last dim       a_shard [..., K]      bs[i] [W*K, N_i]    a [..., W*K],   result[1][i] [..., N_i]
    matmul_reduce_scatter  a [..S.., K], W | S   b [K, N]            [..S/W.., N]
      d the last dim       a [..., K]            b [K, N], W | N     [..., N/W]

Autograd: each op's backward is the other op (``G_i`` the gradient of output i)::

    all_gather_matmul:      grad a_shard = matmul_reduce_scatter(cat(G_i, -1), cat(bs, 1).T, d, "sum")
                            grad b_i     = a.flatten(0, -2).T @ G_i.flatten(0, -2)
                            # a: a_shard (saved) gathered again, while grad a_shard's op runs;
                            # keep_gathered=True saves the gathered a instead (W times the bytes)
    matmul_reduce_scatter:  grad_c, [grad a] = all_gather_matmul(G (/W for avg), [b.T], d, return_a=True)
                            grad b       = a.flatten(0, -2).T @ grad_c.flatten(0, -2)

Errors: TypeError (type, dtype) or ValueError (value, shape, device) naming the argument, raised before any
transfer starts, in the wording of ``csrc/fused/checks.h``; ranks whose shapes differ fail a cross-rank check.
How a call runs (pieces, plans, CUDA paths): ``docs/plans.md`` and ``docs/design/fused-collectives.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from fastmesh import _cpp_lib
from fastmesh.mesh import group_name as _group_name_of
from fastmesh.ops import _dtensor, autocast, backward_gathers, chunked_gather, plans, traced_unfused
from fastmesh.ops._checks import MATMUL_DTYPES, check_bool, check_int, check_is_tensor, check_tensor, wrap_dim
from fastmesh.ops._collectives import traced_all_gather, traced_reduce_scatter
from fastmesh.ops._fp8_operands import check_config
from fastmesh.ops._fused_common import (
    are_plain,
    check_like,
    check_matmul_operands,
    check_matrices,
    check_pieces,
    check_reduce_op,
    check_same_shapes,
    check_scattered_divisible,
    gathered_shape,
    group_size,
    is_plain,
    plain_options,
    resolve_group,
    resolve_pieces,
    scattered_shape,
)
from fastmesh.ops._library import qualified_name
from fastmesh.ops.fp8_config import Float8Config
from fastmesh.ops.fused_collectives_fp8 import all_gather_matmul_fp8, check_rows_gathered, matmul_reduce_scatter_fp8

_AG = "fastmesh::all_gather_matmul"
_RS = "fastmesh::matmul_reduce_scatter"
_AG_FRONT = "fastmesh.all_gather_matmul"
_RS_FRONT = "fastmesh.matmul_reduce_scatter"
_AG_OP = torch.ops.fastmesh.all_gather_matmul.default
_RS_OP = torch.ops.fastmesh.matmul_reduce_scatter.default


# ---- checks (the wording of csrc/fused/checks.h) ----


def _check_all_gather_matmul(a_shard, bs, gather_dim, world: int, pieces, fp8: bool = False) -> int:
    """Checks every argument (``fp8``: for the FP8 form); returns gather_dim made non-negative."""
    check_tensor(a_shard, _AG, "a_shard", MATMUL_DTYPES, min_dim=1)
    dim = wrap_dim(gather_dim, a_shard.dim(), _AG, "gather_dim", "a_shard")
    if fp8:  # first: bs' rows below would count a gathered contraction, which the FP8 form refuses
        check_rows_gathered(a_shard, gather_dim, "fastmesh.all_gather_matmul")
    check_pieces(pieces, _AG)
    if isinstance(bs, torch.Tensor) or not isinstance(bs, (list, tuple)):
        raise TypeError(f"{_AG}: bs must be a list of matrices, got {type(bs).__name__}")
    if not bs:
        raise ValueError(f"{_AG}: bs must hold at least one matrix, got an empty list")
    contraction = dim == a_shard.dim() - 1
    k_full = a_shard.shape[-1] * world if contraction else a_shard.shape[-1]
    for i, b in enumerate(bs):
        check_tensor(b, _AG, f"bs[{i}]", MATMUL_DTYPES, min_dim=2, max_dim=2)
        check_like(b, a_shard, _AG, f"bs[{i}]", "a_shard")
        if b.shape[0] != k_full:
            where = f"the gathered a: a_shard's last dim times the group size {world}" if contraction else "a_shard"
            raise ValueError(
                f"{_AG}: bs[{i}] must have {k_full} rows (the last dim of {where}), got shape {list(b.shape)}"
            )
    return dim


def _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, world: int, pieces) -> int:
    """Checks every argument; returns scatter_dim made non-negative."""
    check_matmul_operands(a, b, _RS)
    dim = wrap_dim(scatter_dim, a.dim(), _RS, "scatter_dim", "a")
    check_reduce_op(reduce_op, _RS)
    check_pieces(pieces, _RS)
    check_scattered_divisible(a.shape, b.shape[1], dim, scatter_dim, world, _RS)
    return dim


# ---- fake impls ----


@torch.library.register_fake(qualified_name("all_gather_matmul"))
def _all_gather_matmul_fake(a_shard, bs, gather_dim, group_name, return_a=False, pieces=0, keep_gathered=False):
    traced_unfused.register_once()  # being traced: inductor may trace an unfused plan as its collective
    backward_gathers.install_once()  # and the backward's gather of the shard stays in backward
    world = group_size(group_name, _AG)
    dim = _check_all_gather_matmul(a_shard, bs, gather_dim, world, pieces)
    full = gathered_shape(a_shard.shape, dim, world)
    outs = [a_shard.new_empty(full[:-1] + [b.shape[1]]) for b in bs]
    return (a_shard.new_empty(full) if return_a else None), outs


@torch.library.register_fake(qualified_name("matmul_reduce_scatter"))
def _matmul_reduce_scatter_fake(a, b, scatter_dim, reduce_op, group_name, pieces=0):
    traced_unfused.register_once()
    world = group_size(group_name, _RS)
    dim = _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, world, pieces)
    return a.new_empty(scattered_shape(a.shape, b.shape[1], dim, world))


# ---- kernels: a plan per call (fastmesh/ops/plans.py), then the C++ schedule or the Triton consumer GEMM ----


def gather_plan_call(a_shard, bs, dim: int, group_name: str, consumer_gemm: bool = False) -> plans.Call:
    """The planner's view of an all_gather_matmul call (also asked by the compile pass, on fake tensors)."""
    group = resolve_group(group_name, _AG)
    return plans.gather_call(
        _AG, group, group_name, a_shard, [b.shape[1] for b in bs], dim, consumer_gemm=consumer_gemm
    )


def scatter_plan_call(a, b, dim: int, group_name: str) -> plans.Call:
    """The planner's view of a matmul_reduce_scatter call."""
    return plans.scatter_call(_RS, resolve_group(group_name, _RS), group_name, a, b.shape[1], dim, a.dtype)


@plans.planned_run("all_gather_matmul")
def _all_gather_matmul_planned(a_shard, bs, gather_dim, group_name, return_a=False, pieces=0, *, cuda=None):
    """``cuda``: plan the call as on CUDA (the consumer GEMM's path; its tests run it on CPU tensors, interpreted),
    default: the tensors' device."""
    group = resolve_group(group_name, _AG)
    world = group.size()
    dim = _check_all_gather_matmul(a_shard, bs, gather_dim, world, pieces)
    ext = _cpp_lib.load()
    cuda = a_shard.device.type == "cuda" if cuda is None else cuda

    def run(plan: plans.Plan):
        if plan.split == "consumer_gemm":
            return chunked_gather.all_gather_chunked_matmul(
                a_shard, bs, dim, chunked_gather.CollectiveTransport(group), return_a, plan.pieces
            )
        return ext.all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a, plan.pieces, plan.split)

    if world == 1:
        return plans.run_unplanned(run)
    bs_shapes = {f"bs[{i}]": b for i, b in enumerate(bs)}
    check_same_shapes(
        group_name, _AG, {"a_shard": a_shard, **bs_shapes}, gather_dim=dim, return_a=return_a, pieces=pieces
    )
    if a_shard.numel() == 0:
        return plans.run_unplanned(run)
    measuring = plans.mode() == "measure"
    reason = chunked_gather.unsupported_reason(a_shard, dim, world) if cuda else "not a CUDA call"
    call = gather_plan_call(a_shard, bs, dim, group_name, consumer_gemm=reason is None and measuring)
    # The consumer GEMM is opt-in (FASTMESH_CUDA_CONSUMER_GEMM=1) until measured plans choose it.
    forced, note = None, ""
    if reason is None and chunked_gather.enabled() and not measuring:
        forced = plans.Decision(plans.Plan("consumer_gemm", pieces), f"{chunked_gather.ENV_ENABLE}=1")
    elif cuda and not measuring:
        reason = reason or f"it is opt-in until measured on GPUs: {chunked_gather.ENV_ENABLE}=1"
        note = f"(not the Triton consumer GEMM: {reason})"
    return plans.run_planned(call, run, plans.decide(call, pieces, run, forced, note))


@plans.planned_run("matmul_reduce_scatter")
def _matmul_reduce_scatter_planned(a, b, scatter_dim, reduce_op, group_name, pieces=0):
    group = resolve_group(group_name, _RS)
    world = group.size()
    dim = _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, world, pieces)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, plan.pieces, plan.split)

    if world == 1:
        return plans.run_unplanned(run)
    product = scattered_shape(a.shape, b.shape[1], dim, world)  # what travels: its shape, not its values
    operands = {"a @ b": a.new_empty(()).expand(product), "a": a, "b": b}
    check_same_shapes(group_name, _RS, operands, scatter_dim=dim, reduce_op=reduce_op, pieces=pieces)
    if a.numel() == 0 or b.numel() == 0:
        return plans.run_unplanned(run)
    call = scatter_plan_call(a, b, dim, group_name)
    return plans.run_planned(call, run, plans.decide(call, pieces, run))


@traced_unfused.trace("all_gather_matmul")
def _all_gather_matmul_traced(a_shard, bs, gather_dim, group_name, return_a=False, pieces=0, keep_gathered=False):
    dim = gather_dim % a_shard.dim()
    if not traced_unfused.plans_unfused(lambda: gather_plan_call(a_shard, bs, dim, group_name), pieces, a_shard, *bs):
        return NotImplemented
    with contextlib.nullcontext() if keep_gathered else backward_gathers.recomputed_in_backward():
        a = traced_all_gather(a_shard, dim, group_name)
    return (a if return_a else None), [a @ b for b in bs]


@traced_unfused.trace("matmul_reduce_scatter")
def _matmul_reduce_scatter_traced(a, b, scatter_dim, reduce_op, group_name, pieces=0):
    dim = scatter_dim % a.dim()
    if not traced_unfused.plans_unfused(lambda: scatter_plan_call(a, b, dim, group_name), pieces, a, b):
        return NotImplemented
    return traced_reduce_scatter(a @ b, dim, group_name, reduce_op)


# Autograd: csrc/fused/autograd.cpp (the formulas in the module docstring).


# ---- Python fronts ----


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    gather_dim: int,
    *,
    group=None,
    return_a: bool = False,
    pieces: int | None = None,
    fp8: Float8Config | None = None,
    chunks: int | None = None,
    keep_gathered: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather ``a_shard`` along ``gather_dim`` and multiply the result by each ``b``, overlapped.

    Equivalent to (see the module docstring for shapes and autograd)::

        a = torch.cat(all_gather(a_shard, group), dim=gather_dim)
        return (a if return_a else None), [a @ b for b in bs]

    with one gather for all ``bs`` (e.g. the Q, K and V projections of one input).

    Args:
        a_shard: this rank's shard, float32 / bfloat16 / float16 / float64, at least 1-D; the same shape
            on every rank. A ``DTensor`` placed ``Shard(gather_dim)`` on a 1-D mesh gives DTensor results
            (the mesh is the group); its shards may be uneven (torch's, along any dim but the last).
        bs: matrices ``[K, N_i]`` (``[W*K, N_i]`` when gathering the last dim), a's dtype and device;
            plain tensors or DTensors on the same mesh (``Replicate()``, or ``Shard(1)`` for a
            column-sharded weight: that output is then ``Shard(-1)``).
        gather_dim: the dim of ``a_shard`` to gather; any dim, negative counts from the end. The last dim
            splits the contraction instead of the rows.
        group: ``ProcessGroup``, 1-D ``DeviceMesh``, ``(mesh, axis_name)``, group name, or ``None`` for the
            default group.
        return_a: also return the gathered ``a``.
        pieces: pipeline pieces of rows per rank (``None``: the call's plan, ``docs/plans.md``; 1: no
            overlap beyond the local shard's multiply).
        fp8: a :class:`fastmesh.fp8.Float8Config` (current scaling; tensor-wise, row-wise, MX or block1x128)
            to run in FP8 (``fastmesh/ops/fused_collectives_fp8.py``). Rows only (``gather_dim`` not the last dim); the
            returned ``a`` is then the dequantized FP8 gather, its gradient passed straight through.
        chunks: deprecated alias of ``pieces`` (warns).
        keep_gathered: save the gathered ``a`` for the ``bs``' gradients (``W`` times the shard's bytes, FP8: its FP8
            data and scales) instead of ``a_shard``, which backward otherwise gathers again while the input
            gradient's fused multiply runs (Megatron-LM's sequence parallelism). The gradients are the same
            either way; only the memory held until backward and one gather differ.

    Returns:
        ``(a or None, [a @ b for b in bs])``.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> mesh = fastmesh.init_mesh(tp=2)
        >>> x = torch.randn(4, 8)                       # this rank's 4 rows of an [8, 8] activation
        >>> a, (q, k) = fastmesh.all_gather_matmul(x, [wq, wk], gather_dim=0, group=mesh["tp"], return_a=True)
        >>> a.shape, q.shape
        (torch.Size([8, 8]), torch.Size([8, wq.shape[1]]))
    """
    if chunks is not None:
        pieces = resolve_pieces(pieces, chunks, _AG_FRONT)
    plain = plain_options(gather_dim, flags=(return_a, keep_gathered), pieces=pieces)
    if fp8 is None and plain and is_plain(a_shard) and are_plain(bs):
        # The steady state: the op checks a key's arguments on its first call, the front only the types its schema
        # takes, and what the schema refuses (a value out of its range) only once refused.
        name = _group_name_of(group)
        try:
            return _AG_OP(a_shard, bs, gather_dim, name, return_a, 0 if pieces is None else pieces, keep_gathered)
        except RuntimeError:
            _check_all_gather_front(a_shard, bs, gather_dim, return_a, 0 if pieces is None else pieces, keep_gathered)
            raise
    pieces = 0 if pieces is None else pieces
    _check_all_gather_front(a_shard, bs, gather_dim, return_a, pieces, keep_gathered)
    if _dtensor.is_dtensor(a_shard) or _dtensor.any_dtensor(bs):
        return _dtensor.all_gather_matmul(
            all_gather_matmul, a_shard, bs, gather_dim, group, return_a, pieces, fp8, keep_gathered
        )
    name = _group_name_of(group)
    if fp8 is not None:
        a_shard, bs = autocast.cast(a_shard), autocast.cast(list(bs))
        config = check_config(fp8, _AG_FRONT, a_shard.dtype)
        try:
            return all_gather_matmul_fp8(a_shard, bs, gather_dim, name, return_a, pieces, config, keep_gathered)
        except (RuntimeError, TypeError, ValueError):  # said in the casts' or the FP8 op's words: these are clearer
            _check_all_gather_matmul(a_shard, bs, gather_dim, group_size(name, _AG), pieces, fp8=True)
            raise
    return _AG_OP(a_shard, bs, gather_dim, name, return_a, pieces, keep_gathered)


def _check_all_gather_front(a_shard, bs, gather_dim, return_a, pieces, keep_gathered) -> None:
    """What the op's schema would refuse less clearly than these errors; the rest the op checks."""
    check_is_tensor(a_shard, _AG, "a_shard")
    check_matrices(bs, _AG_FRONT, _AG)
    check_int(gather_dim, _AG, "gather_dim")
    check_bool(return_a, _AG_FRONT, "return_a")
    check_bool(keep_gathered, _AG_FRONT, "keep_gathered")
    check_pieces(pieces, _AG)


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    *,
    group=None,
    reduce_op: str = "sum",
    pieces: int | None = None,
    fp8: Float8Config | None = None,
    chunks: int | None = None,
) -> torch.Tensor:
    """Multiply ``a @ b`` and reduce-scatter the product along ``scatter_dim``, overlapped.

    Equivalent to (see the module docstring for shapes and autograd)::

        c = a @ b
        return reduce_scatter(c, scatter_dim, reduce_op, group)   # rank j: block j of c, summed over ranks

    Args:
        a: this rank's ``[..., K]`` operand (e.g. a row-parallel layer's column-sharded input), float32 /
            bfloat16 / float16 / float64; the scattered dim of ``a @ b`` must divide by the group size.
            A ``DTensor`` on a 1-D mesh placed ``Shard(-1)`` (with ``b`` plain or ``Shard(0)``) gives a
            DTensor result placed ``Shard(scatter_dim)``, in torch's uneven shards where the group size does not
            divide that dim (any but the last).
        b: ``[K, N]``, a's dtype and device.
        scatter_dim: the dim of ``a @ b`` to scatter; negative counts from the end; the last dim scatters
            the columns.
        group: as for :func:`all_gather_matmul`.
        reduce_op: ``"sum"`` or ``"avg"``.
        pieces: pipeline pieces of rows per rank (``None``: the call's plan, ``docs/plans.md``).
        fp8: a :class:`fastmesh.fp8.Float8Config` (current scaling; tensor-wise, row-wise, MX or block1x128)
            to multiply in FP8 (``fastmesh/ops/fused_collectives_fp8.py``; the product is reduced in a's dtype).
        chunks: deprecated alias of ``pieces`` (warns).

    Returns:
        This rank's block of the reduced product: ``a @ b``'s shape with ``scatter_dim`` divided by the
        group size.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> y_shard = fastmesh.matmul_reduce_scatter(h, w2_t_shard, scatter_dim=0, group=mesh["tp"])
    """
    if chunks is not None:
        pieces = resolve_pieces(pieces, chunks, _RS_FRONT)
    if fp8 is None and is_plain(a) and is_plain(b) and plain_options(scatter_dim, pieces=pieces):
        name = _group_name_of(group)  # the steady state, as all_gather_matmul's
        try:
            return _RS_OP(a, b, scatter_dim, reduce_op, name, 0 if pieces is None else pieces)
        except RuntimeError:
            _check_reduce_scatter_front(a, b, scatter_dim, reduce_op, 0 if pieces is None else pieces)
            raise
    pieces = 0 if pieces is None else pieces
    _check_reduce_scatter_front(a, b, scatter_dim, reduce_op, pieces)
    if _dtensor.is_dtensor(a) or _dtensor.is_dtensor(b):
        return _dtensor.matmul_reduce_scatter(matmul_reduce_scatter, a, b, scatter_dim, group, reduce_op, pieces, fp8)
    name = _group_name_of(group)
    if fp8 is not None:
        a, b = autocast.cast((a, b))
        config = check_config(fp8, _RS_FRONT, a.dtype)
        try:
            return matmul_reduce_scatter_fp8(a, b, scatter_dim, name, reduce_op, pieces, config)
        except (RuntimeError, TypeError, ValueError):  # as all_gather_matmul's fp8 path
            _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_size(name, _RS), pieces)
            raise
    return _RS_OP(a, b, scatter_dim, reduce_op, name, pieces)


def _check_reduce_scatter_front(a, b, scatter_dim, reduce_op, pieces) -> None:
    """What the op's schema would refuse less clearly than these errors; the rest the op checks."""
    check_is_tensor(a, _RS, "a")
    check_is_tensor(b, _RS, "b")
    check_int(scatter_dim, _RS, "scatter_dim")
    check_reduce_op(reduce_op, _RS)
    check_pieces(pieces, _RS)

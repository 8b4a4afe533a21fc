"""Fused all-gather + matmul and matmul + reduce-scatter: ``fastmesh::all_gather_matmul`` and
``fastmesh::matmul_reduce_scatter``.

In sequence-parallel TP a column-parallel linear starts with an all-gather of its input and a row-parallel
linear ends with a reduce-scatter of its output. These ops cut the communicated tensor into pieces and
overlap the transfer of one piece with the multiply of another (schedule: ``csrc/include/fastmesh/pipeline.h``),
on every backend c10d has: gloo on CPU, NCCL on CUDA. The local shard is multiplied while the first
pieces travel. On CUDA, ``all_gather_matmul``'s kernel can instead run one Triton GEMM that multiplies each
tile as soon as its rows have landed (``fastmesh/ops/chunked_gather.py``; opt-in with
``FASTMESH_CUDA_CONSUMER_GEMM=1``).

Each call runs a plan, the same on every rank (``fastmesh/ops/plans.py``): pieces of rows, pieces of b's
columns (reduce-scatter: b read once), or the unfused sequence inside the op where overlapping cannot pay
(few rows and a large weight, latency-bound sizes). ``chunks > 0`` fixes pieces of rows; otherwise the plan
comes from measured plans or the cost model (``FASTMESH_TUNE``). Each key's plan is logged once (INFO,
logger ``fastmesh.plans``).

Plain-PyTorch equivalents (``group`` the process group named by ``group_name``, ``W`` its size)::

    # all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a)
    a = torch.cat(all_gather(a_shard, group), dim=gather_dim)          # every rank's shard, in rank order
    result = (a if return_a else None, [a @ b for b in bs])

    # matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name)
    c = a @ b
    blocks = c.chunk(W, dim=scatter_dim)                                # block j goes to rank j
    result = sum over ranks of blocks[rank]  (divided by W for "avg")

Shapes (``W`` the group size; ``...`` any leading dims; ``d`` = gather_dim / scatter_dim):

=========================  ==================================  ======================================
op / argument              shape                               note
=========================  ==================================  ======================================
all_gather_matmul
  a_shard                  ``[..., S, ..., K]``                S at dim d; the same shape on every rank
  bs[i]                    ``[K, N_i]``                        ``[W*K, N_i]`` when d is the last dim
  a (return_a=True)        ``[..., W*S, ..., K]``              ``[..., W*K]`` when d is the last dim
  result[1][i]             ``[..., W*S, ..., N_i]``            ``[..., N_i]`` when d is the last dim
matmul_reduce_scatter
  a                        ``[..., S, ..., K]``                S divisible by W
  b                        ``[K, N]``
  result                   ``[..., S/W, ..., N]``              ``[..., N/W]`` when d is the last dim
=========================  ==================================  ======================================

Gathering the last dim splits the contraction: ``a @ b = sum_j a_shard_j @ b[rows of rank j]``, summed in
rank order on every rank, so the replicated result is bitwise identical across ranks (bf16/fp16: each
partial product is rounded to the dtype by its matmul, the partials are summed in fp32 and rounded once).
The reduce-scatter sums the same way on gloo; on NCCL the backend's reduce-scatter sums. Scattering the last
dim gives rank ``j`` the columns ``j*N/W:(j+1)*N/W``.

Autograd (each op's backward is the other op; ``G_i`` the gradient of output i)::

    all_gather_matmul:      grad a_shard = matmul_reduce_scatter(cat(G_i, -1), cat(bs, 1).T, d, "sum")
                            grad b_i     = a.flatten(0, -2).T @ G_i.flatten(0, -2)
    matmul_reduce_scatter:  grad_c, [grad a] = all_gather_matmul(G (/W for avg), [b.T], d, return_a=True)
                            grad b       = a.flatten(0, -2).T @ grad_c.flatten(0, -2)

so a forward and its backward issue one gather and one reduce-scatter each, whatever the number of ``bs``.
The backward of ``all_gather_matmul`` needs the gathered ``a`` for the gradients of ``bs``: the Python front
asks the op for it when some ``b`` requires grad (and returns ``None`` if you did not ask for it); a
direct ``torch.ops.fastmesh.all_gather_matmul(..., return_a=False)`` call gathers again in backward. When
the gathered ``a`` returned by the op has a gradient of its own, the backward adds it before one plain
reduce-scatter.

Every rank must pass the same shapes, as for torch's own collectives. A mismatch is not an error gloo
reports (it aborts the receiving process), so on CPU the first call of each op on each group checks it (one
small all-gather), and with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every call does, on CPU and CUDA; checking every
call by default would put a barrier at the start of every op (measured: a 2-rank Llama block step ~25%
slower). Arguments are checked before any transfer starts; as with any collective, a rank that fails or never
calls leaves the others waiting until the group's timeout, and an op that fails part-way waits for the
transfers it started before it raises (so that none is left in flight).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fastmesh import _cpp_lib
from fastmesh.kernels.fused_reference import all_gather
from fastmesh.mesh import group_name as _group_name_of
from fastmesh.ops import _dtensor, chunked_gather, plans, traced_unfused
from fastmesh.ops._checks import MATMUL_DTYPES, wrap_dim
from fastmesh.ops._fused_common import (
    check_chunks,
    check_reduce_op,
    check_scattered_divisible,
    gathered_shape,
    group_size,
    input_grad_operands,
    reduce_scatter_gathered_grad,
    resolve_group,
    resolve_pieces,
    rows,
    scattered_shape,
)
from fastmesh.ops._library import library, qualified_name
from fastmesh.ops.fused_collectives_fp8 import all_gather_matmul_fp8, check_config, matmul_reduce_scatter_fp8

if TYPE_CHECKING:  # fastmesh.fp8 (the recipes layer) sits above the ops
    from fastmesh.fp8.config import Float8Config

_AG = "fastmesh::all_gather_matmul"
_RS = "fastmesh::matmul_reduce_scatter"


# ---- checks (the wording of csrc/fused/checks.h) ----


def _check_operand(t, op: str, arg: str, min_dim: int, max_dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in MATMUL_DTYPES:
        raise TypeError(f"{op}: {arg} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {arg} must be a dense (strided) tensor, got {t.layout}")
    if t.dim() < min_dim or (max_dim is not None and t.dim() > max_dim):
        wanted = f"{min_dim}" if min_dim == max_dim else f"at least {min_dim}"
        raise ValueError(f"{op}: {arg} must have {wanted} dim(s), got shape {list(t.shape)}")


def _check_like(t: torch.Tensor, reference: torch.Tensor, op: str, arg: str, reference_arg: str) -> None:
    if t.dtype != reference.dtype:
        raise TypeError(f"{op}: {arg} must have {reference_arg}'s dtype {reference.dtype}, got {t.dtype}")
    if t.device != reference.device:
        raise ValueError(f"{op}: {arg} must be on {reference_arg}'s device {reference.device}, got {t.device}")


def _check_all_gather_matmul(a_shard, bs, gather_dim, world: int, chunks) -> int:
    """Checks every argument; returns gather_dim made non-negative."""
    _check_operand(a_shard, _AG, "a_shard", 1)
    dim = wrap_dim(gather_dim, a_shard.dim(), _AG, "gather_dim", "a_shard")
    check_chunks(chunks, _AG)
    if isinstance(bs, torch.Tensor) or not isinstance(bs, (list, tuple)):
        raise TypeError(f"{_AG}: bs must be a list of matrices, got {type(bs).__name__}")
    if not bs:
        raise ValueError(f"{_AG}: bs must hold at least one matrix, got an empty list")
    contraction = dim == a_shard.dim() - 1
    k_full = a_shard.shape[-1] * world if contraction else a_shard.shape[-1]
    for i, b in enumerate(bs):
        _check_operand(b, _AG, f"bs[{i}]", 2, 2)
        _check_like(b, a_shard, _AG, f"bs[{i}]", "a_shard")
        if b.shape[0] != k_full:
            where = f"the gathered a: a_shard's last dim times the group size {world}" if contraction else "a_shard"
            raise ValueError(
                f"{_AG}: bs[{i}] must have {k_full} rows (the last dim of {where}), got shape {list(b.shape)}"
            )
    return dim


def _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, world: int, chunks) -> int:
    """Checks every argument; returns scatter_dim made non-negative."""
    _check_operand(a, _RS, "a", 1)
    _check_operand(b, _RS, "b", 2, 2)
    _check_like(b, a, _RS, "b", "a")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{_RS}: b must have {a.shape[-1]} rows (a's last dim), got shape {list(b.shape)}")
    dim = wrap_dim(scatter_dim, a.dim(), _RS, "scatter_dim", "a")
    check_reduce_op(reduce_op, _RS)
    check_chunks(chunks, _RS)
    check_scattered_divisible(a.shape, b.shape[1], dim, scatter_dim, world, _RS)
    return dim


# ---- fake impls ----


@torch.library.register_fake(qualified_name("all_gather_matmul"))
def _all_gather_matmul_fake(a_shard, bs, gather_dim, group_name, return_a=False, chunks=0):
    traced_unfused.register_once()  # being traced: inductor may trace an unfused plan as its collective
    world = group_size(group_name, _AG)
    dim = _check_all_gather_matmul(a_shard, bs, gather_dim, world, chunks)
    full = gathered_shape(a_shard.shape, dim, world)
    outs = [a_shard.new_empty(full[:-1] + [b.shape[1]]) for b in bs]
    return (a_shard.new_empty(full) if return_a else None), outs


@torch.library.register_fake(qualified_name("matmul_reduce_scatter"))
def _matmul_reduce_scatter_fake(a, b, scatter_dim, reduce_op, group_name, chunks=0):
    traced_unfused.register_once()
    world = group_size(group_name, _RS)
    dim = _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, world, chunks)
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


def _all_gather_matmul_kernel(a_shard, bs, gather_dim, group_name, return_a=False, chunks=0, *, cuda=False):
    group = resolve_group(group_name, _AG)
    world = group.size()
    dim = _check_all_gather_matmul(a_shard, bs, gather_dim, world, chunks)
    ext = _cpp_lib.load()
    bs = list(bs)

    def run(plan: plans.Plan):
        if plan.split == "consumer_gemm":
            ext.check_same_shape_on_all_ranks(a_shard, group_name, _AG, "a_shard")
            return chunked_gather.all_gather_chunked_matmul(
                a_shard, bs, dim, chunked_gather.CollectiveTransport(group), return_a, plan.pieces
            )
        return ext.all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a, plan.pieces, plan.split)

    if world == 1 or a_shard.numel() == 0:
        return run(plans.FIXED)
    # Before the ranks agree on a plan: ranks whose calls differ must fail here, all of them, not in the planner.
    ext.check_same_shape_on_all_ranks(a_shard, group_name, _AG, "a_shard")
    measuring = plans.mode() == "measure"
    reason = chunked_gather.unsupported_reason(a_shard, dim, world) if cuda else "not a CUDA call"
    call = gather_plan_call(a_shard, bs, dim, group_name, consumer_gemm=reason is None and measuring)
    # The consumer GEMM is opt-in (FASTMESH_CUDA_CONSUMER_GEMM=1) until measured plans choose it.
    forced, note = None, ""
    if reason is None and chunked_gather.enabled() and not measuring:
        forced = plans.Decision(plans.Plan("consumer_gemm", chunks), f"{chunked_gather.ENV_ENABLE}=1")
    elif cuda and not measuring:
        reason = reason or f"it is opt-in until measured on GPUs: {chunked_gather.ENV_ENABLE}=1"
        note = f"(not the Triton consumer GEMM: {reason})"
    return run(plans.decide(call, chunks, run, forced, note).plan)


_all_gather_matmul_cuda = functools.partial(_all_gather_matmul_kernel, cuda=True)


def _matmul_reduce_scatter_kernel(a, b, scatter_dim, reduce_op, group_name, chunks=0):
    group = resolve_group(group_name, _RS)
    world = group.size()
    dim = _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, world, chunks)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, plan.pieces, plan.split)

    if world == 1 or a.numel() == 0 or b.numel() == 0:
        return run(plans.FIXED)
    product = scattered_shape(a.shape, b.shape[1], dim, world)
    ext.check_same_shape_on_all_ranks(a.new_empty(()).expand(product), group_name, _RS, "a @ b")
    return run(plans.decide(scatter_plan_call(a, b, dim, group_name), chunks, run).plan)


library.impl("all_gather_matmul", _all_gather_matmul_kernel, "CPU")
library.impl("all_gather_matmul", _all_gather_matmul_cuda, "CUDA")
for _device in ("CPU", "CUDA"):
    library.impl("matmul_reduce_scatter", _matmul_reduce_scatter_kernel, _device)


# ---- autograd ----


def _all_gather_matmul_setup(ctx, inputs, output):
    a_shard, bs, gather_dim, group_name, *defaulted = inputs  # return_a, chunks (see _input_grads)
    chunks = defaulted[1] if len(defaulted) > 1 else 0
    a_full, _ = output
    # Unused outputs (typically the gathered a, returned only for this backward) get no gradient rather
    # than zeros: no dead reduce-scatter term.
    ctx.set_materialize_grads(False)
    ctx.gather_dim = gather_dim % a_shard.dim()
    ctx.group_name = group_name
    ctx.chunks = chunks
    ctx.num_bs = len(bs)
    ctx.bs_need_grad = any(b.requires_grad for b in bs)
    # For the bs' gradients: the gathered a, or the shard to gather again in backward when the op was
    # called without return_a. For a_shard's: the bs.
    ctx.a_is_gathered = a_full is not None
    a_saved = (a_full if ctx.a_is_gathered else a_shard) if ctx.bs_need_grad else None
    ctx.save_for_backward(a_saved, *(bs if a_shard.requires_grad else ()))


def _all_gather_matmul_backward(ctx, grad_a_full, grad_outs):
    a_saved, *bs = ctx.saved_tensors
    grads = [(g, i) for i, g in enumerate(grad_outs) if g is not None]
    grad_a_shard = None
    if ctx.needs_input_grad[0] and (grads or grad_a_full is not None):
        grad_a_shard = _all_gather_matmul_input_grad(ctx, bs, grads, grad_a_full)
    grad_bs = [None] * ctx.num_bs  # a list input takes a list of gradients
    if ctx.bs_need_grad:
        a_full = a_saved if ctx.a_is_gathered else all_gather(a_saved.detach(), ctx.gather_dim, ctx.group_name)
        for g, i in grads:
            grad_bs[i] = rows(a_full).t() @ rows(g)
    return _input_grads(ctx, grad_a_shard, grad_bs)


def _input_grads(ctx, *grads):
    """``grads`` for the leading inputs, None for the rest. (torch 2.11 leaves trailing arguments equal to their
    defaults out of the inputs autograd sees, so their count varies.)"""
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


def _all_gather_matmul_input_grad(ctx, bs, grads, grad_a_full):
    if grad_a_full is not None:
        return reduce_scatter_gathered_grad(grad_a_full, bs, grads, ctx.gather_dim, ctx.group_name)
    grad_c, b_t = input_grad_operands(bs, grads)
    return torch.ops.fastmesh.matmul_reduce_scatter(grad_c, b_t, ctx.gather_dim, "sum", ctx.group_name, ctx.chunks)


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, scatter_dim, reduce_op, group_name, *defaulted = inputs  # chunks (see _input_grads)
    chunks = defaulted[0] if defaulted else 0
    ctx.scatter_dim = scatter_dim % a.dim()
    ctx.reduce_op = reduce_op
    ctx.group_name = group_name
    ctx.chunks = chunks
    ctx.save_for_backward(a if b.requires_grad else None, b if a.requires_grad else None)


def _matmul_reduce_scatter_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.reduce_op == "avg":
        grad_out = grad_out / group_size(ctx.group_name, _RS)
    grad_a = grad_b = None
    if need_a:
        grad_c, (grad_a,) = torch.ops.fastmesh.all_gather_matmul(
            grad_out.contiguous(), [b.t()], ctx.scatter_dim, ctx.group_name, need_b, ctx.chunks
        )
    elif need_b:
        grad_c = all_gather(grad_out.contiguous(), ctx.scatter_dim, ctx.group_name)
    if need_b:
        grad_b = rows(a).t() @ rows(grad_c)
    return _input_grads(ctx, grad_a, grad_b)


torch.library.register_autograd(
    qualified_name("all_gather_matmul"), _all_gather_matmul_backward, setup_context=_all_gather_matmul_setup
)
torch.library.register_autograd(
    qualified_name("matmul_reduce_scatter"), _matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup
)


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
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather ``a_shard`` along ``gather_dim`` and multiply the result by each ``b``, overlapped.

    Equivalent to (see the module docstring for shapes and autograd)::

        a = torch.cat(all_gather(a_shard, group), dim=gather_dim)
        return (a if return_a else None), [a @ b for b in bs]

    with one gather for all ``bs`` (e.g. the Q, K and V projections of one input).

    Args:
        a_shard: this rank's shard, float32 / bfloat16 / float16 / float64, at least 1-D; the same shape
            on every rank. A ``DTensor`` placed ``Shard(gather_dim)`` on a 1-D mesh gives DTensor results
            (the mesh is the group).
        bs: matrices ``[K, N_i]`` (``[W*K, N_i]`` when gathering the last dim), a's dtype and device;
            plain tensors or DTensors on the same mesh (``Replicate()``, or ``Shard(1)`` for a
            column-sharded weight: that output is then ``Shard(-1)``).
        gather_dim: the dim of ``a_shard`` to gather; any dim, negative counts from the end. The last dim
            splits the contraction instead of the rows.
        group: ``ProcessGroup``, 1-D ``DeviceMesh``, ``(mesh, axis_name)``, group name, or ``None`` for the
            default group.
        return_a: also return the gathered ``a``.
        pieces: pipeline pieces of rows per rank (``None``: the call's plan, see the module docstring; 1: no
            overlap beyond the local shard's multiply).
        fp8: a :class:`fastmesh.fp8.Float8Config` (current scaling, tensor-wise or row-wise) to run in FP8:
            ``a_shard`` travels as FP8 plus scales and the multiplies are scaled matmuls into a's dtype
            (``fastmesh/ops/fused_collectives_fp8.py`` has the recipe and its backward). Rows only
            (``gather_dim`` not the last dim); the returned ``a`` is then the dequantized FP8 gather, whose
            gradient passes straight through the quantization (added to the products' terms in the input
            dtype, then one reduce-scatter).
        chunks: deprecated alias of ``pieces`` (warns).

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
    if isinstance(bs, torch.Tensor):  # iterating it would split one matrix into rows
        raise TypeError(
            f"fastmesh.all_gather_matmul: bs must be a list of matrices, got a Tensor of shape "
            f"{list(bs.shape)}; pass [b] for one"
        )
    pieces = resolve_pieces(pieces, chunks, "fastmesh.all_gather_matmul")
    if _dtensor.is_dtensor(a_shard) or any(_dtensor.is_dtensor(b) for b in bs):
        return _dtensor.all_gather_matmul(all_gather_matmul, a_shard, bs, gather_dim, group, return_a, pieces, fp8)
    name = _group_name_of(group)
    pieces = 0 if pieces is None else pieces
    bs = list(bs)
    if not torch.compiler.is_compiling():  # when tracing, the fake impl runs the same checks
        _check_all_gather_matmul(a_shard, bs, gather_dim, group_size(name, _AG), pieces)
    _cpp_lib.require()
    if fp8 is not None:
        return all_gather_matmul_fp8(
            a_shard, bs, gather_dim, name, return_a, pieces, check_config(fp8, "fastmesh.all_gather_matmul")
        )
    # The bs' gradients need the gathered a: ask the op for it rather than gathering again in backward.
    want_a = return_a or (torch.is_grad_enabled() and any(b.requires_grad for b in bs))
    a_full, outs = torch.ops.fastmesh.all_gather_matmul(a_shard, bs, gather_dim, name, want_a, pieces)
    return (a_full if return_a else None), list(outs)


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
            DTensor result placed ``Shard(scatter_dim)``.
        b: ``[K, N]``, a's dtype and device.
        scatter_dim: the dim of ``a @ b`` to scatter; negative counts from the end; the last dim scatters
            the columns.
        group: as for :func:`all_gather_matmul`.
        reduce_op: ``"sum"`` or ``"avg"``.
        pieces: pipeline pieces of rows per rank (``None``: the call's plan, see the module docstring).
        fp8: a :class:`fastmesh.fp8.Float8Config` (current scaling, tensor-wise or row-wise) to multiply in FP8
            (scaled matmuls into a's dtype; the product is reduced in a's dtype).
        chunks: deprecated alias of ``pieces`` (warns).

    Returns:
        This rank's block of the reduced product: ``a @ b``'s shape with ``scatter_dim`` divided by the
        group size.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> y_shard = fastmesh.matmul_reduce_scatter(h, w2_t_shard, scatter_dim=0, group=mesh["tp"])
    """
    pieces = resolve_pieces(pieces, chunks, "fastmesh.matmul_reduce_scatter")
    if _dtensor.is_dtensor(a) or _dtensor.is_dtensor(b):
        return _dtensor.matmul_reduce_scatter(matmul_reduce_scatter, a, b, scatter_dim, group, reduce_op, pieces, fp8)
    name = _group_name_of(group)
    pieces = 0 if pieces is None else pieces
    if not torch.compiler.is_compiling():
        _check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_size(name, _RS), pieces)
    _cpp_lib.require()
    if fp8 is not None:
        return matmul_reduce_scatter_fp8(
            a, b, scatter_dim, name, reduce_op, pieces, check_config(fp8, "fastmesh.matmul_reduce_scatter")
        )
    return torch.ops.fastmesh.matmul_reduce_scatter(a, b, scatter_dim, reduce_op, name, pieces)

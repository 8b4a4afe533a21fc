"""A rank's shard inside gathered rows: torch's uneven sharding on the fused ops, and the gradient of a gathered
result that every rank holds whole.

Uneven sharding. The fused ops gather and scatter equal shards. A DTensor ``Shard(d)`` of ``n`` rows over ``w``
ranks holds ``torch.chunk``'s pieces: ``ceil(n / w)`` rows on each rank but the last ones, which hold fewer or none.
Every shard padded at its end with zero rows to ``ceil(n / w)`` rows is an equal shard, and since only the ranks
after the last full one are short, the padded shards gather to the ``n`` rows followed by the padding: the first
``n`` rows of a gathered result are those of the unpadded gather. The other way round, ``n`` rows padded at their
end to ``w * ceil(n / w)`` scatter into each rank's piece followed by padding. A zero row changes no other row of a
product (a row of ``a @ b`` reads only its own row of ``a``), nor another row's FP8 scale (a tensor-wise amax
ignores zeros; the other scales are per row or block), so both are exact; autograd carries the padding and the
slicing. "Rows" are any sharded dim: a weight's rows or columns are padded alike, and a contraction split unevenly
is padded on both operands (:func:`even_contraction`). Equal shapes matter beyond the transfers: the ranks agree
on a fused call's plan once per shape.

Replicated results. The backward of an all-gather + matmul sums the gathered input's gradients over the ranks (a
reduce-scatter): right for column-sharded products, whose ranks hold different parts of the gradient, but a
product or gathered input that every rank holds whole (``Replicate()``) has the whole gradient on every rank, and
the sum would count it once per rank. :func:`count_replicated_grad_once` passes it on from one rank only; a
replicated product's ``b`` then takes its own gradient from the whole one (:func:`replicated_product`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from fastmesh.ops._fused_common import as_matrix


def full_rows(n: int, world: int) -> int:
    """The rows of a full shard of ``n`` rows over ``world`` ranks: ``ceil(n / world)``."""
    return -(-n // world)


def own_rows(n: int, world: int, rank: int) -> int:
    """The rows rank ``rank`` holds of ``n`` rows sharded over ``world`` ranks (``torch.chunk``'s piece, or none)."""
    full = full_rows(n, world)
    return max(0, min(full, n - rank * full))


def pad_rows(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended along ``dim`` up to ``rows`` (``x`` itself when it has them)."""
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim)


def first_rows(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``x`` along ``dim`` (``x`` itself when it has no more), contiguous as an unpadded
    result would be: a copy only when rows are dropped from inside the tensor."""
    return x if x.shape[dim] == rows else x.narrow(dim, 0, rows).contiguous()


def even_shard(x_shard: torch.Tensor, dim: int, n: int, mesh: DeviceMesh, what: str) -> torch.Tensor:
    """This rank's shard of ``n`` rows along ``dim`` as an equal shard: itself when ``mesh.size()`` divides ``n``,
    else checked to be torch's piece (a DTensor made by ``from_local(shape=...)`` may not be) and padded to a full
    shard. Gathered, the first ``n`` rows are the answer."""
    world = mesh.size()
    if n % world == 0:
        return x_shard
    rank = mesh.get_local_rank()
    expected = own_rows(n, world, rank)
    if x_shard.shape[dim] != expected:
        raise ValueError(
            f"{what} is sharded unevenly along dim {dim} ({n} rows over {world} ranks), so rank {rank} must hold "
            f"{expected} of them (torch.chunk's piece: {full_rows(n, world)} per rank, the last ranks fewer), "
            f"but holds {x_shard.shape[dim]}"
        )
    return pad_rows(x_shard, dim, full_rows(n, world))


def even_contraction(
    a: torch.Tensor, b: torch.Tensor, k: int, mesh: DeviceMesh, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [..., K_r]`` and ``b [K_r, N]``, this rank's pieces of a contraction of ``k`` sharded as torch shards it,
    padded with zeros to equal shards of ``ceil(k / world)``: a padded column of ``a`` meets only padded rows of
    ``b``, so the product is the same. Equal shapes matter beyond the transfers: the ranks agree on a fused call's
    plan once per shape, so a rank whose shapes repeat where another's differ would wait for an agreement."""
    padded = even_shard(a, a.dim() - 1, k, mesh, f"{what}: a")
    if padded is a:
        return a, b
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{what}: b must have {a.shape[-1]} rows (a's local last dim), got shape {list(b.shape)}")
    return padded, pad_rows(b, 0, padded.shape[-1])


def rows_to_scatter(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """``x`` padded along ``dim`` to a multiple of ``world`` rows, to scatter in equal shards; follow with
    :func:`own_part`."""
    return pad_rows(x, dim, world * full_rows(x.shape[dim], world))


def own_part(shard: torch.Tensor, dim: int, n: int, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's piece of ``n`` rows along ``dim`` from its padded equal shard: of a scatter
    (:func:`rows_to_scatter`), or of a product of padded weight rows (:func:`even_shard`)."""
    world = mesh.size()
    if n % world == 0:
        return shard
    return first_rows(shard, dim, own_rows(n, world, mesh.get_local_rank()))


def count_replicated_grad_once(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x``, a result every rank of ``mesh`` holds whole, whose gradient (the same on every rank, as a
    ``Replicate()`` DTensor's is) only the mesh's first rank passes on: a backward that sums it over the ranks
    then counts it once."""
    return _CountReplicatedGradOnce.apply(x, mesh.get_local_rank() == 0)


class _CountReplicatedGradOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: bool):
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


def replicated_product(out: torch.Tensor, a_full: torch.Tensor | None, b: torch.Tensor, mesh: DeviceMesh):
    """``out = a_full @ b`` (a fused all-gather + matmul's product of a ``b`` every rank holds whole, passed to the
    op detached when it needs a gradient), whose gradient reaches the op, for ``a``'s gradient, from one rank only,
    while ``b``'s gradient, ``a_full.T @ G``, is taken on every rank from the whole ``G`` before that: each rank's
    ``b`` gets the gradient torch's replicated matmul gives it. ``a_full``: None when ``b`` needs no gradient."""
    out = count_replicated_grad_once(out, mesh)
    return out if a_full is None else _WeightGradOnEveryRank.apply(out, a_full.detach(), b)


class _WeightGradOnEveryRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, a_full: torch.Tensor, b: torch.Tensor):
        ctx.save_for_backward(a_full)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (a_full,) = ctx.saved_tensors
        return grad, None, as_matrix(a_full).t() @ as_matrix(grad)

"""DTensor in, DTensor out for the fused-collective fronts: placements checked, local tensors through the op.

==========================  ======================================  ===================================
front                       inputs (1-D mesh = the group)            outputs
==========================  ======================================  ===================================
all_gather_matmul           a_shard ``Shard(gather_dim)``;           a: ``Replicate()``;
                            each b plain, ``Replicate()`` or         a @ b: ``Replicate()``, or
                            ``Shard(1)`` (column-sharded)            ``Shard(-1)`` for a ``Shard(1)`` b
matmul_reduce_scatter       a ``Shard(-1)`` (contraction sharded);   ``Shard(scatter_dim)``
                            b plain (local rows) or ``Shard(0)``
matmul_all_reduce           a ``Shard(-1)``; b plain or ``Shard(0)``  ``Replicate()``
matmul_all_gather           a ``Replicate()`` (grad: ``Partial()``);  ``Replicate()``
                            b plain or ``Shard(1)``
==========================  ======================================  ===================================

``to_local`` / ``from_local`` are differentiable, so gradients flow back to the DTensor inputs. A sharded dim
the mesh size does not divide (torch's uneven sharding: gathered or scattered rows, a sharded or gathered
contraction, b's columns) runs the op on equal shards padded with zeros, and the results drop the
padding (:mod:`fastmesh.ops._shards`): every rank calls the op with the same shapes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fastmesh.mesh import group_name
from fastmesh.ops import _shards
from fastmesh.ops._checks import wrap_dim


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def any_dtensor(ts) -> bool:
    for t in ts:  # noqa: SIM110  (a loop, not any() of a generator: this runs on every front call)
        if isinstance(t, DTensor):
            return True
    return False


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def wrap_local(local: torch.Tensor, mesh, placement, shape) -> DTensor:
    """``local`` as the DTensor of global ``shape`` (contiguous) it is this rank's part of: ``from_local`` with the
    shape given, which an uneven shard needs."""
    return DTensor.from_local(
        local, mesh, (placement,), run_check=False, shape=torch.Size(shape), stride=_contiguous_strides(shape)
    )


def _mesh_of(t: DTensor, op: str, arg: str):
    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"{op}: {arg} must be a DTensor on a 1-D mesh (the TP group), got a {mesh.ndim}-D mesh; "
            "pass the TP axis's local tensor or a DTensor on mesh['tp']"
        )
    return mesh


def _check_group(group, mesh, op: str) -> None:
    if group is None:
        return
    if group_name(group) != group_name(mesh):
        raise ValueError(f"{op}: group names a different group than the DTensor's mesh {mesh}; pass group=None")


def _local_b(b, mesh, op: str, arg: str, allowed: tuple, hint: str):
    """A b operand's local tensor and its placement (None for a plain tensor)."""
    if not is_dtensor(b):
        return b, None
    if b.device_mesh != mesh:
        raise ValueError(f"{op}: {arg} must be on the same mesh as the DTensor input, got {b.device_mesh}")
    placement = b.placements[0]
    if placement not in allowed:
        raise ValueError(f"{op}: {arg} must be placed {hint}, got {placement!r}")
    return b.to_local(), placement


def all_gather_matmul(front, a_shard, bs, gather_dim, group, return_a, pieces, fp8, keep_gathered):
    op = "fastmesh.all_gather_matmul"
    if not is_dtensor(a_shard):
        raise TypeError(
            f"{op}: bs are DTensors, so a_shard must be a DTensor placed Shard(gather_dim) too, "
            f"got a {type(a_shard).__name__}"
        )
    mesh = _mesh_of(a_shard, op, "a_shard")
    _check_group(group, mesh, op)
    dim = wrap_dim(gather_dim, a_shard.dim(), op, "gather_dim", "a_shard")
    if a_shard.placements[0] != Shard(dim):
        raise ValueError(
            f"{op}: a_shard must be placed Shard({gather_dim}) (sharded along gather_dim), "
            f"got {a_shard.placements[0]!r}"
        )
    contraction, rows = dim == a_shard.dim() - 1, a_shard.shape[dim]
    a_local = _shards.even_shard(a_shard.to_local(), dim, rows, mesh, f"{op}: a_shard")
    # An uneven gathered contraction gathers a's K columns followed by zero columns, which meet zero rows of b.
    gathered_k = a_local.shape[-1] * mesh.size()
    locals_, placements, columns = [], [], []
    for i, b in enumerate(bs):
        allowed = (Replicate(),) if contraction else (Replicate(), Shard(1))
        local, placement = _local_b(
            b, mesh, op, f"bs[{i}]", allowed, "Replicate()" if contraction else "Replicate() or Shard(1)"
        )
        columns.append(local.shape[-1])
        if placement == Shard(1):  # torch's uneven columns: padded, dropped from the product
            local = _shards.even_shard(local, 1, b.shape[1], mesh, f"{op}: bs[{i}]")
        locals_.append(local)
        placements.append(placement)
    # A replicated product's b gets its gradient from replicated_product (whole, on every rank), not the op.
    own_grad = [
        p != Shard(1) and local.requires_grad and torch.is_grad_enabled() for p, local in zip(placements, locals_)
    ]
    op_bs = [local.detach() if own else local for local, own in zip(locals_, own_grad)]
    if contraction and rows % mesh.size():
        for i, b in enumerate(op_bs):
            if b.shape[0] != rows:
                raise ValueError(
                    f"{op}: bs[{i}] must have {rows} rows (a_shard's global last dim), got {list(b.shape)}"
                )
        op_bs = [_shards.pad_rows(b, 0, gathered_k) for b in op_bs]
    gathered, outs = front(
        a_local,
        op_bs,
        dim,
        group=mesh,
        return_a=return_a or any(own_grad),
        pieces=pieces,
        fp8=fp8,
        keep_gathered=keep_gathered,
    )

    def unpadded(t):  # the gathered rows; a gathered contraction leaves no padding in the products
        return t if contraction else _shards.first_rows(t, dim, rows)

    full_shape = list(a_shard.shape)
    out_dtensors = []
    a_rows = None if gathered is None else _shards.first_rows(gathered, dim, rows)
    for b, local, out, placement, n_local, own in zip(bs, locals_, outs, placements, columns, own_grad):
        n = b.shape[1] if is_dtensor(b) else n_local
        if placement == Shard(1):  # column-sharded: each rank's gradient is its part of the sum
            out = _shards.first_rows(unpadded(out), out.dim() - 1, n_local)
            out_dtensors.append(wrap_local(out, mesh, Shard(out.dim() - 1), full_shape[:-1] + [n]))
        else:
            out = _shards.replicated_product(unpadded(out), a_rows if own else None, local, mesh)
            out_dtensors.append(wrap_local(out, mesh, Replicate(), full_shape[:-1] + [n]))
    if not return_a:
        return None, out_dtensors
    a_full = _shards.count_replicated_grad_once(a_rows, mesh)
    return wrap_local(a_full, mesh, Replicate(), full_shape), out_dtensors


def _contraction_sharded(a, b, group, op: str):
    """(mesh, a's and b's local tensors) of a matmul whose contraction is sharded: a ``Shard(-1)``, b plain or
    ``Shard(0)``; torch's uneven pieces of the contraction padded to equal ones."""
    if not is_dtensor(a):
        raise TypeError(f"{op}: b is a DTensor, so a must be a DTensor placed Shard(-1) too, got a {type(a).__name__}")
    mesh = _mesh_of(a, op, "a")
    _check_group(group, mesh, op)
    if a.placements[0] != Shard(a.dim() - 1):
        raise ValueError(
            f"{op}: a must be placed Shard({a.dim() - 1}) (its contraction dim sharded, as a "
            f"row-parallel layer's input), got {a.placements[0]!r}"
        )
    b_local, _ = _local_b(b, mesh, op, "b", (Shard(0),), "Shard(0) (rows matching a's shards)")
    a_local, b_local = _shards.even_contraction(a.to_local(), b_local, a.shape[-1], mesh, op)
    return mesh, a_local, b_local


def matmul_reduce_scatter(front, a, b, scatter_dim, group, reduce_op, pieces, fp8):
    op = "fastmesh.matmul_reduce_scatter"
    mesh, a_local, b_local = _contraction_sharded(a, b, group, op)
    dim = wrap_dim(scatter_dim, a.dim(), op, "scatter_dim", "a")
    n = b.shape[1] if is_dtensor(b) else b_local.shape[1]
    # torch's uneven sharding of the scattered rows (or columns): scattered padded, the padding dropped
    if dim < a.dim() - 1:
        rows, a_local = a.shape[dim], _shards.rows_to_scatter(a_local, dim, mesh.size())
    else:
        rows, b_local = n, _shards.rows_to_scatter(b_local, 1, mesh.size())
    out = front(a_local, b_local, scatter_dim, group=mesh, reduce_op=reduce_op, pieces=pieces, fp8=fp8)
    out = _shards.own_part(out, dim, rows, mesh)
    return wrap_local(out, mesh, Shard(dim), list(a.shape[:-1]) + [n])


def matmul_all_reduce(front, a, b, group, reduce_op, pieces, fp8):
    op = "fastmesh.matmul_all_reduce"
    mesh, a_local, b_local = _contraction_sharded(a, b, group, op)
    out = front(a_local, b_local, group=mesh, reduce_op=reduce_op, pieces=pieces, fp8=fp8)
    n = b.shape[1] if is_dtensor(b) else b_local.shape[1]
    return wrap_local(out, mesh, Replicate(), list(a.shape[:-1]) + [n])


def matmul_all_gather(front, a, b, group, pieces):
    op = "fastmesh.matmul_all_gather"
    if not is_dtensor(a):
        raise TypeError(
            f"{op}: b is a DTensor, so a must be a DTensor placed Replicate() too, got a {type(a).__name__}"
        )
    mesh = _mesh_of(a, op, "a")
    _check_group(group, mesh, op)
    if a.placements[0] != Replicate():
        raise ValueError(
            f"{op}: a must be placed Replicate() (a column-parallel layer's input), got {a.placements[0]!r}"
        )
    b_local, _ = _local_b(b, mesh, op, "b", (Shard(1),), "Shard(1) (this rank's columns)")
    if is_dtensor(b):  # torch's uneven columns: padded, and the padding dropped from the gathered product
        b_local = _shards.even_shard(b_local, 1, b.shape[1], mesh, f"{op}: b")
    # Each rank's gradient of a is its columns' part: partial, summed where a was made replicated.
    out = front(a.to_local(grad_placements=[Partial()]), b_local, group=mesh, pieces=pieces)
    if is_dtensor(b):
        out = _shards.first_rows(out, out.dim() - 1, b.shape[1])
    return wrap_local(out, mesh, Replicate(), list(out.shape))

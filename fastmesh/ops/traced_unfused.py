"""Under inductor, a fused call whose plan is the unfused sequence is traced as that sequence.

Inside a compiled graph the op is opaque, so its unfused plan would block where it is called, while torch's
functional collectives let inductor wait for a transfer only where its result is first used (as it does for
the native TP plan). Inductor's decomposition table gets one entry per fused op: while AOTAutograd traces the
graph (forward and backward), a call with static shapes whose plan is ``unfused`` (asked as the compile pass
asks: this rank's cached plan, else the model, no collective; ``fastmesh/ops/plans.py``) becomes the
functional all-gather / reduce-scatter and the matmuls; any other call stays the op, which plans it at run
time. The entries are registered the first time a fused op is traced (its fake impl), so that importing
fastmesh does not import inductor.
"""

from __future__ import annotations

import logging

import torch

from fastmesh.ops import plans
from fastmesh.ops._fused_common import group_size

logger = logging.getLogger("fastmesh.plans")
_c10d = torch.ops._c10d_functional
_registered = None  # None: not tried yet


def register_once() -> bool:
    """Adds the entries to inductor's decomposition table (once); whether they are in place."""
    global _registered
    if _registered is not None:
        return _registered
    ops = (
        (torch.ops.fastmesh.all_gather_matmul.default, _all_gather_matmul),
        (torch.ops.fastmesh.matmul_reduce_scatter.default, _matmul_reduce_scatter),
    )
    try:
        from torch._inductor import decomposition as inductor_decompositions
        from torch._inductor.lowering import make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag

        # A call the decomposition leaves (NotImplemented) stays the op, which inductor runs as a fallback
        # kernel. Inductor creates that fallback on first sight, but refuses to for an op with a decomposition:
        # so it is created first, as inductor would create it (the op's default layout constraint).
        for op, _ in ops:
            make_fallback(
                op,
                layout_constraint=tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True)),
                warn=False,
            )
    except (ImportError, AttributeError, TypeError) as error:  # another torch's inductor internals
        logger.info("fastmesh: unfused plans stay inside the fused ops under inductor (%s)", error)
        _registered = False
        return False
    for op, traced in ops:
        inductor_decompositions.register_decomposition(op)(traced)
    # Inductor keeps the table it built at its first compile in this process (torch 2.14: a functools.cache).
    cached_table = getattr(inductor_decompositions, "fast_random_decomps", None)
    if hasattr(cached_table, "cache_clear"):
        cached_table.cache_clear()
    _registered = True
    return True


def _static(*tensors) -> bool:
    return all(isinstance(size, int) for t in tensors for size in t.shape)


def _unfused(call) -> bool:
    return call.shape.world > 1 and plans.decide_offline(call).plan == plans.UNFUSED


def _all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a=False, chunks=0):
    from fastmesh.ops.fused_collectives import gather_plan_call

    dim = gather_dim % a_shard.dim()
    if (
        chunks
        or a_shard.numel() == 0
        or not _static(a_shard, *bs)
        or not _unfused(gather_plan_call(a_shard, bs, dim, group_name))
    ):
        return NotImplemented
    world = group_size(group_name, "fastmesh::all_gather_matmul")
    stacked = _c10d.wait_tensor(_c10d.all_gather_into_tensor(a_shard.contiguous(), world, group_name))
    a = stacked if dim == 0 else torch.cat(stacked.chunk(world, 0), dim)  # c10d stacks the ranks along dim 0
    return (a if return_a else None), [a @ b for b in bs]


def _matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, chunks=0):
    from fastmesh.ops.fused_collectives import scatter_plan_call

    dim = scatter_dim % a.dim()
    if (
        chunks
        or a.numel() == 0
        or b.numel() == 0
        or not _static(a, b)
        or not _unfused(scatter_plan_call(a, b, dim, group_name))
    ):
        return NotImplemented
    world = group_size(group_name, "fastmesh::matmul_reduce_scatter")
    product = a @ b
    stacked = product if dim == 0 else torch.cat(product.chunk(world, dim), 0)  # rank j's block at rows j
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(stacked.contiguous(), "sum", world, group_name))
    return out / world if reduce_op == "avg" else out

"""Under inductor, a fused call whose plan is the unfused sequence is traced as that sequence.

Inside a compiled graph the op is opaque, so its unfused plan would block where it is called, while torch's
functional collectives let inductor wait for a transfer only where its result is first used (as it does for
the native TP plan). Inductor's decomposition table gets one entry per fused op: while AOTAutograd traces the
graph (forward and backward), a call with static shapes whose plan is ``unfused`` (asked as the compile pass
asks: this rank's cached plan, else the model, no collective; ``fastmesh/ops/plans.py``) becomes the
functional all-gather / reduce-scatter / all-reduce and the matmuls; any other call stays the op, which plans it at run
time. The entries are registered the first time a fused op is traced (its fake impl), so that importing
fastmesh does not import inductor.
"""

from __future__ import annotations

import logging

import torch

from fastmesh.ops import plans
from fastmesh.ops._collectives import traced_all_gather, traced_all_reduce, traced_reduce_scatter

logger = logging.getLogger("fastmesh.plans")
_registered = None  # None: not tried yet


def register_once() -> bool:
    """Adds the entries to inductor's decomposition table (once); whether they are in place."""
    global _registered
    if _registered is not None:
        return _registered
    ops = (
        (torch.ops.fastmesh.all_gather_matmul.default, _all_gather_matmul),
        (torch.ops.fastmesh.matmul_reduce_scatter.default, _matmul_reduce_scatter),
        (torch.ops.fastmesh.matmul_all_reduce.default, _matmul_all_reduce),
        (torch.ops.fastmesh.matmul_all_gather.default, _matmul_all_gather),
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


def _all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a=False, pieces=0):
    from fastmesh.ops.fused_collectives import gather_plan_call

    dim = gather_dim % a_shard.dim()
    if (
        pieces
        or a_shard.numel() == 0
        or not plans.has_static_shape(a_shard, *bs)
        or plans.unfused_offline(gather_plan_call(a_shard, bs, dim, group_name)) is None
    ):
        return NotImplemented
    a = traced_all_gather(a_shard, dim, group_name)
    return (a if return_a else None), [a @ b for b in bs]


def _matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, pieces=0):
    from fastmesh.ops.fused_collectives import scatter_plan_call

    dim = scatter_dim % a.dim()
    if (
        pieces
        or a.numel() == 0
        or b.numel() == 0
        or not plans.has_static_shape(a, b)
        or plans.unfused_offline(scatter_plan_call(a, b, dim, group_name)) is None
    ):
        return NotImplemented
    return traced_reduce_scatter(a @ b, dim, group_name, reduce_op)


def _traced_unfused(a, b, pieces, plan_call) -> bool:
    """Whether a call whose whole product travels runs its unfused plan: traced as its collective."""
    return (
        not pieces
        and a.numel() != 0
        and b.numel() != 0
        and plans.has_static_shape(a, b)
        and plans.unfused_offline(plan_call()) is not None
    )


def _matmul_all_reduce(a, b, reduce_op, group_name, pieces=0):
    from fastmesh.ops.matmul_all_reduce import plan_call

    if not _traced_unfused(a, b, pieces, lambda: plan_call(a, b, group_name)):
        return NotImplemented
    return traced_all_reduce(a @ b, group_name, reduce_op)


def _matmul_all_gather(a, b, group_name, pieces=0):
    from fastmesh.ops.matmul_all_gather import plan_call

    if not _traced_unfused(a, b, pieces, lambda: plan_call(a, b, group_name)):
        return NotImplemented
    return traced_all_gather(a @ b, -1, group_name)

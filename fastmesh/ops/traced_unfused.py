"""Under inductor, a fused call whose plan is the unfused sequence is traced as that sequence.

Inside a compiled graph the op is opaque, so its unfused plan would block where it is called, while torch's
functional collectives let inductor wait for a transfer only where its result is first used (as it does for
the native TP plan). Inductor's decomposition table gets one entry per fused op: while AOTAutograd traces the
graph (forward and backward), a call with static shapes whose plan is ``unfused`` (asked as the compile pass
asks: this rank's cached plan, else the model, no collective; ``fastmesh/ops/plans.py``) becomes the
functional all-gather / reduce-scatter / all-reduce and the matmuls; any other call stays the op, which plans it at run
time. Each op module registers its trace (:func:`trace`); the entries go into the table the first time a fused op
is traced (its fake impl calls :func:`register_once`), so that importing fastmesh does not import inductor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from fastmesh.ops import plans

logger = logging.getLogger("fastmesh.plans")
_registered = None  # None: not tried yet


# op name ("all_gather_matmul") -> its unfused trace: the op's arguments -> its results as torch's collectives and
# matmuls, or NotImplemented where the call keeps the op (a plan other than unfused, symbolic shapes, pieces=).
_traces: dict[str, Callable] = {}


def trace(op_name: str):
    """Registers the decorated function as ``op_name``'s unfused trace (installed by :func:`register_once`)."""

    def register(fn: Callable) -> Callable:
        _traces[op_name] = fn
        return fn

    return register


def register_once() -> bool:
    """Adds the registered traces to inductor's decomposition table (once); whether they are in place."""
    global _registered
    if _registered is not None:
        return _registered
    ops = [(getattr(torch.ops.fastmesh, name).default, fn) for name, fn in _traces.items()]
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


def plans_unfused(call: Callable[[], plans.Call], pieces: int, *tensors) -> bool:
    """Whether a call with these operands is traced unfused: no ``pieces=``, static shapes, no empty operand, and
    ``call()``'s offline plan (this rank's cached plan, else the model) is ``unfused``."""
    return (
        not pieces
        and all(t.numel() != 0 for t in tensors)
        and plans.has_static_shape(*tensors)
        and plans.unfused_offline(call()) is not None
    )

"""Keeps the all-gathers that autograd runs in backward in the compiled backward graph.

The column-parallel backward of ``all_gather_matmul`` (``csrc/fused/autograd.cpp``; its FP8 form in
``fused_collectives_fp8.py``) gathers the saved shard again for the weights' gradients, so that the gathered input is
not kept from forward to backward. Under ``torch.compile``, AOTAutograd's min-cut partitioner puts every node that
depends on no gradient into the forward graph, and always saves a collective's result rather than run it again
(``force_save_collectives``): that re-gather would run in forward and its result, the gathered input, be saved, as
if it had been kept. :class:`BackwardGathers`, a joint-graph pass, tags each all-gather traced in backward, and its
wait, ``must_be_in_backward``, the partitioner's own tag for a node that belongs to the backward graph: they stay
there and the partitioner saves their input, the shard.

Only all-gathers that autograd traced in backward are tagged (those that need a gradient are in backward anyway);
forward all-gathers, other collectives and other nodes are left as they are. It is
installed (:func:`install_once`) when a fastmesh op whose backward gathers is traced, as inductor's
``joint_custom_post_pass``, where it is not there already; a pass installed there before runs after it. A pass
installed there later, between the trace and the partition, replaces it: that compiled backward then keeps the
gathered input (the same gradients, more memory).
"""

from __future__ import annotations

import torch
from torch._inductor import config as inductor_config
from torch.fx import Graph

from fastmesh.ops._inductor_pass import ChainedPass

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
# AOTAutograd's tags (torch 2.11-2.14: torch/_functorch/_aot_autograd/graph_capture_wrappers.py, partitioners.py).
_TAG = "partitioner_tag"
_TRACED_IN_BACKWARD, _MUST_BE_IN_BACKWARD = "is_backward", "must_be_in_backward"


def keep_in_backward(graph: Graph) -> int:
    """Tags each all-gather traced in backward, and its waits, ``must_be_in_backward``; returns how many gathers."""
    tagged = 0
    for node in graph.nodes:
        if node.target is _GATHER and node.meta.get(_TAG) == _TRACED_IN_BACKWARD:
            node.meta[_TAG] = _MUST_BE_IN_BACKWARD
            for user in node.users:
                if user.target is _WAIT:
                    user.meta[_TAG] = _MUST_BE_IN_BACKWARD
            tagged += 1
    return tagged


class BackwardGathers(ChainedPass):
    """The joint-graph pass (module docstring); a pass installed before it runs after it."""

    sources = (__file__,)

    def run(self, graph: Graph) -> None:
        keep_in_backward(graph)


def installed(current=None) -> bool:
    """Whether :class:`BackwardGathers` is among the joint post passes (``current``: inductor's setting)."""
    current = inductor_config.joint_custom_post_pass if current is None else current
    pending = list(current) if isinstance(current, (list, tuple)) else [current]
    while pending:
        candidate = pending.pop()
        if isinstance(candidate, BackwardGathers):
            return True
        if isinstance(candidate, ChainedPass):
            pending.extend(candidate.previous_passes())
    return False


def install_once() -> None:
    """Installs :class:`BackwardGathers` as inductor's joint post pass where it is not among them (checked on every
    trace: a compile's ``options=`` may have set that pass only for itself)."""
    if not installed():
        inductor_config.joint_custom_post_pass = BackwardGathers(inductor_config.joint_custom_post_pass)

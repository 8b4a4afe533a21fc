"""Keeps the all-gathers that autograd runs in backward in the compiled backward graph.

The column-parallel backward of ``all_gather_matmul`` (``csrc/fused/autograd.cpp``; its FP8 form in
``fused_collectives_fp8.py``) gathers the saved shard again for the weights' gradients, so that the gathered input is
not kept from forward to backward. Under ``torch.compile``, AOTAutograd's min-cut partitioner puts every node that
depends on no gradient into the forward graph, and always saves a collective's result rather than run it again
(``force_save_collectives``): that re-gather would run in forward and its result, the gathered input, be saved, as
if it had been kept. :class:`BackwardGathers`, a joint-graph pass, tags each all-gather that only backward needs
(every use of it reaches the graph's outputs through values computed from a gradient), and its wait,
``must_be_in_backward``, the partitioner's own tag for a node that belongs to the backward graph: they stay there
and the partitioner saves their input, the shard. (AOTAutograd tags the nodes it traces in backward, but not those
of an ``autograd.Function``'s backward that dynamo traced, the FP8 forms': hence the rule on uses.)

An op whose plan is unfused is traced as torch's own gather and matmuls (``traced_unfused``), and AOTAutograd's CSE
merges that forward gather with the backward's gather of the same shard into one node, which the partitioner then
saves. Its trace marks the gather (:func:`recomputed_in_backward`, unless ``keep_gathered``), and the pass tags
the marked forward nodes ``MUST_RECOMPUTE`` (the partitioner's tag for activation checkpointing, which its ban on
recomputing collectives respects): the shard is saved and gathered again in backward, as eager does.

Only these all-gathers are tagged (those that need a gradient are in backward anyway); other forward all-gathers,
other collectives and other nodes are left as they are. It is installed (:func:`install_once`) when a fastmesh op whose
backward gathers is traced, as inductor's ``joint_custom_post_pass``, where it is not there already; a pass
installed there before runs after it. A pass installed there later, between the trace and the partition, replaces
it: that compiled backward then keeps the gathered input (the same gradients, more memory).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.traceback
from torch._inductor import config as inductor_config
from torch.fx import Graph
from torch.utils.checkpoint import CheckpointPolicy

from fastmesh.ops._inductor_pass import ChainedPass

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
# The partitioner's tag for a node of the backward graph (torch 2.11-2.14: torch/_functorch/partitioners.py).
_TAG, _MUST_BE_IN_BACKWARD = "partitioner_tag", "must_be_in_backward"
# The mark of a traced gather whose shard backward keeps (in the node's ``meta["custom"]``, set by ``annotate``).
_SHARD_KEPT = "fastmesh_shard_kept"


def recomputed_in_backward() -> contextlib.AbstractContextManager:
    """Marks the nodes traced inside it (a gather of a shard and its layout ops) to be run again in backward rather
    than saved (module docstring)."""
    return torch.fx.traceback.annotate({_SHARD_KEPT: True})


def _tangent_dependent(graph: Graph) -> set:
    """The nodes computed from a gradient (a ``tangents_*`` input of the joint graph, as the partitioner tells them)."""
    dependent = set()
    for node in graph.nodes:  # in topological order
        is_tangent = node.op == "placeholder" and "tangents" in str(node.target)
        if is_tangent or any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _only_for_gradients(node, tangent_dependent: set) -> bool:
    """Whether every use of ``node`` reaches the graph's outputs only through nodes computed from a gradient: a
    value backward needs and forward does not."""
    seen, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":  # a forward output (the output node itself also returns the gradients)
                return False
            if user in tangent_dependent or user in seen:
                continue
            seen.add(user)
            stack.append(user)
    return True


def keep_in_backward(graph: Graph) -> int:
    """Tags each all-gather that only backward needs, and its waits, ``must_be_in_backward``, and the forward nodes
    marked by :func:`recomputed_in_backward` ``MUST_RECOMPUTE``; returns how many all-gathers it tagged."""
    tangent_dependent = _tangent_dependent(graph)
    tagged = 0
    for node in graph.nodes:
        # Backward's nodes inherit the marks of the forward nodes they differentiate: only forward uses count.
        marked = node.meta.get("custom", {}).get(_SHARD_KEPT, False)
        if node in tangent_dependent or not (marked or node.target is _GATHER):
            continue
        if _only_for_gradients(node, tangent_dependent):
            if node.target is _GATHER:
                node.meta[_TAG] = _MUST_BE_IN_BACKWARD
                for user in node.users:
                    if user.target is _WAIT:
                        user.meta[_TAG] = _MUST_BE_IN_BACKWARD
                tagged += 1
        elif marked:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += node.target is _GATHER
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

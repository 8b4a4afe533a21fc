"""The native plan's column-parallel inputs kept as shards: with the fusion pass, a forward all-gather whose result
backward uses (a weight gradient's operand) is gathered again in backward instead of saved.

torch's native sequence-parallel plan keeps each gathered input for its weights' gradients, ``W`` times the shard.
:class:`SavedShards`, a joint-graph pass installed with the fusion pass (:func:`fastmesh.compile.enable_fusion`,
:func:`fastmesh.compile.fusion_options`), tags each forward all-gather that feeds matmuls, with its wait and the
layout ops between them and the gathered tensor, ``MUST_RECOMPUTE`` (the partitioner's tag for activation
checkpointing, which its ban on recomputing collectives respects). The partitioner then saves the shard and runs
that gather again in the backward graph, where the fusion pass leaves it, by design, unfused
(``patterns.match_all_gather``): what fastmesh's own ops do (``docs/design/fused-collectives.md``, "Saved for
backward"). Where that gather runs in the backward graph is inductor's choice: before its first use unless inductor
reorders collectives (``reorder_for_compute_comm_overlap``).
"""

from __future__ import annotations

from torch.fx import Graph
from torch.utils.checkpoint import CheckpointPolicy

from fastmesh.compile import patterns
from fastmesh.ops._inductor_pass import ChainedPass

_TAG = "partitioner_tag"


def recompute_forward_gathers(graph: Graph) -> int:
    """Tags each forward all-gather of a matmul's operand (its wait and layout ops too) ``MUST_RECOMPUTE``;
    returns how many."""
    tagged = 0
    for node in graph.nodes:
        if node.target is not patterns.ALL_GATHER or node.meta.get(_TAG) == "is_backward":
            continue
        found = patterns.gathered_tensor(node)
        if found is None or not patterns.multiplied_later(found[1]):
            continue
        wait, _, _, layout_nodes = found
        for gather_node in (node, wait, *layout_nodes):
            gather_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        tagged += 1
    return tagged


class SavedShards(ChainedPass):
    """The joint-graph pass (module docstring); a pass installed before it runs after it."""

    sources = (__file__, patterns.__file__)

    def run(self, graph: Graph) -> None:
        recompute_forward_gathers(graph)

"""Rewrite matched native TP patterns (:mod:`fastmesh.compile.patterns`) into fastmesh ops.

Each rewrite first builds its new nodes and computes their fake values by running the ops' fake impls
(which also validates the arguments the way the ops will at run time). Only when that succeeds does it
redirect the old nodes' users and erase the old nodes, collectives included: ``wait_tensor`` is impure, so
dead-code elimination would leave the replaced collective running beside the fused op.
"""

from __future__ import annotations

import operator

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from fastmesh.compile.patterns import GatherMatch, ScatterMatch, Unfusable

aten = torch.ops.aten


class _NodeBuilder:
    """Creates nodes before ``anchor`` with their fake values; :meth:`undo` removes them all."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph = graph
        self.anchor = anchor
        self.created: list[Node] = []
        values = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = detect_fake_mode(values)

    def call(self, target, *args) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        self.created.append(node)
        values = map_arg(args, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*values)
        return node

    def undo(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)


def _erase(graph: Graph, nodes) -> None:
    """Erase ``nodes``, given users first."""
    for node in nodes:
        if node.users:
            raise AssertionError(f"fastmesh fusion: {node.name} still has users {list(node.users)} after the rewrite")
        graph.erase_node(node)


def _first_in_graph(graph: Graph, nodes) -> Node:
    wanted = set(nodes)
    return next(n for n in graph.nodes if n in wanted)


def _matrix_shape(consumer) -> list:
    """The 2-D shape of a consumer matmul's output: the view's row count, the matmul's column count."""
    rows = consumer.view.args[1][0]
    cols = consumer.matmul.meta["val"].shape[1]
    if isinstance(cols, int):
        return [rows, cols]
    if rows == -1:
        raise ValueError(f"the output of {consumer.matmul.name} has a symbolic width and a view with -1 rows")
    return [rows, -1]


def fuse_all_gather(graph: Graph, match: GatherMatch):
    """Replace the gather and its consumer matmuls by one ``fastmesh::all_gather_matmul``. Returns the new
    node, or an :class:`Unfusable` if the fused op's fake impl rejects the arguments."""
    build = _NodeBuilder(graph, _first_in_graph(graph, [c.matmul for c in match.consumers]))
    try:
        fused = build.call(torch.ops.fastmesh.all_gather_matmul.default, match.shard,
                           [c.b for c in match.consumers], match.gather_dim, match.group_name, match.return_a)
        products = build.call(operator.getitem, fused, 1)
        outputs = []
        for index, consumer in enumerate(match.consumers):
            out = build.call(operator.getitem, products, index)
            if consumer.view is not None:
                out = build.call(aten.reshape.default, out, _matrix_shape(consumer))
            if consumer.bias is not None:
                out = build.call(aten.add.Tensor, out, consumer.bias)
            outputs.append(out)
        gathered = build.call(operator.getitem, fused, 0) if match.return_a else None
    except Exception as error:  # the op's own checks, e.g. a shard the group size does not divide
        build.undo()
        return Unfusable(f"fastmesh.all_gather_matmul rejects the arguments: {error}")

    for consumer, out in zip(match.consumers, outputs):
        consumer.matmul.replace_all_uses_with(out)
        graph.erase_node(consumer.matmul)
    if gathered is not None:
        match.gathered.replace_all_uses_with(gathered)
    for view in match.views:  # users first: a chain of reshapes goes from its end
        if not view.users:
            graph.erase_node(view)
    _erase(graph, [*reversed(match.layout_nodes), match.wait, match.collective])
    return fused


def fuse_reduce_scatter(graph: Graph, match: ScatterMatch):
    """Replace the matmul(s) and the reduce-scatter by one ``fastmesh::matmul_reduce_scatter``; a sum of
    matmuls ``sum_j x_j @ b_j`` becomes one matmul of ``cat(x_j, -1)`` by ``cat(b_j, 0)``. Returns the new
    node or an :class:`Unfusable`."""
    build = _NodeBuilder(graph, match.collective)
    terms = match.terms
    try:
        if len(terms) == 1:
            a, b = terms[0].args[0], terms[0].args[1]
        else:
            a = build.call(aten.cat.default, [t.args[0] for t in terms], 1)
            b = build.call(aten.cat.default, [t.args[1] for t in terms], 0)
        contraction = a.meta["val"].shape[1]
        if len(match.shape_args) != 2:
            lead = match.shape_args[:-1]
            a = build.call(aten.reshape.default, a, [*lead, contraction if isinstance(contraction, int) else -1])
        fused = build.call(torch.ops.fastmesh.matmul_reduce_scatter.default, a, b, match.scatter_dim,
                           match.reduce_op, match.group_name)
    except Exception as error:
        build.undo()
        return Unfusable(f"fastmesh.matmul_reduce_scatter rejects the arguments: {error}")

    for user in list(match.collective.users):
        if user.op == "output":  # the collective saved for backward
            user.replace_input_with(match.collective, fused)
    match.wait.replace_all_uses_with(fused)
    _erase(graph, [match.wait, match.collective, *match.chain])
    return fused

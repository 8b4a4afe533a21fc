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
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg

from fastmesh.compile.patterns import (
    ALL_GATHER,
    ALL_REDUCE,
    DTYPE_VIEW,
    REDUCE_SCATTER,
    RESHAPES,
    WAIT,
    GatherMatch,
    ProductGatherMatch,
    ScatterMatch,
    Unfusable,
    matmul_operands,
)

aten = torch.ops.aten


# The layout ops that follow a collective's wait (moving rank blocks, viewing as FP8): pure, so two alike are one.
_LAYOUT_OPS = (aten.split.Tensor, operator.getitem, aten.cat.default, DTYPE_VIEW, *RESHAPES)


def merge_repeated_waits(graph: Graph) -> None:
    """One ``wait_tensor`` per collective: the users of a collective's later waits move to its first, and the layout
    ops that each wait had of its own, now alike, become one. AOTAutograd's common-subexpression elimination merges
    identical collectives but keeps each one's wait and what follows it (two ``ColwiseParallel(input_layouts=
    Shard(1))`` linears reading one input gather it once, waited twice), and the patterns expect one wait. A later
    wait returns the tensor the first one did, and every user of a node comes after the first of its kind, so the
    graph stays in order."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.target not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE):
            continue
        waits = sorted((user for user in node.users if user.target == WAIT), key=order.__getitem__)
        if len(waits) > 1:
            _merge_alike(waits, graph)
            _merge_alike_layout_users(waits[0], graph, order)


def _merge_alike(nodes: list[Node], graph: Graph) -> None:
    for later in nodes[1:]:
        later.replace_all_uses_with(nodes[0])
        graph.erase_node(later)


def _merge_alike_layout_users(node: Node, graph: Graph, order: dict) -> None:
    stack = [node]
    while stack:
        current = stack.pop()
        alike: dict[tuple, list[Node]] = {}
        for user in sorted(current.users, key=order.__getitem__):
            if user.target in _LAYOUT_OPS:
                alike.setdefault((user.target, repr(user.args), repr(user.kwargs)), []).append(user)
        for nodes in alike.values():
            _merge_alike(nodes, graph)
            stack.append(nodes[0])


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


def _is_transposed_contiguous(matrix: torch.Tensor) -> bool:
    rows, cols = matrix.shape
    # Decided without guards: sizes may be symbolic.
    return (
        statically_known_true(matrix.stride(0) == 1)
        and statically_known_true(matrix.stride(1) == rows)
        and not statically_known_true(cols == 1)
    )


def _cat_matrices(build: _NodeBuilder, matrices, dim: int) -> Node:
    """``cat(matrices, dim)`` of 2-D nodes. When every matrix is a transposed view of a contiguous one (a
    weight ``w.t()``), the contiguous ones are concatenated along the other dim and the result transposed: no
    transposing copy, and no transposes materialized into a cat, which inductor's CPU code gets wrong for
    16-bit dtypes (docs/design/compile.md)."""
    if all(_is_transposed_contiguous(m.meta["val"]) for m in matrices):
        rows = [build.call(aten.permute.default, m, [1, 0]) for m in matrices]
        return build.call(aten.permute.default, build.call(aten.cat.default, rows, 1 - dim), [1, 0])
    return build.call(aten.cat.default, list(matrices), dim)


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


def _erase_unused(graph: Graph, nodes) -> None:
    """Erase those of ``nodes`` (given users first) that nothing uses any more."""
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


def fuse_gather(graph: Graph, match: GatherMatch | ProductGatherMatch):
    """The rewrite of an all-gather match: into its consumers (:func:`fuse_all_gather`) or its producer
    (:func:`fuse_product_gather`)."""
    if isinstance(match, ProductGatherMatch):
        return fuse_product_gather(graph, match)
    return fuse_all_gather(graph, match)


def fuse_product_gather(graph: Graph, match: ProductGatherMatch):
    """Replace the matmul, its reshapes and the gather of its columns by one ``fastmesh::matmul_all_gather``
    (reshaped to the gathered tensor's leading dims). Returns the new node or an :class:`Unfusable`."""
    build = _NodeBuilder(graph, match.collective)
    a, b = match.matmul.args[:2]
    try:
        fused = out = build.call(torch.ops.fastmesh.matmul_all_gather.default, a, b, match.group_name)
        if match.reshapes:  # the leading dims the product was reshaped to, as its reshape gives them
            # The gathered columns spelled out where static: the leading dims may already infer one (-1).
            columns = match.gathered.meta["val"].shape[-1]
            out = build.call(
                aten.reshape.default, fused, [*match.shard.args[1][:-1], columns if isinstance(columns, int) else -1]
            )
    except Exception as error:
        build.undo()
        return Unfusable(f"fastmesh's fused op rejects the arguments: {error}")
    match.gathered.replace_all_uses_with(out)
    _erase(graph, [*reversed(match.layout_nodes), match.wait, match.collective, *match.reshapes, match.matmul])
    return fused


def fuse_all_gather(graph: Graph, match: GatherMatch):
    """Replace the gather (and, FP8 row-wise, its scales' gather) and its consumer matmuls by one
    ``fastmesh::all_gather_matmul`` / ``all_gather_scaled_matmul``. Returns the new node, or an
    :class:`Unfusable` if the fused op's fake impl rejects the arguments."""
    build = _NodeBuilder(graph, _first_in_graph(graph, [c.matmul for c in match.consumers]))
    bs = [c.b for c in match.consumers]
    try:
        if match.a_scale is None:
            fused = build.call(
                torch.ops.fastmesh.all_gather_matmul.default,
                match.shard,
                bs,
                match.gather_dim,
                match.group_name,
                match.return_a,
            )
            products = build.call(operator.getitem, fused, 1)
        else:
            b_scales = [c.scaled["scale_b"] for c in match.consumers]
            fused = build.call(
                torch.ops.fastmesh.all_gather_scaled_matmul.default,
                match.shard,
                match.a_scale,
                bs,
                b_scales,
                match.gather_dim,
                match.group_name,
                match.out_dtype,
                match.return_a,
            )
            products = build.call(operator.getitem, fused, 2)
        outputs = []
        for index, consumer in enumerate(match.consumers):
            out = build.call(operator.getitem, products, index)
            if consumer.view is not None:
                out = build.call(aten.reshape.default, out, _matrix_shape(consumer))
            if consumer.bias is not None:
                out = build.call(aten.add.Tensor, out, consumer.bias)
            outputs.append(out)
        gathered = build.call(operator.getitem, fused, 0) if match.return_a else None
        scales = build.call(operator.getitem, fused, 1) if match.return_a and match.scale_gather else None
    except Exception as error:  # the op's own checks, e.g. a shard the group size does not divide
        build.undo()
        return Unfusable(f"fastmesh's fused op rejects the arguments: {error}")

    for consumer, out in zip(match.consumers, outputs):
        consumer.matmul.replace_all_uses_with(out)
        graph.erase_node(consumer.matmul)
    if gathered is not None:
        match.gathered.replace_all_uses_with(gathered)
    if scales is not None:
        match.scale_gather.gathered.replace_all_uses_with(scales)
    _erase_unused(graph, match.views)
    shard_bytes = match.collective.args[0]  # FP8 on gloo: a uint8 view of the shard
    _erase(graph, [*reversed(match.layout_nodes), match.wait, match.collective])
    if match.scale_gather is not None:
        _erase_unused(graph, match.scale_gather.reshapes)
        _erase(graph, match.scale_gather.layout_nodes)
    _erase_unused(graph, [shard_bytes])
    return fused


def _reduction_operands(build: _NodeBuilder, match: ScatterMatch):
    """The fused op's ``a`` (with the product's leading dims), ``b`` and, FP8, ``a_scale``."""
    operands = [matmul_operands(t) for t in match.terms]
    if len(operands) == 1:
        a, b = operands[0]
    else:
        a = _cat_matrices(build, [a for a, _ in operands], 1)
        b = _cat_matrices(build, [b for _, b in operands], 0)
    contraction = a.meta["val"].shape[1]
    a_scale = match.scaled["scale_a"] if match.scaled else None
    if len(match.shape_args) != 2:
        lead = match.shape_args[:-1]
        a = build.call(aten.reshape.default, a, [*lead, contraction if isinstance(contraction, int) else -1])
        if match.scaled and a_scale.meta["val"].dim() == 2:  # row-wise: one scale per row of a
            a_scale = build.call(aten.reshape.default, a_scale, [*lead, 1])
    return a, b, a_scale


def _finish_reduction(graph: Graph, build: _NodeBuilder, match: ScatterMatch, fused: Node) -> Node:
    """Add the partial biases once after the fused op (why that is exact: patterns._partial_bias), then put
    the result in the place of the collective's and erase the native nodes."""
    out = fused
    for bias in match.biases:
        out = build.call(aten.add.Tensor, out, bias.bias)
    for user in list(match.collective.users):
        if user.op == "output":  # the collective saved for backward
            user.replace_input_with(match.collective, out)
    match.wait.replace_all_uses_with(out)
    _erase(graph, [match.wait, match.collective, *match.chain])
    _erase_unused(graph, [bias.term for bias in match.biases])
    return fused


def _fuse_reduction(graph: Graph, match: ScatterMatch, op, scaled_op, *where):
    """Replace the matmul(s) and the reduction by one ``op(a, b, *where, reduce_op, group_name)`` or, for a
    ``_scaled_mm``, ``scaled_op(a, a_scale, b, b_scale, *where, reduce_op, group_name, out_dtype)``, plus the
    partial biases added once after; a sum of matmuls ``sum_j x_j @ b_j`` becomes one matmul of ``cat(x_j, -1)``
    by ``cat(b_j, 0)``. Returns the new node or an :class:`Unfusable`."""
    build = _NodeBuilder(graph, match.collective)
    scaled = match.scaled
    try:
        a, b, a_scale = _reduction_operands(build, match)
        if scaled:
            out_dtype = scaled["out_dtype"] or a.meta["val"].dtype
            args = (a, a_scale, b, scaled["scale_b"], *where, match.reduce_op, match.group_name, out_dtype)
            fused = build.call(scaled_op, *args)
        else:
            fused = build.call(op, a, b, *where, match.reduce_op, match.group_name)
    except Exception as error:
        build.undo()
        return Unfusable(f"fastmesh's fused op rejects the arguments: {error}")
    return _finish_reduction(graph, build, match, fused)


def fuse_reduce_scatter(graph: Graph, match: ScatterMatch):
    """One ``fastmesh::matmul_reduce_scatter`` (``scaled_matmul_reduce_scatter`` for a ``_scaled_mm``) in place
    of the matmul(s) and the reduce-scatter (:func:`_fuse_reduction`)."""
    fastmesh_ops = torch.ops.fastmesh
    return _fuse_reduction(
        graph,
        match,
        fastmesh_ops.matmul_reduce_scatter.default,
        fastmesh_ops.scaled_matmul_reduce_scatter.default,
        match.scatter_dim,
    )


def fuse_all_reduce(graph: Graph, match: ScatterMatch):
    """One ``fastmesh::matmul_all_reduce`` (``scaled_matmul_all_reduce`` for a ``_scaled_mm``) in place of the
    matmul(s) and the all-reduce (:func:`_fuse_reduction`)."""
    fastmesh_ops = torch.ops.fastmesh
    return _fuse_reduction(
        graph, match, fastmesh_ops.matmul_all_reduce.default, fastmesh_ops.scaled_matmul_all_reduce.default
    )

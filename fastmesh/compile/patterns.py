"""Find native TP collectives and the matmuls around them in a post-grad FX graph.

The graphs are those inductor hands to ``post_grad_custom_post_pass``: functional collectives
(``_c10d_functional``), every view already a ``reshape``. A DTensor redistribution Shard(d) -> Replicate
along d > 0 shows up as::

    w = wait_tensor(all_gather_into_tensor(a_shard, W, group))     # ranks stacked along dim 0
    a = cat([split(w, a_shard.size(0))[0], ..., [W-1]], dim=d)       # (absent when d == 0)
    y_i = mm(reshape(a, [-1, K]), b_i)   or   addmm(bias_i, reshape(a, [-1, K]), b_i)

and Partial -> Shard(d) of a row-parallel product as::

    p = reshape(mm(x, b))     or the sum of several such terms (the backward of q/k/v)
    c = cat([split(p, p.size(d) // W, d)[0], ..., [W-1]])             # (absent when d == 0)
    out = wait_tensor(reduce_scatter_tensor(c, "sum" | "avg", W, group))

A Partial -> Replicate of a row-parallel product is ``wait_tensor(all_reduce(p, op, group))``. A row-parallel
linear's bias is made partial by DTensor: ``addmm(bias / W, x, b)`` (or ``mm(x, b) + bias / W``) before the
reduction (:func:`_partial_bias`). The FP8 forms have ``_scaled_mm`` in place of ``mm`` (gloo gathers FP8 as
uint8 bytes, viewed back as FP8).
A Shard(-1) -> Replicate of a column-parallel product (the LM head) is the all-gather of ``reshape(mm(x, b))``
with its rank blocks moved to the last dim.
:func:`match_all_gather`, :func:`match_reduce_scatter` and :func:`match_all_reduce` return a description of
what to rewrite, or an :class:`Unfusable` with the reason a user can act on. Nothing here edits the graph.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

from fastmesh.ops._checks import FP8_DTYPES, MATMUL_DTYPES, REDUCE_OPS

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
WAIT = _c10d.wait_tensor.default
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
MM = aten.mm.default
ADDMM = aten.addmm.default
SCALED_MM = aten._scaled_mm.default
TRANSPOSES = (aten.permute.default, aten.t.default)
DTYPE_VIEW = aten.view.dtype


@dataclasses.dataclass(frozen=True)
class Unfusable:
    """Why a collective was left as it is; ``by_design``: a collective the pass leaves on purpose (not a failure)."""

    reason: str
    by_design: bool = False


@dataclasses.dataclass(frozen=True)
class Consumer:
    """``matmul`` = ``mm(view or gathered, b)``, ``addmm(bias, view or gathered, b)`` or
    ``_scaled_mm(view or gathered, b, scale_a, scale_b, ...)`` (its arguments by name in ``scaled``)."""

    matmul: Node
    view: Node | None  # the last reshape before the matmul (2-D), None if the matmul reads the gathered tensor
    b: Node
    bias: Node | None
    scaled: dict | None = None


@dataclasses.dataclass(frozen=True)
class ScaleGather:
    """The all-gather of row-wise FP8 scales that travels beside the data's: the fused op carries them."""

    shard: Node
    gathered: Node
    reshapes: tuple[Node, ...]  # from the matmuls' scale_a down to ``gathered``, users first
    layout_nodes: tuple[Node, ...]  # from ``gathered`` to the collective, users first

    @property
    def collective(self) -> Node:
        return self.layout_nodes[-1]


@dataclasses.dataclass(frozen=True)
class GatherMatch:
    collective: Node
    wait: Node
    shard: Node
    gather_dim: int
    group_name: str
    gathered: Node  # the node holding the gathered tensor: ``wait``, or the ``cat`` of the split form
    layout_nodes: tuple[Node, ...]  # split, getitems, cat (empty when gather_dim == 0)
    views: tuple[Node, ...]  # the reshapes between the gathered tensor and the matmuls, users first
    consumers: tuple[Consumer, ...]
    return_a: bool  # the gathered tensor (or its gathered row-wise scales) has other users than the matmuls
    a_scale: Node | None = None  # FP8: the shard's scale (tensor-wise, or the row-wise scales' shard)
    scale_gather: ScaleGather | None = None  # FP8 row-wise: the scales' own all-gather, fused too
    out_dtype: torch.dtype | None = None  # FP8: the _scaled_mm output dtype


@dataclasses.dataclass(frozen=True)
class ProductGatherMatch:
    """``cat(split(wait(all_gather(reshape(mm(a, b)))), dim=0), dim=-1)``: a column-parallel product made
    replicated (DTensor's Shard(-1) -> Replicate, the LM head's logits): ``fastmesh::matmul_all_gather``."""

    collective: Node
    wait: Node
    shard: Node  # the gathered product: the mm, or the last of its reshapes
    group_name: str
    gathered: Node  # the cat holding every rank's columns
    layout_nodes: tuple[Node, ...]  # split, getitems, cat
    matmul: Node
    reshapes: tuple[Node, ...]  # from ``shard`` down to the mm, users first


@dataclasses.dataclass(frozen=True)
class ScatterMatch:
    collective: Node
    wait: Node
    reduce_op: str
    scatter_dim: int
    group_name: str
    product: Node  # the tensor the reduce-scatter reduces, before its split/cat layout
    terms: tuple[Node, ...]  # the mm nodes whose sum (through reshapes) is ``product``
    shape_args: list  # ``product``'s shape as reshape arguments (ints and SymInt nodes of the graph)
    chain: tuple[Node, ...]  # every node between the mms and the wait, erased after the rewrite
    scaled: dict | None = None  # FP8: the one term's _scaled_mm arguments by name
    biases: tuple[PartialBias, ...] = ()  # replicated biases DTensor made partial: added once after the fused op


@dataclasses.dataclass(frozen=True)
class PartialBias:
    """``term = div(bias, W)``, added to the product on every one of the ``W`` ranks before the sum over them:
    DTensor's Replicate -> Partial("sum") form of the replicated ``bias`` (see :func:`_partial_bias`)."""

    term: Node
    bias: Node


def matmul_operands(node: Node) -> tuple[Node, Node]:
    """The two matrices of an ``mm``, ``addmm`` or ``_scaled_mm`` node."""
    return (node.args[1], node.args[2]) if node.target == ADDMM else (node.args[0], node.args[1])


def fake_value(node) -> torch.Tensor | None:
    """The fake tensor a graph node stands for (its ``meta["val"]``), None for a non-tensor."""
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _provably_equal(a, b) -> bool:
    """Equal sizes, possibly symbolic, without adding guards."""
    return statically_known_true(a == b)


def size_value(arg):
    """An int, or the SymInt a size node stands for."""
    return arg.meta.get("val") if isinstance(arg, Node) else arg


def _describe_nodes(nodes) -> str:
    return ", ".join(f"{n.name} ({n.target if n.op == 'call_function' else n.op})" for n in nodes) or "none"


def _ancestors(node: Node) -> set[Node]:
    seen: set[Node] = set()
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


# Every multiply op of a post-grad graph, fusable or not, and which of its arguments it multiplies (addmm's and
# baddbmm's first is added; _scaled_mm multiplies its scales too).
_MULTIPLIED = {
    MM: slice(0, 2),
    ADDMM: slice(1, 3),
    SCALED_MM: slice(0, 4),
    aten.bmm.default: slice(0, 2),
    aten.baddbmm.default: slice(1, 3),
}


def _weight_gradient_gather(gathered: Node) -> bool:
    """Whether every use of the gathered tensor is, through reshapes to 2-D, a matmul whose contraction is the
    gathered rows: a weight gradient, ``G.T @ a`` (a the right operand, of ``mm`` or ``addmm``) or ``a.T @ G`` (a
    transposed, left). Fused, it would split those sums over the ranks' rows."""
    stack, gradients = [gathered], 0
    while stack:
        node = stack.pop()
        matrix = (value := fake_value(node)) is not None and value.dim() == 2
        for user in node.users:
            if user.target in RESHAPES:
                stack.append(user)
            elif matrix and (_right_operand_of_mm(user, node) or _transposed_left_operand_of_mms(user)):
                gradients += 1
            else:
                return False
    return gradients > 0


def _right_operand_of_mm(user: Node, node: Node) -> bool:
    """``mm(x, node)`` or ``addmm(c, x, node)`` (inductor folds a tied embedding's gradient into an LM head's weight
    gradient so)."""
    if user.target == MM:
        return user.args[1] is node and user.args[0] is not node
    return user.target == ADDMM and len(user.args) == 3 and user.args[2] is node and node not in user.args[:2]


def _transposed_left_operand_of_mms(user: Node) -> bool:
    return (
        user.target in TRANSPOSES
        and bool(user.users)
        and all(use.target == MM and use.args[0] is user for use in user.users)
    )


def multiplied_later(node: Node) -> bool:
    """Whether a matmul multiplies ``node`` or a tensor computed from it. Being added by one does not count: inductor
    folds a tied embedding's gradient into the LM head's weight gradient as ``addmm(embedding_grad, g, h)``."""
    seen, stack = {node}, [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.target in _MULTIPLIED and current in user.args[_MULTIPLIED[user.target]]:
                return True
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return False


def _scaled_mm_args(node: Node) -> dict:
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def _block_scaled(value: torch.Tensor | None) -> str | None:
    """What block scale a ``_scaled_mm`` scale is (``"MX (float8_e8m0fnu)"``, ``"block"``), or None for the
    tensor-wise and row-wise ones (``[]``, ``[M, 1]``, ``[1, N]``)."""
    if value is None:
        return None
    if value.dtype == torch.float8_e8m0fnu:
        return "MX (float8_e8m0fnu)"
    if value.dim() == 0 or (value.dim() == 2 and any(_provably_equal(size, 1) for size in value.shape)):
        return None
    return "block"


def _block_scales(node: Node, scaled: dict) -> Unfusable | None:
    """Why a ``_scaled_mm`` with block scales is not fused. torch lays them out for the device's kernel (MX scales
    swizzled into 128 x 4 tiles, 1x128 ones outer-dim-major), not in the fused ops' per-row layouts, and
    gathering a swizzled scale by rows is not even defined; torch's own recipes that produce them (torchao's MX
    and blockwise training) run on GPUs this pass has not been measured on."""
    for arg in ("scale_a", "scale_b"):
        kind = _block_scaled(fake_value(scaled[arg]))
        if kind is not None:
            return Unfusable(
                f"_scaled_mm {node.name} has {kind} scales ({arg}), in torch's device layout for block-scaled "
                "matmuls, which the fused ops do not take (they take MX and block scales per row: "
                "fastmesh.fp8.quantize, or fp8=Float8Config(granularity='mx' | 'block1x128') on the fronts)"
            )
    return None


def _scaled_mm_extras(node: Node, scaled: dict) -> Unfusable | None:
    """Why a ``_scaled_mm`` (its arguments by name in ``scaled``) cannot be fused: a bias or scale_result, or
    block scales."""
    if scaled["bias"] is not None or scaled["scale_result"] is not None:
        return Unfusable(f"_scaled_mm {node.name} has a bias or scale_result, which the fused op has not")
    return _block_scales(node, scaled)


def _dtensor_local(node: Node) -> bool:
    """Whether a graph input is a DTensor's local tensor (AOTAutograd's input descriptor says so)."""
    desc = node.meta.get("desc")
    return node.op == "placeholder" and getattr(desc, "attr", None) == "_local_tensor"


def _same_on_every_rank(node: Node, dtensor_locals: bool = False) -> bool:
    """Whether ``node`` is provably replicated: every path up from it ends in an all-reduce's result or in a
    constant (never in a graph input, which each rank gives its own), or with ``dtensor_locals`` in a DTensor's
    local tensor (for what DTensor's own contract makes replicated: :func:`_partial_bias`)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.target == WAIT and current.args[0].target == ALL_REDUCE:
            continue
        if dtensor_locals and _dtensor_local(current):
            continue
        if current.op in ("placeholder", "get_attr"):
            return False
        stack.extend(current.all_input_nodes)
    return True


def _fp8_view(node: Node) -> Node | None:
    """The only user of ``node`` if it reinterprets it as FP8 (gloo gathers FP8 bytes as uint8)."""
    users = list(node.users)
    if len(users) == 1 and users[0].target == DTYPE_VIEW and users[0].args[1] in FP8_DTYPES:
        return users[0]
    return None


def gathered_tensor(collective: Node):
    """``(wait, gathered, gather_dim, layout nodes)`` of an all-gather: the tensor its program uses, after the
    split/cat that moves the rank blocks to ``gather_dim`` and any view as FP8; None if its result is used
    before or besides its wait."""
    users = list(collective.users)
    if len(users) != 1 or users[0].target != WAIT:
        return None
    wait = stacked = users[0]
    layout: list[Node] = []
    view = _fp8_view(stacked)
    if view is not None:
        layout.append(view)
        stacked = view
    blocks = _blocks_moved_from_dim0(stacked, collective.args[1])
    gathered, gather_dim = stacked, 0
    if blocks is not None:
        gathered, gather_dim = blocks.cat, blocks.cat_dim
        layout += blocks.nodes
    view = _fp8_view(gathered)
    if view is not None:
        layout.append(view)
        gathered = view
    return wait, gathered, gather_dim, tuple(layout)


def _scale_gather(scale: Node, shard: Node, gather_dim: int) -> ScaleGather | Unfusable:
    """The all-gather whose result, through reshapes, is the row-wise ``scale`` of a gathered FP8 operand:
    the same group and layout as the data's, gathering a ``[..., 1]`` shard of the data shard's rows."""
    chain: list[Node] = []
    node = scale
    while node.target in RESHAPES:
        chain.append(node)
        node = node.args[0]
    source = node
    while source.target in (aten.cat.default, operator.getitem, aten.split.Tensor) or source.target in RESHAPES:
        source = source.args[0][0] if source.target == aten.cat.default else source.args[0]
    collective = source.args[0] if source.target == WAIT else None
    found = gathered_tensor(collective) if collective is not None and collective.target == ALL_GATHER else None
    if found is None or found[1] is not node or found[2] != gather_dim:
        return Unfusable(
            "the row-wise scale of the gathered FP8 operand is not the all-gather of a scale shard along the same dim"
        )
    wait, gathered, _, layout = found
    scale_shard = collective.args[0]
    want = tuple(fake_value(shard).shape[:-1]) + (1,)
    if fake_value(scale_shard) is None or tuple(fake_value(scale_shard).shape) != want:
        return Unfusable(f"the gathered row-wise scale's shard is not [..., 1] of the data shard's rows {list(want)}")
    return ScaleGather(scale_shard, gathered, tuple(chain), (*reversed(layout), wait, collective))


@dataclasses.dataclass(frozen=True)
class RankBlocks:
    """``cat([split(source, size, split_dim)[r] for r in range(world)], cat_dim)``: how a post-grad graph moves
    the rank blocks c10d stacks along dim 0 to another dim (after an all-gather: ``split_dim == 0``) or from
    another dim (before a reduce-scatter: ``cat_dim == 0``)."""

    source: Node
    cat: Node
    split_dim: int
    cat_dim: int
    equal: bool  # the blocks are ``world`` equal parts of ``source`` along ``split_dim``
    nodes: tuple[Node, ...]  # split, the getitems in rank order, cat


def _dim_arg(node: Node, position: int) -> int:
    """The ``dim`` argument of a split or cat node, given by position or by name (default 0)."""
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)


def _rank_blocks(cat: Node, world: int) -> RankBlocks | None:
    """``cat`` as :class:`RankBlocks` of ``world`` blocks, every block used by ``cat`` alone; else None. The one
    recognizer of the rank-block layout, for both collectives."""
    if cat.target != aten.cat.default:
        return None
    pieces = list(cat.args[0])
    split = pieces[0].args[0] if pieces and pieces[0].target is operator.getitem else None
    if split is None or split.target != aten.split.Tensor or len(pieces) != world or len(split.users) != world:
        return None
    if not all(
        p.target is operator.getitem and p.args[0] is split and p.args[1] == rank and len(p.users) == 1
        for rank, p in enumerate(pieces)
    ):
        return None
    source = split.args[0]
    source_value, cat_value = fake_value(source), fake_value(cat)
    if source_value is None or cat_value is None:
        return None
    split_dim = _dim_arg(split, 2) % source_value.dim()
    equal = _provably_equal(size_value(split.args[1]) * world, source_value.shape[split_dim])
    return RankBlocks(source, cat, split_dim, _dim_arg(cat, 1) % cat_value.dim(), equal, (split, *pieces, cat))


def _blocks_moved_from_dim0(stacked: Node, world: int) -> RankBlocks | None:
    """The rank blocks of ``stacked`` (an all-gather's result, ranks along dim 0) moved to another dim by its
    only user, or None."""
    users = list(stacked.users)
    if len(users) != 1 or users[0].target != aten.split.Tensor or not users[0].users:
        return None
    first_block = next(iter(users[0].users))
    if len(first_block.users) != 1:
        return None
    blocks = _rank_blocks(next(iter(first_block.users)), world)
    return blocks if blocks is not None and blocks.split_dim == 0 and blocks.equal else None


def _consumers_of(gathered: Node) -> tuple[list[Consumer], list[Node], list[Node]]:
    """The matmuls that read ``gathered`` as their left operand, directly or through reshapes ending in a 2-D
    ``[-1, K]`` (K = gathered's last dim: a row-major flatten, whatever the reshapes in between); every other
    user of ``gathered`` or of those reshapes; and the reshapes visited (users before their inputs)."""
    value = fake_value(gathered)
    consumers, others, views = [], [], []

    def as_consumer(user: Node, operand: Node) -> Consumer | None:
        if user.target == MM and user.args[0] is operand and user.args[1] is not operand:
            return Consumer(user, None, user.args[1], None)
        if (
            user.target == ADDMM
            and len(user.args) == 3
            and not user.kwargs
            and user.args[1] is operand
            and user.args[2] is not operand
        ):
            return Consumer(user, None, user.args[2], user.args[0])
        if user.target == SCALED_MM and user.args[0] is operand:
            scaled = _scaled_mm_args(user)
            return Consumer(user, None, scaled["mat2"], scaled["bias"], scaled)
        return None

    def visit(node: Node, view: Node | None) -> None:
        node_value = fake_value(node)
        is_matrix = (
            node_value is not None and node_value.dim() == 2 and _provably_equal(node_value.shape[1], value.shape[-1])
        )
        for user in node.users:
            consumer = as_consumer(user, node) if is_matrix else None
            if consumer is not None:
                consumers.append(dataclasses.replace(consumer, view=view))
            elif user.target in RESHAPES and fake_value(user) is not None:
                views.append(user)
                visit(user, user)
            else:
                others.append(user)

    if value.dim() >= 1:
        visit(gathered, None)
    return consumers, others, views[::-1]


def match_all_gather(collective: Node) -> GatherMatch | ProductGatherMatch | Unfusable | None:
    """An all-gather feeding matmuls (or of a matmul's product), why one is left, or None for one whose gathered
    tensor no matmul multiplies, directly or through other ops (an embedding's gradient), which the pass does not
    list."""
    shard, _, group_name = collective.args[:3]
    found = gathered_tensor(collective)
    if found is None:
        return Unfusable(
            f"the all-gather's result is used before or besides its wait_tensor ({_describe_nodes(collective.users)})"
        )
    wait, gathered, gather_dim, layout_nodes = found
    gathered_value = fake_value(gathered)
    if gathered_value is None or gathered_value.dim() == 0:
        return Unfusable("the gathered tensor has no known shape (or is 0-d)")
    fp8 = gathered_value.dtype in FP8_DTYPES
    if fp8 and fake_value(shard).dtype not in FP8_DTYPES:
        if shard.target != DTYPE_VIEW or fake_value(shard.args[0]).dtype != gathered_value.dtype:
            return Unfusable("the gathered FP8 data is not the all-gather of an FP8 shard (or of its bytes)")
        shard = shard.args[0]
    consumers, others, views = _consumers_of(gathered)
    if not consumers and _weight_gradient_gather(gathered):
        return Unfusable(
            "it gathers a shard kept for backward for weight gradients (matmuls whose contraction is its rows): "
            "left unfused, as fastmesh's own backward leaves it (docs/design/fused-collectives.md, Saved for "
            "backward)",
            by_design=True,
        )
    if not consumers and _matmul_fed(shard):
        return _match_product_gather(collective, wait, shard, gather_dim, group_name, gathered, layout_nodes)
    if not consumers and not multiplied_later(gathered):
        return None  # no matmul multiplies it (an embedding's gradient): none of the pass's business
    if not consumers:
        return Unfusable(
            f"the gathered tensor (gather dim {gather_dim}) feeds no matmul directly or through "
            f"reshapes to 2-D; its users: {_describe_nodes(gathered.users)}"
        )
    if not fp8 and gathered_value.dtype not in MATMUL_DTYPES:
        return Unfusable(
            f"the gathered tensor is {gathered_value.dtype}; the fused ops multiply "
            f"{', '.join(map(str, MATMUL_DTYPES + FP8_DTYPES))}"
        )
    for consumer in consumers:
        b_value = fake_value(consumer.b)
        if b_value is None or (b_value.dtype != gathered_value.dtype and not fp8):
            return Unfusable(
                f"matmul {consumer.matmul.name}: its right operand's dtype differs from the "
                f"gathered tensor's {gathered_value.dtype}"
            )
        if (consumer.scaled is not None) != fp8:
            mismatch = "FP8 data in a plain matmul" if fp8 else "a scaled matmul of high-precision data"
            return Unfusable(f"matmul {consumer.matmul.name}: {mismatch}")
        if any(gathered in _ancestors(arg) for arg in (consumer.b, consumer.bias) if isinstance(arg, Node)):
            return Unfusable(f"matmul {consumer.matmul.name}: its other operands depend on the gathered tensor")
    match = GatherMatch(
        collective,
        wait,
        shard,
        gather_dim,
        group_name,
        gathered,
        layout_nodes,
        tuple(views),
        tuple(consumers),
        return_a=bool(others),
    )
    return _with_scales(match) if fp8 else match


def _match_product_gather(collective, wait, shard, gather_dim, group_name, gathered, layout_nodes):
    """The all-gather of a matmul's product along its columns as a :class:`ProductGatherMatch`, or why not."""
    what = f"the all-gather of a matmul's product (gather dim {gather_dim})"
    shard_value = fake_value(shard)
    if gather_dim != shard_value.dim() - 1:
        return Unfusable(
            f"{what} stacks its rows, not its columns: fastmesh fuses a product's column gather "
            "(matmul_all_gather) or a gather into the matmuls that consume it"
        )
    reshapes, node = [], shard
    while node.target in RESHAPES:
        reshapes.append(node)
        node = node.args[0]
    if node.target != MM:
        return Unfusable(
            f"{what}: the product is {node.name} ({node.target}), not one mm (a bias or a sum of products); "
            "matmul_all_gather fuses a plain matmul"
        )
    if any(len(n.users) != 1 for n in (node, *reshapes)):
        return Unfusable(f"{what}: the product {node.name} has other users than the all-gather")
    product = fake_value(node)
    if product.dtype not in MATMUL_DTYPES or not _provably_equal(shard_value.shape[-1], product.shape[-1]):
        return Unfusable(f"{what}: a {product.dtype} product, or reshaped across its columns")
    return ProductGatherMatch(collective, wait, shard, group_name, gathered, layout_nodes, node, tuple(reshapes))


def _with_scales(match: GatherMatch) -> GatherMatch | Unfusable:
    """The FP8 form: one output dtype and one scale of the gathered operand for every _scaled_mm; a tensor-wise
    scale must be the same on every rank (the fused op dequantizes each rank's rows with that rank's scale, the
    native graph all rows with its own), a row-wise one is the all-gather of the scales, fused too."""
    args = [c.scaled for c in match.consumers]
    for consumer, scaled in zip(match.consumers, args):
        extras = _scaled_mm_extras(consumer.matmul, scaled)
        if extras is not None:
            return extras
    if len({a["out_dtype"] for a in args}) != 1:
        return Unfusable("the _scaled_mm consumers have different out_dtypes (one fused op has one)")
    scale = args[0]["scale_a"]
    if any(a["scale_a"] is not scale for a in args):
        return Unfusable("the _scaled_mm consumers scale the gathered operand with different scale_a")
    scale_value = fake_value(scale)
    out_dtype = args[0]["out_dtype"] or fake_value(match.gathered).dtype
    if scale_value is not None and scale_value.dim() == 0:
        if not _same_on_every_rank(scale):
            return Unfusable(
                "the tensor-wise scale_a is not provably the same on every rank (derive it from an "
                "all-reduced amax, or use row-wise scales)"
            )
        return dataclasses.replace(match, a_scale=scale, out_dtype=out_dtype)
    scale_gather = _scale_gather(scale, match.shard, match.gather_dim)
    if isinstance(scale_gather, Unfusable):
        return scale_gather
    # Users of the gathered scales other than the matmuls (through the reshapes to scale_a) need them returned.
    reshapes = set(scale_gather.reshapes)
    matmuls = {c.matmul for c in match.consumers}
    scale_others = [
        u for n in reshapes | {scale_gather.gathered} for u in n.users if u not in reshapes and u not in matmuls
    ]
    return dataclasses.replace(
        match,
        a_scale=scale_gather.shard,
        scale_gather=scale_gather,
        out_dtype=out_dtype,
        return_a=match.return_a or bool(scale_others),
    )


def _partial_bias(term: Node, product: Node, reduce_op: str, world: int) -> PartialBias | Unfusable:
    """``term`` (a bias added to the matmul ``product`` before the reduction over ``world`` ranks) as a
    :class:`PartialBias`, or why it is not one.

    Adding ``bias`` once after the reduction equals the native graph exactly when the ranks' terms sum to it:
    ``sum_r (p_r + bias / W) = sum_r p_r + bias`` (up to rounding) for a ``bias`` that is the same on every
    rank. That is the form DTensor gives a replicated tensor it makes partial: Replicate -> Partial("sum")
    divides by the mesh size (``Partial._partition_value``), and DTensor does so only to a tensor it holds as
    Replicate. So the pass asks for exactly that: a sum over the group, a division by the group size, and a
    bias that comes from DTensors' local tensors or all-reduced values (a plain graph input may differ per
    rank, and the native graph would then add the ranks' mean). The bias must broadcast over the product's
    rows (a ``[N]`` bias), so that it is the same for every rank's block of a reduce-scatter."""
    why = f"{term.name} is a bias added before the reduction, summed over ranks"
    if reduce_op != "sum":
        return Unfusable(f"{why} with reduce op {reduce_op!r}; the pass moves a bias after a sum only")
    if term.target not in (aten.div.Tensor, aten.div.Scalar) or len(term.args) != 2 or term.kwargs:
        return Unfusable(f"{why}: not DTensor's partial form of a replicated bias (divided by the group size)")
    bias, divisor = term.args
    if isinstance(divisor, Node) or divisor != world or not isinstance(bias, Node):
        return Unfusable(f"{why}: not DTensor's partial form of a replicated bias (divided by the group size)")
    bias_value, product_value = fake_value(bias), fake_value(product)
    if (
        bias_value is None
        or product_value is None
        or bias_value.dim() == 0
        or any(not _provably_equal(size, 1) for size in bias_value.shape[:-1])
        or not _provably_equal(bias_value.shape[-1], product_value.shape[-1])
    ):
        return Unfusable(f"{why}: it does not broadcast over the product's rows as one [N] bias")
    if not _same_on_every_rank(bias, dtensor_locals=True):
        return Unfusable(f"{why}: {bias.name} is not provably the same on every rank (not a DTensor's)")
    return PartialBias(term, bias)


def _strip_reshapes(node: Node, chain: list[Node]) -> Node:
    while node.target in RESHAPES and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node


@dataclasses.dataclass
class _Reduction:
    """What the matmuls feeding a reduction must satisfy, and what :func:`_product_terms` collects."""

    reduce_op: str
    world: int
    chain: list[Node]  # every node between the matmuls and the collective
    biases: list[PartialBias] = dataclasses.field(default_factory=list)


def _broadcasts(node: Node) -> bool:
    """An ``add`` whose operands have different shapes."""
    shapes = [tuple(fake_value(arg).shape) if fake_value(arg) is not None else None for arg in node.args]
    return shapes[0] != shapes[1] or None in shapes


def _broadcasts_into(operand: Node, result: Node) -> bool:
    """Whether ``operand`` has another shape than ``result`` (it is broadcast into it)."""
    value = fake_value(operand)
    return value is None or tuple(value.shape) != tuple(fake_value(result).shape)


def _product_terms(product: Node, reduction: _Reduction) -> list[Node] | Unfusable:
    """The mm / addmm / _scaled_mm nodes that sum (through reshapes that keep the last dim) to ``product``,
    and the partial biases added on the way (to ``reduction.biases``); every node on the way must have no
    other user, or the matmul would have to run anyway."""
    chain = reduction.chain
    value = fake_value(product)
    node = _strip_reshapes(product, chain)
    if node.target == aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        if node is not product and len(node.users) != 1:
            return Unfusable(f"the sum {node.name} feeding the reduction has other users")
        if not all(isinstance(arg, Node) for arg in node.args):
            return Unfusable(f"the sum {node.name} feeding the reduction adds a scalar")
        chain.append(node)
        products = list(node.args)
        if _broadcasts(node):  # a matmul plus a bias broadcast over its rows
            bias = _partial_bias(node.args[1], node, reduction.reduce_op, reduction.world)
            if isinstance(bias, Unfusable):
                return bias
            reduction.biases.append(bias)
            products = [node.args[0]]
        found_terms = []
        for arg in products:
            found = _product_terms(arg, reduction)
            if isinstance(found, Unfusable):
                return found
            found_terms += found
        return found_terms
    if node.target not in (MM, ADDMM, SCALED_MM):
        return Unfusable(f"the reduction's input is not a matmul or a sum of matmuls: {_describe_nodes([node])}")
    more_terms = []
    if node.target == ADDMM:
        if len(node.args) != 3 or node.kwargs:
            return Unfusable(f"the addmm {node.name} scales its terms (beta / alpha)")
        added = node.args[0]
        if isinstance(added, Node) and not _broadcasts_into(added, node):
            # Inductor folds ``mm + mm`` into ``addmm(mm, ...)``: one more term of a sum of matmuls.
            if len(added.users) != 1:
                return Unfusable(f"the term {added.name} added by the addmm {node.name} has other users")
            more_terms = [added]
        else:
            bias = _partial_bias(added, node, reduction.reduce_op, reduction.world)
            if isinstance(bias, Unfusable):
                return bias
            reduction.biases.append(bias)
    if node.target == SCALED_MM:
        scaled = _scaled_mm_args(node)
        if scaled["scale_result"] is not None:
            return Unfusable(f"_scaled_mm {node.name} has a scale_result, which the fused op has not")
        blocked = _block_scales(node, scaled)
        if blocked is not None:
            return blocked
        if scaled["bias"] is not None:
            bias = _partial_bias(scaled["bias"], node, reduction.reduce_op, reduction.world)
            if isinstance(bias, Unfusable):
                return bias
            reduction.biases.append(bias)
    if node is not product and len(node.users) != 1:
        return Unfusable(f"the matmul {node.name} feeding the reduction has other users")
    out = fake_value(node)
    if node.target != SCALED_MM and (
        value is None or out is None or not _provably_equal(out.shape[-1], value.shape[-1])
    ):
        return Unfusable(f"a reshape between the matmul {node.name} and the reduction changes the last dim")
    chain.append(node)  # before the terms it adds: the chain lists users first
    terms = [node]
    for added in more_terms:
        found = _product_terms(added, reduction)
        if isinstance(found, Unfusable):
            return found
        terms += found
    return terms


def _shape_args(product: Node, chain: list[Node]) -> list | None:
    """``product``'s shape as reshape arguments: plain ints, or the size arguments of a reshape in the chain
    that produces that shape (dynamic shapes: their size nodes already exist in the graph)."""
    value = fake_value(product)
    if all(isinstance(size, int) for size in value.shape):
        return list(value.shape)
    for node in chain:
        if node.target in RESHAPES and tuple(fake_value(node).shape) == tuple(value.shape):
            shape = list(node.args[1])
            if all(
                _provably_equal(size_value(arg), size) for arg, size in zip(shape, value.shape) if size_value(arg) != -1
            ):
                return shape
    return None


def _wait_of(collective: Node) -> Node | Unfusable:
    """The only wait_tensor of a reducing collective (whose result may also be saved for backward)."""
    users = list(collective.users)
    waits = [u for u in users if u.target == WAIT]
    if len(waits) != 1 or any(u.op != "output" for u in users if u is not waits[0]):
        return Unfusable(f"its result is used before or besides its wait_tensor ({_describe_nodes(users)})")
    return waits[0]


def _match_reduction(collective, wait, product, scatter_dim, reduce_op, world, group_name, chain):
    """The matmul terms and partial biases whose reduction ``collective`` is (a ScatterMatch; scatter_dim None
    for an all-reduce), or why it is left."""
    if reduce_op not in REDUCE_OPS:
        return Unfusable(f"reduce op {reduce_op!r}: the fused op reduces with {REDUCE_OPS}")
    if len(product.users) != 1:
        return Unfusable(f"the reduced tensor {product.name} has other users")
    reduction = _Reduction(reduce_op, world, chain)
    terms = _product_terms(product, reduction)
    if isinstance(terms, Unfusable):
        return terms
    scaled = _scaled_mm_args(terms[0]) if terms[0].target == SCALED_MM else None
    if scaled is not None and len(terms) > 1:
        return Unfusable("a sum of scaled matmuls: the fused op multiplies one pair of FP8 operands")
    operands = [matmul_operands(t) for t in terms]
    dtypes = {fake_value(operand).dtype for pair in operands for operand in pair}
    if scaled is not None and not dtypes <= set(FP8_DTYPES):
        return Unfusable(f"the scaled matmul's operands are {sorted(map(str, dtypes))}, not FP8")
    if scaled is None and (len(dtypes) != 1 or not dtypes <= set(MATMUL_DTYPES)):
        return Unfusable(
            f"the matmul operands are {sorted(map(str, dtypes))}; the fused op multiplies one of "
            f"{', '.join(map(str, MATMUL_DTYPES))}"
        )
    if len(terms) > 1 and not all(isinstance(fake_value(a).shape[1], int) for a, _ in operands):
        return Unfusable("a sum of matmuls with a symbolic contraction size")
    shape_args = _shape_args(product, chain)
    if shape_args is None:
        return Unfusable("the reduced tensor's symbolic shape is not available as reshape arguments")
    if reduction.biases and scatter_dim is not None and scatter_dim % len(shape_args) == len(shape_args) - 1:
        return Unfusable(
            f"a bias ({reduction.biases[0].term.name}) before a reduce-scatter along the last dim: each rank "
            "would add its own block of it"
        )
    return ScatterMatch(
        collective,
        wait,
        reduce_op,
        scatter_dim,
        group_name,
        product,
        tuple(terms),
        shape_args,
        tuple(chain),
        scaled,
        tuple(reduction.biases),
    )


def match_reduce_scatter(collective: Node) -> ScatterMatch | Unfusable | None:
    """A reduce-scatter of matmul products, why one is left, or None for one that no matmul feeds (an
    embedding's lookup), which the pass does not list."""
    scattered, reduce_op, world, group_name = collective.args[:4]
    if not any(node.target in _MULTIPLIED for node in (scattered, *_ancestors(scattered))):
        return None
    wait = _wait_of(collective)
    if isinstance(wait, Unfusable):
        return wait
    chain: list[Node] = []
    product, scatter_dim = scattered, 0
    blocks = _rank_blocks(scattered, world) if len(scattered.users) == 1 else None
    if blocks is not None and blocks.cat_dim == 0:
        if not blocks.equal:
            return Unfusable(f"the reduce-scatter's blocks along dim {blocks.split_dim} are not {world} equal splits")
        product, scatter_dim = blocks.source, blocks.split_dim
        chain += reversed(blocks.nodes)
    return _match_reduction(collective, wait, product, scatter_dim, reduce_op, world, group_name, chain)


def _matmul_fed(node: Node) -> bool:
    """Whether ``node`` is, through reshapes and adds, a matmul's product."""
    while node.target in RESHAPES:
        node = node.args[0]
    if node.target == aten.add.Tensor:
        return any(isinstance(arg, Node) and _matmul_fed(arg) for arg in node.args)
    return node.target in (MM, ADDMM, SCALED_MM)


def match_all_reduce(collective: Node) -> ScatterMatch | Unfusable | None:
    """An all-reduce of matmul products (a ScatterMatch with ``scatter_dim`` None), why one is left, or None
    for an all-reduce of anything else (an amax, a loss, an embedding's lookup), which the pass does not
    list: it is no matmul's collective."""
    reduced, reduce_op, group_name = collective.args[:3]
    if not _matmul_fed(reduced):
        return None
    wait = _wait_of(collective)
    if isinstance(wait, Unfusable):
        return wait
    world = _resolve_process_group(group_name).size()
    return _match_reduction(collective, wait, reduced, None, reduce_op, world, group_name, [])

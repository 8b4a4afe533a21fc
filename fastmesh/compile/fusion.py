"""The opt-in inductor pass that turns native TP graphs into fastmesh's fused ops, and its report.

:func:`enable_fusion` installs :class:`FusionPass` as ``torch._inductor.config.post_grad_custom_post_pass``.
Inductor calls it once for every graph it compiles (the forward and the backward of each compiled region).
For every ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_reduce`` of a matmul in the graph (one a
matmul feeds or, for a gather, whose result a matmul multiplies; others are not listed) it
either rewrites the pattern into a fastmesh fused op (``all_gather_matmul`` / ``matmul_reduce_scatter`` /
``matmul_all_reduce`` or the FP8 forms) and logs it (INFO on the ``fastmesh.compile`` logger), or leaves it and
logs why (WARNING; INFO when it would not pay). Both end up in :func:`fusion_report`.
With ``strict=True`` a collective it leaves fails the compile with a :class:`FusionError` naming it.

Precedence with torch's own async TP (``torch._inductor.config._micro_pipeline_tp = True``): inductor runs
torch's pass before every custom post pass, so torch rewrites first what it can (CUDA groups with symmetric
memory enabled) and fastmesh fuses what torch left. The report lists torch's fused ops as fused by torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
from collections.abc import Callable

from torch._inductor import config as inductor_config
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from fastmesh.compile import patterns, profit, rewrite
from fastmesh.compile.saved_shards import SavedShards
from fastmesh.ops import backward_gathers, plans
from fastmesh.ops._inductor_pass import ChainedPass

logger = logging.getLogger("fastmesh.compile")

_TORCH_FUSED_PREFIX = "symm_mem.fused_"


class FusionError(RuntimeError):
    """``enable_fusion(strict=True)`` met a collective it could not fuse."""


@dataclasses.dataclass(frozen=True)
class FusionEntry:
    """One collective of one compiled graph: what became of it.

    Attributes:
        graph: the graph's index in the order the pass saw graphs (since the report was last reset).
        graph_kind: ``"forward"``, ``"backward"`` or ``"inference"``.
        collective: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        node: the collective's node name in that graph.
        fused_into: the op it became (``"fastmesh.all_gather_matmul"``, ``"fastmesh.matmul_reduce_scatter"``,
            ``"fastmesh.matmul_all_reduce"``, ``"fastmesh.matmul_all_gather"``, ..., or a
            ``"torch.symm_mem.fused_*"`` op when torch's ``_micro_pipeline_tp`` took it), None if left.
        matmuls: the number of matmuls fused with it.
        detail: the fused call's arguments, or why the collective was left.
        unprofitable: left because the fused op's plan for these shapes is the unfused sequence
            (``detail`` gives the plan and its figures), or because its matmul went into the fused op of
            another collective that moves more (a gathered input and a gathered product of one matmul);
            ``strict=True`` does not fail on these.
        by_design: left on purpose: the backward's gather of a shard kept in place of the gathered input, for
            weight gradients (``docs/design/fused-collectives.md``, "Saved for backward"); nor on these.
    """

    graph: int
    graph_kind: str
    collective: str
    node: str
    fused_into: str | None
    matmuls: int
    detail: str
    unprofitable: bool = False
    by_design: bool = False

    @property
    def expected(self) -> bool:
        """Fused, or left as planned (not profitable, or by design): what ``strict=True`` accepts."""
        return self.fused or self.unprofitable or self.by_design

    @property
    def fused(self) -> bool:
        return self.fused_into is not None


@dataclasses.dataclass(frozen=True)
class FusionReport:
    """What the pass did, graph by graph. ``str(report)`` is a table."""

    graphs: tuple[str, ...]  # each graph's kind, by index
    entries: tuple[FusionEntry, ...]

    @property
    def fused(self) -> list[FusionEntry]:
        return [e for e in self.entries if e.fused]

    @property
    def unfused(self) -> list[FusionEntry]:
        return [e for e in self.entries if not e.fused]

    def count(self, fused_into: str, graph_kind: str | None = None) -> int:
        """How many collectives became ``fused_into`` (in graphs of ``graph_kind``, or in all)."""
        return sum(e.fused_into == fused_into and graph_kind in (None, e.graph_kind) for e in self.entries)

    def __str__(self) -> str:
        if not self.graphs:
            return (
                "fastmesh fusion: no graph compiled with the pass since the report was reset (graphs served "
                "from inductor's caches do not run it)"
            )
        lines = [
            f"fastmesh fusion: {len(self.graphs)} graph(s), {len(self.fused)} collective(s) fused, "
            f"{len(self.unfused)} left"
        ]
        for e in self.entries:
            outcome = (
                f"-> {e.fused_into} ({e.matmuls} matmul{'s' * (e.matmuls != 1)})"
                if e.fused
                else "left (not profitable)"
                if e.unprofitable
                else "left (by design)"
                if e.by_design
                else "left"
            )
            lines.append(f"  graph {e.graph} ({e.graph_kind}) {e.collective} {e.node} {outcome}: {e.detail}")
        return "\n".join(lines)


class _Recorder:
    """The report's state; inductor may compile graphs on several threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._graphs: list[str] = []
        self._entries: list[FusionEntry] = []

    def new_graph(self, kind: str) -> int:
        with self._lock:
            self._graphs.append(kind)
            return len(self._graphs) - 1

    def add(self, entries: list[FusionEntry]) -> None:
        with self._lock:
            self._entries += entries

    def snapshot(self, reset: bool) -> FusionReport:
        with self._lock:
            report = FusionReport(tuple(self._graphs), tuple(self._entries))
            if reset:
                self._graphs.clear()
                self._entries.clear()
            return report


_recorder = _Recorder()


def _graph_kind(graph: Graph) -> str:
    # AOTAutograd names the backward graph's incoming gradients tangents_*; an inference graph has
    # neither tangents nor the primals_* of a training forward.
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(name.startswith("tangents") for name in names):
        return "backward"
    return "forward" if any(name.startswith("primals") for name in names) else "inference"


def _torch_fused_op_name(node: Node) -> str | None:
    name = str(node.target) if node.op == "call_function" else ""
    return f"torch.{name.split('.default')[0]}" if name.startswith(_TORCH_FUSED_PREFIX) else None


def _gather_detail(match) -> str:
    if isinstance(match, patterns.ProductGatherMatch):
        return f"the product's columns gathered, group={match.group_name}"
    detail = f"gather_dim={match.gather_dim}, group={match.group_name}, return_a={match.return_a}"
    if match.scale_gather is not None:
        detail += f", with the row-wise scales' all-gather {match.scale_gather.collective.name}"
    elif match.a_scale is not None:
        detail += ", tensor-wise scale (replicated)"
    return detail


def _scatter_detail(match: patterns.ScatterMatch) -> str:
    detail = f"reduce_op={match.reduce_op}, group={match.group_name}"
    if match.scatter_dim is not None:
        detail = f"scatter_dim={match.scatter_dim}, {detail}"
    if match.biases:
        detail += f", + the replicated bias {', '.join(b.bias.name for b in match.biases)} once after"
    return detail


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How the pass treats one kind of collective."""

    collective: str  # its name in the report
    target: object  # its node target
    match: Callable  # node -> a match, an Unfusable, or None: no matmul's (fastmesh.compile.patterns)
    fuse: Callable  # (graph, match) -> the fused node or an Unfusable (fastmesh.compile.rewrite)
    matmuls: Callable  # match -> how many matmuls the fused op takes in
    detail: Callable  # match -> the fused call's arguments, for the report


_RULES = (
    _Rule(
        "all_gather",
        patterns.ALL_GATHER,
        patterns.match_all_gather,
        rewrite.fuse_gather,
        lambda m: len(_matmuls(m)),
        _gather_detail,
    ),
    _Rule(
        "reduce_scatter",
        patterns.REDUCE_SCATTER,
        patterns.match_reduce_scatter,
        rewrite.fuse_reduce_scatter,
        lambda m: len(m.terms),
        _scatter_detail,
    ),
    _Rule(
        "all_reduce",
        patterns.ALL_REDUCE,
        patterns.match_all_reduce,
        rewrite.fuse_all_reduce,
        lambda m: len(m.terms),
        _scatter_detail,
    ),
)


def _matmuls(match) -> list[Node]:
    """The matmul nodes a match's fused op takes in."""
    if isinstance(match, patterns.GatherMatch):
        return [c.matmul for c in match.consumers]
    if isinstance(match, patterns.ProductGatherMatch):
        return [match.matmul]
    return list(match.terms)


def _transfer_elements(match) -> int:
    """Elements one rank sends for a gather match (0 for an Unfusable): which of two gathers of one matmul to fuse.
    Symbolic sizes count by their hint, the size the graph was traced with (0 without one)."""
    if isinstance(match, patterns.Unfusable):
        return 0
    numel = patterns.fake_value(match.shard).numel()
    if isinstance(numel, int):
        return numel
    hint = numel.node.hint
    return hint if isinstance(hint, int) else 0


def _op_name(node: Node) -> str:
    return str(node.target).removesuffix(".default")


def _torch_fused_entries(graph: Graph, index: int, kind: str) -> list[FusionEntry]:
    """The collectives torch's ``_micro_pipeline_tp`` (which runs first) already fused."""
    entries = []
    for node in graph.nodes:
        torch_op = _torch_fused_op_name(node)
        if torch_op is not None:
            collective = "all_gather" if "all_gather" in torch_op else "reduce_scatter"
            detail = "fused by torch's _micro_pipeline_tp, which runs first"
            entries.append(FusionEntry(index, kind, collective, node.name, torch_op, 1, detail))
    return entries


def _fuse_collectives(graph: Graph, rule: _Rule, index: int, kind: str) -> list[FusionEntry]:
    """Fuse every collective of ``rule``'s kind that matches and pays; an entry for each, in graph order."""
    entry = functools.partial(FusionEntry, index, kind, rule.collective)
    # Match everything first: an FP8 gather carries its scales' gather, which must not be reported as left.
    # A rule's match gives None for a collective that is none of its business (an all-reduce of no matmul).
    found = [(node.name, rule.match(node)) for node in graph.nodes if node.target == rule.target]
    found = [(name, match) for name, match in found if match is not None]
    outcomes: dict[str, FusionEntry] = {}
    carried: dict[str, str] = {}  # a row-wise scales' gather -> the gather whose fused op carries it
    # A matmul whose input and product are both gathered (the LM head under sequence parallelism) goes into one
    # fused op: the one that overlaps the larger transfer, so larger transfers are fused first.
    taken: dict[Node, str] = {}  # matmul -> the collective whose fused op took it in
    by_size = sorted(found, key=lambda item: -_transfer_elements(item[1])) if rule.collective == "all_gather" else found
    for name, match in by_size:
        if isinstance(match, patterns.Unfusable):
            continue
        other = next((taken[m] for m in _matmuls(match) if m in taken), None)
        if other is not None:
            detail = f"its matmul is fused with {other} instead, which moves more data"
            outcomes[name] = entry(name, None, 0, detail, unprofitable=True)
            continue
        scale_gather = getattr(match, "scale_gather", None)
        reason = profit.unprofitable(match)
        if reason is not None:
            outcomes[name] = entry(name, None, 0, reason, unprofitable=True)
            if scale_gather is not None:
                scales = scale_gather.collective.name
                left = f"the row-wise scales of {name}, left with it"
                outcomes[scales] = entry(scales, None, 0, left, unprofitable=True)
            continue
        fused = rule.fuse(graph, match)
        if isinstance(fused, patterns.Unfusable):
            outcomes[name] = entry(name, None, 0, fused.reason)
            continue
        outcomes[name] = entry(name, _op_name(fused), rule.matmuls(match), f"{fused.name}: {rule.detail(match)}")
        taken.update((m, name) for m in _matmuls(match))
        if scale_gather is not None:
            carried[scale_gather.collective.name] = name
    for name, match in found:
        if name in outcomes and outcomes[name].unprofitable:
            continue
        if name in carried:
            data = carried[name]
            detail = f"the row-wise scales of {data}, carried by its fused op"
            outcomes[name] = entry(name, outcomes[data].fused_into, 0, detail)
        elif name not in outcomes:
            outcomes[name] = entry(name, None, 0, match.reason, by_design=match.by_design)
    return [outcomes[name] for name, _ in found]


def fuse_graph(graph: Graph, strict: bool = False) -> FusionReport:
    """Run the fusion on one post-grad graph, in place; returns this graph's part of the report (also added
    to :func:`fusion_report`'s). Raises :class:`FusionError` if ``strict`` and a collective is left."""
    kind = _graph_kind(graph)
    index = _recorder.new_graph(kind)
    rewrite.merge_repeated_waits(graph)
    entries = _torch_fused_entries(graph, index, kind)
    for rule in _RULES:
        entries += _fuse_collectives(graph, rule, index, kind)
    stable_topological_sort(graph)
    graph.lint()
    _recorder.add(entries)

    report = FusionReport((kind,), tuple(entries))
    for e in report.fused:
        logger.info(
            "graph %d (%s): %s %s -> %s with %d matmul(s): %s",
            index,
            kind,
            e.collective,
            e.node,
            e.fused_into,
            e.matmuls,
            e.detail,
        )
    for e in report.unfused:
        log = logger.info if e.expected else logger.warning
        log("graph %d (%s): %s %s left unfused: %s", index, kind, e.collective, e.node, e.detail)
    cannot = [e for e in report.entries if not e.expected]
    if strict and cannot:
        left = "; ".join(f"{e.collective} {e.node}: {e.detail}" for e in cannot)
        raise FusionError(
            f"fastmesh fusion (strict=True): graph {index} ({kind}) has collectives the pass cannot fuse: {left}"
        )
    return report


_OPS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "ops")
# The pass's decisions also depend on the planner: its code, its mode and the cached plans (see uuid()).
_SOURCES = tuple(
    os.path.join(os.path.dirname(__file__), name) for name in ("fusion.py", "patterns.py", "profit.py", "rewrite.py")
) + tuple(os.path.join(_OPS, name) for name in ("plans.py", "plan_model.py"))


class FusionPass(ChainedPass):
    """The post-grad pass :func:`enable_fusion` installs. It runs the pass that was installed before it (if
    any) after its own, and gives inductor's caches a key that covers its source and settings."""

    sources = _SOURCES

    def __init__(self, strict: bool, previous=None):
        super().__init__(previous)
        self.strict = strict

    def run(self, graph: Graph) -> None:
        fuse_graph(graph, self.strict)

    def settings_key(self) -> str:
        cached = json.dumps(plans.cache().entries(), sort_keys=True)
        return f"strict={self.strict};tune={plans.mode()};{cached}"


def _check_options(strict, keep_gathered) -> None:
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if not isinstance(keep_gathered, bool):
        raise TypeError(f"keep_gathered must be a bool, got {type(keep_gathered).__name__}")


def _joint_passes(keep_gathered: bool, current):
    """The joint post pass the fusion needs on top of ``current`` (without a SavedShards of its own): the backward's
    gathers kept in backward (:mod:`fastmesh.ops.backward_gathers`) and, unless ``keep_gathered``, the native plan's
    gathered inputs kept as shards (:mod:`fastmesh.compile.saved_shards`)."""
    joint = current if backward_gathers.installed(current) else backward_gathers.BackwardGathers(current)
    return joint if keep_gathered else SavedShards(joint)


def enable_fusion(strict: bool = False, keep_gathered: bool = False) -> None:
    """Install the fusion pass for every graph inductor compiles from now on (``torch.compile`` with the
    default ``"inductor"`` backend). Graphs already compiled keep their code: call ``torch._dynamo.reset()``
    to recompile them. Calling it again changes the options; custom passes installed before are kept and run after
    fastmesh's.

    Args:
        strict: raise :class:`FusionError` (failing the compile) when a graph has a collective of a matmul the
            pass cannot fuse (not one it leaves as unprofitable or by design), naming it and the reason, instead
            of logging a warning. Collectives of no matmul (an embedding's, a loss's) are not the pass's.
        keep_gathered: keep the native plan's gathered inputs for backward, as torch does, instead of their shards
            (default: the shards, gathered again in backward; :mod:`fastmesh.compile.saved_shards`). Installed as
            inductor's ``joint_custom_post_pass``.
    """
    _check_options(strict, keep_gathered)
    disable_fusion()
    inductor_config.post_grad_custom_post_pass = FusionPass(strict, inductor_config.post_grad_custom_post_pass)
    inductor_config.joint_custom_post_pass = _joint_passes(keep_gathered, inductor_config.joint_custom_post_pass)


def fusion_options(strict: bool = False, keep_gathered: bool = False) -> dict:
    """The fusion as inductor options for one compile, ``torch.compile(model, options=fusion_options())``: what
    :func:`enable_fusion` installs for every compile (the same arguments), for this one alone. Replaces any
    custom post-grad and joint post passes for that compile."""
    _check_options(strict, keep_gathered)
    return {
        "post_grad_custom_post_pass": FusionPass(strict),
        "joint_custom_post_pass": _joint_passes(keep_gathered, None),
    }


def disable_fusion() -> None:
    """Uninstall the pass (restoring the custom passes that were there before :func:`enable_fusion`)."""
    current = inductor_config.post_grad_custom_post_pass
    if isinstance(current, FusionPass):
        inductor_config.post_grad_custom_post_pass = current.previous
    if isinstance(inductor_config.joint_custom_post_pass, SavedShards):
        inductor_config.joint_custom_post_pass = inductor_config.joint_custom_post_pass.previous


def fusion_enabled() -> bool:
    return isinstance(inductor_config.post_grad_custom_post_pass, FusionPass)


def fusion_report(reset: bool = False) -> FusionReport:
    """What the pass fused and what it left, and why, for every graph it ran on in this process since the
    last reset. Graphs that inductor served from its caches did not run the pass and are not in it.

    Args:
        reset: clear the record after taking this report.
    """
    return _recorder.snapshot(reset)

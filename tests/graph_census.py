"""What inductor's compiled graphs hold: fastmesh's ops and torch's functional collectives, counted per graph.

A test that compares compiled values with eager ones passes whichever path ran: a fused op that fell back to
torch's collectives, or a fusion rewrite silently dropped, computes the same values. These counts say which path
ran::

    with graph_census() as census:
        torch.compile(fn, fullgraph=True)(x).sum().backward()
    assert census.total("fastmesh.all_gather_matmul") == 1 and census.total("native.all_gather_into_tensor") == 0

Names are ``fastmesh.<op>`` for fastmesh's ops and ``native.<op>`` for ``_c10d_functional``'s collectives
(``wait_tensor`` left out: it pairs with one of them). Inductor's graph caches are off inside the block, since a
graph served from a cache runs no post-grad pass.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config

_NAMESPACES = {"fastmesh": "fastmesh", "_c10d_functional": "native"}


def ops_in(graph: torch.fx.Graph) -> collections.Counter:
    """fastmesh's ops and torch's functional collectives in ``graph``, by name."""
    counts = collections.Counter()
    for node in graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in _NAMESPACES:
            name = node.target._opname
            if name != "wait_tensor":
                counts[f"{_NAMESPACES[node.target.namespace]}.{name}"] += 1
    return counts


def graph_kind(graph: torch.fx.Graph) -> str:
    """ "backward" for an AOTAutograd backward graph (it takes tangents), else "forward"."""
    tangents = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
    return "backward" if tangents else "forward"


class GraphCensus:
    """A post-grad pass that records each graph's kind and ops; ``graphs``: (kind, Counter), in compile order;
    ``gather_bs``: (kind, how many ``bs``) of each ``fastmesh.all_gather_matmul``, one gather's multiplies."""

    def __init__(self):
        self.graphs: list[tuple[str, collections.Counter]] = []
        self.gather_bs: list[tuple[str, int]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        kind = graph_kind(graph)
        self.graphs.append((kind, ops_in(graph)))
        gathers = graph.find_nodes(op="call_function", target=torch.ops.fastmesh.all_gather_matmul.default)
        self.gather_bs += [(kind, len(node.args[1])) for node in gathers]

    def total(self, name: str, kind: str | None = None) -> int:
        """How many ``name`` ops the graphs (of ``kind``, or all) hold."""
        return sum(ops[name] for k, ops in self.graphs if kind in (None, k))

    def native_collectives(self) -> int:
        return sum(n for _, ops in self.graphs for name, n in ops.items() if name.startswith("native."))


@contextlib.contextmanager
def graph_census(before: GraphCensus | None = None):
    """Yield a :class:`GraphCensus` of the graphs inductor compiles in the block, taken after every post-grad
    pass installed when the block starts (a pass installed inside the block, e.g. ``fastmesh.compile``'s, which
    keeps and calls the previous one, runs before it); ``before``, if given, records the same graphs before any
    post-grad pass. Inductor's caches are off in the block."""
    census = GraphCensus()
    with (
        inductor_config.patch(
            post_grad_custom_post_pass=census,
            post_grad_custom_pre_pass=before,
            fx_graph_cache=False,
        ),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield census


# How the op compile tests run each op: aot_eager (the op's fake impl and autograd; no post-grad pass, so no
# census), inductor under the planner's model (these tests' tiny shapes plan unfused, so the op traces as
# torch's collectives) and inductor under the fixed rule (FASTMESH_TUNE=off: the fused op itself in the graph).
COMPILE_MODES = (("aot_eager", "model"), ("inductor", "model"), ("inductor", "off"))


def assert_compiled_path(census: GraphCensus, tune: str, fused_ops: tuple[str, ...], natives: int = 0) -> None:
    """The graphs of an op compile test took the path ``tune`` decides: under "off" each of ``fused_ops`` (e.g.
    "fastmesh.matmul_all_reduce") and ``natives`` native collectives (those no fused op takes by design); under
    "model" (tiny shapes: unfused) torch's collectives and none of ``fused_ops``."""
    assert census.graphs, "no graph was compiled inside the census"
    found = {name: census.total(name) for name in fused_ops}
    if tune == "off":
        assert all(found.values()) and census.native_collectives() == natives, (tune, census.graphs)
    else:
        assert not any(found.values()) and census.native_collectives() > 0, (tune, census.graphs)

"""The opt-in fusion pass (``fastmesh.compile``) on native TP graphs, 2 gloo ranks, inductor.

* torch's native sequence-parallel plan on a Llama block: the compiled forward and backward graphs hold the
  expected fastmesh ops and no native all-gather / reduce-scatter (q/k/v in one call with three ``bs``), and
  give the outputs and gradients of the same compile without the pass; with activation checkpointing, with
  a dynamic sequence length (one graph, no recompile).
* torch's own test Transformer under its sequence-parallel and its plain TP plan: every matmul collective fused
  (biases added after the reduction; the LM head's output columns gathered by matmul_all_gather), loss and
  gradients equal eager.
* A biased RowwiseParallel (Shard(0), Shard(1), Replicate() output): DTensor's partial bias moved after the
  fused reduce-scatter / all-reduce, outputs and gradients equal eager, in strict mode.
* Each supported pattern alone (gather dims 0 / 1 / last, addmm, several matmuls plus another use of the
  gathered tensor; scatter dims 0 / 1 / last, sum and avg, a sum of matmuls; all-reduces; partial biases as
  mm + bias and as _scaled_mm's bias) in strict mode, against eager.
* Patterns it must leave: the report and the warning give the reason; ``strict=True`` fails the compile
  naming the collective.
* torch's ``_micro_pipeline_tp`` enabled too; the pass installer's bookkeeping.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from environment import environment
from graph_census import GraphCensus, graph_census
from rank_pool import on_ranks
from torch._inductor import config as inductor_config
from torch_support import NEEDS_ROWWISE_ON_CPU, ROWWISE_ON_CPU

import fastmesh.compile
from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables

# The fused ops sum in a different order than the unfused graph (pieces; one matmul for a sum of matmuls):
# measured differences ~1e-6 on outputs and gradients of order 1; a wrong block or a lost term is O(1) off.
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


@contextlib.contextmanager
def _fusion(strict=False, tune="off"):
    """The pass installed, a fresh report, inductor's caches off (a graph served from a cache does not run the
    pass); yields the census of the final graphs (tests/graph_census.py). ``tune``: FASTMESH_TUNE inside the
    block; "off" (the fixed plan, always fused) for the tests of what the pass can fuse, whose shapes are too
    small for fusing to pay.

    When the block ends, each graph's ops are checked against the report, so that a rewrite the report claims
    but the graph lacks fails every test that compiles here: each collective reported fused is one native
    collective fewer and one fastmesh op more than the graph held before any post-grad pass."""
    before = GraphCensus()
    torch._dynamo.reset()
    try:
        with environment(FASTMESH_TUNE=tune), graph_census(before=before) as after:
            fastmesh.compile.enable_fusion(strict=strict)
            fastmesh.compile.fusion_report(reset=True)
            try:
                yield after
                _assert_graphs_hold_the_report(before, after, fastmesh.compile.fusion_report(), strict)
            finally:
                fastmesh.compile.disable_fusion()
    finally:
        torch._dynamo.reset()


def _assert_graphs_hold_the_report(before: GraphCensus, after: GraphCensus, report, strict: bool) -> None:
    """Each collective reported fused is gone from its graph; each fused op reported is in it (a row-wise scales'
    gather rides its data's op: reported fused with 0 matmuls, no op of its own)."""
    # A graph whose compile strict mode stopped (the test expects it to raise) reaches no later pass: the last.
    stopped = (len(report.graphs) - 1,) if strict else ()
    assert len(before.graphs) == len(report.graphs) and len(after.graphs) in (len(report.graphs), *stopped), (
        before.graphs,
        after.graphs,
        str(report),
    )
    if len(after.graphs) < len(report.graphs):
        assert not any(e.fused for e in report.entries if e.graph == len(after.graphs)), str(report)
    for index, ((kind, ops_before), (_, ops_after)) in enumerate(zip(before.graphs, after.graphs)):
        fused = [e for e in report.entries if e.graph == index and e.fused]
        natives_before = sum(n for name, n in ops_before.items() if name.startswith("native."))
        natives_after = sum(n for name, n in ops_after.items() if name.startswith("native."))
        context = (index, kind, ops_before, ops_after, str(report))
        assert natives_before - natives_after == len(fused), context
        for op in {e.fused_into for e in fused}:
            made = sum(e.fused_into == op and e.matmuls > 0 for e in fused)
            assert ops_after[op] - ops_before[op] == made, (op, *context)


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- torch's native plan on a Llama block ----


def _block_step(block, fn, x, world):
    x = x.chunk(world, 1)[dist.get_rank()].clone().requires_grad_()
    y = fn(x)
    (y * y).sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in block.named_parameters()}
    block.zero_grad()
    return y.detach(), x.grad, grads


@on_ranks(2, timeout=600)
def test_native_block_compiles_to_fused_ops_with_equal_results():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import checkpoint

    world = dist.get_world_size()
    args = LlamaArgs()
    torch.manual_seed(0)
    block = parallelize_module(Block(args), init_device_mesh("cpu", (world,)), block_plan("native"))
    lengths = (8, 12)

    for checkpointed in (False, True):

        def run(x):
            rope = rope_tables(x.shape[1] * world, args.head_dim, args.rope_theta)
            return checkpoint(block, x, rope, use_reentrant=False) if checkpointed else block(x, rope)

        want = [_block_step(block, run, _randn((2, n, args.dim), n), world) for n in lengths]

        with _fusion(strict=True) as census:
            fused = torch.compile(run, fullgraph=True, dynamic=True)
            got = [_block_step(block, fused, _randn((2, n, args.dim), n), world) for n in lengths]
            report = fastmesh.compile.fusion_report()
        case = f"checkpointed={checkpointed}"
        for (y, gx, grads), (y_ref, gx_ref, grads_ref) in zip(got, want):
            torch.testing.assert_close(y, y_ref, **TOLERANCE, msg=lambda m: f"{case}: output: {m}")
            torch.testing.assert_close(gx, gx_ref, **TOLERANCE, msg=lambda m: f"{case}: grad x: {m}")
            for name in grads_ref:
                torch.testing.assert_close(
                    grads[name], grads_ref[name], **TOLERANCE, msg=lambda m: f"{case}: {name}: {m}"
                )

        # One forward and one backward graph for both lengths (dynamic: no recompile).
        assert [kind for kind, _ in census.graphs] == ["forward", "backward"], (case, census.graphs)
        (_, forward), (_, backward) = census.graphs
        # Forward: the attention input gathered once for q/k/v and the FFN input once for w1/w3; wo and w2
        # reduce-scattered.
        assert forward == {"fastmesh.all_gather_matmul": 2, "fastmesh.matmul_reduce_scatter": 2}, (case, forward)
        assert sorted(n for kind, n in census.gather_bs if kind == "forward") == [2, 3], (case, census.gather_bs)
        # Backward: the output gradients of wo and w2 gathered (dgrad), the input gradients of q/k/v and of
        # w1/w3 (sums of matmuls) reduce-scattered. Checkpointing recomputes both input gathers and the
        # attention's output projection (the FFN's w2 output is not needed to recompute anything).
        # Without checkpointing, the inputs' shards, saved in place of the gathered inputs, are gathered again for
        # the weight gradients: torch's collectives, left by design (compile/saved_shards.py).
        recomputed = {"all_gather_matmul": 2, "matmul_reduce_scatter": 1} if checkpointed else {}
        shard_gathers = 0 if checkpointed else 2
        want = {f"fastmesh.{op}": 2 + recomputed.get(op, 0) for op in ("all_gather_matmul", "matmul_reduce_scatter")}
        assert backward == {**want, **({"native.all_gather_into_tensor": shard_gathers} if shard_gathers else {})}, (
            case,
            backward,
        )
        assert all(e.fused or e.by_design for e in report.entries), (case, str(report))
        assert sum(e.by_design for e in report.entries) == shard_gathers, (case, str(report))
        assert report.count("fastmesh.matmul_reduce_scatter", "backward") == 2 + checkpointed, (case, str(report))


@on_ranks(2, timeout=600)
def test_whole_native_llama_compiles_strictly_to_fused_ops():
    # The whole model: two blocks, the vocab-parallel head and loss, compiled with strict=True. Every block
    # collective and the head's gather fuse; the embedding's reduce-scatter (of a lookup) and its backward gather
    # (into an index_put) are no matmul's, so neither listed nor fatal, as the loss's all-reduces.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from fastmesh.testing.llama import Llama, parallelize_llama

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    args = LlamaArgs()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(model, compiled):
        with loss_parallel():
            logits = (torch.compile(model) if compiled else model)(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
        return loss.full_tensor(), {name: p.grad.full_tensor() for name, p in model.named_parameters()}

    torch.manual_seed(0)
    want = step(parallelize_llama(Llama(args), mesh, "native"), compiled=False)
    torch.manual_seed(0)
    model = parallelize_llama(Llama(args), mesh, "native")
    with _fusion(strict=True):
        got = step(model, compiled=True)
        report = fastmesh.compile.fusion_report()
    torch.testing.assert_close(got[0], want[0], **TOLERANCE)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **TOLERANCE, msg=name)
    # Forward: 2 gathers and 2 reduce-scatters per block, the head's gather; backward the same, mirrored.
    assert report.count("fastmesh.all_gather_matmul") == 5 + 4, str(report)
    assert report.count("fastmesh.matmul_reduce_scatter") == 4 + 5, str(report)
    # and backward gathers again the shards kept for the weight gradients (2 per block, the head's): left by design
    assert [(e.graph_kind, e.by_design) for e in report.unfused] == [("backward", True)] * 5, str(report)


class _TwoColumnParallel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32, bias=False)
        self.b = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x):
        return self.a(x) * self.b(x)


@on_ranks(2, timeout=600)
def test_two_linears_gathering_one_input_fuse_into_one_gather():
    """Two ColwiseParallel(input_layouts=Shard(1)) linears of one input: in a training graph AOTAutograd merges
    their two all-gathers into one, waited twice, each wait with its own split/cat. The pass merges those, then
    fuses the gather with both matmuls (it once left the gather, and strict=True failed the compile)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _TwoColumnParallel()
    plan = {"a": ColwiseParallel(input_layouts=Shard(1)), "b": ColwiseParallel(input_layouts=Shard(1))}
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    x = _randn((2, 4 * world, 16), seed=1)
    want = _block_step(model, model, x, world)
    with _fusion(strict=True):
        got = _block_step(model, torch.compile(model, fullgraph=True), x, world)
        report = fastmesh.compile.fusion_report()
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    gathers = [e for e in report.entries if e.fused_into == "fastmesh.all_gather_matmul"]
    assert [e.matmuls for e in gathers] == [2], str(report)
    # backward gathers the shard kept for the weight gradients again: left by design
    assert [(e.graph_kind, e.by_design) for e in report.unfused] == [("backward", True)], str(report)


@on_ranks(2, timeout=600)
def test_lm_head_under_sequence_parallelism_fuses_the_larger_gather_with_dynamic_shapes():
    """An LM head under sequence parallelism gathers its input and its product: its matmul goes to the fused op of
    the larger transfer (the product's 24 columns against 16 features), with static and with symbolic shapes
    (a symbolic size once counted as 0, so graph order chose the input's gather)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    world = dist.get_world_size()
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 24, bias=False)
    style = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(head, init_device_mesh("cpu", (world,)), style)
    x = _randn((2, 4 * world, 16), seed=1).chunk(world, 1)[dist.get_rank()]
    for dynamic in (False, True):
        with torch.no_grad(), _fusion():
            got = torch.compile(head, fullgraph=True, dynamic=dynamic)(x)
            report = fastmesh.compile.fusion_report()
        torch.testing.assert_close(got, head(x).detach(), rtol=0, atol=0)
        assert [e.fused_into for e in report.fused] == ["fastmesh.matmul_all_gather"], (dynamic, str(report))
        assert [e.detail for e in report.unfused] == [
            f"its matmul is fused with {report.fused[0].node} instead, which moves more data"
        ], (dynamic, str(report))


# ---- biased row-parallel linears (DTensor makes the bias partial) ----


@on_ranks(2, 3, timeout=600)
def test_biased_rowwise_parallel_fuses_with_the_bias_added_after():
    # RowwiseParallel with a bias: DTensor adds bias / W on every rank before the reduce-scatter or all-reduce
    # (its Replicate -> Partial form), and the pass adds the bias once after the fused op.
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    gather_scatter = [("forward", "fastmesh.matmul_reduce_scatter"), ("backward", "fastmesh.all_gather_matmul")]
    cases = {  # output layout -> the local input of one rank, the fused ops by graph
        Shard(0): (_randn((6, 12 // world), seed=dist.get_rank()), gather_scatter),
        Shard(1): (_randn((2, 3 * world, 12 // world), seed=dist.get_rank()), gather_scatter),
        # Plain TP: an all-reduce in the forward, no collective in the backward.
        Replicate(): (_randn((2, 3, 12 // world), seed=dist.get_rank()), [("forward", "fastmesh.matmul_all_reduce")]),
    }
    for layout, (x, ops) in cases.items():
        torch.manual_seed(0)
        linear = nn.Linear(12, 14)  # 3 ranks: bias / 3 is rounded, and the ranks' thirds sum to bias up to rounding
        parallelize_module(linear, mesh, RowwiseParallel(input_layouts=Shard(-1), output_layouts=layout))

        def step(fn):
            x_local = x.clone().requires_grad_()
            y = fn(x_local)
            (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
            grads = [p.grad.full_tensor() for p in (linear.weight, linear.bias)]
            linear.zero_grad()
            return y.detach(), x_local.grad, grads

        want = step(linear)
        with _fusion(strict=True):
            got = step(torch.compile(linear, fullgraph=True))
            report = fastmesh.compile.fusion_report()
        torch.testing.assert_close(got[:2], want[:2], **TOLERANCE, msg=lambda m: f"{layout}: {m}")
        torch.testing.assert_close(got[2], want[2], **TOLERANCE, msg=lambda m: f"{layout} grads: {m}")
        assert [(e.graph_kind, e.fused_into) for e in report.entries] == ops, (layout, str(report))
        assert "the replicated bias" in report.entries[0].detail, (layout, str(report))


def _scatter_mm_plus_partial_bias(x, w, bias):
    # mm + bias rather than addmm, as DTensor's Replicate -> Partial("sum") makes the bias: divided by W.
    product = (x.reshape(-1, 2, x.shape[-1]) @ w) + bias.to_local() / dist.get_world_size()
    return _scatter(product, 1)


def _fp8_scatter_rowwise_partial_bias(x, w, bias):
    data, scale = _quantize_rows(x)
    wq, ws = _weight_fp8(w)
    partial = bias.to_local() / dist.get_world_size()
    return _scatter(torch._scaled_mm(data, wq, scale, ws, bias=partial, out_dtype=torch.float32), 0)


@on_ranks(2, timeout=300)
def test_partial_bias_forms_fuse_in_strict_mode():
    # A bias DTensor holds as Replicate (here a Replicate DTensor input), made partial before the
    # reduce-scatter, in the mm + add form and as _scaled_mm's bias: fused, the bias added once after.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    x, w, b = _inputs()
    bias = DTensor.from_local(b, init_device_mesh("cpu", (dist.get_world_size(),)), [Replicate()])
    cases = {"mm_plus_bias": (_scatter_mm_plus_partial_bias, "fastmesh.matmul_reduce_scatter", TOLERANCE)}
    if ROWWISE_ON_CPU:
        cases["fp8_rowwise"] = (_fp8_scatter_rowwise_partial_bias, "fastmesh.scaled_matmul_reduce_scatter", TOLERANCE)
    for name, (fn, op, tolerance) in cases.items():
        with torch.no_grad():
            want = fn(x, w, bias)
            with _fusion(strict=True):
                got = torch.compile(fn, fullgraph=True)(x, w, bias)
                report = fastmesh.compile.fusion_report()
        torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{name}: {m}")
        [entry] = report.entries
        assert entry.fused_into == op and "the replicated bias" in entry.detail, (name, str(report))


# ---- torch's own test Transformer (LayerNorm, biased GELU MLP, tied LM head) under its own plans ----


def _torch_transformer_step(model, tokens, compiled):
    logits = (torch.compile(model, fullgraph=True) if compiled else model)(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    # Plain TP leaves the norms' parameters plain tensors.
    grads = {name: getattr(p.grad, "full_tensor", lambda: p.grad)() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def _torch_transformer_report(use_seq_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    args = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    # local_output_for_attn=True: each rank attends with its heads (torch's option; with global heads q, k and v
    # are DTensors, and DTensor has no sharding rule for CPU attention).
    model = Transformer.parallelize(Transformer(args), mesh, use_seq_parallel, local_output_for_attn=True)
    want = _torch_transformer_step(model, tokens, compiled=False)
    with _fusion():
        got = _torch_transformer_step(model, tokens, compiled=True)
        report = fastmesh.compile.fusion_report()
    torch.testing.assert_close(got[0], want[0], **TOLERANCE)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **TOLERANCE, msg=lambda m: f"{name}: {m}")
    return report


@on_ranks(2, timeout=900)
def test_torch_transformer_sequence_parallel_plan_fuses_every_matmul_collective():
    # Every collective of a matmul fuses, the row-parallel biases added after the fused reduce-scatter. The LM
    # head gathers its input (sequence) and its output (vocabulary columns, which torch's plan makes
    # replicated): its matmul goes with the larger, the output's (matmul_all_gather), and the input's gather is
    # left as not worth it. The embeddings' reduce-scatters (of masked lookups) and their backward gathers (into
    # index_put) are no matmul's: not listed.
    report = _torch_transformer_report(use_seq_parallel=True)
    per_layer = {"forward": (4, 4), "backward": (4, 5)}  # (gathers, reduce-scatters) fused: 2 layers (+ the head)
    for kind, (gathers, scatters) in per_layer.items():
        assert report.count("fastmesh.all_gather_matmul", kind) == gathers, str(report)
        assert report.count("fastmesh.matmul_reduce_scatter", kind) == scatters, str(report)
    assert report.count("fastmesh.matmul_all_gather", "forward") == 1, str(report)
    assert sum("the replicated bias" in e.detail for e in report.fused) == 2, str(report)  # w2 of each layer
    [head_input] = [e for e in report.unfused if not e.by_design]
    # the other gathers left: backward's of the shards kept for weight gradients (2 per layer, the head's)
    assert sum(e.by_design and e.graph_kind == "backward" for e in report.unfused) == 5, str(report)
    assert (head_input.graph_kind, head_input.collective) == ("forward", "all_gather"), str(report)
    assert head_input.unprofitable and "which moves more data" in head_input.detail, str(report)


@on_ranks(2, timeout=900)
def test_torch_transformer_plain_tp_plan_fuses_every_matmul_collective():
    # Without sequence parallelism: each row-parallel linear's all-reduce (w2's with its bias added after) and,
    # in the backward, the all-reduce of each column-parallel input gradient fuse into matmul_all_reduce; the
    # LM head's input is replicated, its output columns' gather fuses into matmul_all_gather. Left: the
    # embeddings' all-reduces (of masked lookups; not matmuls', so not listed).
    report = _torch_transformer_report(use_seq_parallel=False)
    # Forward: wo and w2 of 2 layers. Backward: the input gradients of q, k, v (each linear's input is made
    # replicated by its own style, so each is all-reduced alone) and w1 of 2 layers, and of the LM head.
    assert report.count("fastmesh.matmul_all_reduce", "forward") == 4, str(report)
    assert report.count("fastmesh.matmul_all_reduce", "backward") == 4 * 2 + 1, str(report)
    assert report.count("fastmesh.matmul_all_gather", "forward") == 1, str(report)
    assert sum("the replicated bias" in e.detail for e in report.fused) == 2, str(report)
    assert report.unfused == [], str(report)


# ---- each pattern alone ----


def _world():
    return dist.group.WORLD


# all_gather_single / reduce_scatter_single are the names since torch 2.12 (the old ones warn there); 2.11 has only
# the old ones.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _gather(x, dim):
    """Gather along ``dim`` the way DTensor's redistribution does: ranks stacked along dim 0, then moved to
    ``dim`` by split/cat (spelled out: torch 2.11's dynamo cannot trace funcol's own gather_dim > 0)."""
    stacked = _all_gather(x, 0, _world())
    return torch.cat(torch.chunk(stacked, dist.get_world_size(), 0), dim) if dim else stacked


def _scatter(x, dim, op="sum"):
    return _reduce_scatter(x, op, dim, _world())


def _gather_dim0(x, w, b):
    return _gather(x, 0) @ w


def _gather_dim1_linear_bias(x, w, b):
    return F.linear(_gather(x.unsqueeze(0).expand(2, -1, -1) * 1.5, 1), w.t(), b)


def _gather_dim1_batch_of_one(x, w, b):
    # torch >= 2.12 moves the rank blocks of a [1, S, K] shard with a view instead of split/cat.
    return _all_gather(x.unsqueeze(0), 0, _world()).view(1, -1, x.shape[-1]) @ w


def _gather_last_dim(x, w, b):
    return _gather(x, -1) @ torch.cat([w, w], 0)


def _gather_two_matmuls_and_another_use(x, w, b):
    full = _gather(x.reshape(2, -1, x.shape[-1]), 1)
    return full @ w, full @ (2 * w), full.sum(-1)


def _product_gather_columns(x, w, b):
    # A column-parallel product made replicated (the LM head): its rank blocks moved to the last dim.
    return _gather(x.reshape(2, 3, -1) @ w, -1)


def _product_gather_columns_reshaped_inferring_a_dim(x, w, b):
    # The product reshaped with -1 in a leading dim: the pass's own reshape of the fused result must not infer
    # a second one.
    return _gather((x @ w).reshape(-1, 3, w.shape[1]), -1)


def _product_gather_columns_of_gathered_input(x, w, b):
    # The LM head under sequence parallelism: the input gathered too. The product moves more (14 columns
    # against 10 features): matmul_all_gather takes the matmul, the input's gather stays (not worth it).
    return _gather(_gather(x, 0) @ w, -1)


def _scatter_dim0(x, w, b):
    return _scatter(x @ w, 0)


def _scatter_dim1_avg(x, w, b):
    return _scatter((x.reshape(-1, 2, x.shape[-1]) @ w), 1, "avg")


def _scatter_last_dim(x, w, b):
    return _scatter(x @ torch.cat([w, w], 1), -1)


def _scatter_sum_of_matmuls(x, w, b):
    x3 = x.reshape(-1, 2, x.shape[-1])
    return _scatter(x3 @ w + (x3 * 2) @ (w - 1) + torch.sin(x3) @ (3 * w), 1)


def _all_reduce_mm(x, w, b):
    return funcol.all_reduce(x.reshape(2, -1, x.shape[-1]) @ w, "sum", _world())


def _all_reduce_sum_of_matmuls_avg(x, w, b):
    # The backward of column-parallel q/k/v with a replicated input: the input gradient's terms, all-reduced.
    return funcol.all_reduce(x @ w + torch.sin(x) @ (w - 1), "avg", _world())


# ---- FP8: native FP8 TP written by hand (gloo moves FP8 as bytes) ----

E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max


def _quantize(x, amax):
    scale = amax.float().clamp(min=1e-12) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def _quantize_rows(x):
    """data [..., K] e4m3 and its row-wise dequantization scale [..., 1]."""
    return _quantize(x, x.abs().amax(-1, keepdim=True))


def _weight_fp8(w):
    """w [K, N] as _scaled_mm's right operand: column-major FP8 data and one scale per column [1, N]."""
    data, scale = _quantize_rows(w.t())
    return data.t(), scale.t()


def _gather_fp8(data, dim):
    return _gather(data.view(torch.uint8), dim).view(E4M3)


def _fp8_gather_rowwise(x, w, b):
    data, scale = _quantize_rows(x)
    return torch._scaled_mm(
        _gather_fp8(data, 0), *_weight_fp8(w)[:1], _gather(scale, 0), _weight_fp8(w)[1], out_dtype=torch.float32
    )


def _fp8_gather_rowwise_dim1(x, w, b):
    data, scale = _quantize_rows(x.reshape(2, -1, x.shape[-1]))  # [2, 3, K] and [2, 3, 1] per rank
    rows = _gather_fp8(data, 1).reshape(-1, x.shape[-1])
    wq, ws = _weight_fp8(w)
    return torch._scaled_mm(rows, wq, _gather(scale, 1).reshape(-1, 1), ws, out_dtype=torch.bfloat16)


def _fp8_gather_tensorwise_reduced_amax(x, w, b):
    # torchao's recipe: the activation's amax is all-reduced, so every rank's scale is the same.
    amax = funcol.all_reduce(x.abs().amax(), "max", _world())
    data, scale = _quantize(x, amax)
    wq, _ = _weight_fp8(w)
    return torch._scaled_mm(_gather_fp8(data, 0), wq, scale, torch.tensor(0.5), out_dtype=torch.float32)


def _fp8_scatter_rowwise(x, w, b):
    data, scale = _quantize_rows(x)
    product = torch._scaled_mm(data, *_weight_fp8(w)[:1], scale, _weight_fp8(w)[1], out_dtype=torch.float32)
    return _scatter(product.reshape(-1, 2, product.shape[-1]), 1)


def _fp8_scatter_tensorwise(x, w, b):
    data, scale = _quantize(x, x.abs().amax())
    return _scatter(torch._scaled_mm(data, _weight_fp8(w)[0], scale, torch.tensor(0.25), out_dtype=torch.float32), 0)


def _fp8_all_reduce_rowwise(x, w, b):
    # Plain TP's row-parallel linear in FP8: each rank's product of its features, summed over the ranks.
    data, scale = _quantize_rows(x.reshape(2, -1, x.shape[-1]))
    wq, ws = _weight_fp8(w)
    product = torch._scaled_mm(data.flatten(0, 1), wq, scale.flatten(0, 1), ws, out_dtype=torch.bfloat16)
    return funcol.all_reduce(product.reshape(2, -1, product.shape[-1]), "sum", _world())


def _fp8_all_reduce_tensorwise_avg(x, w, b):
    data, scale = _quantize(x, x.abs().amax())
    return funcol.all_reduce(
        torch._scaled_mm(data, _weight_fp8(w)[0], scale, torch.tensor(0.25), out_dtype=torch.float32), "avg", _world()
    )


# name -> (function, fused ops it must produce, matmuls they fuse)
def _no_matmuls_collectives(x, w, b):
    # As an embedding's: the reduce-scatter of a lookup (here a product no matmul feeds), a gathered gradient
    # that ends in an index_put (here an exp), and one that inductor folds into a weight gradient as addmm's
    # added term (a tied embedding's).
    tied = torch.addmm(_gather(x, 0)[:10, :10], x.t(), x[:, :10])
    return _scatter(x * 2, 0), _gather(x, 0).exp(), tied


PATTERNS = {
    "gather_dim0": (_gather_dim0, ["fastmesh.all_gather_matmul"], 1),
    "gather_dim1_linear_bias": (_gather_dim1_linear_bias, ["fastmesh.all_gather_matmul"], 1),
    "gather_dim1_batch_of_one": (_gather_dim1_batch_of_one, ["fastmesh.all_gather_matmul"], 1),
    "gather_last_dim": (_gather_last_dim, ["fastmesh.all_gather_matmul"], 1),
    "gather_two_matmuls_and_another_use": (_gather_two_matmuls_and_another_use, ["fastmesh.all_gather_matmul"], 2),
    "scatter_dim0": (_scatter_dim0, ["fastmesh.matmul_reduce_scatter"], 1),
    "scatter_dim1_avg": (_scatter_dim1_avg, ["fastmesh.matmul_reduce_scatter"], 1),
    "scatter_last_dim": (_scatter_last_dim, ["fastmesh.matmul_reduce_scatter"], 1),
    "scatter_sum_of_matmuls": (_scatter_sum_of_matmuls, ["fastmesh.matmul_reduce_scatter"], 3),
    "all_reduce_mm": (_all_reduce_mm, ["fastmesh.matmul_all_reduce"], 1),
    "product_gather_columns": (_product_gather_columns, ["fastmesh.matmul_all_gather"], 1),
    "product_gather_columns_reshaped_inferring_a_dim": (
        _product_gather_columns_reshaped_inferring_a_dim,
        ["fastmesh.matmul_all_gather"],
        1,
    ),
    "product_gather_columns_of_gathered_input": (
        _product_gather_columns_of_gathered_input,
        [None, "fastmesh.matmul_all_gather"],
        0,
    ),
    "all_reduce_sum_of_matmuls_avg": (_all_reduce_sum_of_matmuls_avg, ["fastmesh.matmul_all_reduce"], 2),
    # Collectives of no matmul: not the pass's, so not listed and not fatal under strict=True.
    "no_matmuls_collectives": (_no_matmuls_collectives, [], 0),
    # An FP8 row-wise gather carries its scales' gather: two collectives, one fused op.
    "fp8_gather_rowwise": (_fp8_gather_rowwise, ["fastmesh.all_gather_scaled_matmul"] * 2, 1),
    "fp8_gather_rowwise_dim1": (_fp8_gather_rowwise_dim1, ["fastmesh.all_gather_scaled_matmul"] * 2, 1),
    "fp8_gather_tensorwise_reduced_amax": (
        _fp8_gather_tensorwise_reduced_amax,
        ["fastmesh.all_gather_scaled_matmul"],
        1,
    ),
    "fp8_scatter_rowwise": (_fp8_scatter_rowwise, ["fastmesh.scaled_matmul_reduce_scatter"], 1),
    "fp8_scatter_tensorwise": (_fp8_scatter_tensorwise, ["fastmesh.scaled_matmul_reduce_scatter"], 1),
    "fp8_all_reduce_rowwise": (_fp8_all_reduce_rowwise, ["fastmesh.scaled_matmul_all_reduce"], 1),
    "fp8_all_reduce_tensorwise_avg": (_fp8_all_reduce_tensorwise_avg, ["fastmesh.scaled_matmul_all_reduce"], 1),
}
ROWWISE_PATTERNS = {"fp8_gather_rowwise", "fp8_gather_rowwise_dim1", "fp8_scatter_rowwise", "fp8_all_reduce_rowwise"}


def _inputs():
    rank = dist.get_rank()
    # Odd sizes: 6 rows per rank, K = 10, N = 14.
    return _randn((6, 10), seed=rank), _randn((10, 14), seed=100), _randn((14,), seed=101)


def _pattern_params():
    return [
        pytest.param(name, marks=NEEDS_ROWWISE_ON_CPU if name in ROWWISE_PATTERNS else ()) for name in sorted(PATTERNS)
    ]


@on_ranks(2, timeout=300)
@pytest.mark.parametrize("name", _pattern_params())
def test_each_pattern_fuses_in_strict_mode_and_matches_eager(name):
    fn, ops, matmuls = PATTERNS[name]
    inputs = _inputs()
    with torch.no_grad():
        want = fn(*inputs)
        with _fusion(strict=True):
            got = torch.compile(fn, fullgraph=True)(*inputs)
            report = fastmesh.compile.fusion_report()
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE)
    assert [e.fused_into for e in report.entries] == ops, str(report)
    assert sum(e.matmuls for e in report.entries[:1]) == matmuls, str(report)


def _bf16_sum_over_linear_weights(x, w1, w2, w3):
    return _scatter(x @ w1.t() + (2 * x) @ w2.t() + (3 * x) @ w3.t(), 1)


@on_ranks(2, timeout=300)
def test_bf16_sum_over_linear_weights_fuses_without_nans():
    # The backward of q/k/v in bf16: a sum of matmuls by row-major weights used as w.t() (as nn.Linear does).
    # The fused op's concatenated b is built from the weights as they lie: inductor's CPU code materializes
    # 16-bit transposes into a cat wrongly (NaNs, torch 2.11 and 2.14; it takes tiles of 32, hence the sizes).
    x = _randn((2, 8, 64), seed=dist.get_rank()).bfloat16()
    weights = [_randn((96, 64), seed=10 + j).bfloat16() for j in range(3)]
    with torch.no_grad():
        want = _bf16_sum_over_linear_weights(x, *weights).float()
        with _fusion(strict=True):
            got = torch.compile(_bf16_sum_over_linear_weights, fullgraph=True)(x, *weights).float()
            report = fastmesh.compile.fusion_report()
    assert [(e.fused_into, e.matmuls) for e in report.entries] == [("fastmesh.matmul_reduce_scatter", 3)], str(report)
    # One fused matmul instead of three rounded ones: values up to ~50, bf16 steps of 1/4 there.
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.5)


def _gather_then_relu(x, w, b):
    return torch.relu(_gather(x, 0)) @ w


def _product_gather_rows(x, w, b):
    return _gather(x @ w, 0)


def _product_gather_biased(x, w, b):
    return _gather(torch.addmm(b, x, w), -1)


def _scatter_product_used_twice(x, w, b):
    product = x @ w
    return _scatter(product, 0), product.sum()


def _scatter_after_bias(x, w, b):
    return _scatter(torch.addmm(b, x, w), 0)


def _scatter_after_plain_partial_bias(x, w, b):
    return _scatter(torch.addmm(b / dist.get_world_size(), x, w), 0)


def _fp8_gather_tensorwise_local_scale(x, wq, b):
    data, scale = _quantize(x, x.abs().amax())  # each rank's own scale: not what the native graph means
    return torch._scaled_mm(_gather_fp8(data, 0), wq, scale, torch.tensor(0.5), out_dtype=torch.float32)


def _fp8_weight_inputs():
    # The FP8 weight quantized outside the graph: an unfused _scaled_mm needs it column-major, which inductor's
    # CPU lowering does not enforce on a weight quantized inside the graph.
    x, w, b = _inputs()
    return x, _weight_fp8(w)[0], b


# name -> (function, collective left, words its reason must contain, inputs, whether inductor compiles it unfused)
UNFUSABLE = {
    # Unfused, this one stops in inductor's CPU lowering of _scaled_mm ("mat_b must be col_major" for a
    # column-major input, torch 2.14), after the pass.
    "fp8_gather_tensorwise_local_scale": (
        _fp8_gather_tensorwise_local_scale,
        "all_gather",
        "not provably the same",
        _fp8_weight_inputs,
        False,
    ),
    "gather_then_relu": (_gather_then_relu, "all_gather", "feeds no matmul", _inputs, True),
    "product_gather_rows": (_product_gather_rows, "all_gather", "stacks its rows, not its columns", _inputs, True),
    "product_gather_biased": (_product_gather_biased, "all_gather", "not one mm", _inputs, True),
    "scatter_product_used_twice": (_scatter_product_used_twice, "reduce_scatter", "other users", _inputs, True),
    "scatter_after_bias": (_scatter_after_bias, "reduce_scatter", "not DTensor's partial form", _inputs, True),
    # Divided by the group size like DTensor's partial bias, but a plain input: each rank may give its own.
    "scatter_after_plain_partial_bias": (
        _scatter_after_plain_partial_bias,
        "reduce_scatter",
        "not provably the same on every rank",
        _inputs,
        True,
    ),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@on_ranks(2, timeout=300)
@pytest.mark.parametrize("name", sorted(UNFUSABLE))
def test_unfusable_patterns_are_reported_and_strict_raises(name):
    fn, collective, reason, make_inputs, compiles_unfused = UNFUSABLE[name]
    inputs = make_inputs()
    logger = logging.getLogger("fastmesh.compile")
    records = _Records()
    logger.addHandler(records)
    try:
        with torch.no_grad():
            want = fn(*inputs)
            if compiles_unfused:
                with _fusion(strict=False):
                    got = torch.compile(fn, fullgraph=True)(*inputs)
                    report = fastmesh.compile.fusion_report()
                torch.testing.assert_close(got, want, **TOLERANCE)
                assert [e.fused for e in report.entries] == [False], str(report)
            with _fusion(strict=True):
                with pytest.raises(Exception, match="strict=True") as raised:
                    torch.compile(fn, fullgraph=True)(*inputs)
                report = fastmesh.compile.fusion_report()  # recorded before the pass raised
    finally:
        logger.removeHandler(records)
    [left] = report.unfused
    assert left.collective == collective and reason in left.detail, str(report)
    assert any(left.node in m and reason in m for m in records.messages), records.messages
    # The compile error names the collective's node and the reason.
    assert left.node in str(raised.value) and reason in str(raised.value), str(raised.value)


def _fp8_gather_mx_scales(data, wq, scale_a, scale_b):
    return torch._scaled_mm(_gather_fp8(data, 0), wq, scale_a, scale_b, out_dtype=torch.bfloat16)


def _fp8_scatter_block_scales(data, wq, scale_a, scale_b):
    return _scatter(torch._scaled_mm(data, wq, scale_a, scale_b, out_dtype=torch.bfloat16), 0)


def _block_scaled_inputs(kind: str):
    """FP8 operands with scales in torch's device layouts for block-scaled _scaled_mm, as its meta function
    checks them: MX scales swizzled ([round_up(M, 128), round_up(K / 32, 4)] E8M0), 1x128 scales of a
    outer-dim-major ([M, K / 128]) beside 128x128 ones of b."""
    m, k, n = 128, 256, 128
    data = torch.zeros(m // 2 if kind == "mx" else m, k, dtype=E4M3)  # the MX graph gathers two ranks' rows
    wq = torch.zeros(n, k, dtype=E4M3).t()
    if kind == "mx":
        e8m0 = torch.ones(m, 8).to(torch.float8_e8m0fnu)
        return data, wq, e8m0, e8m0.clone()
    return data, wq, torch.ones(k // 128, m).t(), torch.ones(k // 128, n // 128)


@on_ranks(2, timeout=300)
def test_block_scaled_scaled_mm_in_a_native_graph_is_reported_not_fused():
    """torch's block-scaled _scaled_mm forms (the layouts its MX and blockwise recipes hand cuBLAS) run on GPUs
    only; traced here (fake tensors), the pass reports them and strict mode raises before anything runs."""
    for fn, kind, reason in (
        (_fp8_gather_mx_scales, "mx", "has MX (float8_e8m0fnu) scales (scale_a)"),
        (_fp8_scatter_block_scales, "block", "has block scales (scale_a)"),
    ):
        with torch.no_grad(), _fusion(strict=True):
            with pytest.raises(Exception, match="strict=True") as raised:
                torch.compile(fn, fullgraph=True)(*_block_scaled_inputs(kind))
            report = fastmesh.compile.fusion_report()
        [left] = report.unfused
        assert reason in left.detail and "device layout" in left.detail, str(report)
        assert reason in str(raised.value), str(raised.value)


# ---- collectives whose plan is the unfused sequence are left, as not profitable ----


@on_ranks(2, timeout=300)
def test_unprofitable_collectives_are_left_and_strict_accepts_them():
    """With the planner on (the default mode), the tiny shapes of these graphs are latency-bound: the op's
    plan would be the unfused sequence, so the pass leaves them, says why with the figures, and strict mode
    does not fail. A measured plan in the cache that says otherwise makes the pass fuse."""
    from fastmesh.ops import plans
    from fastmesh.ops.fused_collectives import gather_plan_call

    inputs = _inputs()
    with torch.no_grad():
        want = _gather_two_matmuls_and_another_use(*inputs)
        with _fusion(strict=True, tune="model"):
            got = torch.compile(_gather_two_matmuls_and_another_use, fullgraph=True)(*inputs)
            report = fastmesh.compile.fusion_report()
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOLERANCE)
        [entry] = report.entries
        assert not entry.fused and entry.unprofitable, str(report)
        assert (
            "not profitable: fastmesh::all_gather_matmul's plan for these shapes is unfused (model: " in entry.detail
            and "left (not profitable)" in str(report)
        ), str(report)

        # The same question for an all-reduce, asked of matmul_all_reduce's planner.
        with _fusion(strict=True, tune="model"):
            got = torch.compile(_all_reduce_mm, fullgraph=True)(*inputs)
            report = fastmesh.compile.fusion_report()
        torch.testing.assert_close(got, _all_reduce_mm(*inputs), **TOLERANCE)
        [entry] = report.entries
        assert entry.unprofitable, str(report)
        assert "fastmesh::matmul_all_reduce's plan for these shapes is unfused" in entry.detail, str(report)

        x, w, _ = inputs  # the fused call's operands: the [2, 3, 10] shard gathered along dim 1, by w and 2w
        call = gather_plan_call(x.reshape(2, -1, x.shape[-1]), [w, 2 * w], 1, fastmesh.group_name(dist.group.WORLD))
        plans.cache().store(call.key, {"split": "rows", "pieces": 2, "ms": {"rowsx2": 1.0, "unfused": 2.0}})
        with _fusion(strict=True, tune="model"):
            got = torch.compile(_gather_two_matmuls_and_another_use, fullgraph=True)(*inputs)
            report = fastmesh.compile.fusion_report()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE)
    assert [e.fused_into for e in report.entries] == ["fastmesh.all_gather_matmul"], str(report)


# ---- torch's own async TP pass enabled too ----


@on_ranks(2, timeout=300)
def test_torch_micro_pipeline_tp_runs_first_and_fastmesh_fuses_what_it_leaves():
    # On gloo groups torch's pass finds the patterns but fuses nothing (it needs symmetric memory on CUDA);
    # fastmesh's pass, which inductor runs after it, takes them.
    inputs = _inputs()
    with torch.no_grad(), inductor_config.patch(_micro_pipeline_tp=True):
        want = _gather_two_matmuls_and_another_use(*inputs)
        with _fusion(strict=True):
            got = torch.compile(_gather_two_matmuls_and_another_use, fullgraph=True)(*inputs)
            report = fastmesh.compile.fusion_report()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE)
    assert [e.fused_into for e in report.entries] == ["fastmesh.all_gather_matmul"], str(report)


def test_ops_fused_by_torch_are_reported_as_torchs():
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        pytest.skip("this torch build has no symm_mem ops")
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a_shard"), graph.placeholder("b")
    fused = graph.call_function(torch.ops.symm_mem.fused_all_gather_matmul.default, (a, [b], 0, "0"))
    graph.output((fused,))
    fastmesh.compile.fusion_report(reset=True)
    report = fastmesh.compile.fuse_graph(graph, strict=True)
    [entry] = report.entries
    assert (entry.collective, entry.fused_into) == ("all_gather", "torch.symm_mem.fused_all_gather_matmul"), entry
    assert fastmesh.compile.fusion_report(reset=True).entries == report.entries


# ---- installing the pass ----


def test_enable_and_disable_keep_the_pass_installed_before():
    def user_pass(graph):
        pass

    saved = inductor_config.post_grad_custom_post_pass
    try:
        inductor_config.post_grad_custom_post_pass = user_pass
        fastmesh.compile.enable_fusion()
        installed = inductor_config.post_grad_custom_post_pass
        assert fastmesh.compile.fusion_enabled() and installed.previous is user_pass and not installed.strict
        fastmesh.compile.enable_fusion(strict=True)  # again: only strictness changes
        assert inductor_config.post_grad_custom_post_pass.previous is user_pass
        assert inductor_config.post_grad_custom_post_pass.strict
        fastmesh.compile.disable_fusion()
        assert inductor_config.post_grad_custom_post_pass is user_pass and not fastmesh.compile.fusion_enabled()

        # The cache key covers the settings, and a previous pass without a key makes the whole one uncacheable.
        inductor_config.post_grad_custom_post_pass = None
        keys = {strict: fastmesh.compile.FusionPass(strict).uuid() for strict in (False, True)}
        assert None not in keys.values() and keys[False] != keys[True]
        assert fastmesh.compile.FusionPass(False, user_pass).uuid() is None
        with pytest.raises(TypeError, match="strict must be a bool"):
            fastmesh.compile.enable_fusion(strict="yes")
    finally:
        inductor_config.post_grad_custom_post_pass = saved

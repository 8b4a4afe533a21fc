"""Fused TP styles (``fastmesh.parallel``) on 2 and 4 gloo ranks.

* A Llama-style block (``fastmesh.testing.llama``) under fastmesh's plan, torch's native sequence-parallel
  plan and unsharded: forward outputs, input and parameter gradients agree (fp32, stated tolerance).
* Small-integer linear pairs (colwise -> rowwise, biases): bit-exact against the unsharded module.
* The collectives per block, counted with CommDebugMode: exactly the native plan's, forward and backward.
* The FP8 plan's training loss tracks the high-precision plan's; compile (fullgraph, no break) equals eager.
* Bad plans raise clear errors on every rank before any collective.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from comm_counts import c10d_calls, p2p_pieces
from environment import environment
from graph_census import assert_compiled_path, graph_census
from log_capture import captured_log
from rank_pool import on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch_support import (
    NATIVE_PLAN_RUNS_UNEVEN_SEQUENCES,
    NEEDS_ROWWISE_ON_CPU,
    ROWWISE_ON_CPU,
    TO_LOCAL_KEEPS_NO_GRADIENT,
    layer_input,
)
from tp_models import LinearPair

import fastmesh
from fastmesh.fp8 import Float8Config
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel
from fastmesh.testing.llama import Block, Llama, LlamaArgs, block_plan, parallelize_llama, rope_tables

# torch < 2.13 runs only tensor-wise scales in torch._scaled_mm on CPU.
FP8_GRANULARITY = "rowwise" if ROWWISE_ON_CPU else "tensorwise"


def _tp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _seeded(seed: int):
    return torch.Generator().manual_seed(seed)


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=_seeded(seed)).to(dtype)


def _small_ints(shape, seed, low=-2, high=3, dtype=torch.float32):
    return torch.randint(low, high, shape, generator=_seeded(seed)).to(dtype)


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()].clone()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p.grad) for name, p in module.named_parameters()}


# ---- a Llama-style block: fastmesh plan == native plan == unsharded ----


def _block_cases(world: int):
    """(batch, sequence length, args): a round case and one with odd sizes that still divide by the TP degree
    (local sequence 3 or 5, head_dim 6, FFN hidden 23 or 13 per rank)."""
    return (
        (2, 4 * world, LlamaArgs(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden=96)),
        (1, (3 if world == 4 else 5) * world, LlamaArgs(dim=48, n_heads=8, n_kv_heads=4, ffn_hidden=23 * world)),
    )


def _run_block(block: nn.Module, x: torch.Tensor, rope, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    y = block(x, rope)
    (y * grad_out).sum().backward()
    return y.detach(), x.grad, _full_grads(block)


# fp32: the three runs differ only in summation order (a sequence shard's rows vs all rows in one matmul,
# the reduce-scatter's rank-order sums vs the unsharded contraction). Measured differences are ~2e-6 on
# outputs and gradients of order 1; a wrong block, scale or missing term is off by O(1).
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


@on_ranks(2, 4)
def test_llama_block_matches_native_plan_and_unsharded(world_size):
    mesh = _tp_mesh()
    for batch, seq_len, args in _block_cases(world_size):
        torch.manual_seed(0)
        unsharded = Block(args)
        x = _randn((batch, seq_len, args.dim), seed=1)
        grad_out = _randn((batch, seq_len, args.dim), seed=2)
        rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
        want_y, want_dx, want_grads = _run_block(unsharded, x, rope, grad_out)
        for plan in ("fastmesh", "native", "fastmesh-plain", "native-plain"):
            # The sequence-parallel plans take and give sequence shards, the plain ones the whole sequence.
            part = (lambda t: t) if plan.endswith("plain") else (lambda t: _shard(t, 1))
            block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(plan))
            y, dx, grads = _run_block(block, part(x), rope, part(grad_out))
            case = f"{plan} plan, batch {batch}, sequence {seq_len}, {args}"
            torch.testing.assert_close(y, part(want_y), **TOLERANCE, msg=lambda m: f"{case}: output: {m}")
            torch.testing.assert_close(dx, part(want_dx), **TOLERANCE, msg=lambda m: f"{case}: grad x: {m}")
            assert grads.keys() == want_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, want_grads[name], **TOLERANCE, msg=lambda m: f"{case}: grad {name}: {m}"
                )


@on_ranks(2)
def test_deep_copy_of_a_parallelized_block_runs_its_own_weights():
    """copy.deepcopy of a parallelized model (EMA / SWA copies, torch.optim.swa_utils.AveragedModel) gives a copy
    that computes with, and sends gradients to, its own parameters; the original is unchanged. The sibling
    linears of linears= once kept their parent's SharedGather in closures, so a copy ran the original weights."""
    mesh = _tp_mesh()
    batch, seq_len, args = _block_cases(2)[0]
    torch.manual_seed(0)
    unsharded = Block(args)
    x, grad_out = _randn((batch, seq_len, args.dim), seed=1), _randn((batch, seq_len, args.dim), seed=2)
    rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
    for plan in ("fastmesh", "fastmesh-plain"):
        part = (lambda t: t) if plan.endswith("plain") else (lambda t: _shard(t, 1))
        block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(plan))
        want_y, want_dx, want_grads = _run_block(block, part(x), rope, part(grad_out))
        block.zero_grad(set_to_none=True)

        twin = copy.deepcopy(block)
        y, dx, grads = _run_block(twin, part(x), rope, part(grad_out))  # the same weights: the same results
        torch.testing.assert_close(y, want_y, rtol=0, atol=0, msg=lambda m: f"{plan}: copy's output: {m}")
        torch.testing.assert_close(dx, want_dx, rtol=0, atol=0, msg=lambda m: f"{plan}: copy's grad x: {m}")
        assert grads.keys() == want_grads.keys(), plan
        assert all(p.grad is None for p in block.parameters()), f"{plan}: the copy's backward reached the original"

        with torch.no_grad():
            for name, parameter in twin.named_parameters():
                if not name.endswith("norm.weight"):
                    parameter.zero_()  # every linear's weight: the copy's attention and FFN add nothing
        twin.zero_grad(set_to_none=True)
        y, _, _ = _run_block(twin, part(x), rope, part(grad_out))
        torch.testing.assert_close(y, part(x), rtol=0, atol=0, msg=lambda m: f"{plan}: zeroed copy's output: {m}")
        y, _, _ = _run_block(block, part(x), rope, part(grad_out))
        torch.testing.assert_close(y, want_y, rtol=0, atol=0, msg=lambda m: f"{plan}: original after the copy: {m}")


# ---- small integers: bit-exact ----


def _integer_pair(d, hidden, dtype, seed):
    pair = LinearPair(d, hidden, dtype)
    with torch.no_grad():
        for i, p in enumerate(pair.parameters()):
            p.copy_(_small_ints(p.shape, seed + i, -1, 2, dtype))
    return pair


def _pair_plan(sequence_parallel: bool, names=("up", "down"), seq_dim: int = 1, fp8=None):
    """A colwise -> rowwise pair's styles, and each rank's part of the unsharded input and output: its sequence
    shard, or (plain TP: the activations replicated, the all-reduces fused) the whole."""
    up, down = names
    if sequence_parallel:
        styles = {
            up: FusedColwiseParallel(input_layouts=Shard(seq_dim), fp8=fp8),
            down: FusedRowwiseParallel(output_layouts=Shard(seq_dim), fp8=fp8),
        }
        return styles, lambda t: _shard(t, seq_dim)
    styles = {up: FusedColwiseParallel(fp8=fp8), down: FusedRowwiseParallel(fp8=fp8)}  # torch's defaults: plain TP
    return styles, lambda t: t


@on_ranks(2, 4)
def test_linear_pair_small_integers_bit_exact(world_size):
    """Values in {-1, 0, 1} keep every product and sum an integer below 256: exact in fp32 and bf16 whatever the
    summation order, so any difference is a wrong row, block, bias or gradient term."""
    mesh = _tp_mesh()
    cases = ((1, (2, 3 * world_size, 12)), (0, (5 * world_size, 12)))  # (sequence dim, shape)
    for dtype, (seq_dim, shape) in itertools.product((torch.float32, torch.bfloat16), cases):
        unsharded = _integer_pair(12, 2 * world_size, dtype, seed=10)
        x = _small_ints(shape, 20, -1, 2, dtype)
        grad_out = _small_ints(shape, 21, -1, 2, dtype)
        xr = x.clone().requires_grad_()
        (unsharded(xr) * grad_out).sum().backward()

        for sequence_parallel in (True, False):
            styles, part = _pair_plan(sequence_parallel, seq_dim=seq_dim)
            pair = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
            xs = part(x).clone().requires_grad_()
            y = pair(xs)
            (y * part(grad_out)).sum().backward()
            case = f"{dtype}, sequence dim {seq_dim}, sequence_parallel={sequence_parallel}"
            assert torch.equal(y, part(unsharded(x))), case
            assert torch.equal(xs.grad, part(xr.grad)), case
            for name, grad in _full_grads(pair).items():
                assert torch.equal(grad, dict(unsharded.named_parameters())[name].grad), f"{case}: grad {name}"


# ---- sequence lengths the TP degree does not divide: torch's uneven shards ----


def _uneven_lengths(world: int) -> tuple[int, ...]:
    """Lengths the TP degree does not divide: one row, a short last shard, and (on 4 ranks) a rank without rows."""
    return (1, world + 1, 2 * world - 1)


def _torchs_piece(t: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    return distribute_tensor(t, mesh, [Shard(dim)]).to_local()


@on_ranks(2, 4)
def test_uneven_sequence_small_integers_bit_exact(world_size):
    """A sequence-sharded DTensor of a length the TP degree does not divide (torch's uneven shards) through a
    biased colwise -> rowwise pair, and through LM heads (the output's gather fused, or the input's): outputs in
    torch's placements and pieces, equal to the unsharded module bit for bit, and so are all gradients."""
    mesh = _tp_mesh()
    unsharded = _integer_pair(12, 2 * world_size, torch.float32, seed=10)
    heads = {"output's gather": nn.Linear(12, 6 * world_size, bias=False), "input's gather": nn.Linear(12, 8)}
    for head in heads.values():
        with torch.no_grad():
            for i, p in enumerate(head.parameters()):
                p.copy_(_small_ints(p.shape, 30 + i, -1, 2))
    for rows, (seq_dim, batch) in itertools.product(_uneven_lengths(world_size), ((1, (2,)), (0, ()))):
        shape = (*batch, rows, 12) if seq_dim == 1 else (rows, 12)
        x = _small_ints(shape, 20, -1, 2)
        for label, module, styles, placement in (
            (
                "pair",
                unsharded,
                {
                    "up": FusedColwiseParallel(input_layouts=Shard(seq_dim)),
                    "down": FusedRowwiseParallel(output_layouts=Shard(seq_dim), use_local_output=False),
                },
                Shard(seq_dim),
            ),
            *(
                (
                    f"LM head, {how}",
                    head,
                    FusedColwiseParallel(input_layouts=Shard(seq_dim), output_layouts=Replicate()),
                    None,
                )
                for how, head in heads.items()
            ),
        ):
            case = f"{label}, input {list(shape)} sharded along dim {seq_dim} over {world_size} ranks"
            xr = x.clone().requires_grad_()
            want = module(xr)
            grad_out = _small_ints(want.shape, 21, -1, 2)
            (want * grad_out).sum().backward()
            want = want.detach()
            parallel = parallelize_module(copy.deepcopy(module), mesh, styles)
            x_d = distribute_tensor(x, mesh, [Shard(seq_dim)]).requires_grad_()
            y = parallel(layer_input(x_d))
            if placement is None:  # the head's logits: every rank's, local
                assert torch.equal(y, want), case
                (y * grad_out).sum().backward()
            else:
                assert isinstance(y, DTensor) and y.placements == (placement,) and y.shape == want.shape, case
                assert torch.equal(y.to_local(), _torchs_piece(want, mesh, seq_dim)), case
                (y.full_tensor() * grad_out).sum().backward()
            assert x_d.grad.placements == (Shard(seq_dim),), case
            assert torch.equal(x_d.grad.to_local(), _torchs_piece(xr.grad, mesh, seq_dim)), case
            for name, grad in _full_grads(parallel).items():
                assert torch.equal(grad, dict(module.named_parameters())[name].grad), f"{case}: grad {name}"
            module.zero_grad()


@on_ranks(2, 4)
def test_uneven_sequence_llama_block_matches_native_plan(world_size):
    """The Llama block on a sequence-sharded DTensor of a length the TP degree does not divide, with DTensor
    outputs: fastmesh's plan gives the native plan's placements and pieces, and both equal the unsharded block
    (outputs, input and parameter gradients; fp32 tolerance)."""
    mesh = _tp_mesh()
    args = LlamaArgs(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden=96)
    torch.manual_seed(0)
    unsharded = Block(args)
    for rows in _uneven_lengths(world_size)[1:]:
        x = _randn((2, rows, args.dim), seed=1)
        grad_out = _randn((2, rows, args.dim), seed=2)
        rope = rope_tables(rows, args.head_dim, args.rope_theta)
        want_y, want_dx, want_grads = _run_block(unsharded, x, rope, grad_out)
        unsharded.zero_grad()
        for plan in ("fastmesh", "native") if NATIVE_PLAN_RUNS_UNEVEN_SEQUENCES else ("fastmesh",):
            styles = block_plan(plan)
            rowwise = (
                FusedRowwiseParallel(output_layouts=Shard(1), use_local_output=False)
                if plan == "fastmesh"
                else RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            )
            styles.update({"attention.wo": rowwise, "feed_forward.w2": rowwise})
            block = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
            x_d = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
            y = block(layer_input(x_d), rope)
            case = f"{plan} plan, sequence {rows} over {world_size} ranks"
            assert y.placements == (Shard(1),) and y.to_local().shape == _torchs_piece(want_y, mesh, 1).shape, case
            (y.full_tensor() * grad_out).sum().backward()
            torch.testing.assert_close(y.full_tensor(), want_y, **TOLERANCE, msg=lambda m: f"{case}: output: {m}")
            torch.testing.assert_close(
                x_d.grad.full_tensor(), want_dx, **TOLERANCE, msg=lambda m: f"{case}: grad x: {m}"
            )
            for name, grad in _full_grads(block).items():
                torch.testing.assert_close(
                    grad, want_grads[name], **TOLERANCE, msg=lambda m: f"{case}: grad {name}: {m}"
                )


@on_ranks(2, timeout=300)
def test_compiled_uneven_sequence_and_features_match_eager():
    """fullgraph compile (aot_eager) of the block on a DTensor of uneven sequence shards, DTensor out, with a
    SwiGLU hidden size the TP degree does not divide: one graph, no break, the outputs and gradients of eager bit
    for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    mesh = _tp_mesh()
    args = LlamaArgs(ffn_hidden=97)
    torch.manual_seed(0)
    styles = block_plan("fastmesh")
    rowwise = FusedRowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    styles.update({"attention.wo": rowwise, "feed_forward.w2": rowwise})
    block = parallelize_module(Block(args), mesh, styles)
    rope = rope_tables(7, args.head_dim, args.rope_theta)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend=counter)):
        x = distribute_tensor(_randn((2, 7, args.dim), seed=1), mesh, [Shard(1)]).requires_grad_()
        y = fn(x, rope)
        (y.full_tensor() * _randn(y.shape, seed=2)).sum().backward()
        results.append((y.full_tensor(), x.grad.full_tensor(), _full_grads(block)))
        block.zero_grad()
    (y, dx, grads), (y_eager, dx_eager, grads_eager) = results[1], results[0]
    assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_eager[name]), name
    assert len([g for g in counter.graphs if len(g.graph.nodes)]) == 1, counter.graphs
    assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters["graph_break"]


@on_ranks(2, 4)
def test_uneven_sequence_fp8_rows_equal_the_even_runs_rows(world_size):
    """MX FP8 scales are per row (blocks along the features), so an uneven sequence's outputs and input gradient
    are the first rows of an even run whose extra rows are anything (random here): a misplaced, lost or padding
    row would show."""
    mesh = _tp_mesh()
    fp8 = Float8Config(granularity="mx")
    torch.manual_seed(0)
    unsharded = nn.Sequential(nn.Linear(64, 32 * world_size), nn.GELU(), nn.Linear(32 * world_size, 64))
    styles = {
        "0": FusedColwiseParallel(input_layouts=Shard(1), fp8=fp8),
        "2": FusedRowwiseParallel(output_layouts=Shard(1), fp8=fp8, use_local_output=False),
    }
    model = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
    for rows in _uneven_lengths(world_size):
        even = world_size * -(-rows // world_size)
        x = _randn((2, even, 64), seed=rows)
        grad_out = _randn((2, even, 64), seed=rows + 1)
        results = []
        for length in (rows, even):
            x_d = distribute_tensor(x[:, :length], mesh, [Shard(1)]).requires_grad_()
            y = model(x_d)
            (y.full_tensor() * grad_out[:, :length]).sum().backward()
            results.append((y.full_tensor(), x_d.grad.full_tensor()))
        case = f"sequence {rows} over {world_size} ranks"
        (y, dx), (y_even, dx_even) = results
        torch.testing.assert_close(y, y_even[:, :rows], rtol=1e-6, atol=1e-6, msg=lambda m: f"{case}: output: {m}")
        torch.testing.assert_close(dx, dx_even[:, :rows], rtol=1e-6, atol=1e-6, msg=lambda m: f"{case}: grad x: {m}")


# ---- in / out features the TP degree does not divide: torch's uneven weight shards ----


def _integer_head(in_features: int, vocab: int, bias: bool) -> nn.Linear:
    head = nn.Linear(in_features, vocab, bias=bias)
    with torch.no_grad():
        for i, p in enumerate(head.parameters()):
            p.copy_(_small_ints(p.shape, 30 + i, -1, 2))
    return head


@on_ranks(2, 3, 4)
def test_uneven_features_small_integers_bit_exact(world_size):
    """Hidden sizes and vocabularies the TP degree does not divide (torch's uneven weight shards; one feature over
    several ranks leaves some without any): a biased colwise -> rowwise pair in both plans, and LM heads (the
    output's gather fused, or the input's) on sequence-sharded and replicated inputs, equal the unsharded module
    bit for bit, forward and backward, with parameters placed as torch places them."""
    mesh = _tp_mesh()
    x = _small_ints((2, 2 * world_size, 12), 20, -1, 2)
    cases = []  # (label, module, styles, the input's part, the output's part)
    for hidden, sequence_parallel in itertools.product((1, 2 * world_size + 1, 3 * world_size - 1), (True, False)):
        styles, part = _pair_plan(sequence_parallel)
        label = f"pair, hidden {hidden}, sequence_parallel={sequence_parallel}"
        cases.append((label, _integer_pair(12, hidden, torch.float32, seed=10), styles, part, part))
    for bias, layout in itertools.product((False, True), (Shard(1), Replicate())):
        head = _integer_head(12, 3 * world_size + 1, bias)
        style = FusedColwiseParallel(input_layouts=layout, output_layouts=Replicate())
        part = (lambda t: _shard(t, 1)) if isinstance(layout, Shard) else (lambda t: t)
        cases.append((f"LM head, bias {bias}, input {layout}", head, style, part, lambda t: t))
    for label, module, styles, part_in, part_out in cases:
        xr = x.clone().requires_grad_()
        want = module(xr)
        grad_out = _small_ints(want.shape, 21, -1, 2)
        (want * grad_out).sum().backward()
        parallel = parallelize_module(copy.deepcopy(module), mesh, styles)
        for name, param in parallel.named_parameters():
            torch_placed = distribute_tensor(dict(module.named_parameters())[name].detach(), mesh, param.placements)
            assert torch.equal(param.to_local(), torch_placed.to_local()), f"{label}: {name}"
        xs = part_in(x).clone().requires_grad_()
        y = parallel(xs)
        (y * part_out(grad_out)).sum().backward()
        assert torch.equal(y, part_out(want.detach())), label
        assert torch.equal(xs.grad, part_in(xr.grad)), label
        for name, grad in _full_grads(parallel).items():
            assert torch.equal(grad, dict(module.named_parameters())[name].grad), f"{label}: grad {name}"
        module.zero_grad()


@on_ranks(2)
def test_replicate_dtensor_input_gives_torchs_column_shards_for_few_out_features():
    """A ``Replicate()`` DTensor input runs as torch's ColwiseParallel, down to its output layout: with fewer
    out_features than ranks DTensor replicates the product, and the style, as torch's, makes it ``Shard(-1)``
    (rank 1 holds no column of 1). Gradients equal torch's."""
    mesh = _tp_mesh()
    x = _small_ints((2, 5, 12), 20, -1, 2)
    for out_features in (1, 3):
        linear = _integer_head(12, out_features, bias=True)
        results = []
        for style in (FusedColwiseParallel(), ColwiseParallel()):
            parallel = parallelize_module(copy.deepcopy(linear), mesh, style)
            x_d = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
            y = parallel(x_d)
            (y * _torchs_piece(_small_ints((2, 5, out_features), 21, -1, 2), mesh, 2)).sum().backward()
            results.append((y, x_d.grad.full_tensor(), _full_grads(parallel)))
        (y, dx, grads), (y_torch, dx_torch, grads_torch) = results
        assert y.shape == y_torch.shape and torch.equal(y, y_torch), out_features
        assert torch.equal(dx, dx_torch), out_features
        for name, grad in grads.items():
            assert torch.equal(grad, grads_torch[name]), (out_features, name)


@on_ranks(2, timeout=300)
def test_lm_head_compiled_before_any_eager_call_traces_in_one_graph(world_size):
    """The styles' once-said choices are not logged while dynamo traces (a logger call breaks fullgraph): an LM head
    whose first call is compiled (fullgraph, aot_eager) equals the unsharded head; the choice is said by a later
    eager call."""
    from fastmesh import _log

    _log.forget(lambda key: isinstance(key, tuple) and key[:2] == ("FusedColwiseParallel", "replicated output"))
    torch._dynamo.reset()
    mesh = _tp_mesh()
    head = _integer_head(4, 3 * world_size + 1, bias=False)  # out > in, no bias: the output's gather is fused
    x = _small_ints((2, 2 * world_size, 4), 20, -1, 2)
    style = FusedColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallel = parallelize_module(copy.deepcopy(head), mesh, style)
    y = torch.compile(parallel, fullgraph=True, backend="aot_eager")(_shard(x, 1))
    assert torch.equal(y, head(x).detach())
    with captured_log("fastmesh.parallel", logging.INFO) as messages:
        parallel(_shard(x, 1))
    assert any("matmul_all_gather" in message for message in messages), messages


@on_ranks(2, 4)
def test_uneven_ffn_hidden_llama_block_matches_unsharded(world_size):
    """A SwiGLU hidden size the TP degree does not divide (97), in both fastmesh plans: the block equals the
    unsharded block, outputs and gradients (fp32 tolerance). torch's own plans fail on it (2.14: its row-wise
    matmul multiplies the padded local shard by the unpadded weight, "a and b must have same reduction dim")."""
    mesh = _tp_mesh()
    args = LlamaArgs(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden=97)
    torch.manual_seed(0)
    unsharded = Block(args)
    seq_len = 4 * world_size
    x, grad_out = _randn((2, seq_len, args.dim), seed=1), _randn((2, seq_len, args.dim), seed=2)
    rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
    want_y, want_dx, want_grads = _run_block(unsharded, x, rope, grad_out)
    for plan in ("fastmesh", "fastmesh-plain"):
        part = (lambda t: t) if plan.endswith("plain") else (lambda t: _shard(t, 1))
        block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(plan))
        y, dx, grads = _run_block(block, part(x), rope, part(grad_out))
        torch.testing.assert_close(y, part(want_y), **TOLERANCE, msg=lambda m: f"{plan}: output: {m}")
        torch.testing.assert_close(dx, part(want_dx), **TOLERANCE, msg=lambda m: f"{plan}: grad x: {m}")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], **TOLERANCE, msg=lambda m: f"{plan}: {name}: {m}")


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return (20 * torch.log10(want.norm() / (got - want).norm())).item()


@on_ranks(2, 3)
@pytest.mark.parametrize(
    "granularity", ["tensorwise", pytest.param("rowwise", marks=NEEDS_ROWWISE_ON_CPU), "mx", "block1x128"]
)
def test_uneven_features_fp8_track_high_precision(granularity, world_size):
    """FP8 pairs whose hidden size the TP degree does not divide, in both plans, against the unsharded pair in
    fp32: output and every gradient between 18 and 40 dB SQNR (measured 20-34 dB on 2 ranks); a misplaced or
    padding column would be noise (about 0 dB), a skipped quantization float32's rounding."""
    mesh = _tp_mesh()
    # MX blocks of 32 and 128x128 blocks along each rank's (padded) contraction.
    hidden = {"mx": 64 * world_size - 1, "block1x128": 128 * world_size - 5}.get(granularity, 32 * world_size + 3)
    fp8 = Float8Config(granularity=granularity)
    torch.manual_seed(0)
    unsharded = nn.Sequential(nn.Linear(128, hidden), nn.GELU(), nn.Linear(hidden, 128))
    x, grad_out = _randn((2, 4 * world_size, 128), seed=1), _randn((2, 4 * world_size, 128), seed=2)
    xr = x.clone().requires_grad_()
    want = unsharded(xr)
    (want * grad_out).sum().backward()
    for sequence_parallel in (True, False):
        styles, part = _pair_plan(sequence_parallel, names=("0", "2"), fp8=fp8)
        model = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
        xs = part(x).clone().requires_grad_()
        y = model(xs)
        (y * part(grad_out)).sum().backward()
        case = f"{granularity}, hidden {hidden}, sequence_parallel={sequence_parallel}"
        checks = {"output": (y, part(want.detach())), "grad x": (xs.grad, part(xr.grad))}
        for name, grad in _full_grads(model).items():
            checks[name] = (grad, dict(unsharded.named_parameters())[name].grad)
        # The last bias's gradient sums the output gradient, which no quantization touches: float32's rounding.
        bias_grad, bias_want = checks.pop("2.bias")
        torch.testing.assert_close(bias_grad, bias_want, msg=lambda m: f"{case}: 2.bias: {m}")
        for what, (got, expected) in checks.items():
            # Ceiling: unquantized, the output and gradients would match float32's rounding (~130 dB).
            assert 18 < _sqnr_db(got, expected) < 40, (case, what, _sqnr_db(got, expected))


# ---- single linears: layouts, DTensor in and out ----


@on_ranks(2)
def test_colwise_input_layouts_and_dtensor_outputs():
    """A sequence-sharded input (plain or DTensor, any sequence dim) is gathered into the matmul; a replicated one
    (plain with input_layouts=Replicate(), or a Replicate DTensor) runs as torch's ColwiseParallel; outputs are
    local or DTensor Shard(-1) per use_local_output. float64: the comparisons are to 1e-12."""
    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = nn.Linear(8, 6, dtype=torch.float64)
    x = _randn((4, 6, 8), seed=3, dtype=torch.float64)
    want = unsharded(x)
    cases = [  # (style keywords, input, how the input relates to x)
        ({"input_layouts": Shard(1)}, _shard(x, 1), "Shard(1) plain"),
        ({"input_layouts": Shard(0)}, _shard(x, 0), "Shard(0) plain"),
        ({}, DTensor.from_local(_shard(x, 0), mesh, [Shard(0)]), "Shard(0) DTensor"),
        ({}, x.clone(), "Replicate plain"),
        ({}, DTensor.from_local(x.clone(), mesh, [Replicate()]), "Replicate DTensor"),
    ]
    for use_local_output in (True, False):
        for keywords, given, label in cases:
            linear = parallelize_module(
                copy.deepcopy(unsharded), mesh, FusedColwiseParallel(use_local_output=use_local_output, **keywords)
            )
            out = linear(given)
            assert isinstance(out, DTensor) == (not use_local_output), label
            if not use_local_output:
                assert out.placements == (Shard(2),), (label, out.placements)
                out = out.to_local()
            torch.testing.assert_close(out, _shard(want, -1), rtol=1e-12, atol=1e-12, msg=label)


# ---- every layout torch's styles take, against torch's styles ----

# The placements torch's ColwiseParallel / RowwiseParallel take for input_layouts and output_layouts (None: the
# style's default), on a [B, S, D] activation: batch, sequence and feature shards, replicated, partial sums.
_TORCH_LAYOUTS = (None, Replicate(), Shard(0), Shard(1), Shard(-1), Shard(2), Partial())


def _annotated_part(x: torch.Tensor, placement, mesh) -> torch.Tensor:
    """This rank's plain tensor that a style whose input_layouts is ``placement`` takes as the global ``x``."""
    if isinstance(placement, Shard):
        return _torchs_piece(x, mesh, placement.dim)
    if isinstance(placement, Partial):  # partial sums: rank 0 holds x, the others zeros (exact in any order)
        return x.clone() if dist.get_rank() == 0 else torch.zeros_like(x)
    return x.clone()


_FUSED_OPS = (
    torch.ops.fastmesh.all_gather_matmul,
    torch.ops.fastmesh.matmul_reduce_scatter,
    torch.ops.fastmesh.matmul_all_reduce,
    torch.ops.fastmesh.matmul_all_gather,
)


def _layout_step(module: nn.Module, x: torch.Tensor):
    """The output as the style returns it, and after a backward of ``sum(local output * g)``: the input's and every
    parameter's full gradient, and how many fused ops ran (forward and backward)."""
    x = x.clone().requires_grad_()
    mode = CommDebugMode()
    mode.comm_registry.update(_FUSED_OPS)
    with mode:
        out = module(x)
        local = out.to_local() if isinstance(out, DTensor) else out
        (local * _small_ints(local.shape, 7)).sum().backward()
    fused = sum(n for op, n in mode.get_comm_counts().items() if op in _FUSED_OPS)
    return out, x.grad, _full_grads(module), fused


def _runs_fused(kind: str, layout_in, layout_out) -> bool:
    """Whether a plain-tensor input under these keywords runs a fused op: colwise with its input replicated or
    sequence-sharded (its output redistributed afterwards if need be), rowwise with its output replicated or
    sequence-sharded (its input redistributed first if need be)."""
    if kind == "colwise":
        return layout_in in (None, Replicate(), Shard(0), Shard(1))
    return layout_out in (None, Replicate(), Shard(0), Shard(1))


@on_ranks(2, 3)
def test_every_torch_layout_matches_torchs_styles(world_size):
    """Every combination of torch's keywords (``input_layouts`` x ``output_layouts`` x ``use_local_output``) on
    either style gives torch's result: a DTensor or not, its placement, the local shape and values, and the input's
    and parameters' gradients (float64 small integers: exact). Defaults included: ``FusedColwiseParallel()`` is
    ``ColwiseParallel()``. Where torch's style raises, fastmesh's must raise too."""
    mesh = _tp_mesh()
    colwise, rowwise = nn.Linear(12, 6 * world_size), nn.Linear(6 * world_size, 12)
    for seed, module in enumerate((colwise, rowwise)):
        module.double()
        with torch.no_grad():
            for i, p in enumerate(module.parameters()):
                p.copy_(_small_ints(p.shape, 40 + 2 * seed + i, -1, 2, torch.float64))
            # torch's rowwise adds a Partial share of the bias on each rank (bias / world): exact for multiples.
            module.bias.mul_(world_size)
    x = _small_ints((2 * world_size, 4 * world_size, 12), 41, dtype=torch.float64)
    rowwise_x = _small_ints((2 * world_size, 4 * world_size, 6 * world_size), 42, dtype=torch.float64)
    styles = (
        ("colwise", ColwiseParallel, FusedColwiseParallel, colwise, x),
        ("rowwise", RowwiseParallel, FusedRowwiseParallel, rowwise, rowwise_x),
    )
    compared = 0
    for (kind, torchs, fused, module, full_x), layout_in, layout_out, use_local_output in itertools.product(
        styles, _TORCH_LAYOUTS, _TORCH_LAYOUTS, (True, False)
    ):
        keywords = dict(input_layouts=layout_in, output_layouts=layout_out, use_local_output=use_local_output)
        case = f"{kind}, {keywords}"
        default_in = Replicate() if kind == "colwise" else Shard(-1)
        given = _annotated_part(full_x, layout_in or default_in, mesh)
        try:
            want = _layout_step(parallelize_module(copy.deepcopy(module), mesh, torchs(**keywords)), given)
        except (RuntimeError, ValueError, NotImplementedError, AssertionError) as error:  # torch cannot run it
            with pytest.raises(Exception):  # noqa: B017  (neither can fastmesh: any error, but not a result)
                _layout_step(parallelize_module(copy.deepcopy(module), mesh, fused(**keywords)), given)
            print(f"{case}: torch raises {type(error).__name__}, and so does fastmesh")
            continue
        got = _layout_step(parallelize_module(copy.deepcopy(module), mesh, fused(**keywords)), given)
        (out, dx, grads, fused_ops), (want_out, want_dx, want_grads, _) = got, want
        assert (fused_ops > 0) == _runs_fused(kind, layout_in, layout_out), (case, fused_ops)
        assert isinstance(out, DTensor) == isinstance(want_out, DTensor), case
        if isinstance(out, DTensor):
            assert out.placements == want_out.placements, (case, out.placements, want_out.placements)
            assert out.shape == want_out.shape, (case, out.shape, want_out.shape)
            out, want_out = out.to_local(), want_out.to_local()
        assert out.shape == want_out.shape, (case, out.shape, want_out.shape)
        assert torch.equal(out, want_out), case
        assert torch.equal(dx, want_dx), f"{case}: grad x"
        for name, grad in grads.items():
            assert torch.equal(grad, want_grads[name]), f"{case}: grad {name}"
        compared += 1
    assert compared >= len(styles) * 2 * 2 * 2 * 2, compared  # at least the fused layouts ran


# ---- replicated layouts: plain TP and the LM head, against torch's styles ----


def _replicated_forms():
    """(label, fastmesh's style, torch's style, how the input is given: "sequence" / "replicated" / "features")."""
    return (
        (
            "LM head, sequence-parallel",
            lambda **kw: FusedColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), **kw),
            lambda **kw: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), **kw),
            "sequence",
        ),
        (
            "LM head, plain TP",
            lambda **kw: FusedColwiseParallel(output_layouts=Replicate(), **kw),
            lambda **kw: ColwiseParallel(output_layouts=Replicate(), **kw),
            "replicated",
        ),
        (
            "colwise, plain TP",
            lambda **kw: FusedColwiseParallel(**kw),
            lambda **kw: ColwiseParallel(**kw),
            "replicated",
        ),
        (
            "rowwise, plain TP",
            lambda **kw: FusedRowwiseParallel(**kw),
            lambda **kw: RowwiseParallel(**kw),
            "features",
        ),
    )


def _count_phases(fn) -> tuple[dict, dict]:
    """(collectives per phase as the native names, the ops as issued) of ``fn``'s forward and backward."""
    mode = CommDebugMode()
    mode.comm_registry.update(_FUSED_AS)
    with mode:
        fn()
    issued = {phase: dict(mode.comm_module_counts["Global"][phase]) for phase in ("forward", "backward")}
    named = {phase: {} for phase in issued}
    for phase, ops in issued.items():
        for op, n in ops.items():
            named[phase][_op_name(op)] = named[phase].get(_op_name(op), 0) + n
    return named, issued


@on_ranks(2, 4)
def test_replicated_layouts_match_torchs_styles(world_size):
    """Each replicated-layout form on a biased linear (odd sizes, float64), against torch's style for it: the
    same output (local or DTensor, same placement), input and parameter gradients, parameter placements and
    local shapes, and the same collectives forward and backward; the plain-TP forms' all-reduce runs fused."""
    mesh = _tp_mesh()
    in_features, out_features = 3 * world_size, 5 * world_size
    x = _randn((2, 2 * world_size, in_features), seed=11, dtype=torch.float64)
    for (label, fused_style, native_style, given), use_local_output in itertools.product(
        _replicated_forms(), (True, False)
    ):
        torch.manual_seed(0)
        unsharded = nn.Linear(in_features, out_features, dtype=torch.float64)
        given_x = {"sequence": _shard(x, 1), "replicated": x.clone(), "features": _shard(x, -1)}[given]
        runs = {}
        for plan, style in (("native", native_style), ("fastmesh", fused_style)):
            linear = parallelize_module(copy.deepcopy(unsharded), mesh, style(use_local_output=use_local_output))
            xs = given_x.clone().requires_grad_()
            out = {}

            def step():
                y = linear(xs)
                out["y"] = y
                local = y.to_local() if isinstance(y, DTensor) else y
                # The same on every rank: a replicated output's gradient is replicated.
                (local * _randn(local.shape, seed=12, dtype=torch.float64)).sum().backward()

            named, issued = _count_phases(step)
            params = {n: (p.placements, p.to_local().shape, _full(p.grad)) for n, p in linear.named_parameters()}
            runs[plan] = (out["y"], xs.grad, params, named, issued)
        (y, dx, params, named, issued), (want_y, want_dx, want_params, want_named, _) = runs["fastmesh"], runs["native"]
        case = f"{label}, use_local_output={use_local_output}"
        assert isinstance(y, DTensor) == isinstance(want_y, DTensor) == (not use_local_output), case
        if not use_local_output:
            assert y.placements == want_y.placements, (case, y.placements, want_y.placements)
            y, want_y = y.to_local(), want_y.to_local()
        torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case}: output: {m}")
        torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case}: grad x: {m}")
        for name, (placements, shape, grad) in want_params.items():
            assert params[name][:2] == (placements, shape), (case, name, params[name][:2], placements, shape)
            torch.testing.assert_close(params[name][2], grad, rtol=1e-12, atol=1e-12, msg=f"{case}: grad {name}")
        # A sequence-sharded input's gathered copy is not kept: backward gathers its shard again.
        assert named == _with_shard_gathers(want_named, 1 if given == "sequence" else 0), (case, named, want_named)
        if given != "sequence":  # the all-reduce (forward rowwise, backward colwise) ran inside the matmul
            phase = "forward" if given == "features" else "backward"
            assert issued[phase].get(torch.ops.fastmesh.matmul_all_reduce) == 1, (case, issued)


@on_ranks(2, 4)
def test_replicate_dtensor_input_matches_torchs_colwise(world_size):
    """A ``Replicate()`` DTensor into ``FusedColwiseParallel(input_layouts=Replicate())`` (as after
    ``PrepareModuleInput``) runs as torch's ``ColwiseParallel(input_layouts=Replicate())``: the same output
    (local or DTensor, same placement; Shard(-1) or Replicate() out), input and parameter gradients, and the same
    collectives forward and backward, none of them fastmesh's (odd sizes, float64)."""
    mesh = _tp_mesh()
    in_features, out_features = 3 * world_size, 5 * world_size
    x = _randn((2, 3, in_features), seed=21, dtype=torch.float64)
    for output_layout, use_local_output in itertools.product((Shard(-1), Replicate()), (True, False)):
        torch.manual_seed(0)
        unsharded = nn.Linear(in_features, out_features, dtype=torch.float64)
        runs = {}
        for plan, style in (("native", ColwiseParallel), ("fastmesh", FusedColwiseParallel)):
            linear = parallelize_module(
                copy.deepcopy(unsharded),
                mesh,
                style(input_layouts=Replicate(), output_layouts=output_layout, use_local_output=use_local_output),
            )
            xs = x.clone().requires_grad_()
            out = {}

            def step():
                y = linear(DTensor.from_local(xs, mesh, [Replicate()], run_check=False))
                out["y"] = y
                local = y.to_local() if isinstance(y, DTensor) else y
                # The same on every rank where the output is replicated; this rank's columns' gradient else.
                seed = 22 if isinstance(output_layout, Replicate) else 22 + dist.get_rank()
                (local * _randn(local.shape, seed=seed, dtype=torch.float64)).sum().backward()

            named, issued = _count_phases(step)
            params = {n: (p.placements, p.to_local().shape, _full(p.grad)) for n, p in linear.named_parameters()}
            runs[plan] = (out["y"], xs.grad, params, named, issued)
        (y, dx, params, named, issued), (want_y, want_dx, want_params, want_named, want_issued) = (
            runs["fastmesh"],
            runs["native"],
        )
        case = f"output_layouts={output_layout}, use_local_output={use_local_output}"
        assert isinstance(y, DTensor) == isinstance(want_y, DTensor) == (not use_local_output), case
        if not use_local_output:
            assert y.placements == want_y.placements, (case, y.placements, want_y.placements)
            y, want_y = y.to_local(), want_y.to_local()
        torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case}: output: {m}")
        want_local = unsharded(x) if isinstance(output_layout, Replicate) else _shard(unsharded(x), -1)
        torch.testing.assert_close(y, want_local, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case}: vs unsharded: {m}")
        assert dx is not None and want_dx is not None, case
        torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case}: grad x: {m}")
        for name, (placements, shape, grad) in want_params.items():
            assert params[name][:2] == (placements, shape), (case, name, params[name][:2], placements, shape)
            torch.testing.assert_close(params[name][2], grad, rtol=1e-12, atol=1e-12, msg=f"{case}: grad {name}")
        assert named == want_named and issued == want_issued, (case, issued, want_issued)
        fused_ops = [op for ops in issued.values() for op in ops if op in _FUSED_AS]
        assert not fused_ops, (case, issued)
        # Replicate() out: one all-gather forward; its gradient comes back through the input's Partial grad,
        # all-reduced where the replicated input was made (from_local's backward here).
        forward_all_gathers = named["forward"].get("all_gather_into_tensor", 0)
        assert forward_all_gathers == (1 if isinstance(output_layout, Replicate) else 0), (case, named)


@on_ranks(2)
def test_sibling_linears_with_replicated_input_share_one_all_reduce(world_size):
    """Plain TP, ``linears=`` with ``input_layouts=Replicate()``: the linears multiply locally and their input
    gradients are summed over the ranks by one fused all-reduce (torch's ColwiseParallel on each linear
    issues one each); values and gradients equal torch's; a replicated use of the input in the parent's forward
    gets its gradient too."""
    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = _QK()
    x = _randn((2, 6, 8), seed=6, dtype=torch.float64)
    gq = _randn((2, 6, 4 // world_size), seed=8, dtype=torch.float64)
    gk = _randn((2, 6, 4 // world_size), seed=9, dtype=torch.float64)
    runs = {}
    for plan in ("native", "fastmesh"):
        if plan == "native":
            styles = {"wq": ColwiseParallel(), "wk": ColwiseParallel()}
        else:
            styles = FusedColwiseParallel(linears=("wq", "wk"), input_layouts=Replicate())
        qk = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
        xs = x.clone().requires_grad_()

        def step():
            q, k, s = qk(xs)
            ((q * gq).sum() + (k * gk).sum() + _full(s)).backward()

        named, issued = _count_phases(step)
        runs[plan] = (xs.grad, {n: _full(p.grad) for n, p in qk.named_parameters()}, named, issued)
    dx, grads, named, issued = runs["fastmesh"]
    want_dx, want_grads, want_named, _ = runs["native"]
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)
    assert want_named["backward"].get("all_reduce") == 2, want_named
    assert issued["backward"] == {torch.ops.fastmesh.matmul_all_reduce: 1}, issued
    assert named["forward"] == want_named["forward"] == {}, (named, want_named)


@on_ranks(2)
def test_an_unused_sibling_output_leaves_its_weight_without_a_gradient():
    """Plain TP, ``linears=``: a step whose loss does not use one linear's output (a branch not taken) leaves that
    weight's gradient None, as under torch's ColwiseParallel, so an optimizer skips it (a zero gradient would
    still move it by weight decay); the used linear's gradients equal torch's. High precision and FP8."""
    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = _QK()
    x = _randn((2, 6, 8), seed=6, dtype=torch.float64)
    gq = _randn((2, 6, 4 // dist.get_world_size()), seed=8, dtype=torch.float64)
    for fp8 in (None, Float8Config(granularity=FP8_GRANULARITY)):
        runs = {}
        for plan in ("native", "fastmesh"):
            if plan == "native":
                styles = {"wq": ColwiseParallel(), "wk": ColwiseParallel()}
            else:
                styles = FusedColwiseParallel(linears=("wq", "wk"), input_layouts=Replicate(), fp8=fp8)
            dtype = torch.float64 if fp8 is None else torch.float32  # FP8 casts take float32 at most
            qk = parallelize_module(copy.deepcopy(unsharded).to(dtype), mesh, styles)
            xs = x.to(dtype, copy=True).requires_grad_()
            q, _, _ = qk(xs)
            (q * gq.to(dtype)).sum().backward()
            runs[plan] = (xs.grad, {n: p.grad for n, p in qk.named_parameters()})
        (dx, grads), (want_dx, want_grads) = runs["fastmesh"], runs["native"]
        unused = grads["wk.weight"]
        assert want_grads["wk.weight"] is None, want_grads["wk.weight"]
        if TO_LOCAL_KEEPS_NO_GRADIENT:
            assert unused is None, (fp8, unused)
        else:  # torch 2.11's to_local makes the missing gradient zeros
            assert unused is None or not bool(unused.to_local().any()), (fp8, unused)
        if fp8 is None:
            torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
            want = _full(want_grads["wq.weight"])
            torch.testing.assert_close(_full(grads["wq.weight"]), want, rtol=1e-12, atol=1e-12)
        else:
            assert dx is not None and grads["wq.weight"] is not None, fp8


@on_ranks(2)
def test_sibling_linears_dtensor_outputs_match_torchs_plan():
    """``linears=`` with ``use_local_output=False``: q and k leave as ``Shard(-1)`` DTensors (attention code that
    keeps the global head count), as after torch's PrepareModuleInput + ColwiseParallel(use_local_output=False);
    the same values, gradients and collectives."""
    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = _QK()
    x = _randn((2, 6, 8), seed=6, dtype=torch.float64)
    runs = {}
    for plan in ("native", "fastmesh"):
        if plan == "native":
            styles = {
                "": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                "wq": ColwiseParallel(use_local_output=False),
                "wk": ColwiseParallel(use_local_output=False),
            }
        else:
            styles = FusedColwiseParallel(linears=("wq", "wk"), input_layouts=Shard(1), use_local_output=False)
        qk = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
        xs = _shard(x, 1).requires_grad_()
        out = {}

        def step():
            q, k, replicated = qk(xs)
            out["placements"] = (q.placements, k.placements)
            out["values"] = (q.full_tensor(), k.full_tensor())
            # A DTensor use of the outputs, as attention with global heads makes of them. The replicated one is used
            # too: torch 2.11's from_local cannot take the zeros CommDebugMode's hooks give an unused output.
            ((q * k).sum() + replicated).full_tensor().backward()

        named, _ = _count_phases(step)
        runs[plan] = (out, xs.grad, {n: _full(p.grad) for n, p in qk.named_parameters()}, named)
    (out, dx, grads, named), (want_out, want_dx, want_grads, want_named) = runs["fastmesh"], runs["native"]
    assert out["placements"] == want_out["placements"] == ((Shard(2),), (Shard(2),)), (out, want_out)
    for got, want in zip(out["values"], want_out["values"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)
    assert named["forward"] == want_named["forward"], (named, want_named)
    # Both linears' input gradient in one reduce-scatter, as torch 2.14's plan issues it (2.11's: two all-reduces),
    # and the shard both keep gathered again.
    assert named["backward"] == {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}, (named, want_named)


@pytest.mark.smoke
@on_ranks(2)
def test_bias_gradients_reach_every_rank():
    """Rowwise: the replicated bias is added once after the reduction, and its gradient (a sum over every
    rank's rows) is a DTensor whose value sums the ranks' parts; colwise: each rank's bias shard gets its
    columns' gradient."""
    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = LinearPair(8, 6, torch.float64)
    x = _randn((2, 4, 8), seed=4, dtype=torch.float64)
    grad_out = _randn((2, 4, 8), seed=5, dtype=torch.float64)
    (unsharded(x) * grad_out).sum().backward()
    pair = parallelize_module(
        copy.deepcopy(unsharded),
        mesh,
        {"up": FusedColwiseParallel(input_layouts=Shard(1)), "down": FusedRowwiseParallel(output_layouts=Shard(1))},
    )
    (pair(_shard(x, 1)) * _shard(grad_out, 1)).sum().backward()
    for name, p in unsharded.named_parameters():
        torch.testing.assert_close(
            _full(dict(pair.named_parameters())[name].grad), p.grad, rtol=1e-12, atol=1e-12, msg=name
        )


@on_ranks(2)
def test_chunks_is_a_deprecated_alias_of_pieces(world_size):
    """``chunks=2`` warns, pointing at the code that built the style, and builds what ``pieces=2`` builds: each
    fused forward moves its operand in two pieces per rank. Both keywords at once is a TypeError."""
    mesh = _tp_mesh()
    for style in (FusedColwiseParallel, FusedRowwiseParallel):
        # sequence parallel: the forward's collective is the fused op's
        layout = {"input_layouts" if style is FusedColwiseParallel else "output_layouts": Shard(1)}
        with pytest.warns(FutureWarning, match="chunks= is deprecated, use pieces=") as caught:
            deprecated = style(chunks=2, **layout)
        assert [w.filename for w in caught] == [__file__], [(w.filename, w.lineno) for w in caught]
        assert repr(deprecated) == repr(style(pieces=2, **layout)), repr(deprecated)
        _raises(TypeError, "pass pieces= only", lambda: style(pieces=2, chunks=2))

        in_features, out_features = (8, 4 * world_size) if style is FusedColwiseParallel else (4 * world_size, 8)
        linear = parallelize_module(nn.Linear(in_features, out_features), mesh, deprecated)
        x = torch.randn(2, 4, in_features // (1 if style is FusedColwiseParallel else world_size))
        linear(x)  # an op's first call on a group also checks shapes (one small all-gather): not counted
        counts = c10d_calls(lambda: linear(x))
        assert counts == p2p_pieces(world_size, 2), (style.__name__, counts)


class _QK(nn.Module):
    """A parent whose forward also uses its input outside the fused linears (a replicated computation) and
    calls one linear with another input."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(8, 4, bias=False, dtype=torch.float64)
        self.wk = nn.Linear(8, 4, bias=False, dtype=torch.float64)

    def forward(self, x, other=None):
        k = self.wk(x if other is None else other)
        return self.wq(x), k, (x * x).sum()


@on_ranks(2)
def test_sibling_linears_share_one_gather_and_other_uses_stay_correct():
    """Listed linears called with the parent's (gathered) input share one fused call, the input passed by position
    or by name (as Hugging Face calls ``self_attn(hidden_states=...)``); a replicated use of that input gets its
    gradient counted once; a listed linear called with another input runs on its own and says so."""
    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = _QK()
    x = _randn((2, 6, 8), seed=6, dtype=torch.float64)
    other = _randn((2, 6, 8), seed=7, dtype=torch.float64)
    gq, gk = _randn((2, 6, 4), seed=8, dtype=torch.float64), _randn((2, 6, 4), seed=9, dtype=torch.float64)
    for use_other, by_name in ((False, False), (False, True), (True, False)):
        xr, other_r = x.clone().requires_grad_(), other.clone().requires_grad_()
        q, k, s = unsharded(xr, other_r if use_other else None)
        ((q * gq).sum() + (k * gk).sum() + s).backward()

        qk = parallelize_module(
            copy.deepcopy(unsharded), mesh, FusedColwiseParallel(linears=("wq", "wk"), input_layouts=Shard(1))
        )
        xs, other_s = _shard(x, 1).requires_grad_(), _shard(other, 1).requires_grad_()
        mode = CommDebugMode()
        mode.comm_registry.add(torch.ops.fastmesh.all_gather_matmul)
        with captured_log("fastmesh.parallel", logging.WARNING) as messages, mode:
            q, k, s = qk(x=xs) if by_name else qk(xs, other_s if use_other else None)
        counts = mode.get_comm_counts()
        messages = " ".join(messages)
        # One gather for both linears, or a second one for wk's own input.
        assert counts[torch.ops.fastmesh.all_gather_matmul] == (2 if use_other else 1), counts
        assert ("wk was called with an input other than the gathered input" in messages) == use_other, messages
        # q, k are this rank's columns; s a Replicate DTensor (one value for the group).
        ((q * _shard(gq, -1)).sum() + (k * _shard(gk, -1)).sum() + s.to_local()).backward()
        torch.testing.assert_close(xs.grad, _shard(xr.grad, 1), rtol=1e-12, atol=1e-12)
        if use_other:
            torch.testing.assert_close(other_s.grad, _shard(other_r.grad, 1), rtol=1e-12, atol=1e-12)
        for name, p in unsharded.named_parameters():
            torch.testing.assert_close(_full(dict(qk.named_parameters())[name].grad), p.grad, rtol=1e-12, atol=1e-12)
            p.grad = None


# ---- the communication pattern ----

# What each fused op stands for in the native plan's CommDebugMode counts.
_FUSED_AS = {
    torch.ops.fastmesh.all_gather_matmul: "all_gather_into_tensor",
    torch.ops.fastmesh.matmul_reduce_scatter: "reduce_scatter_tensor",
    torch.ops.fastmesh.matmul_all_reduce: "all_reduce",
    torch.ops.fastmesh.scaled_matmul_all_reduce: "all_reduce",
}


def _op_name(op) -> str:
    return _FUSED_AS.get(op) or op.__name__


def _with_shard_gathers(named: dict, gathers: int) -> dict:
    """The native plan's collectives per phase (``named``) plus fastmesh's ``gathers`` backward all-gathers of the
    shards its column-parallel linears keep where torch's keep the gathered input (fused_collectives.py)."""
    if not gathers:
        return named
    backward = dict(named["backward"])
    backward["all_gather_into_tensor"] = backward.get("all_gather_into_tensor", 0) + gathers
    return {**named, "backward": backward}


@on_ranks(2)
def test_block_issues_exactly_the_native_plans_collectives():
    """Per block: 2 gathers (q/k/v share one, w1/w3 another) and 2 reduce-scatters forward, and the same
    backward, as the native plan, with keep_gathered; fusing hides communication, it never adds any. By default
    backward also gathers the 2 shards kept in place of the gathered inputs (plain all-gathers)."""
    mesh = _tp_mesh()
    args = LlamaArgs()
    torch.manual_seed(0)
    unsharded = Block(args)
    rope = rope_tables(8, args.head_dim, args.rope_theta)
    counts = {}
    for plan in ("native", "fastmesh", "fastmesh-keep"):
        keep = plan == "fastmesh-keep"
        block_name = plan.removesuffix("-keep")
        block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(block_name, keep_gathered=keep))
        x = _randn((2, 8 // dist.get_world_size(), args.dim), seed=1).requires_grad_()
        mode = CommDebugMode()
        mode.comm_registry.update(_FUSED_AS)
        with mode:
            block(x, rope).sum().backward()
        counts[plan] = {phase: dict(mode.comm_module_counts["Global"][phase]) for phase in ("forward", "backward")}

    def as_native(plan):
        named = {}
        for phase, issued in counts[plan].items():
            for op, n in issued.items():
                named.setdefault(phase, {})[_op_name(op)] = named.get(phase, {}).get(_op_name(op), 0) + n
        return named

    native = as_native("native")
    assert as_native("fastmesh-keep") == native, counts
    assert as_native("fastmesh") == _with_shard_gathers(native, 2), counts
    assert native["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, counts
    # ... and fastmesh's plan issued them as its fused ops, none as torch's collectives.
    fused = {torch.ops.fastmesh.all_gather_matmul: 2, torch.ops.fastmesh.matmul_reduce_scatter: 2}
    assert counts["fastmesh-keep"] == {"forward": fused, "backward": fused}, counts
    shard_gathers = {torch.ops.c10d_functional.all_gather_into_tensor: 2}
    assert counts["fastmesh"] == {"forward": fused, "backward": {**fused, **shard_gathers}}, counts

    # Plain TP: the same 2 all-reduces forward (wo, w2); backward, torch's plan all-reduces each colwise
    # linear's input gradient (q, k, v, w1, w3), fastmesh's one per parent.
    plain = {}
    for plan in ("native-plain", "fastmesh-plain"):
        block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(plan))
        x = _randn((2, 8, args.dim), seed=1).requires_grad_()
        plain[plan], issued = _count_phases(lambda: block(x, rope).sum().backward())
    assert plain["native-plain"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 5}}, plain
    assert plain["fastmesh-plain"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}, plain
    assert issued["backward"] == {torch.ops.fastmesh.matmul_all_reduce: 2}, issued


@on_ranks(2)
def test_whole_llama_under_every_plan_equals_the_unsharded_model():
    """parallelize_llama with each of block_plan's plans, the plain ones too (embedding, norm and head kept
    replicated): vocab-sharded logits equal to the unsharded model's."""
    args = LlamaArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128, vocab_size=64)
    torch.manual_seed(0)
    unsharded = Llama(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=_seeded(3))
    want = unsharded(tokens).detach()
    for plan in ("native", "fastmesh", "native-plain", "fastmesh-plain"):
        logits = parallelize_llama(copy.deepcopy(unsharded), _tp_mesh(), plan)(tokens)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), (plan, logits)
        torch.testing.assert_close(logits.full_tensor(), want, **TOLERANCE, msg=lambda m: f"{plan}: {m}")


# ---- FP8 ----


def _train_losses(plan: str, fp8, steps: int, args: LlamaArgs, batch, seq_len) -> list[float]:
    torch.manual_seed(0)
    model = Llama(args).to(torch.bfloat16)
    parallelize_llama(model, _tp_mesh(), plan, fp8=fp8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable synthetic task: predict the next token of sequences that repeat a short random pattern.
    pattern = torch.randint(0, args.vocab_size, (batch, 4), generator=_seeded(5))
    tokens = pattern.repeat(1, seq_len // 4 + 1)[:, : seq_len + 1]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
    return losses


# Measured over 20 steps (2 layers, bf16, row-wise, torch 2.14): both losses fall from 4.45 to 0.10 and the
# FP8 plan's stays within 0.008 (e5m2 backward) / 0.009 (high-precision backward) of the bf16 plan's at
# every step. The bound allows ~5x that; a wrong scale or a lost gradient term moves the loss by far more.
FP8_LOSS_BOUND = 0.05
# The MX and block forms (n_kv_heads=8, so that every linear's local width is a multiple of 32), measured the
# same way (largest gap, e5m2 / high-precision backward): block1x128 0.013 / 0.013; MX with RCEIL scales
# 0.030 / 0.024; MX with the spec's FLOOR scales 0.071 / 0.073, forward error: FLOOR maps a block's amax to
# [256, 512) * 2**e and saturates what lies above 448 (up to 1/8 of a block's largest values), which RCEIL's
# scales never do. Bounds: ~2x the measured gap.
MX_BLOCK_ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=128, vocab_size=64)


def _assert_fp8_loss_tracks(args: LlamaArgs, bound: float, **config) -> None:
    high = _train_losses("fastmesh", None, 20, args, batch=2, seq_len=16)
    for backward_in_fp8 in (True, False):
        fp8 = _train_losses(
            "fastmesh", Float8Config(backward_in_fp8=backward_in_fp8, **config), 20, args, batch=2, seq_len=16
        )
        gaps = [abs(a - b) for a, b in zip(fp8, high)]
        print(
            f"{config} backward_in_fp8={backward_in_fp8}: bf16 {high[0]:.3f} -> {high[-1]:.3f}, fp8 "
            f"{fp8[0]:.3f} -> {fp8[-1]:.3f}, largest gap {max(gaps):.3f}"
        )
        assert high[-1] < 0.5 * high[0], high  # the task is learned at all
        assert max(gaps) < bound, (config, backward_in_fp8, gaps, fp8, high)


@on_ranks(2)
def test_fp8_plan_loss_tracks_high_precision_plan():
    args = LlamaArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128, vocab_size=64)
    _assert_fp8_loss_tracks(args, FP8_LOSS_BOUND, granularity=FP8_GRANULARITY)


@pytest.mark.parametrize(
    "config, bound",
    [
        (dict(granularity="block1x128"), 0.03),
        (dict(granularity="mx", scale_rounding="rceil"), 0.06),
        (dict(granularity="mx", scale_rounding="floor"), 0.15),
    ],
    ids=["block1x128", "mx-rceil", "mx-floor"],
)
@on_ranks(2)
def test_mx_and_block_fp8_plans_train_like_the_high_precision_plan(config, bound):
    _assert_fp8_loss_tracks(MX_BLOCK_ARGS, bound, **config)


# ---- plain TP in FP8 ----

# A granularity's scale blocks along an activation's rows (0: the whole row), and the weights' granularity.
_ROW_BLOCK = {"tensorwise": 0, "rowwise": 0, "mx": 32, "block1x128": 128}
_WEIGHT_GRANULARITY = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mx": "mx", "block1x128": "block128x128"}
PLAIN_FP8_GRANULARITIES = (
    ("tensorwise", FP8_GRANULARITY, "mx", "block1x128")
    if FP8_GRANULARITY == "rowwise"
    else (
        "tensorwise",
        "mx",
        "block1x128",
    )
)


def _round_trip(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> torch.Tensor:
    """x quantized along its rows by fastmesh.fp8.quantize and dequantized by the test's own rule (each scale
    element expanded over its block by index), in float64."""
    from test_fused_block_scaled import deq

    q = fastmesh.fp8.quantize(x.detach(), dtype=dtype, granularity=granularity)
    if granularity == "block128x128":
        return deq(q.data, q.scale, (128, 128))
    return deq(q.data, q.scale, (1,) * (x.dim() - 1) + (_ROW_BLOCK[granularity],))


def _weight_round_trip(w: torch.Tensor, config: Float8Config) -> torch.Tensor:
    """A linear's weight rows [N, K] as the FP8 matmuls take them: quantized per output column of w.T."""
    return _round_trip(w, config.dtype, _WEIGHT_GRANULARITY[config.granularity])


def _all_reduced(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


class _W1W3(nn.Module):
    """Two linears reading one input, as a SwiGLU's w1 and w3 (K = 160: five MX blocks; two 1x128 blocks, one
    partial). Local widths 48 and 16 per rank: their sum, the FP8 dgrad's contraction, holds whole MX blocks."""

    def __init__(self, world: int):
        super().__init__()
        self.w1 = nn.Linear(160, 48 * world, bias=False)
        self.w3 = nn.Linear(160, 16 * world, bias=False)

    def forward(self, x):
        return self.w1(x), self.w3(x)


@on_ranks(2, 4)
def test_plain_tp_fp8_styles_match_the_quantized_reference(world_size):
    """Plain TP in FP8, every granularity, both backwards: ``FusedColwiseParallel(linears=..., input_layouts=
    Replicate(), fp8=)`` multiplies the replicated input locally and all-reduces its gradient inside one scaled
    (or, without backward_in_fp8, high-precision) matmul; ``FusedRowwiseParallel(output_layouts=Replicate(), fp8=)``
    all-reduces its FP8 product. Outputs and gradients equal a reference built from fastmesh.fp8.quantize, the
    test's own dequantization and dist.all_reduce (the same FP8 operands; float32 sums in another order)."""
    mesh, rank = _tp_mesh(), dist.get_rank()
    x = _randn((2, 6, 160), seed=1)
    for granularity, backward_in_fp8 in itertools.product(PLAIN_FP8_GRANULARITIES, (True, False)):
        config = Float8Config(granularity=granularity, backward_in_fp8=backward_in_fp8)
        case = f"{granularity}, backward_in_fp8={backward_in_fp8}"
        close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)

        # Colwise: the outputs, and the input's gradient all-reduced in one fused call.
        torch.manual_seed(0)
        unsharded = _W1W3(world_size)
        pair = parallelize_module(
            copy.deepcopy(unsharded),
            mesh,
            FusedColwiseParallel(linears=("w1", "w3"), input_layouts=Replicate(), fp8=config),
        )
        xs = x.clone().requires_grad_()
        g1, g3 = _randn((2, 6, 48), seed=2), _randn((2, 6, 16), seed=3)  # the same on every rank
        out = {}

        def colwise_step():
            out["y"] = pair(xs)
            ((out["y"][0] * g1).sum() + (out["y"][1] * g3).sum()).backward()

        named, issued = _count_phases(colwise_step)
        x_q = _round_trip(x, config.dtype, config.granularity)
        w1, w3 = _shard(unsharded.w1.weight.detach(), 0), _shard(unsharded.w3.weight.detach(), 0)
        for got, w in zip(out["y"], (w1, w3)):
            close(got, (x_q @ _weight_round_trip(w, config).t()).float(), msg=lambda m: f"{case}: colwise out: {m}")
        g, w = torch.cat((g1, g3), -1), torch.cat((w1, w3))
        if backward_in_fp8:  # the gradient per its rows (blocks along N); w [N, K] per its columns (along N)
            local = _round_trip(g, config.grad_dtype, config.granularity) @ _weight_round_trip(w.t(), config).t()
        else:
            local = g.double() @ w.double()
        close(xs.grad, _all_reduced(local.float()), msg=lambda m: f"{case}: colwise grad x: {m}")
        for name, grad in (("w1", g1), ("w3", g3)):
            want = (grad.flatten(0, 1).double().t() @ x_q.flatten(0, 1)).float()
            close(getattr(pair, name).weight.grad.to_local(), want, msg=lambda m: f"{case}: grad {name}: {m}")
        fused = torch.ops.fastmesh.scaled_matmul_all_reduce if backward_in_fp8 else torch.ops.fastmesh.matmul_all_reduce
        assert issued == {"forward": {}, "backward": {fused: 1}}, (case, issued)

        # Rowwise: the FP8 product all-reduced in one fused call, the bias added after.
        torch.manual_seed(0)
        unsharded = nn.Linear(96 * world_size, 40)
        down = parallelize_module(
            copy.deepcopy(unsharded), mesh, FusedRowwiseParallel(output_layouts=Replicate(), fp8=config)
        )
        h = _randn((2, 6, 96), seed=4 + rank).requires_grad_()  # this rank's features
        gy = _randn((2, 6, 40), seed=5)
        named, issued = _count_phases(lambda: out.update(y=down(h)) or (out["y"] * gy).sum().backward())
        w = _shard(unsharded.weight.detach(), 1)
        product = _round_trip(h, config.dtype, config.granularity) @ _weight_round_trip(w, config).t()
        close(out["y"], _all_reduced(product.float()) + unsharded.bias.detach(), msg=lambda m: f"{case}: rowwise: {m}")
        close(h.grad, gy @ w, msg=lambda m: f"{case}: rowwise grad h: {m}")  # local, in h's dtype
        assert issued == {"forward": {torch.ops.fastmesh.scaled_matmul_all_reduce: 1}, "backward": {}}, (case, issued)
        assert named["forward"] == {"all_reduce": 1}, (case, named)


@on_ranks(2)
def test_fp8_replicate_dtensor_input_leaves_its_gradient_partial():
    """A ``Replicate()`` DTensor into ``FusedColwiseParallel(fp8=)`` (as after ``PrepareModuleInput``): the FP8
    output of a replicated plain tensor, bit for bit, and an input gradient left ``Partial`` (no fastmesh
    collective; reduced where the input was made replicated, here by from_local's backward) that sums to the plain
    path's all-reduced one."""
    mesh, world = _tp_mesh(), dist.get_world_size()
    x = _randn((2, 3, 64), seed=31)
    for granularity, output_layout in itertools.product(("mx", "block1x128"), (Shard(-1), Replicate())):
        config = Float8Config(granularity=granularity)
        replicated_out = isinstance(output_layout, Replicate)
        # A replicated output's gradient is the same on every rank; a column-sharded one's is this rank's columns'.
        g = _randn((2, 3, 32 * world), seed=32) if replicated_out else _randn((2, 3, 32), seed=32 + dist.get_rank())
        torch.manual_seed(0)
        unsharded = nn.Linear(64, 32 * world)
        runs = {}
        for given in ("dtensor", "plain"):
            style = FusedColwiseParallel(input_layouts=Replicate(), output_layouts=output_layout, fp8=config)
            linear = parallelize_module(copy.deepcopy(unsharded), mesh, style)
            xs = x.clone().requires_grad_()
            out = {}

            def step():
                y = linear(DTensor.from_local(xs, mesh, [Replicate()], run_check=False) if given == "dtensor" else xs)
                out["y"] = y
                (y * g).sum().backward()

            named, issued = _count_phases(step)
            runs[given] = (out["y"], xs.grad, _full(linear.weight.grad), named, issued)
        (y, dx, dw, named, issued), (want_y, want_dx, want_dw, _, want_issued) = runs["dtensor"], runs["plain"]
        case = f"{granularity}, output_layouts={output_layout}"
        assert torch.equal(y, want_y), case
        torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: grad x: {m}")
        torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: grad w: {m}")
        assert not [op for ops in issued.values() for op in ops if op in _FUSED_AS], (case, issued)
        assert named["backward"].get("all_reduce") == 1, (case, named)
        assert torch.ops.fastmesh.scaled_matmul_all_reduce in want_issued["backward"], (case, want_issued)


# ---- compile ----


@on_ranks(2, timeout=600)  # six compiles: ~60 s here, more on a loaded machine
def test_compiled_block_matches_eager_in_one_graph():
    """fullgraph compile of the parallelized block (aot_eager and inductor, with and without activation
    checkpointing): no graph break, the outputs and gradients of eager; a new sequence length under
    dynamic=True reuses the graph."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils.checkpoint import checkpoint

    mesh = _tp_mesh()
    args = LlamaArgs()
    torch.manual_seed(0)
    block = parallelize_module(Block(args), mesh, block_plan("fastmesh"))
    world = dist.get_world_size()

    def step(fn, seq_len):
        x = _randn((2, seq_len, args.dim), seed=seq_len).chunk(world, 1)[dist.get_rank()].clone().requires_grad_()
        y = fn(x)
        y.sum().backward()
        grads = _full_grads(block)
        block.zero_grad()
        return y.detach(), x.grad, grads

    # inductor under the fixed rule (FASTMESH_TUNE=off): these sizes would plan unfused, traced as torch's
    # collectives; the census proves the fused ops are what inductor compiled.
    for backend, checkpointed in (("aot_eager", False), ("aot_eager", True), ("inductor", False)):
        fused_path = contextlib.ExitStack()
        census = fused_path.enter_context(graph_census()) if backend == "inductor" else None
        if census is not None:
            fused_path.enter_context(environment(FASTMESH_TUNE="off"))

        def run(x):
            # The tables come from x's length inside the graph, as in Llama.forward: passed in, they would
            # be a second dynamic length that dynamo can only tie to x's by specializing both.
            rope = rope_tables(x.shape[1] * world, args.head_dim, args.rope_theta)
            if checkpointed:
                return checkpoint(block, x, rope, use_reentrant=False)
            return block(x, rope)

        counter = CompileCounterWithBackend(backend)
        torch._dynamo.reset()
        compiled = torch.compile(run, fullgraph=True, backend=counter, dynamic=True)
        torch._dynamo.utils.counters.clear()
        frames_after_first = None
        with fused_path:
            for seq_len in (8, 12, 16):
                want = step(run, seq_len)
                got = step(compiled, seq_len)
                frames_after_first = frames_after_first or counter.frame_count
                tolerance = dict(rtol=0, atol=0) if backend == "aot_eager" else TOLERANCE
                for label, g, w in zip(("output", "grad x"), got[:2], want[:2]):
                    torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"{backend}: {label}: {m}")
                for name in want[2]:
                    torch.testing.assert_close(got[2][name], want[2][name], **tolerance, msg=name)
        case = f"{backend}, checkpointed={checkpointed}"
        if census is not None:
            # and in backward the two gathers of the shards kept for it (torch's collective: nothing to fuse)
            fused = ("fastmesh.all_gather_matmul", "fastmesh.matmul_reduce_scatter")
            assert_compiled_path(census, "off", fused, natives=2)
            assert census.total("native.all_gather_into_tensor", "backward") == 2, census.graphs
        # One graph (dynamo may also hand the backend an empty one when it restarts its analysis), no break,
        # and no recompile for the new lengths.
        assert len([g for g in counter.graphs if len(g.graph.nodes)]) == 1, (case, counter.graphs)
        assert not torch._dynamo.utils.counters["graph_break"], (case, torch._dynamo.utils.counters["graph_break"])
        assert counter.frame_count == frames_after_first, (case, counter.frame_count, frames_after_first)


class _PlainHead(nn.Module):
    """An MLP then an LM head (a bias-free linear) over a vocabulary of 24."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 24, bias=False)

    def forward(self, x):
        return self.head(self.down(F.gelu(self.up(x))))


@on_ranks(2, timeout=300)
def test_compiled_replicated_layouts_match_eager():
    """fullgraph compile (aot_eager and inductor) of the plain TP forms and the LM head, both plans, and plain TP in
    FP8: one graph with no break, the outputs and gradients of eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    mesh = _tp_mesh()
    torch.manual_seed(0)
    unsharded = _PlainHead()
    fp8 = Float8Config(granularity="block1x128")
    for sequence_parallel, config in ((False, None), (True, None), (False, fp8)):
        layout = Shard(1) if sequence_parallel else Replicate()
        styles = {
            "up": FusedColwiseParallel(input_layouts=layout, fp8=config),
            "down": FusedRowwiseParallel(output_layouts=layout, fp8=config),
            "head": FusedColwiseParallel(input_layouts=layout, output_layouts=Replicate(), fp8=config),
        }
        model = parallelize_module(copy.deepcopy(unsharded), mesh, styles)
        x = _randn((2, 8, 16), seed=1)
        x = _shard(x, 1) if sequence_parallel else x

        def step(fn):
            x_ = x.clone().requires_grad_()
            y = fn(x_)
            y.sum().backward()
            grads = {"output": y.detach(), "x": x_.grad, **_full_grads(model)}
            model.zero_grad()
            return grads

        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            counter = CompileCounterWithBackend(backend)
            # inductor under the fixed rule, its graphs counted: the fused ops, not torch's collectives
            fused_path = contextlib.ExitStack()
            census = fused_path.enter_context(graph_census()) if backend == "inductor" else None
            if census is not None:
                fused_path.enter_context(environment(FASTMESH_TUNE="off"))
            with fused_path:
                want, got = step(model), step(torch.compile(model, fullgraph=True, backend=counter))
            case = f"sequence_parallel={sequence_parallel}, fp8={config}, {backend}"
            if census is not None:
                fused = {
                    (False, None): ("fastmesh.matmul_all_reduce", "fastmesh.matmul_all_gather"),
                    (True, None): ("fastmesh.all_gather_matmul", "fastmesh.matmul_reduce_scatter"),
                    (False, fp8): ("fastmesh.scaled_matmul_all_reduce",),
                }[sequence_parallel, config]
                # Sequence parallel: the head gathers its product's columns (matmul_all_gather), so its input's
                # sequence gather and that gather's backward reduce-scatter are torch's collectives, and so is
                # the backward's gather of the shard "up" keeps. FP8: the head's product gather has no FP8 form
                # (matmul_all_gather is high precision): torch's gather.
                natives = 3 if sequence_parallel else 1 if config is not None else 0
                assert_compiled_path(census, "off", fused, natives=natives)
            tolerance = dict(rtol=0, atol=0) if backend == "aot_eager" else TOLERANCE
            for name in want:
                torch.testing.assert_close(got[name], want[name], **tolerance, msg=lambda m: f"{case}: {name}: {m}")
            assert counter.frame_count == 1, (case, counter.frame_count)
            assert not torch._dynamo.utils.counters["graph_break"], case


@on_ranks(2)
def test_compiled_bf16_sibling_linears_match_eager():
    """inductor, bf16: the siblings' backward concatenates their weights for one reduce-scatter. Built from
    transposed weights, inductor's CPU code filled that cat with NaNs (16-bit transposes into a cat; torch 2.11
    and 2.14, tiles of 32: hence these sizes), so the ops concatenate the weights as they lie."""
    from fastmesh.testing.llama import FeedForward

    torch.manual_seed(0)
    ffn = FeedForward(LlamaArgs(dim=128, ffn_hidden=256)).to(torch.bfloat16)
    plan = {
        "": FusedColwiseParallel(linears=("w1", "w3"), input_layouts=Shard(1)),
        "w2": FusedRowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(ffn, _tp_mesh(), plan)
    x = _shard(_randn((2, 64, 128), seed=1, dtype=torch.bfloat16), 1)

    def step(fn):
        x_ = x.clone().requires_grad_()
        fn(x_).float().sum().backward()
        grads = {"x": x_.grad, **_full_grads(ffn)}
        ffn.zero_grad()
        return grads

    torch._dynamo.reset()
    # The parent compiled itself (not only as part of an enclosing module).
    want, got = step(ffn), step(torch.compile(ffn, fullgraph=True))
    for name in want:
        assert not got[name].isnan().any(), name
        # bf16: the compiled graph rounds intermediate products differently (sums of 128-256 terms ~10).
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=0.25, msg=name)


# ---- bad plans ----


class _NotLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


def _raises(error, match, fn):
    with pytest.raises(error, match=match):
        fn()


@on_ranks(2)
def test_bad_plans_raise_clear_errors():
    mesh = _tp_mesh()
    world = dist.get_world_size()
    apply = lambda module, style: parallelize_module(module, mesh, style)  # noqa: E731

    _raises(TypeError, "must be an nn.Linear, got LayerNorm", lambda: apply(nn.LayerNorm(8), FusedColwiseParallel()))
    _raises(TypeError, "must be an nn.Linear, got LayerNorm", lambda: apply(nn.LayerNorm(8), FusedRowwiseParallel()))
    _raises(
        TypeError,
        "norm must be an nn.Linear",
        lambda: apply(_NotLinear(), FusedColwiseParallel(linears=("proj", "norm"))),
    )
    _raises(
        ValueError,
        "names 'wz', which _NotLinear does not have",
        lambda: apply(_NotLinear(), FusedColwiseParallel(linears=("proj", "wz"))),
    )
    _raises(
        TypeError,
        "apply FusedColwiseParallel\\(\\) to the linear itself",
        lambda: apply(nn.Linear(8, 8), FusedColwiseParallel(linears=("proj",))),
    )
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    _raises(
        ValueError, "must be given a 1-D device mesh", lambda: FusedColwiseParallel()._apply(nn.Linear(8, 8), mesh_2d)
    )
    _raises(
        TypeError,
        "FusedColwiseParallel: output_layouts must be a DTensor placement \\(Shard\\(dim\\), Replicate\\(\\) or "
        "Partial\\(\\)\\), got 'Shard\\(0\\)'",
        lambda: FusedColwiseParallel(output_layouts="Shard(0)"),
    )
    _raises(
        TypeError,
        "FusedRowwiseParallel: input_layouts must be a DTensor placement",
        lambda: FusedRowwiseParallel(input_layouts=1),
    )
    _raises(
        ValueError,
        "FusedRowwiseParallel: fp8 runs in the fused reduce-scatter .* output_layouts=Partial\\(sum\\) runs as torch's "
        "RowwiseParallel, in high precision",
        lambda: FusedRowwiseParallel(output_layouts=Partial(), fp8=Float8Config()),
    )
    _raises(
        ValueError,
        "fp8 granularity must be one of 'tensorwise', 'rowwise', 'mx', 'block1x128'",
        lambda: FusedColwiseParallel(fp8=Float8Config(granularity="block128x128")),
    )
    _raises(
        ValueError,
        f"FusedRowwiseParallel: fp8 granularity 'mx' needs each rank's contraction \\(the module.in_features / "
        f"{world} = 40\\) to be a multiple of 32",
        lambda: apply(nn.Linear(40 * world, 64), FusedRowwiseParallel(fp8=Float8Config(granularity="mx"))),
    )
    _raises(
        ValueError,
        f"FusedRowwiseParallel: fp8 granularity 'mx' needs each rank's contraction \\(the module.in_features = "
        f"{40 * world - 1} over {world} ranks, padded to 40\\) to be a multiple of 32",
        lambda: apply(nn.Linear(40 * world - 1, 64), FusedRowwiseParallel(fp8=Float8Config(granularity="mx"))),
    )
    _raises(
        ValueError,
        "FusedColwiseParallel: fp8 granularity 'mx' needs each rank's contraction \\(the module.in_features = 48\\)",
        lambda: apply(nn.Linear(48, 64), FusedColwiseParallel(fp8=Float8Config(granularity="mx"))),
    )
    mx_plain = FusedColwiseParallel(input_layouts=Replicate(), fp8=Float8Config(granularity="mx"))
    _raises(
        ValueError,
        "FusedColwiseParallel: fp8 granularity 'mx' with backward_in_fp8 needs the product's columns \\(N = 40",
        lambda: apply(nn.Linear(64, 40 * world), mx_plain)(torch.randn(2, 4, 64, requires_grad=True)),
    )
    mx = Float8Config(granularity="mx")
    _raises(  # sequence parallel: said by the style before the fused op, naming the linear
        ValueError,
        "FusedColwiseParallel \\(the module\\): fp8 granularity 'mx' with backward_in_fp8 needs the product's "
        "columns \\(N = 40",
        lambda: apply(nn.Linear(64, 40 * world), FusedColwiseParallel(input_layouts=Shard(1), fp8=mx))(
            torch.randn(2, 4, 64, requires_grad=True)
        ),
    )
    _raises(
        ValueError,
        "FusedRowwiseParallel \\(the module\\): fp8 granularity 'mx' with backward_in_fp8 needs the product's "
        "columns \\(N = 40",
        lambda: apply(nn.Linear(32 * world, 40), FusedRowwiseParallel(output_layouts=Shard(1), fp8=mx))(
            torch.randn(2, 4, 32, requires_grad=True)
        ),
    )
    _raises(
        TypeError,
        "fp8 cannot serve the module's dtype torch.float64",
        lambda: apply(nn.Linear(8, 8, dtype=torch.float64), FusedRowwiseParallel(fp8=Float8Config())),
    )

    # At the first forward: uneven shards that are not torch's, inputs placed otherwise.
    rowwise = apply(nn.Linear(8, 8), FusedRowwiseParallel())
    colwise = apply(nn.Linear(8, 8), FusedColwiseParallel())
    # Inputs whose features are not what the linear multiplies: said in the style's words, not the op's.
    _raises(
        ValueError,
        "FusedColwiseParallel: the module's input has 6 features \\(the last dim of shape \\[2, 4, 6\\]\\), "
        "expected 8 \\(its in_features\\)",
        lambda: colwise(torch.randn(2, 4, 6)),
    )
    _raises(
        ValueError,
        f"FusedRowwiseParallel: the module's input has 8 features .*expected {8 // world} on this rank \\(its piece "
        f"of in_features 8 over TP degree {world}",
        lambda: rowwise(torch.randn(2, 4, 8)),
    )
    shared = apply(_QK(), FusedColwiseParallel(linears=("wq", "wk")))
    _raises(
        ValueError,
        "FusedColwiseParallel: _QK's input has 6 features .*expected 8 \\(the in_features of \\('wq', 'wk'\\)\\)",
        lambda: shared(torch.randn(2, 4, 6, dtype=torch.float64)),
    )
    # Rank 0 holds 1 row of 3 and rank 1 holds 2, where torch's pieces are 2 then 1: both ranks raise.
    not_torchs = DTensor.from_local(
        torch.randn(2, 1 + dist.get_rank(), 8),
        mesh,
        [Shard(1)],
        run_check=False,
        shape=torch.Size((2, 3, 8)),
        stride=(24, 8, 1),
    )
    _raises(
        ValueError,
        f"FusedColwiseParallel: the input is sharded unevenly along dim 1 \\(3 rows over {world} ranks\\), so rank "
        f"{dist.get_rank()} must hold",
        lambda: colwise(not_torchs),
    )
    _raises(
        ValueError,
        "FusedColwiseParallel: input_layouts Shard\\(3\\) names no dim of the 3-D tensor of shape \\(2, 3, 8\\)",
        lambda: apply(nn.Linear(8, 8), FusedColwiseParallel(input_layouts=Shard(3)))(torch.randn(2, 3, 8)),
    )
    _raises(
        ValueError,
        "FusedRowwiseParallel: output_layouts Shard\\(-4\\) names no dim of the 3-D tensor",
        lambda: apply(nn.Linear(8, 8), FusedRowwiseParallel(output_layouts=Shard(-4)))(torch.randn(2, 3, 8 // world)),
    )
    # Every rank raised before any collective: the group still works.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world

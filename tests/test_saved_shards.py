"""What the fused column-parallel path keeps for backward: the input's shard, gathered again in backward (Megatron-LM's
sequence parallelism), unless ``keep_gathered=True`` keeps the gathered input; eager and compiled.

Counted with ``saved_tensors_hooks`` (tests/saved_bytes.py: each saved storage once, weights left out), against the
formula: the shard's bytes (FP8: its FP8 data and its scale), or ``W`` times them with ``keep_gathered``. The
gradients are the same either way, bit for bit: the second gather gives the same gathered input, which one multiply
per weight turns into the same weight gradients.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from environment import environment
from fastmesh.kernels import fused_reference as ref
from graph_census import graph_census
from rank_pool import on_ranks
from torch.distributed.tensor import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch_support import ROWWISE_ON_CPU

import fastmesh
import fastmesh.compile
from fastmesh.fp8 import Float8Config
from fastmesh.ops._fp8_operands import quantize_rows
from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables
from fastmesh.testing.saved_bytes import saved_bytes

FP8_GRANULARITIES = ("tensorwise", "mx") + (("rowwise",) if ROWWISE_ON_CPU else ())


def _randn(shape, seed, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _call(a_shard, bs, gather_dim, keep_gathered, return_a=False, fp8=None, compiled=False):
    """One all_gather_matmul, forward and backward (gradient g_i of output i): (saved bytes, outputs, gradients)."""
    a_shard = a_shard.clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in bs]

    def fn(a, *bs):
        gathered, outs = fastmesh.all_gather_matmul(
            a, list(bs), gather_dim, return_a=return_a, fp8=fp8, keep_gathered=keep_gathered
        )
        return outs if gathered is None else [gathered * 2, *outs]  # a use that saves nothing

    run = torch.compile(fn, fullgraph=True) if compiled else fn
    with saved_bytes(excluded=bs) as saved:
        outs = run(a_shard, *bs)
    sum((out * _randn(out.shape, 40 + i, out.dtype)).sum() for i, out in enumerate(outs)).backward()
    return saved.total, [o.detach() for o in outs], [a_shard.grad, *(b.grad for b in bs)]


def _fp8_shard_bytes(a_shard, config, world: int, keep_gathered: bool) -> int:
    """The FP8 shard's data and scale (tensor-wise: 0-d), or with keep_gathered the gathered data and its scales,
    one row of the shard's scale groups per gathered row (tensor-wise: one each)."""
    data, scale = quantize_rows(a_shard, config.dtype, config)
    if not keep_gathered:
        return data.numel() * data.element_size() + scale.numel() * scale.element_size()
    rows = data.numel() // data.shape[-1]
    groups = 1 if scale.dim() == 0 else scale.shape[-1]
    return world * (data.numel() * data.element_size() + rows * groups * scale.element_size())


def _assert_same_gradients(got, want, case):
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{case}: gradient {i} differs, max diff {(g.float() - w.float()).abs().max()}"


@on_ranks(2, 3, 4)
def test_all_gather_matmul_saves_the_shard_and_gives_the_same_gradients(world_size):
    rank = dist.get_rank()
    for dtype, gather_dim, nbs, return_a in itertools.product(
        (torch.float32, torch.bfloat16), (0, 1), (1, 2), (False, True)
    ):
        a_shard = _randn((2, 3, 16), seed=rank, dtype=dtype)
        bs = [_randn((16, 8 + 4 * i), seed=10 + i, dtype=dtype) for i in range(nbs)]
        case = f"{dtype}, gather_dim {gather_dim}, {nbs} bs, return_a {return_a}"
        results = {}
        for keep in (False, True):
            saved, outs, grads = _call(a_shard, bs, gather_dim, keep, return_a)
            shard = a_shard.numel() * a_shard.element_size()
            assert saved == (world_size if keep else 1) * shard, f"{case}, keep_gathered {keep}: saved {saved}"
            results[keep] = outs, grads
        for got, want in zip(results[False][0], results[True][0]):
            assert torch.equal(got, want), case
        _assert_same_gradients(results[False][1], results[True][1], case)
        if dtype != torch.float32:
            continue
        # and they are the unfused sequence's gradients (up to summation order: float32 only)
        a, bs_ref = a_shard.clone().requires_grad_(), [b.clone().requires_grad_() for b in bs]
        gathered, outs = ref.all_gather_matmul(a, bs_ref, gather_dim, dist.group.WORLD.group_name, return_a=return_a)
        outs = outs if gathered is None else [gathered * 2, *outs]
        sum((out * _randn(out.shape, 40 + i, out.dtype)).sum() for i, out in enumerate(outs)).backward()
        for got, want in zip(results[False][1], [a.grad, *(b.grad for b in bs_ref)]):
            torch.testing.assert_close(got, want, msg=lambda m: f"{case}: {m}")


@on_ranks(2, 3)
def test_a_weight_without_gradient_saves_nothing_of_the_input(world_size):
    """Only the weights' gradients need the input: with frozen weights neither the shard nor the gathered input is
    kept, and backward gathers nothing."""
    a_shard = _randn((4, 16), seed=dist.get_rank())
    for keep in (False, True):
        a = a_shard.clone().requires_grad_()
        b = _randn((16, 8), seed=3)
        with saved_bytes(excluded=[b]) as saved:
            _, (out,) = fastmesh.all_gather_matmul(a, [b], 0, keep_gathered=keep)
        assert saved.total == 0, f"keep_gathered {keep}: saved {saved.storages}"
        out.sum().backward()
        assert a.grad is not None


@on_ranks(2, 3, 4)
def test_fp8_forms_save_the_fp8_shard_and_give_the_same_gradients(world_size):
    rank = dist.get_rank()
    for granularity, backward_in_fp8 in itertools.product(FP8_GRANULARITIES, (False, True)):
        config = Float8Config(granularity=granularity, backward_in_fp8=backward_in_fp8)
        a_shard = _randn((2, 4, 64), seed=rank)
        bs = [_randn((64, 32), seed=11), _randn((64, 64), seed=12)]
        case = f"{granularity}, backward_in_fp8 {backward_in_fp8}"
        results = {}
        for keep in (False, True):
            saved, outs, grads = _call(a_shard, bs, 1, keep, fp8=config)
            want = _fp8_shard_bytes(a_shard, config, world_size, keep)
            assert saved == want, f"{case}, keep_gathered {keep}: saved {saved}, want {want}"
            results[keep] = outs, grads
        for got, want in zip(results[False][0], results[True][0]):
            assert torch.equal(got, want), case
        _assert_same_gradients(results[False][1], results[True][1], case)


@on_ranks(2)
def test_compiled_op_saves_the_shard(world_size):
    """Compiled, the partitioner keeps the second gather in backward (fastmesh/ops/backward_gathers.py) and saves
    the shard, not the gathered input; the compiled gradients are the eager ones."""
    torch._dynamo.reset()
    a_shard = _randn((2, 4, 16), seed=dist.get_rank())
    bs = [_randn((16, 8), seed=10), _randn((16, 12), seed=11)]
    shard = a_shard.numel() * a_shard.element_size()
    with environment(FASTMESH_TUNE="off"), graph_census() as census:
        for keep in (False, True):
            _, _, eager = _call(a_shard, bs, 1, keep)
            saved, _, compiled = _call(a_shard, bs, 1, keep, compiled=True)
            assert saved == (world_size if keep else 1) * shard, f"keep_gathered {keep}: saved {saved}"
            for got, want in zip(compiled, eager):
                torch.testing.assert_close(got, want)
            torch._dynamo.reset()
    # keep_gathered=False: the shard's gather again, in the backward graph; True: none
    assert census.total("native.all_gather_into_tensor", "forward") == 0, census.graphs
    assert census.total("native.all_gather_into_tensor", "backward") == 1, census.graphs
    # FP8: the FP8 shard and its scale, compiled as eager
    config = Float8Config(granularity="tensorwise")
    a_shard = _randn((2, 4, 64), seed=dist.get_rank())
    bs = [_randn((64, 32), seed=11)]
    with environment(FASTMESH_TUNE="off"):
        saved, _, compiled = _call(a_shard, bs, 1, False, fp8=config, compiled=True)
        torch._dynamo.reset()
    _, _, eager = _call(a_shard, bs, 1, False, fp8=config)
    # Compiled, the partitioner also keeps the FP8 weight (transposed) and its scale for the input gradient's
    # multiply, quantized once in forward rather than again in backward: bytes of the weight, not the input.
    fp8_weight = bs[0].numel() + 4
    assert saved - fp8_weight == _fp8_shard_bytes(a_shard, config, world_size, False), saved
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


@on_ranks(2)
def test_compiled_op_planned_unfused_saves_the_shard(world_size):
    """Under the default planner these sizes plan unfused, and inductor traces the op as torch's gather and matmuls;
    AOTAutograd's CSE merges that gather with the backward's gather of the same shard. The merged gather still runs
    again in backward: the shard is saved (the gathered input with keep_gathered), the gradients are eager's."""
    a_shard = _randn((2, 4, 16), seed=dist.get_rank())
    bs = [_randn((16, 8), seed=10), _randn((16, 12), seed=11)]
    shard = a_shard.numel() * a_shard.element_size()
    with environment(FASTMESH_TUNE="model"):
        for keep in (False, True):
            torch._dynamo.reset()
            _, _, eager = _call(a_shard, bs, 1, keep)
            with graph_census() as census:
                saved, _, compiled = _call(a_shard, bs, 1, keep, compiled=True)
            assert saved == (world_size if keep else 1) * shard, f"keep_gathered {keep}: saved {saved}"
            for got, want in zip(compiled, eager):
                torch.testing.assert_close(got, want)
            # traced unfused: torch's gather in forward, and again in backward unless the gathered input is kept
            assert census.total("fastmesh.all_gather_matmul") == 0, census.graphs
            assert census.total("native.all_gather_into_tensor", "forward") == 1, census.graphs
            assert census.total("native.all_gather_into_tensor", "backward") == (0 if keep else 1), census.graphs
    torch._dynamo.reset()


@on_ranks(2, 3)
def test_styles_save_the_shard(world_size):
    """FusedColwiseParallel on a sequence-sharded input and ColumnParallelLinear(sequence_parallel=True) keep the
    input's shard (keep_gathered=True: the gathered input); biased, odd sizes; the same gradients either way."""
    from torch.distributed.tensor import Shard

    from fastmesh.nn import ColumnParallelLinear
    from fastmesh.parallel import FusedColwiseParallel

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 5 * world_size)
    x = _randn((2, 3, 12), seed=dist.get_rank())  # this rank's 3 rows of a [2, 3 * W, 12] input
    shard = x.numel() * x.element_size()

    def modules(keep):
        style = FusedColwiseParallel(input_layouts=Shard(1), keep_gathered=keep)
        yield "FusedColwiseParallel", parallelize_module(copy.deepcopy(linear), mesh, style), x
        column = ColumnParallelLinear.from_linear(linear, sequence_parallel=True, keep_gathered=keep)
        yield "ColumnParallelLinear", column, x.transpose(0, 1).contiguous()  # Megatron's [S, B, H]

    results = {}
    for keep in (False, True):
        for name, module, given in modules(keep):
            given = given.clone().requires_grad_()
            with saved_bytes(excluded=list(module.parameters())) as saved:
                out = module(given)
            out = out[0] if isinstance(out, tuple) else out
            assert saved.total == (world_size if keep else 1) * shard, f"{name}, keep_gathered {keep}: {saved.total}"
            (out * _randn(out.shape, seed=5 + dist.get_rank())).sum().backward()
            results[name, keep] = [given.grad] + [_local(p.grad) for p in module.parameters()]
    for name in ("FusedColwiseParallel", "ColumnParallelLinear"):
        _assert_same_gradients(results[name, False], results[name, True], name)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---- a sequence-parallel Llama block: fastmesh's plan against torch's ----


def _block_saved_bytes(world: int, compiled, plans=("native", "fastmesh", "fastmesh-keep")):
    """Saved bytes and gradients of one Llama block's step under each plan (``compiled``: False for eager, else
    torch.compile's options), and a gathered input's bytes less its shard's (each of the block's two gathered
    inputs: attention's, feed-forward's). A plan "-keep" keeps the gathered inputs."""
    args = LlamaArgs(dim=48, n_heads=6 if world == 3 else 8, n_kv_heads=3 if world == 3 else 4, ffn_hidden=24 * world)
    batch, seq_len = 2, 4 * world
    torch.manual_seed(0)
    unsharded = Block(args)
    rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
    x = _randn((batch, seq_len, args.dim), seed=1).chunk(world, 1)[dist.get_rank()].contiguous()
    grad_out = _randn(x.shape, seed=2)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for plan in plans:
        name, keep = plan.removesuffix("-keep"), plan.endswith("-keep")
        block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(name, keep_gathered=keep))
        run = torch.compile(block, fullgraph=True, options=compiled) if compiled is not False else block
        x_in = x.clone().requires_grad_()
        with saved_bytes(excluded=list(block.parameters())) as saved:
            y = run(x_in, rope)
        (y * grad_out).sum().backward()
        grads = [x_in.grad] + [p.grad.to_local() for p in block.parameters()]
        results[plan] = saved.total, grads
        torch._dynamo.reset()
    shard = x.numel() * x.element_size()
    return results, (world - 1) * shard


def _check_block(world: int, compiled: bool):
    results, gathered_less_shard = _block_saved_bytes(world, compiled)
    (native, _), (fused, grads), (kept, kept_grads) = (results[p] for p in ("native", "fastmesh", "fastmesh-keep"))
    case = f"{world} ranks, {'compiled' if compiled else 'eager'}: native {native}, fastmesh {fused}, kept {kept}"
    # exactly the two gathered inputs' bytes less their shards' apart
    assert kept - fused == 2 * gathered_less_shard, case
    # the target: >= 90% of (gathered - shard) less than torch's native plan, for each gathered input
    assert native - fused >= 0.9 * 2 * gathered_less_shard, case
    _assert_same_gradients(grads, kept_grads, case)


@on_ranks(2, 3, 4)
def test_sequence_parallel_block_saves_shards_not_gathered_inputs(world_size):
    _check_block(world_size, compiled=False)


@on_ranks(2)
def test_compiled_sequence_parallel_block_saves_shards(world_size):
    with environment(FASTMESH_TUNE="off"):
        _check_block(world_size, compiled=None)


@on_ranks(2)
def test_fusion_pass_keeps_the_native_plans_shards(world_size):
    """The native plan compiled with the fusion pass saves the shards (the gathers run again in backward, left
    unfused by design), keep_gathered=True the gathered inputs, as torch; the gradients are the same."""
    with environment(FASTMESH_TUNE="off"):
        results = {}
        for keep in (False, True):
            options = fastmesh.compile.fusion_options(strict=True, keep_gathered=keep)
            fastmesh.compile.fusion_report(reset=True)
            results[keep], gathered_less_shard = _block_saved_bytes(world_size, options, plans=("native",))
            report = fastmesh.compile.fusion_report()
            by_design = [e for e in report.entries if e.by_design]
            assert len(by_design) == (0 if keep else 2), str(report)
            assert all(e.graph_kind == "backward" and e.collective == "all_gather" for e in by_design), str(report)
    (shards, grads), (kept, kept_grads) = results[False]["native"], results[True]["native"]
    # each of the two gathered inputs saved as its shard: at least 90% of (gathered - shard) less
    assert kept - shards >= 0.9 * 2 * gathered_less_shard, (shards, kept, gathered_less_shard)
    for got, want in zip(grads, kept_grads):
        torch.testing.assert_close(got, want)

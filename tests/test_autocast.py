"""Under ``torch.autocast`` the fused ops and the TP styles multiply in the region's dtype, as ``F.linear`` does
(``fastmesh/ops/autocast.py``), on 2 gloo ranks.

Small-integer operands are exact in bfloat16 and float16 and their products and sums stay exact, so an op under
autocast must equal, bit for bit, the same op called outside autocast on operands cast to the region's dtype; the
gradients of the float32 leaves are the cast-back gradients of that call. The Llama block compares with torch's
native plans under the same region, within bfloat16's rounding.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from rank_pool import on_ranks
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tp_models import LinearPair

import fastmesh
from fastmesh.fp8 import Float8Config
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel
from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables

REGION_DTYPES = (torch.bfloat16, torch.float16)


def _small_ints(shape, seed, dtype=torch.float32):
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _calls(group: str, world: int):
    """(name, operand shapes, fn(a, b) -> output): each matmul op through its front and as a torch op."""
    ops = torch.ops.fastmesh
    return [
        ("all_gather_matmul", ((4, 8), (8, 6)), lambda a, b: fastmesh.all_gather_matmul(a, [b], 0, group=group)[1][0]),
        ("torch.ops all_gather_matmul", ((4, 8), (8, 6)), lambda a, b: ops.all_gather_matmul(a, [b], 0, group)[1][0]),
        (
            "matmul_reduce_scatter",
            ((4 * world, 8), (8, 6)),
            lambda a, b: fastmesh.matmul_reduce_scatter(a, b, 0, group=group),
        ),
        (
            "torch.ops matmul_reduce_scatter",
            ((4 * world, 8), (8, 6)),
            lambda a, b: ops.matmul_reduce_scatter(a, b, 0, "sum", group),
        ),
        ("matmul_all_reduce", ((5, 8), (8, 6)), lambda a, b: fastmesh.matmul_all_reduce(a, b, group=group)),
        ("torch.ops matmul_all_reduce", ((5, 8), (8, 6)), lambda a, b: ops.matmul_all_reduce(a, b, "sum", group)),
        ("matmul_all_gather", ((5, 8), (8, 6)), lambda a, b: fastmesh.matmul_all_gather(a, b, group=group)),
        ("torch.ops matmul_all_gather", ((5, 8), (8, 6)), lambda a, b: ops.matmul_all_gather(a, b, group)),
        (
            "matmul_all_reduce fp8=mx",
            ((4, 64), (64, 32)),
            lambda a, b: fastmesh.matmul_all_reduce(a, b, group=group, fp8=Float8Config(granularity="mx")),
        ),
    ]


def _run(fn, a, b, region: torch.dtype | None):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    if region is None:
        out = fn(a, b)
    else:
        with torch.autocast("cpu", dtype=region):
            out = fn(a, b)
    out.backward(_small_ints(out.shape, 99, out.dtype))
    return out.detach(), a.grad, b.grad


@on_ranks(2)
def test_ops_multiply_in_the_regions_dtype_and_leave_float64_alone():
    world, group = dist.get_world_size(), fastmesh.group_name(dist.group.WORLD)
    rank = dist.get_rank()
    for name, (a_shape, b_shape), fn in _calls(group, world):
        a, b = _small_ints(a_shape, 1 + rank), _small_ints(b_shape, 7)
        for region in REGION_DTYPES:
            case = f"{name} under autocast({region})"
            out, grad_a, grad_b = _run(fn, a, b, region)
            assert out.dtype == region, f"{case}: output {out.dtype}"
            want, want_a, want_b = _run(fn, a.to(region), b.to(region), None)
            torch.testing.assert_close(out, want, rtol=0, atol=0, msg=lambda m: f"{case}: output: {m}")
            assert grad_a.dtype == grad_b.dtype == torch.float32, f"{case}: leaf gradients {grad_a.dtype}"
            torch.testing.assert_close(grad_a, want_a.float(), rtol=0, atol=0, msg=lambda m: f"{case}: grad a: {m}")
            torch.testing.assert_close(grad_b, want_b.float(), rtol=0, atol=0, msg=lambda m: f"{case}: grad b: {m}")
        if "fp8" not in name:  # autocast leaves float64 as it is (FP8 takes no float64)
            out, _, _ = _run(fn, a.double(), b.double(), torch.bfloat16)
            want, _, _ = _run(fn, a.double(), b.double(), None)
            assert out.dtype == torch.float64, f"{name}: float64 under autocast gave {out.dtype}"
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@on_ranks(2)
def test_compiled_front_under_autocast_equals_eager():
    group, rank = fastmesh.group_name(dist.group.WORLD), dist.get_rank()
    a, b = _small_ints((5, 8), 1 + rank), _small_ints((8, 6), 7)

    def fn(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fastmesh.matmul_all_reduce(a, b, group=group)

    want = fn(a, b)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(a, b)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _assert_as_accurate(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """``got`` (fastmesh under autocast) is about as far from the float64 result as ``want`` (torch's plan under the
    same region): the two differ in summation order and in where partial sums are rounded to bfloat16, so neither
    is closer to the other than to the exact result; a wrong or missing term would be off by far more."""
    exact = exact.double()
    error, want_error = ((t.double() - exact).abs().max().item() for t in (got, want))
    bound = 3 * want_error + 1e-6 * exact.abs().max().item()
    assert error <= bound, f"{what}: max error {error:.3g} against torch's {want_error:.3g}"


def _block_run(block, x, rope, grad_out):
    """(output, input gradient, full parameter gradients, {sub-block: its output's dtype})."""
    x = x.clone().requires_grad_()
    dtypes = {}
    for name in ("attention", "feed_forward"):
        block.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: dtypes.__setitem__(name, out.dtype)
        )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x, rope)
    (y.float() * grad_out).sum().backward()
    grads = {}
    for name, parameter in block.named_parameters():
        grad = parameter.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return y.detach(), x.grad, grads, dtypes


@on_ranks(2)
def test_llama_block_under_autocast_matches_the_native_plan():
    """The block's attention runs in bfloat16 under autocast, so ``wo`` gets a bfloat16 input beside a float32
    weight; the attention's and the feed-forward's outputs are bfloat16, as under torch's plans."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    args = LlamaArgs(dim=64, n_heads=8, n_kv_heads=4, ffn_hidden=96)
    batch, seq_len = 2, 4 * world
    torch.manual_seed(0)
    unsharded = Block(args)
    x = torch.randn(batch, seq_len, args.dim, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(batch, seq_len, args.dim, generator=torch.Generator().manual_seed(2))
    rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
    exact = copy.deepcopy(unsharded).double()
    exact_x = x.double().requires_grad_()
    (exact(exact_x, tuple(t.double() for t in rope)) * grad_out.double()).sum().backward()
    exact_grads = {name: p.grad for name, p in exact.named_parameters()}
    for fused, native in (("fastmesh", "native"), ("fastmesh-plain", "native-plain")):

        def part(t, plan=fused):
            return t if plan.endswith("plain") else t.chunk(world, 1)[rank]

        runs = {}
        for plan in (fused, native):
            block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(plan))
            runs[plan] = _block_run(block, part(x), rope, part(grad_out))
        (y, dx, grads, dtypes), (want_y, want_dx, want_grads, want_dtypes) = runs[fused], runs[native]
        assert dtypes == want_dtypes == {"attention": torch.bfloat16, "feed_forward": torch.bfloat16}, (fused, dtypes)
        assert y.dtype == want_y.dtype, f"{fused}: output {y.dtype}, {native}: {want_y.dtype}"  # the residual's
        exact_y = part(exact(x.double(), tuple(t.double() for t in rope)).detach())
        _assert_as_accurate(y, want_y, exact_y, f"{fused}: output")
        _assert_as_accurate(dx, want_dx, part(exact_x.grad), f"{fused}: grad x")
        assert grads.keys() == want_grads.keys() == exact_grads.keys()
        for name, grad in grads.items():
            assert grad.dtype == want_grads[name].dtype == torch.float32, name
            _assert_as_accurate(grad, want_grads[name], exact_grads[name], f"{fused}: grad {name}")


@on_ranks(2)
def test_biased_linears_under_autocast_match_torchs_styles():
    """Biases are added in the product's dtype, as F.linear adds them under autocast: a biased colwise -> rowwise
    pair gives torch's output dtype and values, sequence-parallel and plain."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    unsharded = LinearPair(16, 32, torch.float32)
    x = torch.randn(2, 4 * world, 16, generator=torch.Generator().manual_seed(1))
    plans = {
        "sequence-parallel": (
            {"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))},
            {"up": FusedColwiseParallel(input_layouts=Shard(1)), "down": FusedRowwiseParallel(output_layouts=Shard(1))},
            x.chunk(world, 1)[rank],
        ),
        "plain": (
            {"up": ColwiseParallel(), "down": RowwiseParallel()},
            {"up": FusedColwiseParallel(), "down": FusedRowwiseParallel()},
            x,
        ),
    }
    exact = copy.deepcopy(unsharded).double()
    exact_x = x.double().requires_grad_()
    exact_y = exact(exact_x)
    exact_y.pow(2).sum().backward()
    for case, (native, fused, local_x) in plans.items():

        def part(t, case=case):
            return t if case == "plain" else t.chunk(world, 1)[rank]

        runs = []
        for plan in (native, fused):
            pair = parallelize_module(copy.deepcopy(unsharded), mesh, plan)
            xs = local_x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = pair(xs)
            y.float().pow(2).sum().backward()
            grads = {n: p.grad.full_tensor() for n, p in pair.named_parameters()}
            runs.append((y.detach(), xs.grad, grads))
        (want_y, want_dx, want_grads), (y, dx, grads) = runs
        assert y.dtype == want_y.dtype == torch.bfloat16, (case, y.dtype, want_y.dtype)
        _assert_as_accurate(y, want_y, part(exact_y.detach()), f"{case}: output")
        _assert_as_accurate(dx, want_dx, part(exact_x.grad), f"{case}: grad x")
        for name, p in exact.named_parameters():
            _assert_as_accurate(grads[name], want_grads[name], p.grad, f"{case}: grad {name}")

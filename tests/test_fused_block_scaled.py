"""MX and block-scaled FP8 forms of the fused collectives, on 2 and 4 gloo ranks.

* The ops against a dequantize-gather-multiply reference, bit for bit: FP8 data holding small integers and
  power-of-two scales (E8M0 for MX, float32 powers of two for block) make every dequantized value, product and
  sum exact, so any difference is a wrong block, scale or row. The reference expands each scale over its block by
  index (``element // block``), not by the library's rule.
* The fronts' ``fp8=Float8Config(granularity="mx" | "block1x128")`` against a quantize-gather-dequantize-matmul
  reference written from ``fastmesh.fp8.quantize`` and torch's collectives, forward and backward (both
  ``backward_in_fp8``): the same arithmetic but for the order of float32 sums.
* Bad input: K or N that MX blocks do not divide, scales of the wrong shape or dtype, named in the error.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.distributed as dist
from fastmesh.kernels import fused_reference as ref
from log_capture import captured_log
from rank_pool import on_ranks
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh import _log
from fastmesh.fp8 import Float8Config

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
K, N = 160, 136  # 5 MX blocks; 2 block-scale groups, the last one partial, along K and along N


def _world_name() -> str:
    return dist.group.WORLD.group_name


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_ints(shape, seed) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=_generator(seed)).float().to(E4M3)


def scale_of(layout: str, shape, seed) -> torch.Tensor:
    """Power-of-two scales 2**-3 .. 2**2 of `shape` in the layout's dtype."""
    exponents = torch.randint(-3, 3, shape, generator=_generator(seed))
    if layout == "mx":
        return (exponents + 127).to(torch.uint8).view(E8M0)
    return torch.pow(2.0, exponents.float())


def a_scale_shape(layout: str, a_shape) -> list[int]:
    k = a_shape[-1]
    last = {"tensorwise": None, "rowwise": 1, "mx": k // 32, "block": -(-k // 128)}[layout]
    return [] if last is None else list(a_shape[:-1]) + [last]


def b_scale_shape(layout: str, k: int, n: int) -> list[int]:
    return {"tensorwise": [], "rowwise": [1, n], "mx": [k // 32, n], "block": [-(-k // 128), -(-n // 128)]}[layout]


def a_blocks(layout: str, dims: int) -> tuple[int, ...]:
    """Elements per scale along each dim of a (0: the whole dim)."""
    return (1,) * (dims - 1) + ({"tensorwise": 0, "rowwise": 0, "mx": 32, "block": 128}[layout],)


def b_blocks(layout: str) -> tuple[int, int]:
    return {"tensorwise": (0, 0), "rowwise": (0, 1), "mx": (32, 1), "block": (128, 128)}[layout]


def deq(data: torch.Tensor, scale: torch.Tensor, blocks) -> torch.Tensor:
    """data * scale in float64, scale element i covering elements [i * block, (i + 1) * block) of each dim."""
    s = scale.double()
    if s.dim() == 0:
        return data.double() * s
    for d, block in enumerate(blocks):
        index = torch.zeros(data.shape[d], dtype=torch.long) if block == 0 else torch.arange(data.shape[d]) // block
        s = s.index_select(d, index)
    return data.double() * s


# (a's layout, b's layout): the two formats, and each beside a scale of the kinds torch._scaled_mm takes.
LAYOUTS = (("mx", "mx"), ("block", "block"), ("rowwise", "block"), ("mx", "tensorwise"))


@pytest.mark.smoke
@on_ranks(2, 4)
def test_all_gather_scaled_matmul_block_scales_exact():
    rank, name = dist.get_rank(), _world_name()
    for (a_layout, b_layout), gather_dim, out_dtype, pieces in itertools.product(
        LAYOUTS, (0, 1, -2), (torch.bfloat16, torch.float32), (0, 2)
    ):
        shape = [3, 4, K]
        a = fp8_ints(shape, seed=rank)
        a_scale = scale_of(a_layout, a_scale_shape(a_layout, shape), seed=10 + rank)
        bs = [fp8_ints((n, K), seed=20 + n).t() for n in (N, 64)]  # column-major, as the ops' b
        b_scales = [scale_of(b_layout, b_scale_shape(b_layout, K, b.shape[1]), seed=30 + i) for i, b in enumerate(bs)]
        a_full, a_full_scale, outs = torch.ops.fastmesh.all_gather_scaled_matmul(
            a, a_scale, bs, b_scales, gather_dim, name, out_dtype, True, pieces
        )
        want_a = ref.all_gather(deq(a, a_scale, a_blocks(a_layout, 3)), gather_dim, name)
        case = f"{a_layout} a, {b_layout} b, gather_dim {gather_dim}, {out_dtype}, pieces {pieces}"
        groups = a_scale.shape[-1] if a_scale.dim() else 1
        assert a_full_scale.dtype == a_scale.dtype and a_full_scale.shape == a_full.shape[:-1] + (groups,), case
        full_blocks = a_blocks(a_layout, 3) if a_scale.dim() else a_blocks("rowwise", 3)
        assert torch.equal(deq(a_full, a_full_scale, full_blocks), want_a), case
        for got, b, s in zip(outs, bs, b_scales):
            want = (want_a @ deq(b, s, b_blocks(b_layout))).to(out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want), case


@on_ranks(2, 4)
def test_scaled_matmul_reduce_scatter_block_scales_exact(world_size):
    rank, name = dist.get_rank(), _world_name()
    for (a_layout, b_layout), scatter_dim, reduce_op, pieces in itertools.product(
        LAYOUTS, (0, 1, -1), ("sum", "avg"), (0, 3)
    ):
        shape = [world_size, 3 * world_size, K]
        a = fp8_ints(shape, seed=rank)
        a_scale = scale_of(a_layout, a_scale_shape(a_layout, shape), seed=10 + rank)
        b = fp8_ints((N, K), seed=20 + rank).t()
        b_scale = scale_of(b_layout, b_scale_shape(b_layout, K, N), seed=30 + rank)
        got = torch.ops.fastmesh.scaled_matmul_reduce_scatter(
            a, a_scale, b, b_scale, scatter_dim, reduce_op, name, torch.float32, pieces
        )
        product = (deq(a, a_scale, a_blocks(a_layout, 3)) @ deq(b, b_scale, b_blocks(b_layout))).float()
        want = ref.reduce_scatter(product, scatter_dim, name, reduce_op)
        assert torch.equal(got, want), f"{a_layout} a, {b_layout} b, scatter_dim {scatter_dim}, {reduce_op}, {pieces}"


@on_ranks(2)
def test_scaled_matmul_all_reduce_block_scales_exact():
    rank, name = dist.get_rank(), _world_name()
    for (a_layout, b_layout), pieces in itertools.product(LAYOUTS, (0, 2)):
        shape = [2, 6, K]
        a = fp8_ints(shape, seed=rank)
        a_scale = scale_of(a_layout, a_scale_shape(a_layout, shape), seed=10 + rank)
        b = fp8_ints((N, K), seed=20 + rank).t()
        b_scale = scale_of(b_layout, b_scale_shape(b_layout, K, N), seed=30 + rank)
        got = torch.ops.fastmesh.scaled_matmul_all_reduce(a, a_scale, b, b_scale, "sum", name, torch.float32, pieces)
        want = (deq(a, a_scale, a_blocks(a_layout, 3)) @ deq(b, b_scale, b_blocks(b_layout))).float()
        dist.all_reduce(want)
        assert torch.equal(got, want), f"{a_layout} a, {b_layout} b, pieces {pieces}"


def test_scaled_matmul_is_the_local_scaled_multiply():
    """fastmesh::scaled_matmul (a plain-TP column-parallel linear's FP8 product) in every layout pair, exact as the
    fused forms; opcheck (eager, fake, compile); bad operands named."""
    from test_fused_collectives_fp8 import _opcheck_fp8

    op = torch.ops.fastmesh.scaled_matmul
    mixed = (("tensorwise", "rowwise"),) if ROWWISE_ON_CPU else ()  # torch < 2.13: no row-wise on CPU
    for (a_layout, b_layout), out_dtype, shape in itertools.product(
        LAYOUTS + mixed, (torch.bfloat16, torch.float32), ([5, K], [2, 3, K], [0, K])
    ):
        a = fp8_ints(shape, seed=0)
        a_scale = scale_of(a_layout, a_scale_shape(a_layout, shape), seed=1)
        b = fp8_ints((N, K), seed=2).t()
        b_scale = scale_of(b_layout, b_scale_shape(b_layout, K, N), seed=3)
        got = op(a, a_scale, b, b_scale, out_dtype)
        want = (deq(a, a_scale, a_blocks(a_layout, len(shape))) @ deq(b, b_scale, b_blocks(b_layout))).to(out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want), f"{a_layout} a, {b_layout} b, {out_dtype}, {shape}"
    a, b = fp8_ints([4, K], seed=0), fp8_ints((N, K), seed=1).t()
    mx_a, mx_b = scale_of("mx", [4, K // 32], 2), scale_of("mx", [K // 32, N], 3)
    _opcheck_fp8(op, (a, mx_a, b, mx_b, torch.bfloat16))
    _opcheck_fp8(op, (a, scale_of("block", [4, 2], 4), b, scale_of("block", [2, 2], 5), torch.float32))
    with pytest.raises(ValueError, match=r"fastmesh::scaled_matmul: b must have 160 rows \(a's last dim\), got shape"):
        op(a, mx_a, b[:32], mx_b, torch.float32)
    with pytest.raises(TypeError, match=r"fastmesh::scaled_matmul: out_dtype must be torch.float32, torch.bfloat16"):
        op(a, mx_a, b, mx_b, torch.int32)


@on_ranks(2)
def test_block_scaled_multiply_says_which_path_ran():
    name = _world_name()
    a = fp8_ints([8, K], seed=0)
    b = fp8_ints((N, K), seed=1).t()
    a_scale, b_scale = scale_of("mx", [8, K // 32], 2), scale_of("mx", [K // 32, N], 3)
    op = "fastmesh::scaled_matmul_reduce_scatter"
    _log.forget(lambda key: isinstance(key, tuple) and key[0] == op)  # earlier tests in this rank process said it
    with captured_log("fastmesh.ops._fp8_operands", logging.INFO) as messages:
        for _ in range(2):
            torch.ops.fastmesh.scaled_matmul_reduce_scatter(a, a_scale, b, b_scale, 0, "sum", name, torch.float32)
    said = [m for m in messages if "dequantize-and-multiply" in m]
    assert len(said) == 1 and "mx a and mx b scales on cpu" in said[0], said


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _sm90(), reason="torch._scaled_mm's 1x128 x 128x128 block form runs on SM90 only")
@on_ranks(1)
def test_block_scales_multiply_through_torch_scaled_mm_on_sm90():
    """On SM90 the block-scaled ops (scaled_matmul too) multiply through torch._scaled_mm (the log says so), exactly:
    small integers and power-of-two scales keep cuBLAS's fp32 sums exact. M = 15 rows takes the scale's padding to
    4 rows."""
    name, k, n, device = _world_name(), 1024, 256, torch.device("cuda")
    a = fp8_ints([3, 5, k], seed=0)
    a_scale = scale_of("block", a_scale_shape("block", a.shape), 1)
    b = fp8_ints((n, k), seed=2).t()
    b_scale = scale_of("block", b_scale_shape("block", k, n), 3)
    want = deq(a, a_scale, a_blocks("block", 3)) @ deq(b, b_scale, b_blocks("block"))
    on_gpu = [t.to(device) for t in (a, a_scale, b, b_scale)]
    _log.forget(lambda key: isinstance(key, tuple) and str(key[0]).startswith("fastmesh::"))
    with captured_log("fastmesh.ops._fp8_operands", logging.INFO) as messages:
        ga, gs, gb, gbs = on_gpu
        _, _, (gathered,) = torch.ops.fastmesh.all_gather_scaled_matmul(ga, gs, [gb], [gbs], 0, name, torch.bfloat16)
        reduced = torch.ops.fastmesh.scaled_matmul_all_reduce(ga, gs, gb, gbs, "sum", name, torch.bfloat16)
        scattered = torch.ops.fastmesh.scaled_matmul_reduce_scatter(ga, gs, gb, gbs, -1, "sum", name, torch.bfloat16)
        local = torch.ops.fastmesh.scaled_matmul(ga, gs, gb, gbs, torch.bfloat16)
    results = (("all_gather", gathered), ("all_reduce", reduced), ("reduce_scatter", scattered), ("local", local))
    for what, got in results:
        assert torch.equal(got.cpu(), want.to(torch.bfloat16)), what
    said = [m for m in messages if "torch._scaled_mm's 1x128 x 128x128" in m]
    assert len(said) == 4 and not [m for m in messages if "dequantize-and-multiply" in m], messages


# ---- the fronts' fp8= option ----

A_GRANULARITY = {"mx": "mx", "block1x128": "block1x128"}
B_GRANULARITY = {"mx": "mx", "block1x128": "block128x128"}
LAYOUT_OF = {"mx": "mx", "block1x128": "block", "block128x128": "block"}


def randn(shape, seed) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed))


def q_deq(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> torch.Tensor:
    """x quantized along its rows by fastmesh.fp8.quantize and dequantized by the test's own rule."""
    q = fastmesh.fp8.quantize(x, dtype=dtype, granularity=granularity)
    layout = LAYOUT_OF[granularity]
    blocks = b_blocks(layout)[::-1] if granularity == "block128x128" else a_blocks(layout, x.dim())
    return deq(q.data, q.scale, blocks).float()


def weight_deq(w: torch.Tensor, dtype, config) -> torch.Tensor:
    """w ([K, N]) as the forward multiplies it: quantized per output column (its transpose's rows)."""
    return q_deq(w.t().contiguous(), dtype, B_GRANULARITY[config.granularity]).t()


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@on_ranks(2, 4)
def test_fp8_gather_front_matches_quantize_gather_dequantize_reference():
    rank, name = dist.get_rank(), _world_name()
    for granularity, backward_in_fp8 in itertools.product(("mx", "block1x128"), (True, False)):
        config = Float8Config(granularity=granularity, backward_in_fp8=backward_in_fp8)
        x = randn((2, 8, K), seed=rank).requires_grad_()
        w = randn((K, 64), seed=1).requires_grad_()
        _, (y,) = fastmesh.all_gather_matmul(x, [w], 1, fp8=config)
        g = randn(y.shape, seed=5)  # the same on every rank: the gathered product is replicated
        y.backward(g)

        a_full = ref.all_gather(q_deq(x.detach(), config.dtype, A_GRANULARITY[granularity]), 1, name)
        what = f"{granularity}, backward_in_fp8={backward_in_fp8}"
        close(y, a_full @ weight_deq(w.detach(), config.dtype, config), f"{what}: forward")
        if backward_in_fp8:
            # grad @ w.T in FP8: the gradient along its rows (blocks along N), w per row (its blocks along N too).
            grad_full = (
                q_deq(g, config.grad_dtype, A_GRANULARITY[granularity])
                @ q_deq(w.detach(), config.dtype, B_GRANULARITY[granularity]).t()
            )
        else:
            grad_full = g @ w.detach().t()
        close(x.grad, ref.reduce_scatter(grad_full, 1, name, "sum"), f"{what}: grad x")
        close(w.grad, a_full.flatten(0, 1).t() @ g.flatten(0, 1), f"{what}: grad w")


@on_ranks(2, 4)
def test_fp8_scatter_front_matches_quantize_gather_dequantize_reference(world_size):
    rank, name = dist.get_rank(), _world_name()
    for granularity, backward_in_fp8 in itertools.product(("mx", "block1x128"), (True, False)):
        config = Float8Config(granularity=granularity, backward_in_fp8=backward_in_fp8)
        a = randn((2, 4 * world_size, K), seed=rank).requires_grad_()
        w = randn((K, 64), seed=1 + rank).requires_grad_()
        y = fastmesh.matmul_reduce_scatter(a, w, 1, fp8=config)
        g = randn(y.shape, seed=5 + rank)
        y.backward(g)

        what = f"{granularity}, backward_in_fp8={backward_in_fp8}"
        a_deq = q_deq(a.detach(), config.dtype, A_GRANULARITY[granularity])
        close(y, ref.reduce_scatter(a_deq @ weight_deq(w.detach(), config.dtype, config), 1, name, "sum"), what)
        if backward_in_fp8:
            g_full = ref.all_gather(q_deq(g, config.grad_dtype, A_GRANULARITY[granularity]), 1, name)
            w_t = q_deq(w.detach(), config.dtype, B_GRANULARITY[granularity]).t()
        else:
            g_full, w_t = ref.all_gather(g, 1, name), w.detach().t()
        close(a.grad, g_full @ w_t, f"{what}: grad a")
        close(w.grad, a.detach().flatten(0, 1).t() @ g_full.flatten(0, 1), f"{what}: grad w")


@on_ranks(3)
def test_mx_fronts_take_any_columns_without_an_fp8_dgrad():
    """N that MX blocks do not divide only stops an FP8 dgrad: no_grad calls, frozen activations and
    backward_in_fp8=False run, and equal the reference."""
    rank, name = dist.get_rank(), _world_name()
    n = 40  # a product's columns: neither 32 nor the 3 ranks' share of a block divide it
    config = Float8Config(granularity="mx")
    x, w = randn((5, K), seed=rank), randn((K, n), seed=1)
    gathered = ref.all_gather(q_deq(x, config.dtype, "mx"), 0, name)
    want = gathered @ weight_deq(w, config.dtype, config)
    with torch.no_grad():
        _, (y,) = fastmesh.all_gather_matmul(x.requires_grad_(), [w], 0, fp8=config)
    close(y, want, "no_grad gather")
    _, (y,) = fastmesh.all_gather_matmul(x.detach(), [w.requires_grad_()], 0, fp8=config)
    close(y, want, "gather of a frozen activation")
    y.sum().backward()  # the weight's gradient needs no FP8 dgrad: the dequantized FP8 activation's column sums
    close(w.grad, gathered.t() @ torch.ones(gathered.shape[0], n), "weight gradient of a frozen activation")

    a, w3 = randn((6, K), seed=rank), randn((K, 3 * n), seed=2)
    want = ref.reduce_scatter(q_deq(a, config.dtype, "mx") @ weight_deq(w3, config.dtype, config), 0, name, "sum")
    with torch.no_grad():
        close(fastmesh.matmul_reduce_scatter(a, w3, 0, fp8=config), want, "no_grad reduce-scatter")
    high_precision_dgrad = Float8Config(granularity="mx", backward_in_fp8=False)
    close(fastmesh.matmul_reduce_scatter(a.requires_grad_(), w3, 0, fp8=high_precision_dgrad), want, "bf16 dgrad")


@on_ranks(2)
def test_fp8_fronts_take_an_empty_contraction_and_no_columns():
    """K = 0 (a sum over nothing: zeros) and N = 0 (no columns, forward and backward) in every FP8 form, as the
    high-precision ops take them."""
    tp = fastmesh.init_mesh(tp=dist.get_world_size())["tp"]
    world = tp.size()
    granularities = ("tensorwise", "mx", "block1x128") + (("rowwise",) if ROWWISE_ON_CPU else ())
    for granularity in granularities:
        config = Float8Config(granularity=granularity)
        a, b = torch.randn(4, 0), torch.randn(0, 8)
        gathered, (y,) = fastmesh.all_gather_matmul(a, [b], 0, group=tp, fp8=config, return_a=True)
        assert gathered.shape == (4 * world, 0), granularity
        torch.testing.assert_close(y, torch.zeros(4 * world, 8), rtol=0, atol=0, msg=granularity)
        scattered = fastmesh.matmul_reduce_scatter(a, b, 0, group=tp, fp8=config)
        torch.testing.assert_close(scattered, torch.zeros(4 // world, 8), rtol=0, atol=0, msg=granularity)
        reduced = fastmesh.matmul_all_reduce(a, b, group=tp, fp8=config)
        torch.testing.assert_close(reduced, torch.zeros(4, 8), rtol=0, atol=0, msg=granularity)

        a, b = torch.randn(4, 64, requires_grad=True), torch.randn(64, 0, requires_grad=True)
        _, (y,) = fastmesh.all_gather_matmul(a, [b], 0, group=tp, fp8=config)
        assert y.shape == (4 * world, 0), granularity
        y.sum().backward()  # the FP8 dgrad contracts over N = 0
        torch.testing.assert_close(a.grad, torch.zeros(4, 64), rtol=0, atol=0, msg=granularity)
        assert b.grad.shape == (64, 0), granularity


@on_ranks(2)
def test_fp8_block_forms_opcheck_and_compile():
    from test_fused_collectives_fp8 import _opcheck_fp8, assert_compiled_fp8_block_matches_eager

    name = _world_name()
    a = fp8_ints([4, 6, K], seed=dist.get_rank())
    b = fp8_ints((N, K), seed=1).t()
    for layout in ("mx", "block"):
        a_scale = scale_of(layout, a_scale_shape(layout, a.shape), 3)
        b_scale = scale_of(layout, b_scale_shape(layout, K, N), 4)
        for dim, return_a in ((0, True), (1, False)):
            _opcheck_fp8(
                torch.ops.fastmesh.all_gather_scaled_matmul,
                (a, a_scale, [b], [b_scale], dim, name, torch.bfloat16, return_a, 0),
            )
        _opcheck_fp8(
            torch.ops.fastmesh.scaled_matmul_reduce_scatter,
            (a, a_scale, b, b_scale, 0, "sum", name, torch.float32, 0),
        )

    for granularity in ("mx", "block1x128"):
        # Two scale groups along each dim, the last one partial for block1x128 (its scales expand over a split dim).
        assert_compiled_fp8_block_matches_eager(Float8Config(granularity=granularity), k=192, hidden=160)


@on_ranks(2)
def test_fp8_block_forms_bad_inputs():
    name = _world_name()
    ag = torch.ops.fastmesh.all_gather_scaled_matmul
    rs = torch.ops.fastmesh.scaled_matmul_reduce_scatter
    a = fp8_ints([4, K], seed=0)
    b = fp8_ints((N, K), seed=1).t()
    mx_a, mx_b = scale_of("mx", [4, K // 32], 2), scale_of("mx", [K // 32, N], 3)
    a48 = fp8_ints([4, 48], seed=0)
    cases = [
        (
            lambda: ag(a48, scale_of("mx", [4, 1], 0), [b[:48]], [mx_b[:1]], 0, name, torch.float32),
            ValueError,
            r"a_scale is an MX scale \(float8_e8m0fnu\): a_shard's contraction dim must be a multiple of 32, got 48",
        ),
        (
            lambda: ag(a, mx_a[:, :4], [b], [mx_b], 0, name, torch.float32),
            ValueError,
            r"a_scale must have shape \[4, 5\] \(MX: one scale per 32 elements along K\), got \[4, 4\]",
        ),
        (
            lambda: rs(a, mx_a, b, torch.ones(3, 2), 0, "sum", name, torch.float32),
            ValueError,
            r"b_scale must be tensor-wise \(shape \[\]\), row-wise \(shape \[1, 136\]\) or block \(shape \[2, 2\]\), "
            r"got shape \[3, 2\]",
        ),
        (
            lambda: rs(a, mx_a.view(torch.uint8), b, mx_b, 0, "sum", name, torch.float32),
            TypeError,
            r"a_scale must be float32 \(tensor-wise, row-wise or block scales\) or float8_e8m0fnu \(MX scales\), "
            r"got torch.uint8",
        ),
        (
            lambda: fastmesh.all_gather_matmul(
                torch.randn(4, 48), [torch.randn(48, 32)], 0, fp8=Float8Config(granularity="mx")
            ),
            ValueError,
            r"fastmesh.all_gather_matmul: fp8 granularity 'mx' needs the contraction dim \(K = 48\) to be a multiple "
            r"of 32",
        ),
        (  # a gathered contraction is refused before its (world times a_shard's) K is checked for MX
            lambda: fastmesh.all_gather_matmul(
                torch.randn(4, 48),
                [torch.randn(48 * dist.get_world_size(), 32)],
                -1,
                fp8=Float8Config(granularity="mx"),
            ),
            ValueError,
            r"fastmesh.all_gather_matmul: the FP8 form gathers rows: gather_dim must not be the last dim",
        ),
        (  # ... and before bs' rows are counted as a gathered contraction's
            lambda: fastmesh.all_gather_matmul(torch.randn(4, 64), [torch.randn(64, 32)], -1, fp8=Float8Config()),
            ValueError,
            r"fastmesh.all_gather_matmul: the FP8 form gathers rows: gather_dim must not be the last dim",
        ),
        (
            lambda: fastmesh.matmul_reduce_scatter(
                torch.randn(4, 64, requires_grad=True), torch.randn(64, 40), 0, fp8=Float8Config(granularity="mx")
            ),
            ValueError,
            r"fp8 granularity 'mx' with backward_in_fp8 needs the product's columns \(N = 40",
        ),
        (
            lambda: fastmesh.all_gather_matmul(
                torch.randn(4, 64, requires_grad=True), [torch.randn(64, 40)], 0, fp8=Float8Config(granularity="mx")
            ),
            ValueError,
            r"fp8 granularity 'mx' with backward_in_fp8 needs the product's columns \(N = 40",
        ),
        (
            lambda: fastmesh.all_gather_matmul(
                torch.randn(4, 64), [torch.randn(64, 32)], 0, fp8=Float8Config(granularity="block128x128")
            ),
            ValueError,
            r"fp8 granularity must be one of 'tensorwise', 'rowwise', 'mx', 'block1x128'",
        ),
        (
            lambda: Float8Config(granularity="rowwise", scale_rounding="rceil"),
            ValueError,
            r"Float8Config: scale_rounding applies to granularity 'mx', got granularity 'rowwise'",
        ),
        (
            lambda: Float8Config(granularity="mx", power_of_two=True),
            ValueError,
            r"Float8Config: power_of_two does not apply to granularity 'mx'",
        ),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()

"""Property-based tests (hypothesis) of every fused op and of ``fastmesh.fp8.quantize`` against their references.

Hypothesis draws each example in this (the pytest) process and sends it to every rank of a pool of 4, so that the
ranks of a group run the same call; each rank builds its own shard from the example's seeds. A failing rank raises
RankFailure here, and hypothesis shrinks the example as usual. World sizes 1-3 run in groups of the pool's ranks
(``GROUPS``), whose group ranks differ from their global ranks, as on a 2-D mesh's axis.

Exactness: small-integer inputs and upstream gradients keep every product and partial sum an integer that the
dtype holds (|sums| <= 256 for bfloat16, the shape bounds below), so fused and reference agree bit for bit
whatever the summation order or piece count. ``avg`` gradients are drawn as multiples of the world size, so that
their division is exact too. FP8 fronts: with power-of-two scales, small integers quantize exactly, so the front
must equal its reference (``fastmesh.fp8.quantize``, torch collectives, dequantize, matmul) bit for bit, and its
gradients the plain reference's; with computed scales (random inputs) the forward is judged by the same-precision
baseline rule of ``test_fused_collectives.py``, the baseline torch._scaled_mm of the same FP8 operands.

Bounded: ``max_examples`` per test, derandomized (the same examples every run). ``FASTMESH_HYPOTHESIS_EXAMPLES=N``
draws N fresh random examples per test instead, kept in the run's temporary database (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib

import pytest
import torch
import torch.distributed as dist
from environment import environment
from fastmesh.kernels import fp8_reference
from fastmesh.kernels import fused_reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_pool import get_pool
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh.fp8 import Float8Config
from fastmesh.ops import plans

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
WORLDS = (1, 2, 3, 4)
RUN_TIMEOUT_S = 60.0
# torch < 2.13 runs only tensor-wise scales in torch._scaled_mm on CPU.
FP8_GRANULARITIES = ("tensorwise", "rowwise") if ROWWISE_ON_CPU else ("tensorwise",)
_EXPLORE = int(os.environ.get("FASTMESH_HYPOTHESIS_EXAMPLES", "0"))


def bounded(max_examples: int):
    """The settings of one property test: ``max_examples`` derandomized examples, the same on every run (so CI
    cannot pass one run and fail the next; derandomize implies no database, which could only replay examples
    these runs all draw anyway), or FASTMESH_HYPOTHESIS_EXAMPLES random ones, with the temporary database of
    the profile in tests/conftest.py. No deadline: an example's time is mostly the pool's round trip."""
    if _EXPLORE:
        return settings(max_examples=_EXPLORE, derandomize=False, deadline=None)
    return settings(max_examples=max_examples, derandomize=True, deadline=None)


# ---- examples: plain values (printed by hypothesis when an example fails, pickled to the ranks) ----

SEEDS = st.integers(0, 2**31 - 1)
HP_DTYPES = ("float32", "bfloat16", "float64", "float16")
FP8_OUT_DTYPES = ("float32", "bfloat16")
# Dtypes whose exact integers allow a 4-D a and longer dims (more rows in a wgrad's sum); bfloat16 holds every
# integer up to 256 only: 3-D, dims <= 4 (5 for the product ops), entries in [-1, 1] keep every sum within it.
WIDE = ("float32", "float64")
PIECES = (None, 1, 2, 3, 7, "unfused", "fixed")  # None: the call's own plan; ints: pieces=; else a forced plan
SCATTER_PIECES = (*PIECES, "columns2", "columns3")


@st.composite
def sizes(draw, ndim: int, high: int = 4) -> list[int]:
    """``ndim`` sizes in 1..high, now and then one of them 0."""
    shape = [draw(st.integers(1, high)) for _ in range(ndim)]
    if ndim and draw(st.integers(0, 11)) == 11:
        shape[draw(st.integers(0, ndim - 1))] = 0
    return shape


@st.composite
def grad_flags(draw, outputs: int) -> dict:
    """Which inputs need a gradient, and which outputs the loss uses (an unused one gets no gradient)."""
    return dict(
        a_grad=draw(st.booleans()),
        b_grad=draw(st.booleans()),
        used=[draw(st.booleans()) for _ in range(outputs)],
    )


@st.composite
def gather_examples(draw, world: int, fp8: bool = False) -> dict:
    """An all_gather_matmul call: any gather dim (the FP8 form: one before the last), 1-3 bs (some transposed
    views, some with no columns), return_a either way."""
    dtype = draw(st.sampled_from(FP8_OUT_DTYPES if fp8 else HP_DTYPES))
    ndim = draw(st.integers(2 if fp8 else 1, 4 if dtype in WIDE else 3))
    shape = draw(sizes(ndim, high=6 if dtype in WIDE else 4))
    if fp8:  # the FP8 gather rejects an empty last dim (csrc/fused/all_gather_scaled_matmul.cpp)
        shape[-1] = max(shape[-1], 1)
    dims = [d for d in range(-ndim, ndim) if not (fp8 and d % ndim == ndim - 1)]
    bs = draw(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=3))  # (N, transposed)
    return dict(
        dtype=dtype,
        shape=shape,
        gather_dim=draw(st.sampled_from(dims)),
        bs=bs,
        return_a=draw(st.booleans()),
        pieces=draw(st.sampled_from(PIECES)),
        grads=draw(grad_flags(len(bs) + 1)),  # the gathered a is the last output
        seed=draw(SEEDS),
        **({"config": draw(fp8_config())} if fp8 else {}),
    )


@st.composite
def scatter_examples(draw, world: int, fp8: bool = False) -> dict:
    """A matmul_reduce_scatter call: any scatter dim (the last: the product's columns), either reduce op."""
    dtype = draw(st.sampled_from(FP8_OUT_DTYPES if fp8 else HP_DTYPES))
    ndim = draw(st.integers(1, 4 if dtype in WIDE else 3))
    shape = draw(sizes(ndim, high=6 if dtype in WIDE else 4))
    scatter_dim = draw(st.integers(-ndim, ndim - 1))
    n = draw(st.integers(0, 4))
    if scatter_dim % ndim == ndim - 1:
        n *= world
    else:
        shape[scatter_dim % ndim] *= world
    return dict(
        dtype=dtype,
        shape=shape,
        n=n,
        b_transposed=draw(st.booleans()),
        scatter_dim=scatter_dim,
        reduce_op=draw(st.sampled_from(["sum", "avg"])),
        pieces=draw(st.sampled_from(SCATTER_PIECES)),
        grads=draw(grad_flags(1)),
        seed=draw(SEEDS),
        **({"config": draw(fp8_config())} if fp8 else {}),
    )


@st.composite
def product_examples(draw, world: int, reduce_ops=("sum", "avg"), fp8: bool = False) -> dict:
    """A matmul_all_reduce call (reduce_op drawn) or a matmul_all_gather one (``reduce_ops=(None,)``)."""
    dtype = draw(st.sampled_from(FP8_OUT_DTYPES if fp8 else HP_DTYPES))
    ndim = draw(st.integers(1, 4 if dtype in WIDE else 3))
    return dict(
        dtype=dtype,
        shape=draw(sizes(ndim, high=7 if dtype in WIDE else 5)),
        n=draw(st.integers(0, 5)),
        b_transposed=draw(st.booleans()),
        reduce_op=draw(st.sampled_from(reduce_ops)),
        pieces=draw(st.sampled_from(PIECES)),
        grads=draw(grad_flags(1)),
        seed=draw(SEEDS),
        **({"config": draw(fp8_config())} if fp8 else {}),
    )


@st.composite
def fp8_config(draw) -> dict:
    """A Float8Config's fields. power_of_two makes small integers quantize exactly (the bit-exact regime)."""
    return dict(
        granularity=draw(st.sampled_from(FP8_GRANULARITIES)),
        power_of_two=draw(st.booleans()),
        backward_in_fp8=draw(st.booleans()),
        grad_dtype=draw(st.sampled_from(["float8_e5m2", "float8_e4m3fn"])),
    )


# ---- on the ranks ----

POOL_SIZE = 4
# World sizes below the pool's run in groups of its ranks (one pool start for every world size): each rank alone,
# pairs {0, 1} and {2, 3}, ranks {1, 2, 3} (rank 0 idles). Group ranks then differ from the global ranks, as on a
# 2-D mesh's axis.
GROUPS = {1: [[0], [1], [2], [3]], 2: [[0, 1], [2, 3]], 3: [[1, 2, 3]]}
_groups: dict = {}


def _group(world: int):
    """This rank's group of ``world`` ranks, or None where it has none."""
    if world == dist.get_world_size():
        return dist.group.WORLD
    if not _groups:  # every rank creates every group, in the same order
        for size, rank_sets in GROUPS.items():
            _groups[size] = [(ranks, dist.new_group(ranks)) for ranks in rank_sets]
    return next((group for ranks, group in _groups[world] if dist.get_rank() in ranks), None)


def _run_check(check: str, example: dict, world: int) -> None:
    group = _group(world)
    if group is not None:
        globals()[check](example, group)


def _seed(example: dict, *parts) -> int:
    """A seed of its own for each tensor of an example (``parts`` name it, and the rank where it differs)."""
    return zlib.crc32(repr((example["seed"], *parts)).encode())


def small_ints(shape, dtype, seed, low=-1, high=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, list(shape), generator=g).to(dtype)


def randn(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(list(shape), generator=g).to(dtype)


def matrix(k: int, n: int, transposed: bool, make) -> torch.Tensor:
    """A [k, n] operand, or the transposed view of an [n, k] one (how a linear's weight arrives)."""
    return make((n, k)).t() if transposed else make((k, n))


@contextlib.contextmanager
def plan_of(pieces):
    """The example's plan: yields the call's ``pieces=`` and runs the block under the forced plan, if any."""
    if pieces is None or isinstance(pieces, int):
        yield pieces
    elif pieces == "fixed":
        with environment(FASTMESH_TUNE="off"):
            yield None
    elif pieces == "unfused":
        with plans.override(plans.UNFUSED):
            yield None
    else:
        with plans.override(plans.Plan("columns", int(pieces.removeprefix("columns")))):
            yield None


def leaves(tensors, flags) -> list:
    return [t.detach().clone().requires_grad_(flag) for t, flag in zip(tensors, flags)]


def backward(outputs, grads, used) -> None:
    """Backward from the used outputs (with these upstream gradients), if any of them needs a gradient."""
    pairs = [(o, g) for o, g, u in zip(outputs, grads, used) if u and o is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def assert_same(got, want, what: str) -> None:
    if want is None:
        assert got is None, f"{what}: expected None, got {type(got).__name__}"
        return
    assert got is not None, f"{what}: got None"
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    )
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        raise AssertionError(
            f"{what}: {int((diff > 0).sum())} of {diff.numel()} differ, max diff {diff.max().item():g}"
        )


def grad_of(t: torch.Tensor):
    return t.grad if t.requires_grad else None


def upstream(shape, dtype, seed, world: int, reduce_op) -> torch.Tensor:
    """Small-integer upstream gradients; multiples of the world size under avg (divided exactly)."""
    g = small_ints(shape, dtype, seed)
    return g * world if reduce_op == "avg" else g


def upstreams(outputs, example: dict, rank: int) -> list:
    """Small-integer upstream gradients of a gather's outputs (None for an output not returned)."""
    return [
        None if o is None else small_ints(o.shape, o.dtype, _seed(example, "g", i, rank)) for i, o in enumerate(outputs)
    ]


def _check_all_gather_matmul(example: dict, group) -> None:
    rank, world = group.rank(), group.size()
    name, dtype, dim = fastmesh.group_name(group), getattr(torch, example["dtype"]), example["gather_dim"]
    shape, flags = example["shape"], example["grads"]
    k = shape[-1] * (world if dim % len(shape) == len(shape) - 1 else 1)
    a = small_ints(shape, dtype, _seed(example, "a", rank))
    bs = [
        matrix(k, n, transposed, lambda s, i=i: small_ints(s, dtype, _seed(example, "b", i)))
        for i, (n, transposed) in enumerate(example["bs"])
    ]
    results = {}
    for fn in ("fused", "reference"):
        a_in, *bs_in = leaves([a, *bs], [flags["a_grad"]] + [flags["b_grad"]] * len(bs))
        with plan_of(example["pieces"]) as pieces:
            if fn == "fused":
                a_full, outs = fastmesh.all_gather_matmul(
                    a_in, bs_in, dim, group=group, return_a=example["return_a"], pieces=pieces
                )
            else:
                a_full, outs = ref.all_gather_matmul(a_in, bs_in, dim, name, return_a=example["return_a"])
            backward([*outs, a_full], upstreams([*outs, a_full], example, rank), flags["used"])
        results[fn] = [a_full, *outs, grad_of(a_in), *(grad_of(b) for b in bs_in)]
    names = ["a", *(f"outs[{i}]" for i in range(len(bs))), "grad a_shard", *(f"grad bs[{i}]" for i in range(len(bs)))]
    for what, got, want in zip(names, results["fused"], results["reference"]):
        assert_same(got, want, what)


def _check_matmul_reduce_scatter(example: dict, group) -> None:
    rank, world = group.rank(), group.size()
    name, dtype, shape = fastmesh.group_name(group), getattr(torch, example["dtype"]), example["shape"]
    a = small_ints(shape, dtype, _seed(example, "a", rank))
    b = matrix(
        shape[-1], example["n"], example["b_transposed"], lambda s: small_ints(s, dtype, _seed(example, "b", rank))
    )
    flags, reduce_op, dim = example["grads"], example["reduce_op"], example["scatter_dim"]
    results = {}
    for fn in ("fused", "reference"):
        a_in, b_in = leaves([a, b], [flags["a_grad"], flags["b_grad"]])
        with plan_of(example["pieces"]) as pieces:
            if fn == "fused":
                out = fastmesh.matmul_reduce_scatter(a_in, b_in, dim, group=group, reduce_op=reduce_op, pieces=pieces)
            else:
                out = ref.matmul_reduce_scatter(a_in, b_in, dim, reduce_op, name)
            grad = upstream(out.shape, dtype, _seed(example, "g", rank), world, reduce_op)
            backward([out], [grad], flags["used"])
        results[fn] = [out, grad_of(a_in), grad_of(b_in)]
    for what, got, want in zip(("out", "grad a", "grad b"), results["fused"], results["reference"]):
        assert_same(got, want, what)


class AllReduceReplicated(torch.autograd.Function):
    """c10d's all-reduce of each rank's partial product into a replicated result; its gradient, the same on every
    rank, is each rank's partial's (DTensor's Partial -> Replicate)."""

    @staticmethod
    def forward(ctx, c, reduce_op, group):
        out = c.clone()
        dist.all_reduce(out, group=group)
        ctx.divisor = group.size() if reduce_op == "avg" else 1
        return out / ctx.divisor if reduce_op == "avg" else out

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.divisor if ctx.divisor > 1 else grad), None, None


class GatherColumns(torch.autograd.Function):
    """c10d's all-gather of each rank's product as column block ``rank``; backward keeps this rank's block of the
    replicated gradient (DTensor's Replicate(), as torch's ColwiseParallel(output_layouts=Replicate()))."""

    @staticmethod
    def forward(ctx, c, group):
        parts = [torch.empty_like(c) for _ in range(group.size())]
        dist.all_gather(parts, c.contiguous(), group=group)
        ctx.rank, ctx.n = group.rank(), c.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.n, ctx.n), None


def _check_product_op(example: dict, group) -> None:
    """matmul_all_reduce (reduce_op given) or matmul_all_gather (reduce_op None)."""
    rank, world = group.rank(), group.size()
    dtype, shape, reduce_op = getattr(torch, example["dtype"]), example["shape"], example["reduce_op"]
    a = small_ints(shape, dtype, _seed(example, "a", rank))
    b = matrix(
        shape[-1], example["n"], example["b_transposed"], lambda s: small_ints(s, dtype, _seed(example, "b", rank))
    )
    flags = example["grads"]
    results = {}
    for fn in ("fused", "reference"):
        a_in, b_in = leaves([a, b], [flags["a_grad"], flags["b_grad"]])
        with plan_of(example["pieces"]) as pieces:
            if reduce_op is None:
                out = (
                    fastmesh.matmul_all_gather(a_in, b_in, group=group, pieces=pieces)
                    if fn == "fused"
                    else GatherColumns.apply(a_in @ b_in, group)
                )
            elif fn == "fused":
                out = fastmesh.matmul_all_reduce(a_in, b_in, group=group, reduce_op=reduce_op, pieces=pieces)
            else:
                out = AllReduceReplicated.apply(a_in @ b_in, reduce_op, group)
            grad = upstream(out.shape, dtype, _seed(example, "g"), world, reduce_op)  # replicated: the same everywhere
            backward([out], [grad], flags["used"])
        results[fn] = [out, grad_of(a_in), grad_of(b_in)]
    for what, got, want in zip(("out", "grad a", "grad b"), results["fused"], results["reference"]):
        assert_same(got, want, what)


# ---- FP8 fronts ----


def config_of(example: dict) -> Float8Config:
    c = example["config"]
    return Float8Config(
        granularity=c["granularity"],
        power_of_two=c["power_of_two"],
        backward_in_fp8=c["backward_in_fp8"],
        grad_dtype=getattr(torch, c["grad_dtype"]),
    )


def fp8_operand(example: dict, role, shape, dtype, rank_factor: bool) -> torch.Tensor:
    """Small integers, times a power of two of this rank's (1 or 2: ranks' scales differ) where ``rank_factor``,
    in the bit-exact regime; random normal values otherwise."""
    seed = _seed(example, *role)
    if not example["config"]["power_of_two"]:
        return randn(shape, dtype, seed)
    factor = 2.0 ** (seed % 2) if rank_factor else 1.0
    return small_ints(shape, dtype, seed) * factor


def quantized_rows(x: torch.Tensor, config: Float8Config):
    """x quantized per row (or tensor-wise) by fastmesh.fp8.quantize, as the front does: (data, scale)."""
    q = fastmesh.fp8.quantize(
        x.detach(), dtype=config.dtype, granularity=config.granularity, power_of_two=config.power_of_two
    )
    return q.data, q.scale


def quantized_columns(b: torch.Tensor, config: Float8Config):
    """b ([K, N]) quantized per column (or tensor-wise): column-major data, scale [] or [1, N]."""
    data, scale = quantized_rows(b.t(), config)
    return data.t(), scale.t()


def dequantized(operand, precision) -> torch.Tensor:
    data, scale = operand
    return data.to(precision) * scale.to(precision)


def scaled_mm(a_operand, b_operand, out_dtype) -> torch.Tensor:
    """torch._scaled_mm of an FP8 a ([..., K]) by an FP8 b ([K, N]), each (data, scale): the unfused product."""
    (a, a_scale), (b, b_scale) = a_operand, b_operand
    rows = a.reshape(-1, a.shape[-1])
    a_scale = a_scale if a_scale.dim() == 0 else a_scale.reshape(-1, 1)
    out = torch._scaled_mm(rows, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    return out.reshape(*a.shape[:-1], b.shape[1])


def gathered_operands(operand, group) -> list:
    """Every rank's (data, scale), by c10d's all-gather (of the data's bytes: gloo moves no FP8)."""
    parts = []
    for t in operand:
        raw = t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t
        got = [torch.empty_like(raw) for _ in range(group.size())]
        dist.all_gather(got, raw.contiguous(), group=group)
        parts.append([g.view(t.dtype) for g in got])
    return list(zip(*parts))


def assert_within_baseline(got, baseline, exact64, what: str) -> None:
    """The same-precision baseline rule (test_fused_collectives.py): the fused error against float64 at most twice
    the unfused result's, plus a few ulps at the result's scale."""
    assert got.shape == baseline.shape and got.dtype == baseline.dtype, what
    err = (got.double() - exact64).abs().max().item()
    base = (baseline.double() - exact64).abs().max().item()
    ulp = torch.finfo(got.dtype).eps * exact64.abs().max().item()
    assert err <= 2 * base + 4 * ulp, f"{what}: error {err:.3g} vs unfused {base:.3g} (ulp at scale {ulp:.3g})"


def check_fp8_result(example: dict, fused, reference, unfused, what: str) -> None:
    """``fused`` against ``reference(precision)``, the same quantization dequantized and multiplied in fp32 or
    float64: bit for bit in the exact regime (and where nothing is summed), else by the baseline rule, the
    baseline ``unfused()``: torch._scaled_mm of the same FP8 operands, then the collective."""
    dtype = getattr(torch, example["dtype"])
    want = reference(torch.float32).to(dtype)
    if example["config"]["power_of_two"] or want.numel() == 0 or example["shape"][-1] == 0:
        assert_same(fused, want, what)
    else:
        assert_within_baseline(fused, unfused(), reference(torch.float64), what)


def _compare_grads(got_leaves, want_leaves, names) -> None:
    for what, got, want in zip(names, got_leaves, want_leaves):
        assert_same(grad_of(got), grad_of(want), what)


def _check_fp8_all_gather_matmul(example: dict, group) -> None:
    rank, name, dtype = group.rank(), fastmesh.group_name(group), getattr(torch, example["dtype"])
    dim, shape, flags = example["gather_dim"], example["shape"], example["grads"]
    config, exact = config_of(example), example["config"]["power_of_two"]
    a = fp8_operand(example, ("a", rank), shape, dtype, rank_factor=True)
    bs = [
        matrix(shape[-1], n, tr, lambda s, i=i: fp8_operand(example, ("b", i), s, dtype, rank_factor=False))
        for i, (n, tr) in enumerate(example["bs"])
    ]
    needs = [flags["a_grad"] and exact] + [flags["b_grad"] and exact] * len(bs)
    a_in, *bs_in = leaves([a, *bs], needs)
    with plan_of(example["pieces"]) as pieces:
        a_full, outs = fastmesh.all_gather_matmul(
            a_in, bs_in, dim, group=group, return_a=example["return_a"], pieces=pieces, fp8=config
        )
    qa = quantized_rows(a, config)

    def gathered(precision):
        return ref.all_gather(dequantized(qa, precision), dim, name)

    def unfused(qb):  # each rank's block multiplied by its own scale, the blocks concatenated
        return torch.cat([scaled_mm(part, qb, dtype) for part in gathered_operands(qa, group)], dim % len(shape))

    # The returned a is the dequantized gather, elementwise: exact in either regime.
    assert_same(a_full, gathered(torch.float32).to(dtype) if example["return_a"] else None, "a")
    for i, (out, b) in enumerate(zip(outs, bs)):
        qb = quantized_columns(b, config)
        check_fp8_result(
            example, out, lambda p, qb=qb: gathered(p) @ dequantized(qb, p), lambda qb=qb: unfused(qb), f"outs[{i}]"
        )
    if not exact:
        return
    # Every quantization exact: the front's gradients are the plain reference's, whichever backward it runs.
    grads = upstreams([*outs, a_full], example, rank)
    with plan_of(example["pieces"]):
        backward([*outs, a_full], grads, flags["used"])
    a_ref, *bs_ref = leaves([a, *bs], needs)
    ref_a_full, ref_outs = ref.all_gather_matmul(a_ref, bs_ref, dim, name, return_a=example["return_a"])
    backward([*ref_outs, ref_a_full], grads, flags["used"])
    _compare_grads([a_in, *bs_in], [a_ref, *bs_ref], ["grad a_shard", *(f"grad bs[{i}]" for i in range(len(bs)))])


def _check_fp8_matmul_reduce_scatter(example: dict, group) -> None:
    rank, world, name = group.rank(), group.size(), fastmesh.group_name(group)
    dtype, shape, flags = getattr(torch, example["dtype"]), example["shape"], example["grads"]
    config, exact = config_of(example), example["config"]["power_of_two"]
    dim, reduce_op = example["scatter_dim"], example["reduce_op"]
    a = fp8_operand(example, ("a", rank), shape, dtype, rank_factor=False)
    b = matrix(
        shape[-1], example["n"], example["b_transposed"], lambda s: fp8_operand(example, ("b", rank), s, dtype, True)
    )
    a_in, b_in = leaves([a, b], [flags["a_grad"] and exact, flags["b_grad"] and exact])
    with plan_of(example["pieces"]) as pieces:
        out = fastmesh.matmul_reduce_scatter(
            a_in, b_in, dim, group=group, reduce_op=reduce_op, pieces=pieces, fp8=config
        )
    qa, qb = quantized_rows(a, config), quantized_columns(b, config)

    def reference(precision):
        product = dequantized(qa, precision) @ dequantized(qb, precision)
        # The op reduces each rank's product in the output dtype; float64 stays unrounded.
        return ref.reduce_scatter(product if precision == torch.float64 else product.to(dtype), dim, name, reduce_op)

    check_fp8_result(
        example, out, reference, lambda: ref.reduce_scatter(scaled_mm(qa, qb, dtype), dim, name, reduce_op), "out"
    )
    if not exact:
        return
    grad = upstream(out.shape, dtype, _seed(example, "g", rank), world, reduce_op)
    with plan_of(example["pieces"]):
        backward([out], [grad], flags["used"])
    a_ref, b_ref = leaves([a, b], [a_in.requires_grad, b_in.requires_grad])
    backward([ref.matmul_reduce_scatter(a_ref, b_ref, dim, reduce_op, name)], [grad], flags["used"])
    _compare_grads([a_in, b_in], [a_ref, b_ref], ["grad a", "grad b"])


def _check_fp8_matmul_all_reduce(example: dict, group) -> None:
    rank, world = group.rank(), group.size()
    dtype, shape, flags = getattr(torch, example["dtype"]), example["shape"], example["grads"]
    config, exact, reduce_op = config_of(example), example["config"]["power_of_two"], example["reduce_op"]
    a = fp8_operand(example, ("a", rank), shape, dtype, rank_factor=True)
    b = matrix(
        shape[-1], example["n"], example["b_transposed"], lambda s: fp8_operand(example, ("b", rank), s, dtype, False)
    )
    a_in, b_in = leaves([a, b], [flags["a_grad"] and exact, flags["b_grad"] and exact])
    with plan_of(example["pieces"]) as pieces:
        out = fastmesh.matmul_all_reduce(a_in, b_in, group=group, reduce_op=reduce_op, pieces=pieces, fp8=config)
    qa, qb = quantized_rows(a, config), quantized_columns(b, config)

    def reference(precision):
        product = dequantized(qa, precision) @ dequantized(qb, precision)
        return AllReduceReplicated.apply(product if precision == torch.float64 else product.to(dtype), reduce_op, group)

    check_fp8_result(
        example, out, reference, lambda: AllReduceReplicated.apply(scaled_mm(qa, qb, dtype), reduce_op, group), "out"
    )
    if not exact:
        return
    grad = upstream(out.shape, dtype, _seed(example, "g"), world, reduce_op)
    backward([out], [grad], flags["used"])
    a_ref, b_ref = leaves([a, b], [a_in.requires_grad, b_in.requires_grad])
    backward([AllReduceReplicated.apply(a_ref @ b_ref, reduce_op, group)], [grad], flags["used"])
    _compare_grads([a_in, b_in], [a_ref, b_ref], ["grad a", "grad b"])


# ---- the tests: hypothesis here, the example on the ranks ----


def run_on_ranks(check, world: int, example: dict) -> None:
    get_pool(POOL_SIZE).run(
        _run_check, {"check": check.__name__, "example": example, "world": world}, timeout=RUN_TIMEOUT_S
    )


PER_WORLD = pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w}ranks")


@PER_WORLD
@bounded(40)
@given(data=st.data())
def test_all_gather_matmul(world, data):
    run_on_ranks(_check_all_gather_matmul, world, data.draw(gather_examples(world), label="example"))


@PER_WORLD
@bounded(40)
@given(data=st.data())
def test_matmul_reduce_scatter(world, data):
    run_on_ranks(_check_matmul_reduce_scatter, world, data.draw(scatter_examples(world), label="example"))


@PER_WORLD
@bounded(30)
@given(data=st.data())
def test_matmul_all_reduce(world, data):
    run_on_ranks(_check_product_op, world, data.draw(product_examples(world), label="example"))


@PER_WORLD
@bounded(30)
@given(data=st.data())
def test_matmul_all_gather(world, data):
    run_on_ranks(_check_product_op, world, data.draw(product_examples(world, reduce_ops=(None,)), label="example"))


@PER_WORLD
@bounded(30)
@given(data=st.data())
def test_fp8_all_gather_matmul(world, data):
    run_on_ranks(_check_fp8_all_gather_matmul, world, data.draw(gather_examples(world, fp8=True), label="example"))


@PER_WORLD
@bounded(30)
@given(data=st.data())
def test_fp8_matmul_reduce_scatter(world, data):
    run_on_ranks(_check_fp8_matmul_reduce_scatter, world, data.draw(scatter_examples(world, fp8=True), label="example"))


@PER_WORLD
@bounded(30)
@given(data=st.data())
def test_fp8_matmul_all_reduce(world, data):
    run_on_ranks(_check_fp8_matmul_all_reduce, world, data.draw(product_examples(world, fp8=True), label="example"))


# Found by test_fp8_matmul_reduce_scatter (shrunk): with b [K, 0] the FP8 dgrad gathered a gradient with an empty
# last dim, which the FP8 gather rejects; the backward raised (fixed in fastmesh/ops/fused_collectives_fp8.py).
FP8_SCATTER_WITH_NO_COLUMNS = dict(
    dtype="float32",
    shape=[1, 1],
    n=0,
    b_transposed=False,
    scatter_dim=0,
    reduce_op="sum",
    pieces=None,
    grads=dict(a_grad=False, b_grad=True, used=[True]),
    seed=0,
    config=dict(granularity="tensorwise", power_of_two=True, backward_in_fp8=True, grad_dtype="float8_e5m2"),
)


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_reduce_scatter_with_no_columns(world):
    example = dict(FP8_SCATTER_WITH_NO_COLUMNS, shape=[world, 1])
    run_on_ranks(_check_fp8_matmul_reduce_scatter, world, example)


# Found by test_fp8_all_gather_matmul (FASTMESH_HYPOTHESIS_EXAMPLES=1000, shrunk): a shard whose gathered dim is
# empty while the dims before it hold more than one row failed in the FP8 gather (the front always asks for the
# gathered a), "The size of tensor a (2) must match the size of tensor b (0)"; the high-precision op returned.
FP8_GATHER_OF_AN_EMPTY_DIM = dict(
    dtype="float32",
    shape=[2, 0, 1],
    gather_dim=-2,
    bs=[(3, False)],
    return_a=False,
    pieces=None,
    grads=dict(a_grad=False, b_grad=False, used=[False, False]),
    seed=0,
    config=dict(granularity="tensorwise", power_of_two=False, backward_in_fp8=False, grad_dtype="float8_e5m2"),
)


def test_fp8_all_gather_of_an_empty_dim():
    """csrc/fused/all_gather_scaled_matmul.cpp returned early only when no rank block had a unit (here: 2 units of
    0 rows); now whenever there are no rows."""
    run_on_ranks(_check_fp8_all_gather_matmul, 2, FP8_GATHER_OF_AN_EMPTY_DIM)


# ---- fastmesh.fp8.quantize, in this process ----

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Sizes around the 128-element blocks, odd ones beside round ones, an empty dim last (shrinking goes to the first).
LEADING, ROWS, COLUMNS = (1, 2, 3, 0), (1, 2, 3, 5, 31, 127, 128, 129, 257, 0), (1, 2, 7, 127, 128, 129, 257, 300, 0)
MIN_DIMS = {"tensorwise": 0, "rowwise": 1, "block1x128": 1, "block128x128": 2}
F32 = torch.finfo(torch.float32)


def special_values(fp8: torch.dtype, input_dtype: torch.dtype) -> list[float]:
    """Values at the edges of the FP8 format and of the input dtype (after scaling by 1, where a scale is given)."""
    info = torch.finfo(fp8)
    top, subnormal = info.max, info.tiny * info.eps  # the largest value; the smallest subnormal
    return [
        *(0.0, -0.0, 1.0, -1.0),
        *(top, -top, top * (1 + info.eps / 2), top * (1 - info.eps / 4), 2 * top),  # the max, and around it
        *(info.tiny, subnormal, subnormal / 2, 1.5 * subnormal, -subnormal),  # the smallest; ties to even
        *(F32.max, -F32.max, F32.tiny, F32.tiny * F32.eps, 1e-40),  # fp32's extremes and subnormals
        *(torch.finfo(input_dtype).max, torch.finfo(input_dtype).tiny),
        *(math.inf, -math.inf, math.nan),
    ]


@st.composite
def quantize_examples(draw) -> dict:
    granularity = draw(st.sampled_from(fp8_reference.GRANULARITIES))
    fp8 = draw(st.sampled_from([E4M3, E5M2]))
    input_dtype = draw(st.sampled_from(INPUT_DTYPES))
    ndim = draw(st.integers(max(MIN_DIMS[granularity], 1 if granularity != "tensorwise" else 0), 3))
    shape = [draw(st.sampled_from(LEADING)) for _ in range(ndim - 2)]
    shape += [draw(st.sampled_from(ROWS))] if ndim >= 2 else []
    shape += [draw(st.sampled_from(COLUMNS))] if ndim >= 1 else []
    scale = draw(st.sampled_from([None, "one", "pow2", "plausible", "extreme"]))
    transpose = ndim >= 2 and (scale is None or granularity in ("tensorwise", "block128x128")) and draw(st.booleans())
    values = st.one_of(st.sampled_from(special_values(fp8, input_dtype)), st.floats(width=32))
    return dict(
        granularity=granularity,
        dtype=fp8,
        input_dtype=input_dtype,
        shape=shape,
        background=draw(st.sampled_from(["normal", "wide", "ints", "zeros"])),
        magnitude=draw(st.integers(-30, 30)),  # the background's power of two
        planted=draw(st.lists(st.tuples(st.integers(0, 2**20), values), max_size=8)),  # (flat index, value)
        column_major=ndim >= 2 and draw(st.booleans()),  # a non-contiguous view of the same values
        scale=scale,
        transpose=transpose,
        power_of_two=scale is None and draw(st.booleans()),
        seed=draw(SEEDS),
    )


def quantize_input(example: dict) -> torch.Tensor:
    shape, seed = example["shape"], example["seed"]
    g = torch.Generator().manual_seed(seed)
    background = example["background"]
    if background == "zeros":
        x = torch.zeros(shape)
    elif background == "ints":
        x = torch.randint(-3, 4, shape, generator=g).float()
    elif background == "wide":  # magnitudes spanning 2^-24..2^24 around the drawn one
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-24, 25, shape, generator=g).float())
    else:
        x = torch.randn(shape, generator=g)
    x = (x * 2.0 ** example["magnitude"]).flatten()
    for index, value in example["planted"]:
        if x.numel():
            x[index % x.numel()] = value
    x = x.reshape(shape).to(example["input_dtype"])
    if example["column_major"]:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x


def given_scale(example: dict, x: torch.Tensor) -> torch.Tensor | None:
    """A dequantization scale in the layout of the granularity: positive, from plausible to extreme."""
    kind, granularity = example["scale"], example["granularity"]
    if kind is None:
        return None
    shape = fp8_reference.scale_shape(x.shape, granularity)
    g = torch.Generator().manual_seed(example["seed"] + 1)
    if kind == "one":
        return torch.ones(shape)
    if kind == "pow2":
        return torch.exp2(torch.randint(-20, 21, shape, generator=g).float())
    if kind == "plausible":  # the amax's scale, off by up to 4x either way
        amax = fp8_reference.group_amax(x, granularity)
        return amax / fp8_reference.FP8_MAX[example["dtype"]] * (torch.rand(shape, generator=g) * 4 + 0.25)
    extremes = torch.tensor([0.0, F32.tiny * F32.eps, 1e-40, F32.tiny, 1e-30, 1e30, F32.max, math.inf])
    return extremes[torch.randint(0, len(extremes), shape, generator=g)]


def assert_bits_equal(got, want, what: str) -> None:
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    )
    if got.dtype in (E4M3, E5M2):
        same = fp8_reference.fp8_bits_equal(got, want)
    else:
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {got.numel()} differ, e.g. at {bad}: "
            f"{[got[tuple(i)].item() for i in bad]} vs {[want[tuple(i)].item() for i in bad]}"
        )


@bounded(200)
@given(example=quantize_examples())
def test_quantize_matches_the_reference(example):
    x = quantize_input(example)
    scale = given_scale(example, x)
    options = dict(transpose=example["transpose"], power_of_two=example["power_of_two"])
    got = fastmesh.fp8.quantize(x, dtype=example["dtype"], granularity=example["granularity"], scale=scale, **options)
    want = fp8_reference.quantize(x.contiguous(), example["dtype"], example["granularity"], scale, **options)
    for what, g, w in zip(("data", "scale", "amax", "data_t", "scale_t"), got, want):
        assert_bits_equal(g, w, what)

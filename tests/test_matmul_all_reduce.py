"""fastmesh.matmul_all_reduce against all_reduce(a @ b), on 2 and 3 gloo ranks.

Small-integer inputs keep every product and partial sum an integer that fp32 (and, with |sums| <= 256, bf16)
represents exactly, so every plan must agree with the unfused reference bit for bit, whatever the summation
order. Each rank function loops over many cases so that the pools' per-call overhead is paid once per test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from comm_counts import c10d_calls
from environment import environment
from graph_census import COMPILE_MODES, assert_compiled_path, graph_census
from rank_pool import on_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh.fp8 import Float8Config
from fastmesh.ops import plan_model, plans
from fastmesh.ops.matmul_all_reduce import plan_call

OP, SCALED_OP = "fastmesh::matmul_all_reduce", "fastmesh::scaled_matmul_all_reduce"
ALL_REDUCE = "c10d::allreduce_"
E4M3 = torch.float8_e4m3fn
ROWWISE = (False, True) if ROWWISE_ON_CPU else (False,)  # torch < 2.13: CPU _scaled_mm tensor-wise only


def small_ints(shape, dtype, seed, low=-1, high=2) -> torch.Tensor:
    """The same tensor on every rank that uses the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def all_reduced(c, reduce_op="sum"):
    """c10d's own all-reduce of ``c`` (a copy)."""
    c = c.clone()
    dist.all_reduce(c)
    return c / dist.get_world_size() if reduce_op == "avg" else c


def reference(a, b, reduce_op="sum"):
    """The unfused sequence: the product, then c10d's own all-reduce."""
    return all_reduced(a @ b, reduce_op)


def _name() -> str:
    return fastmesh.group_name(dist.group.WORLD)


# (a's shape, N): leading dims, one row, a 1-D a, odd sizes, empty rows and an empty contraction.
SHAPES = [((5, 6), 7), ((2, 3, 9), 4), ((1, 33), 5), ((127, 33), 11), ((16,), 3), ((0, 4), 5), ((3, 0), 5)]
PLANS = [None, 1, 2, 3, plans.UNFUSED]  # None: the call's own plan; ints: pieces=


@on_ranks(2, 3)
def test_every_plan_equals_all_reduce_of_the_product(world_size):
    rank = dist.get_rank()
    for dtype, (shape, n), reduce_op, plan in itertools.product(
        (torch.float32, torch.bfloat16, torch.float64), SHAPES, ("sum", "avg"), PLANS
    ):
        a = small_ints(shape, dtype, seed=100 + rank)
        b = small_ints((shape[-1], n), dtype, seed=200 + rank)
        case = f"{dtype} a {list(shape)} N {n} {reduce_op} plan {plan}"
        if isinstance(plan, plans.Plan):
            with plans.override(plan):
                got = fastmesh.matmul_all_reduce(a, b, reduce_op=reduce_op)
        else:
            got = fastmesh.matmul_all_reduce(a, b, reduce_op=reduce_op, pieces=plan)
        want = reference(a, b, reduce_op)
        assert got.shape == want.shape and got.dtype == dtype, case
        assert torch.equal(got, want), f"{case}: max diff {(got.double() - want.double()).abs().max()}"
    plans.forget()


@on_ranks(2)
def test_large_product_in_automatic_pieces():
    rank = dist.get_rank()
    a = small_ints((1000, 45), torch.float32, seed=rank)
    b = small_ints((45, 300), torch.float32, seed=10 + rank)
    with environment(FASTMESH_TUNE="off"):  # the fixed rule: pieces from the size (2 here)
        assert torch.equal(fastmesh.matmul_all_reduce(a, b), reference(a, b))
        assert plans.last_decision(OP)[1].plan == plans.FIXED
    plans.forget()


# ---- autograd ----


def _global_reference(world, dtype, shape, n, reduce_op, grad):
    """Every rank's operands (rebuilt from their seeds) as one matmul, differentiated by autograd."""
    a_full = torch.cat([small_ints(shape, dtype, seed=100 + j) for j in range(world)], dim=-1).requires_grad_()
    b_full = torch.cat([small_ints((shape[-1], n), dtype, seed=200 + j) for j in range(world)]).requires_grad_()
    y = a_full @ b_full
    if reduce_op == "avg":
        y = y / world
    y.backward(grad)
    return y.detach(), a_full.grad.chunk(world, dim=-1), b_full.grad.chunk(world, dim=0)


@on_ranks(2, 3)
def test_gradients_match_autograd_through_the_plain_product(world_size):
    """grad a = G @ b.T and grad b = a.T @ G, with G the replicated output gradient; the backward issues no
    collective at all."""
    rank = dist.get_rank()
    fastmesh.matmul_all_reduce(torch.ones(2, 2), torch.ones(2, 2))  # the first call's shape check, behind us
    for dtype, (shape, n), reduce_op, pieces in itertools.product(
        (torch.float32, torch.float64), [((6, 5), 4), ((2, 3, 7), 3), ((1, 4), 2)], ("sum", "avg"), (None, 1, 2)
    ):
        case = f"{dtype} a {list(shape)} N {n} {reduce_op} pieces {pieces}"
        grad = small_ints(shape[:-1] + (n,), dtype, seed=7)  # the same on every rank, as a replicated output's
        want, grad_as, grad_bs = _global_reference(world_size, dtype, shape, n, reduce_op, grad)
        a = small_ints(shape, dtype, seed=100 + rank).requires_grad_()
        b = small_ints((shape[-1], n), dtype, seed=200 + rank).requires_grad_()
        out = fastmesh.matmul_all_reduce(a, b, reduce_op=reduce_op, pieces=pieces)
        assert torch.equal(out, want), case
        backward = c10d_calls(lambda: out.backward(grad))
        assert backward == {}, f"{case}: {backward}"
        assert torch.equal(a.grad, grad_as[rank]), case
        assert torch.equal(b.grad, grad_bs[rank]), case
    # Only one operand needs a gradient.
    a = small_ints((4, 3), torch.float64, seed=1)
    b = small_ints((3, 2), torch.float64, seed=2).requires_grad_()
    fastmesh.matmul_all_reduce(a, b).sum().backward()
    assert torch.equal(b.grad, a.t() @ torch.ones(4, 2, dtype=torch.float64))


@on_ranks(2, 3)
def test_forward_issues_one_all_reduce_per_piece(world_size):
    fastmesh.matmul_all_reduce(torch.ones(2, 2), torch.ones(2, 2))
    a, b = torch.randn(12, 8), torch.randn(8, 6)
    for pieces in (1, 3):
        counts = c10d_calls(lambda: fastmesh.matmul_all_reduce(a, b, pieces=pieces))
        assert counts == {ALL_REDUCE: pieces}, counts
    with plans.override(plans.UNFUSED):
        counts = c10d_calls(lambda: fastmesh.matmul_all_reduce(a, b))
    assert counts == {ALL_REDUCE: 1}, counts
    plans.forget()


# ---- opcheck, compile ----


@on_ranks(2)
def test_opcheck():
    name = _name()
    for shape, reduce_op, pieces in (((4, 6), "sum", 0), ((2, 3, 6), "avg", 2), ((6,), "sum", 1)):
        a = torch.randn(shape, requires_grad=True)
        b = torch.randn(6, 5, requires_grad=True)
        torch.library.opcheck(torch.ops.fastmesh.matmul_all_reduce, (a, b, reduce_op, name, pieces))


def _row_parallel_block(x, w1, w2):
    """A plain-TP MLP: column-parallel w1 (x replicated), row-parallel w2 (its product all-reduced)."""
    return fastmesh.matmul_all_reduce(torch.relu(x @ w1), w2)


@on_ranks(2)
def test_compile_fullgraph_matches_eager():
    rank = dist.get_rank()
    torch._dynamo.reset()
    for backend, tune in COMPILE_MODES:
        results = []
        with environment(FASTMESH_TUNE=tune), graph_census() as census:
            for compiled in (False, True):
                x = small_ints((2, 5, 8), torch.float32, seed=1).requires_grad_()
                w1 = small_ints((8, 6), torch.float32, seed=10 + rank).requires_grad_()
                w2 = small_ints((6, 8), torch.float32, seed=20 + rank).requires_grad_()
                fn = _row_parallel_block
                if compiled:
                    fn = torch.compile(fn, fullgraph=True, backend=backend)
                out = fn(x, w1, w2)
                out.sum().backward()
                results.append([out, x.grad, w1.grad, w2.grad])
        for got, want in zip(*results):
            assert torch.equal(got, want), (backend, tune)
        if backend == "inductor":
            assert_compiled_path(census, tune, ("fastmesh.matmul_all_reduce",))
        torch._dynamo.reset()
    plans.forget()


# ---- world of one, DTensor ----


@on_ranks(2)
def test_group_of_one_is_a_plain_matmul():
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    a = torch.randn(3, 4, 6)
    b = torch.randn(6, 5)
    for reduce_op in ("sum", "avg"):
        assert torch.equal(fastmesh.matmul_all_reduce(a, b, group=singles[rank], reduce_op=reduce_op), a @ b)


@on_ranks(2, 3)
def test_dtensor_inputs_give_a_replicated_dtensor(world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    h = small_ints((2, 5, 4 * world_size), torch.float32, seed=3)  # the same global tensor on every rank
    w2 = small_ints((4 * world_size, 6), torch.float32, seed=4)
    h_d = distribute_tensor(h, mesh, [Shard(2)]).requires_grad_()
    for b in (distribute_tensor(w2, mesh, [Shard(0)]), w2.chunk(world_size)[dist.get_rank()]):
        out = fastmesh.matmul_all_reduce(h_d, b, reduce_op="sum")
        assert isinstance(out, DTensor) and out.placements == (Replicate(),) and out.shape == (2, 5, 6)
        assert torch.equal(out.to_local(), h @ w2)
    out.to_local().sum().backward()
    assert isinstance(h_d.grad, DTensor) and h_d.grad.placements == (Shard(2),)
    assert torch.equal(h_d.grad.full_tensor(), torch.ones(2, 5, 6) @ w2.t())
    with pytest.raises(ValueError, match=r"fastmesh.matmul_all_reduce: a must be placed Shard\(2\)"):
        fastmesh.matmul_all_reduce(distribute_tensor(h, mesh, [Shard(1)]), w2)
    with pytest.raises(TypeError, match=r"b is a DTensor, so a must be a DTensor placed Shard\(-1\) too"):
        fastmesh.matmul_all_reduce(h, distribute_tensor(w2, mesh, [Shard(0)]))


# ---- plans ----


@on_ranks(2)
def test_modes_and_given_pieces():
    a = small_ints((8, 4), torch.float32, seed=1)
    b = small_ints((4, 3), torch.float32, seed=2)
    plans.forget()
    fastmesh.matmul_all_reduce(a, b, pieces=3)
    assert plans.last_decision(OP)[1] == plans.Decision(plans.Plan("rows", 3), "pieces= given")
    with environment(FASTMESH_TUNE="off"):
        fastmesh.matmul_all_reduce(a, b)
        assert plans.last_decision(OP)[1].plan == plans.FIXED
    with environment(FASTMESH_TUNE="model"):
        fastmesh.matmul_all_reduce(a, b)
        key, decision = plans.last_decision(OP)
        assert key.startswith(f"{OP}|gloo|cpu|a=[8, 4]|n=3|dtype=torch.float32|world=2|"), key
        assert decision.source == "model" and decision.plan == plans.UNFUSED, decision  # tiny: all latency
    with environment(FASTMESH_TUNE="measure"):
        plans.forget()
        got = fastmesh.matmul_all_reduce(a, b)
        decision = plans.last_decision(OP)[1]
        assert decision.source in ("measured", "cache"), decision
        assert decision.plan in plan_call(a, b, _name()).candidates
        assert torch.equal(got, reference(a, b))
    plans.forget()


def _shape(rows, k, n, dtype="bfloat16", device_type="cpu"):
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return plan_model.Shape("all_reduce", 2, rows, k, (n,), 1, False, size, size, dtype, 1, device_type)


def _candidates():
    return [plans.Plan("rows", p) for p in (2, 4, 8)] + [plans.UNFUSED]


def test_model_does_not_cut_rows_when_the_weight_dominates():
    chosen, times = plan_model.best(_shape(64, 4096, 4096, "float32"), _candidates())
    assert chosen == plans.UNFUSED, (chosen, times)
    assert times["rowsx2"] < times["rowsx4"] < times["rowsx8"]


def test_model_overlaps_where_the_transfer_is_as_long_as_the_multiply():
    # CPU: a 4096 x 1024 bf16 product (a ring all-reduce sends 8 MiB, ~5.6 ms over gloo) beside a ~5 ms
    # multiply. The transfer takes CPU from the multiplies there, so overlap gains little.
    chosen, times = plan_model.best(_shape(4096, 128, 1024), _candidates())
    assert chosen.split == "rows" and times[chosen.label] < 0.95 * times["unfused"], times
    # CUDA (NCCL takes no compute in the model): an 8192 x 4096 bf16 product beside a 4096-deep multiply.
    chosen, times = plan_model.best(_shape(8192, 4096, 4096, device_type="cuda"), _candidates())
    assert chosen.split == "rows" and times[chosen.label] < 0.85 * times["unfused"], times


# ---- bad inputs ----


def _bad_calls():
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    return [
        (dict(a=a.int(), b=b), TypeError, r"a must be float32, bfloat16, float16 or float64, got torch.int32"),
        (dict(a=a, b=b.double()), TypeError, r"b must have a's dtype torch.float32, got torch.float64"),
        (dict(a=a, b=torch.randn(5, 5)), ValueError, r"b must have 6 rows \(a's last dim\), got shape \[5, 5\]"),
        (dict(a=a, b=b.view(6, 5, 1)), ValueError, r"b must have 2 dim\(s\), got shape \[6, 5, 1\]"),
        (dict(a=torch.randn(()), b=b), ValueError, r"a must have at least 1 dim\(s\), got shape \[\]"),
        (dict(a=a, b=b, reduce_op="max"), ValueError, r'reduce_op must be "sum" or "avg", got "max"'),
        (dict(a=a, b=b, pieces=-1), ValueError, r"pieces must be an int >= 0"),
    ]


@on_ranks(2)
def test_bad_inputs_raise_naming_the_argument():
    for kwargs, error, match in _bad_calls():
        with pytest.raises(error, match=rf"fastmesh::matmul_all_reduce: {match}"):
            fastmesh.matmul_all_reduce(**kwargs)
    # The C++ kernel checks the same things, in the same words (callers of the op with real tensors).
    ext = fastmesh._cpp_lib.load()
    for kwargs, error, match in _bad_calls():
        args = (kwargs["a"], kwargs["b"], kwargs.get("reduce_op", "sum"), _name(), kwargs.get("pieces", 0), "rows")
        with pytest.raises(error, match=rf"fastmesh::matmul_all_reduce: {match}"):
            ext.matmul_all_reduce(*args)
    with pytest.raises(ValueError, match=r'split must be "rows" or "none"'):
        ext.matmul_all_reduce(torch.randn(4, 6), torch.randn(6, 5), "sum", _name(), 0, "columns")


@on_ranks(2)
def test_operands_that_differ_across_ranks_raise_on_every_rank():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"a @ b must have the same shape and dtype on every rank"):
        fastmesh.matmul_all_reduce(torch.randn(4, 3), torch.randn(3, 2 + rank), group=dist.new_group([0, 1]))
    # A contraction split unevenly, though only the product travels: the ranks agree on a plan once per shape, so
    # differing operands could leave one waiting (a DTensor's uneven shards are padded: test_fused_collectives.py).
    a, b = small_ints((4, 2 + rank), torch.float32, seed=rank), small_ints((2 + rank, 3), torch.float32, seed=5)
    with pytest.raises(ValueError, match=r"fastmesh::matmul_all_reduce: a must have the same shape and dtype"):
        fastmesh.matmul_all_reduce(a, b, group=dist.new_group([0, 1]))


@on_ranks(2)
def test_chunks_is_a_deprecated_alias_of_pieces():
    a, b = small_ints((4, 6), torch.float32, 0), small_ints((6, 4), torch.float32, 1)
    want = fastmesh.matmul_all_reduce(a, b, pieces=2)
    with pytest.warns(FutureWarning, match=r"fastmesh.matmul_all_reduce: chunks= is deprecated, use pieces=") as rec:
        got = fastmesh.matmul_all_reduce(a, b, chunks=2)
    assert torch.equal(got, want)
    assert rec[0].filename == __file__, rec[0].filename
    with pytest.raises(TypeError, match=r"pass pieces= only; chunks= is its deprecated alias"):
        fastmesh.matmul_all_reduce(a, b, pieces=2, chunks=2)


# ---- the FP8 form ----


def _pow2(shape, seed) -> torch.Tensor:
    """Scales 1 or 2: products of small integers stay integers that bf16 holds exactly."""
    return torch.pow(2.0, torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).float())


@on_ranks(2, 3)
def test_scaled_matmul_all_reduce_equals_all_reduce_of_the_dequantized_product(world_size):
    rank, name = dist.get_rank(), _name()
    for (shape, n), rowwise_a, rowwise_b, out_dtype, reduce_op, plan in itertools.product(
        [((6, 16), 5), ((2, 3, 16), 7), ((1, 32), 3), ((0, 16), 4)],
        ROWWISE,
        ROWWISE,
        (torch.float32, torch.bfloat16),
        ("sum", "avg"),
        (0, 1, 3, plans.UNFUSED),
    ):
        a = small_ints(shape, torch.float32, seed=100 + rank).to(E4M3)
        b = small_ints((n, shape[-1]), torch.float32, seed=200 + rank).to(E4M3).t()  # column-major, as _scaled_mm
        a_scale = _pow2(shape[:-1] + (1,) if rowwise_a else (), seed=300 + rank)
        b_scale = _pow2((1, n) if rowwise_b else (), seed=400 + rank)
        args = (a, a_scale, b, b_scale, reduce_op, name, out_dtype)
        if isinstance(plan, plans.Plan):
            with plans.override(plan):
                got = torch.ops.fastmesh.scaled_matmul_all_reduce(*args)
        else:
            got = torch.ops.fastmesh.scaled_matmul_all_reduce(*args, plan)
        product = ((a.float() * a_scale) @ (b.float() * b_scale)).to(out_dtype)
        want = all_reduced(product, reduce_op)
        case = f"a {list(shape)} N {n} rowwise a {rowwise_a} b {rowwise_b} {out_dtype} {reduce_op} plan {plan}"
        assert got.dtype == out_dtype and torch.equal(got, want), case
    plans.forget()


@on_ranks(2)
def test_fp8_front_equals_the_high_precision_op_on_exact_inputs():
    """Small integers quantize exactly with power-of-two scales, so the FP8 form gives the high-precision op's
    bits, forward and backward (its backward runs in the input dtype, locally)."""
    rank = dist.get_rank()
    granularities = ("tensorwise", "rowwise") if len(ROWWISE) == 2 else ("tensorwise",)
    for granularity in granularities + ("mx", "block1x128"):
        config = Float8Config(granularity=granularity, power_of_two=granularity != "mx")
        results = []
        for fp8 in (config, None):
            a = small_ints((2, 5, 32), torch.bfloat16, seed=rank).requires_grad_()
            b = small_ints((32, 8), torch.bfloat16, seed=10 + rank).requires_grad_()
            out = fastmesh.matmul_all_reduce(a, b, reduce_op="avg", fp8=fp8)
            grad = small_ints(out.shape, torch.bfloat16, seed=3)
            backward = c10d_calls(lambda: out.backward(grad))
            assert backward == {}, backward
            results.append((out, a.grad, b.grad))
        for got, want in zip(*results):
            assert torch.equal(got, want), granularity
    with pytest.raises(ValueError, match="fp8 granularity must be one of 'tensorwise', 'rowwise', 'mx', 'block1x128'"):
        fastmesh.matmul_all_reduce(a, b, fp8=Float8Config(granularity="block128x128"))


@on_ranks(2)
def test_scaled_op_checks_and_opcheck():
    name = _name()
    a, b = small_ints((4, 16), torch.float32, 1).to(E4M3), small_ints((16, 8), torch.float32, 2).to(E4M3)
    one = torch.ones(())
    bad = [
        ((a.float(), one, b, one), TypeError, r"a must be float8_e4m3fn or float8_e5m2, got torch.float32"),
        ((a, one, b[:8], one), ValueError, r"b must have 16 rows \(a's last dim\), got shape \[8, 8\]"),
        ((a, torch.ones(3, 1), b, one), ValueError, r"a_scale must be tensor-wise \(shape \[\]\), row-wise"),
    ]
    ext = fastmesh._cpp_lib.load()
    for (a_, sa, b_, sb), error, match in bad:
        with pytest.raises(error, match=rf"{SCALED_OP}: {match}"):
            torch.ops.fastmesh.scaled_matmul_all_reduce(a_, sa, b_, sb, "sum", name, torch.float32)
        with pytest.raises(error, match=rf"{SCALED_OP}: {match}"):
            ext.scaled_matmul_all_reduce(a_, sa, b_, sb, "sum", name, torch.float32, 0, "rows")
    with pytest.raises(TypeError, match=rf"{SCALED_OP}: out_dtype must be torch.float32, torch.bfloat16"):
        torch.ops.fastmesh.scaled_matmul_all_reduce(a, one, b, one, "sum", name, torch.float64)
    # opcheck's schema test compares inputs with arithmetic float8 tensors lack on CPU: the other tests run here.
    args = (a, one, b, one, "avg", name, torch.bfloat16, 2)
    torch.library.opcheck(
        torch.ops.fastmesh.scaled_matmul_all_reduce,
        args,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )

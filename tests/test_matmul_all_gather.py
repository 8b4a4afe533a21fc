"""fastmesh.matmul_all_gather against cat(all_gather(a @ b), -1), on 2 and 3 gloo ranks.

Small-integer inputs keep every product an integer that fp32 and bf16 represent exactly, so every plan must agree
with the unfused reference bit for bit. Each rank function loops over many cases so that the pools' per-call
overhead is paid once per test.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from comm_counts import c10d_calls, p2p_pieces
from environment import environment
from graph_census import COMPILE_MODES, assert_compiled_path, graph_census
from rank_pool import on_ranks
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

import fastmesh
from fastmesh.ops import plan_model, plans
from fastmesh.ops.matmul_all_gather import plan_call

OP = "fastmesh::matmul_all_gather"


def small_ints(shape, dtype, seed, low=-2, high=3) -> torch.Tensor:
    """The same tensor on every rank that uses the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def reference(a, b):
    """The unfused sequence: the product, then c10d's own all-gather, rank blocks along the last dim."""
    c = a @ b
    parts = [torch.empty_like(c) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, c.contiguous())
    return torch.cat(parts, dim=-1)


def _name() -> str:
    return fastmesh.group_name(dist.group.WORLD)


# (a's shape, n): leading dims, one row, a 1-D a, odd sizes, empty rows, an empty contraction, no columns.
SHAPES = [((5, 6), 7), ((2, 3, 9), 4), ((1, 33), 5), ((127, 33), 11), ((16,), 3), ((0, 4), 5), ((3, 0), 5), ((3, 4), 0)]
PLANS = [None, 1, 2, 3, plans.UNFUSED]  # None: the call's own plan; ints: pieces=


@on_ranks(2, 3)
def test_every_plan_equals_the_gather_of_the_products(world_size):
    rank = dist.get_rank()
    for dtype, (shape, n), plan in itertools.product((torch.float32, torch.bfloat16, torch.float64), SHAPES, PLANS):
        a = small_ints(shape, dtype, seed=100 + rank)  # differs per rank: each rank's block is its own product
        b = small_ints((shape[-1], n), dtype, seed=200 + rank)
        case = f"{dtype} a {list(shape)} n {n} plan {plan}"
        if isinstance(plan, plans.Plan):
            with plans.override(plan):
                got = fastmesh.matmul_all_gather(a, b)
        else:
            got = fastmesh.matmul_all_gather(a, b, pieces=plan)
        want = reference(a, b)
        assert got.shape == want.shape and got.dtype == dtype, case
        assert torch.equal(got, want), case
    plans.forget()


@on_ranks(2)
def test_transposed_weight_and_automatic_pieces():
    rank = dist.get_rank()
    a = small_ints((1000, 45), torch.float32, seed=rank)
    w = small_ints((300, 45), torch.float32, seed=10 + rank)  # a linear's weight rows: b = w.t(), a view
    with environment(FASTMESH_TUNE="off"):  # the fixed rule: pieces from the size
        assert torch.equal(fastmesh.matmul_all_gather(a, w.t()), reference(a, w.t()))
        assert plans.last_decision(OP)[1].plan == plans.FIXED
    plans.forget()


@on_ranks(2, 3)
def test_each_piece_travels_once(world_size):
    fastmesh.matmul_all_gather(torch.ones(2, 2), torch.ones(2, 2))  # the first call's shape check, behind us
    a, b = torch.randn(12, 8), torch.randn(8, 6)
    for pieces in (1, 3):
        counts = c10d_calls(lambda: fastmesh.matmul_all_gather(a, b, pieces=pieces))
        assert counts == p2p_pieces(world_size, pieces), counts
    plans.forget()


# ---- autograd ----


@on_ranks(2, 3)
def test_gradients_keep_this_ranks_columns_without_communication(world_size):
    """With G the replicated output gradient: grad a = G_r @ b.T and grad b = a.T @ G_r, G_r this rank's column
    block (DTensor's convention for a Replicate() output); summed over the ranks, the a gradients are the
    gradient of the whole product."""
    rank = dist.get_rank()
    fastmesh.matmul_all_gather(torch.ones(2, 2), torch.ones(2, 2))
    for dtype, (shape, n), pieces in itertools.product(
        (torch.float32, torch.float64), [((6, 5), 4), ((2, 3, 7), 3), ((1, 4), 2)], (None, 1, 2)
    ):
        case = f"{dtype} a {list(shape)} n {n} pieces {pieces}"
        a_full = small_ints(shape, dtype, seed=1)  # replicated, as a column-parallel input
        b_full = small_ints((shape[-1], world_size * n), dtype, seed=2)
        grad = small_ints(shape[:-1] + (world_size * n,), dtype, seed=7)  # the same on every rank
        a = a_full.clone().requires_grad_()
        b = b_full.chunk(world_size, dim=1)[rank].clone().requires_grad_()
        out = fastmesh.matmul_all_gather(a, b, pieces=pieces)
        assert torch.equal(out, a_full @ b_full), case
        backward = c10d_calls(lambda: out.backward(grad))
        assert backward == {}, f"{case}: {backward}"
        mine = grad.chunk(world_size, dim=-1)[rank]
        assert torch.equal(a.grad, mine @ b.detach().t()), case
        assert torch.equal(b.grad, a_full.reshape(-1, shape[-1]).t() @ mine.reshape(-1, n)), case
        total = a.grad.clone()
        dist.all_reduce(total)
        assert torch.equal(total, grad @ b_full.t()), case


# ---- opcheck, compile ----


@on_ranks(2)
def test_opcheck():
    name = _name()
    for shape, pieces in (((4, 6), 0), ((2, 3, 6), 2), ((6,), 1)):
        a = torch.randn(shape, requires_grad=True)
        b = torch.randn(6, 5, requires_grad=True)
        torch.library.opcheck(torch.ops.fastmesh.matmul_all_gather, (a, b, name, pieces))
    torch.library.opcheck(torch.ops.fastmesh.rank_columns, (torch.randn(3, 2 * dist.get_world_size()), name))


def _lm_head(h, w1, w_out):
    """A replicated input through a column-parallel hidden layer's local part and a gathered head."""
    return fastmesh.matmul_all_gather(torch.relu(h @ w1), w_out)


@on_ranks(2)
def test_compile_fullgraph_matches_eager():
    # Inductor's caches stay on under the model: the ranks share them, so a rank-dependent compiled backward would
    # be loaded by the other rank (the reason for fastmesh::rank_columns). The census, which needs them off (a
    # cached graph runs no post-grad pass), checks the fused path.
    rank = dist.get_rank()
    torch._dynamo.reset()
    for backend, tune in COMPILE_MODES:
        census_or_not = graph_census() if tune == "off" else contextlib.nullcontext()
        with environment(FASTMESH_TUNE=tune), census_or_not as census:
            results = []
            for compiled in (False, True):
                h = small_ints((2, 5, 8), torch.float32, seed=1).requires_grad_()
                w1 = small_ints((8, 6), torch.float32, seed=10).requires_grad_()
                w_out = small_ints((6, 4), torch.float32, seed=20 + rank).requires_grad_()
                fn = torch.compile(_lm_head, fullgraph=True, backend=backend) if compiled else _lm_head
                out = fn(h, w1, w_out)
                out.backward(small_ints(out.shape, torch.float32, seed=3))
                results.append([out, h.grad, w1.grad, w_out.grad])
            for got, want in zip(*results):
                assert torch.equal(got, want), (backend, tune)
        if census is not None:
            assert_compiled_path(census, tune, ("fastmesh.matmul_all_gather",))
        torch._dynamo.reset()
    plans.forget()


# ---- world of one, DTensor ----


@on_ranks(2)
def test_group_of_one_is_a_plain_matmul():
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    a, b = torch.randn(3, 4, 6), torch.randn(6, 5)
    assert torch.equal(fastmesh.matmul_all_gather(a, b, group=singles[rank]), a @ b)


@on_ranks(2, 3)
def test_dtensor_inputs_give_a_replicated_dtensor_and_a_partial_gradient(world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    h = small_ints((2, 5, 4), torch.float32, seed=3)
    w = small_ints((4, 3 * world_size), torch.float32, seed=4)
    h_d = distribute_tensor(h, mesh, [Replicate()]).requires_grad_()
    for b in (distribute_tensor(w, mesh, [Shard(1)]), w.chunk(world_size, dim=1)[dist.get_rank()]):
        out = fastmesh.matmul_all_gather(h_d, b)
        assert isinstance(out, DTensor) and out.placements == (Replicate(),) and out.shape == (2, 5, 3 * world_size)
        assert torch.equal(out.to_local(), h @ w)
    out.sum().backward()
    # Each rank's part of the gradient (its columns'), summed when it is made replicated: as for F.linear.
    assert isinstance(h_d.grad, DTensor) and h_d.grad.placements == (Partial(),)
    assert torch.equal(h_d.grad.full_tensor(), torch.ones(2, 5, 3 * world_size) @ w.t())
    with pytest.raises(ValueError, match=r"fastmesh.matmul_all_gather: a must be placed Replicate\(\)"):
        fastmesh.matmul_all_gather(distribute_tensor(h, mesh, [Shard(1)]), w)
    with pytest.raises(ValueError, match=r"b must be placed Shard\(1\)"):
        fastmesh.matmul_all_gather(h_d, distribute_tensor(w, mesh, [Replicate()]))
    with pytest.raises(TypeError, match=r"b is a DTensor, so a must be a DTensor placed Replicate\(\) too"):
        fastmesh.matmul_all_gather(h, distribute_tensor(w, mesh, [Shard(1)]))


# ---- plans ----


@on_ranks(2)
def test_modes_and_given_pieces():
    a, b = small_ints((8, 4), torch.float32, seed=1), small_ints((4, 3), torch.float32, seed=2)
    plans.forget()
    fastmesh.matmul_all_gather(a, b, pieces=3)
    assert plans.last_decision(OP)[1] == plans.Decision(plans.Plan("rows", 3), "pieces= given")
    with environment(FASTMESH_TUNE="model"):
        fastmesh.matmul_all_gather(a, b)
        key, decision = plans.last_decision(OP)
        assert key.startswith(f"{OP}|gloo|cpu|a=[8, 4]|n=3|dtype=torch.float32|world=2|"), key
        assert decision.source == "model" and decision.plan == plans.UNFUSED, decision  # tiny: all latency
    with environment(FASTMESH_TUNE="measure"):
        plans.forget()
        got = fastmesh.matmul_all_gather(a, b)
        decision = plans.last_decision(OP)[1]
        assert decision.source in ("measured", "cache"), decision
        assert decision.plan in plan_call(a, b, _name()).candidates
        assert torch.equal(got, reference(a, b))
    plans.forget()


def test_model_overlaps_a_large_vocabulary_gather_on_cuda_and_not_a_tiny_one():
    candidates = [plans.Plan("rows", p) for p in (2, 4, 8)] + [plans.UNFUSED]

    def shape(rows, k, n, device_type):
        return plan_model.Shape("product_all_gather", 8, rows, k, (n,), 1, False, 2, 2, "bfloat16", 1, device_type)

    # An LM head: 8192 tokens, 4096 features, 128k / 8 vocabulary columns per rank.
    chosen, times = plan_model.best(shape(8192, 4096, 16384, "cuda"), candidates)
    assert chosen.split == "rows" and times[chosen.label] < 0.85 * times["unfused"], times
    chosen, times = plan_model.best(shape(4, 64, 64, "cpu"), candidates)
    assert chosen == plans.UNFUSED, times


# ---- bad inputs ----


def _bad_calls():
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    return [
        (dict(a=a.int(), b=b), TypeError, r"a must be float32, bfloat16, float16 or float64, got torch.int32"),
        (dict(a=a, b=b.double()), TypeError, r"b must have a's dtype torch.float32, got torch.float64"),
        (dict(a=a, b=torch.randn(5, 5)), ValueError, r"b must have 6 rows \(a's last dim\), got shape \[5, 5\]"),
        (dict(a=a, b=b.view(6, 5, 1)), ValueError, r"b must have 2 dim\(s\), got shape \[6, 5, 1\]"),
        (dict(a=torch.randn(()), b=b), ValueError, r"a must have at least 1 dim\(s\), got shape \[\]"),
        (dict(a=a, b=b, pieces=-1), ValueError, r"pieces must be an int >= 0"),
    ]


@on_ranks(2)
def test_bad_inputs_raise_naming_the_argument():
    for kwargs, error, match in _bad_calls():
        with pytest.raises(error, match=rf"{OP}: {match}"):
            fastmesh.matmul_all_gather(**kwargs)
    # The C++ kernel checks the same things, in the same words (callers of the op with real tensors).
    ext = fastmesh._cpp_lib.load()
    for kwargs, error, match in _bad_calls():
        args = (kwargs["a"], kwargs["b"], _name(), kwargs.get("pieces", 0), "rows")
        with pytest.raises(error, match=rf"{OP}: {match}"):
            ext.matmul_all_gather(*args)
    with pytest.raises(ValueError, match=r'split must be "rows" or "none"'):
        ext.matmul_all_gather(torch.randn(4, 6), torch.randn(6, 5), _name(), 0, "columns")


@on_ranks(2)
def test_products_that_differ_across_ranks_raise_on_every_rank():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"a @ b must have the same shape and dtype on every rank"):
        fastmesh.matmul_all_gather(torch.randn(4, 3), torch.randn(3, 2 + rank), group=dist.new_group([0, 1]))

"""fastmesh.all_gather_matmul / matmul_reduce_scatter against the unfused reference, on 2 and 4 gloo ranks.

Exactness: with small-integer inputs every product and partial sum is an integer that fp32 (and, with
|sums| <= 256, bf16) represents exactly, so fused and unfused must agree bit for bit whatever the
summation order. With random inputs the summation order may differ (pieces, the split contraction), so
the fused result's error against a float64 computation must stay within twice the unfused result's error
(plus a few ulps at the result's scale), the same-precision baseline rule.

Each rank function loops over many cases so that the pools' per-call overhead is paid once per test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from comm_counts import PLAIN_GATHER, c10d_calls, p2p_pieces
from environment import environment
from fastmesh.kernels import fused_reference as ref
from graph_census import COMPILE_MODES, assert_compiled_path, graph_census
from rank_pool import on_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from torch_support import NATIVE_PLAN_RUNS_UNEVEN_SEQUENCES, layer_input

import fastmesh
from fastmesh.ops import plans

WORLD = "WORLD"  # placeholder: ranks resolve it to the default group's name


def _world_name() -> str:
    return dist.group.WORLD.group_name


def small_ints(shape, dtype, seed, low=-2, high=3) -> torch.Tensor:
    """The same tensor on every rank that uses the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def randn(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def shard_shape(rows: int, k: int, gather_dim: int) -> list[int]:
    """A 3-D shard [B, S, K]: `rows` entries at the gathered dim (at S when the last dim is gathered, whose
    size is then k); B = 2 so that dims 0 and 1 differ."""
    shape = [2, 5, k]
    shape[min(gather_dim, 1)] = rows
    return shape


# (shard rows, K) with K the contraction for rows gathers; odd sizes beside round ones.
ROW_CASES = [(1, 7), (3, 42), (127, 33), (16, 64)]


def _gather_cases(world):
    for (rows, k), gather_dim, nbs, return_a, pieces in itertools.product(
        ROW_CASES, (0, 1, 2, -1), (1, 2, 3), (False, True), (0, 3)
    ):
        if gather_dim in (2, -1):
            k = max(1, k // world) if rows != 127 else 11  # contraction split: each rank holds K/W columns
        yield rows, k, gather_dim, nbs, return_a, pieces


def _check_gather_case(rank, world, dtype, make, rows, k, gather_dim, nbs, return_a, pieces, exact):
    shape = shard_shape(rows, k, gather_dim % 3)
    a_shard = make(shape, dtype, seed=100 + rank)
    k_full = k * world if gather_dim % 3 == 2 else k
    # Odd-numbered bs as transposed views (b = w.t() of a row-major w), the usual way weights arrive.
    bs = [
        make((k_full, 5 + 4 * i), dtype, seed=7 + i) if i % 2 == 0 else make((5 + 4 * i, k_full), dtype, seed=7 + i).t()
        for i in range(nbs)
    ]
    got_a, got = fastmesh.all_gather_matmul(a_shard, bs, gather_dim, return_a=return_a, pieces=pieces or None)
    want_a, want = ref.all_gather_matmul(a_shard, bs, gather_dim, _world_name(), return_a=return_a)
    case = f"shard {shape}, gather_dim {gather_dim}, {nbs} bs, return_a {return_a}, pieces {pieces}"
    assert (got_a is None) == (not return_a), case
    if return_a:
        assert torch.equal(got_a, want_a), case
    assert len(got) == nbs
    for g, w, b in zip(got, want, bs):
        assert g.shape == w.shape and g.dtype == w.dtype, case
        if exact:
            assert torch.equal(g, w), f"{case}: max diff {(g.float() - w.float()).abs().max()}"
        else:
            exact64 = ref.all_gather_matmul(a_shard.double(), [b.double()], gather_dim, _world_name())[1][0]
            assert_within_baseline(g, w, exact64, case)


def assert_within_baseline(got, baseline, exact64, case):
    err = (got.double() - exact64).abs().max().item()
    base = (baseline.double() - exact64).abs().max().item()
    ulp = torch.finfo(got.dtype).eps * exact64.abs().max().item()
    assert err <= 2 * base + 4 * ulp, f"{case}: error {err:.3g} vs unfused {base:.3g} (ulp at scale {ulp:.3g})"


@on_ranks(2, 4)
def test_all_gather_matmul_small_integers_bit_exact(world_size):
    rank = dist.get_rank()
    for dtype in (torch.float32, torch.bfloat16):
        for case in _gather_cases(world_size):
            # |values| <= 1 keeps every partial sum within bf16's exact integers (K_full <= 168 here).
            _check_gather_case(
                rank, world_size, dtype, lambda s, d, seed: small_ints(s, d, seed, -1, 2), *case, exact=True
            )


@on_ranks(2, 4)
def test_all_gather_matmul_random_within_baseline_error(world_size):
    rank = dist.get_rank()
    for dtype in (torch.float32, torch.bfloat16):
        for case in _gather_cases(world_size):
            if case[3] == 1 and case[4] is False:  # one b, no a: the rest of the grid covers the numerics
                _check_gather_case(rank, world_size, dtype, randn, *case, exact=False)


@pytest.mark.smoke
@on_ranks(2)
def test_all_gather_matmul_large_shard():
    """1000 rows per rank, K and N not multiples of 8, several automatic pieces."""
    rank = dist.get_rank()
    a_shard = small_ints((1000, 300), torch.float32, seed=rank)
    bs = [small_ints((300, 93), torch.float32, seed=9)]
    a, (out,) = fastmesh.all_gather_matmul(a_shard, bs, 0, return_a=True)
    want_a, (want,) = ref.all_gather_matmul(a_shard, bs, 0, _world_name(), return_a=True)
    assert torch.equal(a, want_a) and torch.equal(out, want)


@on_ranks(2)
def test_one_dim_and_empty_inputs():
    """A 1-D shard (its only dim is the contraction) and shards with no rows or no columns."""
    name = _world_name()
    rank = dist.get_rank()
    vector = small_ints((6,), torch.float32, seed=rank)
    b = small_ints((12, 5), torch.float32, seed=1)
    _, (got,) = fastmesh.all_gather_matmul(vector, [b], 0)
    assert torch.equal(got, ref.all_gather_matmul(vector, [b], 0, name)[1][0])
    got = fastmesh.matmul_reduce_scatter(vector, small_ints((6, 4), torch.float32, seed=2 + rank), 0)
    assert torch.equal(
        got, ref.matmul_reduce_scatter(vector, small_ints((6, 4), torch.float32, seed=2 + rank), 0, "sum", name)
    )
    for shard in (torch.empty(0, 6), torch.empty(3, 0)):
        bs = [torch.ones(shard.shape[1], 4)]
        a, (got,) = fastmesh.all_gather_matmul(shard, bs, 0, return_a=True)
        want_a, (want,) = ref.all_gather_matmul(shard, bs, 0, name, return_a=True)
        assert torch.equal(a, want_a) and torch.equal(got, want)
    got = fastmesh.matmul_reduce_scatter(torch.empty(0, 6), torch.ones(6, 4), 0)
    assert got.shape == (0, 4)
    got = fastmesh.matmul_reduce_scatter(torch.empty(4, 0), torch.ones(0, 4), 0)  # an empty sum: zeros
    assert torch.equal(got, torch.zeros(2, 4))


def _random_gather_call(r, rank, world):
    """A random valid all_gather_matmul call: 1-4 dims, any gather dim, empty dims now and then, 1-3 bs (some
    transposed, some with no columns), return_a either way, any piece count."""
    ndim = r.randint(1, 4)
    shape = [r.randint(0 if r.random() < 0.05 else 1, 5) for _ in range(ndim)]
    dim = r.randrange(-ndim, ndim)
    k = shape[-1] * (world if dim % ndim == ndim - 1 else 1)
    bs = []
    for _ in range(r.randint(1, 3)):
        n = r.randint(0, 6)
        bs.append(
            small_ints((n, k), torch.float64, seed=r.randrange(10**6)).t()
            if r.random() < 0.5
            else small_ints((k, n), torch.float64, seed=r.randrange(10**6))
        )
    a = small_ints(shape, torch.float64, seed=r.randrange(10**6) + rank)
    return a, bs, dim, r.random() < 0.5, r.choice([None, 1, 2, 3, 7])


def _random_scatter_call(r, rank, world):
    """A random valid matmul_reduce_scatter call: any scatter dim, empty dims now and then, either reduce op."""
    ndim = r.randint(1, 4)
    shape = [r.randint(0 if r.random() < 0.1 else 1, 4) for _ in range(ndim)]
    dim = r.randrange(-ndim, ndim)
    n = r.randint(0, 4)
    if dim % ndim == ndim - 1:
        n *= world
    else:
        shape[dim % ndim] *= world
    a = small_ints(shape, torch.float64, seed=r.randrange(10**6) + rank)
    b = small_ints((shape[-1], n), torch.float64, seed=r.randrange(10**6) + rank)
    return (
        a,
        (b.t().contiguous().t() if r.random() < 0.5 else b),
        dim,
        r.choice(["sum", "avg"]),
        r.choice([None, 1, 2, 5]),
    )


@on_ranks(2, 4)
def test_random_calls_match_the_reference():
    """A seeded sweep over the valid arguments of both ops (float64 small integers: every result exact), forward and
    backward against the reference. Such a sweep found the empty-last-dim backward bug."""
    import random

    rank, world, name = dist.get_rank(), dist.get_world_size(), _world_name()
    r = random.Random(2026)  # the same calls on every rank
    for call in range(40):
        a, bs, dim, return_a, pieces = _random_gather_call(r, rank, world)
        case = f"call {call}: all_gather_matmul a {list(a.shape)}, bs {[list(b.shape) for b in bs]}, dim {dim}"
        results = []
        for fn in ("fused", "reference"):
            a_in = a.clone().requires_grad_()
            bs_in = [b.detach().clone().requires_grad_() for b in bs]
            if fn == "fused":
                a_full, outs = fastmesh.all_gather_matmul(a_in, bs_in, dim, return_a=return_a, pieces=pieces)
            else:
                a_full, outs = ref.all_gather_matmul(a_in, bs_in, dim, name, return_a=return_a)
            loss = sum((o * (i + 2)).sum() for i, o in enumerate(outs)) + (a_full.sum() if return_a else 0)
            loss.backward()
            results.append([a_full, *outs, a_in.grad, *(b.grad for b in bs_in)])
        for got, want in zip(*results):
            assert (got is None and want is None) or torch.equal(got, want), case
        a, b, dim, reduce_op, pieces = _random_scatter_call(r, rank, world)
        case = f"call {call}: matmul_reduce_scatter a {list(a.shape)}, b {list(b.shape)}, dim {dim}, {reduce_op}"
        results = []
        for fn in ("fused", "reference"):
            a_in, b_in = a.clone().requires_grad_(), b.detach().clone().requires_grad_()
            if fn == "fused":
                out = fastmesh.matmul_reduce_scatter(a_in, b_in, dim, reduce_op=reduce_op, pieces=pieces)
            else:
                out = ref.matmul_reduce_scatter(a_in, b_in, dim, reduce_op, name)
            (out * 3).sum().backward()
            results.append([out, a_in.grad, b_in.grad])
        for got, want in zip(*results):
            assert got.shape == want.shape, case
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=case)  # avg divides: not exact


@on_ranks(2)
def test_empty_inputs_have_empty_gradients():
    """Backward through shards with no columns (K = 0) or no rows: zero gradients of the right shapes, as
    through the reference (found by a randomized sweep: the flattening of an empty last dim was ambiguous)."""
    name = _world_name()
    for shard_shape, gather_dim, b_shape in [((2, 3, 0), 1, (0, 4)), ((0, 5), 0, (5, 3)), ((2, 0), -1, (0, 3))]:
        grads = []
        for fn in ("fused", "reference"):
            a = torch.zeros(shard_shape, dtype=torch.float64, requires_grad=True)
            b = torch.ones(b_shape, dtype=torch.float64, requires_grad=True)
            if fn == "fused":
                _, (out,) = fastmesh.all_gather_matmul(a, [b], gather_dim)
            else:
                _, (out,) = ref.all_gather_matmul(a, [b], gather_dim, name)
            out.sum().backward()
            grads.append((a.grad, b.grad))
        for got, want in zip(*grads):
            assert got.shape == want.shape and torch.equal(got, want), (shard_shape, got, want)
    a = torch.zeros(4, 0, dtype=torch.float64, requires_grad=True)
    b = torch.ones(0, 6, dtype=torch.float64, requires_grad=True)
    fastmesh.matmul_reduce_scatter(a, b, 0).sum().backward()
    assert a.grad.shape == (4, 0) and torch.equal(b.grad, torch.zeros(0, 6, dtype=torch.float64))


def _scatter_cases(world):
    for (rows, k), scatter_dim, reduce_op, pieces in itertools.product(
        ROW_CASES, (0, 1, 2, -1), ("sum", "avg"), (0, 3)
    ):
        yield rows, k, scatter_dim, reduce_op, pieces


def _check_scatter_case(rank, world, dtype, make, rows, k, scatter_dim, reduce_op, pieces, exact):
    shape = [2, 5, k]
    n = 6 * world
    if scatter_dim % 3 != 2:
        shape[scatter_dim % 3] = rows * world
    a = make(shape, dtype, seed=200 + rank)
    b = make((k, n), dtype, seed=300 + rank)
    got = fastmesh.matmul_reduce_scatter(a, b, scatter_dim, reduce_op=reduce_op, pieces=pieces or None)
    want = ref.matmul_reduce_scatter(a, b, scatter_dim, reduce_op, _world_name())
    case = f"a {shape}, b {[k, n]}, scatter_dim {scatter_dim}, {reduce_op}, pieces {pieces}"
    assert got.shape == want.shape and got.dtype == want.dtype, case
    if exact:
        assert torch.equal(got, want), f"{case}: max diff {(got.float() - want.float()).abs().max()}"
    else:
        exact64 = ref.matmul_reduce_scatter(a.double(), b.double(), scatter_dim, reduce_op, _world_name())
        assert_within_baseline(got, want, exact64, case)


@on_ranks(2, 4)
def test_matmul_reduce_scatter_small_integers_bit_exact(world_size):
    rank = dist.get_rank()
    for dtype in (torch.float32, torch.bfloat16):
        for case in _scatter_cases(world_size):
            # avg divides by the world size: exact for a power of two.
            _check_scatter_case(
                rank, world_size, dtype, lambda s, d, seed: small_ints(s, d, seed, -1, 2), *case, exact=True
            )


@on_ranks(2, 4)
def test_matmul_reduce_scatter_random_within_baseline_error(world_size):
    rank = dist.get_rank()
    for dtype in (torch.float32, torch.bfloat16):
        for case in _scatter_cases(world_size):
            if case[3] == "sum":
                _check_scatter_case(rank, world_size, dtype, randn, *case, exact=False)


# ---- autograd ----


def _grad_case_all_gather(rank, gather_dim, nbs, return_a, use_a, dtype=torch.float64):
    """Gradients of the fused op and of the reference, from the same upstream gradients."""
    shape = shard_shape(6, 8, gather_dim % 3)
    world = dist.get_world_size()
    k_full = 8 * world if gather_dim % 3 == 2 else 8
    results = []
    for fn in ("fused", "reference"):
        a_shard = randn(shape, dtype, seed=10 + rank).requires_grad_()
        bs = [randn((k_full, 3 + i), dtype, seed=20 + i).requires_grad_() for i in range(nbs)]
        if fn == "fused":
            a, outs = fastmesh.all_gather_matmul(a_shard, bs, gather_dim, return_a=return_a)
        else:
            a, outs = ref.all_gather_matmul(a_shard, bs, gather_dim, _world_name(), return_a=return_a)
        loss = sum((o * randn(o.shape, dtype, seed=30 + i + rank)).sum() for i, o in enumerate(outs))
        if use_a:
            loss = loss + (a * randn(a.shape, dtype, seed=40 + rank)).sum()
        loss.backward()
        results.append([a_shard.grad] + [b.grad for b in bs])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, msg=lambda m: f"gather_dim {gather_dim}, {nbs} bs: {m}")


@on_ranks(2, 4)
def test_all_gather_matmul_gradients_match_reference():
    rank = dist.get_rank()
    for gather_dim, nbs in itertools.product((0, 1, -1), (1, 3)):
        _grad_case_all_gather(rank, gather_dim, nbs, return_a=False, use_a=False)
    for gather_dim in (0, 2):
        _grad_case_all_gather(rank, gather_dim, 2, return_a=True, use_a=True)
        _grad_case_all_gather(rank, gather_dim, 2, return_a=True, use_a=False)


def _grad_case_reduce_scatter(rank, scatter_dim, reduce_op, a_grad=True, b_grad=True, dtype=torch.float64):
    world = dist.get_world_size()
    shape = [world, 3 * world, 7]
    results = []
    for fn in ("fused", "reference"):
        a = randn(shape, dtype, seed=50 + rank).requires_grad_(a_grad)
        b = randn((7, 2 * world), dtype, seed=60 + rank).requires_grad_(b_grad)
        if fn == "fused":
            out = fastmesh.matmul_reduce_scatter(a, b, scatter_dim, reduce_op=reduce_op)
        else:
            out = ref.matmul_reduce_scatter(a, b, scatter_dim, reduce_op, _world_name())
        (out * randn(out.shape, dtype, seed=70 + rank)).sum().backward()
        results.append([t.grad for t in (a, b)])
    for got, want in zip(*results):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want)


@on_ranks(2, 4)
def test_matmul_reduce_scatter_gradients_match_reference():
    rank = dist.get_rank()
    for scatter_dim, reduce_op in itertools.product((0, 1, -1), ("sum", "avg")):
        _grad_case_reduce_scatter(rank, scatter_dim, reduce_op)
    _grad_case_reduce_scatter(rank, 1, "sum", a_grad=False)
    _grad_case_reduce_scatter(rank, 1, "sum", b_grad=False)


# ---- communication pattern ----


def _check_shapes_once():
    """Runs both ops once on the world group, so that their first-call shape check is behind us."""
    fastmesh.all_gather_matmul(torch.randn(2, 4), [torch.randn(4, 2)], 0)
    fastmesh.matmul_reduce_scatter(torch.randn(4, 4), torch.randn(4, 2), 0)


@on_ranks(2, 4)
def test_one_pipelined_gather_per_call_whatever_the_number_of_bs(world_size):
    """A call moves its pieces once, the same for 1 or 3 bs. Its backward moves the pieces of one
    reduce-scatter and gathers the saved shard again in one plain all-gather for the bs' gradients; with
    keep_gathered, nothing: the gathered a was kept from the forward."""
    _check_shapes_once()
    a_shard = torch.randn(12, 16, requires_grad=True)
    for nbs, keep_gathered in itertools.product((1, 3), (False, True)):
        bs = [torch.randn(16, 4, requires_grad=True) for _ in range(nbs)]
        result = {}

        def forward():
            result["out"] = fastmesh.all_gather_matmul(a_shard, bs, 0, pieces=3, keep_gathered=keep_gathered)[1]

        forward_calls = c10d_calls(forward)
        assert forward_calls == p2p_pieces(world_size, 3), forward_calls
        backward = c10d_calls(lambda: sum(o.sum() for o in result["out"]).backward())
        want = {**p2p_pieces(world_size, 3), PLAIN_GATHER: 0 if keep_gathered else 1}
        assert {name: backward.get(name, 0) for name in want} == want, backward


@pytest.mark.smoke
@on_ranks(2)
def test_reduce_scatter_backward_is_one_pipelined_gather(world_size):
    _check_shapes_once()
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 6, requires_grad=True)
    result = {}
    forward = c10d_calls(lambda: result.update(out=fastmesh.matmul_reduce_scatter(a, b, 0, pieces=2)))
    assert forward == p2p_pieces(world_size, 2), forward
    backward = c10d_calls(lambda: result["out"].sum().backward())
    assert backward == p2p_pieces(world_size, 2), backward


# ---- opcheck, compile ----


@on_ranks(2)
def test_opcheck():
    name = _world_name()
    a_shard = torch.randn(3, 5, 6)
    bs = [torch.randn(6, 4), torch.randn(6, 2)]
    for dim, return_a in ((0, True), (1, False), (2, True)):
        b_rows = 12 if dim == 2 else 6
        args = (a_shard, [torch.randn(b_rows, 4, requires_grad=True)], dim, name, return_a, 0)
        torch.library.opcheck(torch.ops.fastmesh.all_gather_matmul, args)
    torch.library.opcheck(torch.ops.fastmesh.all_gather_matmul, (a_shard.requires_grad_(), bs, 0, name, True, 2))
    a = torch.randn(4, 6, 5, requires_grad=True)
    for dim, op in ((0, "sum"), (1, "avg"), (2, "sum")):
        torch.library.opcheck(torch.ops.fastmesh.matmul_reduce_scatter, (a, torch.randn(5, 8), dim, op, name, 0))


def _tp_block(x_shard, w_q, w_k, w_o):
    """Sequence-parallel attention-like block: gather x for two projections, reduce-scatter the output."""
    _, (q, k) = fastmesh.all_gather_matmul(x_shard, [w_q, w_k], 1)
    return fastmesh.matmul_reduce_scatter(torch.relu(q) * k, w_o, 1)


@on_ranks(2)
def test_compile_fullgraph_matches_eager():
    rank = dist.get_rank()
    torch._dynamo.reset()
    for backend, tune in COMPILE_MODES:
        results = []
        with environment(FASTMESH_TUNE=tune), graph_census() as census:
            for compiled in (False, True):
                x = randn((2, 5, 8), torch.float32, seed=rank).requires_grad_()
                shapes = [(8, 6), (8, 6), (6, 8)]
                ws = [randn(s, torch.float32, seed=i).requires_grad_() for i, s in enumerate(shapes)]
                fn = torch.compile(_tp_block, fullgraph=True, backend=backend) if compiled else _tp_block
                out = fn(x, *ws)
                out.sum().backward()
                results.append([out, x.grad, *(w.grad for w in ws)])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, msg=lambda m: f"{backend}, {tune}: {m}")
        if backend == "inductor":
            # Fused: one native collective, the backward's gather of the saved shard, in the backward graph.
            fused = ("fastmesh.all_gather_matmul", "fastmesh.matmul_reduce_scatter")
            assert_compiled_path(census, tune, fused, natives=1 if tune == "off" else 0)
            if tune == "off":
                assert census.total("native.all_gather_into_tensor", "backward") == 1, census.graphs
        torch._dynamo.reset()
    plans.forget()


# ---- world of one, DTensor ----


@on_ranks(2)
def test_group_of_one_is_a_plain_matmul():
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    mine = singles[rank]
    a = randn((3, 4, 6), torch.float32, seed=rank)
    b = randn((6, 5), torch.float32, seed=1)
    for dim in (0, 1, 2):
        got_a, (got,) = fastmesh.all_gather_matmul(a, [b], dim, group=mine, return_a=True)
        assert torch.equal(got_a, a) and got_a.data_ptr() != a.data_ptr()
        assert torch.equal(got, a @ b)
        assert torch.equal(fastmesh.matmul_reduce_scatter(a, b, dim, group=mine, reduce_op="avg"), a @ b)


def _tp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


@on_ranks(2, 4)
def test_dtensor_inputs_give_dtensor_outputs():
    mesh = _tp_mesh()
    world = dist.get_world_size()
    x = randn((2, 4 * world, 6), torch.float32, seed=0)  # the same global tensor on every rank
    w_rep = randn((6, 5), torch.float32, seed=1)
    w_col = randn((6, 3 * world), torch.float32, seed=2)
    x_d = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    w_col_d = distribute_tensor(w_col, mesh, [Shard(1)])
    a, (y_rep, y_col) = fastmesh.all_gather_matmul(x_d, [w_rep, w_col_d], 1, return_a=True)
    assert a.placements == (Replicate(),) and y_rep.placements == (Replicate(),)
    assert y_col.placements == (Shard(2),) and y_col.shape == (2, 4 * world, 3 * world)
    torch.testing.assert_close(a.full_tensor(), x)
    torch.testing.assert_close(y_rep.full_tensor(), x @ w_rep)
    torch.testing.assert_close(y_col.full_tensor(), x @ w_col)
    (y_rep.to_local().sum() + y_col.to_local().sum()).backward()
    assert isinstance(x_d.grad, DTensor) and x_d.grad.placements == (Shard(1),)

    # Row-parallel: the contraction dim sharded, the product reduce-scattered along the sequence.
    h = randn((2, 4 * world, 8 * world), torch.float32, seed=3)
    w2 = randn((8 * world, 6), torch.float32, seed=4)
    h_d = distribute_tensor(h, mesh, [Shard(2)])
    w2_d = distribute_tensor(w2, mesh, [Shard(0)])
    out = fastmesh.matmul_reduce_scatter(h_d, w2_d, 1)
    assert out.placements == (Shard(1),) and out.shape == (2, 4 * world, 6)
    torch.testing.assert_close(out.full_tensor(), h @ w2)


def _loss(tensors, seed: int) -> torch.Tensor:
    """A loss of DTensors that every rank computes alike (on their full tensors), with integer weights."""
    return sum((t.full_tensor() * small_ints(t.shape, t.dtype, seed + i)).sum() for i, t in enumerate(tensors))


@pytest.mark.skipif(
    not NATIVE_PLAN_RUNS_UNEVEN_SEQUENCES, reason="torch < 2.13's own matmul of a gathered uneven sequence fails"
)
@on_ranks(2, 4)
def test_dtensor_fronts_run_torchs_uneven_shards_with_torchs_gradients(world_size):
    """Gathered and scattered dims the mesh size does not divide (torch's uneven shards; ranks without rows
    among them) give torch's DTensor results, placements and local shards bit for bit (small integers), and the
    inputs' gradients of torch's redistribute + matmul: replicated results, whose gradient every rank holds whole,
    count it once for a, while each rank's replicated b (plain or a ``Replicate()`` DTensor) gets the whole one."""
    mesh = _tp_mesh()
    for rows in (1, world_size + 1, 2 * world_size - 1, 2 * world_size):
        for shape, dim in (((rows, 8), 0), ((2, rows, 8), 1), ((rows, 3, 8), 0)):
            case = f"a {list(shape)} sharded along dim {dim} over {world_size} ranks"
            x = small_ints(shape, torch.float32, seed=rows)
            w_rep = small_ints((8, 5), torch.float32, seed=1)
            w_col = distribute_tensor(small_ints((8, 2 * world_size), torch.float32, seed=2), mesh, [Shard(1)])
            x_fm = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_()
            w_plain, w_dtensor = w_rep.clone().requires_grad_(), distribute_tensor(w_rep, mesh, [Replicate()])
            got = fastmesh.all_gather_matmul(
                layer_input(x_fm), [w_plain, w_dtensor.requires_grad_(), w_col], dim, return_a=True
            )
            got = [got[0], *got[1]]
            x_torch = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_()
            w_torch = [distribute_tensor(w_rep, mesh, [Replicate()]).requires_grad_() for _ in range(2)]
            a = x_torch.redistribute(mesh, [Replicate()])
            want = [a, a @ w_torch[0], a @ w_torch[1], a @ w_col]
            for g, t in zip(got, want):
                assert g.placements == t.placements and g.shape == t.shape, (case, g, t)
                assert torch.equal(g.to_local(), t.to_local()), case
            _loss(got, seed=3).backward()
            _loss(want, seed=3).backward()
            assert torch.equal(x_fm.grad.to_local(), x_torch.grad.to_local()), case
            assert torch.equal(w_plain.grad, w_torch[0].grad.to_local()), case
            assert torch.equal(w_dtensor.grad.to_local(), w_torch[1].grad.to_local()), case

            # Row-parallel: a's contraction sharded, the product reduce-scattered along dim.
            h = small_ints((*shape[:-1], 4 * world_size), torch.float32, seed=4)
            w2 = distribute_tensor(small_ints((4 * world_size, 6), torch.float32, seed=5), mesh, [Shard(0)])
            h_fm = distribute_tensor(h, mesh, [Shard(-1)]).requires_grad_()
            out = fastmesh.matmul_reduce_scatter(h_fm, w2, dim)
            h_torch = distribute_tensor(h, mesh, [Shard(-1)]).requires_grad_()
            out_torch = (h_torch @ w2).redistribute(mesh, [Shard(dim)])
            assert out.placements == out_torch.placements and out.shape == out_torch.shape, case
            assert torch.equal(out.to_local(), out_torch.to_local()), case
            _loss([out], seed=6).backward()
            _loss([out_torch], seed=6).backward()
            assert torch.equal(h_fm.grad.to_local(), h_torch.grad.to_local()), case


@on_ranks(2, 3)
def test_dtensor_fronts_pad_uneven_contractions_and_columns(world_size):
    """A contraction (row-parallel a and b, or gathered) or b's columns the mesh size does not divide: torch's results,
    placements and gradients, bit for bit. Contractions of 5 then 6 then 5 columns over 2 ranks once hung: rank 0
    held 3 columns each time (one plan agreed, no exchange) while rank 1's 2 then 3 were a new shape to agree on."""
    mesh = _tp_mesh()
    for k in (5, 6, 5, 2 * world_size + 1, 1):
        a, b = small_ints((4 * world_size, k), torch.float32, seed=k), small_ints((k, 3), torch.float32, seed=1)
        for scatter_dim in (0, 1, None):  # None: matmul_all_reduce
            case = f"contraction {k} over {world_size} ranks, scatter_dim {scatter_dim}"
            mine = [distribute_tensor(t, mesh, [Shard(d)]).requires_grad_() for t, d in ((a, 1), (b, 0))]
            theirs = [distribute_tensor(t, mesh, [Shard(d)]).requires_grad_() for t, d in ((a, 1), (b, 0))]
            inputs = [layer_input(t) for t in mine]
            if scatter_dim is None:
                got, want = (
                    fastmesh.matmul_all_reduce(*inputs),
                    (theirs[0] @ theirs[1]).redistribute(mesh, [Replicate()]),
                )
            else:
                got = fastmesh.matmul_reduce_scatter(*inputs, scatter_dim)
                want = (theirs[0] @ theirs[1]).redistribute(mesh, [Shard(scatter_dim)])
            assert got.placements == want.placements and torch.equal(got.to_local(), want.to_local()), case
            _loss([got], seed=2).backward()
            _loss([want], seed=2).backward()
            for m, t in zip(mine, theirs):
                assert torch.equal(m.grad.full_tensor(), t.grad.full_tensor()), case

        # A gathered contraction: a's K columns gathered, then multiplied by a replicated b (plain or DTensor).
        case = f"gathered contraction {k} over {world_size} ranks"
        x_fm = distribute_tensor(a, mesh, [Shard(1)]).requires_grad_()
        b_plain, b_dtensor = b.clone().requires_grad_(), distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
        got = fastmesh.all_gather_matmul(layer_input(x_fm), [b_plain, b_dtensor], 1, return_a=True)
        got = [got[0], *got[1]]
        x_torch = distribute_tensor(a, mesh, [Shard(1)]).requires_grad_()
        b_torch = [distribute_tensor(b, mesh, [Replicate()]).requires_grad_() for _ in range(2)]
        a_torch = x_torch.redistribute(mesh, [Replicate()])
        want = [a_torch, a_torch @ b_torch[0], a_torch @ b_torch[1]]
        for g, t in zip(got, want):
            assert g.placements == t.placements and g.shape == t.shape, (case, g, t)
            assert torch.equal(g.to_local(), t.to_local()), case
        _loss(got, seed=6).backward()
        _loss(want, seed=6).backward()
        assert torch.equal(x_fm.grad.to_local(), x_torch.grad.to_local()), case
        assert torch.equal(b_plain.grad, b_torch[0].grad.to_local()), case
        assert torch.equal(b_dtensor.grad.to_local(), b_torch[1].grad.to_local()), case

        # b's columns sharded unevenly: all_gather_matmul's column-sharded product, matmul_all_gather's gather.
        x, w = small_ints((2 * world_size, 8), torch.float32, seed=3), small_ints((8, k), torch.float32, seed=4)
        case = f"{k} columns over {world_size} ranks"
        x_fm = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        w_fm = distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()
        _, (y,) = fastmesh.all_gather_matmul(layer_input(x_fm), [layer_input(w_fm)], 0)
        x_torch = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        w_torch = distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()
        y_torch = x_torch.redistribute(mesh, [Replicate()]) @ w_torch
        assert y.shape == y_torch.shape and torch.equal(y.full_tensor(), y_torch.full_tensor()), case
        _loss([y], seed=5).backward()
        _loss([y_torch], seed=5).backward()
        assert torch.equal(x_fm.grad.full_tensor(), x_torch.grad.full_tensor()), case
        assert torch.equal(w_fm.grad.full_tensor(), w_torch.grad.full_tensor()), case
        gathered = fastmesh.matmul_all_gather(distribute_tensor(x, mesh, [Replicate()]), w_fm)
        assert gathered.placements == (Replicate(),) and torch.equal(gathered.to_local(), x @ w), case


@on_ranks(2)
def test_dtensor_placement_errors():
    mesh = _tp_mesh()
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    w = torch.randn(6, 5)
    cases = [
        (lambda: fastmesh.all_gather_matmul(x, [w], 1), ValueError, r"a_shard must be placed Shard\(1\)"),
        (
            lambda: fastmesh.all_gather_matmul(x.to_local(), [distribute_tensor(w, mesh, [Replicate()])], 0),
            TypeError,
            r"a_shard must be a DTensor placed Shard\(gather_dim\) too",
        ),
        (
            lambda: fastmesh.all_gather_matmul(x, [distribute_tensor(w, mesh, [Shard(0)])], 0),
            ValueError,
            r"bs\[0\] must be placed Replicate\(\) or Shard\(1\), got Shard\(dim=0\)",
        ),
        (lambda: fastmesh.matmul_reduce_scatter(x, w, 0), ValueError, r"a must be placed Shard\(1\)"),
        # Uneven shards that are not torch's pieces ([2, 6] and [3, 6] of a [5, 6], where torch holds 3 then 2
        # rows) cannot be padded into place: refused on every rank, before any collective.
        (
            lambda: fastmesh.all_gather_matmul(not_torchs, [w], 0),
            ValueError,
            r"a_shard is sharded unevenly along dim 0 \(5 rows over 2 ranks\), so rank [01] must hold [32] of them "
            r"\(torch.chunk's piece: 3 per rank, the last ranks fewer\), but holds [23]",
        ),
        (
            lambda: fastmesh.all_gather_matmul(distribute_tensor(torch.randn(4, 5), mesh, [Shard(1)]), [w], 1),
            ValueError,
            r"bs\[0\] must have 5 rows \(a_shard's global last dim\), got \[6, 5\]",
        ),
    ]
    not_torchs = DTensor.from_local(
        torch.randn(2 + dist.get_rank(), 6), mesh, [Shard(0)], run_check=False, shape=torch.Size([5, 6]), stride=(6, 1)
    )
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# ---- bad inputs: every rank raises, none hangs ----


def _bad_all_gather_calls(world):
    a = torch.randn(4, 6)
    b = torch.randn(6, 5)
    return [
        (
            dict(a_shard=a, bs=[torch.randn(7, 5)], gather_dim=0),
            ValueError,
            r"bs\[0\] must have 6 rows \(the last dim of a_shard\), got shape \[7, 5\]",
        ),
        (
            dict(a_shard=a, bs=[torch.randn(6, 5)], gather_dim=1),
            ValueError,
            rf"bs\[0\] must have {6 * world} rows \(the last dim of the gathered a: a_shard's last dim times the group "
            rf"size {world}\)",
        ),
        (dict(a_shard=a, bs=[b.double()], gather_dim=0), TypeError, r"bs\[0\] must have a_shard's dtype torch.float32"),
        (dict(a_shard=a, bs=[b.to("meta")], gather_dim=0), ValueError, r"bs\[0\] must be on a_shard's device cpu"),
        (dict(a_shard=a, bs=[b], gather_dim=2), ValueError, r"gather_dim must be in \[-2, 1\] for a_shard with 2 dim"),
        (dict(a_shard=a, bs=[], gather_dim=0), ValueError, r"bs must hold at least one matrix"),
        (
            dict(a_shard=a, bs=b, gather_dim=0),
            TypeError,
            r"bs must be a list of matrices, got a Tensor of shape \[6, 5\]; pass \[b\] for one",
        ),
        (dict(a_shard=a, bs=[b.view(6, 5, 1)], gather_dim=0), ValueError, r"bs\[0\] must have 2 dim\(s\)"),
        (dict(a_shard=a.int(), bs=[b], gather_dim=0), TypeError, r"a_shard must be float32, bfloat16, float16"),
        (dict(a_shard=a, bs=[b], gather_dim=0, pieces=-1), ValueError, r"pieces must be an int >= 0"),
        (
            dict(a_shard=a, bs=[b], gather_dim=0, group="no-such-group"),
            ValueError,
            r"no process group is registered under the name 'no-such-group'",
        ),
    ]


def _bad_reduce_scatter_calls(world):
    a = torch.randn(4 * world, 6)
    b = torch.randn(6, 2 * world)
    return [
        (dict(a=a, b=torch.randn(5, 4), scatter_dim=0), ValueError, r"b must have 6 rows \(a's last dim\)"),
        (
            dict(a=torch.randn(3, 6), b=b, scatter_dim=0),
            ValueError,
            rf"the scattered dim 0 of a @ b has size 3, which is not divisible by the group size {world}",
        ),
        (
            dict(a=a, b=torch.randn(6, 3), scatter_dim=-1),
            ValueError,
            rf"the scattered dim -1 of a @ b has size 3, which is not divisible by the group size {world}",
        ),
        (dict(a=a, b=b, scatter_dim=0, reduce_op="max"), ValueError, r'reduce_op must be "sum" or "avg", got "max"'),
        (dict(a=a, b=b.half(), scatter_dim=0), TypeError, r"b must have a's dtype torch.float32, got torch.float16"),
        (dict(a=a, b=b, scatter_dim=-3), ValueError, r"scatter_dim must be in \[-2, 1\] for a with 2 dim"),
    ]


def _bad_front_arguments():
    """Arguments the op's schema would refuse (or take) less clearly: the fronts check them first."""
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    return [
        (dict(a_shard=a, bs=None, gather_dim=0), TypeError, r"bs must be a list of matrices, got NoneType"),
        (dict(a_shard=a, bs=[b], gather_dim=0, return_a="yes"), TypeError, r"return_a must be a bool, got str"),
        (dict(a_shard=a, bs=[b], gather_dim=0, return_a=None), TypeError, r"return_a must be a bool, got NoneType"),
        (dict(a_shard=a, bs=[b], gather_dim=0, pieces=True), TypeError, r"pieces must be an int, got bool"),
        (dict(a_shard=a, bs=[b], gather_dim=0, pieces=2.0), TypeError, r"pieces must be an int, got float"),
        (dict(a_shard=a, bs=[b], gather_dim=0, pieces=2**63), ValueError, r"pieces must be an int >= 0"),
    ]


@on_ranks(2, 4)
def test_bad_inputs_raise_on_every_rank(world_size):
    for kwargs, error, match in _bad_all_gather_calls(world_size) + _bad_front_arguments():
        with pytest.raises(error, match=match):
            fastmesh.all_gather_matmul(**kwargs)
    for kwargs, error, match in _bad_reduce_scatter_calls(world_size):
        with pytest.raises(error, match=match):
            fastmesh.matmul_reduce_scatter(**kwargs)


@on_ranks(2)
def test_chunks_is_a_deprecated_alias_of_pieces(world_size):
    """chunks= still works, warns (pointing at the caller), and cannot be combined with pieces=."""
    a, b = small_ints((4, 6), torch.float32, 0), small_ints((6, 4), torch.float32, 1)
    calls = {
        "fastmesh.all_gather_matmul": lambda **kw: fastmesh.all_gather_matmul(a, [b], 0, **kw)[1][0],
        "fastmesh.matmul_reduce_scatter": lambda **kw: fastmesh.matmul_reduce_scatter(a, b, 0, **kw),
    }
    for front, call in calls.items():
        want = call(pieces=2)
        with pytest.warns(FutureWarning, match=rf"{front}: chunks= is deprecated, use pieces=") as record:
            got = call(chunks=2)
        assert torch.equal(got, want), front
        assert record[0].filename == __file__, record[0].filename
        with pytest.raises(TypeError, match=rf"{front}: pass pieces= only; chunks= is its deprecated alias"):
            call(pieces=2, chunks=2)


@on_ranks(2)
def test_kernel_checks_bypassing_python(world_size):
    """The C++ kernels check the same things (for callers of torch.ops.fastmesh.* with real tensors)."""
    name = _world_name()
    for kwargs, error, match in _bad_all_gather_calls(world_size):
        if isinstance(kwargs["bs"], torch.Tensor):
            continue  # not a Tensor[]: the dispatcher refuses it before any kernel
        if "group" in kwargs or kwargs["a_shard"].dtype != torch.float32 or any(b.is_meta for b in kwargs["bs"]):
            continue  # resolved or rejected before the kernel
        args = (kwargs["a_shard"], kwargs["bs"], kwargs["gather_dim"], name, False, kwargs.get("pieces", 0))
        with pytest.raises(error, match=match):
            _call_cpu_kernel("all_gather_matmul", *args)
    for kwargs, error, match in _bad_reduce_scatter_calls(world_size):
        args = (kwargs["a"], kwargs["b"], kwargs["scatter_dim"], kwargs.get("reduce_op", "sum"), name, 0)
        with pytest.raises(error, match=match):
            _call_cpu_kernel("matmul_reduce_scatter", *args)


def _call_cpu_kernel(op, *args):
    """Call the registered CPU kernel directly, skipping the fake/autograd layers and the Python checks."""
    with torch._C._AutoDispatchBelowAutograd():
        return getattr(torch.ops.fastmesh, op).default.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args
        )


@on_ranks(2, 4)
def test_shard_shapes_that_differ_across_ranks_raise_on_every_rank():
    """The first call of an op on a group checks the shapes (and so does the next, until one passes), and every
    call does with FASTMESH_SHAPE_CHECK=every or TORCH_DISTRIBUTED_DEBUG=DETAIL (unchecked, gloo would abort the
    receiving process on such a transfer)."""
    from environment import environment

    rank, world = dist.get_rank(), dist.get_world_size()

    def mismatched_calls(group):
        a = torch.randn(3 + rank, 4)
        for return_a in (False, True):
            with pytest.raises(
                ValueError,
                match=r"a_shard must have the same shape and dtype on every rank of the "
                r"group, got:\n  rank 0: shape \[3, 4\] torch.float32\n  rank 1: "
                r"shape \[4, 4\] torch.float32",
            ):
                fastmesh.all_gather_matmul(a, [torch.randn(4, 2)], 0, group=group, return_a=return_a)
        b = torch.randn(4, 2 * (1 + rank))
        with pytest.raises(ValueError, match=r"a @ b must have the same shape and dtype on every rank"):
            fastmesh.matmul_reduce_scatter(torch.randn(8, 4), b, 0, group=group)
        # An empty shard on one rank only: still a call whose shapes differ.
        with pytest.raises(ValueError, match=r"a_shard must have the same shape"):
            fastmesh.all_gather_matmul(torch.randn(rank % 2, 4), [torch.randn(4, 2)], 0, group=group)
        # A different number of bs: the operands' count is compared first (their shapes' transfer is sized by it).
        with pytest.raises(
            ValueError,
            match=r"every rank of the group must pass the same operands, got different "
            r"numbers of tensors \(rank 0: 2, rank 1: 3",
        ):
            fastmesh.all_gather_matmul(torch.randn(3, 4), [torch.randn(4, 2)] * (1 + rank % 2), 0, group=group)

    mismatched_calls(dist.new_group(list(range(world))))  # first calls on a new group
    fastmesh.all_gather_matmul(torch.randn(3, 4), [torch.randn(4, 2)], 0)  # passes: later calls are not checked
    fastmesh.matmul_reduce_scatter(torch.randn(8, 4), torch.randn(4, 2), 0)
    with environment(FASTMESH_SHAPE_CHECK="every"):
        mismatched_calls(dist.group.WORLD)
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        mismatched_calls(dist.group.WORLD)
    finally:
        dist.set_debug_level(previous)
    with (
        environment(FASTMESH_SHAPE_CHECK="sometimes"),
        pytest.raises(ValueError, match=r'FASTMESH_SHAPE_CHECK .* must be "first" or "every", got "sometimes"'),
    ):
        fastmesh.all_gather_matmul(torch.randn(3, 4), [torch.randn(4, 2)], 0)
    # The group is still usable afterwards.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


@on_ranks(2, 4)
def test_options_that_differ_across_ranks_raise_on_every_rank():
    """The first call's check compares the options that change what travels or what is summed, and the op itself:
    unchecked, gloo aborts on the first kind, and on the second the ranks' results silently differ. Square shards
    make the two gather dims' transfers the same size: only the option tells them apart. (Two scatter dims always
    scatter shapes that differ, which the shape check reports.)"""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))  # first calls on a new group
    square, b = torch.randn(4, 4), torch.randn(4, 4)

    def raises_naming(option: str, values: tuple[str, str]):
        ranks = "".join(rf"\n  rank {r}: {values[r % 2]}" for r in range(world))
        return pytest.raises(ValueError, match=rf"{option} must be the same on every rank of the group, got:{ranks}$")

    with raises_naming("pieces", ("2", "3")):
        fastmesh.all_gather_matmul(square, [b], 0, group=group, pieces=2 + rank % 2)
    with raises_naming("return_a", ("False", "True")):
        fastmesh.all_gather_matmul(square, [b], 0, group=group, return_a=rank % 2 == 1)
    with raises_naming("gather_dim", ("0", "1")):
        fastmesh.all_gather_matmul(square.unsqueeze(0), [b], rank % 2, group=group)
    with raises_naming("reduce_op", ("'sum'", "'avg'")):
        fastmesh.matmul_reduce_scatter(square, b, 0, group=group, reduce_op=("sum", "avg")[rank % 2])
    with raises_naming("reduce_op", ("'sum'", "'avg'")):
        fastmesh.matmul_all_reduce(square, b, group=group, reduce_op=("sum", "avg")[rank % 2])
    with raises_naming("pieces", ("1", "2")):
        fastmesh.matmul_all_gather(square, b, group=group, pieces=1 + rank % 2)
    fp8 = fastmesh.fp8.Float8Config(granularity="rowwise")
    with raises_naming("reduce_op", ("'sum'", "'avg'")):
        fastmesh.matmul_all_reduce(square, b, group=group, reduce_op=("sum", "avg")[rank % 2], fp8=fp8)
    # Ranks on different ops, both on their first call on the group: each is told which ranks called another.
    others = ", ".join(str(r) for r in range(world) if r % 2 != rank % 2)
    with pytest.raises(ValueError, match=rf"every rank of the group must call the same op, but rank\(s\) {others} "):
        if rank % 2:
            fastmesh.matmul_reduce_scatter(torch.randn(8, 4), b, 0, group=group, pieces=1)
        else:
            fastmesh.matmul_all_gather(square, b, group=group, pieces=1)
    # The same options on every rank pass, and the group is still usable.
    fastmesh.all_gather_matmul(square, [b], 0, group=group, pieces=2)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == world


@on_ranks(2)
def test_plan_is_logged_once_per_key():
    from log_capture import plan_log

    with plan_log() as messages:
        for _ in range(2):
            fastmesh.all_gather_matmul(torch.randn(2, 4), [torch.randn(4, 3)], 0)
            fastmesh.matmul_reduce_scatter(torch.randn(4, 4), torch.randn(4, 3), 0)
    assert len(messages) == 2, messages
    assert messages[0].startswith("fastmesh::all_gather_matmul [fastmesh::all_gather_matmul|gloo|cpu|a=[2, 4]|ns=[3]|")
    assert messages[1].startswith("fastmesh::matmul_reduce_scatter [fastmesh::matmul_reduce_scatter|gloo|cpu|a=[4, 4]|")
    assert all(": plan " in m and "(model: " in m for m in messages), messages


@on_ranks(2)
def test_compile_dynamic_sequence_length():
    """The fake impls take symbolic sizes: one dynamic graph serves several sequence lengths."""
    rank = dist.get_rank()
    torch._dynamo.reset()
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    compiled = torch.compile(_tp_block, fullgraph=True, dynamic=True, backend=counting_backend)
    ws = [randn(s, torch.float32, seed=i) for i, s in enumerate([(8, 6), (8, 6), (6, 8)])]
    for seq in (3, 5, 8):
        x = randn((2, seq, 8), torch.float32, seed=rank + seq)
        torch.testing.assert_close(compiled(x, *ws), _tp_block(x, *ws))
    assert len(frames) == 1, f"{len(frames)} graphs for 3 sequence lengths"

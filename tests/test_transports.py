"""The transports of the fused ops' C++ pipelines (csrc/fused/process_group.cpp, ``point_to_point``).

On gloo the pieces travel point-to-point; on every other backend (NCCL) as the backend's collectives, one
all-gather, reduce-scatter or all-reduce per piece. ``FASTMESH_TRANSPORT=collective`` makes gloo take the
collective path too, so that it runs on CPU: every plan of every fused op must then still equal the reference
bitwise (small-integer inputs make every sum exact, in any order), forward and backward, and the profiler
must see the collectives instead of send/recv.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from comm_counts import c10d_calls, p2p_pieces
from environment import environment
from fastmesh.kernels import fused_reference as ref
from rank_pool import on_ranks
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh.ops import plans
from fastmesh.ops.fused_collectives import gather_plan_call, scatter_plan_call
from fastmesh.ops.fused_collectives_fp8 import scaled_gather_plan_call, scaled_scatter_plan_call
from fastmesh.ops.matmul_all_gather import plan_call as product_gather_plan_call
from fastmesh.ops.matmul_all_reduce import plan_call as all_reduce_plan_call

E4M3 = torch.float8_e4m3fn
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_"
ROWWISE_CASES = (False, True) if ROWWISE_ON_CPU else (False,)  # CPU _scaled_mm: tensor-wise before


def small_ints(shape, dtype, seed, low=-2, high=3) -> torch.Tensor:
    """The same tensor on every rank that uses the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def pow2_scale(shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.pow(2.0, torch.randint(-3, 3, shape, generator=g).float())


def dequantize(data, scale):
    return data.double() * scale.double()


def _name() -> str:
    return fastmesh.group_name(dist.group.WORLD)


def _with_plans(candidates):
    """Every candidate plan (run under plans.override), then pieces= 1 and 3."""
    return [*candidates, 1, 3]


def _run(plan, fn):
    """fn(pieces) under ``plan``: a Plan is forced with plans.override, an int is passed as pieces=."""
    if isinstance(plan, plans.Plan):
        with plans.override(plan):
            return fn(None)
    return fn(plan)


# ---- every plan of every op over the collectives, bitwise ----

# (a_shard's shape, gather_dim, the bs' column counts): rows, a middle dim, the last dim (the contraction).
_GATHERS = [((6, 5), 0, (3, 7)), ((2, 4, 5), 1, (4,)), ((3, 2, 4), -1, (2, 5))]
# (a's shape before the world factor, scatter_dim, n per rank): rows, a middle dim, the last dim (the columns).
_SCATTERS = [((4, 5), 0, 6), ((2, 4, 5), 1, 4), ((3, 4, 6), -1, 4)]


def _scaled_up(shape, dim, world):
    """``shape`` with ``world`` times the size along ``dim``; the last dim (a scatter of b's columns) unchanged."""
    out = list(shape)
    if dim % len(shape) != len(shape) - 1:
        out[dim] *= world
    return out


def _check_gathers(rank, world, name, dtype):
    for shape, dim, ns in _GATHERS:
        last = dim % len(shape) == len(shape) - 1
        k = shape[-1] * (world if last else 1)
        shard = small_ints(shape, dtype, 10 + rank).requires_grad_()
        bs = [small_ints((k, n), dtype, 20 + i).requires_grad_() for i, n in enumerate(ns)]
        shard_ref = shard.detach().clone().requires_grad_()
        bs_ref = [b.detach().clone().requires_grad_() for b in bs]
        a_ref, outs_ref = ref.all_gather_matmul(shard_ref, bs_ref, dim, name, return_a=True)
        grads = [small_ints(out.shape, dtype, 30 + rank + i) for i, out in enumerate(outs_ref)]
        want_grads = torch.autograd.grad(outs_ref, [shard_ref, *bs_ref], grads)
        for plan in _with_plans(gather_plan_call(shard, bs, dim % len(shape), name).candidates):
            case = f"all_gather_matmul {dtype} {list(shape)} gather_dim {dim} plan {plan}"
            a_full, outs = _run(plan, lambda p: fastmesh.all_gather_matmul(shard, bs, dim, return_a=True, pieces=p))
            assert torch.equal(a_full, a_ref), case
            for out, want in zip(outs, outs_ref, strict=True):
                assert torch.equal(out, want), case
            got_grads = _run(plan, lambda _: torch.autograd.grad(outs, [shard, *bs], grads))
            for got, want in zip(got_grads, want_grads, strict=True):
                assert torch.equal(got, want), f"{case}: backward"


def _check_scatters(rank, world, name, dtype):
    for shape, dim, n in _SCATTERS:
        a = small_ints(_scaled_up(shape, dim, world), dtype, 40 + rank).requires_grad_()
        b = small_ints((shape[-1], n * world), dtype, 50 + rank).requires_grad_()
        a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        want = ref.matmul_reduce_scatter(a_ref, b_ref, dim, "sum", name)
        grad = small_ints(want.shape, dtype, 60 + rank)
        want_grads = torch.autograd.grad(want, [a_ref, b_ref], grad)
        candidates = scatter_plan_call(a, b, dim % a.dim(), name).candidates
        assert {plan.split for plan in candidates} == {"rows", "columns", "none"}, candidates
        for plan, reduce_op in itertools.product(_with_plans(candidates), ("sum", "avg")):
            case = f"matmul_reduce_scatter {dtype} {list(a.shape)} scatter_dim {dim} plan {plan} {reduce_op}"
            got = _run(plan, lambda p: fastmesh.matmul_reduce_scatter(a, b, dim, reduce_op=reduce_op, pieces=p))
            assert torch.equal(got, want if reduce_op == "sum" else want / world), case
            if reduce_op == "sum":
                got_grads = _run(plan, lambda _: torch.autograd.grad(got, [a, b], grad))
                for g, w in zip(got_grads, want_grads, strict=True):
                    assert torch.equal(g, w), f"{case}: backward"


def _all_reduced(c):
    c = c.clone()
    dist.all_reduce(c)
    return c


def _check_products(rank, world, name, dtype):
    for shape, n in (((5, 6), 7), ((2, 3, 9), 4)):
        a = small_ints(shape, dtype, 70 + rank).requires_grad_()
        b = small_ints((shape[-1], n), dtype, 80 + rank).requires_grad_()
        grad = small_ints((*shape[:-1], n), dtype, 90)  # replicated: the same on every rank
        c = a.detach() @ b.detach()
        want = _all_reduced(c)
        want_grads = (grad @ b.detach().t(), a.detach().reshape(-1, shape[-1]).t() @ grad.reshape(-1, n))
        for plan in _with_plans(all_reduce_plan_call(a, b, name).candidates):
            case = f"matmul_all_reduce {dtype} {list(shape)} plan {plan}"
            got = _run(plan, lambda p: fastmesh.matmul_all_reduce(a, b, pieces=p))
            assert torch.equal(got, want), case
            got_grads = torch.autograd.grad(got, [a, b], grad)
            for g, w in zip(got_grads, want_grads, strict=True):
                assert torch.equal(g, w), f"{case}: backward"

        parts = [torch.empty_like(c) for _ in range(world)]
        dist.all_gather(parts, c)
        want = torch.cat(parts, dim=-1)
        grad = small_ints(want.shape, dtype, 95)  # replicated; each rank keeps its column block
        grad_r = grad[..., rank * n : (rank + 1) * n]
        want_grads = (grad_r @ b.detach().t(), a.detach().reshape(-1, shape[-1]).t() @ grad_r.reshape(-1, n))
        for plan in _with_plans(product_gather_plan_call(a, b, name).candidates):
            case = f"matmul_all_gather {dtype} {list(shape)} plan {plan}"
            got = _run(plan, lambda p: fastmesh.matmul_all_gather(a, b, pieces=p))
            assert torch.equal(got, want), case
            got_grads = torch.autograd.grad(got, [a, b], grad)
            for g, w in zip(got_grads, want_grads, strict=True):
                assert torch.equal(g, w), f"{case}: backward"


@on_ranks(2, 3)
def test_every_plan_of_every_op_over_the_collectives(world_size):
    rank, name = dist.get_rank(), _name()
    with environment(FASTMESH_TRANSPORT="collective"):
        for dtype in (torch.float32, torch.bfloat16):
            _check_gathers(rank, world_size, name, dtype)
            _check_scatters(rank, world_size, name, dtype)
            _check_products(rank, world_size, name, dtype)
    plans.forget()


@on_ranks(2, 3)
def test_every_plan_of_the_fp8_ops_over_the_collectives(world_size):
    """FP8 data of small integers and power-of-two scales: every product is exact, and so is every sum of the
    float32 partials."""
    rank, name = dist.get_rank(), _name()
    with environment(FASTMESH_TRANSPORT="collective"):
        for rowwise in ROWWISE_CASES:
            _check_scaled_gathers(rank, name, rowwise)
            _check_scaled_scatters(rank, world_size, name, rowwise)
    plans.forget()


def _check_scaled_gathers(rank, name, rowwise):
    # The FP8 form gathers rows only (gather_dim 0 and 1 here).
    for out_dtype, dim in itertools.product((torch.float32, torch.bfloat16), (0, 1)):
        shape = [2, 4, 16]
        a = small_ints(shape, torch.float32, 100 + rank).to(E4M3)
        a_scale = pow2_scale(shape[:-1] + [1] if rowwise else [], 110 + rank)
        bs = [small_ints((8 + i, 16), torch.float32, 120 + i).to(E4M3).t() for i in range(2)]  # column-major
        b_scales = [pow2_scale([1, b.shape[1]] if rowwise else [], 130 + i) for i, b in enumerate(bs)]
        want_a = ref.all_gather(dequantize(a, a_scale), dim, name)
        want = [(want_a @ dequantize(b, s)).to(out_dtype) for b, s in zip(bs, b_scales, strict=True)]
        call = scaled_gather_plan_call(a, a_scale, bs, dim, name, out_dtype)
        for plan in _with_plans(call.candidates):
            case = f"all_gather_scaled_matmul rowwise {rowwise} {out_dtype} gather_dim {dim} plan {plan}"
            a_full, a_full_scale, outs = _run(
                plan,
                lambda p: torch.ops.fastmesh.all_gather_scaled_matmul(
                    a, a_scale, bs, b_scales, dim, name, out_dtype, True, p or 0
                ),
            )
            assert torch.equal(dequantize(a_full, a_full_scale), want_a), case
            for got, w in zip(outs, want, strict=True):
                assert torch.equal(got, w), case


def _check_scaled_scatters(rank, world, name, rowwise):
    # float32 partials: a bfloat16 sum of rounded partials would depend on the order of the sum.
    for dim in (0, 1, -1):
        shape = _scaled_up([2, 4, 16], dim, world)
        a = small_ints(shape, torch.float32, 140 + rank).to(E4M3)
        a_scale = pow2_scale(shape[:-1] + [1] if rowwise else [], 150 + rank)
        b = small_ints((4 * world, 16), torch.float32, 160 + rank).to(E4M3).t()
        b_scale = pow2_scale([1, b.shape[1]] if rowwise else [], 170 + rank)
        product = (dequantize(a, a_scale) @ dequantize(b, b_scale)).float()
        call = scaled_scatter_plan_call(a, a_scale, b, b_scale, dim % a.dim(), name, torch.float32)
        for plan, reduce_op in itertools.product(_with_plans(call.candidates), ("sum", "avg")):
            case = f"scaled_matmul_reduce_scatter rowwise {rowwise} dim {dim} plan {plan} {reduce_op}"
            got = _run(
                plan,
                lambda p: torch.ops.fastmesh.scaled_matmul_reduce_scatter(
                    a, a_scale, b, b_scale, dim, reduce_op, name, torch.float32, p or 0
                ),
            )
            assert torch.equal(got, ref.reduce_scatter(product, dim, name, reduce_op)), case


# ---- which transport ran ----


@on_ranks(2, 3)
def test_the_switch_picks_the_transport(world_size):
    rank = dist.get_rank()
    shard = small_ints((6, 5), torch.float32, rank)
    b = small_ints((5, 4), torch.float32, 1)
    a = small_ints((4, 6 * world_size, 5), torch.float32, 2 + rank)
    b_rs = small_ints((5, 12), torch.float32, 3)
    ops = [
        (lambda p: fastmesh.all_gather_matmul(shard, [b], 0, pieces=p), ALL_GATHER, None),
        (lambda p: fastmesh.matmul_reduce_scatter(a, b_rs, 1, pieces=p), REDUCE_SCATTER, None),
        (lambda _: fastmesh.matmul_reduce_scatter(a, b_rs, 1), REDUCE_SCATTER, plans.Plan("columns", 2)),
        (lambda p: fastmesh.matmul_all_gather(shard, b, pieces=p), ALL_GATHER, None),
        (lambda p: fastmesh.matmul_all_reduce(shard, b, pieces=p), ALL_REDUCE, None),
    ]
    for run, _, _ in ops:
        run(2)  # the first call's shape check (one small all-gather) is behind us
    for transport, (run, collective, plan) in itertools.product(("auto", "", "p2p", "collective"), ops):
        with environment(FASTMESH_TRANSPORT=transport):  # "": as unset
            if plan is None:
                calls = c10d_calls(lambda: run(2))
            else:
                with plans.override(plan):
                    calls = c10d_calls(lambda: run(None))
        if collective == ALL_REDUCE or transport == "collective":  # the all-reduce is a collective everywhere
            want = {collective: 2}
        else:
            want = p2p_pieces(world_size, 2)
        assert calls == want, (transport, collective, plan, calls)
    plans.forget()


@on_ranks(2)
def test_a_bad_transport_raises_naming_the_variable():
    shard = small_ints((6, 5), torch.float32, dist.get_rank())
    b = small_ints((5, 4), torch.float32, 1)
    a = small_ints((4, 5), torch.float32, 2)
    calls = [
        lambda: fastmesh.all_gather_matmul(shard, [b], 0, pieces=2),
        lambda: fastmesh.matmul_reduce_scatter(a, b, 0, pieces=2),
        lambda: fastmesh.matmul_all_gather(shard, b, pieces=2),
    ]
    for call in calls:
        call()  # the first call's shape check is behind us: the error comes before any transfer starts
    with environment(FASTMESH_TRANSPORT="nccl"):
        for call in calls:
            with pytest.raises(ValueError, match=r'FASTMESH_TRANSPORT .* "auto", "collective" or "p2p", got "nccl"'):
                call()
    for call in calls:  # the group is still usable: no transfer was left in flight
        counts = c10d_calls(call)
        assert counts == p2p_pieces(2, 2), counts
    plans.forget()

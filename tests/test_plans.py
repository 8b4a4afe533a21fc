"""Plans per call (fastmesh/ops/plans.py): every plan computes the same result, ranks always agree on one, the
cost model avoids the shapes where fusing loses, and the cache of measured plans is safe to share."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from environment import environment
from fastmesh.kernels import fused_reference as ref
from rank_pool import on_ranks
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh import _cpp_lib
from fastmesh.ops import plan_cache, plan_model, plans, traced_unfused
from fastmesh.ops.fused_collectives import gather_plan_call, scatter_plan_call
from fastmesh.ops.fused_collectives_fp8 import scaled_gather_plan_call, scaled_scatter_plan_call
from fastmesh.ops.plan_cache import PlanCache

E4M3 = torch.float8_e4m3fn
AG, RS = "fastmesh::all_gather_matmul", "fastmesh::matmul_reduce_scatter"


def small_ints(shape, dtype, seed) -> torch.Tensor:
    # Small integers: every product and sum is exact, so plans that sum in another order still agree bitwise.
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _group():
    group = dist.group.WORLD
    return group, fastmesh.group_name(group)


def _gather_call(a_shard, bs, dim):
    """The Call the op's kernel plans (the same key)."""
    return gather_plan_call(a_shard, bs, dim % a_shard.dim(), _group()[1])


def _scatter_call(a, b, dim):
    return scatter_plan_call(a, b, dim % a.dim(), _group()[1])


# ---- every plan gives the reference's result ----

_GATHERS = [((6, 5), 0, (3, 7)), ((2, 4, 5), 1, (4,)), ((3, 2, 4), 0, (2, 5)), ((5, 4), -1, (3,))]
_SCATTERS = [((12, 5), 0, 6), ((2, 6, 5), 1, 4), ((6, 2, 3), 0, 8), ((6, 5), -1, 12), ((3, 4, 6), 2, 6)]


@on_ranks(2, 3)
def test_every_plan_equals_the_reference():
    rank, world = dist.get_rank(), dist.get_world_size()
    _, name = _group()
    checked = set()
    for shape, dim, ns in _GATHERS:
        shards = [small_ints(shape, torch.float32, 10 + j) for j in range(world)]
        k = shape[-1] * (world if dim % len(shape) == len(shape) - 1 else 1)
        bs = [small_ints((k, n), torch.float32, 20 + i) for i, n in enumerate(ns)]
        a_ref, outs_ref = ref.all_gather_matmul(shards[rank], bs, dim, name, return_a=True)
        call = _gather_call(shards[rank], bs, dim)
        for plan in call.candidates:
            with plans.override(plan):
                a_full, outs = torch.ops.fastmesh.all_gather_matmul(shards[rank], bs, dim, name, True)
            assert plans.last_decision(AG)[1].plan == plan
            assert torch.equal(a_full, a_ref), (shape, dim, plan)
            for out, want in zip(outs, outs_ref):
                assert torch.equal(out, want), (shape, dim, plan)
            checked.add(("ag", plan.split))
    for shape, dim, n in _SCATTERS:
        a = small_ints(shape, torch.float32, 30 + rank)
        b = small_ints((shape[-1], n), torch.float32, 40 + rank)
        want = ref.matmul_reduce_scatter(a, b, dim, "sum", name)
        for plan in _scatter_call(a, b, dim).candidates:
            for reduce_op in ("sum", "avg"):
                with plans.override(plan):
                    got = torch.ops.fastmesh.matmul_reduce_scatter(a, b, dim, reduce_op, name)
                assert plans.last_decision(RS)[1].plan == plan
                expected = want if reduce_op == "sum" else want / world
                assert torch.equal(got, expected), (shape, dim, plan, reduce_op)
            checked.add(("rs", plan.split))
    assert checked == {("ag", "rows"), ("ag", "none"), ("rs", "rows"), ("rs", "columns"), ("rs", "none")}


@on_ranks(2)
def test_every_plan_of_the_fp8_ops_gives_the_same_bits():
    """FP8 data of small integers with power-of-two scales: every product is exact, so every plan must agree
    with the default plan bitwise (row-wise and tensor-wise scales, rows and the last dim; on torch < 2.13, whose
    CPU _scaled_mm takes tensor-wise scales only, the reduce-scatter's tensor-wise scales)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, name = _group()
    for rowwise in (True, False) if ROWWISE_ON_CPU else (False,):
        a = small_ints((2, 8, 16), torch.float32, 50 + rank).to(E4M3)
        a_scale = (torch.full((2, 8, 1), 0.5) if rowwise else torch.tensor(0.25)).float()
        b = small_ints((32, 16), torch.float32, 60).to(E4M3).t()  # column-major [16, 32], as _scaled_mm wants
        b_scale = torch.full((1, 32), 2.0) if rowwise else torch.tensor(2.0)
        if ROWWISE_ON_CPU:  # the gathered per-rank tensor-wise scales are row-wise ones
            _, _, (want,) = torch.ops.fastmesh.all_gather_scaled_matmul(
                a, a_scale, [b], [b_scale], 1, name, torch.float32, False
            )
            call = scaled_gather_plan_call(a, a_scale, [b], 1, name, torch.float32)
            for plan in call.candidates:
                with plans.override(plan):
                    _, _, (got,) = torch.ops.fastmesh.all_gather_scaled_matmul(
                        a, a_scale, [b], [b_scale], 1, name, torch.float32, False
                    )
                assert torch.equal(got, want), (rowwise, plan)
        for dim in (1, 2):
            want = torch.ops.fastmesh.scaled_matmul_reduce_scatter(
                a, a_scale, b, b_scale, dim, "sum", name, torch.float32
            )
            call = scaled_scatter_plan_call(a, a_scale, b, b_scale, dim, name, torch.float32)
            for plan in call.candidates:
                with plans.override(plan):
                    got = torch.ops.fastmesh.scaled_matmul_reduce_scatter(
                        a, a_scale, b, b_scale, dim, "sum", name, torch.float32
                    )
                assert torch.equal(got, want), (rowwise, dim, plan)
            assert world * got.shape[dim] == (8 if dim == 1 else 32)


@on_ranks(2)
def test_backward_runs_the_planned_ops_and_matches_the_reference():
    rank = dist.get_rank()
    _, name = _group()
    x = small_ints((4, 6), torch.float32, 70 + rank).requires_grad_()
    w = small_ints((6, 5), torch.float32, 80).requires_grad_()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    for plan in (plans.UNFUSED, plans.Plan("rows", 2)):
        with plans.override(plan):
            _, (y,) = fastmesh.all_gather_matmul(x, [w], 0)
            z = fastmesh.matmul_reduce_scatter(y, w.t(), 0)
        _, (y_ref,) = ref.all_gather_matmul(x_ref, [w_ref], 0, name)
        z_ref = ref.matmul_reduce_scatter(y_ref, w_ref.t(), 0, "sum", name)
        assert torch.equal(z, z_ref)
        grad = small_ints(z.shape, torch.float32, 90 + rank)
        gx, gw = torch.autograd.grad(z, (x, w), grad)
        gx_ref, gw_ref = torch.autograd.grad(z_ref, (x_ref, w_ref), grad)
        assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref), plan


@on_ranks(2, 3)
def test_plans_move_the_pieces_they_say(world_size):
    from comm_counts import c10d_calls, p2p_pieces

    rank = dist.get_rank()
    a = small_ints((4, 6 * world_size, 5), torch.float32, 5 + rank)
    b = small_ints((5, 12), torch.float32, 6)
    fastmesh.matmul_reduce_scatter(a, b, 1)  # the first call's shape check is behind us
    for plan, pieces in ((plans.UNFUSED, 1), (plans.Plan("columns", 4), 4), (plans.Plan("rows", 2), 2)):
        with plans.override(plan):
            calls = c10d_calls(lambda: fastmesh.matmul_reduce_scatter(a, b, 1))
        assert calls == p2p_pieces(world_size, pieces), (plan, calls)
    shard = small_ints((8, 5), torch.float32, 7 + rank)
    fastmesh.all_gather_matmul(shard, [b], 0)
    with plans.override(plans.UNFUSED):
        calls = c10d_calls(lambda: fastmesh.all_gather_matmul(shard, [b], 0))
    assert calls == p2p_pieces(world_size, 1), calls


@on_ranks(2)
def test_ranks_agree_in_one_all_reduce_per_new_key():
    from comm_counts import c10d_calls, p2p_pieces

    plans.forget()
    a = small_ints((6, 5), torch.float32, dist.get_rank())
    b = small_ints((5, 4), torch.float32, 8)
    fastmesh.all_gather_matmul(a, [b], 0, pieces=1)  # the first call's shape check is behind us
    first = c10d_calls(lambda: fastmesh.all_gather_matmul(a, [b], 0))
    agreement = {name: first.pop(name) for name in list(first) if "all_reduce" in name or "allreduce" in name}
    assert agreement.get("c10d::allreduce_", agreement.get("_c10d_functional::all_reduce")) == 1, agreement
    assert first == {**p2p_pieces(2, 1), "_c10d_functional::wait_tensor": 1}, first
    assert c10d_calls(lambda: fastmesh.all_gather_matmul(a, [b], 0)) == p2p_pieces(2, 1)


@on_ranks(2)
def test_a_call_is_planned_from_one_call_object_per_shape():
    """Every call asks for its Call; one is built per distinct shape, dtype and thread count (building its candidates
    and key was most of a planned call's host time), and forget() drops them."""
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    first = _gather_call(a, [b], 0)
    assert _gather_call(torch.randn(6, 5), [torch.randn(5, 4)], 0) is first
    assert _scatter_call(torch.randn(6, 5), b, 0) is _scatter_call(a, b, 0)
    others = [
        _gather_call(torch.randn(8, 5), [b], 0),
        _gather_call(a.double(), [b.double()], 0),
        _scatter_call(a, b, 0),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        others.append(_gather_call(a, [b], 0))
    finally:
        torch.set_num_threads(threads)
    assert len({first.key, *(call.key for call in others)}) == 1 + len(others)
    plans.forget()
    again = _gather_call(a, [b], 0)
    assert again is not first and again.key == first.key


@on_ranks(3)
def test_a_rank_in_two_groups_agrees_in_each():
    """Ranks 0 and 1, then ranks 0 and 2, make the same call on their own group: rank 0 has agreed on the key in the
    first group, rank 2 has not, so the second group must agree again (rank 0 skipping it left rank 2 waiting)."""
    rank = dist.get_rank()
    plans.forget()
    groups = [dist.new_group([0, 1]), dist.new_group([0, 2])]
    a, b = torch.ones(4, 8), torch.ones(8, 6)
    for members, group in zip(([0, 1], [0, 2]), groups):
        if rank in members:
            assert torch.equal(fastmesh.matmul_all_reduce(a, b, group=group), torch.full((4, 6), 16.0))
            assert torch.equal(fastmesh.all_gather_matmul(a, [b], 0, group=group)[1][0], torch.full((8, 6), 8.0))
        dist.barrier()


# ---- ranks agree ----


def _gathered_labels(label: str) -> list:
    labels = [None] * dist.get_world_size()
    dist.all_gather_object(labels, label)
    return labels


@on_ranks(2, 3)
def test_measured_plans_agree_when_each_rank_times_differently():
    """Each rank is made to find a different plan fastest (an injected delay); the MAX over ranks decides, so
    every rank takes the same plan, the one whose slowest rank is fastest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cache_file = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], f"agree-{world}.json")
    a = small_ints((8, 4), torch.float32, 1 + rank)
    bs = [small_ints((4, 3), torch.float32, 2)]
    call = _gather_call(a, bs, 0)
    slow_here = call.candidates[rank % len(call.candidates)]  # rank r finds its own plan slow

    def run(plan):  # the op's own kernel runs a plan like this (through the planner it would measure again)
        time.sleep(0.02 if plan == slow_here else 0.001)
        return _cpp_lib.load().all_gather_matmul(a, bs, 0, call.group_name, False, plan.pieces, plan.split)

    plans.forget()
    with environment(FASTMESH_TUNE="measure", FASTMESH_TUNE_CACHE=cache_file):
        decision = plans.decide(call, 0, run)
        labels = _gathered_labels(decision.plan.label)
        assert len(set(labels)) == 1, labels
        assert decision.source == "measured"
        assert decision.plan not in {call.candidates[r % len(call.candidates)] for r in range(world)}
        # Measured once, then agreed: a second call does not measure again.
        assert plans.decide(call, 0, lambda plan: pytest.fail("measured twice")) == decision
        with plans.override(decision.plan):
            _, (out,) = torch.ops.fastmesh.all_gather_matmul(a, bs, 0, call.group_name, False)
        _, (want,) = ref.all_gather_matmul(a, bs, 0, call.group_name)
        assert torch.equal(out, want)
    plans.forget()


@on_ranks(2)
def test_a_plan_cached_on_one_rank_only_is_rank_0s_choice_everywhere():
    rank = dist.get_rank()
    a = small_ints((8, 4), torch.float32, 1 + rank)
    bs = [small_ints((4, 3), torch.float32, 2)]
    cache_file = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], f"one-rank-{rank}.json")
    with environment(FASTMESH_TUNE="model", FASTMESH_TUNE_CACHE=cache_file):
        call = _gather_call(a, bs, 0)
        model = plans._model(call).plan
        other = next(p for p in call.candidates if p != model)
        if rank == 0:
            plans.cache().store(call.key, {"split": other.split, "pieces": other.pieces, "ms": {}})
        dist.barrier()
        plans.forget()
        decision = plans.decide(call, 0, None)
        assert _gathered_labels(decision.plan.label) == [other.label] * 2
        assert decision.source == ("cache" if rank == 0 else "rank 0's plan")
        # Where every rank has the plan cached, it comes from the cache everywhere.
        if rank == 1:
            plans.cache().store(call.key, {"split": other.split, "pieces": other.pieces, "ms": {}})
        dist.barrier()
        plans.forget()
        assert plans.decide(call, 0, None).source == "cache"
        # The op runs it, and the result is exact.
        _, (out,) = fastmesh.all_gather_matmul(a, bs, 0)
        assert plans.last_decision(AG)[1].plan == other
        assert torch.equal(out, ref.all_gather_matmul(a, bs, 0, call.group_name)[1][0])
    plans.forget()


@on_ranks(2)
def test_modes_and_given_pieces():
    rank = dist.get_rank()
    a = small_ints((8, 4), torch.float32, 1 + rank)
    bs = [small_ints((4, 3), torch.float32, 2)]
    plans.forget()
    with environment(FASTMESH_TUNE="off"):
        fastmesh.all_gather_matmul(a, bs, 0)
        assert plans.last_decision(AG)[1].plan == plans.FIXED
    fastmesh.all_gather_matmul(a, bs, 0, pieces=3)
    assert plans.last_decision(AG)[1] == plans.Decision(plans.Plan("rows", 3), "pieces= given")
    with (
        environment(FASTMESH_TUNE="fast"),
        pytest.raises(ValueError, match="FASTMESH_TUNE must be one of off, model, measure, got 'fast'"),
    ):
        fastmesh.all_gather_matmul(a, bs, 0)
    plans.forget()


# ---- the model ----


def _shape(op, rows, k, ns, dtype="float32", outer=1, last=False, world=2):
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return plan_model.Shape(op, world, rows, k, tuple(ns), outer, last, size, size, dtype, 1, "cpu")


def _candidates(op):
    rows = [plans.Plan("rows", p) for p in (1, 2, 4, 8)]
    columns = [plans.Plan("columns", p) for p in (2, 4, 8)] if op == "reduce_scatter" else []
    return rows + columns + [plans.UNFUSED]


@pytest.mark.parametrize(
    "op, rows, k, ns, dtype",
    [
        # Where the issue measured fusing lose: few rows and a large weight (every piece re-reads b).
        ("all_gather", 64, 4096, [4096], "float32"),
        ("reduce_scatter", 128, 4096, [4096], "float32"),
        ("reduce_scatter", 512, 8192, [1024], "bfloat16"),
        ("all_gather", 256, 2048, [8192], "bfloat16"),
    ],
)
def test_model_does_not_cut_rows_when_the_weight_dominates(op, rows, k, ns, dtype):
    chosen, times = plan_model.best(_shape(op, rows, k, ns, dtype), _candidates(op))
    assert chosen.split != "rows", (chosen, times)
    # And more row pieces only cost more passes over b.
    assert times["rowsx1"] < times["rowsx2"] < times["rowsx4"] < times["rowsx8"]


def test_model_overlaps_where_the_transfer_is_as_long_as_the_multiply():
    # 2048 rows of 4096 bf16 per rank (16 MiB, ~11 ms over gloo) against a narrow multiply (~11 ms)
    chosen, times = plan_model.best(_shape("all_gather", 2048, 4096, [48], "bfloat16"), _candidates("all_gather"))
    assert chosen.split == "rows" and times[chosen.label] < 0.9 * times["unfused"], times


# ---- the cache ----


def _entry(label):
    return {"split": "rows", "pieces": int(label), "ms": {}}


def test_cache_is_written_once_and_reused(tmp_path):
    path = str(tmp_path / "sub" / "plans.json")
    writer = PlanCache(path)
    assert writer.lookup("k") is None
    writer.store("k", _entry(2))
    assert PlanCache(path).lookup("k") == _entry(2)
    data = json.loads(pathlib.Path(path).read_text())
    assert data["format"] == plan_cache.FORMAT
    (section,) = data["machines"].values()
    assert section["machine"]["torch"] == torch.__version__ and list(section["plans"]) == ["k"]
    # A second writer's entry is merged, not lost; the first sees it once the file changed.
    PlanCache(path).store("k2", _entry(4))
    assert writer.lookup("k2") == _entry(4) and writer.lookup("k") == _entry(2)


def test_cache_is_invalidated_by_a_version_change(tmp_path, monkeypatch):
    path = str(tmp_path / "plans.json")
    PlanCache(path).store("k", _entry(2))
    newer = dict(plan_cache.machine(), torch="9.9.9")
    monkeypatch.setattr(plan_cache, "machine", lambda: newer)
    assert PlanCache(path).lookup("k") is None
    PlanCache(path).store("k", _entry(8))  # a section of its own, beside the old one
    assert len(json.loads(pathlib.Path(path).read_text())["machines"]) == 2


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the plan cache .*plans.json"):
        assert PlanCache(str(path)).lookup("k") is None
    with pytest.warns(UserWarning):
        PlanCache(str(path)).store("k", _entry(2))
    assert PlanCache(str(path)).lookup("k") == _entry(2)


def test_unwritable_cache_warns_once_and_keeps_the_entry_in_the_process(tmp_path):
    """A cache path that cannot be written (here its parent is a file; a directory or no permission alike) must not
    fail the fused call that measured: one warning, and the process keeps what it measured."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    cache = PlanCache(str(blocker / "plans.json"))
    with pytest.warns(UserWarning, match="could not write the plan cache .*kept in this process only"):
        cache.store("k", _entry(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.store("j", _entry(2))
    assert cache.lookup("k") == _entry(1) and cache.lookup("j") == _entry(2)
    with pytest.warns(UserWarning) as record:  # a directory where the file should be: unreadable too
        PlanCache(str(tmp_path)).store("k", _entry(1))
    assert any("could not write the plan cache" in str(w.message) for w in record), [str(w.message) for w in record]


def _store_many(path, prefix, count):
    cache = PlanCache(path)
    for i in range(count):
        cache.store(f"{prefix}{i}", _entry(i))


def test_cache_is_safe_with_two_processes_writing(tmp_path):
    path = str(tmp_path / "plans.json")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_store_many, args=(path, prefix, 40)) for prefix in ("a", "b")]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
        assert w.exitcode == 0
    entries = PlanCache(path).entries()
    assert sorted(entries) == sorted([f"a{i}" for i in range(40)] + [f"b{i}" for i in range(40)])
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".plans-")]  # no temporary file left


# ---- under inductor ----


def _compiled_layer(x, w1, w2):
    _, (h,) = fastmesh.all_gather_matmul(x, [w1], 0)
    return fastmesh.matmul_reduce_scatter(torch.relu(h), w2, 0)


@on_ranks(2, timeout=300)
def test_inductor_traces_unfused_plans_as_torchs_collectives():
    """Tiny static shapes: the model's plan is unfused, and inductor's graph holds torch's functional
    collectives instead of the ops (the ops' kernels never run); with a fused plan in the cache the ops stay.
    Forward and backward equal eager either way."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor import config as inductor_config

    rank = dist.get_rank()
    x = small_ints((6, 5), torch.float32, 3 + rank).requires_grad_()
    w1, w2 = small_ints((5, 4), torch.float32, 4), small_ints((4, 6), torch.float32, 5)
    grad = small_ints((6, 6), torch.float32, 6 + rank)
    want = _compiled_layer(x, w1, w2)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    cache_file = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], f"inductor-{rank}.json")
    for cached in (None, plans.Plan("rows", 2)):
        with (
            environment(FASTMESH_TUNE="model", FASTMESH_TUNE_CACHE=cache_file),
            inductor_config.patch(fx_graph_cache=False),
        ):
            if cached is not None:
                h = torch.empty(2 * x.shape[0], w1.shape[1])  # the gathered product the reduce-scatter multiplies
                for call in (_gather_call(x, [w1], 0), _scatter_call(h, w2, 0)):
                    plans.cache().store(call.key, {"split": cached.split, "pieces": cached.pieces, "ms": {}})
            plans.forget()
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("inductor")
            got = torch.compile(_compiled_layer, fullgraph=True, backend=counter)(x, w1, w2)
            (got_grad,) = torch.autograd.grad(got, x, grad)
        assert counter.frame_count == 1
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad), cached
        ran = {op: plans.last_decision(op) for op in (AG, RS)}
        if cached is None and traced_unfused.register_once():
            assert ran == {AG: None, RS: None}, ran  # traced as torch's collectives: the ops never ran
        elif cached is None:  # a torch whose inductor internals fastmesh cannot extend: the ops ran, unfused
            assert all(d is not None and d[1].plan == plans.UNFUSED for d in ran.values()), ran
        else:
            assert all(d is not None and d[1].plan == cached for d in ran.values()), ran
    torch._dynamo.reset()
    plans.forget()


# ---- CUDA-graph capture (the branch, on CPU: the capture is simulated) ----


@on_ranks(2)
def test_a_call_planned_during_capture_takes_the_models_plan_for_that_call_only():
    """Inside a capture nothing may talk to the other ranks: a key planned there takes the cost model's plan, says
    so, and is not remembered (each captured call plans again, without collectives); once out of the capture the key
    is agreed as usual and remembered. The every-call shape check is a collective: inside a capture it is an error
    that says so, not a hang."""
    from log_capture import plan_log

    group = dist.new_group([0, 1])  # keys of their own
    a, b = small_ints((6, 10), torch.float32, 1), small_ints((10, 4), torch.float32, 2)
    runs = []
    planned = plans._planned_runs["matmul_all_reduce"]
    plans._planned_runs["matmul_all_reduce"] = lambda *args: runs.append(args) or planned(*args)
    try:
        captured, plans.capturing = plans.capturing, lambda device: True
        try:
            with plan_log() as messages:
                for _ in range(2):
                    out = fastmesh.matmul_all_reduce(a, b, group=group)
                    torch.testing.assert_close(out, a @ b * 2, rtol=0, atol=0)
            assert len(runs) == 2, "a decision taken during capture is not remembered"
            _, decision = plans.last_decision("fastmesh::matmul_all_reduce")
            assert decision.source == "model" and decision.this_call_only, decision
            assert len(messages) == 1 and messages[0].endswith(plans.CAPTURE_NOTE), messages
            with (
                environment(FASTMESH_SHAPE_CHECK="every"),
                pytest.raises(RuntimeError, match=r"cannot run inside a CUDA-graph capture"),
            ):
                fastmesh.matmul_all_reduce(a, b, group=group)
        finally:
            plans.capturing = captured
        runs.clear()
        for _ in range(3):
            torch.testing.assert_close(fastmesh.matmul_all_reduce(a, b, group=group), a @ b * 2, rtol=0, atol=0)
        assert len(runs) == 1, "out of the capture, the key is planned once and remembered"
        _, decision = plans.last_decision("fastmesh::matmul_all_reduce")
        assert not decision.this_call_only, decision
    finally:
        plans._planned_runs["matmul_all_reduce"] = planned

"""How each fused call runs: a plan per call, the same on every rank, never slower than not fusing.

A plan is a schedule and a piece count: pieces of rows (the pipeline of ``csrc/include/fastmesh/pipeline.h``),
pieces of the product's columns (reduce-scatters: ``b`` read once whatever the piece count), ``"none"`` (the
unfused sequence inside the op: the whole transfer, then one multiply per ``b``, or the reverse), or on CUDA
the Triton consumer GEMM. The op's kernel builds the :class:`Call` (its key: op, shapes, dtypes, dim, group
size, backend, device, threads) and asks :func:`decide`, once per key, group and process:

* ``pieces=N`` (N > 0) given by the caller wins: rows in N pieces;
* ``FASTMESH_TUNE=off``: the fixed rule (rows, pieces from the size: ``pipeline.h``);
* ``FASTMESH_TUNE=model`` (default): a measured plan from the cache file (:mod:`fastmesh.ops.plan_cache`) if
  every rank has one, else the cost model (:mod:`fastmesh.ops.plan_model`);
* ``FASTMESH_TUNE=measure``: as ``model``, but a key not every rank has cached is measured on the spot: every
  candidate is timed on every rank in interleaved rounds, judged by its time over the unfused plan's in the
  same round (the slowest rank's), and the fastest plan is stored.

Every rank must run the same plan (different plans exchange different messages). Ranks agree in one small
all-reduce per key and group: rank 0's plan is taken (and whether every rank has a cached one), and measured
times are reduced with MAX so that every rank picks from the same figures. Under CUDA-graph capture nothing is
measured or exchanged: the model decides (its constants are fixed, so every rank computes the same plan).
Each key's decision is logged once (INFO, logger ``fastmesh.plans``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from fastmesh import _cpp_lib, _log, settings
from fastmesh.ops import _collectives, plan_model
from fastmesh.ops.plan_cache import PlanCache, default_path

logger = logging.getLogger("fastmesh.plans")

ENV_MODE = "FASTMESH_TUNE"
SPLITS = ("rows", "columns", "none", "consumer_gemm")
# A measured fused plan must beat the unfused one by this much: less is noise on a loaded machine.
MEASURE_MARGIN = 0.01
MEASURE_ROUNDS = 5  # timed rounds per candidate at least, after one warm-up round
MEASURE_SECONDS = 2.0  # what the timed rounds of one key should take in all, where MEASURE_ROUNDS take less


def mode() -> str:
    """``FASTMESH_TUNE`` (:mod:`fastmesh.settings`): "off", "model" or "measure"."""
    return settings.get(ENV_MODE)


@dataclasses.dataclass(frozen=True)
class Plan:
    split: str  # one of SPLITS
    pieces: int = 0  # 0: from the size (pipeline.h)

    @property
    def label(self) -> str:
        if self.split == "none":
            return "unfused"
        if self.split == "consumer_gemm":
            return "consumer_gemm"
        return f"{self.split}x{self.pieces}" if self.pieces else f"{self.split} (auto)"


UNFUSED = Plan("none", 1)
FIXED = Plan("rows", 0)


@dataclasses.dataclass(frozen=True)
class Decision:
    plan: Plan
    source: str  # "pieces=", "fixed", "model", "cache", "measured", or why nothing is planned
    figures: tuple = ()  # (label, milliseconds) per candidate: model estimates or measured times
    # The plan holds for this call only (an override, a decision taken during CUDA-graph capture): the op's C++
    # kernel asks again next time rather than remember it.
    this_call_only: bool = False

    def describe(self) -> str:
        figures = ", ".join(f"{label} {ms:.3g} ms" for label, ms in self.figures)
        return f"{self.plan.label} ({self.source}{': ' + figures if figures else ''})"


@dataclasses.dataclass(frozen=True)
class Call:
    """One fused call as the planner sees it; every field is the same on every rank."""

    op: str
    group_name: str
    backend: str
    device: torch.device
    fields: tuple  # the key's fields besides op, backend and device (shapes, dtypes, dims, world, threads)
    shape: plan_model.Shape
    candidates: tuple  # Plans this call can run

    @property
    def key(self) -> str:
        # Computed once per Call, kept beside the fields (functools.cached_property takes a lock per access on
        # Python < 3.12: a measurable part of a planned call's overhead).
        key = self.__dict__.get("_key")
        if key is None:
            key = "|".join([self.op, self.backend, _device_key(self.device)] + [f"{n}={v}" for n, v in self.fields])
            self.__dict__["_key"] = key
        return key


_gpu_names: dict[torch.device, str] = {}


def _device_key(device: torch.device) -> str:
    """A key's device: the type, and for CUDA the GPU's name (plans measured on one GPU model hold for it)."""
    if device.type != "cuda":
        return device.type
    name = _gpu_names.get(device)
    if name is None:
        try:
            name = _gpu_names[device] = "cuda:" + torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):  # a fake CUDA tensor on a machine without one
            return "cuda"
    return name


def backend_of(group, device: torch.device) -> str:
    try:
        return group._get_backend(device).name()
    except (RuntimeError, AttributeError):
        return "unknown"


def threads(device: torch.device) -> int:
    return torch.get_num_threads() if device.type == "cpu" else 1


def _dtype_name(dtype: torch.dtype) -> str:
    return "float8" if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else str(dtype).removeprefix("torch.")


def _rows_around(t: torch.Tensor, dim: int) -> tuple[int, int]:
    """(the product of t's dims before ``dim``, t's rows: the product of every dim but the last)."""
    return math.prod(t.shape[:dim]), math.prod(t.shape[:-1])


def _call(
    op: str,
    kind: str,
    group,
    group_name: str,
    a: torch.Tensor,
    candidates: list,
    *,
    rows: int,
    ns,
    comm_bytes: int,
    outer: int = 1,
    last: bool = False,
    operands: tuple = (),
    results: tuple = (),
    extra: tuple = (),
) -> Call:
    """The Call of a fused ``op`` whose multiplied operand on this rank is ``a`` (its last dim the contraction):
    the model's Shape of ``kind`` and the key's fields (``operands`` after a's shape, ``results`` after its
    dtype, ``extra`` last)."""
    world = group.size()
    shape = plan_model.Shape(
        kind,
        world,
        rows,
        a.shape[-1],
        tuple(ns),
        outer,
        last,
        comm_bytes,
        a.element_size(),
        _dtype_name(a.dtype),
        threads(a.device),
        a.device.type,
    )
    fields = (
        ("a", list(a.shape)),
        *operands,
        ("dtype", str(a.dtype)),
        *results,
        ("world", world),
        ("threads", shape.threads),
        *extra,
    )
    return Call(op, group_name, backend_of(group, a.device), a.device, fields, shape, tuple(candidates))


# Calls built so far, by what each was built from: building one (its candidates, the model's shape, the key) is
# most of a planned call's host time, where a decode loop repeats a few shapes. Grows with the
# distinct shapes a process runs, as the agreed decisions do; forget() clears both.
_calls: dict[tuple, Call] = {}


def _memoized(group, a: torch.Tensor, arguments: tuple, build: Callable[[], Call]) -> Call:
    """``build()``, or the Call it gave for the same ``arguments`` (the constructor's own, hashable) and the same
    group size, backend, operand and threads: a group name can name another group after the default group is
    destroyed and made again."""
    memo = (group.size(), backend_of(group, a.device), a.shape, a.dtype, a.device, threads(a.device), *arguments)
    call = _calls.get(memo)
    if call is None:
        call = _calls[memo] = build()
    return call


def gather_call(
    op: str,
    group,
    group_name: str,
    a_shard: torch.Tensor,
    ns,
    dim: int,
    extra: tuple = (),
    allow_unfused: bool = True,
    consumer_gemm: bool = False,
) -> Call:
    """The Call of an all-gather + matmul of ``a_shard`` along ``dim`` by bs (of a_shard's dtype) of ``ns``
    columns."""
    arguments = ("gather", op, group_name, tuple(ns), dim, extra, allow_unfused, consumer_gemm)
    return _memoized(
        group,
        a_shard,
        arguments,
        lambda: _gather_call(op, group, group_name, a_shard, ns, dim, extra, allow_unfused, consumer_gemm),
    )


def _gather_call(op, group, group_name, a_shard, ns, dim, extra, allow_unfused, consumer_gemm) -> Call:
    last = dim == a_shard.dim() - 1
    outer, shard_rows = _rows_around(a_shard, dim)
    units = outer if outer > 1 else shard_rows
    candidates = [Plan("rows", p) for p in plan_model.pieces_up_to(units)]
    if allow_unfused and not last:
        candidates.append(UNFUSED)
    if consumer_gemm:
        candidates.append(Plan("consumer_gemm", 0))
    return _call(
        op,
        "all_gather",
        group,
        group_name,
        a_shard,
        candidates,
        rows=shard_rows,
        ns=ns,
        comm_bytes=a_shard.element_size(),
        outer=outer,
        last=last,
        operands=(("ns", list(ns)), ("dim", dim)),
        extra=extra,
    )


def scatter_call(
    op: str,
    group,
    group_name: str,
    a: torch.Tensor,
    n: int,
    dim: int,
    out_dtype: torch.dtype,
    extra: tuple = (),
    columns_pieces: bool = True,
) -> Call:
    """The Call of a matmul + reduce-scatter of ``a @ b`` (``b`` of ``n`` columns) along ``dim``."""
    arguments = ("scatter", op, group_name, n, dim, out_dtype, extra, columns_pieces)
    return _memoized(
        group, a, arguments, lambda: _scatter_call(op, group, group_name, a, n, dim, out_dtype, extra, columns_pieces)
    )


def _scatter_call(op, group, group_name, a, n, dim, out_dtype, extra, columns_pieces) -> Call:
    world = group.size()
    last = dim == a.dim() - 1
    outer, rows = _rows_around(a, dim)
    block_rows = rows if last else rows // world
    units = outer if (outer > 1 and not last) else block_rows
    block_cols = n // world if last else n
    candidates = [Plan("rows", p) for p in plan_model.pieces_up_to(units)]
    if columns_pieces:
        candidates += [Plan("columns", p) for p in plan_model.pieces_up_to(block_cols) if p > 1]
    candidates.append(UNFUSED)
    return _call(
        op,
        "reduce_scatter",
        group,
        group_name,
        a,
        candidates,
        rows=rows,
        ns=(n,),
        comm_bytes=out_dtype.itemsize,
        outer=outer,
        last=last,
        operands=(("n", n), ("dim", dim)),
        results=(("out_dtype", str(out_dtype)),),
        extra=extra,
    )


def product_call(
    op: str, kind: str, group, group_name: str, a: torch.Tensor, n: int, out_dtype: torch.dtype, extra: tuple = ()
) -> Call:
    """The Call of a matmul whose whole product ``a @ b`` (``b`` of ``n`` columns; in ``out_dtype``) then travels:
    ``kind`` ``"all_reduce"`` (matmul + all-reduce) or ``"product_all_gather"`` (matmul + all-gather of the
    product's columns). Pieces of the product's rows; one piece is the unfused plan."""
    arguments = ("product", op, kind, group_name, n, out_dtype, extra)
    return _memoized(group, a, arguments, lambda: _product_call(op, kind, group, group_name, a, n, out_dtype, extra))


def _product_call(op, kind, group, group_name, a, n, out_dtype, extra) -> Call:
    rows = math.prod(a.shape[:-1])
    candidates = [Plan("rows", p) for p in plan_model.pieces_up_to(rows) if p > 1] + [UNFUSED]
    return _call(
        op,
        kind,
        group,
        group_name,
        a,
        candidates,
        rows=rows,
        ns=(n,),
        comm_bytes=out_dtype.itemsize,
        operands=(("n", n),),
        results=(("out_dtype", str(out_dtype)),) if out_dtype != a.dtype else (),
        extra=extra,
    )


# ---- the decision ----

_lock = threading.Lock()
# (group name, key) -> the decision the group's ranks took, for this process. Per group: the ranks of two groups
# of one size agree separately (a rank in both would skip the agreement the other group's ranks wait in).
_agreed: dict[tuple[str, str], Decision] = {}
_last: dict[str, tuple[str, Decision]] = {}  # op -> (key, decision) of its latest call planned in Python
# Ids of the decisions the ops' C++ kernels remember (csrc/fused/planned.h), for last_decision: id -> (op, key,
# decision), and (op, key, decision) -> id.
_decision_ids: dict[int, tuple[str, str, Decision]] = {}
_ids_of: dict[tuple[str, str, Decision], int] = {}
_cache: PlanCache | None = None
_override: Plan | None = None
_LOG_KEY = "plan"  # log-once keys: (_LOG_KEY, key, decision)


def cache() -> PlanCache:
    """The plan cache at the current location (``FASTMESH_TUNE_CACHE`` is read again when it changes)."""
    global _cache
    if _cache is None or _cache.path != default_path():
        _cache = PlanCache()
    return _cache


def forget() -> None:
    """Drop this process's agreed decisions (the next call of each key decides again, on every rank)."""
    with _lock:
        _agreed.clear()
        _last.clear()
        _calls.clear()
        _decision_ids.clear()
        _ids_of.clear()
    _forget_remembered()
    _log.forget(lambda said: isinstance(said, tuple) and said[0] == _LOG_KEY)


def _forget_remembered() -> None:
    """The ops' C++ kernels forget the plans they remember (each key asks the planner again)."""
    if _cpp_lib.load_error() is None:
        _cpp_lib.load().forget_plans()


def last_decision(op: str) -> tuple[str, Decision] | None:
    """(key, decision) of ``op``'s latest planned call in this process, or None: the call's own when the op's C++
    kernel ran it with a remembered plan, else the latest the planner took."""
    if _cpp_lib.load_error() is None and op.startswith("fastmesh::"):
        remembered = _decision_ids.get(_cpp_lib.load().planned_decision(op.removeprefix("fastmesh::")))
        if remembered is not None and remembered[0] == op:
            return remembered[1:]
    return _last.get(op)


def remembered(call: Call | None, decision: Decision) -> tuple[str, int, int] | None:
    """What the op's C++ kernel remembers for the key of a call it ran with ``decision`` (``call``: the planner's
    view, None where nothing was planned: a group of one, an empty operand): ``(split, pieces, decision id)``, or
    None when the plan holds for this call only, runs in Python (the CUDA consumer GEMM), or every call must reach
    the planner (the cross-rank check of every call, ``FASTMESH_SHAPE_CHECK=every``)."""
    if decision.this_call_only or decision.plan.split == "consumer_gemm" or _cpp_lib.load().shape_check_every_call():
        return None
    if call is None:
        return decision.plan.split, decision.plan.pieces, -1
    entry = (call.op, call.key, decision)
    with _lock:
        decision_id = _ids_of.get(entry)
        if decision_id is None:
            decision_id = _ids_of[entry] = len(_decision_ids)
            _decision_ids[decision_id] = entry
    return decision.plan.split, decision.plan.pieces, decision_id


@contextlib.contextmanager
def override(plan: Plan):
    """Inside the block, every call of this process whose candidates include ``plan`` runs it, without talking
    to the other ranks: for tests and benchmarks that compare plans (every rank must enter the same block)."""
    global _override
    previous, _override = _override, plan
    _forget_remembered()  # the kernels ask the planner, which overrides, from here on
    try:
        yield
    finally:
        _override = previous
        _forget_remembered()


def capturing(device: torch.device) -> bool:
    """Whether a call on ``device`` is being captured into a CUDA graph (nothing may sync the host or talk to the
    other ranks)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Said with a decision taken during CUDA-graph capture (once per key, as every decision).
CAPTURE_NOTE = (
    "(during CUDA-graph capture: the cost model's plan alone, neither agreed with the other ranks nor measured nor "
    "remembered; call the op once before capturing to plan its key as usual)"
)


def _all_reduce(values: list, op: str, call: Call) -> list:
    tensor = torch.tensor(values, dtype=torch.float64 if op == "max" else torch.int64, device=call.device)
    try:
        return _collectives.all_reduce(tensor, op, call.group_name).tolist()
    except RuntimeError as error:
        # Said as a failed transfer of the op's pieces is (csrc/fused/process_group.cpp): the op, the group, the
        # backend's error kept in the text. A peer gone before a call of a new shape fails here first.
        group = _resolve_process_group(call.group_name)
        raise torch.distributed.DistBackendError(
            f"{call.op}: the transfer of the ranks' plan agreement (before the pieces) failed on rank {group.rank()} "
            f'of group "{call.group_name}" ({group.size()} ranks): its all-reduce, a collective of the group\'s '
            f"{group.size()} ranks, did not complete (a rank that exits or stalls fails its peers' transfers: "
            f"fastmesh's docs/faults.md).\nCaused by the backend's error: {error}"
        ) from error


def _model(call: Call) -> Decision:
    modelled = [c for c in call.candidates if c.split != "consumer_gemm"]
    chosen, times = plan_model.best(call.shape, modelled)
    return Decision(chosen, "model", tuple((label, s * 1e3) for label, s in times.items()))


def _cached(call: Call) -> Decision | None:
    entry = cache().lookup(call.key)
    if not isinstance(entry, dict):
        return None
    plan = Plan(entry.get("split"), entry.get("pieces", 0))
    if plan not in call.candidates:
        return None
    return Decision(plan, "cache", tuple((k, v) for k, v in entry.get("ms", {}).items()))


def _time(call: Call, run: Callable[[Plan], object], plan: Plan, cuda: bool) -> float:
    _all_reduce([0], "sum", call)  # a barrier: every rank starts the candidate together
    if cuda:
        torch.cuda.synchronize(call.device)
    start = time.perf_counter()
    run(plan)
    if cuda:
        torch.cuda.synchronize(call.device)
    return time.perf_counter() - start


def measure(call: Call, run: Callable[[Plan], object]) -> Decision:
    """Times every candidate of ``call`` on every rank in interleaved rounds (after a warm-up round; enough
    rounds for about MEASURE_SECONDS in all, MEASURE_ROUNDS to 3x that) and picks the fastest by the slowest
    rank's figures. Where the unfused plan is a candidate, each plan is judged by its time over the unfused
    plan's in the same round (the median over rounds): rounds drift together on a loaded machine, ratios
    less; a fused plan must win by MEASURE_MARGIN."""
    cuda = call.device.type == "cuda"
    candidates = list(call.candidates)
    warm_up = sum(_time(call, run, c, cuda) for c in candidates)
    (round_s,) = _all_reduce([warm_up], "max", call)
    rounds = min(3 * MEASURE_ROUNDS, max(MEASURE_ROUNDS, math.ceil(MEASURE_SECONDS / max(round_s, 1e-9))))
    times = {c: [] for c in candidates}
    for _ in range(rounds):
        for c in candidates:
            times[c].append(_time(call, run, c, cuda))
    medians = _all_reduce([statistics.median(times[c]) for c in candidates], "max", call)
    figures = tuple((c.label, s * 1e3) for c, s in zip(candidates, medians))
    if UNFUSED not in times:
        return Decision(min(candidates, key=dict(zip(candidates, medians)).get), "measured", figures)
    ratios = _all_reduce(
        [statistics.median(t / u for t, u in zip(times[c], times[UNFUSED])) for c in candidates], "max", call
    )
    by_ratio = dict(zip(candidates, ratios))
    chosen = min(candidates, key=by_ratio.get)
    if by_ratio[chosen] > 1 - MEASURE_MARGIN:
        chosen = UNFUSED
    return Decision(chosen, "measured", figures)


def _encode(plan: Plan) -> list:
    return [SPLITS.index(plan.split), plan.pieces]


def decide(
    call: Call,
    pieces: int,
    run: Callable[[Plan], object] | None = None,
    forced: Decision | None = None,
    note: str = "",
) -> Decision:
    """The plan ``call`` runs, the same on every rank (see the module docstring). ``run(plan)`` executes the
    call with a plan (for measuring); ``forced`` is a decision the op imposes (an opt-in path); ``note`` is
    added to the log line."""
    if forced is not None:
        return _remember(call, forced, note)
    if pieces > 0:
        return _remember(call, Decision(Plan("rows", pieces), "pieces= given"), note)
    if _override is not None and _override in call.candidates:
        return _remember(call, Decision(_override, "override", this_call_only=True), note)
    tune = mode()
    if tune == "off":
        return _remember(call, Decision(FIXED, f"fixed rule, {ENV_MODE}=off"), note)
    key = call.key
    with _lock:
        agreed = _agreed.get((call.group_name, key))
    if agreed is not None:  # the common case, once per call: no log (said when it was agreed), no exchange
        _last[call.op] = (key, agreed)
        return agreed
    if capturing(call.device):  # no collective, no timing: the model's plan is the same on every rank
        note = f"{note} {CAPTURE_NOTE}" if note else CAPTURE_NOTE
        return _remember(call, dataclasses.replace(_model(call), this_call_only=True), note)
    cached = _cached(call)
    local = _model(call) if cached is None else cached
    is_rank0 = _rank(call) == 0
    have_cached, *plan_code = _all_reduce(
        [int(cached is not None)] + (_encode(local.plan) if is_rank0 else [0, 0]), "sum", call
    )
    every_rank_cached = have_cached == call.shape.world
    if tune == "measure" and not every_rank_cached and run is not None:
        decision = measure(call, run)
        cache().store(
            key,
            {
                "split": decision.plan.split,
                "pieces": decision.plan.pieces,
                "ms": dict(decision.figures),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
        )
    else:  # rank 0's plan, from its cache or its model
        plan = Plan(SPLITS[plan_code[0]], plan_code[1])
        decision = local if plan == local.plan else Decision(plan, "rank 0's plan")
    with _lock:
        _agreed[call.group_name, key] = decision
    return _remember(call, decision, note)


# op name ("all_gather_matmul") -> its planned run: the op's arguments in schema order -> (result, remembered(...)).
_planned_runs: dict[str, Callable] = {}


def planned_run(op_name: str):
    """Registers the decorated function as ``op_name``'s planned run: what the op's C++ kernel calls on a key's
    first call (:func:`run_first_call`). It checks the arguments, plans the call (:func:`decide`), runs it, and returns
    the result with :func:`remembered`."""

    def register(run: Callable) -> Callable:
        _planned_runs[op_name] = run
        return run

    return register


def run_planned(call: Call, run: Callable[[Plan], object], decision: Decision):
    """A planned run's result: ``run(decision.plan)`` and what the op's C++ kernel remembers of it."""
    return run(decision.plan), remembered(call, decision)


def run_unplanned(run: Callable[[Plan], object]):
    """A planned run's result where nothing is planned (a group of one, an empty operand): the fixed schedule."""
    return run(FIXED), remembered(None, Decision(FIXED, "nothing to plan"))


def run_first_call(op_name: str, args: tuple):
    """The fused ops' C++ kernels' planner (``fastmesh._C.set_planner``): the planned run of ``op_name``."""
    return _planned_runs[op_name](*args)


def connect_kernels() -> None:
    """Registers :func:`run_first_call` with the ops' C++ kernels; where the extension cannot be used, registers
    kernels that raise its :class:`fastmesh.ExtensionError` instead (the ops' schemas and fake impls exist without
    it)."""
    error = _cpp_lib.load_error()
    if error is None:
        ext = _cpp_lib.load()
        ext.set_planner(run_first_call)
        settings.on_reload(lambda: (ext.reload_settings(), ext.forget_plans()))
        return

    def unavailable(*args, **kwargs):
        raise _cpp_lib.load_error()

    from fastmesh.ops._library import library

    for op_name in _planned_runs:
        for device in ("CPU", "CUDA"):
            library.impl(op_name, unavailable, device)


def _rank(call: Call) -> int:
    return _resolve_process_group(call.group_name).rank()


def _remember(call: Call, decision: Decision, note: str = "") -> Decision:
    """Records ``decision`` as ``call.op``'s latest and logs it, once per key and decision."""
    key = call.key
    _last[call.op] = (key, decision)
    _log.log_once(
        logger,
        logging.INFO,
        (_LOG_KEY, key, decision),
        "%s [%s]: plan %s%s",
        call.op,
        key,
        _Described(decision),
        f" {note}" if note else "",
    )
    return decision


class _Described:
    """``decision.describe()`` when a log record is formatted: not on every call that logs nothing."""

    __slots__ = ("decision",)

    def __init__(self, decision: Decision):
        self.decision = decision

    def __str__(self) -> str:
        return self.decision.describe()


def has_static_shape(*tensors) -> bool:
    """Every size of every tensor is a plain int: a shape fixed at compile time (None is not a tensor)."""
    return all(t is not None and all(isinstance(size, int) for size in t.shape) for t in tensors)


def unfused_offline(call: Call) -> Decision | None:
    """The offline decision (:func:`decide_offline`) when it is to run ``call`` unfused, else None. The compile
    pass and inductor's decompositions ask this same question."""
    if call.shape.world == 1:
        return None
    decision = decide_offline(call)
    return decision if decision.plan == UNFUSED else None


def decide_offline(call: Call) -> Decision:
    """The plan without talking to the other ranks (for the compile pass): this rank's cached plan, else the
    model's. Ranks agree as long as they see the same cache file."""
    if mode() == "off":
        return Decision(FIXED, f"fixed rule, {ENV_MODE}=off")
    return _cached(call) or _model(call)

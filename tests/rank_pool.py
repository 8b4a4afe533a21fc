"""Pools of rank processes for multi-rank tests, reused across the whole pytest run.

Starting a rank costs seconds (importing torch), so each world size gets one pool of
processes, started on first use and kept until the session ends. Every rank of a pool
runs the same function, SPMD style, inside an initialized default process group::

    @on_ranks(2, 4)                      # parametrized: world_size=2 and world_size=4
    def test_all_reduce():
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)
        assert t.item() == sum(range(dist.get_world_size()))

    results = get_pool(2).run(some_module_level_fn, {"n": 3}, timeout=30)  # one value per rank

Ranks import the function by module and qualified name, so it must be defined at module
level; arguments and return values are pickled. The default group is gloo on CPU (CUDA
hidden from the ranks), or ``cpu:gloo,cuda:nccl`` with one GPU per rank when there are
enough GPUs or ``FASTMESH_TEST_BACKEND=nccl``; ``FASTMESH_TEST_BACKEND=gloo`` forces CPU.
Tests must not destroy the default group.

A run returns only if every rank returned. Otherwise it raises :class:`RankFailure` with each
rank's status, traceback and output; :class:`RankTimeout` when the run outlives its timeout.
Whenever a rank may be left stuck (a timeout, a dead rank, or ranks still busy a grace period
after another failed, e.g. waiting in a collective), the pool is killed and restarts on next
use. A rank's stdout and stderr go to a per-rank log: echoed to this process's stdout after a
successful run (so pytest shows it with a failing test), quoted in the error otherwise.
"""

import ast
import atexit
import dataclasses
import datetime
import faulthandler
import functools
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import pathlib
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from _pytest.assertion.rewrite import rewrite_asserts

DEFAULT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0
# Other ranks get this long to report after one fails before the pool is presumed stuck.
GRACE_S = 3.0
# A collective that outlives this raises in the rank, long before anyone kills it.
PG_TIMEOUT = datetime.timedelta(seconds=60)
OUTPUT_TAIL_LINES = 100
# The folder holding the fastmesh this process imports (the checkout, or site-packages for an installed package):
# tests that start fresh processes put it first on their path, so they run the same fastmesh.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(importlib.util.find_spec("fastmesh").origin))

_STARTUP_TASK = 0


class RankFailure(Exception):
    """A pool run in which some rank raised, died, or did not finish."""


class RankTimeout(RankFailure):
    """A pool run that did not finish on every rank within its timeout."""


@dataclasses.dataclass(frozen=True)
class _Outcome:
    ok: bool
    payload: object  # the pickled return value if ok, else a description of the failure


class RankPool:
    """``world_size`` rank processes sharing a default process group, started on first use."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs = []
        self._task_queues = []
        self._results = None
        self._log_dir = None
        self._last_task = _STARTUP_TASK

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank (empty while the pool is not started)."""
        return [proc.pid for proc in self._procs]

    def run(self, fn, kwargs: dict | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> list:
        """Call ``fn(**kwargs)`` on every rank; return the return values, by rank.

        Raises :class:`RankFailure` (:class:`RankTimeout` after ``timeout`` seconds) unless
        every rank returned.
        """
        module, qualname, path, rewrite = _importable_name(fn)
        kwargs_bytes = pickle.dumps(kwargs or {})
        if not self._procs:
            self._start()
        self._last_task += 1
        for tasks in self._task_queues:
            tasks.put((self._last_task, list(sys.path), module, path, rewrite, qualname, kwargs_bytes))
        outcomes = self._await(f"{module}.{qualname}", self._last_task, timeout)
        return [pickle.loads(outcomes[rank].payload) for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks; the next :meth:`run` starts new ones."""
        for tasks in self._task_queues:
            tasks.put(None)
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _start(self) -> None:
        backend = _test_backend(self.world_size)
        context = multiprocessing.get_context("spawn")
        try:
            self._log_dir = tempfile.mkdtemp(prefix=f"fastmesh-ranks{self.world_size}-")
            self._results = context.Queue()
            self._task_queues = [context.Queue() for _ in range(self.world_size)]
            for rank in range(self.world_size):
                config = _WorkerConfig(rank, self.world_size, backend, self._log_dir, os.getpid())
                proc = context.Process(
                    target=_worker_main,
                    args=(config, self._task_queues[rank], self._results),
                    name=f"fastmesh-rank{rank}",
                )
                proc.start()
                self._procs.append(proc)
        except BaseException:
            self._kill()
            raise
        self._await(f"starting a pool of {self.world_size} ranks ({backend})", _STARTUP_TASK, START_TIMEOUT_S)

    def _await(self, what: str, task_id: int, timeout: float) -> dict[int, _Outcome]:
        """Return every rank's outcome of ``task_id`` if all succeeded; raise otherwise."""
        outcomes = self._collect(task_id, timeout)
        stuck = [rank for rank in range(self.world_size) if rank not in outcomes]
        self._dump_stacks(stuck)
        outputs = self._read_outputs()
        if not stuck and all(outcome.ok for outcome in outcomes.values()):
            _echo(outputs)
            return outcomes
        if stuck or task_id == _STARTUP_TASK or not all(proc.is_alive() for proc in self._procs):
            self._kill()
        raise _failure(what, self.world_size, outcomes, outputs, timeout)

    def _collect(self, task_id: int, timeout: float) -> dict[int, _Outcome]:
        """Gather the ranks' outcomes of ``task_id`` until all report, the timeout passes, or
        the grace period after the first failure ends."""
        outcomes = {}
        limit = time.monotonic() + timeout
        failed = False
        while len(outcomes) < self.world_size and time.monotonic() < limit:
            self._receive(task_id, outcomes)
            if not failed and any(not outcome.ok for outcome in outcomes.values()):
                failed = True
                limit = min(limit, time.monotonic() + GRACE_S)
        return outcomes

    def _receive(self, task_id: int, outcomes: dict[int, _Outcome]) -> None:
        # Exits are read before the queue: a rank's reports are all queued by the time it has
        # exited, so a rank that exited and still has no outcome after the drain died silently.
        exitcodes = {rank: proc.exitcode for rank, proc in enumerate(self._procs) if proc.exitcode is not None}
        wait_s = 0.1
        while True:
            try:
                reported_task, rank, ok, payload = self._results.get(timeout=wait_s)
            except queue.Empty:
                break
            if reported_task == task_id:
                outcomes[rank] = _Outcome(ok, payload)
            wait_s = 0
        for rank, code in exitcodes.items():
            outcomes.setdefault(rank, _Outcome(False, f"its process exited with {_describe_exit(code)}"))

    def _dump_stacks(self, ranks: list[int]) -> None:
        alive = [self._procs[rank] for rank in ranks if self._procs[rank].is_alive()]
        for proc in alive:
            os.kill(proc.pid, signal.SIGUSR1)
        if alive:
            time.sleep(0.5)  # faulthandler writes from its signal handler; give it a moment

    def _read_outputs(self) -> dict[int, str]:
        outputs = {}
        for rank in range(self.world_size):
            try:
                with open(_log_path(self._log_dir, rank), errors="replace") as log:
                    outputs[rank] = log.read()
            except FileNotFoundError:
                outputs[rank] = ""
        return outputs

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.exitcode is None:
                try:
                    # Each rank leads its own process group, so this also ends anything it started.
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # killed before it made its group
                    proc.kill()
            proc.join()
        for q in [*self._task_queues, self._results]:
            if q is not None:
                q.close()
                q.cancel_join_thread()
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        self._procs, self._task_queues, self._results, self._log_dir = [], [], None, None


_pools: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """The session's pool of ``world_size`` ranks (started on its first run)."""
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size)
    return _pools[world_size]


def close_pools() -> None:
    """Stop every pool's ranks."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()


# multiprocessing joins live non-daemon children at exit; stop the ranks first so it never waits.
atexit.register(close_pools)


def on_ranks(*world_sizes: int, timeout: float = DEFAULT_TIMEOUT_S):
    """Run the decorated test on every rank of a pool, once per world size.

    The test gains a ``world_size`` parameter (parametrized over ``world_sizes``; the test
    receives it too if it declares it). Its other arguments (parametrize values, fixtures)
    are pickled to the ranks.

    Args:
        *world_sizes (int): the pool sizes to run the test on.
        timeout (float): seconds the test may run on the ranks before it fails and the
            pool is killed.
    """
    if not world_sizes:
        raise ValueError("on_ranks() needs at least one world size, e.g. on_ranks(2)")

    def decorate(fn):
        params = inspect.signature(fn).parameters
        takes_world_size = "world_size" in params

        @functools.wraps(fn)
        def test(world_size, **kwargs):
            if takes_world_size:
                kwargs["world_size"] = world_size
            get_pool(world_size).run(fn, kwargs, timeout=timeout)

        world_size_param = inspect.Parameter("world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        test.__signature__ = inspect.Signature(
            [world_size_param, *(p for name, p in params.items() if name != "world_size")]
        )
        test._rank_fn = fn
        return pytest.mark.parametrize("world_size", world_sizes, ids=lambda n: f"{n}ranks")(test)

    return decorate


def _importable_name(fn) -> tuple[str, str, str | None, bool]:
    """Return ``fn``'s module name and qualified name, the module's file (if any), and whether
    pytest rewrote the module's asserts."""
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__} cannot run on ranks: they import it by name, so define it at module level")
    module = sys.modules.get(fn.__module__)
    return fn.__module__, fn.__qualname__, getattr(module, "__file__", None), "@pytest_ar" in vars(module or {})


def _test_backend(world_size: int) -> str:
    requested = os.environ.get("FASTMESH_TEST_BACKEND")
    gpus = torch.cuda.device_count()
    if requested is None:
        requested = "nccl" if gpus >= world_size else "gloo"
    if requested == "gloo":
        return "gloo"
    if requested != "nccl":
        raise ValueError(f"FASTMESH_TEST_BACKEND={requested!r}: expected 'gloo' or 'nccl'")
    if gpus < world_size:
        raise RuntimeError(f"FASTMESH_TEST_BACKEND=nccl needs a GPU per rank: {world_size} ranks, {gpus} GPUs")
    return "cpu:gloo,cuda:nccl"


def _describe_exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def _echo(outputs: dict[int, str]) -> None:
    for rank, text in outputs.items():
        if text:
            sys.stdout.write(f"----- rank {rank} output -----\n{text}")


def _failure(
    what: str, world_size: int, outcomes: dict[int, _Outcome], outputs: dict[int, str], timeout: float
) -> RankFailure:
    stuck = [rank for rank in range(world_size) if rank not in outcomes]
    failed = [rank for rank, outcome in sorted(outcomes.items()) if not outcome.ok]
    if stuck and not failed:
        headline = (
            f"{what} timed out after {timeout:g} s on rank(s) {stuck} of {world_size}; "
            "the pool was killed and restarts on next use"
        )
    else:
        headline = f"{what} failed on rank(s) {failed} of {world_size}"
        if stuck:
            headline += (
                f"; rank(s) {stuck} were still busy {GRACE_S:g} s later, so the pool was killed "
                "and restarts on next use"
            )
    sections = [headline]
    for rank in range(world_size):
        outcome = outcomes.get(rank)
        if outcome is None:
            status = "did not finish (its Python stack at the kill is in its output)"
        else:
            status = "ok" if outcome.ok else f"failed\n{outcome.payload}"
        sections.append(f"===== rank {rank}: {status}")
        if outputs.get(rank):
            sections.append(f"----- rank {rank} output -----\n{_tail(outputs[rank])}")
    return (RankTimeout if stuck and not failed else RankFailure)("\n".join(sections))


def _tail(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= OUTPUT_TAIL_LINES:
        return text
    return f"[{len(lines) - OUTPUT_TAIL_LINES} lines omitted]\n" + "\n".join(lines[-OUTPUT_TAIL_LINES:])


def _log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


@dataclasses.dataclass(frozen=True)
class _WorkerConfig:
    rank: int
    world_size: int
    backend: str
    log_dir: str
    parent_pid: int


def _worker_main(config: _WorkerConfig, tasks, results) -> None:
    # Killing the pool kills this process group, so whatever a test starts in a rank dies with it.
    os.setpgrp()
    _redirect_output(_log_path(config.log_dir, config.rank))
    try:
        _init_rank(config)
    except BaseException:
        results.put((_STARTUP_TASK, config.rank, False, traceback.format_exc()))
        return
    results.put((_STARTUP_TASK, config.rank, True, None))
    while (task := _next_task(tasks, config.parent_pid)) is not None:
        task_id, sys_path, module, path, rewrite, qualname, kwargs_bytes = task
        sys.path[:] = sys_path
        os.ftruncate(1, 0)
        ok, payload = _run_task(module, path, rewrite, qualname, kwargs_bytes)
        sys.stdout.flush()
        sys.stderr.flush()
        results.put((task_id, config.rank, ok, payload))


def _redirect_output(path: str) -> None:
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _init_rank(config: _WorkerConfig) -> None:
    os.environ.update(
        RANK=str(config.rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_RANK=str(config.rank),
        LOCAL_WORLD_SIZE=str(config.world_size),
    )
    # Ranks share the machine's cores; more threads per rank only oversubscribe them (inductor's compile workers:
    # one per process, tests/conftest.py).
    torch.set_num_threads(1)
    if config.backend == "gloo":
        # A CPU pool: with CUDA hidden, code under test picks the CPU on any machine, as in CI.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        torch.cuda.set_device(config.rank)
    # A file store in the pool's own fresh directory: no port, so no collision with other runs.
    dist.init_process_group(
        config.backend,
        init_method=f"file://{config.log_dir}/rendezvous",
        rank=config.rank,
        world_size=config.world_size,
        timeout=PG_TIMEOUT,
    )


def _next_task(tasks, parent_pid: int):
    while True:
        try:
            return tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # orphaned: the test run is gone
                return None


def _run_task(module: str, path: str | None, rewrite: bool, qualname: str, kwargs_bytes: bytes) -> tuple[bool, object]:
    try:
        fn = _import(module, path, rewrite)
        for attr in qualname.split("."):
            fn = getattr(fn, attr)
        fn = getattr(fn, "_rank_fn", fn)
        _forget_dtensor_sharding_cache()
        return True, pickle.dumps(fn(**pickle.loads(kwargs_bytes)))
    except BaseException:
        return False, traceback.format_exc()


def _forget_dtensor_sharding_cache() -> None:
    """Give each test a DTensor sharding cache of its own, as a fresh process would have.

    Tests build their own meshes, and the sharding cache matches meshes by value, so a test can be handed output
    specs that hold an earlier test's (equal) mesh. torch.compile (torch 2.14) tracks meshes as graph inputs by
    identity; after test_parallel.py's bf16 tests, such a spec made inductor's partitioner fail in
    test_compile_fusion.py ("Node tangents_2 was invalid, but is output"). The cache is C++ from torch 2.13."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def _import(module: str, path: str | None, rewrite: bool):
    if module in sys.modules:
        return sys.modules[module]
    if not rewrite:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError:
            if path is None:
                raise
    # From the file: pytest's importlib import mode names test modules after paths that need
    # not be on sys.path, and a plain import would not rewrite asserts as pytest did.
    spec = importlib.util.spec_from_file_location(module, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    try:
        if rewrite:
            source = pathlib.Path(path).read_bytes()
            tree = ast.parse(source, filename=path)
            rewrite_asserts(tree, source, path)
            exec(compile(tree, path, "exec"), vars(loaded))
        else:
            spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[module]
        raise
    return loaded

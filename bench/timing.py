"""Timing shared by the benchmark families: interleaved rounds, CUDA events, the slowest rank, spreads."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class WallClock:
    """Host clock, for CPU work (which has finished when the call returns)."""

    def start(self):
        return time.perf_counter()

    def stop(self, started) -> Callable[[], float]:
        elapsed = time.perf_counter() - started
        return lambda: elapsed


class CudaEventClock:
    """CUDA events around each call on the current stream: device time, without host launch gaps between calls.
    The events are read after the round, so no synchronization sits between the contenders of a round."""

    def start(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started) -> Callable[[], float]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()

        def seconds():
            end.synchronize()
            return started.elapsed_time(end) / 1e3

        return seconds


def clock_for(device: torch.device):
    return CudaEventClock() if device.type == "cuda" else WallClock()


def time_interleaved(
    candidates: dict[str, Callable],
    repeats: int,
    clock=None,
    before_each: Callable[[], None] = lambda: None,
    settle: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, run round-robin so that drifts hit every candidate alike.

    ``before_each()`` runs before each call, outside its timing (a barrier for ranks). With ``settle``, each timed
    call directly follows an untimed call of the same candidate, so that no candidate pays for what the previous
    one left behind: measured on CPU, a read-only reduction over 64 MB ran 2x slower right after an op that wrote
    a 64 MB temporary (its dirty lines being written back) than after itself.
    """
    clock = clock or WallClock()
    timings = {name: [] for name in candidates}
    for _ in range(repeats):
        pending = []
        for name, fn in candidates.items():
            before_each()
            if settle:
                fn()
            started = clock.start()
            fn()
            pending.append((name, clock.stop(started)))
        for name, seconds in pending:
            timings[name].append(seconds())
    return timings


def time_slowest_rank(
    candidates: dict[str, Callable], group, warmup: int, repeats: int, clock=None
) -> dict[str, list[float]]:
    """Interleaved timings on every rank of ``group`` after ``warmup`` untimed rounds: {name: [seconds of the
    slowest rank, per round]}.

    Every call starts together on all ranks (a barrier) and counts as long as its slowest rank: the per-rank
    lists are all-reduced with MAX once per candidate after all rounds, so that no extra collective runs between
    timed calls.
    """
    import torch.distributed as dist

    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    time_interleaved(candidates, warmup, clock, barrier)
    timings = time_interleaved(candidates, repeats, clock, barrier)
    slowest = {}
    for name, samples in timings.items():
        t = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        slowest[name] = t.tolist()
    return slowest


def spread(samples: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of a list of samples."""
    if len(samples) < 2:
        raise ValueError(f"a spread needs at least 2 samples, got {len(samples)}")
    # "inclusive": quartiles within the samples (the default extrapolates beyond them for few samples)
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return {"median": statistics.median(samples), "q1": q1, "q3": q3, "min": min(samples), "max": max(samples)}

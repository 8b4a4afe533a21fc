"""Exposed communication in a ``torch.profiler`` trace, for the block benchmark and the training example.

"Exposed" communication is the time a rank's main thread is blocked in communication: inside a collective or
point-to-point call, or waiting for one to finish. Communication that runs on gloo's own threads while the main
thread computes is overlapped, not exposed, and is not counted. The events that mark blocking communication on
the main thread are:

* torch's: the c10d ops (``c10d::allgather_into_tensor_coalesced_``, ``c10d::send`` ...) and the functional
  collectives with their waits (``_c10d_functional::all_gather_into_tensor``,
  ``_c10d_functional::wait_tensor`` ...). Under the native TP plan these are all of it; under fastmesh's plan
  the ones left are DTensor's (the embedding's reduce-scatter, the optimizer's all-reduce of partial norm-weight
  gradients) and the point-to-point calls the fused ops post;
* fastmesh's fused pipelines: ``fastmesh::wait_transfer`` (waiting for a piece's transfer) and
  ``fastmesh::check_shapes`` (the cross-rank shape check, whose all-gather also waits for the slower rank).

gloo's own ``gloo:*`` events are left out: they span a transfer from its start to its completion, mostly on
gloo's threads (and, for send/recv, on the main thread while it computes), so they are not blocking time.
Events nest (``fastmesh::check_shapes`` holds a ``c10d::_allgather_base_``; a functional collective holds its
c10d op), so the blocked time is the length of the union of their intervals, never the sum of durations.
"""

from __future__ import annotations

import os

import torch

__all__ = ["STEP_EVENT", "cpu_profile", "is_blocking_comm", "step_comm_times"]

STEP_EVENT = "step"  # wrap each profiled step in torch.profiler.record_function(STEP_EVENT)

_BLOCKING_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_BLOCKING_NAMES = ("fastmesh::wait_transfer", "fastmesh::check_shapes")


def cpu_profile() -> torch.profiler.profile:
    """A profiler of CPU events. On every start and stop kineto logs to stderr (at its USDT level, 5) and, on a
    machine without a GPU, an error from its CUDA probe (level 4); neither affects the trace, so unless the
    user asked for a level, its log is silenced (kineto reads the level when it first profiles)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def is_blocking_comm(name: str) -> bool:
    return name.startswith(_BLOCKING_PREFIXES) or name in _BLOCKING_NAMES


def step_comm_times(prof: torch.profiler.profile, step_event: str = STEP_EVENT) -> list[tuple[float, float]]:
    """(duration, exposed communication), in seconds, of each ``step_event`` range in the trace, in order.

    A step's exposed communication is the union of the blocking-communication events (see the module
    docstring) that lie inside the step's time range on the step's own thread (the main thread; on CPU the
    autograd engine runs the backward there too)."""
    events = list(prof.events())
    steps = sorted((e for e in events if e.name == step_event), key=lambda e: e.time_range.start)
    comm = sorted(((e.thread, e.time_range.start, e.time_range.end) for e in events if is_blocking_comm(e.name)),
                  key=lambda t: t[1])
    times = []
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        inside = [(s, e) for thread, s, e in comm if thread == step.thread and start <= s and e <= end]
        times.append(((end - start) * 1e-6, _union_length(inside) * 1e-6))
    return times


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals sorted by start (nested or overlapping ones counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total

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
c10d op), so the blocked time is the length of the union of their intervals (the outermost events' durations),
never the sum of all durations.
"""

from __future__ import annotations

import dataclasses
import os

import torch

__all__ = ["STEP_EVENT", "StepComm", "cpu_profile", "is_blocking_comm", "step_comm_times"]

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


@dataclasses.dataclass
class StepComm:
    """One profiled step: its duration and its exposed communication (seconds), in total and by the name of the
    outermost blocking event (``fastmesh::wait_transfer``, ``_c10d_functional::wait_tensor``, ``c10d::send`` ...)."""

    duration: float
    exposed: float
    by_name: dict[str, float]


def step_comm_times(prof: torch.profiler.profile, step_event: str = STEP_EVENT) -> list[StepComm]:
    """The duration and exposed communication of each ``step_event`` range in the trace, in order.

    A step's exposed communication is the union of the blocking-communication events (see the module
    docstring) that lie inside the step's time range on the step's own thread (the main thread; on CPU the
    autograd engine runs the backward there too). Events on one thread nest, so the union is the sum of the
    outermost ones, and each is attributed to its own name."""
    events = list(prof.events())
    steps = sorted((e for e in events if e.name == step_event), key=lambda e: e.time_range.start)
    # Outer events first where two start together, so that a nested one finds the outer one's reach.
    comm = sorted((e.time_range.start, -e.time_range.end, e.thread, e.name) for e in events if is_blocking_comm(e.name))
    result = []
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        by_name, reach = {}, float("-inf")
        for begin, neg_finish, thread, name in comm:
            finish = -neg_finish
            if thread != step.thread or begin < start or finish > end or finish <= reach:
                continue  # another thread, outside the step, or nested in an event already counted
            by_name[name] = by_name.get(name, 0.0) + (finish - max(begin, reach)) * 1e-6
            reach = finish
        result.append(StepComm((end - start) * 1e-6, sum(by_name.values()), by_name))
    return result

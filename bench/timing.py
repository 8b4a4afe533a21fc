"""Timing helpers shared by the microbenchmarks: interleaved runs, medians with spread."""

import statistics
import time


def time_interleaved(candidates, repeats, sync, sync_after=None):
    """Seconds per call of each candidate, run round-robin so that drifts hit every candidate alike.

    ``sync()`` runs before each call starts and ``sync_after()`` (default: ``sync``) before its clock stops.
    """
    sync_after = sync if sync_after is None else sync_after
    timings = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            sync()
            start = time.perf_counter()
            fn()
            sync_after()
            timings[name].append(time.perf_counter() - start)
    return timings


def median_iqr(samples):
    """(median, interquartile range) of a list of timings."""
    quartiles = statistics.quantiles(samples, n=4)
    return statistics.median(samples), quartiles[2] - quartiles[0]


def time_interleaved_ranks(candidates, repeats, barrier, slowest):
    """Seconds per call of each candidate on a group of ranks, run round-robin like time_interleaved.

    Every call starts together on all ranks (``barrier()``) and counts as long as its slowest rank:
    ``slowest(samples)`` maps this rank's list of seconds to the element-wise max over ranks (e.g. one
    all-reduce MAX), called once per candidate after all repetitions so that no extra collective runs
    between timed calls. For CUDA work, make each candidate synchronize its stream before returning.
    """
    if repeats <= 0:
        return {name: [] for name in candidates}
    timings = time_interleaved(candidates, repeats, barrier, sync_after=lambda: None)
    return {name: slowest(samples) for name, samples in timings.items()}

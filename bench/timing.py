"""Timing helpers shared by the microbenchmarks: interleaved runs, medians with spread."""

import statistics
import time


def time_interleaved(candidates, repeats, sync):
    """Seconds per call of each candidate, run round-robin so that drifts hit every candidate alike."""
    timings = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
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
    timings = {name: [] for name in candidates}
    if repeats <= 0:
        return timings
    for _ in range(repeats):
        for name, fn in candidates.items():
            barrier()
            start = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - start)
    return {name: slowest(samples) for name, samples in timings.items()}

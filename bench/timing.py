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

"""Starting the benchmark's ranks: torch's elastic launcher on one machine, or the world torchrun gives.

Threads: on CPU the ranks share the machine's cores, and a rank's transfers are work for its cores too, so
each rank gets ``cores // ranks`` intra-op threads (at least one); more ranks than cores oversubscribe the
machine, and the runner says so, because its figures then describe contention rather than the ops.

Allocation: page faults on freshly allocated outputs dominate CPU timings (a fresh 64 MB buffer costs more than
the copy into it), and the ops allocate their outputs where the baselines may write into preallocated ones.
:func:`keep_freed_memory` makes glibc's malloc keep and reuse freed blocks instead of returning them to the
system, for every contender alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import gc
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Collectives of a failed or stuck rank time out after this, rather than leaving the others blocked forever.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=15)

T = TypeVar("T")


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds (1 GiB, 2 GiB) so that freed buffers are recycled without page
    faults. Returns what was done, for the run's record."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        done = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError, TypeError):
        done = False
    if done:
        return "glibc mallopt: mmap threshold 1 GiB, trim threshold 2 GiB (freed buffers are reused)"
    return f"allocator left as is (no glibc mallopt in {name!r}): CPU timings include page faults of fresh outputs"


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, local world size) when started by torchrun (or another torch elastic launcher)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return None


def threads_per_rank(local_ranks: int, cores: int, requested: int | None) -> tuple[int, str | None]:
    """Intra-op threads per rank and, when ranks x threads exceed the cores, a warning saying so."""
    threads = requested or max(1, cores // local_ranks)
    if local_ranks * threads > cores:
        return threads, (
            f"{local_ranks} ranks x {threads} thread(s) > {cores} cores: ranks share cores, so "
            "communication and computation cannot overlap fully and the figures measure contention"
        )
    return threads, None


def launch(world: int, threads: int, entry: Callable[..., Any], *args) -> Any:
    """Runs ``entry(threads, *args)`` on ``world`` local ranks started by torch's elastic launcher; returns rank
    0's return value. ``entry`` must be a module-level function (ranks are spawned and receive it pickled). If a
    rank fails, the launcher stops the others and this raises its ChildFailedError (with each rank's traceback)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"fastmesh-bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone does
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    # Set before the ranks start so that their OpenMP pools start at this size (torch.set_num_threads alone
    # would leave inter-op pools at the core count).
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return elastic_launch(config, entry)(threads, *args)[0]


def on_world_mesh(device_type: str, work: Callable[[Any], T]) -> T:
    """``work(mesh)`` on a 1-D ``tp`` mesh over the world in the environment (this launcher's or torchrun's), then
    the process groups destroyed, the mesh first.

    The order matters: torch's ``DeviceMesh`` keeps its process groups alive, so with a mesh left over
    ``destroy_process_group`` frees nothing, and the groups die at interpreter exit. A gloo worker thread still
    releasing the last collective's tensors then needs the GIL after finalization has begun, and the process
    aborts ("terminate called without an active exception"; 3 of 15 runs of the example under torchrun, 2 shared
    cores). Destroyed with no mesh left, a group joins its worker threads while Python is whole."""
    import torch
    import torch.distributed as dist

    import fastmesh

    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = fastmesh.init_mesh(tp=int(os.environ["WORLD_SIZE"]), device_type=device_type, timeout=COLLECTIVE_TIMEOUT)
    try:
        return work(mesh)
    finally:
        del mesh
        gc.collect()  # the meshes the work's reference cycles (modules, autograd graphs) still hold
        dist.destroy_process_group()

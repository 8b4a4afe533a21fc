"""What a benchmark result was measured on: machine, versions, git commit, command."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess

import torch

import fastmesh
from fastmesh import info


def cores() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """The commit of the fastmesh checkout being run (with "(dirty)" for uncommitted tracked changes), or why not."""
    source = os.path.dirname(os.path.dirname(os.path.abspath(fastmesh.__file__)))

    def git(*arguments):
        return subprocess.run(["git", "-C", source, *arguments], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
    if head.returncode != 0:
        return "unknown (fastmesh is not run from a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + (" (dirty)" if dirty else "")


def describe(command: list[str]) -> dict:
    """The machine, versions, commit, command and time of a run."""
    memory = _memory_gib()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_model(),
            "cores": cores(),
            "memory_gib": None if memory is None else round(memory, 1),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gpus": info.cuda_devices(),
            "platform": platform.platform(),
        },
        "versions": {
            "fastmesh": fastmesh.__version__,
            "torch": torch.__version__,
            "triton": _version("triton"),
            "torchao": _version("torchao"),
            "python": platform.python_version(),
        },
        "commit": git_commit(),
        "command": shlex.join(command),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def summary_lines(meta: dict) -> list[str]:
    m, v = meta["machine"], meta["versions"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in m["gpus"]) or "no GPU"
    memory = f"{m['memory_gib']} GiB" if m["memory_gib"] is not None else "memory unknown"
    others = ", ".join(f"{name} {v[name]}" for name in ("triton", "torchao") if v[name])
    return [
        f"machine: {m['host']}, {m['cpu']}, {m['cores']} cores, {memory}, {gpus}; torch CPU capability "
        f"{m['cpu_capability']}",
        f"versions: fastmesh {v['fastmesh']}, torch {v['torch']}{', ' + others if others else ''}, python "
        f"{v['python']}; commit {meta['commit']}",
        f"command: {meta['command']}  ({meta['date']})",
    ]

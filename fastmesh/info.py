"""``fastmesh info``: what was built, what the dispatcher holds, and whether this install is usable.

Everything reported is read from the running system (the dispatcher, torch, triton, the loaded
extension's compiled-in metadata), never from a hand-kept list. Exit code 0 means usable; otherwise
the problems are printed and the exit code is 1.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

import fastmesh
from fastmesh import _cpp_lib
from fastmesh.ops import plans
from fastmesh.ops._library import NAMESPACE
from fastmesh.version import TESTED_TORCH

_DISPATCH_KEY_LINE = re.compile(r"^(\w+)(?:\[alias\])?: registered at ")


def fastmesh_ops() -> list[str]:
    """Every ``torch.ops.fastmesh`` op the dispatcher knows, as ``fastmesh::name``."""
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith(f"{NAMESPACE}::"))


def kernel_dispatch_keys(op: str) -> list[str]:
    """Dispatch keys with a kernel registered for ``op`` (CPU, CUDA, Meta, and alias keys such as
    CompositeExplicitAutograd, which serve every backend)."""
    keys = [m.group(1) for line in torch._C._dispatch_dump(op).splitlines() if (m := _DISPATCH_KEY_LINE.match(line))]
    # The dump also has header lines ("debug: registered at ..."); keep real dispatch keys only.
    return [key for key in keys if key in torch._C.DispatchKey.__members__]


def _extension_report() -> dict[str, Any]:
    error = _cpp_lib.load_error()
    if error is not None:
        return {"loaded": False, "error": str(error), "build_info": None}
    return {"loaded": True, "error": None, "build_info": _cpp_lib.build_info()}


def cuda_devices() -> list[dict[str, Any]]:
    """Every visible CUDA device: index, name, compute capability, memory."""
    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
    return devices


def _cuda_report() -> dict[str, Any]:
    return {"torch_cuda_version": torch.version.cuda, "available": torch.cuda.is_available(), "devices": cuda_devices()}


def _distributed_report() -> dict[str, Any]:
    if not dist.is_available():
        return {"available": False, "backends": {}}
    probes = {
        "gloo": dist.is_gloo_available,
        "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available,
        "ucc": dist.is_ucc_available,
        "xccl": getattr(dist, "is_xccl_available", lambda: False),
    }
    return {"available": True, "backends": {name: bool(probe()) for name, probe in probes.items()}}


# rows, contraction, columns of the probe: under a millisecond in float32, tens where bf16 is emulated.
_MATMUL_PROBE = (64, 512, 512)
# A half-precision dtype whose matmul is within this factor of float32's counts as native: an emulated one is
# 50-80x slower (AVX2 without AVX512-BF16 / AMX), a native one as fast or faster.
_NATIVE_WITHIN = 4.0


@functools.cache
def cpu_matmul() -> dict[str, Any]:
    """This CPU's matmul rate per dtype on one thread (GFLOP/s, the best of 3 of a small product) and whether it
    multiplies bf16 / fp16 natively, as measured: torch's CPU capability alone does not say (AVX-512 without
    AVX512-BF16 emulates bf16)."""
    rows, inner, columns = _MATMUL_PROBE
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, columns).to(dtype)
            a @ b  # the first call allocates and picks the kernel
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            rates[str(dtype).removeprefix("torch.")] = 2 * rows * inner * columns / best / 1e9
    finally:
        torch.set_num_threads(threads)
    native = {name: rates[name] * _NATIVE_WITHIN >= rates["float32"] for name in ("bfloat16", "float16")}
    return {"capability": torch.backends.cpu.get_cpu_capability(), "gflops": rates, "native": native}


def half_precision_note(dtype_name: str) -> str | None:
    """What a reader of a CPU figure in ``dtype_name`` must know when this CPU emulates it, or None."""
    report = cpu_matmul()
    if report["native"].get(dtype_name, True):
        return None
    rates = report["gflops"]
    return (
        f"this CPU ({report['capability']}) has no native {dtype_name} matmul: {rates[dtype_name]:.1f} GFLOP/s on one "
        f"thread, {rates['float32'] / rates[dtype_name]:.0f}x slower than float32"
    )


def _symmetric_memory_report() -> dict[str, Any]:
    try:
        import torch.distributed._symmetric_memory
    except ImportError as error:
        return {"available": False, "reason": f"torch.distributed._symmetric_memory does not import: {error}"}
    if not torch.cuda.is_available():
        return {
            "available": False,
            "reason": "torch has symmetric memory, but it needs CUDA devices and none is visible",
        }
    return {"available": True, "reason": "torch.distributed._symmetric_memory imports and CUDA devices are visible"}


def _triton_report() -> dict[str, Any]:
    try:
        import triton
    except ImportError:
        return {"version": None, "target": None, "mode": "not installed"}
    try:
        target = triton.runtime.driver.active.get_current_target()
    except Exception as error:  # triton raises RuntimeError without a driver; older versions differ
        return {
            "version": triton.__version__,
            "target": None,
            "mode": f"interpreter only (TRITON_INTERPRET=1): {error}",
        }
    return {"version": triton.__version__, "target": f"{target.backend} {target.arch}", "mode": "compiles for the GPU"}


def _cuda_gather_report() -> dict[str, Any]:
    from fastmesh.ops import chunked_gather

    try:
        return {"path": chunked_gather.describe_cuda_path(), "error": None}
    except ValueError as error:
        return {"path": None, "error": str(error)}


def _tuning_report() -> dict[str, Any]:
    """How the fused ops choose their plans (``FASTMESH_TUNE``) and the plan cache they read."""
    try:
        mode, error = plans.mode(), None
    except ValueError as invalid:
        mode, error = None, str(invalid)
    cache = plans.cache()
    # The cache warns and counts as empty when it cannot parse its file; here that is worth a line, not a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = len(cache.entries())
        sections = len(cache.sections())
    return {
        "mode": mode,
        "env": os.environ.get(plans.ENV_MODE),
        "error": error,
        "cache": {
            "path": cache.path,
            "exists": os.path.exists(cache.path),
            "section": cache.section,
            "entries": entries,
            "sections": sections,
            "unreadable": str(caught[0].message) if caught else None,
        },
    }


def _problems(report: dict[str, Any]) -> list[str]:
    problems = []
    if report["cuda_all_gather_matmul"]["error"]:
        problems.append(report["cuda_all_gather_matmul"]["error"])
    if report["tuning"]["error"]:
        problems.append(report["tuning"]["error"])
    extension = report["extension"]
    if not extension["loaded"]:
        problems.append(extension["error"])
        return problems
    for op in report["ops"]:
        # "Computed" tables resolve alias keys: a CompositeExplicitAutograd kernel serves CPU and CUDA.
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op, "CPU"):
            problems.append(f"{op} has no CPU kernel")
        if extension["build_info"]["build_cuda"] and not torch._C._dispatch_has_computed_kernel_for_dispatch_key(
            op, "CUDA"
        ):
            problems.append(f"{op} has no CUDA kernel although the CUDA sources were built")
    if not report["ops"]:
        problems.append("no torch.ops.fastmesh op is registered")
    return problems


def collect() -> dict[str, Any]:
    """The whole report as a JSON-serializable dict (what ``fastmesh info --json`` prints)."""
    report: dict[str, Any] = {
        "fastmesh": fastmesh.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {
            "version": torch.__version__,
            "git_version": torch.version.git_version,
            "tested": _torch_release(torch.__version__) in TESTED_TORCH,
        },
        "extension": _extension_report(),
        "cuda": _cuda_report(),
        "cpu_matmul": cpu_matmul(),
        "distributed": _distributed_report(),
        "symmetric_memory": _symmetric_memory_report(),
        "triton": _triton_report(),
        "cuda_all_gather_matmul": _cuda_gather_report(),
        "tuning": _tuning_report(),
    }
    report["ops"] = {op: kernel_dispatch_keys(op) for op in fastmesh_ops()}
    report["problems"] = _problems(report)
    report["usable"] = not report["problems"]
    return report


def _torch_release(version: str) -> str:
    """``"2.14"`` of ``"2.14.1+cu130"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"fastmesh        {report['fastmesh']}",
        f"python          {report['python']} ({report['platform']})",
        f"torch           {report['torch']['version']} (git {report['torch']['git_version'][:12]}): "
        + ("tested" if report["torch"]["tested"] else f"not tested (fastmesh is tested on {', '.join(TESTED_TORCH)})"),
        f"triton          {report['triton']['version'] or 'not installed'}: {report['triton']['mode']}",
        "",
    ]
    extension = report["extension"]
    if extension["loaded"]:
        build = extension["build_info"]
        lines += [
            f"fastmesh._C     loaded ({build['mode']} build)",
            f"  built for     torch {build['torch_version']}, CUDA {build['torch_cuda_version']}, "
            f"python {build['python_version']}",
            f"  CUDA part     {build['reason']}",
            f"  arch list     {build['cuda_arch_list']}",
            f"  sources       {', '.join(build['sources'])}",
            f"  cxx flags     {' '.join(build['cxx_flags'])}",
            f"  nvcc flags    {' '.join(build['nvcc_flags']) or '-'}",
            f"  source digest {build['source_digest'][:16]}",
        ]
    else:
        lines.append(f"fastmesh._C     NOT LOADED: {extension['error']}")
    lines += ["", "ops (dispatch keys with a kernel):"]
    width = max((len(op) for op in report["ops"]), default=0)
    lines += [f"  {op:{width}s}  {', '.join(keys)}" for op, keys in report["ops"].items()] or ["  (none)"]
    cuda = report["cuda"]
    lines += [
        "",
        f"CUDA            torch built with {cuda['torch_cuda_version'] or 'no CUDA'}; "
        f"{len(cuda['devices'])} device(s) visible",
    ]
    lines += [
        f"  cuda:{d['index']}        {d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)" for d in cuda["devices"]
    ]
    matmul = report["cpu_matmul"]
    rates = ", ".join(
        f"{name} {rate:.1f}" + ("" if matmul["native"].get(name, True) else " (emulated)")
        for name, rate in matmul["gflops"].items()
    )
    lines.append(f"CPU matmul      {matmul['capability']}; GFLOP/s on one thread: {rates}")
    backends = report["distributed"]["backends"]
    lines.append("distributed     " + (", ".join(f"{n}={_yes_no(v)}" for n, v in backends.items()) or "unavailable"))
    symm = report["symmetric_memory"]
    lines.append(f"symmetric mem   {_yes_no(symm['available'])}: {symm['reason']}")
    gather = report["cuda_all_gather_matmul"]
    lines.append(f"CUDA all-gather {gather['path'] or 'unknown: ' + gather['error']}")
    lines += _tuning_lines(report["tuning"])
    lines.append("")
    if report["usable"]:
        lines.append("status          usable")
    else:
        lines.append("status          NOT USABLE")
        lines += [f"  - {problem}" for problem in report["problems"]]
    return "\n".join(lines)


def _tuning_lines(tuning: dict[str, Any]) -> list[str]:
    if tuning["error"]:
        mode = f"INVALID: {tuning['error']}"
    else:
        mode = f"{plans.ENV_MODE}={tuning['mode']}" + ("" if tuning["env"] else " (the default)")
    cache = tuning["cache"]
    if cache["unreadable"]:
        state = cache["unreadable"]
    elif cache["exists"]:
        state = (
            f"{cache['entries']} plan(s) for this machine (section {cache['section']}), {cache['sections']} section(s)"
        )
    else:
        state = "not written yet (fastmesh tune, or FASTMESH_TUNE=measure, writes it)"
    return [f"plan choice     {mode}", f"plan cache      {cache['path']}: {state}"]


def main(as_json: bool = False) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0 if report["usable"] else 1


if __name__ == "__main__":
    sys.exit(main())

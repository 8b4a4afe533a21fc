"""How ``fastmesh._C`` is built: one description shared by ``setup.py`` and the JIT path.

This module is loaded by file path from ``setup.py`` (before the package is importable), so it
imports nothing from ``fastmesh`` and does not import ``torch.utils.cpp_extension`` at module level:
that module reads ``CUDA_HOME`` once, at import, and :func:`configure_cuda_environment` must run
first.

Environment variables honoured:

======================== ====================================================================
``FASTMESH_BUILD_CUDA``  ``1`` forces the CUDA sources (error if impossible), ``0`` skips them;
                         unset: built when torch is a CUDA build and nvcc is found.
``TORCH_CUDA_ARCH_LIST`` GPU architectures; defaults to ``8.0;9.0a`` when no GPU is visible.
``CUDA_HOME``            CUDA toolkit root; found from ``nvcc`` when unset.
``MAX_JOBS``             parallel compile jobs (ninja), as in ``torch.utils.cpp_extension``.
======================== ====================================================================
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import site
import sys
from dataclasses import asdict, dataclass, field

DEFAULT_CUDA_ARCH_LIST = "8.0;9.0a"

# Prefix of the metadata string compiled into the extension; lets the loader find and check the
# metadata in the binary before loading it (loading a stale binary can abort the process when its
# kernels no longer match the schemas).
BUILD_INFO_MARKER = "FASTMESH_BUILD_INFO_V1"

# -fopenmp: ATen's at::parallel_for runs serially in code compiled without it (its inline
# implementation keys on _OPENMP); linking it shares torch's OpenMP runtime, so torch.set_num_threads
# governs fastmesh's kernels too. -g1 overrides the -g of Python's own CFLAGS, which setuptools passes:
# full debug info of torch's templates took a third of each source's compile time (18.0 s against 11.5 s
# for fused/matmul_reduce_scatter.cpp, objects of 5.4 MB against 0.9 MB); line tables keep backtraces
# that name the function, file and line.
CXX_FLAGS = ["-O3", "-g1", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-lineinfo"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_root() -> str:
    """The repository root that holds ``csrc/`` when running from a source checkout."""
    return _ROOT


def csrc_dir(root: str | None = None) -> str:
    return os.path.join(root or _ROOT, "csrc")


def _relative_sources(root: str, pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(csrc_dir(root), pattern), recursive=True))


def cpp_sources(root: str | None = None) -> list[str]:
    """C++ sources, relative to ``root``: everything under ``csrc/`` except ``csrc/cuda``."""
    root = root or _ROOT
    return [s for s in _relative_sources(root, "**/*.cpp") if not s.startswith(os.path.join("csrc", "cuda") + os.sep)]


def cuda_sources(root: str | None = None) -> list[str]:
    root = root or _ROOT
    return _relative_sources(root, os.path.join("cuda", "**", "*.cu")) + _relative_sources(
        root, os.path.join("cuda", "**", "*.cpp")
    )


def source_digest(root: str | None = None) -> str:
    """SHA-256 over every file under ``csrc/`` (path and content): what a built ``_C`` is compared to."""
    root = root or _ROOT
    digest = hashlib.sha256()
    for rel in _relative_sources(root, "**/*"):
        path = os.path.join(root, rel)
        if os.path.isfile(path) and not rel.endswith((".pyc", ".o")):
            digest.update(rel.replace(os.sep, "/").encode())
            digest.update(b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _has_toolkit(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
        os.path.join(root, "include", "cuda_runtime.h")
    )


def find_cuda_home() -> str | None:
    """The CUDA toolkit root: ``CUDA_HOME``/``CUDA_PATH`` if they hold a toolkit, else found from nvcc.

    ``nvcc`` on ``PATH`` may be a wrapper script (``/usr/local/bin/nvcc`` here), which makes torch guess
    ``/usr/local``; a candidate only counts if it has both ``bin/nvcc`` and ``include/cuda_runtime.h``.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        candidates.append(os.path.dirname(os.path.dirname(nvcc)))
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and _has_toolkit(candidate):
            return os.path.realpath(candidate)
    return None


def pip_cuda_include_dirs() -> list[str]:
    """Header folders of the ``nvidia-*`` wheels that a CUDA torch build pulls in.

    ATen's CUDA headers include cuSPARSE/cuBLAS/... headers that a bare toolkit may lack; the wheels
    carry them (``nvidia/cu13/include`` for CUDA 13, ``nvidia/<lib>/include`` for CUDA 12).
    """
    roots = list(dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()] + sys.path))
    found: list[str] = []
    for root in roots:
        if not root or not os.path.isdir(os.path.join(root, "nvidia")):
            continue
        for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                if path not in found:
                    found.append(path)
    return found


@dataclass
class BuildPlan:
    """What will be compiled and with which settings; serialized into the extension as metadata."""

    build_cuda: bool
    reason: str  # why the CUDA part is built or skipped, one line
    cuda_home: str | None = None
    cuda_arch_list: str | None = None
    include_dirs: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    cxx_flags: list[str] = field(default_factory=lambda: list(CXX_FLAGS))
    link_flags: list[str] = field(default_factory=lambda: list(LINK_FLAGS))
    nvcc_flags: list[str] = field(default_factory=list)


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def plan_build(root: str | None = None) -> BuildPlan:
    """Decide whether to build the CUDA sources and with which toolkit, headers and architectures."""
    import torch

    root = root or _ROOT
    forced = _env_flag("FASTMESH_BUILD_CUDA")
    cuda_home = find_cuda_home()
    if forced is False:
        build_cuda, reason = False, "skipping CUDA sources: FASTMESH_BUILD_CUDA=0"
    elif torch.version.cuda is None:
        reason = f"skipping CUDA sources: torch {torch.__version__} is not a CUDA build"
        if forced:
            raise RuntimeError(f"FASTMESH_BUILD_CUDA=1 but {reason.split(': ', 1)[1]}")
        build_cuda = False
    elif cuda_home is None:
        reason = "skipping CUDA sources: no CUDA toolkit found (set CUDA_HOME to a folder with bin/nvcc)"
        if forced:
            raise RuntimeError("FASTMESH_BUILD_CUDA=1 but no CUDA toolkit was found; set CUDA_HOME")
        build_cuda = False
    else:
        build_cuda = True
        reason = f"building CUDA sources with {cuda_home} for torch CUDA {torch.version.cuda}"

    plan = BuildPlan(build_cuda=build_cuda, reason=reason, include_dirs=[os.path.join(csrc_dir(root), "include")])
    plan.sources = cpp_sources(root) + (cuda_sources(root) if build_cuda else [])
    if build_cuda:
        plan.cuda_home = cuda_home
        plan.include_dirs += pip_cuda_include_dirs()
        plan.nvcc_flags = list(NVCC_FLAGS)
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
        plan.cuda_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or "detected from the visible GPUs"
    return plan


def configure_cuda_environment(plan: BuildPlan) -> None:
    """Point ``torch.utils.cpp_extension`` at the toolkit found; call before importing that module."""
    if plan.build_cuda and plan.cuda_home:
        os.environ["CUDA_HOME"] = plan.cuda_home


def build_info_header(plan: BuildPlan, root: str | None = None, mode: str = "setup") -> str:
    """C++ header text that compiles the build metadata into the extension (read by ``_C.build_info()``)."""
    import torch

    info = {
        "mode": mode,
        "torch_version": torch.__version__,
        "torch_git_version": torch.version.git_version,
        "torch_cuda_version": torch.version.cuda,
        "python_version": sys.version.split()[0],
        "source_digest": source_digest(root),
        "max_jobs": os.environ.get("MAX_JOBS"),
        **asdict(plan),
    }
    payload = BUILD_INFO_MARKER + json.dumps(info, indent=1, sort_keys=True)
    delimiter = "fmbuild"  # C++ caps raw-string delimiters at 16 characters
    if f"){delimiter}" in payload:
        raise ValueError(f"build metadata contains the raw-string delimiter {delimiter!r}")
    return (
        "// Generated by fastmesh/_build_config.py at build time; do not edit.\n"
        "#pragma once\n"
        "namespace fastmesh {\n"
        f'inline constexpr const char* kBuildInfoJson = R"{delimiter}({payload}){delimiter}";\n'
        "}  // namespace fastmesh\n"
    )


def parse_build_info(text: str) -> dict:
    """The metadata dict from the compiled-in string (as returned by ``_C.build_info()``)."""
    if not text.startswith(BUILD_INFO_MARKER):
        raise ValueError("not fastmesh build metadata")
    return json.loads(text[len(BUILD_INFO_MARKER) :])


def read_embedded_build_info(binary_path: str) -> dict | None:
    """The metadata compiled into an extension binary, read from the file without loading it."""
    with open(binary_path, "rb") as f:
        data = f.read()
    start = data.find(BUILD_INFO_MARKER.encode())
    if start < 0:
        return None
    end = data.find(b"\0", start)
    return parse_build_info(data[start:end].decode())


def write_if_changed(path: str, text: str) -> None:
    """Write ``text`` unless the file already holds it, so ninja does not rebuild for nothing."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)

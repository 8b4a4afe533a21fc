"""Loading ``fastmesh._C``, the C++/CUDA kernels, with errors that say what to do.

The extension is loaded on first need (:func:`load`), not when ``fastmesh`` is imported, so that a
broken build never stops ``import fastmesh`` or ``fastmesh info`` from explaining itself. Loading
registers the kernels with the dispatcher (``TORCH_LIBRARY_IMPL`` blocks in ``csrc/``).

Two ways to get the extension:

* installed: ``pip install --no-build-isolation [-e] .`` compiles ``fastmesh/_C*.so``;
* JIT (``FASTMESH_JIT=1``): compiles the same sources from a source checkout with
  ``torch.utils.cpp_extension.load`` into a cache folder (``FASTMESH_JIT_CACHE``, default
  ``~/.cache/fastmesh/jit``), so that editing a ``.cpp``/``.cu`` file needs no reinstall; ninja rebuilds
  only what changed.

Before it is used, an installed extension is checked against the running torch (a different torch
means a different C++ ABI) and, in a source checkout, against ``csrc/`` (a stale build).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Any

import torch

from fastmesh import _build_config, settings

logger = logging.getLogger(__name__)

REBUILD_COMMAND = "pip install --no-build-isolation -e ."


class ExtensionError(RuntimeError):
    """``fastmesh._C`` is missing, stale, or was built for another torch; the message says what to run."""


_lock = threading.Lock()
_module: ModuleType | None = None
_error: ExtensionError | None = None


def _jit_enabled() -> bool:
    return settings.get("FASTMESH_JIT") == "1"


def _jit_cache_dir() -> str:
    root = settings.get("FASTMESH_JIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastmesh", "jit")
    # One folder per torch build: objects compiled against one torch must never link into another.
    tag = f"torch{torch.__version__}-{(torch.version.git_version or 'unknown')[:12]}".replace("+", "_")
    return os.path.join(root, tag)


def _build_jit() -> ModuleType:
    root = _build_config.source_root()
    if not os.path.isdir(_build_config.csrc_dir(root)):
        raise ExtensionError(
            f"FASTMESH_JIT=1 needs a source checkout with csrc/, but {_build_config.csrc_dir(root)} does not exist; "
            f"install from a clone with `{REBUILD_COMMAND}`"
        )
    plan = _build_config.plan_build(root)
    _build_config.configure_cuda_environment(plan)
    logger.info("fastmesh JIT: %s", plan.reason)
    from torch.utils import cpp_extension

    build_dir = _jit_cache_dir()
    os.makedirs(build_dir, exist_ok=True)
    generated = os.path.join(build_dir, "generated")
    _build_config.write_if_changed(
        os.path.join(generated, "fastmesh", "build_info.h"), _build_config.build_info_header(plan, root, mode="jit")
    )
    macro = f"-DFASTMESH_WITH_CUDA={1 if plan.build_cuda else 0}"
    try:
        return cpp_extension.load(
            name="fastmesh_jit_C",
            sources=[os.path.join(root, s) for s in plan.sources],
            extra_include_paths=[os.path.join(root, d) for d in plan.include_dirs] + [generated],
            extra_cflags=plan.cxx_flags + [macro],
            extra_cuda_cflags=plan.nvcc_flags + [macro],
            extra_ldflags=plan.link_flags,
            build_directory=build_dir,
            with_cuda=plan.build_cuda,
            verbose=settings.get("FASTMESH_JIT_VERBOSE") == "1",
        )
    except (RuntimeError, OSError, ImportError) as error:
        raise ExtensionError(
            f"the JIT build of fastmesh._C in {build_dir} failed: {error}. "
            "Set FASTMESH_JIT_VERBOSE=1 to see the compiler output"
        ) from error


def _not_built_error() -> ExtensionError:
    return ExtensionError(
        "fastmesh._C is not built: this fastmesh was not installed with its extension. "
        f"From the repository root run `{REBUILD_COMMAND}` (or set FASTMESH_JIT=1 to compile it on first use)"
    )


def _find_installed_binary() -> str:
    if "fastmesh._C" in sys.modules and sys.modules["fastmesh._C"] is None:
        raise _not_built_error()  # import blocked on purpose (how tests simulate a missing build)
    spec = importlib.util.find_spec("fastmesh._C")
    if spec is None or not spec.origin:
        raise _not_built_error()
    return spec.origin


def _check_build_info(info: dict[str, Any]) -> None:
    if info["torch_version"] != torch.__version__ or info["torch_git_version"] != torch.version.git_version:
        raise ExtensionError(
            f"fastmesh._C was built against torch {info['torch_version']} but torch {torch.__version__} is "
            f"running; the C++ ABI differs. Rebuild with `{REBUILD_COMMAND}`"
        )
    csrc = _build_config.csrc_dir()
    if (
        os.path.isdir(csrc)
        and settings.get("FASTMESH_ALLOW_STALE") != "1"
        and _build_config.source_digest() != info["source_digest"]
    ):
        raise ExtensionError(
            f"fastmesh._C is stale: sources under {csrc} changed since it was built. Rebuild with "
            f"`{REBUILD_COMMAND}`, use FASTMESH_JIT=1 while editing kernels, or set FASTMESH_ALLOW_STALE=1 "
            "to run the old build anyway"
        )


def _import_installed() -> ModuleType:
    # Checked before loading: a stale binary's kernels may no longer match the schemas, and the
    # dispatcher aborts the process on such a mismatch at load time.
    binary = _find_installed_binary()
    info = _build_config.read_embedded_build_info(binary)
    if info is None:
        raise ExtensionError(f"{binary} carries no fastmesh build metadata; rebuild with `{REBUILD_COMMAND}`")
    _check_build_info(info)
    try:
        return importlib.import_module("fastmesh._C")
    except ImportError as error:
        # Typically "undefined symbol": the binary was linked against another torch.
        raise ExtensionError(
            f"fastmesh._C failed to load ({error}); it was probably built against a different torch than "
            f"torch {torch.__version__}. Rebuild with `{REBUILD_COMMAND}`"
        ) from error


def load() -> ModuleType:
    """Load the extension (once) and return it; raises :class:`ExtensionError` with the fix."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            if _jit_enabled():
                module = _build_jit()
            else:
                module = _import_installed()
        except ExtensionError as error:
            _error = error
            raise
        _module = module
        return module


def require() -> None:
    """For op fronts: raise :class:`ExtensionError` before dispatching to a kernel that is missing.

    Skipped while torch.compile traces (dynamo cannot trace the lock, and tracing needs only the fake
    impls); the compiled graph still fails loudly at run time if the kernels are missing.
    """
    if not torch.compiler.is_compiling():
        load()


def load_error() -> ExtensionError | None:
    """The reason the extension cannot be used, or None if it loads."""
    try:
        load()
    except ExtensionError as error:
        return error
    return None


def build_info() -> dict[str, Any]:
    """Build metadata compiled into the loaded extension (versions, sources, flags, CUDA settings)."""
    return _build_config.parse_build_info(load().build_info())

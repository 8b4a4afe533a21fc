"""fastmesh: fused tensor-parallel collectives for PyTorch.

Importing fastmesh defines the ``torch.ops.fastmesh`` schemas and fake impls (pure Python) and then
tries to load the C++/CUDA kernels (``fastmesh._C``). A missing, stale or mismatched extension does
not fail the import: it warns once, ``fastmesh info`` explains it, and every op raises
:class:`fastmesh.ExtensionError` saying what to run.
"""

import warnings

from fastmesh import fp8
from fastmesh._cpp_lib import ExtensionError, load_error
from fastmesh.mesh import group_name, init_mesh
from fastmesh.ops import all_gather_matmul, amax, matmul_all_gather, matmul_all_reduce, matmul_reduce_scatter
from fastmesh.version import __version__

__all__ = [
    "ExtensionError",
    "__version__",
    "all_gather_matmul",
    "amax",
    "fp8",
    "group_name",
    "init_mesh",
    "matmul_all_gather",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
]


def _load_kernels() -> None:
    error = load_error()
    if error is not None:
        warnings.warn(f"fastmesh kernels are unavailable: {error}", RuntimeWarning, stacklevel=3)


_load_kernels()

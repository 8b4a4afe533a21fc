"""``fastmesh::amax``: the largest magnitude of a tensor, the first pass of FP8 current scaling.

======  ==================  =========================================
name    shape               dtype
======  ==================  =========================================
x       any (may be empty)  float32, bfloat16, float16
result  ``[]`` (0-d)        float32, on ``x``'s device
======  ==================  =========================================

Plain-PyTorch equivalent::

    x.abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)

NaN anywhere in ``x`` gives NaN; an infinity gives inf. The reduction is exact (a max), so the result
equals the equivalent bit for bit. Non-contiguous inputs are read through a contiguous copy.
"""

import torch

from fastmesh import _cpp_lib
from fastmesh.ops._library import qualified_name

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def check_float_input(x: torch.Tensor, op: str, arg: str) -> None:
    """The Python twin of ``csrc/include/fastmesh/checks.h``: same rule, same wording."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{op}: {arg} must be float32, bfloat16 or float16, got {x.dtype}")


@torch.library.register_fake(qualified_name("amax"))
def _amax_fake(x: torch.Tensor) -> torch.Tensor:
    check_float_input(x, "fastmesh::amax", "x")
    return x.new_empty((), dtype=torch.float32)


def amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of ``x`` as a 0-d float32 tensor (see the module docstring for shapes).

    Equivalent to ``x.abs().amax().float()``, with 0 for an empty ``x``. Not differentiable: the result
    never requires grad (it feeds scales, not the loss).

    Args:
        x: float32, bfloat16 or float16 tensor of any shape, on CPU or CUDA.

    Returns:
        A 0-d float32 tensor on ``x``'s device.

    Example::

        >>> fastmesh.amax(torch.tensor([1.0, -3.0, 2.0]))
        tensor(3.)
    """
    check_float_input(x, "fastmesh.amax", "x")
    _cpp_lib.load()
    return torch.ops.fastmesh.amax(x.detach())

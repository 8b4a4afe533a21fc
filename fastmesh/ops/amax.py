"""``fastmesh::amax``: the largest magnitude per FP8 scaling group, the first pass of current scaling.

The groups are those of :func:`fastmesh.fp8.quantize` (x viewed as ``[M, K]``, leading dims flattened):

==============  ==================  ==============================================
granularity     x                   result (float32, on x's device)
==============  ==================  ==============================================
tensorwise      any shape           ``[]``
rowwise         ``[..., K]``        ``[..., 1]``
block1x128      ``[..., K]``        ``[..., ceil(K/128)]``
block128x128    ``[..., K]``, 2-D+  ``[ceil(M/128), ceil(K/128)]``
==============  ==================  ==============================================

Plain-PyTorch equivalent (tensorwise)::

    x.abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)

and per group alike for the others. NaN in a group gives NaN, an infinity gives inf, an empty group
gives 0. The reduction is exact (a max), so the result equals the equivalent bit for bit. x may be
float32, bfloat16 or float16; non-contiguous inputs are read through a contiguous copy.
"""

import torch

from fastmesh import _cpp_lib
from fastmesh.ops._checks import FLOAT_INPUTS, check_granularity, check_tensor, scale_shape
from fastmesh.ops._library import qualified_name


@torch.library.register_fake(qualified_name("amax"))
def _amax_fake(x: torch.Tensor, granularity: str = "tensorwise") -> torch.Tensor:
    check_tensor(x, "fastmesh::amax", "x", FLOAT_INPUTS)
    check_granularity(granularity, x, "fastmesh::amax")
    return x.new_empty(scale_shape(x.shape, granularity), dtype=torch.float32)


def amax(x: torch.Tensor, granularity: str = "tensorwise") -> torch.Tensor:
    """Largest magnitude of ``x`` per scaling group, float32 (see the module docstring for shapes).

    Equivalent to ``x.abs().amax().float()`` for ``"tensorwise"`` (0 for an empty ``x``), and to the
    same reduction over each group for the other granularities. Not differentiable: the result never
    requires grad (it feeds scales, not the loss).

    Args:
        x: float32, bfloat16 or float16 tensor, on CPU or CUDA.
        granularity: ``"tensorwise"``, ``"rowwise"``, ``"block1x128"`` or ``"block128x128"``.

    Returns:
        A float32 tensor in the scale layout of ``granularity``, on ``x``'s device.

    Example::

        >>> fastmesh.amax(torch.tensor([[1.0, -3.0], [2.0, 0.5]]), "rowwise")
        tensor([[3.],
                [2.]])
    """
    check_tensor(x, "fastmesh.amax", "x", FLOAT_INPUTS)
    check_granularity(granularity, x, "fastmesh.amax")
    _cpp_lib.require()
    return torch.ops.fastmesh.amax(x.detach(), granularity)

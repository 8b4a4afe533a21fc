"""Input checks shared by the op fronts and fake impls; the wording matches ``csrc/include/fastmesh/checks.h``.

Errors name the argument and what was expected: TypeError for a wrong type or dtype, ValueError for a
wrong value, shape or device.
"""

from __future__ import annotations

import torch

from fastmesh.kernels.formats import (  # noqa: F401  (the formats the ops check against, re-exported)
    BLOCK,
    FP8_DTYPES,
    FP8_MAX,
    GRANULARITIES,
    MX,
    MX_BLOCK,
    SCALE_ROUNDINGS,
    scale_shape,
)

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)  # what fp8 quantize casts from
MATMUL_DTYPES = (*FLOAT_INPUTS, torch.float64)  # the high-precision fused ops' operands
REDUCE_OPS = ("sum", "avg")
# Fewest dims of x each granularity is defined for.
_MIN_DIMS = {"tensorwise": 0, "rowwise": 1, "block1x128": 1, "block128x128": 2}


def dtype_names(dtypes) -> str:
    """``(torch.float32, torch.bfloat16)`` as ``"float32 or bfloat16"``, the way error messages list them."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_tensor(
    t,
    op: str,
    arg: str,
    dtypes,
    *,
    min_dim: int = 0,
    max_dim: int | None = None,
    device: torch.device | None = None,
    device_of: str = "",
) -> None:
    """``t`` is a dense tensor of one of ``dtypes`` with ``min_dim..max_dim`` dims (on ``device``, the device of
    the argument named ``device_of``, when given); else a TypeError (type, dtype) or ValueError naming ``arg``."""
    check_is_tensor(t, op, arg)
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {arg} must be {dtype_names(dtypes)}, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {arg} must be a dense (strided) tensor, got {t.layout}")
    if t.dim() < min_dim or (max_dim is not None and t.dim() > max_dim):
        wanted = f"{min_dim}" if min_dim == max_dim else f"at least {min_dim}"
        raise ValueError(f"{op}: {arg} must have {wanted} dim(s), got shape {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {arg} must be on {device_of}'s device {device}, got {t.device}")


def check_bool(value, op: str, arg: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {arg} must be a bool, got {type(value).__name__}")


def check_int(value, op: str, arg: str) -> None:
    """An int (not a bool) that fits the op's schema (64 bits); its range is the op's to check."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {arg} must be an int, got {type(value).__name__}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{op}: {arg} must fit in 64 bits, got {value!r}")


def check_is_tensor(value, op: str, arg: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(value).__name__}")


def check_fp8_dtype(dtype: torch.dtype, op: str, arg: str = "dtype") -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: {arg} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def check_granularity(granularity: str, x: torch.Tensor, op: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"{op}: granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    if x.dim() < _MIN_DIMS[granularity]:
        raise ValueError(
            f"{op}: granularity {granularity!r} needs x with at least {_MIN_DIMS[granularity]} dim(s), "
            f"got shape {list(x.shape)}"
        )


def check_per_group_tensor(t: torch.Tensor, arg: str, x: torch.Tensor, granularity: str, op: str) -> None:
    """A given scale or amax: float32, on x's device, in the scale layout of ``granularity``."""
    check_tensor(t, op, arg, (torch.float32,), device=x.device, device_of="x")
    expected = scale_shape(x.shape, granularity)
    if tuple(t.shape) != expected:
        raise ValueError(
            f"{op}: {arg} must have shape {list(expected)} for granularity {granularity!r} and x of shape "
            f"{list(x.shape)}, got {list(t.shape)}"
        )


def wrap_dim(dim, ndim: int, op: str, arg: str, tensor_arg: str) -> int:
    """``dim`` of a tensor with ``ndim`` dims, in ``[-ndim, ndim)``, made non-negative."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: {arg} must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: {arg} must be in [{-ndim}, {ndim - 1}] for {tensor_arg} with {ndim} dim(s), got {dim}")
    return dim % ndim

"""Autocast: under ``torch.autocast`` the fused ops multiply in the region's dtype, as ``torch.mm`` and ``F.linear`` do.

torch's matmuls are on autocast's lower-precision list: in an autocast region their floating-point inputs (float64
excepted) are cast to the region's dtype (``torch.get_autocast_dtype(device)``), so their outputs have it. fastmesh
follows the same rule in two places, sharing :func:`cast`:

* the ops that take high-precision operands (their spec's ``autocast``: ``all_gather_matmul``,
  ``matmul_reduce_scatter``, ``matmul_all_reduce``, ``matmul_all_gather``) get an Autocast kernel per device type,
  which casts and runs the op with autocast off (what ``torch.library.register_autocast`` does, with the region's
  dtype rather than one fixed when registering); the FP8 ops take FP8 data and an ``out_dtype`` and are left alone;
* the Python fronts' FP8 paths cast their operands first (the FP8 forms' autograd Functions save and quantize them),
  and the TP styles cast a bias before adding it, as ``F.linear`` does. (A front's high-precision path passes its
  operands to the op as they are: the op's Autocast kernel casts them.)
"""

from __future__ import annotations

import torch

from fastmesh.ops._library import SPECS, library

# The device types whose autocast regions the ops follow, found once: dynamo (torch 2.11) cannot trace the check,
# and cast() runs inside compiled fronts.
_AUTOCAST_DEVICE_TYPES = tuple(d for d in ("cpu", "cuda", "xpu") if torch.amp.is_autocast_available(d))


def _cast_to(value, device_type: str, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.dtype != torch.float64 and value.device.type == device_type
        return value.to(dtype) if eligible and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_to(v, device_type, dtype) for v in value)
    return value


def any_region() -> bool:
    """Whether an autocast region is open for any of the device types the ops follow."""
    for device_type in _AUTOCAST_DEVICE_TYPES:  # noqa: SIM110  (a loop: no generator on every front call)
        if torch.is_autocast_enabled(device_type):
            return True
    return False


def cast(value):
    """``value`` (a tensor, or a list / tuple of them) as an autocast region casts a matmul's inputs; unchanged
    outside one. A tensor's own device type says which region applies (none for other devices, meta included)."""
    if not any_region():  # the common case, without looking at the tensors
        return value
    tensors = [value] if isinstance(value, torch.Tensor) else [t for t in value if isinstance(t, torch.Tensor)]
    for device_type in {t.device.type for t in tensors}:
        if device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
            value = _cast_to(value, device_type, torch.get_autocast_dtype(device_type))
    return value


def _register(op_name: str, device_type: str) -> None:
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    dispatch_key = getattr(torch._C.DispatchKey, key)
    op = getattr(torch.ops.fastmesh, op_name).default

    def run(*args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        args = _cast_to(args, device_type, dtype)
        kwargs = {name: _cast_to(v, device_type, dtype) for name, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(dispatch_key)):
            return op(*args, **kwargs)

    op.py_impl(dispatch_key)(run)  # the Python dispatcher's (tracing) path
    library.impl(op_name, lambda _keys, *args, **kwargs: run(*args, **kwargs), key, with_keyset=True)


for _spec in SPECS:  # the ops whose operands are high-precision matrices
    if _spec.autocast:
        for _device_type in _AUTOCAST_DEVICE_TYPES:
            _register(_spec.name, _device_type)

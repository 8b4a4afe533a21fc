"""``fastmesh::fp8_quantize``: FP8 cast-and-scale in one pass; :func:`quantize` is ``fastmesh.fp8.quantize``.

Plain-PyTorch equivalent (tensorwise, current scaling; ``fp8_max`` 448 for e4m3fn, 57344 for e5m2). The other
granularities do the same per scaling group; ``kernels/fp8_reference.py`` spells out every option, and the
kernels equal it bit for bit (NaN bits aside: the kernels write NaN as ``0x7F``)::

    amax = x.abs().amax().float()                                         # NaN wins; 0 for an empty x
    q = torch.where(amax == 0, 1.0, fp8_max / amax).clamp(max=torch.finfo(torch.float32).max)
    data = (x.float() * q).clamp(-fp8_max, fp8_max).to(dtype)             # saturates, e5m2 too
    scale = q.reciprocal()                                                # x ~= data.float() * scale

Shapes (x as ``[M, K]``, leading dims flattened; scale and amax in the layout ``torch._scaled_mm`` takes)::

    granularity    scale / amax                  data_t (transpose=True)   scale_t
    tensorwise     []                            [K, M]                    []
    rowwise        [..., 1]                      [K, M]                    [K, 1]  (per column of x)
    block1x128     [..., ceil(K/128)]            [K, M]                    [K, ceil(M/128)]
    block128x128   [ceil(M/128), ceil(K/128)]    [K, M]                    [ceil(K/128), ceil(M/128)]

``data`` has x's shape; ``data_t``/``scale_t`` quantize ``x2d.t()`` in the same pass (the op returns empty
tensors without ``transpose``, :func:`quantize` returns ``None``). Not differentiable. Errors: TypeError for a
wrong type or dtype, ValueError for a wrong granularity, shape, device or mix of options. CPU runs C++; CUDA runs
Triton or CUDA C++ (``FASTMESH_FP8_CUDA_IMPL=triton|cuda``). Special values and design: ``docs/design/fp8.md``.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple, Optional

import torch

from fastmesh import settings
from fastmesh._log import log_once
from fastmesh.mesh import group_name
from fastmesh.ops import _collectives
from fastmesh.ops._checks import (
    BLOCK,
    FLOAT_INPUTS,
    GRANULARITIES,
    MX,
    MX_BLOCK,
    check_bool,
    check_fp8_dtype,
    check_granularity,
    check_per_group_tensor,
    check_tensor,
    scale_shape,
)
from fastmesh.ops._fused_common import as_matrix
from fastmesh.ops._library import below_autograd, qualified_name, signature
from fastmesh.ops.amax import amax as group_amax
from fastmesh.ops.mx_quantize import mx_quantize

logger = logging.getLogger(__name__)

_OP = "fastmesh::fp8_quantize"
_QUANTIZE_GRANULARITIES = (*GRANULARITIES, MX)  # what quantize() takes: the fp8_quantize op's and the MX cast
# Granularities whose transposed groups are the transposes of the row groups, so that a given scale
# or amax also determines the transposed output.
_TRANSPOSE_FOLLOWS_GIVEN = ("tensorwise", "block128x128")


class Float8Quantized(NamedTuple):
    """Result of :func:`quantize`: ``x ~= data.float() * scale``, each scale element covering its group
    (:meth:`dequantize`)."""

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    data_t: torch.Tensor | None
    scale_t: torch.Tensor | None

    def dequantize(self, dtype: torch.dtype = torch.float32, *, transposed: bool = False) -> torch.Tensor:
        """``data * scale`` in ``dtype`` (fp32 products, then one rounding): what ``x`` is taken to be. With
        ``transposed=True``, ``data_t * scale_t``: ``[K, M]``, x as ``[M, K]`` transposed (``transpose=True``
        quantizations only). An E8M0 scale of NaN (0xFF) gives NaN over its block."""
        data, scale = (self.data_t, self.scale_t) if transposed else (self.data, self.scale)
        if data is None:
            raise ValueError("Float8Quantized.dequantize: transposed=True needs a quantize(..., transpose=True) result")
        if 0 < scale.dim() != data.dim():  # 128 x 128 blocks of an N-D x: the scale's layout is x as [M, K]
            return dequantize(as_matrix(data), scale, dtype).reshape(data.shape)
        return dequantize(data, scale, dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale`` in ``dtype``, each scale element covering its block of ``data`` (a size-1 dim of the
    scale covers the whole dim): the rule and the method of ``dequantize`` in ``csrc/fused/scaled.h`` (blocks
    that tile a dim exactly broadcast their scale over a split dim; a partial last block expands it)."""
    values = data.float()
    s = scale.float()
    if s.dim() == 0:
        return values.mul_(s).to(dtype)
    block = MX_BLOCK if scale.dtype == torch.float8_e8m0fnu else BLOCK
    value_shape, scale_shape = [], []
    for d, (n, groups) in enumerate(zip(data.shape, scale.shape)):
        if groups in (1, n):
            value_shape.append(n)
            scale_shape.append(groups)
        elif n == groups * block:
            value_shape += [groups, block]
            scale_shape += [groups, 1]
        else:
            # An index per element, not repeat_interleave(block).narrow(n): inductor (torch 2.14, CPU) compiles
            # that expand-flatten-slice to a loop over the first block only and leaves the rest unwritten.
            s = s.index_select(d, torch.arange(n, device=s.device) // block)
            value_shape.append(n)
            scale_shape.append(n)
    values.view(value_shape).mul_(s.reshape(scale_shape))
    return values.to(dtype)


def check_quantize_args(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    scale: torch.Tensor | None,
    amax: torch.Tensor | None,
    transpose: bool,
    power_of_two: bool,
    op: str = _OP,
) -> None:
    check_tensor(x, op, "x", FLOAT_INPUTS)
    check_fp8_dtype(dtype, op)
    check_granularity(granularity, x, op)
    if scale is not None and amax is not None:
        raise ValueError(f"{op}: pass at most one of scale= (delayed scaling) and amax= (a precomputed amax)")
    for arg, given in (("scale", scale), ("amax", amax)):
        if given is not None:
            check_per_group_tensor(given, arg, x, granularity, op)
    if scale is not None and power_of_two:
        raise ValueError(f"{op}: power_of_two applies to computed scales; with scale= the given scale is used as is")
    if transpose:
        if x.dim() < 2:
            raise ValueError(f"{op}: transpose=True needs x with at least 2 dims, got shape {list(x.shape)}")
        if (scale is not None or amax is not None) and granularity not in _TRANSPOSE_FOLLOWS_GIVEN:
            raise ValueError(
                f"{op}: transpose=True with a given scale or amax needs granularity 'tensorwise' or 'block128x128' "
                f"(the {granularity!r} groups of x.t() differ from those of x); quantize x.t() separately"
            )


def _log_path_once(path: str) -> None:
    log_once(logger, logging.INFO, ("fp8_quantize", path), "fastmesh.fp8 quantize runs the %s implementation", path)


def _fp8_quantize_body(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    scale: Optional[torch.Tensor] = None,  # noqa: UP045 -- torch 2.11's schema inference needs Optional
    amax: Optional[torch.Tensor] = None,  # noqa: UP045
    transpose: bool = False,
    power_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_quantize_args(x, dtype, granularity, scale, amax, transpose, power_of_two)
    # Kernels read x as a row-major [M, K] matrix; a strided x is copied once here.
    x = x.contiguous()
    if x.device.type == "cuda" and settings.get("FASTMESH_FP8_CUDA_IMPL") == "triton":
        from torch.library import wrap_triton

        from fastmesh.kernels import fp8_quantize as triton_kernels

        _log_path_once("Triton")
        result = triton_kernels.quantize(x, dtype, granularity, scale, amax, transpose, power_of_two, wrap=wrap_triton)
    else:
        _log_path_once(f"C++ ({x.device.type})")
        result = torch.ops.fastmesh.fp8_quantize_native(x, dtype, granularity, scale, amax, transpose, power_of_two)
    data, scale_out, amax_out, data_t, scale_t = result
    if data_t is None:
        data_t, scale_t = x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    return data, scale_out, amax_out, data_t, scale_t


# torch 2.11 ignores schema= and infers the schema from the body's annotations (hence Optional above); a test
# checks that the registered schema is the one in _library.
fp8_quantize_op = torch.library.triton_op(
    qualified_name("fp8_quantize"), _fp8_quantize_body, mutates_args=(), schema=signature("fp8_quantize")
)
# The op users reach: on CPU it runs csrc/cpu/fp8_quantize.cpp's kernel directly (no Python); the body above serves
# CUDA and tracing.
_QUANTIZE = torch.ops.fastmesh.fp8_quantize.default


@torch.library.register_fake(qualified_name("fp8_quantize_native"))
def _fp8_quantize_native_fake(x, dtype, granularity, scale=None, amax=None, transpose=False, power_of_two=False):
    check_quantize_args(x, dtype, granularity, scale, amax, transpose, power_of_two, op="fastmesh::fp8_quantize_native")
    per_group = scale_shape(x.shape, granularity)
    data = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    scale_out = x.new_empty(per_group, dtype=torch.float32)
    amax_out = x.new_empty(per_group, dtype=torch.float32)
    if not transpose:
        return data, scale_out, amax_out, None, None
    # x as [M, K] with M computed, not inferred: reshape(-1, 0) is ambiguous for an empty x.
    data_t = x.new_empty((x.shape[-1], math.prod(x.shape[:-1])), dtype=dtype)
    scale_t = x.new_empty(scale_shape(data_t.shape, granularity), dtype=torch.float32)
    return data, scale_out, amax_out, data_t, scale_t


def fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    transpose: bool = False,
    power_of_two: bool = False,
) -> Float8Quantized:
    """The op on one tensor (no group): see the module docstring. Not differentiable.

    The op validates the arguments before any kernel runs, in eager and under tracing alike."""
    with below_autograd():
        data, scale_out, amax_out, data_t, scale_t = _QUANTIZE(
            x.detach() if x.requires_grad else x, dtype, granularity, scale, amax, transpose, power_of_two
        )
    if not transpose:
        return Float8Quantized(data, scale_out, amax_out, None, None)
    return Float8Quantized(data, scale_out, amax_out, data_t, scale_t)


def _all_reduce_amax(local_amax: torch.Tensor, group_name: str) -> torch.Tensor:
    """Max over the group, NaN-safe: the int32 view of a magnitude's bits orders like the value, NaN
    above inf, so an integer max propagates NaN, which a float max may drop."""
    return _collectives.all_reduce(local_amax.view(torch.int32), "max", group_name).view(torch.float32)


def quantize(
    x: torch.Tensor,
    *,
    dtype: torch.dtype,
    granularity: str,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
    amax_group=None,
    power_of_two: bool = False,
    scale_rounding: str | None = None,
) -> Float8Quantized:
    """Quantize ``x`` to FP8 with a fused cast-and-scale kernel (``fastmesh.fp8.quantize``).

    Args:
        x: float32, bfloat16 or float16 tensor on CPU or CUDA, any shape (see the granularity table in
            :mod:`fastmesh.ops.fp8_quantize`). Non-contiguous inputs are copied to contiguous first.

    Keyword Args:
        dtype: ``torch.float8_e4m3fn`` (saturates at +-448) or ``torch.float8_e5m2`` (saturates at
            +-57344, unlike ``x.to(torch.float8_e5m2)``).
        granularity: ``"tensorwise"``, ``"rowwise"`` (over the last dim), ``"block1x128"``, ``"block128x128"``
            or ``"mx"`` (MXFP8: blocks of 32 along the last dim, which 32 must divide, with power-of-two E8M0
            scales ``[..., K/32]``: :mod:`fastmesh.ops.mx_quantize`).
        scale: a given dequantization scale in the scale layout (delayed scaling); ``x`` is multiplied by
            its fp32 reciprocal. ``None`` computes the scale from this tensor's amax (current scaling).
        transpose: also return ``data_t``/``scale_t``, the same quantization of ``x`` (as ``[M, K]``)
            transposed, written in the same pass.
        amax_group: a group (``ProcessGroup``, 1-D ``DeviceMesh``, ``(mesh, dim)`` or name) over which the
            amax is all-reduced (max) before the scale is formed, so every rank holding a shard gets the
            scale of the whole tensor; one small all-reduce of the amax, never of the data. Tensorwise and
            rowwise (a tensor sharded along its last dim) only.
        power_of_two: round computed scales down to powers of two (exact to invert).
        scale_rounding: ``"mx"`` only: ``"floor"`` (the default, the OCP spec's rule) or ``"rceil"``.

    Returns:
        :class:`Float8Quantized` ``(data, scale, amax, data_t, scale_t)``: ``x ~= data.float() * scale``;
        ``amax`` is the per-group amax (over the group when ``amax_group`` is given); the last two are
        ``None`` unless ``transpose``. Not differentiable. With ``"mx"`` the scale is E8M0 (one per block of
        32): ``x ~= (data.float().unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)``, and
        ``transpose`` casts the columns (blocks of 32 rows, which 32 must divide). ``.dequantize()`` gives that
        approximation of ``x`` for every granularity.

    Example::

        >>> qx = fastmesh.fp8.quantize(x, dtype=torch.float8_e4m3fn, granularity="rowwise")
        >>> y = torch._scaled_mm(qx.data, qw.data.t(), qx.scale, qw.scale.t(), out_dtype=torch.bfloat16)
    """
    op = "fastmesh.fp8.quantize"
    if not isinstance(x, torch.Tensor):  # the rest of x is the op's to check (dynamo's backward bans x.layout here)
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    check_fp8_dtype(dtype, op)  # here, not only in the op: its schema would refuse a non-dtype less clearly
    check_bool(transpose, op, "transpose")
    check_bool(power_of_two, op, "power_of_two")
    if granularity not in _QUANTIZE_GRANULARITIES:
        known = ", ".join(map(repr, _QUANTIZE_GRANULARITIES))
        raise ValueError(f"{op}: granularity must be one of {known}, got {granularity!r}")
    if scale is not None and not isinstance(scale, torch.Tensor):
        raise TypeError(
            f"{op}: scale must be a float32 tensor in the scale layout (0-d for 'tensorwise'), got "
            f"{type(scale).__name__}"
        )
    if granularity == MX:
        if scale is not None or amax_group is not None or power_of_two:
            arg = "scale" if scale is not None else "amax_group" if amax_group is not None else "power_of_two"
            raise ValueError(
                f"{op}: {arg}= does not apply to granularity 'mx' (its scales are powers of two from each block's "
                "own amax)"
            )
        return Float8Quantized(*mx_quantize(x, dtype, scale_rounding or "floor", transpose))
    if scale_rounding is not None:
        raise ValueError(f"{op}: scale_rounding applies to granularity 'mx', got granularity {granularity!r}")
    if amax_group is None:
        return fp8_quantize(x, dtype, granularity, scale, None, transpose, power_of_two)
    if scale is not None:
        raise ValueError(f"{op}: amax_group forms the scale from a reduced amax; it cannot be combined with scale=")
    if granularity not in ("tensorwise", "rowwise"):
        raise ValueError(
            f"{op}: amax_group applies to granularity 'tensorwise' or 'rowwise' (groups that span shards), "
            f"got {granularity!r}"
        )
    check_quantize_args(x, dtype, granularity, None, None, False, power_of_two, op=op)
    try:
        amax_group_name = group_name(amax_group)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{op}: amax_group: {error}") from error
    reduced = _all_reduce_amax(group_amax(x, granularity), amax_group_name)
    return fp8_quantize(x, dtype, granularity, None, reduced, transpose, power_of_two)

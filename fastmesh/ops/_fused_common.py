"""What the high-precision and FP8 fused-collective ops share: group size, argument checks, autograd operands."""

from __future__ import annotations

import math
import warnings

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from fastmesh import _cpp_lib
from fastmesh.ops import plans
from fastmesh.ops._checks import MATMUL_DTYPES, REDUCE_OPS, check_is_tensor, check_tensor


def resolve_group(group_name: str, op: str):
    """The live process group registered as ``group_name``, or a ValueError naming ``op``."""
    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError) as error:
        raise ValueError(
            f'{op}: group_name "{group_name}" names no registered process group '
            "(pass fastmesh.group_name(group) of a live group)"
        ) from error


def group_size(group_name: str, op: str) -> int:
    return resolve_group(group_name, op).size()


def resolve_pieces(pieces, chunks, where: str, stacklevel: int = 3):
    """The pipeline's piece count: ``pieces=``, or the deprecated alias ``chunks=`` with a FutureWarning.
    ``stacklevel`` points the warning at the user's call (3: the caller of the function calling this)."""
    if chunks is None:
        return pieces
    if pieces is not None:
        raise TypeError(f"{where}: pass pieces= only; chunks= is its deprecated alias, and both were given")
    warnings.warn(
        f"{where}: chunks= is deprecated, use pieces= (the same number: pipeline pieces per rank)",
        FutureWarning,
        stacklevel=stacklevel,
    )
    return chunks


def check_same_shapes(group_name: str, op: str, tensors: dict[str, torch.Tensor], **options) -> None:
    """Errors on every rank (ValueError naming the argument and each rank's shape or value) unless every rank calls
    ``op`` with the same number of ``tensors`` (argument name -> tensor), each of the same shape and dtype, and
    with the same ``options`` (argument name -> value, compared as its ``repr``): two small all-gathers on the
    first call of each op and arguments on a CPU group, or on every call with ``FASTMESH_SHAPE_CHECK=every``
    (``csrc/fused/process_group.h``; docs/errors.md). Called before the ranks agree on a plan: ranks whose calls
    differ must all fail here, not in the planner or the pipeline. Every operand is checked, not only what
    travels: the ranks agree on a plan once per shape, so operands that differ across ranks (a contraction split
    unevenly) would leave one rank waiting for an agreement the others think they have."""
    device = next(iter(tensors.values())).device
    if plans.capturing(device) and _cpp_lib.load().shape_check_every_call():
        raise RuntimeError(
            f"{op}: the cross-rank shape check of every call (FASTMESH_SHAPE_CHECK=every or "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL) cannot run inside a CUDA-graph capture: it is a collective that syncs "
            "the host. Capture without it (the first call of each op on a group is checked on CPU groups only)"
        )
    named_values = [(name, repr(value)) for name, value in options.items()]
    _cpp_lib.load().check_same_shapes_on_all_ranks(list(tensors.values()), list(tensors), named_values, group_name, op)


def check_matrices(bs, front: str, op: str) -> None:
    """``bs``: a list (or tuple) of tensors, as the op's ``Tensor[]`` takes it; their shapes are the op's to check.
    ``front`` names the Python front (what was passed), ``op`` the op (what it takes)."""
    if isinstance(bs, torch.Tensor):  # iterating it would split one matrix into rows
        shape = list(bs.shape)
        raise TypeError(f"{front}: bs must be a list of matrices, got a Tensor of shape {shape}; pass [b] for one")
    if not isinstance(bs, (list, tuple)):
        raise TypeError(f"{front}: bs must be a list of matrices, got {type(bs).__name__}")
    for i, b in enumerate(bs):
        check_is_tensor(b, op, f"bs[{i}]")


def is_plain(t) -> bool:
    """Whether ``t`` goes to an op as it is: a plain tensor or parameter (a DTensor takes the fronts' DTensor path)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def are_plain(ts) -> bool:
    """Whether ``ts`` is a list or tuple of :func:`is_plain` tensors (a ``Tensor[]`` argument as it is)."""
    if type(ts) is not list and type(ts) is not tuple:
        return False
    for t in ts:  # noqa: SIM110  (a loop, not all() of a generator: this runs on every front call)
        if not is_plain(t):
            return False
    return True


def plain_options(*ints, flags=(), pieces=None) -> bool:
    """Whether a call's options go to the op as they are: ``ints`` ints (not bools), ``flags`` bools, ``pieces`` None
    or an int. The fronts check the rest only when the op refuses a call (:func:`fastmesh.ops.fused_collectives`)."""
    for value in ints:
        if type(value) is not int:
            return False
    for value in flags:
        if type(value) is not bool:
            return False
    return pieces is None or type(pieces) is int


def any_requires_grad(tensors) -> bool:
    for t in tensors:  # noqa: SIM110  (a loop, not any() of a generator: this runs on every front call)
        if t.requires_grad:
            return True
    return False


def check_pieces(pieces, op: str) -> None:
    if isinstance(pieces, bool) or not isinstance(pieces, int):
        raise TypeError(f"{op}: pieces must be an int, got {type(pieces).__name__}")
    if not 0 <= pieces < 2**63:
        raise ValueError(f"{op}: pieces must be an int >= 0 (0 picks the count from the shapes), got {pieces!r}")


def check_reduce_op(reduce_op, op: str) -> None:
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f'{op}: reduce_op must be "sum" or "avg", got "{reduce_op}"')


def check_matmul_operands(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """a ``[..., K]`` by b ``[K, N]`` of one matmul dtype, on one device (as ``csrc/fused/checks.h``)."""
    check_tensor(a, op, "a", MATMUL_DTYPES, min_dim=1)
    check_tensor(b, op, "b", MATMUL_DTYPES, min_dim=2, max_dim=2)
    check_like(b, a, op, "b", "a")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{op}: b must have {a.shape[-1]} rows (a's last dim), got shape {list(b.shape)}")


def check_like(t: torch.Tensor, reference: torch.Tensor, op: str, arg: str, reference_arg: str) -> None:
    if t.dtype != reference.dtype:
        raise TypeError(f"{op}: {arg} must have {reference_arg}'s dtype {reference.dtype}, got {t.dtype}")
    if t.device != reference.device:
        raise ValueError(f"{op}: {arg} must be on {reference_arg}'s device {reference.device}, got {t.device}")


def check_scattered_divisible(a_shape, n: int, dim: int, scatter_dim: int, world: int, op: str) -> None:
    scattered = n if dim == len(a_shape) - 1 else a_shape[dim]
    if scattered % world != 0:
        raise ValueError(
            f"{op}: the scattered dim {scatter_dim} of a @ b has size {scattered}, which is not "
            f"divisible by the group size {world}"
        )


def gathered_shape(shape, dim: int, world: int) -> list:
    full = list(shape)
    full[dim] = full[dim] * world
    return full


def scattered_shape(a_shape, n: int, dim: int, world: int) -> list:
    shape = list(a_shape[:-1]) + [n]
    shape[dim] = shape[dim] // world
    return shape


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix: leading dims flattened. The row count is computed, not inferred: ``reshape(-1, 0)``
    is ambiguous for a tensor with an empty last dim."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def input_grad_operands(bs, grads) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of the one matmul + reduce-scatter that gives the gathered input's gradient, for the
    non-None output gradients ``grads`` (``(G_i, i)`` pairs): ``[G_1 .. G_n] @ [b_1 .. b_n].T`` equals
    ``sum_i G_i @ b_i.T``, so several bs still cost one reduce-scatter."""
    if len(grads) == 1:
        g, i = grads[0]
        return g, bs[i].t()
    chosen = [bs[i] for _, i in grads]
    # Concatenate in the layout the bs have (typically w.t() views of row-major weights: their transposes are
    # contiguous): no transposing copy, and no transposes materialized into a cat, which inductor's CPU code
    # gets wrong for 16-bit dtypes (docs/design/fused-collectives.md).
    # A list, not a generator: dynamo fails to trace a generator in an autograd.Function's backward (torch 2.14:
    # "generator already executing" when it closes the frame's generators), and the FP8 ops' backward calls this.
    if all([b.t().is_contiguous() for b in chosen]):
        b_t = torch.cat([b.t() for b in chosen], dim=0)
    else:
        b_t = torch.cat(chosen, dim=1).t()
    return torch.cat([g for g, _ in grads], dim=-1), b_t

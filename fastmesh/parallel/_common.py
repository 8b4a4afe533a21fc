"""What the fused styles share: argument checks, parameter sharding, and moving tensors between DTensor and
the local tensors the fused ops take. Nothing numerical happens here."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from fastmesh._log import log_once
from fastmesh.ops._checks import MX, MX_BLOCK
from fastmesh.ops._dtensor import wrap_local
from fastmesh.ops._fp8_operands import OUT_DTYPES, check_config
from fastmesh.ops._fused_common import check_pieces, resolve_pieces
from fastmesh.ops._shards import full_rows, own_rows

logger = logging.getLogger("fastmesh.parallel")


def check_placement(placement, style: str, arg: str) -> Placement:
    """A layout keyword: any DTensor placement torch's ``ColwiseParallel`` / ``RowwiseParallel`` take (``Shard(dim)``,
    ``Replicate()``, ``Partial()``). Which of them run fused is decided at the forward, where the tensor's dims are
    known (:func:`runs_torchs_way`)."""
    if not isinstance(placement, Placement):
        raise TypeError(
            f"{style}: {arg} must be a DTensor placement (Shard(dim), Replicate() or Partial()), got {placement!r}"
        )
    return placement


def shards_last_dim(placement: Placement, ndim: int) -> bool:
    """Whether ``placement`` shards the last of ``ndim`` dims (the features)."""
    return isinstance(placement, Shard) and placement.dim % ndim == ndim - 1


def normalized(placement: Placement, x: torch.Tensor, style: str, what: str) -> Placement:
    """``Shard(dim)`` with ``dim`` made non-negative for ``x``'s dims (a ValueError naming ``what`` for a dim ``x``
    does not have); any other placement as it is."""
    if not isinstance(placement, Shard):
        return placement
    if not -x.dim() <= placement.dim < x.dim():
        raise ValueError(
            f"{style}: {what} Shard({placement.dim}) names no dim of the {x.dim()}-D tensor of shape {tuple(x.shape)}"
        )
    return Shard(placement.dim % x.dim())


def runs_torchs_way(style: str, what: str, why: str) -> None:
    """Says once (INFO, logger ``fastmesh.parallel``) that a layout runs as torch's style runs it, a DTensor
    redistribution that is not fused into a matmul, and why."""
    log_once(
        logger, logging.INFO, (style, what), "%s: %s runs as torch's style runs it (not fused): %s", style, what, why
    )


def check_fp8(config, style: str):
    """The ``fp8`` keyword: None or a Float8Config the fused fronts can run (current scaling; tensor-wise,
    row-wise, MX or block1x128), checked when the style is built rather than at the first forward."""
    return None if config is None else check_config(config, style)


def pipeline_pieces(pieces, chunks, style: str) -> int | None:
    """The ``pieces`` keyword (``chunks`` its deprecated alias): None for the op's plan per call, else an int
    >= 0. The FutureWarning points at the code that built the style."""
    pieces = resolve_pieces(pieces, chunks, style, stacklevel=4)
    if pieces is not None:
        check_pieces(pieces, style)
    return pieces


def check_mesh(mesh: DeviceMesh, style: str) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{style}: parallelize_module must be given a 1-D device mesh (the TP axis, e.g. mesh['tp']), "
            f"got a {mesh.ndim}-D mesh with axes {mesh.mesh_dim_names}"
        )


def check_linear_names(linears, style: str) -> tuple[str, ...] | None:
    """The ``linears`` keyword: None, or one or more distinct submodule names."""
    if linears is None:
        return None
    if isinstance(linears, str) or not all(isinstance(name, str) and name for name in linears):
        raise TypeError(f"{style}: linears must be a sequence of submodule names, got {linears!r}")
    names = tuple(linears)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{style}: linears must name one or more distinct submodules, got {names!r}")
    return names


def check_input_features(
    x: torch.Tensor, in_features: int, style: str, what: str, mesh: DeviceMesh | None = None, linears=None
) -> None:
    """The input's last dim is what the linear multiplies, named in the style's words rather than the fused op's:
    ``in_features``, or for a column-sharded input this rank's piece of them over ``mesh`` (torch's: even, or
    ``ceil(in_features / tp)`` on the first ranks); ``linears``: the siblings of a shared gather, whose in_features
    it is. The message is built only for a mismatch."""
    tp = 1 if mesh is None else mesh.size()
    expected = in_features // tp if in_features % tp == 0 else own_rows(in_features, tp, mesh.get_local_rank())
    if x.shape[-1] == expected:
        return
    if tp > 1:
        why = f" on this rank (its piece of in_features {in_features} over TP degree {tp}: a colwise output's columns)"
    else:
        why = f" (the in_features of {linears})" if linears else " (its in_features)"
    raise ValueError(
        f"{style}: {what}'s input has {x.shape[-1]} features (the last dim of shape {list(x.shape)}), expected "
        f"{expected}{why}"
    )


def check_linear(module, style: str, what: str, mesh: DeviceMesh, sharded_features: str, fp8) -> nn.Linear:
    """``module`` is an ``nn.Linear`` whose dtype the fp8 config (if any) can serve. Its ``sharded_features`` need
    not divide by the TP degree: torch's uneven shards are padded to equal ones for the fused ops."""
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{style}: {what} must be an nn.Linear, got {type(module).__name__}")
    tp = mesh.size()
    if isinstance(module.weight, DTensor):
        raise ValueError(
            f"{style}: {what} is already parallelized (its weight is a DTensor placed "
            f"{module.weight.placements}); apply one style per linear"
        )
    if fp8 is not None and module.weight.dtype not in OUT_DTYPES:
        raise TypeError(
            f"{style}: fp8 cannot serve {what}'s dtype {module.weight.dtype}: FP8 matmuls produce "
            "float32, bfloat16 or float16; convert the module or drop fp8"
        )
    # MX blocks run along each rank's contraction: all of in_features column-wise, its (padded) TP shard row-wise.
    contraction = full_rows(module.in_features, tp) if sharded_features == "in_features" else module.in_features
    if fp8 is not None and fp8.granularity == MX and contraction % MX_BLOCK:
        if contraction == module.in_features:
            per_rank = f"{what}.in_features = {contraction}"
        elif module.in_features % tp == 0:
            per_rank = f"{what}.in_features / {tp} = {contraction}"
        else:  # torch's uneven pieces, padded to the largest
            per_rank = f"{what}.in_features = {module.in_features} over {tp} ranks, padded to {contraction}"
        raise ValueError(
            f"{style}: fp8 granularity 'mx' needs each rank's contraction ({per_rank}) to be a multiple of "
            f"{MX_BLOCK}; pick another granularity for this linear"
        )
    return module


def shard_parameters(
    module: nn.Linear, mesh: DeviceMesh, weight: Placement, bias: Placement, src_data_rank: int | None
) -> None:
    """Replace the weight and bias with DTensors placed as torch's Colwise/RowwiseParallel place them, so that
    state dicts are interchangeable with the native plan's."""
    for name, placement in (("weight", weight), ("bias", bias)):
        param = getattr(module, name)
        if param is None:
            continue
        sharded = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def local_parameter(module: nn.Linear, name: str, style: str, what: str) -> torch.Tensor | None:
    """This rank's TP shard of a parameter (differentiable: its gradient lands on the DTensor parameter)."""
    param = getattr(module, name)
    if not isinstance(param, DTensor):
        return param
    if param.device_mesh.ndim != 1:
        # FSDP2 unshards a 2-D (dp, tp) parameter to its TP shard in the pre-forward of the module it wraps;
        # a fused call that reads a sibling's weights from the parent runs before that.
        raise RuntimeError(
            f"{style}: {what}.{name} is still sharded over a {param.device_mesh.ndim}-D mesh when the fused matmul "
            "runs; apply fully_shard to a module that contains all the fused linears (e.g. the block), not to "
            "the linears themselves"
        )
    return param.to_local()


def sequence_dim(placement: Shard, x: torch.Tensor, style: str, what: str) -> int:
    """The non-negative dim a ``Shard`` placement names on ``x``: a sequence dim, not the last (the features)."""
    dim = placement.dim
    if not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1:
        raise ValueError(
            f"{style}: {what} Shard({dim}) must name a sequence dim of the {x.dim()}-D tensor "
            f"(any dim but the last, the features), got shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def is_dtensor_input(x, mesh: DeviceMesh, style: str) -> bool:
    """Whether the module's input ``x`` is a DTensor (then on the style's mesh); raises for a non-tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{style}: the module's input must be a tensor, got {type(x).__name__}")
    if isinstance(x, DTensor) and x.device_mesh != mesh:
        raise ValueError(f"{style}: the input DTensor's mesh {x.device_mesh} is not the style's mesh {mesh}")
    return isinstance(x, DTensor)


def local_input(x, mesh: DeviceMesh, layout: Placement, style: str):
    """The column-parallel input as the style will use it, its placement, and, for a sequence-sharded DTensor, its
    global sequence length (else None: a plain tensor's shards are equal). A DTensor's own placement wins over
    ``input_layouts`` (which only annotates plain tensors, as in torch's styles). A sequence-sharded input comes back
    as its local shard, which may be torch's uneven piece; a replicated one as it is (a plain tensor, or a
    ``Replicate()`` DTensor). Features sharded (``Shard(-1)``) or ``Partial()`` sums are made a ``Replicate()`` DTensor
    by DTensor, as torch's ``ColwiseParallel`` makes them."""
    dtensor = is_dtensor_input(x, mesh, style)
    placement = normalized(x.placements[0] if dtensor else layout, x, style, "input_layouts")
    if isinstance(placement, Replicate):
        return x, placement, None
    if isinstance(placement, Shard) and not shards_last_dim(placement, x.dim()):
        return (x.to_local(), placement, x.shape[placement.dim]) if dtensor else (x, placement, None)
    runs_torchs_way(
        style, f"an input placed {placement!r}", "DTensor redistributes it to Replicate() before the matmul"
    )
    if not dtensor:
        x = DTensor.from_local(x, mesh, [placement], run_check=False)
    return x.redistribute(mesh, [Replicate()]), Replicate(), None


def as_output(local: torch.Tensor, mesh: DeviceMesh, placement: Placement, use_local_output: bool, shape=None):
    """What the module returns: ``local`` itself, or a DTensor of it placed ``placement`` (of global ``shape``
    where given: an uneven shard's DTensor needs it)."""
    if use_local_output:
        return local
    if shape is not None:
        return wrap_local(local, mesh, placement, shape)
    return DTensor.from_local(local, mesh, [placement], run_check=False)

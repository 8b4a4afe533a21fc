"""Plain-tensor tensor-parallel linears in Megatron-LM / vLLM conventions: local shards in, local tensors out, the TP
collectives fused into the matmuls (the fused backend for frameworks that do not use DTensor).

Each module owns this rank's shard of the weight as a plain ``nn.Parameter`` and its forward returns
``(output, output_bias)``. Which fused op a flag combination runs::

    module                 flags                       forward                              input's gradient
    ColumnParallelLinear   sequence_parallel=True      all_gather_matmul (sequence_dim)     matmul_reduce_scatter
                           (default)                   local matmul                         matmul_all_reduce
                           gather_output=True          matmul_all_gather                    matmul_all_reduce
    RowParallelLinear      sequence_parallel=True      matmul_reduce_scatter (sequence_dim) all_gather_matmul
                           (default)                   matmul_all_reduce                    local
                           reduce_results=False        local matmul (a partial sum)         local

``fp8=Float8Config(...)`` runs the same ops' FP8 forms (``gather_output`` then gathers after an FP8 local matmul, and
says so once in the ``fastmesh.nn`` logger). ``input_is_parallel=False`` splits a replicated input's features
locally (backward: an all-gather). A bias is added once, after any reduction; a bias added to sequence-sharded rows
gets its gradient all-reduced in backward, so every rank's replica holds the whole gradient.

State dicts hold the local shards; ``load_state_dict`` also takes the full tensors (or a DTensor) and keeps this
rank's part. Errors: TypeError / ValueError naming the argument, at construction or before any collective.
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fastmesh._log import log_once
from fastmesh.mesh import group_name as _group_name_of
from fastmesh.ops import all_gather_matmul, autocast, matmul_all_reduce, matmul_reduce_scatter
from fastmesh.ops._checks import MX, MX_BLOCK, check_bool
from fastmesh.ops._collectives import all_gather, all_reduce
from fastmesh.ops._fp8_operands import check_config, check_fp8_dgrad_columns, fp8_dgrad_possible
from fastmesh.ops._fused_common import as_matrix, resolve_group
from fastmesh.ops.fp8_config import Float8Config
from fastmesh.ops.replicated_input import replicated_input_matmul

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]

logger = logging.getLogger("fastmesh.nn")


# ---- the collectives around the fused matmuls (autograd as Megatron's mappings) ----


class _GatherColumns(torch.autograd.Function):
    """Every rank's ``t`` concatenated along the last dim; backward: this rank's block of the (replicated) gradient,
    no communication (Megatron's ``gather_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group_name: str):
        ctx.group_name = group_name
        # The functional all-gather (its own autograd unused here: this Function's is the replicated output's). Not
        # traced_all_gather: it resolves the group's size, which dynamo cannot trace.
        return all_gather(t, t.dim() - 1, group_name)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.fastmesh.rank_columns(grad.contiguous(), ctx.group_name), None


class _OwnColumns(torch.autograd.Function):
    """This rank's block of a replicated ``x``'s last dim; backward: every rank's gradient block gathered
    (Megatron's ``scatter_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str):
        ctx.group_name = group_name
        return torch.ops.fastmesh.rank_columns(x.contiguous(), group_name)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), grad.dim() - 1, ctx.group_name), None


class _SummedOverRanks(torch.autograd.Function):
    """A replicated bias as it is, whose gradient is all-reduced in backward: a bias added to this rank's rows of a
    sequence-sharded output gets a gradient summed over those rows only, and each replica needs the sum over all
    (Megatron tags such a bias ``sequence_parallel`` for ``finalize_model_grads``; here the module is complete on its
    own, so do not tag it too)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, group_name: str):
        ctx.group_name = group_name
        return bias.view_as(bias)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), "sum", ctx.group_name), None


class _BiasOnFirstRank(torch.autograd.Function):
    """A partial sum plus the bias on the group's first rank only (vLLM's ``reduce_results=False``): the sum over the
    ranks then holds it once. The output's gradient is the reduced output's, the same on every rank, so every rank's
    replica gets the bias's whole gradient, not only the first."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, bias: torch.Tensor, first: bool):
        return out + bias if first else out.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, as_matrix(grad).sum(0) if ctx.needs_input_grad[1] else None, None


def _plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Under autocast the bias in the product's dtype, as ``F.linear`` adds it."""
    return out if bias is None else out + autocast.cast(bias)


# ---- what both modules share: the group, checks, parameters, state dicts ----


def _resolve(group, owner: str) -> tuple[str, int, int]:
    """(group name, size, this rank's index) of the ``group`` argument."""
    if isinstance(group, DeviceMesh) and group.ndim != 1:
        raise ValueError(
            f"{owner}: group must be a 1-D DeviceMesh (the TP axis, e.g. mesh['tp']), got a {group.ndim}-D mesh with "
            f"axes {group.mesh_dim_names}"
        )
    try:
        name = _group_name_of(group)
    except TypeError:
        raise TypeError(
            f"{owner}: group must be a ProcessGroup, a 1-D DeviceMesh or None (the default group), got "
            f"{type(group).__name__}"
        ) from None
    except (ValueError, RuntimeError) as error:
        raise type(error)(f"{owner}: group: {error}") from error
    process_group = resolve_group(name, owner)
    return name, process_group.size(), process_group.rank()


def _check_features(value, owner: str, arg: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {arg} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{owner}: {arg} must be >= 1, got {value}")


def _check_divisible(value: int, tp: int, owner: str, arg: str, held: str) -> int:
    if value % tp:
        raise ValueError(
            f"{owner}: {arg}={value} must be divisible by the group size {tp} (each rank holds {arg} / {tp} {held})"
        )
    return value // tp


def _check_fp8_contraction(fp8, k: int, owner: str, what: str) -> None:
    """MX blocks of 32 run along each rank's contraction: checked when the module is built, in its words."""
    if fp8 is not None and fp8.granularity == MX and k % MX_BLOCK:
        raise ValueError(
            f"{owner}: fp8 granularity 'mx' needs each rank's contraction ({what} = {k}) to be a multiple of "
            f"{MX_BLOCK}; pick another granularity for this layer"
        )


def _mark_partitioned(param: nn.Parameter, dim: int) -> None:
    """Megatron's tensor-parallel attributes (``set_tensor_model_parallel_attributes``): its gradient-norm and
    checkpoint code count a partitioned parameter on every rank, a replicated one once."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


class _ParallelLinear(nn.Module):
    """The parts both modules share. ``_partition_dims``: each parameter's sharded dim (None: replicated)."""

    _partition_dims: ClassVar[dict[str, int | None]]

    def _setup(self, in_features, out_features, group, bias, fp8, sequence_parallel, sequence_dim, skip_bias_add):
        owner = type(self).__name__
        _check_features(in_features, owner, "in_features")
        _check_features(out_features, owner, "out_features")
        for arg, value in (("bias", bias), ("sequence_parallel", sequence_parallel), ("skip_bias_add", skip_bias_add)):
            check_bool(value, owner, arg)
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"{owner}: sequence_dim must be an int, got {type(sequence_dim).__name__}")
        self.in_features, self.out_features = in_features, out_features
        self.group_name, self.tp_size, self.tp_rank = _resolve(group, owner)
        self.sequence_parallel, self.sequence_dim, self.skip_bias_add = sequence_parallel, sequence_dim, skip_bias_add
        self.fp8 = None if fp8 is None else check_config(fp8, owner)

    def _make_parameters(self, weight_shape, bias_shape, device, dtype) -> None:
        owner = type(self).__name__
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(weight_shape, **factory))
        if bias_shape is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_shape, **factory))
        if self.fp8 is not None:
            check_config(self.fp8, owner, self.weight.dtype)
        self._mark_partitioned()
        self.reset_parameters()

    def _mark_partitioned(self) -> None:
        for name, dim in self._partition_dims.items():
            param = getattr(self, name)
            if param is not None and dim is not None:
                _mark_partitioned(param, dim)

    def _apply(self, fn, recurse=True):
        # A conversion that makes new Parameters (meta -> to_empty, a move across devices) drops their attributes.
        module = super()._apply(fn, recurse)
        self._mark_partitioned()
        return module

    def reset_parameters(self) -> None:
        """The weight shard from ``nn.Linear``'s distribution for the whole layer (uniform in +-1/sqrt(in_features)),
        drawn from this rank's RNG; the bias zeroed, as Megatron does (a replicated bias stays equal on every rank)."""
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if name == "weight" else (self.out_features,)

    def _check_input(self, x, features: int, why: str) -> None:
        owner = type(self).__name__
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            got = "a DTensor (use fastmesh.parallel's styles for DTensors)" if isinstance(x, DTensor) else type(x)
            raise TypeError(f"{owner}: the input must be a plain torch.Tensor, got {got}")
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(f"{owner}: the input's last dim must be {why}, got shape {list(x.shape)}")

    def _sequence_dim_of(self, x: torch.Tensor) -> int:
        """``sequence_dim`` on ``x``, non-negative: any dim but the last (the features)."""
        dim = self.sequence_dim
        if not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1:
            raise ValueError(
                f"{type(self).__name__}: sequence_dim={dim} must name a sequence dim of the input (any dim but the "
                f"last, the features), got an input of shape {list(x.shape)}"
            )
        return dim % x.dim()

    def _check_fp8_dgrad(self, x: torch.Tensor, n: int) -> None:
        """An FP8 dgrad in MX blocks contracts over the product's ``n`` columns: said at the forward, in the module's
        words, before a backward could fail half-way."""
        if self.fp8 is not None and fp8_dgrad_possible(self.fp8, x):
            check_fp8_dgrad_columns(self.fp8, n, type(self).__name__)

    def _own_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        dim = self._partition_dims[name]
        if dim is None:
            return full
        size = getattr(self, name).shape[dim]
        return full.narrow(dim, self.tp_rank * size, size).clone()

    def _is_own_shard(self, name: str, value: DTensor) -> bool:
        """Whether the DTensor ``value`` is sharded as this module shards parameter ``name``, over its group (the same
        answer on every rank: a rank that answers no gathers the full tensor, a collective)."""
        dim, mesh, (placement, *_) = self._partition_dims[name], value.device_mesh, value.placements
        return (
            dim is not None
            and mesh.ndim == 1
            and isinstance(placement, Shard)
            and placement.dim % value.dim() == dim
            and _group_name_of(mesh) == self.group_name
            and tuple(value.to_local().shape) == tuple(getattr(self, name).shape)
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        """Each parameter from this rank's shard or from the full tensor (a DTensor: its local shard where it is this
        rank's, else its full tensor), of which this rank keeps its part; any other shape is an error naming both."""
        refused = {}
        for name, param in self._parameters.items():
            key = prefix + name
            if param is None or key not in state_dict:
                continue
            value, local, full = state_dict[key], tuple(param.shape), self._full_shape(name)
            if isinstance(value, DTensor):
                value = value.to_local() if self._is_own_shard(name, value) else value.full_tensor()
            if tuple(value.shape) == local:
                state_dict[key] = value
            elif tuple(value.shape) == full:
                state_dict[key] = self._own_part(name, value)
            else:
                refused[key] = state_dict.pop(key)
                errors.append(
                    f"{type(self).__name__}: {key} has shape {list(value.shape)}, expected this rank's shard "
                    f"{list(local)} (rank {self.tp_rank} of a group of {self.tp_size}) or the full tensor {list(full)}"
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        for key, value in refused.items():
            if key in missing_keys:
                missing_keys.remove(key)
            state_dict[key] = value

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, **kwargs):
        """This module with this rank's part of ``linear``'s weight and bias (copied; ``linear`` is unchanged), on its
        device and in its dtype. ``kwargs``: the module's other keyword arguments (not ``bias``, ``device``,
        ``dtype``: they come from ``linear``)."""
        owner = cls.__name__
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{owner}.from_linear: linear must be an nn.Linear, got {type(linear).__name__}")
        if isinstance(linear.weight, DTensor):
            raise ValueError(
                f"{owner}.from_linear: linear is already parallelized (its weight is a DTensor placed "
                f"{linear.weight.placements}); pass the unsharded nn.Linear"
            )
        taken = sorted({"bias", "device", "dtype"} & kwargs.keys())
        if taken:
            raise TypeError(f"{owner}.from_linear: {', '.join(taken)} come(s) from linear; do not pass them")
        weight = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            group=group,
            bias=linear.bias is not None,
            device="meta",
            dtype=weight.dtype,
            **kwargs,
        )
        module.to_empty(device=weight.device)
        module.load_state_dict(linear.state_dict())
        for name, param in module.named_parameters():
            param.requires_grad_(getattr(linear, name).requires_grad)
        return module

    def _flags(self) -> str:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_size={self.tp_size}, {self._flags()}, skip_bias_add={self.skip_bias_add}, fp8={self.fp8}"
        )


# ---- the modules ----


class ColumnParallelLinear(_ParallelLinear):
    """A linear whose weight is split along its output features: ``Y = X A^T + b`` with ``A`` and ``b`` sharded by
    rows, each rank computing its columns of ``Y`` (Megatron-LM's / vLLM's ``ColumnParallelLinear``).

    Equivalent to (``x`` the whole input; ``weight`` [out/tp, in] and ``bias`` [out/tp] this rank's rows)::

        x = torch.cat(all_gather(x_shard), dim=sequence_dim)  # sequence_parallel: the gather fused into the matmul
        y = x @ weight.T + bias                               # this rank's columns of nn.Linear(in, out)(x)
        y = torch.cat(all_gather(y), dim=-1)                  # gather_output: every column (the matmul's own gather)
        return (y, None)                                      # skip_bias_add: (y without the bias, bias)

    Shapes per rank (``tp`` the group's size; ``S`` the length of ``sequence_dim``, here dim 0 as in Megatron)::

        flags                    input            weight        output          input's gradient
        (default)                [S, B, in]       [out/tp, in]  [S, B, out/tp]  all-reduced (fused)
        sequence_parallel=True   [S/tp, B, in]    [out/tp, in]  [S, B, out/tp]  reduce-scattered (fused)
        gather_output=True       [S, B, in]       [out/tp, in]  [S, B, out]     all-reduced (fused)

    Args:
        in_features (int): the input's features (every rank sees all of them).
        out_features (int): the layer's output features, divisible by the group size.

    Keyword Args:
        group: ``ProcessGroup``, 1-D ``DeviceMesh`` (the TP axis), or ``None`` for the default group.
        bias (bool): a bias, sharded as the output features (initialized to zero, as Megatron does).
        gather_output (bool): return every column (all-gathered; backward keeps this rank's columns). Not with
            ``sequence_parallel`` (Megatron asserts the same).
        sequence_parallel (bool): the input is this rank's shard along ``sequence_dim``; it is gathered inside the
            matmul (``fastmesh.all_gather_matmul``), and its gradient reduce-scattered inside the backward matmul.
        sequence_dim (int): the input's sharded dim for ``sequence_parallel``: any dim but the last (default 0,
            Megatron's ``[s, b, h]``; 1 for ``[b, s, h]``).
        skip_bias_add (bool): return the bias (this rank's shard, even with ``gather_output``: Megatron's and vLLM's
            contract) rather than adding it, for a fused bias + activation.
        fp8 (Float8Config): run the matmuls in FP8 (current scaling; tensor-wise, row-wise, MX or block1x128), as the
            fused ops' ``fp8=`` does.
        keep_gathered (bool): with ``sequence_parallel``, keep the gathered input for the weight's gradient (``tp``
            times the shard's memory until backward) instead of this rank's shard, which backward gathers again while
            the input's gradient is computed (default, as Megatron-LM does). The gradients are the same either way.
        device, dtype: of the parameters.

    Returns:
        ``(output, output_bias)``: ``output_bias`` is the bias when ``skip_bias_add``, else None.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> fc1 = ColumnParallelLinear(1024, 4096, sequence_parallel=True)  # x [S/tp, B, 1024] -> [S, B, 4096/tp]
        >>> h, _ = fc1(x_shard)
    """

    _partition_dims: ClassVar[dict[str, int | None]] = {"weight": 0, "bias": 0}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group=None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        fp8: Float8Config | None = None,
        keep_gathered: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        owner = type(self).__name__
        self._setup(in_features, out_features, group, bias, fp8, sequence_parallel, sequence_dim, skip_bias_add)
        check_bool(gather_output, owner, "gather_output")
        check_bool(keep_gathered, owner, "keep_gathered")
        self.keep_gathered = keep_gathered
        if gather_output and sequence_parallel:
            raise ValueError(
                f"{owner}: gather_output=True and sequence_parallel=True conflict (Megatron asserts the same): a "
                "sequence-parallel output stays column-sharded; gather it after the layer, or drop sequence_parallel"
            )
        self.gather_output = gather_output
        self.output_size_per_partition = _check_divisible(out_features, self.tp_size, owner, "out_features", "rows")
        _check_fp8_contraction(self.fp8, in_features, owner, "in_features")
        self._make_parameters(
            (self.output_size_per_partition, in_features),
            (self.output_size_per_partition,) if bias else None,
            device,
            dtype,
        )

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_input(input_, self.in_features, f"in_features={self.in_features}")
        bias = None if self.skip_bias_add else self.bias
        self._check_fp8_dgrad(input_, self.output_size_per_partition)
        if self.sequence_parallel:
            dim = self._sequence_dim_of(input_)
            _, (out,) = all_gather_matmul(
                input_, [self.weight.t()], dim, group=self.group_name, fp8=self.fp8, keep_gathered=self.keep_gathered
            )
            out = _plus_bias(out, bias)
        elif not self.gather_output:
            (out,) = replicated_input_matmul(input_, [self.weight], self.group_name, fp8=self.fp8)
            out = _plus_bias(out, bias)
        elif self.fp8 is None:  # every rank's columns, gathered while they are multiplied
            (out,) = replicated_input_matmul(input_, [self.weight], self.group_name, gathered=True)
            if bias is not None:
                out = out + _GatherColumns.apply(autocast.cast(bias), self.group_name)
        else:
            owner = type(self).__name__
            said = "gather_output with fp8: the output's gather follows the FP8 matmul (no FP8 matmul_all_gather)"
            log_once(logger, logging.INFO, (owner, "fp8 gather_output"), "%s: %s", owner, said)
            (out,) = replicated_input_matmul(input_, [self.weight], self.group_name, fp8=self.fp8)
            out = _GatherColumns.apply(_plus_bias(out, bias), self.group_name)
        return out, (self.bias if self.skip_bias_add else None)

    def _flags(self) -> str:
        return (
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
            f"sequence_dim={self.sequence_dim}, keep_gathered={self.keep_gathered}"
        )


class RowParallelLinear(_ParallelLinear):
    """A linear whose weight is split along its input features: ``Y = X A^T + b`` with ``A`` sharded by columns and
    ``X`` by features (a column-parallel layer's output); the ranks' partial products are summed inside the matmul,
    and the bias, replicated, is added once after (Megatron-LM's / vLLM's ``RowParallelLinear``).

    Equivalent to (``x`` this rank's input features; ``weight`` [out, in/tp] this rank's columns, ``bias`` [out])::

        x = x_full.chunk(tp, dim=-1)[rank]           # input_is_parallel=False: split locally (backward: gather)
        y = all_reduce(x @ weight.T) + bias          # sequence_parallel: reduce_scatter(..., sequence_dim) + bias
        return (y, None)                             # skip_bias_add: (y without the bias, bias)
        # reduce_results=False: x @ weight.T (+ bias on the group's first rank): a partial sum the caller reduces

    Shapes per rank (``tp`` the group's size; ``S`` the length of ``sequence_dim``, here dim 0 as in Megatron)::

        flags                    input           weight        output                  input's gradient
        (default)                [S, B, in/tp]   [out, in/tp]  [S, B, out]    replicated  local
        sequence_parallel=True   [S, B, in/tp]   [out, in/tp]  [S/tp, B, out]             all-gathered (fused)
        input_is_parallel=False  [S, B, in]      [out, in/tp]  as above                   all-gathered
        reduce_results=False     [S, B, in/tp]   [out, in/tp]  [S, B, out]    partial     local

    Args:
        in_features (int): the layer's input features, divisible by the group size.
        out_features (int): its output features (every rank produces all of them).

    Keyword Args:
        group: ``ProcessGroup``, 1-D ``DeviceMesh`` (the TP axis), or ``None`` for the default group.
        bias (bool): a bias, replicated (initialized to zero, as Megatron does). With ``sequence_parallel`` each rank
            adds it to its own rows, and its gradient is all-reduced in backward (the returned ``output_bias`` too,
            with ``skip_bias_add``): do not also tag it ``sequence_parallel`` for Megatron's ``finalize_model_grads``.
        input_is_parallel (bool): the input holds this rank's features (default); False: a replicated input whose
            features are split here. Not with ``sequence_parallel`` (Megatron refuses it too).
        sequence_parallel (bool): reduce-scatter the output along ``sequence_dim``, whose length the group size must
            divide (``fastmesh.matmul_reduce_scatter``); else all-reduce it (``fastmesh.matmul_all_reduce``).
        sequence_dim (int): the output's scattered dim for ``sequence_parallel``: any dim but the last (default 0).
        reduce_results (bool): False returns this rank's partial sum unreduced (vLLM), the bias added on the group's
            first rank only (every rank's bias gets the whole gradient). Not with ``sequence_parallel``.
        skip_bias_add (bool): return the bias rather than adding it.
        fp8 (Float8Config): run the matmul in FP8, as the fused ops' ``fp8=`` does (the product is reduced in the
            input's dtype).
        device, dtype: of the parameters.

    Returns:
        ``(output, output_bias)``: ``output_bias`` is the bias when ``skip_bias_add``, else None.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> fc2 = RowParallelLinear(4096, 1024, sequence_parallel=True)  # h [S, B, 4096/tp] -> [S/tp, B, 1024]
        >>> y_shard, _ = fc2(h)
    """

    _partition_dims: ClassVar[dict[str, int | None]] = {"weight": 1, "bias": None}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group=None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        reduce_results: bool = True,
        skip_bias_add: bool = False,
        fp8: Float8Config | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        owner = type(self).__name__
        self._setup(in_features, out_features, group, bias, fp8, sequence_parallel, sequence_dim, skip_bias_add)
        check_bool(input_is_parallel, owner, "input_is_parallel")
        check_bool(reduce_results, owner, "reduce_results")
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                f"{owner}: sequence_parallel=True needs input_is_parallel=True (Megatron refuses the pair too): a "
                "sequence-parallel row layer takes a column-parallel layer's output"
            )
        if sequence_parallel and not reduce_results:
            raise ValueError(
                f"{owner}: sequence_parallel=True reduce-scatters the output, so reduce_results=False conflicts with "
                "it; drop one"
            )
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        self.input_size_per_partition = _check_divisible(in_features, self.tp_size, owner, "in_features", "columns")
        _check_fp8_contraction(self.fp8, self.input_size_per_partition, owner, "in_features / group size")
        self._make_parameters(
            (out_features, self.input_size_per_partition), (out_features,) if bias else None, device, dtype
        )

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = self.input_size_per_partition
        if self.input_is_parallel:
            self._check_input(input_, k, f"this rank's in_features / {self.tp_size} = {k} (input_is_parallel=True)")
            x = input_
        else:
            self._check_input(input_, self.in_features, f"in_features={self.in_features} (input_is_parallel=False)")
            x = _OwnColumns.apply(input_, self.group_name)
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:
            dim = self._sequence_dim_of(x)
            if x.shape[dim] % self.tp_size:
                raise ValueError(
                    f"{type(self).__name__}: sequence_parallel scatters the output along sequence_dim="
                    f"{self.sequence_dim}, whose size {x.shape[dim]} (input shape {list(x.shape)}) is not divisible by "
                    f"the group size {self.tp_size}"
                )
            self._check_fp8_dgrad(x, self.out_features)
            out = matmul_reduce_scatter(x, self.weight.t(), dim, group=self.group_name, fp8=self.fp8)
            out = _plus_bias(out, self._row_shards_bias(bias))
        elif self.reduce_results:
            out = _plus_bias(matmul_all_reduce(x, self.weight.t(), group=self.group_name, fp8=self.fp8), bias)
        else:
            self._check_fp8_dgrad(x, self.out_features)
            if self.fp8 is None:
                out = torch.nn.functional.linear(x, self.weight)
            else:  # a local FP8 matmul whose input gradient stays local
                (out,) = replicated_input_matmul(
                    x, [self.weight], self.group_name, fp8=self.fp8, reduce_input_grad=False
                )
            if bias is not None and torch.is_grad_enabled() and bias.requires_grad:
                out = _BiasOnFirstRank.apply(out, autocast.cast(bias), self.tp_rank == 0)
            elif bias is not None and self.tp_rank == 0:
                out = _plus_bias(out, bias)
        if not self.skip_bias_add:
            return out, None
        return out, self._row_shards_bias(self.bias) if self.sequence_parallel else self.bias

    def _row_shards_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The bias to add to this rank's rows of the sequence-sharded output (its gradient then all-reduced)."""
        if bias is None or not (torch.is_grad_enabled() and bias.requires_grad):
            return bias
        return _SummedOverRanks.apply(bias, self.group_name)

    def _flags(self) -> str:
        return (
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}, "
            f"sequence_dim={self.sequence_dim}, reduce_results={self.reduce_results}"
        )

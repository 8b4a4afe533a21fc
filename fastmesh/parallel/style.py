"""Fused tensor-parallel styles for ``parallelize_module``: the TP collectives run inside the matmuls
(``fastmesh.all_gather_matmul`` / ``matmul_reduce_scatter`` / ``matmul_all_reduce`` / ``matmul_all_gather``),
moving exactly the data of torch's native plan, one collective for one (or fewer: sibling linears share one),
forward and backward.

Every argument means what it means in torch's ``ColwiseParallel`` / ``RowwiseParallel``, defaults included: a
plan with the names swapped computes what torch's computes. Shapes per rank (``tp`` the TP degree, ``S`` the
sequence length, ``D`` the input features, ``N`` a linear's ``out_features``; the sequence dim may be any dim but
the last)::

    style (layouts)                     input                     weight (local)       output
    FusedColwiseParallel()              [B, S, D]     Replicate   [N/tp, D]  Shard(0)  [B, S, N/tp]  Shard(-1)
      input_layouts=Shard(1)            [B, S/tp, D]  Shard(1)                         [B, S, N/tp]  Shard(-1)
      output_layouts=Replicate()        either of those                                [B, S, N]     Replicate
    FusedRowwiseParallel()              [B, S, D/tp]  Shard(-1)   [N, D/tp]  Shard(1)  [B, S, N]     Replicate
      output_layouts=Shard(1)           [B, S, D/tp]  Shard(-1)                        [B, S/tp, N]  Shard(1)

Fused: those layouts. Any other placement torch's styles take (an input placed ``Shard(-1)`` or ``Partial()`` for
colwise, or anything but ``Shard(-1)`` for rowwise; a colwise output placed ``Shard(seq)`` or ``Partial()``, a
rowwise one placed ``Shard(-1)`` or ``Partial()``) runs as torch's style runs it, a DTensor redistribution before or
after the fused matmul (or, for those rowwise outputs, torch's own DTensor matmul), said once per style and layout
(INFO, logger ``fastmesh.parallel``). The sequence-parallel plan passes ``input_layouts=Shard(1)`` /
``output_layouts=Shard(1)``, as torch's own sequence-parallel plans do.

Plain-PyTorch equivalents (``x_shard`` this rank's sequence shard; weights and biases this rank's shards)::

    y_i = x @ w_i.T + b_i                                              # colwise, a replicated x: local
    x = torch.cat(all_gather(x_shard), dim=1); y_i = x @ w_i.T + b_i   #   input_layouts=Shard(1) (linears=: one gather)
    y = torch.cat(all_gather(y_i), dim=-1)    # output_layouts=Replicate(): the larger gather in the matmul
    y = all_reduce(h_shard @ w.T) + b                                  # rowwise
    y_shard = reduce_scatter(h_shard @ w.T, dim=1) + b                  #   output_layouts=Shard(1)

Autograd: all_gather_matmul and matmul_reduce_scatter are each other's backward. A replicated plain-tensor
input's gradient is summed over the ranks in backward by one ``matmul_all_reduce`` for all the linears (torch's
ColwiseParallel all-reduces it after its matmul); a replicated output's backward needs no collective.
Parameters are DTensors placed as torch's ``ColwiseParallel`` / ``RowwiseParallel`` place them: state dicts,
DCP and FSDP2 see what they see under the native plan.

A sequence length ``S`` the TP degree does not divide (a DTensor input's, or the rowwise input's whole sequence)
runs on torch's uneven shards (``ceil(S/tp)`` rows per rank, the last ranks fewer or none), padded with zero rows
for the fused ops and the padding dropped from their results (:mod:`fastmesh.ops._shards`); so do ``out_features``
/ ``in_features`` the TP degree does not divide (weights sharded as torch shards them, padded for the fused ops).

Errors: a bad keyword raises ``TypeError`` / ``ValueError`` naming the style when it is built, a module it
cannot serve when it is applied, an input it cannot take at the forward; all before any collective.
A whole Llama block's plan, and why the styles are built as they are: ``docs/design/tp-styles.md``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from fastmesh._log import log_once
from fastmesh.mesh import group_name
from fastmesh.ops import all_gather_matmul, autocast, matmul_all_gather, matmul_all_reduce, matmul_reduce_scatter
from fastmesh.ops._checks import check_bool
from fastmesh.ops._collectives import all_gather
from fastmesh.ops._dtensor import wrap_local
from fastmesh.ops._fp8_operands import check_fp8_dgrad_columns, fp8_dgrad_possible
from fastmesh.ops._shards import even_contraction, even_shard, first_rows, own_part, rows_to_scatter
from fastmesh.ops.replicated_input import replicated_input_matmul
from fastmesh.parallel._common import (
    as_output,
    check_fp8,
    check_input_features,
    check_linear,
    check_linear_names,
    check_mesh,
    check_placement,
    is_dtensor_input,
    local_input,
    local_parameter,
    normalized,
    pipeline_pieces,
    runs_torchs_way,
    sequence_dim,
    shard_parameters,
    shards_last_dim,
)
from fastmesh.parallel.shared_gather import SharedGather

__all__ = ["FusedColwiseParallel", "FusedRowwiseParallel"]

logger = logging.getLogger("fastmesh.parallel")

_COLWISE = "FusedColwiseParallel"
_ROWWISE = "FusedRowwiseParallel"


def _plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """This rank's columns plus their bias; under autocast the bias in the product's dtype, as ``F.linear`` adds it."""
    return out if bias is None else out + autocast.cast(bias)


class FusedColwiseParallel(ParallelStyle):
    """Partition ``nn.Linear``s column-wise and fuse the all-gather of their sequence-sharded input into the
    matmul. Applied to a linear, it parallelizes that linear; applied to a parent module with
    ``linears=(names...)``, it parallelizes those sibling linears, which read the same input, with one gather
    whose transfer overlaps all of their matmuls (attention's q/k/v, the SwiGLU's w1/w3).

    With ``linears``, the parent's forward receives the gathered input as a ``Replicate()`` DTensor (as after
    torch's ``PrepareModuleInput(desired_input_layouts=Replicate())``); each listed linear called with it
    returns its precomputed output. Any other use of it in the parent's forward is computed by DTensor, with
    the right gradients; a listed linear called with another input runs on its own (and says so once, in the
    ``fastmesh.parallel`` logger). The parent's input is its forward's first argument, by position or by name.

    Keyword Args:
        input_layouts (Placement, optional):
            The DTensor layout of a plain-tensor input, as in torch's ``ColwiseParallel``: ``Replicate()``
            (default, plain TP): the matmuls are local and the input's gradient, summed over the ranks, is fused
            into its matmul in backward (one all-reduce for all ``linears``); or ``Shard(sequence_dim)``
            (sequence parallel, e.g. ``Shard(1)``), whose gather is fused. A DTensor input's own placement is
            used instead; a sequence-sharded one may hold torch's uneven shards (a length the TP degree does not
            divide); a ``Replicate()`` DTensor runs as torch's ``ColwiseParallel`` (its gradient is reduced where
            it was made replicated). Other placements are made ``Replicate()`` by DTensor, as torch does.
        output_layouts (Placement, optional):
            The DTensor layout of the outputs: ``Shard(-1)`` (default), or ``Replicate()``: the columns
            gathered after the matmul (an LM head's logits), as torch's ``ColwiseParallel`` gathers them. Other
            placements are redistributed from ``Shard(-1)`` by DTensor, as torch does.
        use_local_output (bool, optional):
            Whether the outputs are local :class:`torch.Tensor`\\ s rather than DTensors, default: True.
            ``False`` with ``linears`` gives ``Shard(-1)`` DTensors, for attention code that keeps the global
            head count.
        linears (Sequence[str], optional):
            Names of the parent's ``nn.Linear`` submodules that share the gather; ``None`` (default) when the
            style is applied to a linear itself.
        fp8 (Float8Config, optional):
            Run the matmuls in FP8 (``fastmesh.fp8.Float8Config``, current scaling; tensor-wise, row-wise, MX
            or block1x128): the input shard is quantized and travels as FP8 plus its scales (a replicated
            plain-tensor input is quantized where it is), the weights are quantized per output column (or
            tensor; MX blocks along K; 128x128 for block1x128), and the backward runs in FP8 or high precision
            per ``backward_in_fp8``. Each rank's scales are those of its own shard and travel with it, so no
            amax is reduced across the group.
        pieces (int, optional):
            The fused op's pipeline pieces of rows per rank (default: the op's plan per call).
        chunks (int, optional):
            Deprecated alias of ``pieces`` (FutureWarning; passing both is a ``TypeError``).
        keep_gathered (bool, optional):
            For a sequence-sharded input: keep the gathered input for the weights' gradients (``tp`` times the
            shard's memory until backward; FP8: its FP8 data and scales) instead of this rank's shard, which
            backward gathers again while the input's gradient is computed. Default: ``False``, the shard (as
            Megatron-LM's sequence parallelism). The gradients are the same either way.

    Returns:
        A :class:`ParallelStyle` object that represents the fused column-wise sharding.

    Example::
        >>> # xdoctest: +SKIP("needs a process group")
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> from fastmesh.parallel import FusedColwiseParallel
        >>> tp_mesh = fastmesh.init_mesh(tp=2)
        >>> # sequence parallel: attention's input arrives as local sequence shards [B, S/2, D];
        >>> # q, k and v leave [B, S, H/2], one fused gather for the three
        >>> qkv = FusedColwiseParallel(linears=("wq", "wk", "wv"), input_layouts=Shard(1))
        >>> parallelize_module(block, tp_mesh, {"attention": qkv})
        >>> # an LM head: sequence-sharded input, the logits gathered over the vocabulary
        >>> head = FusedColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        >>> parallelize_module(model, tp_mesh, {"output": head})
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        linears: Sequence[str] | None = None,
        fp8=None,
        pieces: int | None = None,
        chunks: int | None = None,
        keep_gathered: bool = False,
    ):
        super().__init__()
        # torch's ColwiseParallel's defaults: a replicated input, column-sharded outputs.
        self.input_layouts = (check_placement(input_layouts or Replicate(), _COLWISE, "input_layouts"),)
        self.output_layouts = (check_placement(output_layouts or Shard(-1), _COLWISE, "output_layouts"),)
        self.use_local_output = use_local_output
        self.linears = check_linear_names(linears, _COLWISE)
        self.fp8 = check_fp8(fp8, _COLWISE)
        self.pieces = pipeline_pieces(pieces, chunks, _COLWISE)
        check_bool(keep_gathered, _COLWISE, "keep_gathered")
        self.keep_gathered = keep_gathered

    def _prepare_input_fn(self, x, mesh: DeviceMesh) -> tuple[torch.Tensor | DTensor, Placement, int | None]:
        """The input, its placement and a DTensor's global sequence length: a local sequence shard (``Shard``;
        a DTensor's may be uneven), or a ``Replicate()`` DTensor."""
        return local_input(x, mesh, self.input_layouts[0], _COLWISE)

    def _prepare_output_fn(self, out: torch.Tensor, mesh: DeviceMesh, n: int):
        """This rank's columns of ``n``, local or a ``Shard(-1)`` DTensor; for any other ``output_layouts``, the
        columns redistributed to it as torch's ColwiseParallel redistributes them (``Replicate()``: every column
        gathered, whose backward keeps this rank's columns of the gradient: no communication)."""
        columns, shape = Shard(out.dim() - 1), [*out.shape[:-1], n]
        layout = normalized(self.output_layouts[0], out, _COLWISE, "output_layouts")
        if layout == columns:
            return as_output(out, mesh, columns, self.use_local_output, shape)
        if not isinstance(layout, Replicate):
            runs_torchs_way(_COLWISE, f"output_layouts={layout!r}", "DTensor redistributes the Shard(-1) product to it")
        full = wrap_local(out, mesh, columns, shape).redistribute(mesh, [layout])
        return full.to_local() if self.use_local_output else full

    def _local_weights(self, mesh: DeviceMesh, named_linears) -> list[torch.Tensor]:
        """Each linear's weight rows on this rank, as equal shards: torch's uneven pieces of an ``out_features`` the
        TP degree does not divide padded with zero rows, whose columns :meth:`_column_outputs` drops."""
        return [
            even_shard(local_parameter(linear, "weight", _COLWISE, name), 0, linear.out_features, mesh, name)
            for name, linear in named_linears
        ]

    def _column_outputs(self, mesh: DeviceMesh, named_linears, outs) -> list:
        """Each linear's product of padded weight rows (:meth:`_local_weights`) as the module's output: this rank's
        columns, plus their bias, in the output layout."""
        results = []
        for (name, linear), out in zip(named_linears, outs):
            out = own_part(out, out.dim() - 1, linear.out_features, mesh)
            bias = local_parameter(linear, "bias", _COLWISE, name)
            results.append(self._prepare_output_fn(_plus_bias(out, bias), mesh, linear.out_features))
        return results

    def _partition_linear_fn(self, linear: nn.Linear, mesh: DeviceMesh) -> None:
        shard_parameters(linear, mesh, Shard(0), Shard(0), self.src_data_rank)

    def _gathers_output(self, named_linears, return_a: bool) -> bool:
        """Whether, for ``output_layouts=Replicate()``, the matmul is overlapped with the gather of its output
        columns (matmul_all_gather) rather than with its input's: where that moves more (out_features >
        in_features: an LM head's logits). Not for FP8 (no FP8 matmul_all_gather) nor a bias (added to this
        rank's columns before their gather, as torch adds it). The choice is said once."""
        if not isinstance(self.output_layouts[0], Replicate) or return_a or len(named_linears) != 1:
            return False
        linear = named_linears[0][1]
        larger = linear.out_features > linear.in_features
        output = larger and self.fp8 is None and linear.bias is None
        if output:
            said = (
                "the output columns' gather is overlapped with the matmul (matmul_all_gather), the input's not "
                "(a sequence-sharded input is kept gathered for backward, not as its shard)"
            )
        else:
            why = "it moves less" if not larger else "fp8 has no matmul_all_gather" if self.fp8 else "a bias"
            said = f"the output columns' gather is not overlapped ({why})"
        log_once(logger, logging.INFO, (_COLWISE, "replicated output", said), "%s: %s", _COLWISE, said)
        return output

    def _gather_matmul(
        self, mesh: DeviceMesh, named_linears, x_shard: torch.Tensor, placement: Shard, return_a: bool, rows=None
    ):
        """The fused gather + matmuls: (gathered input or None, each linear's output). ``rows``: the global sequence
        length of an input DTensor, whose shard may be uneven (padded to gather: :mod:`fastmesh.ops._shards`)."""
        dim = sequence_dim(placement, x_shard, _COLWISE, "the input's")
        rows = x_shard.shape[dim] * mesh.size() if rows is None else rows
        x_shard = even_shard(x_shard, dim, rows, mesh, f"{_COLWISE}: the input")
        if self._gathers_output(named_linears, return_a):
            # The input gathered by a plain all-gather (its backward reduce-scatters the partial gradient).
            (_, linear), group = named_linears[0], group_name(mesh)
            (weight,) = self._local_weights(mesh, named_linears)  # no bias: _gathers_output
            x = first_rows(all_gather(x_shard, dim, group), dim, rows)
            out = matmul_all_gather(x, weight.t(), group=group, pieces=self.pieces)
            return None, [self._gathered_output(out, mesh, linear.out_features)]
        weights = self._local_weights(mesh, named_linears)
        if self.fp8 is not None and fp8_dgrad_possible(self.fp8, x_shard):  # said here in the style's words
            for (what, _), weight in zip(named_linears, weights):
                check_fp8_dgrad_columns(self.fp8, weight.shape[0], f"{_COLWISE} ({what})")
        a, outs = all_gather_matmul(
            x_shard,
            [w.t() for w in weights],
            dim,
            group=group_name(mesh),
            return_a=return_a,
            pieces=self.pieces,
            fp8=self.fp8,
            keep_gathered=self.keep_gathered,
        )
        outs = [first_rows(out, dim, rows) for out in outs]
        return (None if a is None else first_rows(a, dim, rows)), self._column_outputs(mesh, named_linears, outs)

    def _gathered_output(self, out: torch.Tensor, mesh: DeviceMesh, n: int):
        """The gathered product of padded weight rows as every column of ``n``, local or a ``Replicate()``
        DTensor."""
        out = first_rows(out, out.dim() - 1, n)
        return out if self.use_local_output else DTensor.from_local(out, mesh, [Replicate()], run_check=False)

    def _replicated_matmul(self, mesh: DeviceMesh, named_linears, x: torch.Tensor) -> list:
        """A replicated plain-tensor input (``input_layouts=Replicate()``): nothing to gather, each rank
        multiplies its columns locally (or, with ``output_layouts=Replicate()``, gathers them as it multiplies).
        The input's gradient, summed over the ranks as torch's ColwiseParallel sums it (one all-reduce for all
        the linears), is fused into its matmul. FP8: :mod:`fastmesh.ops.replicated_input`."""
        weights = self._local_weights(mesh, named_linears)
        gathered = self._gathers_output(named_linears, return_a=False)
        outs = replicated_input_matmul(x, weights, group_name(mesh), self.pieces, gathered, self.fp8)
        if gathered:
            return [self._gathered_output(outs[0], mesh, named_linears[0][1].out_features)]
        return self._column_outputs(mesh, named_linears, outs)

    def _replicated_dtensor_matmul(self, linear: nn.Linear, x: DTensor):
        """A ``Replicate()`` DTensor input: the matmul runs as torch's ColwiseParallel runs it. Its gradient stays
        a Partial DTensor, reduced where the input was made replicated (after ``PrepareModuleInput``, a
        reduce-scatter), so it is not all-reduced here. In FP8, the local FP8 matmul of a replicated plain tensor,
        its input gradient left partial."""
        if self.fp8 is not None:
            mesh, named_linears = x.device_mesh, [("the module", linear)]
            local = x.to_local(grad_placements=[Partial()])
            outs = replicated_input_matmul(
                local,
                self._local_weights(mesh, named_linears),
                group_name(mesh),
                self.pieces,
                fp8=self.fp8,
                reduce_input_grad=False,
            )
            return self._column_outputs(mesh, named_linears, outs)[0]
        out = F.linear(x, linear.weight, linear.bias)
        # As torch's ColwiseParallel: DTensor may place the product otherwise (Replicate() for fewer out_features
        # than ranks), so it is redistributed to the output layout (a no-op when it is there).
        out = out.redistribute(x.device_mesh, [normalized(self.output_layouts[0], out, _COLWISE, "output_layouts")])
        return out.to_local() if self.use_local_output else out

    def _forward(self, linear: nn.Linear, x, mesh: DeviceMesh, what: str):
        """The forward of a linear under this style (``what`` names it in errors)."""
        x, placement, rows = self._prepare_input_fn(x, mesh)
        check_input_features(x, linear.in_features, _COLWISE, what)
        if isinstance(x, DTensor):
            return self._replicated_dtensor_matmul(linear, x)
        if isinstance(placement, Replicate):
            (out,) = self._replicated_matmul(mesh, [(what, linear)], x)
            return out
        _, (out,) = self._gather_matmul(mesh, [(what, linear)], x, placement, return_a=False, rows=rows)
        return out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_mesh(device_mesh, _COLWISE)
        if self.linears is None:
            linear = check_linear(module, _COLWISE, "the module", device_mesh, "out_features", self.fp8)
            self._partition_linear_fn(linear, device_mesh)

            def forward(linear: nn.Linear, x):
                return self._forward(linear, x, device_mesh, "the module")

            linear.forward = types.MethodType(forward, linear)
            return module
        if isinstance(module, nn.Linear):
            raise TypeError(
                f"{_COLWISE}: linears= names sibling linears of a parent module, but it was applied to an "
                "nn.Linear; apply FusedColwiseParallel() to the linear itself"
            )
        # A wrapped forward, not forward hooks: see docs/design/tp-styles.md (pytorch/pytorch#172556).
        SharedGather(self, device_mesh, module)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output}, linears={self.linears}, fp8={self.fp8}, "
            f"pieces={self.pieces})"
        )


def _unfused_fp8_output(layout: Placement) -> str:
    return (
        f"{_ROWWISE}: fp8 runs in the fused reduce-scatter (output_layouts=Shard(sequence_dim)) or all-reduce "
        f"(Replicate()); output_layouts={layout!r} runs as torch's RowwiseParallel, in high precision: drop fp8 or "
        "pick one of those layouts"
    )


class FusedRowwiseParallel(ParallelStyle):
    """Partition an ``nn.Linear`` row-wise and fuse the reduction of its output into the matmul: the input is
    column-sharded (a colwise linear's output); the output leaves sequence-sharded (a reduce-scatter) or, in plain
    TP, replicated (an all-reduce). The bias is added once, after the reduction.

    Keyword Args:
        input_layouts (Placement, optional):
            The DTensor layout of a plain-tensor input: ``Shard(-1)`` (default, a colwise linear's output). A
            DTensor input's own placement is used instead. Other placements are redistributed to ``Shard(-1)``
            by DTensor first, as torch does.
        output_layouts (Placement, optional):
            The DTensor layout of the output, as in torch's ``RowwiseParallel``: ``Replicate()`` (default, plain
            TP): ``fastmesh.matmul_all_reduce``, whose backward needs no collective; or ``Shard(sequence_dim)``
            (sequence parallel, e.g. ``Shard(1)``; any dim but the last; a length the TP degree does not divide
            leaves in torch's uneven shards): ``fastmesh.matmul_reduce_scatter``. ``Shard(-1)`` and ``Partial()``
            run as torch's ``RowwiseParallel`` runs them (not with ``fp8``).
        use_local_output (bool, optional):
            Whether the output is a local :class:`torch.Tensor` rather than a DTensor, default: True.
        fp8 (Float8Config, optional):
            Run the matmul in FP8 (as for :class:`FusedColwiseParallel`); the product is reduce-scattered or
            all-reduced in the input dtype.
        pieces (int, optional):
            The fused op's pipeline pieces of rows per rank (default: the op's plan per call).
        chunks (int, optional):
            Deprecated alias of ``pieces`` (FutureWarning; passing both is a ``TypeError``).

    Returns:
        A :class:`ParallelStyle` object that represents the fused row-wise sharding.

    Example::
        >>> # xdoctest: +SKIP("needs a process group")
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> from fastmesh.parallel import FusedRowwiseParallel
        >>> tp_mesh = fastmesh.init_mesh(tp=2)
        >>> # plain TP: wo's input [B, S, D/2] (heads sharded) -> output [B, S, D], all-reduced
        >>> parallelize_module(block, tp_mesh, {"attention.wo": FusedRowwiseParallel()})
        >>> # sequence parallel: the output reduce-scattered into sequence shards [B, S/2, D]
        >>> parallelize_module(block, tp_mesh, {"attention.wo": FusedRowwiseParallel(output_layouts=Shard(1))})
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fp8=None,
        pieces: int | None = None,
        chunks: int | None = None,
    ):
        super().__init__()
        # torch's RowwiseParallel's defaults: the features sharded in, a replicated (all-reduced) output.
        self.input_layouts = (check_placement(input_layouts or Shard(-1), _ROWWISE, "input_layouts"),)
        self.output_layouts = (check_placement(output_layouts or Replicate(), _ROWWISE, "output_layouts"),)
        if fp8 is not None and isinstance(self.output_layouts[0], Partial):
            raise ValueError(_unfused_fp8_output(self.output_layouts[0]))
        self.use_local_output = use_local_output
        self.fp8 = check_fp8(fp8, _ROWWISE)
        self.pieces = pipeline_pieces(pieces, chunks, _ROWWISE)

    def _prepare_input_fn(self, x, mesh: DeviceMesh) -> torch.Tensor:
        """The local feature shard: a plain tensor as it is, a ``Shard(-1)`` DTensor unwrapped. An input placed
        otherwise (a DTensor's own placement, or ``input_layouts`` for a plain tensor) is redistributed to
        ``Shard(-1)`` by DTensor first, as torch's RowwiseParallel redistributes it."""
        dtensor = is_dtensor_input(x, mesh, _ROWWISE)
        placement = normalized(x.placements[0] if dtensor else self.input_layouts[0], x, _ROWWISE, "input_layouts")
        if shards_last_dim(placement, x.dim()):
            return x.to_local() if dtensor else x
        runs_torchs_way(
            _ROWWISE, f"an input placed {placement!r}", "DTensor redistributes it to Shard(-1) before the matmul"
        )
        if not dtensor:
            x = DTensor.from_local(x, mesh, [placement], run_check=False)
        return x.redistribute(mesh, [Shard(x.dim() - 1)]).to_local()

    def _prepare_output_fn(self, out: torch.Tensor, mesh: DeviceMesh, placement: Placement, bias, shape=None):
        """The reduced shard plus the bias, local or a DTensor (of global ``shape`` where given). The bias is
        replicated and each rank adds it to its own rows, as a DTensor op: its gradient (a sum over rows that
        differ per rank) is then a Partial DTensor, reduced where it is used (the optimizer step), as for the norm
        weights under torch's SequenceParallel."""
        if bias is None:
            return as_output(out, mesh, placement, self.use_local_output, shape)
        out = as_output(out, mesh, placement, False, shape) + autocast.cast(bias)
        return out.to_local() if self.use_local_output else out

    def _partition_linear_fn(self, linear: nn.Linear, mesh: DeviceMesh) -> None:
        shard_parameters(linear, mesh, Shard(1), Replicate(), self.src_data_rank)

    def _forward(self, linear: nn.Linear, x, mesh: DeviceMesh):
        """The forward of a linear under this style."""
        x = self._prepare_input_fn(x, mesh)
        check_input_features(x, linear.in_features, _ROWWISE, "the module", mesh=mesh)
        weight = local_parameter(linear, "weight", _ROWWISE, "the module")
        # in_features the TP degree does not divide: torch's uneven pieces of the contraction, padded to equal ones.
        layout = normalized(self.output_layouts[0], x, _ROWWISE, "output_layouts")
        if not isinstance(layout, (Shard, Replicate)) or shards_last_dim(layout, x.dim()):
            return self._unfused_forward(linear, x, mesh, layout)
        a, b = even_contraction(x, weight.t(), linear.in_features, mesh, _ROWWISE)
        if isinstance(layout, Replicate):
            out = matmul_all_reduce(a, b, group=group_name(mesh), pieces=self.pieces, fp8=self.fp8)
            return self._prepare_output_fn(out, mesh, Replicate(), linear.bias)
        dim = sequence_dim(layout, x, _ROWWISE, "output_layouts")
        if self.fp8 is not None and fp8_dgrad_possible(self.fp8, a):  # said here in the style's words
            check_fp8_dgrad_columns(self.fp8, b.shape[1], f"{_ROWWISE} (the module)")
        # A sequence the TP degree does not divide leaves in torch's uneven shards (padded to scatter).
        out = matmul_reduce_scatter(
            rows_to_scatter(a, dim, mesh.size()), b, dim, group=group_name(mesh), pieces=self.pieces, fp8=self.fp8
        )
        shape = [*x.shape[:-1], linear.out_features]
        return self._prepare_output_fn(own_part(out, dim, x.shape[dim], mesh), mesh, Shard(dim), linear.bias, shape)

    def _unfused_forward(self, linear: nn.Linear, x: torch.Tensor, mesh: DeviceMesh, layout: Placement):
        """An output layout no fused op produces (the features sharded, ``Partial()``): torch's RowwiseParallel's own
        DTensor matmul, then its redistribution."""
        if self.fp8 is not None:
            raise ValueError(_unfused_fp8_output(layout))
        runs_torchs_way(_ROWWISE, f"output_layouts={layout!r}", "DTensor's matmul, then its redistribution")
        x = wrap_local(x, mesh, Shard(x.dim() - 1), [*x.shape[:-1], linear.in_features])
        out = F.linear(x, linear.weight, linear.bias).redistribute(mesh, [layout])
        return out.to_local() if self.use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_mesh(device_mesh, _ROWWISE)
        linear = check_linear(module, _ROWWISE, "the module", device_mesh, "in_features", self.fp8)
        self._partition_linear_fn(linear, device_mesh)

        def forward(linear: nn.Linear, x):
            return self._forward(linear, x, device_mesh)

        linear.forward = types.MethodType(forward, linear)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output}, fp8={self.fp8}, pieces={self.pieces})"
        )

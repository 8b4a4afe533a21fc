"""Fused tensor-parallel styles: ``ParallelStyle``s for ``parallelize_module`` whose collectives run inside the
matmuls (``fastmesh.all_gather_matmul`` / ``fastmesh.matmul_reduce_scatter``).

In a sequence-parallel TP block (Megatron-style SP, torch's ``SequenceParallel`` on the norms), activations
between blocks are sharded along the sequence; each column-parallel linear starts with an all-gather of its
input and each row-parallel linear ends with a reduce-scatter of its output. torch's plan runs those
collectives on their own (``PrepareModuleInput`` / ``RowwiseParallel(output_layouts=Shard(1))``); these styles
overlap them with the matmuls, and move exactly the same data: a forward and a backward issue the native
plan's collectives, one for one.

Shapes per rank (``tp`` the TP degree, ``S`` the sequence length, ``D`` the input features, ``N`` a
colwise linear's ``out_features``; the sequence dim is 1 by default, any dim but the last may be)::

    =========================  ==========================  =================  ==================
    style                      input                       weight (local)     output
    =========================  ==========================  =================  ==================
    FusedColwiseParallel       [B, S/tp, D]  Shard(1)      [N/tp, D] Shard(0)  [B, S, N/tp]  Shard(-1)
    FusedRowwiseParallel       [B, S, D/tp]  Shard(-1)     [N, D/tp] Shard(1)  [B, S/tp, N]  Shard(1)
    =========================  ==========================  =================  ==================

Plain-PyTorch equivalents (``x_shard`` this rank's sequence shard; weights and biases this rank's shards)::

    # FusedColwiseParallel on a linear, or on a parent with linears=(...): one gather for all of them
    x = torch.cat(all_gather(x_shard), dim=1)
    y_i = x @ w_i.T + b_i
    # FusedRowwiseParallel
    y_shard = reduce_scatter(h_shard @ w.T, dim=1) + b

Gradients: as the fused ops' (each op's backward is the other), so the backward of a colwise linear issues one
reduce-scatter and the backward of a rowwise linear one all-gather, like the native plan's. Parameters are
DTensors placed as torch's ``ColwiseParallel`` / ``RowwiseParallel`` place them, so state dicts, optimizers,
``torch.distributed.checkpoint`` and FSDP2 (``fully_shard`` on a 2-D ``(dp, tp)`` mesh) see the same thing as
with the native plan.

A Llama-style block (``attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``; block input and output are local
sequence shards ``[B, S/tp, D]``)::

    plan = {
        "attention_norm": SequenceParallel(),
        "attention": FusedColwiseParallel(linears=("wq", "wk", "wv")),  # one gather, three matmuls
        "attention.wo": FusedRowwiseParallel(),                         # output sequence-sharded
        "ffn_norm": SequenceParallel(),
        "feed_forward": FusedColwiseParallel(linears=("w1", "w3")),
        "feed_forward.w2": FusedRowwiseParallel(),
    }
    parallelize_module(block, mesh["tp"], plan)

The native plan it replaces puts ``PrepareModuleInput(input_layouts=(Shard(1), None),
desired_input_layouts=(Replicate(), None))`` on ``attention`` and ``ColwiseParallel()`` on each of ``wq``,
``wk``, ``wv`` (likewise ``feed_forward``, ``w1``, ``w3``), and ``RowwiseParallel(output_layouts=Shard(1))``
on ``wo`` and ``w2``.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from fastmesh.mesh import group_name
from fastmesh.ops import all_gather_matmul, matmul_reduce_scatter
from fastmesh.ops._fused_common import check_chunks
from fastmesh.parallel._common import (
    check_fp8,
    check_linear,
    check_mesh,
    check_sequence_placement,
    is_dtensor_input,
    local_input,
    local_parameter,
    output,
    sequence_dim,
    shard_parameters,
    warn_once,
)

__all__ = ["FusedColwiseParallel", "FusedRowwiseParallel"]

_COLWISE = "FusedColwiseParallel"
_ROWWISE = "FusedRowwiseParallel"


def _check_chunks(chunks, style: str) -> int | None:
    if chunks is not None:
        check_chunks(chunks, style)
    return chunks


class FusedColwiseParallel(ParallelStyle):
    """Partition ``nn.Linear``s column-wise and fuse the all-gather of their sequence-sharded input into the
    matmul. Applied to a linear, it parallelizes that linear; applied to a parent module with
    ``linears=(names...)``, it parallelizes those sibling linears, which read the same input, with one gather
    whose transfer overlaps all of their matmuls (attention's q/k/v, the SwiGLU's w1/w3).

    With ``linears``, the parent's forward receives the gathered input as a ``Replicate()`` DTensor (as after
    torch's ``PrepareModuleInput(desired_input_layouts=Replicate())``); each listed linear called with it
    returns its precomputed output. Any other use of it in the parent's forward is computed by DTensor, with
    the right gradients; a listed linear called with another input runs on its own (and says so once, in the
    ``fastmesh.parallel`` logger). The parent's first positional argument is its input.

    Keyword Args:
        input_layouts (Placement, optional):
            The DTensor layout of a plain-tensor input: ``Shard(sequence_dim)`` (default ``Shard(1)``), whose
            gather is fused, or ``Replicate()``, which needs no collective: the linears then run as torch's
            ``ColwiseParallel``. A DTensor input's own placement (one of those two) is used instead.
        output_layouts (Placement, optional):
            The DTensor layout of the outputs: ``Shard(-1)``, the only one (default).
        use_local_output (bool, optional):
            Whether the outputs are local :class:`torch.Tensor`\\ s rather than DTensors, default: True.
        linears (Sequence[str], optional):
            Names of the parent's ``nn.Linear`` submodules that share the gather; ``None`` (default) when the
            style is applied to a linear itself.
        fp8 (Float8Config, optional):
            Run the matmuls in FP8 (``fastmesh.fp8.Float8Config``, current scaling, tensor-wise or row-wise):
            the input shard is quantized and travels as FP8 plus its scales, the weights are quantized per
            output column (or tensor), and the backward runs in FP8 or high precision per
            ``backward_in_fp8``. Each rank's scales are those of its own shard and travel with it, so no amax
            is reduced across the group. Needs a sequence-sharded input.
        chunks (int, optional):
            Pipeline pieces of rows per rank for the fused op (default: the op's plan per call).

    Returns:
        A :class:`ParallelStyle` object that represents the fused column-wise sharding.

    Example::
        >>> # xdoctest: +SKIP("needs a process group")
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> from fastmesh.parallel import FusedColwiseParallel
        >>> tp_mesh = fastmesh.init_mesh(tp=2)
        >>> # attention's input arrives as local sequence shards [B, S/2, D]; q, k and v leave [B, S, H/2]
        >>> parallelize_module(block, tp_mesh, {"attention": FusedColwiseParallel(linears=("wq", "wk", "wv"))})
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        linears: Sequence[str] | None = None,
        fp8=None,
        chunks: int | None = None,
    ):
        super().__init__()
        self.input_layouts = (check_sequence_placement(input_layouts or Shard(1), _COLWISE, "input_layouts", True),)
        if output_layouts is not None and output_layouts != Shard(-1):
            raise ValueError(
                f"{_COLWISE}: output_layouts must be Shard(-1) (column-sharded), got {output_layouts!r}; "
                "for a replicated output use torch's ColwiseParallel(output_layouts=Replicate())"
            )
        self.output_layouts = (Shard(-1),)
        self.use_local_output = use_local_output
        self.linears = _check_linear_names(linears)
        self.fp8 = check_fp8(fp8, _COLWISE)
        if self.fp8 is not None and isinstance(self.input_layouts[0], Replicate):
            raise ValueError(
                f"{_COLWISE}: fp8 needs a sequence-sharded input (it quantizes the shard that travels), "
                "got input_layouts=Replicate()"
            )
        self.chunks = _check_chunks(chunks, _COLWISE)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_mesh(device_mesh, _COLWISE)
        if self.linears is None:
            linear = check_linear(module, _COLWISE, "the module", device_mesh, "out_features", self.fp8)
            shard_parameters(linear, device_mesh, Shard(0), Shard(0), self.src_data_rank)
            linear.forward = types.MethodType(_colwise_forward(self, device_mesh, "the module"), linear)
            return module
        if isinstance(module, nn.Linear):
            raise TypeError(
                f"{_COLWISE}: linears= names sibling linears of a parent module, but it was applied to an "
                "nn.Linear; apply FusedColwiseParallel() to the linear itself"
            )
        siblings = _Siblings(self, device_mesh, module)
        # A wrapped forward rather than forward hooks: compiling the parent itself (torch.compile(parent),
        # parent.compile()) compiles its hooks as frames of their own, whose gathered-input output then gets a
        # plain-tensor gradient where AOTAutograd expects a DTensor (pytorch/pytorch#172556). Inside forward,
        # the gather is in the parent's graph however it is compiled.
        module.forward = types.MethodType(siblings.wrap_forward(module.forward), module)
        return module

    def _multiply(self, mesh: DeviceMesh, named_linears, x_shard: torch.Tensor, placement: Shard, return_a: bool):
        """The fused gather + matmuls: (gathered input or None, each linear's output)."""
        dim = sequence_dim(placement, x_shard, _COLWISE, "the input's")
        weights = [local_parameter(linear, "weight", _COLWISE, name) for name, linear in named_linears]
        a, outs = all_gather_matmul(
            x_shard,
            [w.t() for w in weights],
            dim,
            group=group_name(mesh),
            return_a=return_a,
            chunks=self.chunks,
            fp8=self.fp8,
        )
        results = []
        for (name, linear), out in zip(named_linears, outs):
            bias = local_parameter(linear, "bias", _COLWISE, name)
            results.append(
                output(out if bias is None else out + bias, mesh, Shard(out.dim() - 1), self.use_local_output)
            )
        return a, results

    def _replicated(self, linear: nn.Linear, x: DTensor):
        """A replicated input: nothing to gather, so the matmul runs as torch's ColwiseParallel runs it (DTensor
        gives the input's gradient its all-reduce)."""
        if self.fp8 is not None:
            raise ValueError(
                f"{_COLWISE}: fp8 needs a sequence-sharded input (it quantizes the shard that travels), "
                "got a replicated one"
            )
        out = F.linear(x, linear.weight, linear.bias)
        return out.to_local() if self.use_local_output else out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output}, linears={self.linears}, fp8={self.fp8}, "
            f"chunks={self.chunks})"
        )


def _check_linear_names(linears) -> tuple[str, ...] | None:
    if linears is None:
        return None
    if isinstance(linears, str) or not all(isinstance(name, str) and name for name in linears):
        raise TypeError(f"{_COLWISE}: linears must be a sequence of submodule names, got {linears!r}")
    names = tuple(linears)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"{_COLWISE}: linears must name one or more distinct submodules, got {names!r}")
    return names


def _colwise_forward(style: FusedColwiseParallel, mesh: DeviceMesh, what: str):
    """The forward of a linear under FusedColwiseParallel (bound to the linear as its ``forward``)."""

    def forward(linear: nn.Linear, x):
        x, placement = local_input(x, mesh, style.input_layouts[0], _COLWISE)
        if isinstance(placement, Replicate):
            return style._replicated(linear, x)
        _, (out,) = style._multiply(mesh, [(what, linear)], x, placement, return_a=False)
        return out

    return forward


# The outputs of one fused call ride on the gathered input they were computed from, so that each sibling finds
# its own by its argument alone: no state outside the call, which compiled activation checkpointing forbids.
_SIBLING_OUTPUTS = "_fastmesh_sibling_outputs"


class _Siblings:
    """The linears of a parent under ``FusedColwiseParallel(linears=...)``: the parent's wrapped forward first runs
    one fused gather + matmuls and hands the parent the gathered input, carrying the linears' outputs; each
    linear called with that input returns its output."""

    def __init__(self, style: FusedColwiseParallel, mesh: DeviceMesh, parent: nn.Module):
        self.style, self.mesh = style, mesh
        self.named_linears = []
        for name in style.linears:
            try:
                child = parent.get_submodule(name)
            except AttributeError as error:
                raise ValueError(
                    f"{_COLWISE}: linears names {name!r}, which {type(parent).__name__} does not have"
                ) from error
            self.named_linears.append((name, check_linear(child, _COLWISE, name, mesh, "out_features", style.fp8)))
        in_features = {linear.in_features for _, linear in self.named_linears}
        if len(in_features) != 1:
            raise ValueError(
                f"{_COLWISE}: the linears sharing a gather must read the same input, but their "
                f"in_features differ: {[(n, lin.in_features) for n, lin in self.named_linears]}"
            )
        # The parent's rank 0 in the group keeps the gradient of replicated uses of the gathered input, so
        # that the reduce-scatter of the fused op's backward counts it once.
        self.keeps_replicated_grad = mesh.get_local_rank() == 0
        # Eager only: the gathered input of the call in progress, to recognize aliases of it (below).
        self.eager_gathered: DTensor | None = None
        for name, linear in self.named_linears:
            shard_parameters(linear, mesh, Shard(0), Shard(0), style.src_data_rank)
            linear.forward = types.MethodType(self._linear_forward(name), linear)

    def gather_and_multiply(self, parent: nn.Module, args: tuple, kwargs: dict):
        if not args:
            raise TypeError(
                f"{_COLWISE}(linears={self.style.linears}): {type(parent).__name__}'s input must be its "
                "first positional argument"
            )
        x, placement = local_input(args[0], self.mesh, self.style.input_layouts[0], _COLWISE)
        if isinstance(placement, Replicate):
            if self.style.fp8 is not None:
                raise ValueError(
                    f"{_COLWISE}: fp8 needs a sequence-sharded input (it quantizes the shard that "
                    "travels), got a replicated one"
                )
            return (x, *args[1:]), kwargs
        a, outs = self.style._multiply(self.mesh, self.named_linears, x, placement, return_a=True)
        a = _CountReplicatedGradOnce.apply(a, self.keeps_replicated_grad)
        gathered = DTensor.from_local(a, self.mesh, [Replicate()], run_check=False)
        setattr(gathered, _SIBLING_OUTPUTS, {name: out for (name, _), out in zip(self.named_linears, outs)})
        if not torch.compiler.is_compiling():
            self.eager_gathered = gathered
        return (gathered, *args[1:]), kwargs

    def release(self) -> None:
        if not torch.compiler.is_compiling() and self.eager_gathered is not None:
            # A gathered input kept past the call must not hand out outputs of weights that have since changed.
            delattr(self.eager_gathered, _SIBLING_OUTPUTS)
            self.eager_gathered = None

    def wrap_forward(self, forward):
        """The parent's forward (``forward``, bound), preceded by the shared gather and followed by release."""

        def gathered_forward(parent: nn.Module, *args, **kwargs):
            args, kwargs = self.gather_and_multiply(parent, args, kwargs)
            try:
                return forward(*args, **kwargs)
            finally:
                self.release()

        return gathered_forward

    def _outputs_for(self, x) -> dict | None:
        outputs = getattr(x, _SIBLING_OUTPUTS, None)
        gathered = self.eager_gathered
        if outputs is not None or gathered is None or not isinstance(x, DTensor):
            return outputs
        # A module with backward hooks (e.g. under CommDebugMode) gets an alias of its input, not the object:
        # the same data, so the precomputed output is still its output.
        mine, theirs = x._local_tensor, gathered._local_tensor
        same = (
            x.placements == gathered.placements
            and mine.data_ptr() == theirs.data_ptr()
            and mine.shape == theirs.shape
            and mine.stride() == theirs.stride()
            and mine.dtype == theirs.dtype
        )
        return getattr(gathered, _SIBLING_OUTPUTS) if same else None

    def _linear_forward(self, name: str):
        def forward(linear: nn.Linear, x):
            outputs = self._outputs_for(x)
            if outputs is not None:
                return outputs[name]
            if self.eager_gathered is not None:
                warn_once(
                    f"{id(self)}.{name}",
                    "%s: %s was called with an input other than the gathered input of its "
                    "parent, so it runs on its own (no shared gather)",
                    _COLWISE,
                    name,
                )
            return alone(linear, x)

        alone = _colwise_forward(self.style, self.mesh, name)
        return forward


class _CountReplicatedGradOnce(torch.autograd.Function):
    """Identity; in backward, only one rank passes on the gradient. The fused op reduce-scatters (sums over the
    ranks) whatever gradient its gathered output gets; a replicated use of it gives every rank the whole
    gradient (DTensor all-reduces partial ones into that), which the sum must count once."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, keep: bool):
        ctx.keep = keep
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.keep else torch.zeros_like(grad)), None


class FusedRowwiseParallel(ParallelStyle):
    """Partition an ``nn.Linear`` row-wise and fuse the reduce-scatter of its output into the matmul: the input
    is column-sharded (a colwise linear's output), the output leaves sequence-sharded. The bias is added once,
    after the reduction.

    Keyword Args:
        input_layouts (Placement, optional):
            The DTensor layout of a plain-tensor input: ``Shard(-1)``, the only one (default). A DTensor input
            must be placed so too.
        output_layouts (Placement, optional):
            The DTensor layout of the output: ``Shard(sequence_dim)``, default ``Shard(1)``; any dim but the
            last, whose length must divide by the TP degree. For a replicated output use torch's
            ``RowwiseParallel()``: its all-reduce has no reduce-scatter to fuse.
        use_local_output (bool, optional):
            Whether the output is a local :class:`torch.Tensor` rather than a DTensor, default: True.
        fp8 (Float8Config, optional):
            Run the matmul in FP8 (as for :class:`FusedColwiseParallel`); the product is reduced in the input
            dtype.
        chunks (int, optional):
            Pipeline pieces of rows per rank for the fused op (default: the op's plan per call).

    Returns:
        A :class:`ParallelStyle` object that represents the fused row-wise sharding.

    Example::
        >>> # xdoctest: +SKIP("needs a process group")
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> from fastmesh.parallel import FusedRowwiseParallel
        >>> tp_mesh = fastmesh.init_mesh(tp=2)
        >>> # wo's input [B, S, D/2] (heads sharded) -> output [B, S/2, D] (sequence-sharded)
        >>> parallelize_module(block, tp_mesh, {"attention.wo": FusedRowwiseParallel()})
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fp8=None,
        chunks: int | None = None,
    ):
        super().__init__()
        if input_layouts is not None and input_layouts != Shard(-1):
            raise ValueError(
                f"{_ROWWISE}: input_layouts must be Shard(-1) (the features sharded), got {input_layouts!r}"
            )
        self.input_layouts = (Shard(-1),)
        self.output_layouts = (check_sequence_placement(output_layouts or Shard(1), _ROWWISE, "output_layouts", False),)
        self.use_local_output = use_local_output
        self.fp8 = check_fp8(fp8, _ROWWISE)
        self.chunks = _check_chunks(chunks, _ROWWISE)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_mesh(device_mesh, _ROWWISE)
        linear = check_linear(module, _ROWWISE, "the module", device_mesh, "in_features", self.fp8)
        shard_parameters(linear, device_mesh, Shard(1), Replicate(), self.src_data_rank)
        linear.forward = types.MethodType(_rowwise_forward(self, device_mesh), linear)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
            f"use_local_output={self.use_local_output}, fp8={self.fp8}, chunks={self.chunks})"
        )


def _rowwise_forward(style: FusedRowwiseParallel, mesh: DeviceMesh):
    """The forward of a linear under FusedRowwiseParallel (bound to the linear as its ``forward``)."""

    def forward(linear: nn.Linear, x):
        x = _rowwise_local_input(x, mesh)
        dim = sequence_dim(style.output_layouts[0], x, _ROWWISE, "output_layouts")
        tp = mesh.size()
        if x.shape[dim] % tp:
            raise ValueError(
                f"{_ROWWISE}: the sequence length {x.shape[dim]} (dim {dim} of the input, "
                f"shape {tuple(x.shape)}) must be divisible by the TP degree {tp}"
            )
        weight = local_parameter(linear, "weight", _ROWWISE, "the module")
        out = matmul_reduce_scatter(x, weight.t(), dim, group=group_name(mesh), chunks=style.chunks, fp8=style.fp8)
        placement = Shard(dim)
        if linear.bias is None:
            return output(out, mesh, placement, style.use_local_output)
        # The bias is replicated and each rank adds it to its own rows: as a DTensor op, its gradient (a sum
        # over rows that differ per rank) is a Partial DTensor, reduced where it is used (the optimizer step),
        # as for the norm weights under torch's SequenceParallel.
        out = DTensor.from_local(out, mesh, [placement], run_check=False) + linear.bias
        return out.to_local() if style.use_local_output else out

    return forward


def _rowwise_local_input(x, mesh: DeviceMesh) -> torch.Tensor:
    if not is_dtensor_input(x, mesh, _ROWWISE):
        return x
    placement = x.placements[0]
    if not (isinstance(placement, Shard) and placement.dim % x.dim() == x.dim() - 1):
        raise ValueError(
            f"{_ROWWISE}: the input DTensor must be placed Shard(-1) (features sharded, a colwise "
            f"linear's output), got {placement!r}"
        )
    return x.to_local()

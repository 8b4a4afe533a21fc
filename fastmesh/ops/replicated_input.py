"""Column-parallel matmuls of a replicated input (plain TP): each rank multiplies its own columns with no transfer,
and the input's gradient, summed over the ranks, is all-reduced inside its matmul in backward.
``FusedColwiseParallel(input_layouts=Replicate())`` runs :func:`replicated_input_matmul`.

Plain-PyTorch equivalent (``w_i`` this rank's rows of linear i's weight; ``W`` the group's size)::

    outs = [x @ w_i.T for w_i in weights]                        # forward: local
    grad_x = all_reduce(sum_i grad_i @ w_i)                      # backward: one matmul_all_reduce of
    grad_w_i = grad_i.flatten(0, -2).T @ x.flatten(0, -2)        #   [g_1 | g_2 ..] @ [w_1; w_2 ..]; local

Shapes::

    x [..., K] (the same on every rank)    w_i [N_i, K]    outs[i] [..., N_i], or [..., W * N_i] with gathered

``gathered=True`` (an LM head's replicated output): each product's columns are gathered from every rank while they
are multiplied (``matmul_all_gather``); the backward keeps this rank's columns of the gradient.
``reduce_input_grad=False``: grad_x is this rank's partial sum, ``sum_i grad_i @ w_i``, for an input whose gradient
is reduced elsewhere (a ``Replicate()`` DTensor made local with a ``Partial()`` gradient).

FP8 (``fp8=Float8Config(...)``, current scaling; not with ``gathered``): x is quantized per its rows, each w_i per
output column (MX: blocks of 32 along K; block1x128: 128x128 blocks), and they multiply through
``fastmesh::scaled_matmul``. The input's gradient runs in FP8 (the gradients in ``grad_dtype``,
``scaled_matmul_all_reduce``) or in x's dtype, per ``backward_in_fp8``; the weights' gradients in x's dtype from the
dequantized FP8 input. With ``"mx"``, 32 must divide K and, for an FP8 input gradient, the sum of the N_i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmesh.ops import autocast
from fastmesh.ops._fp8_operands import (
    check_fp8_contraction,
    fp8_dgrad_possible,
    quantize_columns,
    quantize_rows,
)
from fastmesh.ops._fused_common import as_matrix
from fastmesh.ops.fp8_config import Float8Config
from fastmesh.ops.fp8_quantize import dequantize
from fastmesh.ops.matmul_all_gather import matmul_all_gather
from fastmesh.ops.matmul_all_reduce import matmul_all_reduce

_FRONT = "FusedColwiseParallel"


def _concatenated(grads, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """``[g_1 | g_2 ..]`` and ``[w_1; w_2 ..]``: sum_i g_i @ w_i as one product, over the outputs that have a
    gradient (an output the loss does not use has none: its weight gets none, as under torch's ColwiseParallel)."""
    used = [(g, w) for g, w in zip(grads, weights) if g is not None]
    grads, weights = [g for g, _ in used], [w for _, w in used]
    grad = grads[0] if len(grads) == 1 else torch.cat(grads, dim=-1)
    weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
    return grad, weight


def _weight_grads(grads, x_rows: torch.Tensor, needs) -> list:
    """grad_w_i = g_i^T @ x for each weight that needs one and whose output has a gradient."""
    return [as_matrix(g).t() @ x_rows if need and g is not None else None for g, need in zip(grads, needs)]


def _input_grad(grads, weights, group: str, pieces: int | None, reduce: bool) -> torch.Tensor:
    """sum_i g_i @ w_i, all-reduced over the group inside its matmul where ``reduce``."""
    grad, weight = _concatenated(grads, weights)
    return matmul_all_reduce(grad, weight, group=group, pieces=pieces) if reduce else grad @ weight


class _ReplicatedInputMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, pieces: int | None, gathered: bool, reduce_grad: bool, *weights: torch.Tensor):
        ctx.group, ctx.pieces, ctx.gathered, ctx.reduce_grad = group, pieces, gathered, reduce_grad
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)  # an unused output's weight gets no gradient (_concatenated)
        if gathered:  # every rank's columns, gathered while they are multiplied
            return tuple(matmul_all_gather(x, w.t(), group=group, pieces=pieces) for w in weights)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        if all(g is None for g in grads):
            return (None,) * (5 + len(weights))
        if ctx.gathered:  # the replicated output's gradient: this rank's columns are its outputs'
            grads = tuple(None if g is None else torch.ops.fastmesh.rank_columns(g, ctx.group) for g in grads)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(grads, weights, ctx.group, ctx.pieces, ctx.reduce_grad)
        grad_ws = _weight_grads(grads, as_matrix(x), ctx.needs_input_grad[5:])
        return (grad_x, None, None, None, None, *grad_ws)


class _Float8ReplicatedInputMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, pieces: int | None, reduce_grad: bool, config, dgrad_in_fp8: bool, *weights):
        x_data, x_scale = quantize_rows(x, config.dtype, config)
        outs = []
        for w in weights:
            w_data, w_scale = quantize_columns(w.t(), config.dtype, config)
            outs.append(torch.ops.fastmesh.scaled_matmul(x_data, x_scale, w_data, w_scale, x.dtype))
        ctx.group, ctx.pieces, ctx.reduce_grad, ctx.dtype = group, pieces, reduce_grad, x.dtype
        ctx.config, ctx.dgrad_in_fp8 = config, dgrad_in_fp8
        ctx.save_for_backward(x_data, x_scale, *weights)
        ctx.set_materialize_grads(False)  # an unused output's weight gets no gradient (_concatenated)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x_data, x_scale, *weights = ctx.saved_tensors
        if all(g is None for g in grads):
            return (None,) * (6 + len(weights))
        grad_x = None
        if ctx.needs_input_grad[0] and not ctx.dgrad_in_fp8:
            grad_x = _input_grad(grads, weights, ctx.group, ctx.pieces, ctx.reduce_grad)
        elif ctx.needs_input_grad[0]:
            grad, weight = _concatenated(grads, weights)
            g_data, g_scale = quantize_rows(grad, ctx.config.grad_dtype, ctx.config)
            # weight [N, K] is the product's b: quantized per its columns, along N (the contraction).
            w_data, w_scale = quantize_columns(weight, ctx.config.dtype, ctx.config)
            if ctx.reduce_grad:
                grad_x = torch.ops.fastmesh.scaled_matmul_all_reduce(
                    g_data, g_scale, w_data, w_scale, "sum", ctx.group, ctx.dtype, ctx.pieces or 0
                )
            else:
                grad_x = torch.ops.fastmesh.scaled_matmul(g_data, g_scale, w_data, w_scale, ctx.dtype)
        grad_ws = [None] * len(weights)
        if any(ctx.needs_input_grad[6:]):
            grad_ws = _weight_grads(grads, as_matrix(dequantize(x_data, x_scale, ctx.dtype)), ctx.needs_input_grad[6:])
        return (grad_x, None, None, None, None, None, *grad_ws)


def replicated_input_matmul(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    group_name: str,
    pieces: int | None = None,
    gathered: bool = False,
    fp8: Float8Config | None = None,
    reduce_input_grad: bool = True,
) -> tuple[torch.Tensor, ...]:
    """``x @ w.T`` for each of this rank's weight rows ``w`` (module docstring); ``pieces``: the backward's (or the
    gathered output's) pipeline pieces, None for the op's plan per call."""
    x, weights = autocast.cast(x), autocast.cast(list(weights))
    if fp8 is None:
        return _ReplicatedInputMatmul.apply(x, group_name, pieces, gathered, reduce_input_grad, *weights)
    if gathered:
        raise ValueError(f"{_FRONT}: fp8 has no form that gathers the output columns while they are multiplied")
    dgrad_in_fp8 = fp8_dgrad_possible(fp8, x)
    check_fp8_contraction(fp8, x.shape[-1], sum(w.shape[0] for w in weights), dgrad_in_fp8, _FRONT)
    return _Float8ReplicatedInputMatmul.apply(x, group_name, pieces, reduce_input_grad, fp8, dgrad_in_fp8, *weights)

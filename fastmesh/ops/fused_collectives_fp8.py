"""FP8 forms of the fused collectives: ``fastmesh::all_gather_scaled_matmul`` and
``fastmesh::scaled_matmul_reduce_scatter``, and the ``fp8=`` option of the Python fronts.

The ops take FP8 data with dequantization scales (``x ~= data.float() * scale``) in the layouts of
``_fp8_operands.py``: tensor-wise (0-d), row-wise, MX (E8M0, blocks of 32 along K) or block (1x128 a, 128x128 b).
Plain-PyTorch equivalents (``deq(d, s)``: ``d.float() * s`` with each scale covering its block)::

    # all_gather_scaled_matmul(a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype, return_a)
    a = cat(all_gather(deq(a_shard, a_scale)), gather_dim)                # rows only: gather_dim < last dim
    outs = [(a @ deq(b, s)).to(out_dtype) for b, s in zip(bs, b_scales)]
    result = (gathered FP8 data, its scales per row) if return_a else (None, None), outs
    # scaled_matmul_reduce_scatter(a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name, out_dtype)
    result = reduce_scatter((deq(a, a_scale) @ deq(b, b_scale)).to(out_dtype), scatter_dim, reduce_op)

Shapes are those of ``fused_collectives.py``, with (``out_dtype``: float32, bfloat16 or float16)::

    a_shard / a   [..., K] FP8                    a_scale        [], [..., 1], [..., K/32] e8m0, [..., ceil(K/128)]
    bs[i] / b     [K, N] FP8 (CUDA: column-major)  b_scale(s[i])  [], [1, N], [K/32, N] e8m0, [ceil(K/128), ceil(N/128)]
    gathered a    [..W*S.., K] FP8                 its scale      [..W*S.., G]: a_scale's G per row (tensor-wise: 1)

The multiplies are ``torch._scaled_mm`` for tensor-wise and row-wise scales, and for 1x128 a x 128x128 b block
scales where torch runs that form (SM90: ``_fp8_operands.log_multiply``); otherwise, with MX or block scales on
either operand, they dequantize both operands to ``out_dtype`` and multiply those (b once per call). The op says
which once in the log.

Autograd: the ops take quantized data and have none. The fronts' ``fp8=Float8Config(...)`` (current scaling;
tensor-wise, row-wise, MX or block1x128) quantizes the inputs (each b alike along its output columns; 128x128 for
block1x128) and calls these ops. Its backward runs the dgrad through the other fused op, in FP8 (``grad_dtype``)
when ``backward_in_fp8``, else in the input dtype (always for a reduce-scatter of the last dim: its dgrad would
gather the contraction dim), and the wgrad in the input dtype from the FP8 shard and scales saved in forward and
gathered again while the dgrad runs (``keep_gathered``: the gathered FP8 a saved). Errors as for the high-precision
ops. Design: ``docs/design/fp8.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmesh import _cpp_lib
from fastmesh.ops import backward_gathers, plans
from fastmesh.ops._checks import FP8_DTYPES, check_tensor, wrap_dim
from fastmesh.ops._collectives import reduce_scatter, started_all_gather
from fastmesh.ops._fp8_operands import (
    check_a_scale,
    check_b_scale,
    check_fp8_contraction,
    check_out_dtype,
    check_scaled_b,
    check_scaled_operands,
    fp8_dgrad_possible,
    log_multiply,
    quantize_columns,
    quantize_rows,
)
from fastmesh.ops._fused_common import (
    any_requires_grad,
    as_matrix,
    check_pieces,
    check_reduce_op,
    check_same_shapes,
    check_scattered_divisible,
    gathered_shape,
    group_size,
    input_grad_operands,
    resolve_group,
    scattered_shape,
)
from fastmesh.ops._library import qualified_name
from fastmesh.ops.fp8_config import Float8Config
from fastmesh.ops.fp8_quantize import dequantize

_AG = "fastmesh::all_gather_scaled_matmul"
_RS = "fastmesh::scaled_matmul_reduce_scatter"
_SCALED_GATHER = torch.ops.fastmesh.all_gather_scaled_matmul.default
_SCALED_SCATTER = torch.ops.fastmesh.scaled_matmul_reduce_scatter.default


# ---- checks (the wording of csrc/fused/all_gather_scaled_matmul.cpp, scaled_matmul_reduce_scatter.cpp) ----


def check_rows_gathered(a_shard, gather_dim: int, op: str) -> int:
    """gather_dim wrapped, which must not be a_shard's last dim (the contraction)."""
    dim = wrap_dim(gather_dim, a_shard.dim(), op, "gather_dim", "a_shard")
    if dim == a_shard.dim() - 1:
        raise ValueError(
            f"{op}: the FP8 form gathers rows: gather_dim must not be the last dim ({gather_dim} for "
            f"a_shard with {a_shard.dim()} dims), since ranks' scales cannot share a dot product"
        )
    return dim


def _check_all_gather_scaled(a_shard, a_scale, bs, b_scales, gather_dim, out_dtype, world, pieces):
    """(gather_dim wrapped, a's scale layout, each b's)."""
    check_tensor(a_shard, _AG, "a_shard", FP8_DTYPES, min_dim=2)
    dim = check_rows_gathered(a_shard, gather_dim, _AG)
    a_layout = check_a_scale(a_scale, a_shard, _AG, "a_scale", "a_shard")
    check_out_dtype(out_dtype, _AG)
    check_pieces(pieces, _AG)
    if not bs:
        raise ValueError(f"{_AG}: bs must hold at least one matrix, got an empty list")
    if len(b_scales) != len(bs):
        raise ValueError(f"{_AG}: b_scales must hold one scale per b ({len(bs)}), got {len(b_scales)}")
    b_layouts = []
    for i, (b, s) in enumerate(zip(bs, b_scales)):
        check_scaled_b(b, a_shard, _AG, f"bs[{i}]", "a_shard", "the last dim of a_shard")
        b_layouts.append(check_b_scale(s, b, _AG, f"b_scales[{i}]", f"bs[{i}]"))
    return dim, a_layout, b_layouts


def _check_scaled_reduce_scatter(a, a_scale, b, b_scale, scatter_dim, reduce_op, out_dtype, world, pieces):
    """(scatter_dim wrapped, (a's scale layout, b's))."""
    layouts = check_scaled_operands(a, a_scale, b, b_scale, out_dtype, _RS)
    dim = wrap_dim(scatter_dim, a.dim(), _RS, "scatter_dim", "a")
    check_reduce_op(reduce_op, _RS)
    check_pieces(pieces, _RS)
    check_scattered_divisible(a.shape, b.shape[1], dim, scatter_dim, world, _RS)
    return dim, layouts


# ---- fake impls ----


@torch.library.register_fake(qualified_name("all_gather_scaled_matmul"))
def _all_gather_scaled_matmul_fake(
    a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype, return_a=False, pieces=0
):
    backward_gathers.install_once()  # being traced: the fp8= backward's gathers of the shard stay in backward
    world = group_size(group_name, _AG)
    dim, _, _ = _check_all_gather_scaled(a_shard, a_scale, bs, b_scales, gather_dim, out_dtype, world, pieces)
    full = gathered_shape(a_shard.shape, dim, world)
    outs = [a_shard.new_empty(full[:-1] + [b.shape[1]], dtype=out_dtype) for b in bs]
    if not return_a:
        return None, None, outs
    return a_shard.new_empty(full), a_scale.new_empty(full[:-1] + [a_scale.shape[-1] if a_scale.dim() else 1]), outs


@torch.library.register_fake(qualified_name("scaled_matmul_reduce_scatter"))
def _scaled_matmul_reduce_scatter_fake(a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name, out_dtype, pieces=0):
    world = group_size(group_name, _RS)
    dim, _ = _check_scaled_reduce_scatter(a, a_scale, b, b_scale, scatter_dim, reduce_op, out_dtype, world, pieces)
    return a.new_empty(scattered_shape(a.shape, b.shape[1], dim, world), dtype=out_dtype)


# ---- kernels: a plan per call (fastmesh/ops/plans.py), then the C++ schedule ----


def scaled_gather_plan_call(
    a_shard, a_scale, bs, dim: int, group_name: str, out_dtype, a_layout: str | None = None
) -> plans.Call:
    """The planner's view of an all_gather_scaled_matmul call (also asked by the compile pass); ``a_layout``:
    a_scale's layout where the caller has checked it."""
    # One multiply over every rank's rows needs a scale per row: tensor-wise shards keep one multiply per rank.
    return plans.gather_call(
        _AG,
        resolve_group(group_name, _AG),
        group_name,
        a_shard,
        [b.shape[1] for b in bs],
        dim,
        extra=(("a_scale", a_layout or check_a_scale(a_scale, a_shard, _AG)), ("out_dtype", str(out_dtype))),
        allow_unfused=a_scale.dim() > 0,
    )


def scaled_scatter_plan_call(
    a, a_scale, b, b_scale, dim: int, group_name: str, out_dtype, layouts: tuple[str, str] | None = None
) -> plans.Call:
    """The planner's view of a scaled_matmul_reduce_scatter call; ``layouts``: the scales' layouts where the
    caller has checked them."""
    # CUDA's scaled matmul wants widths in multiples of 16, which column pieces would not keep.
    return plans.scatter_call(
        _RS,
        resolve_group(group_name, _RS),
        group_name,
        a,
        b.shape[1],
        dim,
        out_dtype,
        extra=(("scales", ",".join(layouts or check_scaled_operands(a, a_scale, b, b_scale, out_dtype, _RS))),),
        columns_pieces=a.device.type != "cuda",
    )


@plans.planned_run("all_gather_scaled_matmul")
def _all_gather_scaled_matmul_planned(
    a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype, return_a=False, pieces=0
):
    group = resolve_group(group_name, _AG)
    dim, a_layout, b_layouts = _check_all_gather_scaled(
        a_shard, a_scale, bs, b_scales, gather_dim, out_dtype, group.size(), pieces
    )
    for b, b_layout in zip(bs, b_layouts):
        log_multiply(_AG, a_shard.dtype, b, (a_layout, b_layout), out_dtype)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.all_gather_scaled_matmul(
            a_shard, a_scale, bs, b_scales, gather_dim, group_name, out_dtype, return_a, plan.pieces, plan.split
        )

    if group.size() == 1:
        return plans.run_unplanned(run)
    # Row-wise and tensor-wise shards cannot meet in one gathered a: a_scale is compared too.
    bs_shapes = {f"bs[{i}]": b for i, b in enumerate(bs)}
    operands = {"a_shard": a_shard, "a_scale": a_scale, **bs_shapes}
    check_same_shapes(group_name, _AG, operands, gather_dim=dim, return_a=return_a, pieces=pieces)
    if a_shard.numel() == 0:
        return plans.run_unplanned(run)
    call = scaled_gather_plan_call(a_shard, a_scale, bs, dim, group_name, out_dtype, a_layout)
    return plans.run_planned(call, run, plans.decide(call, pieces, run))


@plans.planned_run("scaled_matmul_reduce_scatter")
def _scaled_matmul_reduce_scatter_planned(
    a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name, out_dtype, pieces=0
):
    group = resolve_group(group_name, _RS)
    dim, layouts = _check_scaled_reduce_scatter(
        a, a_scale, b, b_scale, scatter_dim, reduce_op, out_dtype, group.size(), pieces
    )
    columns = dim == a.dim() - 1  # each rank's n / W columns are a slice of b, multiplied alone
    log_multiply(_RS, a.dtype, b, layouts, out_dtype, b.shape[1] // group.size() if columns else None)
    ext = _cpp_lib.load()

    def run(plan: plans.Plan):
        return ext.scaled_matmul_reduce_scatter(
            a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name, out_dtype, plan.pieces, plan.split
        )

    if group.size() == 1:
        return plans.run_unplanned(run)
    product = scattered_shape(a.shape, b.shape[1], dim, group.size())
    operands = {"a @ b": a.new_empty((), dtype=out_dtype).expand(product), "a": a, "b": b}
    check_same_shapes(group_name, _RS, operands, scatter_dim=dim, reduce_op=reduce_op, pieces=pieces)
    if a.numel() == 0 or b.numel() == 0:
        return plans.run_unplanned(run)
    call = scaled_scatter_plan_call(a, a_scale, b, b_scale, dim, group_name, out_dtype, layouts)
    return plans.run_planned(call, run, plans.decide(call, pieces, run))


# ---- the fronts' fp8= option (quantization and its config: _fp8_operands.py) ----


def _gather_fp8(config, group_name, gather_dim, pieces, a_shard, bs, keep_a: bool):
    """The FP8 forward of all_gather_matmul: a_shard and each b quantized, then the scaled op; (the quantized shard's
    data and scale; the gathered FP8 a and its scales per row, or Nones without ``keep_a``; the products)."""
    a_data, a_scale = quantize_rows(a_shard, config.dtype, config)
    b_data, b_scales = [], []
    for b in bs:
        data, scale = quantize_columns(b, config.dtype, config)
        b_data.append(data)
        b_scales.append(scale)
    a_full, a_full_scale, outs = _SCALED_GATHER(
        a_data, a_scale, b_data, b_scales, gather_dim, group_name, a_shard.dtype, keep_a, pieces
    )
    return (a_data, a_scale), (a_full, a_full_scale), outs


def _start_fp8_gather(a_data, a_scale, gather_dim: int, group_name: str):
    """The FP8 shard and its scale (saved for backward) gathered again, in the op's layout: started now, (the gathered
    FP8 a, its scales per row) waited for by calling what this returns."""
    scale_rows = a_scale.expand(*a_data.shape[:-1], 1) if a_scale.dim() == 0 else a_scale  # tensor-wise: one per row
    # One transfer of each row's bytes, its FP8 data then its scales (gloo has no FP8 types; one collective in flight,
    # not two).
    k = a_data.shape[-1]
    # Fresh row-major strides: a contiguous tensor may keep stride 0 on a size-1 last dim, which a byte view refuses.
    scale_rows = scale_rows.clone(memory_format=torch.contiguous_format)
    packed = torch.cat([a_data.view(torch.uint8), scale_rows.view(torch.uint8)], dim=-1)
    finish = started_all_gather(packed, gather_dim, group_name)

    def gathered():
        rows = finish()
        data = rows[..., :k].contiguous().view(a_data.dtype)
        # A copy of its own (offset 0, row-major): the scales' bytes start at byte k of a row, unaligned.
        return data, rows[..., k:].clone(memory_format=torch.contiguous_format).view(a_scale.dtype)

    return gathered


class _Float8AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, group_name, gather_dim, pieces, return_a, keep_gathered, a_shard, *bs):
        keep = keep_gathered and any(b.requires_grad for b in bs)
        (a_data, a_scale), (a_full, a_full_scale), outs = _gather_fp8(
            config, group_name, gather_dim, pieces, a_shard, bs, return_a or keep
        )
        ctx.config, ctx.group_name, ctx.gather_dim, ctx.pieces = config, group_name, gather_dim, pieces
        ctx.dtype, ctx.kept_gathered = a_shard.dtype, keep
        # What the bs' gradients need: the FP8 shard and its scale (gathered again in backward), or with
        # keep_gathered the gathered FP8 a and its scales; nothing where no b needs a gradient.
        if keep:
            a_saved = (a_full, a_full_scale)
        elif any(b.requires_grad for b in bs):
            a_saved = (a_data, a_scale)
        else:
            a_saved = (None, None)
        ctx.save_for_backward(*a_saved, *bs)
        # The gathered a's own gradient takes another path (_GatheredGradient), so that the dgrad below runs as the
        # config says whether or not the gathered a is used.
        gathered = dequantize(a_full, a_full_scale, a_shard.dtype) if return_a else None
        ctx.mark_non_differentiable(*[t for t in (a_full, a_full_scale, gathered) if t is not None])
        # An unused product gets no gradient, not zeros (eager; compiled, dynamo passes zeros).
        ctx.set_materialize_grads(False)
        return (gathered, *outs)

    @staticmethod
    def backward(ctx, _grad_gathered, *grad_outs):
        a_saved, a_saved_scale, *bs = ctx.saved_tensors
        grads = [(g, i) for i, g in enumerate(grad_outs) if g is not None]
        need_bs = any(ctx.needs_input_grad[7:]) and grads
        regather = None
        if need_bs and not ctx.kept_gathered:  # travels while the dgrad runs
            regather = _start_fp8_gather(a_saved, a_saved_scale, ctx.gather_dim, ctx.group_name)
        grad_a = None
        if ctx.needs_input_grad[6] and grads:
            grad_c, b_t = input_grad_operands(bs, grads)
            if ctx.config.backward_in_fp8:
                g_data, g_scale = quantize_rows(grad_c, ctx.config.grad_dtype, ctx.config)
                bt_data, bt_scale = quantize_columns(b_t, ctx.config.dtype, ctx.config)
                grad_a = torch.ops.fastmesh.scaled_matmul_reduce_scatter(
                    g_data, g_scale, bt_data, bt_scale, ctx.gather_dim, "sum", ctx.group_name, ctx.dtype, ctx.pieces
                )
            else:
                grad_a = torch.ops.fastmesh.matmul_reduce_scatter(
                    grad_c.contiguous(), b_t, ctx.gather_dim, "sum", ctx.group_name, ctx.pieces
                )
        grad_bs = [None] * len(bs)
        if need_bs:
            a_full, a_full_scale = regather() if regather is not None else (a_saved, a_saved_scale)
            a_hp = as_matrix(dequantize(a_full, a_full_scale, ctx.dtype))
            for g, i in grads:
                grad_bs[i] = a_hp.t() @ as_matrix(g)
        return (None, None, None, None, None, None, grad_a, *grad_bs)


class _GatheredGradient(torch.autograd.Function):
    """The dequantized gathered a (``gathered``, not differentiable) as a function of ``a_shard``: its gradient
    passes straight through the quantization (as FP8 training does) and is reduce-scattered back to the shards in
    the input dtype, a transfer of its own. Apart from the products' dgrad because an output of an autograd.Function
    that nothing uses gets zeros, not None, under torch.compile: the dgrad would not know whether the gathered a
    has a gradient, and compiled and eager would run it differently."""

    @staticmethod
    def forward(ctx, gathered, a_shard, gather_dim, group_name):
        ctx.gather_dim, ctx.group_name = gather_dim, group_name
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        return None, reduce_scatter(grad.contiguous(), ctx.gather_dim, ctx.group_name), None, None


def _scatter_fp8(config, group_name, scatter_dim, reduce_op, pieces, a, b):
    """The FP8 forward of matmul_reduce_scatter: a and b quantized, then the scaled op."""
    a_data, a_scale = quantize_rows(a, config.dtype, config)
    b_data, b_scale = quantize_columns(b, config.dtype, config)
    return _SCALED_SCATTER(a_data, a_scale, b_data, b_scale, scatter_dim, reduce_op, group_name, a.dtype, pieces)


class _Float8MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, group_name, scatter_dim, reduce_op, pieces, dgrad_in_fp8, a, b):
        out = _scatter_fp8(config, group_name, scatter_dim, reduce_op, pieces, a, b)
        ctx.config, ctx.group_name, ctx.scatter_dim, ctx.reduce_op, ctx.pieces = (
            config,
            group_name,
            scatter_dim,
            reduce_op,
            pieces,
        )
        ctx.dtype = a.dtype
        ctx.dgrad_in_fp8 = dgrad_in_fp8
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[6], ctx.needs_input_grad[7]
        if ctx.reduce_op == "avg":
            grad_out = grad_out / group_size(ctx.group_name, _RS)
        grad_a = grad_b = grad_c = None
        if ctx.dgrad_in_fp8:
            g_data, g_scale = quantize_rows(grad_out, ctx.config.grad_dtype, ctx.config)
            bt_data, bt_scale = quantize_columns(b.t(), ctx.config.dtype, ctx.config)
            g_full, g_full_scale, outs = torch.ops.fastmesh.all_gather_scaled_matmul(
                g_data, g_scale, [bt_data], [bt_scale], ctx.scatter_dim, ctx.group_name, ctx.dtype, need_b, ctx.pieces
            )
            grad_a = outs[0] if need_a else None
            if need_b:
                grad_c = dequantize(g_full, g_full_scale, ctx.dtype)
        else:
            grad_c, (grad_a,) = torch.ops.fastmesh.all_gather_matmul(
                grad_out.contiguous(), [b.t()], ctx.scatter_dim, ctx.group_name, need_b, ctx.pieces
            )
        if need_b:
            grad_b = as_matrix(a).t() @ as_matrix(grad_c)
        return None, None, None, None, None, None, (grad_a if need_a else None), grad_b


def all_gather_matmul_fp8(
    a_shard,
    bs: Sequence[torch.Tensor],
    gather_dim: int,
    group_name: str,
    return_a: bool,
    pieces: int,
    config: Float8Config,
    keep_gathered: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The fronts' ``fp8=`` path of all_gather_matmul (module docstring)."""
    check_rows_gathered(a_shard, gather_dim, "fastmesh.all_gather_matmul")  # before bs' MX / block sizes
    dgrad = fp8_dgrad_possible(config, a_shard)
    for b in bs:
        check_fp8_contraction(config, b.shape[0], b.shape[1], dgrad, "fastmesh.all_gather_matmul")
    if not (torch.is_grad_enabled() and (a_shard.requires_grad or any_requires_grad(bs))):
        # No backward to record: the forward alone (an autograd Function costs host time for nothing).
        _, (a_full, a_full_scale), outs = _gather_fp8(config, group_name, gather_dim, pieces, a_shard, bs, return_a)
        return (dequantize(a_full, a_full_scale, a_shard.dtype) if return_a else None), outs
    gathered, *outs = _Float8AllGatherMatmul.apply(
        config, group_name, gather_dim, pieces, return_a, keep_gathered, a_shard, *bs
    )
    if gathered is not None and a_shard.requires_grad:
        gathered = _GatheredGradient.apply(gathered, a_shard, gather_dim % a_shard.dim(), group_name)
    return gathered, list(outs)


def matmul_reduce_scatter_fp8(
    a, b, scatter_dim: int, group_name: str, reduce_op: str, pieces: int, config: Float8Config
) -> torch.Tensor:
    """The fronts' ``fp8=`` path of matmul_reduce_scatter (module docstring)."""
    # The dgrad gathers the product's scattered dim. Scattered columns make that the contraction dim, which the
    # FP8 gather cannot take (ranks' scales would share a dot product): that dgrad stays in a.dtype. So does one
    # with no columns (b [K, 0]): there is nothing to shrink.
    dgrad_in_fp8 = fp8_dgrad_possible(config, a) and scatter_dim % a.dim() != a.dim() - 1 and b.shape[1] > 0
    check_fp8_contraction(config, b.shape[0], b.shape[1], dgrad_in_fp8, "fastmesh.matmul_reduce_scatter")
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return _scatter_fp8(config, group_name, scatter_dim, reduce_op, pieces, a, b)  # no backward to record
    return _Float8MatmulReduceScatter.apply(config, group_name, scatter_dim, reduce_op, pieces, dgrad_in_fp8, a, b)

"""Host time per call, one process on torch's fake process group: fastmesh against the unfused torch sequence.

On a GPU a call is only as fast as the host can issue it: at decode and small-batch sizes (10-50 us of GPU work per
matmul) the host decides. This family measures that host cost where nothing else costs: torch's fake process group
(``torch.testing._internal.distributed.fake_pg``, world 2; its collectives move nothing and return at once), tiny
tensors, one thread. Per case, each contender runs ``CALLS`` calls per round (``QUICK_CALLS`` with ``--quick``),
interleaved, and the figure is the time of one call:

* ``fastmesh`` (kernel): the public call (``fastmesh.all_gather_matmul(...)``, ``fastmesh.fp8.quantize(...)``),
  forward (under ``no_grad``) or forward and backward (``fwd+bwd``: the sum of the outputs, backward);
* ``unfused`` (baseline): the torch sequence it replaces, as a user writes it: c10d's collective (``dist``) then
  ``@`` (forward), torch's differentiable functional collective and ``@`` (``fwd+bwd``), the quantization's eager
  composite (amax, scale, multiply, clamp, cast), or for the FP8 forms (float32 operands) the composite's
  quantization of both operands, the collective of the FP8 bytes and their scales, and torch's scaled matmul
  (``torch._scaled_mm``; dequantize and ``@`` for the MX and block scales torch does not multiply on CPU);
* ``schedule`` (bound): what the call costs with no layer above the C++: the schedule of the plan the call took,
  called directly (``fastmesh._C``), with, for ``fwd+bwd``, the backward's schedules and matmuls, and for the FP8
  forms the C++ cast kernels; for ``quantize``, its C++ kernel (``torch.ops.fastmesh.fp8_quantize_native``).

The targets (issue 42): forward <= 1.0x the unfused sequence, forward and backward <= 1.25x, quantize <= 1.0x.
Every fastmesh result is checked against the unfused one before timing.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from fastmesh.bench.family import Context, Family
from fastmesh.bench.figures import Case, Contender
from fastmesh.bench.timing import time_interleaved

import fastmesh
from fastmesh.ops import plans
from fastmesh.ops._collectives import all_gather, all_gather_into, reduce_scatter, reduce_scatter_into
from fastmesh.ops.fp8_quantize import dequantize

WORLD = 2
CALLS = 200  # calls per contender per round: a round of ~5-50 ms, far above the clock's resolution
QUICK_CALLS = 50
E4M3 = torch.float8_e4m3fn
FP8_FORMS = ("tensorwise", "rowwise", "mx", "block1x128")


@dataclasses.dataclass
class _Contenders:
    fastmesh: Callable
    unfused: Callable
    schedule: Callable


def _random(shape, seed, dtype=torch.float32, requires_grad=False):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(requires_grad)


def _forward_and_backward(fn, inputs):
    """fn's outputs summed and differentiated; the gradients are dropped afterwards."""

    def step():
        outs = fn()
        total = sum(o.float().sum() for o in (outs if isinstance(outs, (list, tuple)) else [outs]) if o is not None)
        total.backward()
        for t in inputs:
            t.grad = None

    return step


def _ext():
    return fastmesh._cpp_lib.load()


def _plan_of(op: str) -> plans.Plan:
    decided = plans.last_decision(op)
    return decided[1].plan if decided else plans.FIXED


def _case(fused, unfused, schedule, inputs, backward: bool, schedule_backward=None) -> _Contenders:
    """The contenders of an op's case: forward only, or forward and backward (the schedule's bound then runs the
    backward's schedules and local matmuls too, with the gradient of a sum: ones)."""
    if not backward:
        return _Contenders(fused, unfused, schedule)
    return _Contenders(
        _forward_and_backward(fused, inputs),
        _forward_and_backward(unfused, inputs),
        lambda: schedule_backward(schedule()),
    )


def _gather_case(group, name, backward: bool) -> _Contenders:
    a = _random((8, 64), 1, requires_grad=backward)
    b = _random((64, 64), 2, requires_grad=backward)
    ones = torch.ones(16, 64)

    def torch_forward():
        if backward:
            return all_gather(a, 0, name) @ b
        out = torch.empty(16, 64)  # the op allocates its results too: the same allocation pattern
        all_gather_into(out, a, group=group)
        return out @ b

    def fused():
        return fastmesh.all_gather_matmul(a, [b], 0, group=group)[1][0]

    with torch.no_grad():
        fused()
    plan = _plan_of("fastmesh::all_gather_matmul")
    back = _plan_of("fastmesh::matmul_reduce_scatter")

    def schedule():
        return _ext().all_gather_matmul(a.detach(), [b.detach()], 0, name, backward, plan.pieces, plan.split)

    def schedule_backward(forward):
        a_full, _ = forward
        _ext().matmul_reduce_scatter(ones, b.detach().t(), 0, "sum", name, back.pieces, back.split)
        return a_full.t() @ ones

    return _case(fused, torch_forward, schedule, [a, b], backward, schedule_backward)


def _scatter_case(group, name, backward: bool) -> _Contenders:
    a = _random((16, 64), 3, requires_grad=backward)
    b = _random((64, 64), 4, requires_grad=backward)
    ones = torch.ones(8, 64)

    def torch_forward():
        if backward:
            return reduce_scatter(a @ b, 0, name)
        out = torch.empty(8, 64)
        reduce_scatter_into(out, a @ b, group=group)
        return out

    def fused():
        return fastmesh.matmul_reduce_scatter(a, b, 0, group=group)

    with torch.no_grad():
        fused()
    plan = _plan_of("fastmesh::matmul_reduce_scatter")
    back = _plan_of("fastmesh::all_gather_matmul")

    def schedule():
        return _ext().matmul_reduce_scatter(a.detach(), b.detach(), 0, "sum", name, plan.pieces, plan.split)

    def schedule_backward(_):
        grad_c, _ = _ext().all_gather_matmul(ones, [b.detach().t()], 0, name, True, back.pieces, back.split)
        return a.detach().t() @ grad_c

    return _case(fused, torch_forward, schedule, [a, b], backward, schedule_backward)


def _all_reduce_case(group, name, backward: bool) -> _Contenders:
    a = _random((8, 64), 5, requires_grad=backward)
    b = _random((64, 64), 6, requires_grad=backward)
    ones = torch.ones(8, 64)

    def torch_forward():
        # The all-reduce of a row-parallel output needs no collective in backward: torch's functional all-reduce has
        # no autograd, so the plain one (its gradient passes through) is the sequence a user differentiates.
        c = a @ b
        dist.all_reduce(c, group=group)
        return c

    def fused():
        return fastmesh.matmul_all_reduce(a, b, group=group)

    with torch.no_grad():
        fused()
    plan = _plan_of("fastmesh::matmul_all_reduce")

    def schedule():
        return _ext().matmul_all_reduce(a.detach(), b.detach(), "sum", name, plan.pieces, plan.split)

    def schedule_backward(_):
        return ones @ b.detach().t(), a.detach().t() @ ones

    return _case(fused, torch_forward, schedule, [a, b], backward, schedule_backward)


def _product_gather_case(group, name, backward: bool) -> _Contenders:
    a = _random((8, 64), 7, requires_grad=backward)
    b = _random((64, 32), 8, requires_grad=backward)
    ones = torch.ones(8, WORLD * 32)

    def torch_forward():
        if backward:
            return torch.cat(all_gather(a @ b, 0, name).chunk(WORLD), dim=-1)
        out = torch.empty(WORLD * 8, 32)
        all_gather_into(out, a @ b, group=group)
        return torch.cat(out.chunk(WORLD), dim=-1)

    def fused():
        return fastmesh.matmul_all_gather(a, b, group=group)

    with torch.no_grad():
        fused()
    plan = _plan_of("fastmesh::matmul_all_gather")

    def schedule():
        return _ext().matmul_all_gather(a.detach(), b.detach(), name, plan.pieces, plan.split)

    def schedule_backward(_):
        mine = torch.ops.fastmesh.rank_columns(ones, name)
        return mine @ b.detach().t(), a.detach().t() @ mine

    return _case(fused, torch_forward, schedule, [a, b], backward, schedule_backward)


# ---- FP8: the quantization's eager composite, then the unfused sequence on its FP8 operands ----


def composite_quantize(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M and K multiples of the blocks) quantized to e4m3 in eager torch ops: data and the dequantization
    scale in the layout fastmesh gives (MX: the floor rule's power-of-two scales, as float32)."""
    m, k = x.shape
    a = x.abs().float()
    if granularity == "tensorwise":
        amax = a.amax()
    elif granularity == "rowwise":
        amax = a.amax(dim=-1, keepdim=True)
    elif granularity == "block1x128":
        amax = a.view(m, -1, min(k, 128)).amax(dim=-1)
    elif granularity == "block128x128":
        amax = a.view(-1, min(m, 128), k // min(k, 128), min(k, 128)).amax(dim=(1, 3))
    else:  # mx: 2**(floor(log2(amax)) - 8) per 32 elements
        amax = a.view(m, k // 32, 32).amax(dim=-1)
        scale = torch.exp2(torch.floor(torch.log2(amax.clamp(min=2**-126))) - 8)
        data = (x.float().view(m, k // 32, 32) / scale.unsqueeze(-1)).clamp(-448, 448).to(E4M3).view(m, k)
        return data, scale
    scale = amax.clamp(min=1e-12) / 448.0
    values = x.float()
    if granularity == "block1x128":
        values = values.view(m, -1, min(k, 128)) / scale.unsqueeze(-1)
    elif granularity == "block128x128":
        values = values.view(scale.shape[0], -1, scale.shape[1], min(k, 128)) / scale[:, None, :, None]
    else:
        values = values / scale
    return values.clamp(-448, 448).to(E4M3).view(m, k), scale


def _scaled_product(a_data, a_scale, b_data, b_scale, granularity, dtype):
    """torch's scaled matmul of the composite's operands (b [K, N] column-major), or dequantize and ``@`` for the
    scales torch does not multiply on CPU (MX, blocks)."""
    if granularity in ("tensorwise", "rowwise"):
        a_scale = a_scale.expand(a_data.shape[0], 1).contiguous()
        b_scale = b_scale.expand(1, b_data.shape[1]).contiguous()
        return torch._scaled_mm(a_data, b_data, scale_a=a_scale, scale_b=b_scale, out_dtype=dtype)
    if granularity == "mx":
        a_values = (a_data.float().unflatten(-1, (-1, 32)) * a_scale.unsqueeze(-1)).flatten(-2)
        b_values = (b_data.t().float().unflatten(-1, (-1, 32)) * b_scale.t().unsqueeze(-1)).flatten(-2).t()
    else:
        a_values = dequantize(a_data, a_scale.view(a_data.shape[0], -1), torch.float32)
        b_values = dequantize(b_data, b_scale, torch.float32)
    return (a_values @ b_values).to(dtype)


_B_GRANULARITY = {"block1x128": "block128x128"}


def _native_quantize(x: torch.Tensor, granularity: str):
    """The C++ cast kernel called directly: (data, scale)."""
    if granularity == "mx":
        return torch.ops.fastmesh.mx_quantize_native(x, E4M3, "floor", False)[:2]
    return torch.ops.fastmesh.fp8_quantize_native(x, E4M3, granularity, None, None, False, False)[:2]


def _fp8_case(group, name, op: str, granularity: str) -> _Contenders:
    """The front with ``fp8=`` (forward; float32 operands, so that the CPU's 16-bit matmul speed stays out of it)
    against the composite's quantization of both operands and the unfused sequence on them; the bound: the C++ cast
    kernels and the scaled op's schedule, called directly."""
    config = fastmesh.fp8.Float8Config(granularity=granularity)
    dtype = torch.float32
    rows = 16 if op == "rs" else 8
    a, b = _random((rows, 64), 9, dtype), _random((64, 64), 10, dtype)
    b_granularity = _B_GRANULARITY.get(granularity, granularity)

    def quantized():
        a_data, a_scale = composite_quantize(a, granularity)
        b_data, b_scale = composite_quantize(b.t(), b_granularity)
        return a_data, a_scale, b_data.t(), b_scale.t() if b_scale.dim() else b_scale

    def native():
        a_data, a_scale = _native_quantize(a, granularity)
        b_data, b_scale = _native_quantize(b.t().contiguous(), b_granularity)
        return a_data, a_scale, b_data.t(), b_scale.t() if b_scale.dim() else b_scale

    if op == "ag":

        def unfused():
            a_data, a_scale, b_data, b_scale = quantized()
            gathered = torch.empty(WORLD * rows, 64, dtype=torch.uint8)
            all_gather_into(gathered, a_data.view(torch.uint8), group=group)
            if granularity == "tensorwise":  # each rank's tensor-wise scale, one per row of its shard
                scales = torch.empty(WORLD, 1)
                all_gather_into(scales, a_scale.reshape(1, 1), group=group)
                a_scale = scales.repeat_interleave(rows, dim=0)
            else:
                gathered_scales = torch.empty(WORLD * rows, *a_scale.shape[1:])
                all_gather_into(gathered_scales, a_scale.contiguous(), group=group)
                a_scale = gathered_scales
            return _scaled_product(gathered.view(E4M3), a_scale, b_data, b_scale, granularity, dtype)

        def fused():
            return fastmesh.all_gather_matmul(a, [b], 0, group=group, fp8=config)[1][0]

        fused()
        plan = _plan_of("fastmesh::all_gather_scaled_matmul")

        def schedule():
            a_data, a_scale, b_data, b_scale = native()
            return _ext().all_gather_scaled_matmul(
                a_data, a_scale, [b_data], [b_scale], 0, name, dtype, False, plan.pieces, plan.split
            )

        return _Contenders(fused, unfused, schedule)

    def unfused_product():
        return _scaled_product(*quantized(), granularity, dtype)

    if op == "rs":

        def unfused():
            out = torch.empty(rows // WORLD, 64, dtype=dtype)
            reduce_scatter_into(out, unfused_product(), group=group)
            return out

        def fused():
            return fastmesh.matmul_reduce_scatter(a, b, 0, group=group, fp8=config)

        fused()
        plan = _plan_of("fastmesh::scaled_matmul_reduce_scatter")

        def schedule():
            return _ext().scaled_matmul_reduce_scatter(*native(), 0, "sum", name, dtype, plan.pieces, plan.split)

        return _Contenders(fused, unfused, schedule)

    def unfused_all_reduce():
        c = unfused_product()
        dist.all_reduce(c, group=group)
        return c

    def fused_all_reduce():
        return fastmesh.matmul_all_reduce(a, b, group=group, fp8=config)

    fused_all_reduce()
    plan = _plan_of("fastmesh::scaled_matmul_all_reduce")

    def schedule_all_reduce():
        return _ext().scaled_matmul_all_reduce(*native(), "sum", name, dtype, plan.pieces, plan.split)

    return _Contenders(fused_all_reduce, unfused_all_reduce, schedule_all_reduce)


def _quantize_case(granularity: str) -> _Contenders:
    x = _random((128, 128), 11, torch.bfloat16)
    if granularity == "mx":
        return _Contenders(
            lambda: fastmesh.fp8.quantize(x, dtype=E4M3, granularity="mx"),
            lambda: composite_quantize(x, "mx"),
            lambda: torch.ops.fastmesh.mx_quantize_native(x, E4M3, "floor", False),
        )
    return _Contenders(
        lambda: fastmesh.fp8.quantize(x, dtype=E4M3, granularity=granularity),
        lambda: composite_quantize(x, granularity),
        lambda: torch.ops.fastmesh.fp8_quantize_native(x, E4M3, granularity, None, None, False, False),
    )


def _high_precision(label, make):
    """An op's cases: forward, and forward and backward (float32)."""

    def cases(group, name):
        yield f"{label} fwd", "float32", lambda: make(group, name, False)
        yield f"{label} fwd+bwd", "float32", lambda: make(group, name, True)

    return cases


def _fp8(op, code):
    """An FP8 form's cases: the front's forward with each fp8= granularity."""

    def cases(group, name):
        for granularity in FP8_FORMS:
            yield f"{op} fp8 {granularity} fwd", "float8", lambda g=granularity: _fp8_case(group, name, code, g)

    return cases


def _casts(granularities):
    def cases(group, name):
        for granularity in granularities:
            yield f"quantize {granularity} [128, 128]", "float8", lambda g=granularity: _quantize_case(g)

    return cases


# By op (its spec's host_bench, fastmesh/ops/_library.py): the cases that time its front.
CASES = {
    "all_gather_matmul": _high_precision("all_gather_matmul [8, 64] x [64, 64]", _gather_case),
    "matmul_reduce_scatter": _high_precision("matmul_reduce_scatter [16, 64] x [64, 64]", _scatter_case),
    "matmul_all_reduce": _high_precision("matmul_all_reduce [8, 64] x [64, 64]", _all_reduce_case),
    "matmul_all_gather": _high_precision("matmul_all_gather [8, 64] x [64, 32]", _product_gather_case),
    "all_gather_scaled_matmul": _fp8("all_gather_matmul", "ag"),
    "scaled_matmul_reduce_scatter": _fp8("matmul_reduce_scatter", "rs"),
    "scaled_matmul_all_reduce": _fp8("matmul_all_reduce", "ar"),
    "fp8_quantize": _casts(("tensorwise", "rowwise", "block1x128", "block128x128")),
    "mx_quantize": _casts(("mx",)),
}


def _cases(group, name, quick: bool):
    """(label, dtype, make contenders) for every case; without ``quick`` also the compiled block (its three
    compilations take a minute or two)."""
    for cases in CASES.values():
        yield from cases(group, name)
    if not quick:
        yield "compiled SP MLP [16, 64] fwd+bwd", "float32", lambda: _compiled_block_case(group, name)


def _compiled_block_case(group, name) -> _Contenders:
    """A sequence-parallel MLP ([16, 64] tokens, 64 -> 128 -> 64, no biases) under torch's native plan, compiled
    (inductor, fullgraph), forward and backward: with fastmesh's fusion pass (its 4 collectives fused; the fixed
    rule, FASTMESH_TUNE=off: at these sizes the model would trace them unfused, as torch's own) against without it;
    the bound: the unsharded MLP compiled, which has no collective at all."""
    import copy
    import os

    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fastmesh.compile
    from fastmesh import settings

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 128, bias=False), torch.nn.GELU(), torch.nn.Linear(128, 64, bias=False)
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {"0": ColwiseParallel(input_layouts=Shard(0)), "2": RowwiseParallel(output_layouts=Shard(0))}
    x = _random((16 // WORLD, 64), 12, requires_grad=True)
    unsharded_x = _random((16, 64), 12, requires_grad=True)

    # Three functions, so three code objects: dynamo caches a graph per code object, and these three modules would
    # otherwise share one (their parameters are the graph's inputs), whatever the pass did to it.
    def native_forward(model, inputs):
        return model(inputs)

    def fused_forward(model, inputs):
        return model(inputs)

    def unsharded_forward(model, inputs):
        return model(inputs)

    def step(forward, model, inputs):
        compiled = torch.compile(forward, fullgraph=True)
        run = _forward_and_backward(lambda: compiled(model, inputs), [inputs, *model.parameters()])
        run()  # compiled now, with the pass or not
        return run

    torch._dynamo.reset()
    native = step(native_forward, parallelize_module(copy.deepcopy(mlp), mesh, plan), x)
    saved = os.environ.get("FASTMESH_TUNE")
    os.environ["FASTMESH_TUNE"] = "off"
    settings.reload()
    fastmesh.compile.enable_fusion(strict=True)
    fastmesh.compile.fusion_report(reset=True)
    try:
        # Inductor's caches would serve the native graphs (a cached graph does not run the pass).
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            fused = step(fused_forward, parallelize_module(copy.deepcopy(mlp), mesh, plan), x)
    finally:
        fastmesh.compile.disable_fusion()
        if saved is None:
            os.environ.pop("FASTMESH_TUNE")
        else:
            os.environ["FASTMESH_TUNE"] = saved
        settings.reload()
    fusions = fastmesh.compile.fusion_report()
    if len(fusions.fused) != 4:
        raise RuntimeError(f"host: the compiled block fused {len(fusions.fused)} collectives, not 4: {fusions}")
    return _Contenders(fused, native, step(unsharded_forward, copy.deepcopy(mlp), unsharded_x))


def _check(contenders: _Contenders, label: str) -> None:
    """fastmesh's forward result against the unfused one (FP8: the dequantized or multiplied values, to FP8's
    precision); a forward-and-backward case is run once."""
    got, want = contenders.fastmesh(), contenders.unfused()
    if got is None:  # fwd+bwd: nothing returned
        return
    if isinstance(got, fastmesh.fp8.Float8Quantized):
        got = got.dequantize()
        data, scale = want
        want = dequantize(data, scale, torch.float32) if scale.dim() < 2 or scale.shape == data.shape else None
        if want is None:  # MX / block scales: the composite's per-block layout
            return
    if isinstance(got, (list, tuple)):
        got = got[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=0.15, atol=0.15, msg=lambda m: f"{label}: {m}")


def _run_case(ctx: Context, label: str, dtype: str, contenders: _Contenders, calls: int) -> None:
    with torch.no_grad() if "fwd+bwd" not in label else torch.enable_grad():
        _check(contenders, label)
        candidates = {"fastmesh": contenders.fastmesh, "unfused": contenders.unfused, "schedule": contenders.schedule}

        def many(fn):
            def run_calls():
                for _ in range(calls):
                    fn()

            return run_calls

        looped = {name: many(fn) for name, fn in candidates.items()}
        time_interleaved(looped, ctx.warmup)
        timings = time_interleaved(looped, ctx.repeats)
    per_call = {name: [s / calls for s in seconds] for name, seconds in timings.items()}
    figures = {
        "fastmesh": Contender("kernel", per_call["fastmesh"]),
        "unfused": Contender("baseline", per_call["unfused"]),
        "schedule": Contender("bound", per_call["schedule"]),
    }
    ctx.emit(Case("host", label, dtype, "fastmesh", figures, params={"calls_per_round": calls}))


def run(ctx: Context) -> None:
    if dist.is_initialized():
        ctx.note("not run: a process group is already initialized here (the family starts torch's fake one)")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        group = dist.group.WORLD
        name = fastmesh.group_name(group)
        cases = list(_cases(group, name, ctx.quick))
        ctx.expect(len(cases))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 deprecates c10d's *_into_tensor names
            for label, dtype, make in cases:
                if dtype not in ctx.dtypes:
                    continue
                _run_case(ctx, label, dtype, make(), QUICK_CALLS if ctx.quick else CALLS)
    finally:
        plans.forget()
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    ctx.note(
        f"torch's fake process group (world {WORLD}): collectives move nothing; 1 thread; "
        f"{QUICK_CALLS if ctx.quick else CALLS} calls per contender per round, figures per call"
    )


def _parse_case(spec: str, world: int):
    raise ValueError("the host family has fixed cases (tiny shapes, host-bound); it takes no --case")


FAMILY = Family(
    name="host",
    description="host time per call on torch's fake process group: fastmesh's calls vs the unfused torch sequence",
    distributed=False,
    dtypes=("float32", "float8"),
    run=run,
    parse_case=_parse_case,
    plot_ratio="speedup_vs_unfused",
)

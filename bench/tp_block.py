"""One Llama block's training step under fastmesh's fused TP plan against torch's native plan, eager and compiled.

The step is a forward and backward of ``fastmesh.testing.llama.Block`` (RMSNorm, grouped-query attention with
RoPE, SwiGLU feed-forward) on this rank's block input ``x`` (requiring grad), loss ``output.sum()``, in one of two
forms (``block_plan`` names):

* sequence-parallel (``--case tp_block=BxSxDxF``): ``x [B, S/tp, D]``; ``fastmesh`` (the block's 2 all-gathers
  and 2 reduce-scatters per pass fused into its matmuls) against ``native`` (torch's SequenceParallel / Colwise /
  Rowwise styles);
* plain TP (``BxSxDxF:plain``): ``x [B, S, D]``, the same on every rank; ``fastmesh-plain`` (the 2 forward
  all-reduces fused into the row-parallel matmuls, the input gradient of each sibling group, q/k/v and w1/w3,
  summed by one fused all-reduce) against ``native-plain`` (torch's Colwise / Rowwise styles: the same 2 forward
  all-reduces, one backward all-reduce per column-parallel linear, 5).

Contenders, timed in the same interleaved rounds (each round starts with a barrier and counts as long as its
slowest rank):

* ``fastmesh`` (kernel) and ``native`` (baseline): the two plans, eager;
* sequence-parallel, ``fastmesh_keep`` (baseline): fastmesh's plan with ``keep_gathered=True``, eager: each gathered
  input kept for backward instead of its shard, which ``fastmesh`` gathers again in backward
  (``speedup_vs_fastmesh_keep``: what that second gather costs; the saved bytes: what it saves);
* float32 / bfloat16 also compiled (``torch.compile(fullgraph=True)``, inductor): ``native_c``,
  ``native_c+pass`` (the native plan compiled with fastmesh's fusion pass, which must fuse every matmul
  collective of the native graphs, 4 + 4 sequence-parallel and 2 + 5 plain, or leave them as not profitable:
  checked) and ``fastmesh_c``; ratios ``pass_speedup = native_c / native_c+pass`` and
  ``compiled_speedup = native_c / fastmesh_c``;
* float8: fastmesh's plan with ``Float8Config(granularity="rowwise")`` (tensor-wise on CPU before torch 2.13) on
  bf16 weights against the bf16 native plan, and, sequence-parallel, torchao's float8 plan
  (``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, tensor-wise) when torchao is installed and the backend
  carries float8 tensors (NCCL; gloo does not);
* ``comm`` (part): fastmesh's plan's collectives alone as c10d collectives of the same sizes: 4 all-gathers and 4
  reduce-scatters; plain, 4 all-reduces of ``[B, S, D]`` (the native plain plan runs 7);
* ``bound``: ``max(comm, compute)`` per round, where ``compute`` is the native step without its communication:
  the timed native step minus its exposed communication (the time the main thread is blocked in c10d calls,
  profiled afterwards over a few steps, ``fastmesh/testing/comm_profile.py``; the slowest rank's). Under the
  native plan nothing overlaps, so this is the block's computation alone. ``details`` in the JSON keep the
  profiled figures. On CUDA, NCCL's collectives are asynchronous, so the host is not blocked while they run:
  the profile then under-counts exposed communication and this bound is loose (too high).

Beside the times: the bytes each contender's step keeps for backward (``saved_bytes`` in the details and a note
per case; parameters left out), with ``shard_accounting``, the native plan's bytes with each gathered input kept
as its shard (Megatron-LM's sequence parallelism: what fastmesh's plan keeps).

Every contender's output and input gradient is checked against the native plan's before timing (compiled: the
tolerance of inductor's fp32 intermediates; float8: a relative error bound). Compiling happens in that check,
with inductor's graph caches off (a cached graph would not run the pass, whose report is checked).

Cases: ``--case tp_block=BxSxDxF[:plain]`` (batch, whole sequence length, model dim, feed-forward hidden dim; D/64
heads of 64, half as many key/value heads).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from fastmesh.bench import torchao_baselines
from fastmesh.bench.family import Context, Family
from fastmesh.bench.figures import Case, Contender
from fastmesh.bench.fused_collectives import rowwise_scaled_mm_on_cpu
from fastmesh.bench.timing import time_slowest_rank
from torch.distributed.tensor.parallel import parallelize_module

import fastmesh
import fastmesh.compile
from fastmesh.fp8 import Float8Config
from fastmesh.ops._collectives import all_gather_into, reduce_scatter_into
from fastmesh.testing.comm_profile import STEP_EVENT, cpu_profile, step_comm_times
from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables
from fastmesh.testing.saved_bytes import saved_bytes

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8": torch.bfloat16}
FP8_ROWWISE, FP8_TENSORWISE = Float8Config(granularity="rowwise"), Float8Config(granularity="tensorwise")
# name -> (plan, fusion pass on): the compiled contenders
COMPILED = {"native_c": ("native", False), "native_c+pass": ("native", True), "fastmesh_c": ("fastmesh", False)}
KEPT = "fastmesh_keep"  # fastmesh's plan keeping the gathered inputs (keep_gathered=True)
HEAD_DIM = 64
PROFILE_STEPS = 3
# assert_close (rtol, atol) between the plans, for unit-scale outputs and input gradients (|values| up to ~8).
# The reduction orders differ (the fused reduce-scatter adds fp32 partials and rounds once, gloo's rounds per
# addition): measured up to 1.5e-6 apart in fp32 and 2 ulps (2^-8 relative each) in bf16.
_TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 3e-2)}
# The compiled contenders: inductor keeps fp32 intermediates where eager rounds each op's bf16 result (measured
# up to 0.039 apart on a gradient element of 0.09 in bf16).
_COMPILED_TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (5e-2, 1e-1)}
# FP8 plans against the bf16 native plan, ||got - want|| / ||want||: measured 0.9-2.2% (torchao's tensor-wise
# plan; fastmesh's row-wise forward ~25 dB = 5.6%, its e5m2 gradients ~21 dB = 9%). A wrong result is ~100%.
_FP8_RELATIVE_ERROR = 0.15


@dataclasses.dataclass(frozen=True)
class Form:
    """What the block's two TP forms do differently: the plans' names, the collectives fastmesh's fusion pass
    must take per compiled graph of the native plan, and the part of the sequence each rank holds."""

    plans: dict[str, str]  # contender's plan ("native", "fastmesh", as in COMPILED) -> block_plan name
    fused_per_graph: dict[str, int]
    sequence_parallel: bool
    suffix: str  # of the case spec and label


SEQUENCE_PARALLEL = Form({"native": "native", "fastmesh": "fastmesh"}, {"forward": 4, "backward": 4}, True, "")
# Plain: 2 all-reduces of row-parallel products forward; backward, one per column-parallel linear's input gradient.
PLAIN = Form({"native": "native-plain", "fastmesh": "fastmesh-plain"}, {"forward": 2, "backward": 5}, False, ":plain")
FORMS = {form.suffix: form for form in (SEQUENCE_PARALLEL, PLAIN)}

# Cases "BxSxDxF[:plain]". Per rank and step the collectives move 8 * B*S/2*D elements (plain: 4 all-reduces of
# B*S*D, about the same bytes) and the matmuls do ~3 * B*S*D*(2*D + 2*Dkv + 3*F)/2 flops, plus attention (~S per
# element) and the elementwise work (plain: the norms and residuals on the whole sequence). Measured on the
# 2-core dev machine, 1 thread per rank, sequence-parallel: fp32 reaches comm/compute 0.27-0.35 at these sizes;
# bf16 halves the bytes but not the compute time (no AMX; bf16 elementwise ops convert) and stays at 0.14-0.24.
# The plain cases take D = 256 (the least flops per communicated byte) and the shorter sequences.
FULL_SHAPES = [
    "8x256x256x256",
    "8x256x256x512",
    "4x512x256x256",
    "16x128x512x512",
    "8x256x512x512",
    "8x256x256x512:plain",
    "4x512x256x256:plain",
    "16x128x256x256:plain",
]
QUICK_SHAPES = ["8x256x256x512"]


def parse_case(spec: str, world: int = 2) -> tuple[tuple[int, int, int, int], Form]:
    """``"BxSxDxF[:plain]"`` -> ((batch, seq_len, dim, ffn_hidden), form)."""
    shape_spec, colon, suffix = spec.partition(":")
    form = FORMS.get(colon + suffix)
    try:
        if form is None:
            raise ValueError
        batch, seq_len, dim, ffn_hidden = (int(s) for s in shape_spec.split("x"))
    except ValueError:
        raise ValueError(
            f'tp_block case {spec!r}: expected "BxSxDxF" or "BxSxDxF:plain", e.g. "8x256x256x512"'
        ) from None
    sequence = form.sequence_parallel
    if (
        min(batch, seq_len, dim, ffn_hidden) <= 0
        or dim % (2 * HEAD_DIM * world)
        or ffn_hidden % world
        or (sequence and seq_len % world)
    ):
        raise ValueError(
            f"tp_block case {spec!r}: {'S, ' if sequence else ''}F and D/{2 * HEAD_DIM} (the key/value heads) must "
            f"be positive and divisible by the {world} ranks"
        )
    return (batch, seq_len, dim, ffn_hidden), form


def shape_label(shape, form) -> str:
    return "x".join(map(str, shape)) + form.suffix


def _step(block, x, rope, fusion=None):
    """One training step; ``fusion`` None: eager; False / True: the block compiled without / with the pass."""
    forward = block
    if fusion is not None:
        # The pass as this compile's own inductor option: the compiled contenders share one code object, and
        # the option also keeps their dynamo cache entries apart (dynamo guards on the backend's config).
        options = fastmesh.compile.fusion_options(strict=True) if fusion else None
        forward = torch.compile(lambda x, rope: block(x, rope), fullgraph=True, options=options)

    def step():
        x.grad = None
        block.zero_grad(set_to_none=True)
        out = forward(x, rope)
        out.sum().backward()
        return out.detach()

    return step


def _check_fused(report, form, rank):
    """Every matmul collective of the native block fused, or left because its plan is the unfused sequence;
    returns how many were fused."""
    taken = {
        kind: sum(e.graph_kind == kind and (e.fused or e.unprofitable) for e in report.entries)
        for kind in form.fused_per_graph
    }
    if any(not e.expected for e in report.entries) or taken != form.fused_per_graph:
        raise RuntimeError(
            f"rank {rank}: the fusion pass did not fuse the native block as expected "
            f"({taken} instead of {form.fused_per_graph}):\n{report}"
        )
    return len(report.fused)


def _fp8_config(device_type, note):
    if device_type == "cpu" and not rowwise_scaled_mm_on_cpu():
        note("float8: fastmesh's plan with tensor-wise scales (torch < 2.13 has no row-wise _scaled_mm on CPU)")
        return FP8_TENSORWISE
    return FP8_ROWWISE


def _variants(dtype_name, form, mesh, note):
    """{contender: (plan, fusion)} for one dtype; plan "native" / "fastmesh" (the form names the block plan)."""
    variants = {"native": ("native", None), "fastmesh": ("fastmesh", None)}
    if form.sequence_parallel:  # plain TP gathers no input
        variants[KEPT] = ("fastmesh", None)
    if dtype_name != "float8":
        variants.update(COMPILED)
    elif form.sequence_parallel:  # torchao's float8 plan here is the sequence-parallel one
        ok, why = torchao_baselines.status()
        try:
            if not ok:
                raise RuntimeError(why)
            torchao_baselines.block_plan(mesh)  # raises where the backend cannot carry float8
            variants["torchao"] = ("torchao", None)
        except RuntimeError as error:
            note(f"torchao float8 plan not run: {error}")
    return variants


def block_steps(shape, form, dtype_name, mesh, note):
    """{contender: step()} on the same input and initial weights, after checking every contender's output and
    input gradient against the native plan's (which also compiles the compiled ones)."""
    batch, seq_len, dim, ffn_hidden = shape
    tp, rank = mesh.size(), mesh.get_local_rank()
    heads = dim // HEAD_DIM
    args = LlamaArgs(dim=dim, n_heads=heads, n_kv_heads=heads // 2, ffn_hidden=ffn_hidden)
    rope = tuple(t.to(mesh.device_type) for t in rope_tables(seq_len, args.head_dim, args.rope_theta))
    dtype = TORCH_DTYPES[dtype_name]
    if form.sequence_parallel:
        x = torch.randn(batch, seq_len // tp, dim, generator=torch.Generator().manual_seed(1000 + rank))
    else:  # replicated: the same on every rank
        x = torch.randn(batch, seq_len, dim, generator=torch.Generator().manual_seed(1000))
    x = x.to(device=mesh.device_type, dtype=dtype).requires_grad_()
    variants = _variants(dtype_name, form, mesh, note)
    fp8_config = _fp8_config(mesh.device_type, note)
    # The compiled contenders share one code object (the lambda in _step): forget earlier cases' graphs so that
    # this case's three stay under dynamo's recompile limit (hitting it fails, see run()).
    torch._dynamo.reset()
    steps, results, fused, saved_by = {}, {}, None, {}
    for name, (plan, fusion) in variants.items():
        torch.manual_seed(0)  # the same initial weights for every contender (each shards them from rank 0's)
        block = Block(args).to(device=mesh.device_type, dtype=dtype)
        if plan == "torchao":
            block = parallelize_module(torchao_baselines.convert(block), mesh, torchao_baselines.block_plan(mesh))
        else:
            fp8 = fp8_config if plan == "fastmesh" and dtype_name == "float8" else None
            block = parallelize_module(block, mesh, block_plan(form.plans[plan], fp8=fp8, keep_gathered=name == KEPT))
        steps[name] = _step(block, x, rope, fusion)
        fastmesh.compile.fusion_report(reset=True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with saved_bytes(excluded=list(block.parameters())) as saved:
            results[name] = (steps[name](), x.grad)  # compiles a compiled contender
        saved_by[name] = saved.total
        if fusion is not None and torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs + 1:
            raise RuntimeError(f"rank {rank}: {name} did not compile its own graph")
        if fusion:
            fused = _check_fused(fastmesh.compile.fusion_report(), form, rank)
    if fused == 0:
        note(
            f"{shape_label(shape, form)} {dtype_name}: the fusion pass left every collective (the fused ops' plans "
            "are unfused at these shapes), so native_c+pass runs native_c's graph"
        )
    for name in variants:
        if name == "native":
            continue
        for what, want, got in zip(("output", "input gradient"), results["native"], results[name]):
            where = f"rank {rank}, {shape_label(shape, form)}, {dtype_name}, {name} {what}"
            if dtype_name == "float8":
                error = ((got.float() - want.float()).norm() / want.float().norm()).item()
                if not error <= _FP8_RELATIVE_ERROR:
                    raise AssertionError(f"{where}: relative error {error:.3f} > {_FP8_RELATIVE_ERROR}")
            else:
                rtol, atol = (_TOLERANCES if variants[name][1] is None else _COMPILED_TOLERANCES)[dtype_name]
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
    return steps, saved_by


def saved_for_backward(saved_by: dict[str, int], shape, form, dtype, world: int) -> dict[str, int]:
    """Bytes each contender's step keeps for backward (parameters left out), and ``shard_accounting``: the native
    plan's with each of the block's two gathered inputs kept as its shard, as Megatron-LM's sequence parallelism
    keeps it (sequence-parallel form; plain TP gathers no input)."""
    batch, seq_len, dim, _ = shape
    saved = dict(saved_by)
    if form.sequence_parallel:
        shard = batch * seq_len // world * dim * dtype.itemsize
        saved["shard_accounting"] = saved_by["native"] - 2 * (world - 1) * shard
    return saved


def comm_step(shape, form, dtype, group, device):
    """fastmesh's plan's collectives of the block step alone, as c10d collectives of the step's sizes."""
    batch, seq_len, dim, _ = shape
    world = group.size()
    if not form.sequence_parallel:
        # Zeros stay zeros however often they are summed.
        activation = torch.zeros(batch * seq_len * dim, device=device, dtype=dtype)

        def comm():
            for _ in range(4):  # 2 per pass, forward and backward
                dist.all_reduce(activation, group=group)

        return comm
    shard_numel = batch * seq_len // world * dim
    shard = torch.randn(shard_numel, device=device).to(dtype)
    full = torch.randn(world * shard_numel, device=device).to(dtype)
    gathered, scattered = torch.empty_like(full), torch.empty_like(shard)

    def comm():
        for _ in range(4):  # 2 per pass, forward and backward
            all_gather_into(gathered, shard, group=group)
            reduce_scatter_into(scattered, full, group=group)

    return comm


def exposed_communication(step, group, steps=PROFILE_STEPS):
    """The slowest rank's (the least) median exposed communication per step, in seconds, with its split by event.
    A rank's exposed time includes waiting for a slower peer, so the least is the step's own."""
    with cpu_profile() as prof:
        for _ in range(steps):
            dist.barrier(group=group)
            with torch.profiler.record_function(STEP_EVENT):
                step()
    times = step_comm_times(prof)
    names = sorted({name for t in times for name in t.by_name})
    mine = {
        "exposed_s": statistics.median(t.exposed for t in times),
        "by_event_s": {name: statistics.median(t.by_name.get(name, 0.0) for t in times) for name in names},
    }
    ranks = [None] * group.size()
    dist.all_gather_object(ranks, mine, group=group)
    return min(ranks, key=lambda r: r["exposed_s"])


def run(ctx: Context) -> None:
    # A compiled contender that silently fell back to eager would be timed as if compiled.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # A graph served from inductor's caches (e.g. written by the other rank) does not run the fusion pass, whose
    # report is checked.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    world = ctx.group.size()
    cases = []
    for dtype_name in ctx.measured_dtypes(TORCH_DTYPES):
        for spec in ctx.cases or (QUICK_SHAPES if ctx.quick else FULL_SHAPES):
            shape, form = parse_case(spec, world)
            cases.append((shape, form, spec, dtype_name))
    ctx.expect(len(cases))
    for shape, form, spec, dtype_name in cases:
        steps, saved_by = block_steps(shape, form, dtype_name, ctx.mesh, ctx.note)
        saved = saved_for_backward(saved_by, shape, form, TORCH_DTYPES[dtype_name], world)
        ctx.note(
            f"{spec} {dtype_name}: saved for backward per step, MB: "
            + ", ".join(f"{name} {saved_mb:.2f}" for name, saved_mb in ((n, b / 1e6) for n, b in saved.items()))
        )
        steps["comm"] = comm_step(shape, form, TORCH_DTYPES[dtype_name], ctx.group, ctx.device)
        timings = time_slowest_rank(steps, ctx.group, ctx.warmup, ctx.repeats, ctx.clock)
        native_exposed = exposed_communication(steps["native"], ctx.group)
        fastmesh_exposed = exposed_communication(steps["fastmesh"], ctx.group)
        # The timed step, not the profiled one, so that the profiler's own overhead is not counted as computation.
        compute = statistics.median(timings["native"]) - native_exposed["exposed_s"]
        kinds = {"fastmesh": "kernel", "fastmesh_c": "kernel", "comm": "part"}
        contenders = {name: Contender(kinds.get(name, "baseline"), seconds) for name, seconds in timings.items()}
        contenders["bound"] = Contender("bound", [max(c, compute) for c in timings["comm"]])
        extra = {}
        if "native_c" in timings:
            extra = {
                "pass_speedup": ("native_c", "native_c+pass"),
                "compiled_speedup": ("native_c", "fastmesh_c"),
                "fastmesh_eager_over_compiled": ("fastmesh", "fastmesh_c"),
            }
        details = {
            "compute_s": compute,
            "comm_over_compute": statistics.median(timings["comm"]) / compute,
            "native_exposed": native_exposed,
            "fastmesh_exposed": fastmesh_exposed,
            "saved_bytes": saved,
        }
        batch, seq_len, dim, ffn_hidden = shape
        params = {"batch": batch, "seq_len": seq_len, "dim": dim, "ffn_hidden": ffn_hidden, "world": world}
        ctx.emit(
            Case(
                "tp_block",
                f"block {spec.replace(':', ' ')}",
                dtype_name,
                "fastmesh",
                contenders,
                extra_ratios=extra,
                details=details,
                params={**params, "sequence_parallel": form.sequence_parallel},
            )
        )


FAMILY = Family(
    "tp_block",
    "one Llama block's forward+backward, sequence-parallel or plain TP: fastmesh's plan against torch's native "
    "plan, eager, compiled and with fastmesh's fusion pass, and max(comm, compute)",
    distributed=True,
    dtypes=tuple(TORCH_DTYPES),
    run=run,
    parse_case=parse_case,
)

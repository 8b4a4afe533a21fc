"""Benchmark of one Llama block's training step under fastmesh's fused TP plan and torch's native one.

The step is a forward and backward of ``fastmesh.testing.llama.Block`` (RMSNorm, grouped-query attention with
RoPE, SwiGLU feed-forward) on this rank's sequence shard ``x [B, S/tp, D]`` (requiring grad), loss
``output.sum()``, with the block parallelized by ``block_plan("native")`` (torch's SequenceParallel /
Colwise / Rowwise styles: 2 all-gathers and 2 reduce-scatters forward, the same backward) or
``block_plan("fastmesh")`` (the same collectives fused into the matmuls). Per case and dtype:

* ``native``, ``fastmesh``: the step under each plan, timed round-robin (interleaved) after warm-up, each
  round starting with a barrier and counting as long as its slowest rank; medians ±IQR;
  ``speedup = native / fastmesh`` per round. Target: >= 1.10.
* ``comm``: the block's collectives alone, with plain c10d calls on tensors of the step's sizes: 4
  all-gathers of ``[B, S/tp, D]`` and 4 reduce-scatters to it (forward and backward), timed in the same
  rounds. ``p2p``: the same bytes moved as fastmesh moves them on gloo (send/recv with every peer).
* ``compute``: the native step without its communication, measured: the timed native step minus its exposed
  communication, the time the main thread is blocked in c10d calls and waits (``fastmesh/testing/comm_profile.py``),
  median of a few steps run under ``torch.profiler`` afterwards, of the slowest rank (the one with the least
  exposed: a rank's exposed time includes waiting for a slower peer). Under the native plan nothing overlaps,
  so this is the block's computation alone.
* ``bound = max(comm, compute)`` (perfect overlap) and ``ideal = native / bound``, printed beside the measured
  speedup; ``comm/compute`` says how much communication there is to hide. The same profile of the fused
  plan gives its exposed communication and its ``busy`` time (step minus exposed): on CPU the transfers are
  work for the same cores, so hiding them makes the computation slower rather than free.

With ``--compiled`` (issue 6's comparison) three more contenders run in the same rounds, each the step with the
block's forward under ``torch.compile(fullgraph=True)`` (inductor; its backward compiled by AOTAutograd):
``native_c`` (the native plan), ``native_c+pass`` (the native plan compiled with fastmesh's fusion pass as this
compile's ``post_grad_custom_post_pass`` option, what ``fastmesh.compile.enable_fusion()`` installs globally,
which must fuse every collective of both graphs: the benchmark checks the pass's report) and ``fastmesh_c``
(fastmesh's plan). Targets: ``native_c / native_c+pass >= 1.10`` where comm/compute >= 0.25, and ``fastmesh_c``
no slower than ``fastmesh``. Compiling happens in the checking step, before any timing, with inductor's graph
caches off (a cached graph would not run the pass, and the report could not be checked).

Every contender's output and input gradient is checked against the native plan's before timing. Ranks are started
and the allocator is configured as in ``bench_fused_collectives.py`` (spawned gloo ranks or ``torchrun``,
one intra-op thread per rank, glibc's mmap/trim thresholds raised).

    python bench/bench_tp_block.py [--quick] [--compiled] [--dtype float32 bfloat16] [--shapes 8x256x256x512 ...]
        [--repeats 20] [--warmup 3] [--profile-steps 5] [--json PATH]
    torchrun --nproc-per-node 2 bench/bench_tp_block.py --quick
"""

import argparse
import json
import os
import statistics

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

import fastmesh
import fastmesh.compile
from bench_fused_collectives import DTYPES, _collectives, _exchange, metadata, print_machine, run_main, time_slowest_rank
from fastmesh.testing.comm_profile import STEP_EVENT, cpu_profile, step_comm_times
from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables
from timing import median_iqr

SPEEDUP_TARGET, RATIO_FOR_TARGET = 1.10, 0.25
PLANS = ("native", "fastmesh")
# name -> (plan, fusion pass on): the compiled contenders of --compiled
COMPILED = {"native_c": ("native", False), "native_c+pass": ("native", True), "fastmesh_c": ("fastmesh", False)}
# The collectives the pass must fuse per compiled block: 2 all-gathers and 2 reduce-scatters in each graph.
FUSED_PER_GRAPH = {"forward": 4, "backward": 4}
HEAD_DIM = 64
# assert_close (rtol, atol) between the plans, for unit-scale outputs and input gradients (|values| up to ~8).
# The reduction orders differ (the fused reduce-scatter adds fp32 partials and rounds once, gloo's rounds per
# addition): measured up to 1.5e-6 apart in fp32 and 2 ulps (2^-8 relative each) in bf16.
_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}
# The compiled contenders against the eager native plan: inductor keeps fp32 intermediates where eager rounds
# each op's bf16 result (measured up to 0.039 apart on a gradient element of 0.09 in bf16).
_COMPILED_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 1e-1)}

# Cases "BxSxDxF": batch, sequence length (whole, split over the ranks), model dim, feed-forward hidden dim;
# D/64 heads of 64, half as many key/value heads. Per rank and step the collectives move 8 * B*S/2*D elements
# and the matmuls do ~3 * B*S*D*(2*D + 2*Dkv + 3*F)/2 flops, plus attention (~S per element) and the
# elementwise work (norms, RoPE, SwiGLU, residuals: per element, a large share at these widths on CPU). So
# comm/compute falls as D, F and S grow. Measured on the 2-core dev machine, 1 thread per rank: fp32 reaches
# comm/compute 0.27-0.35 at these sizes (0.15-0.17 at D=512 with F=1024, or D=1024); bf16 halves the bytes but not
# the compute time (no AMX here; bf16 elementwise ops convert), and stays at 0.14-0.24 whatever the size.
DEFAULT_SHAPES = ["8x256x256x256", "8x256x256x512", "4x512x256x256", "16x128x512x512", "8x256x512x512"]
QUICK_SHAPES = ["8x256x256x512"]


def parse_shape(spec, world):
    try:
        batch, seq_len, dim, ffn_hidden = (int(s) for s in spec.split("x"))
    except ValueError:
        raise ValueError(f'shape {spec!r}: expected "BxSxDxF", e.g. "8x256x256x512"') from None
    if dim % (2 * HEAD_DIM * world) or seq_len % world or ffn_hidden % world:
        raise ValueError(f"shape {spec!r}: S, F and D/{2 * HEAD_DIM} (the key/value heads) must be divisible by the "
                         f"{world} ranks")
    return batch, seq_len, dim, ffn_hidden


# ---- contenders ----

def block_steps(shape, dtype, mesh, compiled=False):
    """{contender: step()} on the same input and initial weights, after checking every contender's output and
    input gradient against the native plan's (which also compiles the compiled ones)."""
    batch, seq_len, dim, ffn_hidden = shape
    tp, rank = mesh.size(), mesh.get_local_rank()
    heads = dim // HEAD_DIM
    args = LlamaArgs(dim=dim, n_heads=heads, n_kv_heads=heads // 2, ffn_hidden=ffn_hidden)
    rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
    x = torch.randn(batch, seq_len // tp, dim, generator=torch.Generator().manual_seed(1000 + rank))
    x = x.to(dtype).requires_grad_()
    variants = {plan: (plan, None) for plan in PLANS}
    if compiled:
        # The compiled contenders share one code object (the lambda in _step): forget earlier cases' graphs so
        # that this case's three stay under dynamo's recompile limit (hitting it fails, see main()).
        torch._dynamo.reset()
        variants.update({name: (plan, fusion) for name, (plan, fusion) in COMPILED.items()})
    steps, results = {}, {}
    for name, (plan, fusion) in variants.items():
        torch.manual_seed(0)  # the same initial weights for every contender (each shards them from rank 0's)
        block = parallelize_module(Block(args).to(dtype), mesh, block_plan(plan))
        steps[name] = _step(block, x, rope, fusion)
        fastmesh.compile.fusion_report(reset=True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results[name] = (steps[name](), x.grad)  # compiles a compiled contender
        if fusion is not None and torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs + 1:
            raise RuntimeError(f"rank {rank}: {name} did not compile its own graph")
        if fusion:
            _check_fused(fastmesh.compile.fusion_report(), rank)
    for name, (_, fusion) in variants.items():
        rtol, atol = (_TOLERANCES if fusion is None else _COMPILED_TOLERANCES)[dtype]
        for what, want, got in zip(("output", "input gradient"), results["native"], results[name]):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank}, {shape}, {dtype}, {name} {what}: {m}")
    return steps


def _check_fused(report, rank):
    fused = {kind: sum(e.graph_kind == kind for e in report.fused) for kind in FUSED_PER_GRAPH}
    if report.unfused or fused != FUSED_PER_GRAPH:
        raise RuntimeError(f"rank {rank}: the fusion pass did not fuse the native block as expected "
                           f"({fused} instead of {FUSED_PER_GRAPH}):\n{report}")


def _step(block, x, rope, fusion=None):
    """One training step; ``fusion`` None: eager; False / True: the block compiled without / with the pass."""
    forward = block
    if fusion is not None:
        # The pass as this compile's own inductor option: the compiled contenders share one code object, and
        # the option also keeps their dynamo cache entries apart (dynamo guards on the backend's config).
        options = {"post_grad_custom_post_pass": fastmesh.compile.FusionPass(strict=True)} if fusion else None
        forward = torch.compile(lambda x, rope: block(x, rope), fullgraph=True, options=options)

    def step():
        x.grad = None
        block.zero_grad(set_to_none=True)
        out = forward(x, rope)
        out.sum().backward()
        return out.detach()

    return step


def comm_contenders(shape, dtype, group):
    """The block step's collectives alone: as c10d collectives (``comm``) and as fastmesh's point-to-point
    transfers of the same bytes (``p2p``)."""
    batch, seq_len, dim, _ = shape
    world = group.size()
    all_gather, reduce_scatter = _collectives()
    shard_numel = batch * seq_len // world * dim
    shard = torch.randn(shard_numel).to(dtype)
    full = torch.randn(world * shard_numel).to(dtype)
    gathered, scattered = torch.empty_like(full), torch.empty_like(shard)
    received = list(torch.empty_like(full).chunk(world))

    def comm():
        for _ in range(4):  # 2 per pass, forward and backward
            all_gather(gathered, shard, group=group)
            reduce_scatter(scattered, full, group=group)

    def p2p():
        for _ in range(4):
            _exchange(group, [shard] * world, list(gathered.chunk(world)))
            _exchange(group, list(full.chunk(world)), received)

    return {"comm": comm, "p2p": p2p}


# ---- measurement ----

def profile_step(step, group, steps):
    """Every rank's medians over ``steps`` profiled steps, in seconds: [{"step": duration, "exposed": exposed
    communication, "by_name": {event: exposed time}}, ...] (rank order)."""
    with cpu_profile() as prof:
        for _ in range(steps):
            dist.barrier(group=group)
            with torch.profiler.record_function(STEP_EVENT):
                step()
    times = step_comm_times(prof)
    names = sorted({name for t in times for name in t.by_name})
    mine = {"step": statistics.median(t.duration for t in times),
            "exposed": statistics.median(t.exposed for t in times),
            "by_name": {name: statistics.median(t.by_name.get(name, 0.0) for t in times) for name in names}}
    ranks = [None] * group.size()
    dist.all_gather_object(ranks, mine, group=group)
    return ranks


def measure(shape, dtype, mesh, args):
    group = mesh.get_group()
    contenders = {**block_steps(shape, dtype, mesh, args.compiled), **comm_contenders(shape, dtype, group)}
    timings = time_slowest_rank(contenders, group, args.warmup, args.repeats)
    profiles = {plan: profile_step(contenders[plan], group, args.profile_steps) for plan in PLANS}
    return timings, profiles


def summarize(timings, profiles):
    """Medians ±IQR (ms) of the timed contenders and the per-round speedup; the figures derived from them and
    from the profiles."""
    figures = {f"{name}_ms": dict(zip(("median", "iqr"), median_iqr([1e3 * t for t in ts])))
               for name, ts in timings.items()}
    speedups = [n / f for n, f in zip(timings["native"], timings["fastmesh"])]
    figures["speedup"] = dict(zip(("median", "iqr"), median_iqr(speedups)))
    # A rank's exposed communication includes waiting for a slower peer; the slowest rank's (the least) is the
    # step's own, and the timed step (the slowest rank's) minus it is the slowest rank's busy time. The timed
    # step, not the profiled one, so that the profiler's own overhead is not counted as computation.
    exposed = {plan: 1e3 * min(r["exposed"] for r in profiles[plan]) for plan in PLANS}
    busy = {plan: figures[f"{plan}_ms"]["median"] - exposed[plan] for plan in PLANS}
    native, comm, compute = figures["native_ms"]["median"], figures["comm_ms"]["median"], busy["native"]
    bound = max(comm, compute)
    derived = {
        "compute_ms": compute,
        "comm_over_compute": comm / compute,
        "bound_ms": bound,
        "ideal_speedup": native / bound,
        "fastmesh_over_bound": figures["fastmesh_ms"]["median"] / bound,
        **{f"{plan}_exposed_ms": exposed[plan] for plan in PLANS},
        "fastmesh_busy_ms": busy["fastmesh"],
    }
    verdict = _verdict(figures["speedup"]["median"], SPEEDUP_TARGET, derived["comm_over_compute"])
    if "native_c" in timings:
        for key, (over, under) in _COMPILED_RATIOS.items():
            figures[key] = dict(zip(("median", "iqr"), median_iqr([o / u for o, u in zip(timings[over], timings[under])])))
        verdict += "; pass " + _verdict(figures["pass_speedup"]["median"], SPEEDUP_TARGET, derived["comm_over_compute"])
        verdict += "; fm_c " + ("ok" if figures["fastmesh_c_speedup"]["median"] >= 1.0 else "MISS")
    return figures, derived, verdict


# figure -> (numerator, denominator) contenders, per round
_COMPILED_RATIOS = {"pass_speedup": ("native_c", "native_c+pass"), "fastmesh_c_speedup": ("fastmesh", "fastmesh_c")}


def _verdict(speedup, target, comm_over_compute):
    verdict = "ok" if speedup >= target else "MISS"
    if comm_over_compute < RATIO_FOR_TARGET:
        verdict += f" (comm/compute < {RATIO_FOR_TARGET})"
    return verdict


# ---- report ----

_COLUMNS = (("native", "native_ms"), ("fastmesh", "fastmesh_ms"), ("speedup", "speedup"), ("comm", "comm_ms"),
            ("p2p", "p2p_ms"), ("compute", "compute_ms"), ("comm/comp", "comm_over_compute"),
            ("bound", "bound_ms"), ("ideal", "ideal_speedup"), ("fm/bound", "fastmesh_over_bound"),
            ("nat exp", "native_exposed_ms"), ("fm exp", "fastmesh_exposed_ms"), ("fm busy", "fastmesh_busy_ms"))


_COMPILED_COLUMNS = (("native_c", "native_c_ms"), ("native_c+pass", "native_c+pass_ms"),
                     ("pass speedup", "pass_speedup"), ("fastmesh_c", "fastmesh_c_ms"),
                     ("fm eager/c", "fastmesh_c_speedup"))


def print_header(meta, args):
    print_machine(meta)
    print(f"world {meta['world']} ({meta['backend']}), {meta['threads_per_rank']} intra-op thread(s) per rank "
          f"(torch.get_num_threads() = {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); {meta['repeats']} interleaved rounds "
          f"after {meta['warmup']} warm-up, {args.profile_steps} profiled steps per plan")
    print(f"times in ms of the slowest rank, median ±IQR; step = forward + backward of one block on x "
          f"[B, S/{meta['world']}, D], loss = output.sum()")
    print("comm = the step's 4 all-gathers + 4 reduce-scatters as c10d collectives alone; p2p = the same bytes "
          "point-to-point (fastmesh's gloo transport) alone;")
    print("compute = native step minus its exposed comm (profiled); bound = max(comm, compute); ideal = native / "
          "bound; exp = exposed comm per step (profiled), busy = step - exposed")
    print(f"target: speedup = native / fastmesh >= {SPEEDUP_TARGET:.2f} (where comm/compute >= {RATIO_FOR_TARGET})")
    if args.compiled:
        print("compiled (torch.compile fullgraph, inductor): native_c, native_c+pass (fastmesh.compile.FusionPass), "
              f"fastmesh_c; targets: pass speedup = native_c / native_c+pass >= {SPEEDUP_TARGET:.2f}, "
              "fm eager/c = fastmesh / fastmesh_c >= 1")
    print(f"\n{'case BxSxDxF':18s} {'dtype':8s} " + " ".join(f"{title:>11s}" for title, _ in _COLUMNS) + "  target")


def _cells(row, columns):
    cells = []
    for _, key in columns:
        digits = 2 if key in _RATIO_KEYS else 1
        if key in row["figures"]:
            figure = row["figures"][key]
            cells.append(f"{figure['median']:.{digits}f}±{figure['iqr']:.{digits}f}")
        else:
            cells.append(f"{row['derived'][key]:.{digits}f}")
    return " ".join(f"{c:>11s}" for c in cells)


_RATIO_KEYS = ("speedup", "comm_over_compute", "ideal_speedup", "fastmesh_over_bound", *_COMPILED_RATIOS)


def print_row(row):
    print(f"{row['case']:18s} {row['dtype']:8s} " + _cells(row, _COLUMNS) + f"  {row['verdict']}")
    if "native_c_ms" in row["figures"]:
        titles = " ".join(f"{title}" for title, _ in _COMPILED_COLUMNS)
        print(f"    compiled ({titles}): {_cells(row, _COMPILED_COLUMNS)}")
    for plan in PLANS:
        print(f"    {plan} exposed ms by event: {_by_name(row['profiles_s'][plan])}", flush=True)


def _by_name(ranks):
    """The slowest rank's (least exposed) exposed communication per outermost event, largest first."""
    slowest = min(ranks, key=lambda r: r["exposed"])
    return ", ".join(f"{name} {1e3 * t:.1f}" for name, t in sorted(slowest["by_name"].items(), key=lambda kv: -kv[1]))


def print_summary(rows):
    misses = [r for r in rows if r["verdict"].startswith("MISS")]
    speedups = [r["figures"]["speedup"]["median"] for r in rows]
    print(f"\nspeedup native/fastmesh {min(speedups):.2f}-{max(speedups):.2f}x over {len(rows)} cases; "
          f"{len(rows) - len(misses)} reach the {SPEEDUP_TARGET:.2f}x target, {len(misses)} miss it"
          + (": " + ", ".join(f"{r['case']} {r['dtype']}" for r in misses) if misses else ""))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


# ---- ranks ----

def run(group, args, world):
    torch.set_num_threads(args.threads)
    # A compiled contender that silently fell back to eager would be timed as if compiled.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # A graph served from inductor's caches (e.g. written by the other rank) does not run the fusion pass, whose
    # report is checked.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    mesh = fastmesh.init_mesh(tp=world)
    leader = group.rank() == 0
    if leader:
        meta = metadata(args, world, args.threads)
        print_header(meta, args)
    rows = []
    for dtype_name in args.dtype:
        for spec in args.shapes:
            timings, profiles = measure(parse_shape(spec, world), DTYPES[dtype_name], mesh, args)
            figures, derived, verdict = summarize(timings, profiles)
            row = {"case": spec, "dtype": dtype_name, "figures": figures, "derived": derived, "verdict": verdict,
                   "profiles_s": profiles, "samples_s": timings}
            rows.append(row)
            if leader:
                print_row(row)
    if leader:
        print_summary(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
            print(f"wrote {args.json}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=None,
                        help="ranks to start (default 2); under torchrun, torchrun's world")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--shapes", nargs="+", default=None, metavar="BxSxDxF",
                        help="cases, each run in every dtype")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20; 5 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; 1 with --quick)")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="profiled steps per plan for compute and exposed comm (default 5; 3 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--quick", action="store_true", help="one case, 5 rounds (under a minute)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the compiled native plan without and with fastmesh's fusion pass, and the "
                             "compiled fastmesh plan (each compiles once per case and dtype)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure and the metadata here")
    args = parser.parse_args()
    args.repeats = args.repeats or (5 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.profile_steps = args.profile_steps or (3 if args.quick else 5)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the spread needs two samples)")
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    try:
        for spec in args.shapes:
            parse_shape(spec, int(os.environ.get("WORLD_SIZE", args.world or 2)))
    except ValueError as error:
        parser.error(str(error))
    return args


def main():
    run_main(parse_args(), run)


if __name__ == "__main__":
    main()

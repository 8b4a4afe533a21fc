"""Microbenchmark of fastmesh's fused collectives against the unfused c10d baseline and their bounds.

For each op, dtype and shape, four contenders run round-robin (interleaved repetitions, after warm-up):

* ``fused``: ``fastmesh.all_gather_matmul`` / ``fastmesh.matmul_reduce_scatter`` (with ``--chunks``: the
  automatic piece count and each fixed one);
* ``unfused``: ``dist.all_gather_single`` then ``torch.matmul`` per ``b`` / ``torch.matmul`` then
  ``dist.reduce_scatter_single``, plus the block-reordering copy c10d needs when the gathered / scattered dim
  is not dim 0 (what torch's functional collectives do too);
* ``comm``: the all-gather / reduce-scatter alone, same sizes;
* ``p2p``: the same bytes moved the way fastmesh moves them on gloo (send/recv with every peer), alone;
* ``matmul``: the same multiplies alone on local data of the gathered size / of ``a``.

The bound is ``max(comm, matmul)``: perfect overlap. On CPU the transfer is not free for the cores: gloo
copies through loopback TCP on its own thread, so a rank's transfer and multiplies share the CPU. The
``cpu bound`` column is therefore ``matmul + (CPU time of p2p)`` (the CPU time of the transfer measured
with ``time.process_time`` after the timed rounds): what a rank's core must do, however well it overlaps. Derived figures are computed per repetition from the
contenders of that same round-robin round, then summarized: ``fused/bound``, ``speedup = unfused/fused``,
``comm/matmul`` and ``overlap = (unfused - fused) / min(comm, matmul)`` (1: the smaller part fully
hidden). Targets: ``fused/bound <= 1.10``, and ``speedup >= 1.15`` where ``comm/matmul >= 0.25``.

Timing: every repetition starts with ``dist.barrier()``; a call counts as long as its slowest rank
(the per-rank times are all-reduced with MAX after the run). Medians with the interquartile range.
Every fused result is checked against the unfused one (random inputs) before timing.

Allocation: the fused ops allocate their outputs; the baselines write into preallocated buffers. Page
faults on fresh buffers would dominate CPU timings, so the script re-executes itself with glibc's mmap and
trim thresholds raised (freed buffers are recycled), as bench_fp8_quantize.py does.

Ranks: started here (``torch.multiprocessing`` spawn, FileStore rendezvous, gloo), or by ``torchrun``
(``RANK`` / ``WORLD_SIZE`` set: the group from the environment). One intra-op thread per rank by default.

    python bench/bench_fused_collectives.py [--world 2] [--dtype float32 bfloat16] [--quick]
        [--op all_gather_matmul matmul_reduce_scatter] [--shapes ag:4096x4096:0:256 ...]
        [--repeats 15] [--warmup 3] [--chunks 1 2 4 8] [--json PATH]
    torchrun --nproc-per-node 2 bench/bench_fused_collectives.py --quick
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastmesh
from timing import median_iqr, time_interleaved_ranks

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
OPS = ("all_gather_matmul", "matmul_reduce_scatter")
_OP_CODES = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPEEDUP_TARGET, BOUND_TARGET, RATIO_FOR_SPEEDUP = 1.15, 1.10, 0.25
# assert_close (rtol, atol) for unit-scale outputs. fp32: a different blocking of the same dot products. Low
# precision: the rounding of the output (bf16: 2^-8 relative).
_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def _tolerance(dtype, world, sums_partials):
    rtol, atol = _TOLERANCES[dtype]
    if sums_partials and dtype != torch.float32:
        # A sum over ranks of low-precision partial products: each partial is rounded to the dtype, and
        # gloo's reduce-scatter (the baseline) rounds after every addition too, where the fused op sums in
        # fp32 and rounds once: up to W roundings apart.
        atol *= world
    return rtol, atol


# Case specs, "op:shape:dim:N[,N...]": shape is this rank's a_shard (ag) or a (rs), dims joined by "x";
# dim the gathered / scattered dim; N the columns of each b.
# Sizes for 1 thread per rank, gloo over loopback TCP, 2 ranks, as measured on the 2-core dev machine:
# fp32 matmul ~160 GFLOP/s per core (AVX-512), bf16 ~83 (no AMX); gloo ~0.45-0.7 GB/s received per rank
# (all-gather or reduce-scatter, 17-34 MB, either dtype). Then comm/matmul ~ (W-1)/W * bytes/elem * flop
# rate / (2 * N (ag) or K (rs) * bandwidth): fp32 ~250-350/N (ag) or /K (rs); bf16 ~60-90/N or /K.
# bf16 halves the bytes and the flop rate, a 4x lower comm/matmul at equal sizes: its cases are narrower
# so that both dtypes span comm/matmul ~0.25-1 with each fused call at ~40-200 ms. Measured ratios below.
DEFAULT_SHAPES = {
    "float32": [
        "ag:2048x4096:0:384",            # sequence-parallel colwise input, one weight; comm/mm 0.9
        "ag:2048x4096:0:768",            # 0.45
        "ag:1024x4096:0:896",            # 0.25
        "ag:1024x4096:0:256,256,256",    # QKV: one gather, three matmuls; 0.3
        "ag:4x512x4096:1:512",           # [B, S/W, D] gathered along the sequence; 0.65
        "ag:4096x2048:-1:512",           # gathering the contraction dim; 0.65
        "rs:4096x384:0:4096",            # rowwise output, sequence-scattered; 0.8
        "rs:4096x1024:0:2048",           # 0.35
        "rs:4x1024x768:1:3072",          # [B, S, D] scattered along the sequence; 0.45
    ],
    "bfloat16": [
        "ag:2048x4096:0:48",             # 1.0
        "ag:2048x4096:0:96",             # 0.55
        "ag:2048x4096:0:192",            # 0.3
        "ag:2048x4096:0:64,64,64",       # 0.3
        "ag:4x512x4096:1:128",           # 0.45
        "ag:4096x2048:-1:128",           # 0.4
        "rs:4096x128:0:4096",            # 0.85
        "rs:4096x256:0:4096",            # 0.4
        "rs:4x1024x192:1:4096",          # 0.55
    ],
}
QUICK_SHAPES = {
    "float32": ["ag:1024x2048:0:512", "ag:2x256x2048:1:128,128,128", "rs:2048x512:0:2048"],
    "bfloat16": ["ag:1024x2048:0:128", "ag:2x512x2048:1:32,32,32", "rs:2048x128:0:2048"],
}


@dataclass(frozen=True)
class Case:
    op: str
    shape: tuple  # this rank's a_shard (all_gather_matmul) or a (matmul_reduce_scatter)
    dim: int  # gather_dim / scatter_dim, as given (may be negative)
    ns: tuple  # columns of each b

    @classmethod
    def parse(cls, spec):
        try:
            code, shape, dim, ns = spec.split(":")
            case = cls(_OP_CODES[code], tuple(int(s) for s in shape.split("x")), int(dim),
                       tuple(int(n) for n in ns.split(",")))
        except (KeyError, ValueError):
            raise ValueError(f'case {spec!r}: expected "ag|rs:DxDx..:dim:N[,N..]", e.g. "ag:2048x4096:0:384"') from None
        if case.op == "matmul_reduce_scatter" and len(case.ns) != 1:
            raise ValueError(f"case {spec!r}: matmul_reduce_scatter takes one b")
        return case

    def label(self):
        repeated = len(self.ns) > 1 and len(set(self.ns)) == 1
        ns = f"{len(self.ns)}x{self.ns[0]}" if repeated else ",".join(map(str, self.ns))
        return f"[{', '.join(map(str, self.shape))}] d{self.dim} N={ns}"


# ---- contenders ----

def _collectives():
    """(all_gather, reduce_scatter) c10d calls into preallocated buffers, without deprecation warnings:
    torch 2.14 renames *_into_tensor / *_tensor to *_single; torch 2.11 has only the old names."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return all_gather, reduce_scatter


def _random(shape, dtype, generator, scale=1.0):
    # Normal values: never zero, so a dropped or misplaced block cannot pass the check.
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def all_gather_matmul_contenders(case, dtype, group, chunk_counts):
    """Contender callables and a check of the fused result against the unfused one."""
    world, rank = group.size(), group.rank()
    all_gather, _ = _collectives()
    dim = case.dim % len(case.shape)
    shard_k = case.shape[-1]
    k = shard_k * world if dim == len(case.shape) - 1 else shard_k
    a_shard = _random(case.shape, dtype, torch.Generator().manual_seed(1000 + rank))
    same = torch.Generator().manual_seed(7)  # the weights are replicated: the same on every rank
    bs = [_random((k, n), dtype, same, k ** -0.5) for n in case.ns]  # unit-scale outputs
    full_shape = list(case.shape)
    full_shape[dim] *= world
    # c10d gathers rank-major along dim 0 (gloo takes only this concatenated form)
    gathered = torch.empty((world * case.shape[0], *case.shape[1:]), dtype=dtype)
    a_full = gathered if dim == 0 else torch.empty(full_shape, dtype=dtype)
    outs = [torch.empty((*full_shape[:-1], n), dtype=dtype) for n in case.ns]
    local_a = _random(full_shape, dtype, torch.Generator().manual_seed(2000 + rank))

    def comm():
        all_gather(gathered, a_shard, group=group)

    received = list(torch.empty_like(gathered).chunk(world))

    def unfused():
        comm()
        if dim != 0:  # rank blocks back into place along dim
            a_full.unflatten(dim, (world, -1)).copy_(gathered.unflatten(0, (world, -1)).movedim(0, dim))
        for b, out in zip(bs, outs):
            torch.matmul(a_full, b, out=out)

    def matmul():
        for b, out in zip(bs, outs):
            torch.matmul(local_a, b, out=out)

    def fused(chunks):
        return lambda: fastmesh.all_gather_matmul(a_shard, bs, case.dim, group=group, chunks=chunks)

    def check():
        _, got = fastmesh.all_gather_matmul(a_shard, bs, case.dim, group=group)
        unfused()
        rtol, atol = _tolerance(dtype, world, sums_partials=dim == len(case.shape) - 1)
        for i, (g, want) in enumerate(zip(got, outs)):
            torch.testing.assert_close(g, want, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank}, {case.label()}, output {i}: {m}")

    p2p = lambda: _exchange(group, [a_shard] * world, received)  # noqa: E731
    return _named(fused, chunk_counts, unfused, comm, p2p, matmul), check


def matmul_reduce_scatter_contenders(case, dtype, group, chunk_counts):
    """Contender callables and a check of the fused result against the unfused one."""
    world, rank = group.size(), group.rank()
    _, reduce_scatter = _collectives()
    (n,) = case.ns
    a = _random(case.shape, dtype, torch.Generator().manual_seed(1000 + rank))
    # Each rank holds its own rows of the weight; scaled so that the sum over ranks is unit-scale.
    k = case.shape[-1]
    b = _random((k, n), dtype, torch.Generator().manual_seed(3000 + rank), (k * world) ** -0.5)
    c = torch.empty((*case.shape[:-1], n), dtype=dtype)
    dim = case.dim % c.dim()
    out_shape = list(c.shape)
    out_shape[dim] //= world
    out = torch.empty(out_shape, dtype=dtype)
    send = c if dim == 0 else torch.empty((world * out_shape[0], *out_shape[1:]), dtype=dtype)
    comm_send = _random(send.shape, dtype, torch.Generator().manual_seed(4000 + rank))

    def unfused():
        torch.matmul(a, b, out=c)
        if dim != 0:  # c10d scatters rank-major blocks of dim 0: bring dim's blocks there
            send.unflatten(0, (world, -1)).copy_(c.unflatten(dim, (world, -1)).movedim(dim, 0))
        reduce_scatter(out, send, group=group)

    def fused(chunks):
        return lambda: fastmesh.matmul_reduce_scatter(a, b, case.dim, group=group, chunks=chunks)

    def check():
        got = fastmesh.matmul_reduce_scatter(a, b, case.dim, group=group)
        unfused()
        rtol, atol = _tolerance(dtype, world, sums_partials=True)
        torch.testing.assert_close(got, out, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank}, {case.label()}: {m}")

    partials = list(torch.empty_like(comm_send).chunk(world))
    contenders = _named(fused, chunk_counts, unfused,
                        lambda: reduce_scatter(out, comm_send, group=group),
                        lambda: _exchange(group, list(comm_send.chunk(world)), partials),
                        lambda: torch.matmul(a, b, out=c))
    return contenders, check


def _exchange(group, sends, receives):
    """sends[j] to rank j and receives[j] from rank j, for every other rank j (fastmesh's gloo transport)."""
    world, rank = group.size(), group.rank()
    works = []
    for step in range(1, world):
        to, source = (rank + step) % world, (rank - step) % world
        works.append(dist.isend(sends[to], dist.get_global_rank(group, to), group=group))
        works.append(dist.irecv(receives[source], dist.get_global_rank(group, source), group=group))
    for work in works:
        work.wait()


def _cpu_fraction(fn, group, repeats=3):
    """CPU time over wall time of ``fn`` on the busiest rank (all of this process's threads)."""
    dist.barrier(group=group)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    fraction = torch.tensor([(time.process_time() - cpu) / (time.perf_counter() - wall)])
    dist.all_reduce(fraction, op=dist.ReduceOp.MAX, group=group)
    return fraction.item()


def _named(fused, chunk_counts, unfused, comm, p2p, matmul):
    contenders = {_fused_name(chunks): fused(chunks) for chunks in chunk_counts}
    contenders.update(unfused=unfused, comm=comm, p2p=p2p, matmul=matmul)
    return contenders


def _fused_name(chunks):
    return "fused" if chunks is None else f"fused[{chunks}]"


# ---- measurement ----

def measure(case, dtype, group, args):
    """Times every contender of one case; returns {name: [seconds of the slowest rank per repetition]}."""
    chunk_counts = [None, *args.chunks]
    build = all_gather_matmul_contenders if case.op == "all_gather_matmul" else matmul_reduce_scatter_contenders
    contenders, check = build(case, dtype, group, chunk_counts)
    check()
    timings = time_slowest_rank(contenders, group, args.warmup, args.repeats)
    return timings, chunk_counts, _cpu_fraction(contenders["p2p"], group)


def time_slowest_rank(contenders, group, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Interleaved timings of every contender on every rank of ``group`` (after ``warmup`` untimed rounds):
    {name: [seconds of the slowest rank per repetition]}."""

    def slowest(samples):
        t = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()

    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    time_interleaved_ranks(contenders, warmup, barrier, slowest)
    return time_interleaved_ranks(contenders, repeats, barrier, slowest)


def summarize(timings, fused_name, p2p_cpu_fraction):
    """Medians and IQRs of the times (ms) and of the per-repetition derived figures of one fused variant."""
    fused, unfused, comm, p2p, matmul = (timings[k] for k in (fused_name, "unfused", "comm", "p2p", "matmul"))
    cpu_bound = [m + p2p_cpu_fraction * t for m, t in zip(matmul, p2p)]
    per_rep = {
        "fused_ms": [1e3 * f for f in fused],
        "unfused_ms": [1e3 * u for u in unfused],
        "comm_ms": [1e3 * c for c in comm],
        "p2p_ms": [1e3 * t for t in p2p],
        "matmul_ms": [1e3 * m for m in matmul],
        "bound_ms": [1e3 * max(c, m) for c, m in zip(comm, matmul)],
        "cpu_bound_ms": [1e3 * b for b in cpu_bound],
        "fused_over_bound": [f / max(c, m) for f, c, m in zip(fused, comm, matmul)],
        "fused_over_cpu_bound": [f / b for f, b in zip(fused, cpu_bound)],
        "speedup": [u / f for u, f in zip(unfused, fused)],
        "comm_over_matmul": [c / m for c, m in zip(comm, matmul)],
        "overlap": [(u - f) / min(c, m) for u, f, c, m in zip(unfused, fused, comm, matmul)],
    }
    figures = {name: dict(zip(("median", "iqr"), median_iqr(values))) for name, values in per_rep.items()}
    misses = []
    if figures["fused_over_bound"]["median"] > BOUND_TARGET:
        misses.append("bound")
    if figures["comm_over_matmul"]["median"] >= RATIO_FOR_SPEEDUP and figures["speedup"]["median"] < SPEEDUP_TARGET:
        misses.append("speedup")
    return figures, misses


# ---- report ----

def metadata(args, world, threads):
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or "unknown")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*arguments):
        return subprocess.run(["git", "-C", repo, *arguments], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return {
        "machine": f"{platform.node()}, {cpu}, {len(os.sched_getaffinity(0))} cores, "
                   f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}",
        "load_average": os.getloadavg(),
        "versions": {"torch": torch.__version__, "fastmesh": fastmesh.__version__, "python": platform.python_version()},
        "commit": commit + (" (dirty)" if git("status", "--porcelain", "--untracked-files=no") else ""),
        "command": shlex.join([sys.executable, *sys.argv]),
        "world": world,
        "threads_per_rank": threads,
        "backend": "gloo",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "malloc_env": {k: os.environ.get(k) for k in _MALLOC_ENV},
        "fastmesh_env": {k: v for k, v in os.environ.items() if k.startswith("FASTMESH_")},
    }


def print_machine(meta):
    print(f"machine: {meta['machine']}; load average {' '.join(f'{x:.2f}' for x in meta['load_average'])}")
    v = meta["versions"]
    print(f"versions: fastmesh {v['fastmesh']}, torch {v['torch']}, python {v['python']}; commit {meta['commit']}")
    print(f"command: {meta['command']}" + "".join(f" {k}={v}" for k, v in meta["fastmesh_env"].items()))


def print_header(meta):
    print_machine(meta)
    print(f"world {meta['world']} ({meta['backend']}), {meta['threads_per_rank']} intra-op thread(s) per rank; "
          f"{meta['repeats']} interleaved repetitions after {meta['warmup']} warm-up; times in ms of the slowest rank, "
          "median ±IQR")
    print(f"targets: fused/bound <= {BOUND_TARGET:.2f}; speedup >= {SPEEDUP_TARGET:.2f} where comm/matmul >= "
          f"{RATIO_FOR_SPEEDUP:.2f}; bound = max(comm, matmul); cpu bound = matmul + CPU time of p2p; "
          "overlap = (unfused - fused) / min(comm, matmul)")


_COLUMNS = [("fused_ms", 1), ("unfused_ms", 1), ("comm_ms", 1), ("p2p_ms", 1), ("matmul_ms", 1), ("bound_ms", 1),
            ("cpu_bound_ms", 1), ("fused_over_bound", 2), ("fused_over_cpu_bound", 2), ("speedup", 2),
            ("comm_over_matmul", 2), ("overlap", 2)]
_TITLES = ["fused", "unfused", "comm", "p2p", "matmul", "bound", "cpu bound", "fused/bound", "f/cpu bound",
           "speedup", "comm/mm", "overlap"]


def print_table_header(op):
    print(f"\n{op}")
    print(f"{'case':34s} {'dtype':8s} {'chunks':6s} " + " ".join(f"{t:>11s}" for t in _TITLES) + "  target")


def print_row(row):
    cells = []
    for key, digits in _COLUMNS:
        figure = row["figures"][key]
        cells.append(f"{figure['median']:.{digits}f}±{figure['iqr']:.{digits}f}".rjust(11))
    target = "ok" if not row["misses"] else "MISS " + ",".join(row["misses"])
    print(f"{row['case']:34s} {row['dtype']:8s} {row['chunks']:6s} " + " ".join(cells) + f"  {target}", flush=True)


# ---- ranks ----

def run(group, args, world):
    """The benchmark on every rank of ``group``; rank 0 prints and writes the JSON."""
    torch.set_num_threads(args.threads)
    leader = group.rank() == 0
    if leader:
        meta = metadata(args, world, args.threads)
        print_header(meta)
    rows = []
    for op in args.op:
        if leader:
            print_table_header(op)
        for dtype_name in args.dtype:
            for case in (c for c in args.cases[dtype_name] if c.op == op):
                timings, chunk_counts, p2p_cpu_fraction = measure(case, DTYPES[dtype_name], group, args)
                for chunks in chunk_counts:
                    figures, misses = summarize(timings, _fused_name(chunks), p2p_cpu_fraction)
                    row = {"op": op, "case": case.label(), **asdict(case), "dtype": dtype_name,
                           "chunks": "auto" if chunks is None else str(chunks), "figures": figures, "misses": misses,
                           "p2p_cpu_fraction": p2p_cpu_fraction,
                           "samples_s": {k: timings[k] for k in (_fused_name(chunks), "unfused", "comm", "p2p", "matmul")}}
                    rows.append(row)
                    if leader:
                        print_row(row)
    if leader and args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.json}")


def spawned_rank(rank, world, store_path, args, body):
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        body(dist.group.WORLD, args, world)
    finally:
        dist.destroy_process_group()


def launch(args, body):
    """Starts ``args.world`` local ranks, or joins torchrun's group when RANK / WORLD_SIZE are set; every rank
    runs ``body(group, args, world)`` (a module-level function: spawned ranks receive it pickled)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if args.world not in (None, world):
            warnings.warn(f"--world {args.world} ignored: torchrun started {world} ranks")
        _warn_oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", world)), args.threads)
        dist.init_process_group("gloo")
        try:
            body(dist.group.WORLD, args, world)
        finally:
            dist.destroy_process_group()
        return
    world = args.world or 2
    _warn_oversubscribed(world, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned_rank, args=(world, os.path.join(tmp, "store"), args, body), nprocs=world)


def _warn_oversubscribed(local_ranks, threads):
    cores = len(os.sched_getaffinity(0))
    if local_ranks * threads > cores:
        print(f"WARNING: {local_ranks} ranks x {threads} thread(s) > {cores} cores: ranks share cores, so comm "
              "and matmul cannot overlap fully and the figures are not the op's", file=sys.stderr, flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=None,
                        help="ranks to start (default 2); under torchrun, torchrun's world")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--op", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--shapes", nargs="+", default=None, metavar="SPEC",
                        help='cases "ag|rs:DxDx..:dim:N[,N..]" for every dtype (default: a per-dtype set)')
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 15; 7 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; 1 with --quick)")
    parser.add_argument("--chunks", nargs="+", type=int, default=[], metavar="N",
                        help="also time the fused op with these fixed piece counts, beside the automatic one")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--quick", action="store_true", help="a small subset (under a minute on 2 ranks)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure and the metadata here")
    args = parser.parse_args()
    args.repeats = args.repeats or (7 if args.quick else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the spread needs two samples)")
    args.chunks = sorted({c for c in args.chunks if c > 0})
    try:
        if args.shapes:
            args.cases = {d: [Case.parse(s) for s in args.shapes] for d in DTYPES}
        else:
            defaults = QUICK_SHAPES if args.quick else DEFAULT_SHAPES
            args.cases = {d: [Case.parse(s) for s in defaults.get(d, defaults["bfloat16"])] for d in DTYPES}
    except ValueError as error:
        parser.error(str(error))
    return args


def run_main(args, body):
    """A benchmark's main: the allocator settings, then every rank runs ``body``; rank 0 prints the total time."""
    if any(os.environ.get(k) != v for k, v in _MALLOC_ENV.items()):
        # exec, not a child process: under torchrun the rank keeps its pid and environment.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC_ENV})
    start = time.perf_counter()
    launch(args, body)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"total {time.perf_counter() - start:.0f} s", flush=True)


def main():
    run_main(parse_args(), run)


if __name__ == "__main__":
    main()

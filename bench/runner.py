"""``fastmesh bench``: runs the benchmark families, prints a table per family, writes JSON and PNG plots.

    fastmesh bench --quick                       # every family, small (about 80 s on 2 CPU cores)
    fastmesh bench                               # every family, the full case lists
    fastmesh bench --only fused_collectives --dtype float32 --case fused_collectives=ag:4096x4096:0:1024
    fastmesh bench --only fused_collectives --dtype float8 --fp8 rowwise mx block   # these FP8 forms
    torchrun --nproc-per-node 4 -m fastmesh.bench.runner --quick   # the world torchrun gives
    fastmesh bench --device cuda                 # on GPUs (distributed families need two or more)

Single-process families (``fp8_quantize``, ``amax``) run in this process with every core. Distributed families
(``fused_collectives``, ``sweep``, ``tp_block``, ``hf_model``) run on ranks started here with torch's elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` uses), ``--world`` of them (default 2 on CPU,
every GPU on CUDA), with ``cores // world`` intra-op threads each; or, under ``torchrun``, on its world.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field, replace

import torch
from fastmesh.bench import (
    fp8_quantize,
    fused_collectives,
    hf_model,
    host,
    launch,
    machine,
    plots,
    report,
    sweep,
    tp_block,
)
from fastmesh.bench.family import DTYPES, Context, emulated_dtypes
from fastmesh.bench.timing import clock_for
from torch._inductor import config as inductor_config

FAMILIES = {
    f.name: f
    for f in (
        *fp8_quantize.FAMILIES,
        host.FAMILY,
        fused_collectives.FAMILY,
        sweep.FAMILY,
        tp_block.FAMILY,
        hf_model.FAMILY,
    )
}
QUICK_REPEATS, QUICK_WARMUP, FULL_REPEATS, FULL_WARMUP = 5, 1, 15, 3


@dataclass
class Plan:
    """What to run (picklable: it travels to spawned ranks)."""

    families: list[str]
    device_type: str
    quick: bool
    repeats: int
    warmup: int
    dtypes: tuple[str, ...]
    cases: dict[str, list[str]] = field(default_factory=dict)
    fp8: tuple[str, ...] = ()  # fused_collectives' FP8 forms; empty: its defaults
    emulated: dict[str, str] = field(default_factory=dict)  # family.emulated_dtypes of this machine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastmesh bench",
        description="fastmesh's kernel benchmarks, each beside its baselines and bound",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="families:\n" + "\n".join(f"  {f.name:18s} {f.description}" for f in FAMILIES.values()),
    )
    parser.add_argument("--quick", action="store_true", help="small cases and 5 rounds (the README's main command)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(FAMILIES),
        metavar="NAME",
        help=f"run only these families ({', '.join(FAMILIES)})",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is visible, else cpu"
    )
    parser.add_argument(
        "--world",
        type=int,
        default=None,
        help="ranks to start for distributed families (default: 2 on CPU, every GPU on CUDA); "
        "under torchrun, torchrun's world",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per rank (default: cores // ranks; single-process families: cores)",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=DTYPES,
        default=list(DTYPES),
        help="dtypes to measure (each family takes those it has; float8: the FP8 forms)",
    )
    parser.add_argument(
        "--fp8",
        nargs="+",
        choices=fused_collectives.FP8_GRANULARITIES,
        default=[],
        metavar="GRANULARITY",
        help="the FP8 forms of fused_collectives' float8 cases, by scale granularity "
        f"({', '.join(fused_collectives.FP8_GRANULARITIES)}; block: a 1x128, b 128x128). Default: all of them, "
        f"{' and '.join(fused_collectives.QUICK_FP8_GRANULARITIES)} with --quick",
    )
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="replace a family's cases with these (repeatable), e.g. tp_block=8x256x256x512",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"timed rounds (default {FULL_REPEATS}; {QUICK_REPEATS} with --quick)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed rounds first (default {FULL_WARMUP}; {QUICK_WARMUP} with --quick)",
    )
    parser.add_argument(
        "--out",
        default="fastmesh-bench",
        metavar="DIR",
        help="where bench.json and the plots go (default ./fastmesh-bench)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    return parser


def _plan(args, parser, device_type: str, world: int) -> Plan:
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if args.quick else FULL_REPEATS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else FULL_WARMUP)
    if repeats < 2:
        parser.error("--repeats must be at least 2 (the spread needs two samples)")
    if warmup < 0:
        parser.error("--warmup must be >= 0")
    cases: dict[str, list[str]] = {}
    for item in args.case:
        name, _, spec = item.partition("=")
        if name not in FAMILIES or not spec:
            parser.error(f"--case {item!r}: expected NAME=SPEC with NAME one of {', '.join(FAMILIES)}")
        try:
            FAMILIES[name].parse_case(spec, world)
        except ValueError as error:
            parser.error(f"--case {item!r}: {error}")
        cases.setdefault(name, []).append(spec)
    families = args.only or list(FAMILIES)
    unused = sorted(set(cases) - set(families))
    if unused:
        parser.error(f"--case given for {', '.join(unused)}, which --only leaves out")
    if args.fp8 and (fused_collectives.FAMILY.name not in families or "float8" not in args.dtype):
        parser.error("--fp8 selects the FP8 forms of fused_collectives: it needs that family and --dtype float8")
    fp8 = tuple(dict.fromkeys(args.fp8))  # in the given order, once each
    emulated = emulated_dtypes(device_type)
    return Plan(families, device_type, args.quick, repeats, warmup, tuple(args.dtype), cases, fp8, emulated)


def _context(plan: Plan, name: str, leader: bool, group=None, mesh=None) -> Context:
    device = (
        torch.device(plan.device_type, torch.cuda.current_device())
        if plan.device_type == "cuda"
        else torch.device("cpu")
    )
    return Context(
        family=name,
        device=device,
        quick=plan.quick,
        repeats=plan.repeats,
        warmup=plan.warmup,
        dtypes=plan.dtypes,
        cases=plan.cases.get(name, []),
        clock=clock_for(device),
        fp8=plan.fp8,
        emulated=plan.emulated,
        leader=leader,
        group=group,
        mesh=mesh,
    )


def _run_families(plan: Plan, names: list[str], leader: bool, group=None, mesh=None) -> dict:
    results = {}
    for name in names:
        family = FAMILIES[name]
        if leader:
            print(f"\n== {name}: {family.description}", flush=True)
        ctx = _context(plan, name, leader, group, mesh)
        if set(plan.dtypes) & set(family.dtypes):
            family.run(ctx)
        else:
            ctx.note(
                f"nothing measured: --dtype {' '.join(plan.dtypes)} has none of its dtypes ({' '.join(family.dtypes)})"
            )
        results[name] = {"description": family.description, "rows": ctx.rows, "notes": ctx.notes}
        if ctx.summary:
            results[name]["summary"] = ctx.summary
    return results


def _distributed_names(plan: Plan) -> list[str]:
    return [n for n in plan.families if FAMILIES[n].distributed]


def _rank_main(threads: int, plan: Plan) -> dict | None:
    """A rank started by :func:`launch.launch`: the distributed families on the launcher's world."""
    launch.keep_freed_memory()
    torch.set_num_threads(threads)
    # Inductor's compile workers share the cores as the intra-op threads do: as many per rank (its default, one per
    # core on every rank, oversubscribes them).
    inductor_config.compile_threads = threads
    return _distributed_on_world(plan)


def _distributed_on_world(plan: Plan) -> dict | None:
    """The distributed families on the world in the environment (RANK, WORLD_SIZE, ...); rank 0 returns them."""
    import torch.distributed as dist

    def run(mesh) -> dict | None:
        leader = dist.get_rank() == 0
        # Under torchrun each rank measured its CPU: rank 0's finding decides, so that every rank runs the same cases.
        emulated = [plan.emulated]
        dist.broadcast_object_list(emulated, src=0, group=mesh.get_group())
        ranks_plan = replace(plan, emulated=emulated[0])
        results = _run_families(ranks_plan, _distributed_names(plan), leader, mesh.get_group(), mesh)
        return results if leader else None

    return launch.on_world_mesh(plan.device_type, run)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.world is not None and args.world < 1:
        parser.error("--world must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    under_torchrun = launch.torchrun_world()
    if under_torchrun:
        rank, world, local_world = under_torchrun
        if args.world not in (None, world):
            parser.error(f"--world {args.world}: torchrun started {world} ranks")
    else:
        rank = 0
        world = args.world or (torch.cuda.device_count() if device_type == "cuda" else 2)
        local_world = world
    plan = _plan(args, parser, device_type, world)
    try:  # before any timing: a run whose results cannot be written is lost
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(f"{args.out} is not writable")
    except OSError as error:
        parser.error(f"--out {args.out}: {error}")
    leader = rank == 0
    cores = machine.cores()
    allocator = launch.keep_freed_memory()
    meta = machine.describe(["fastmesh", "bench", *argv])
    local = [n for n in plan.families if not FAMILIES[n].distributed]
    distributed = _distributed_names(plan)
    skipped = {
        name: f"measures --dtype {' / '.join(FAMILIES[name].dtypes)}, none of which was asked for"
        for name in plan.families
        if not set(plan.dtypes) & set(FAMILIES[name].dtypes)
    }
    local = [n for n in local if n not in skipped]
    distributed = [n for n in distributed if n not in skipped]
    if distributed and world < 2:
        if device_type == "cuda":
            reason = f"needs two or more CUDA devices (one rank per GPU), found {world}"
        else:
            reason = "needs two or more ranks (one rank runs no collective): --world 1"
        skipped.update({name: reason for name in distributed})
        distributed = []
    threads, warning = launch.threads_per_rank(local_world, cores, args.threads)
    local_threads = args.threads or cores
    meta["run"] = {
        "device": device_type,
        "quick": plan.quick,
        "repeats": plan.repeats,
        "warmup": plan.warmup,
        "dtypes": list(plan.dtypes),
        "cases": plan.cases,
        "fp8": list(plan.fp8),
        "emulated_dtypes": plan.emulated,
        "allocator": allocator,
        "launcher": "torchrun" if under_torchrun else "elastic_launch",
        "world": world,
        "local_ranks": local_world,
        "threads_per_rank": threads,
        "single_process_threads": local_threads,
        "backend": "nccl" if device_type == "cuda" else "gloo",
    }
    if leader:
        _print_setup(meta, local, distributed, skipped, warning, under_torchrun, cores)
    start = time.perf_counter()
    results = {}
    if local and leader:
        torch.set_num_threads(local_threads)
        results.update(_run_families(plan, local, leader=True))
    if distributed:
        plan.families = [n for n in plan.families if n in distributed]
        if under_torchrun:
            # The other ranks wait for rank 0 here (within the collective timeout) while it runs the
            # single-process families.
            torch.set_num_threads(threads)
            results.update(_distributed_on_world(plan) or {})
        else:
            results.update(launch.launch(world, threads, _rank_main, plan))
    if not leader:
        return 0
    ordered = {name: results[name] for name in FAMILIES if name in results}
    _write_outputs(args, meta, ordered, skipped, time.perf_counter() - start)
    return 0


def _print_setup(meta, local, distributed, skipped, warning, under_torchrun, cores) -> None:
    run = meta["run"]
    for line in machine.summary_lines(meta):
        print(line)
    print(f"allocator: {run['allocator']}")
    if local:
        print(
            f"single-process families ({', '.join(local)}): {run['single_process_threads']} intra-op thread(s), "
            f"{cores} cores"
        )
    if distributed:
        how = "torchrun's world" if under_torchrun else "started with torch's elastic launcher"
        print(
            f"distributed families ({', '.join(distributed)}): {run['world']} ranks on {run['backend']} ({how}), "
            f"{run['threads_per_rank']} intra-op thread(s) per rank: {run['local_ranks']} local ranks x "
            f"{run['threads_per_rank']} = {run['local_ranks'] * run['threads_per_rank']} threads on {cores} cores"
        )
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    for name, reason in skipped.items():
        print(f"{name}: not run: {reason}")
    print(
        f"{run['repeats']} interleaved rounds after {run['warmup']} warm-up per case; every result checked "
        "against its baseline before timing",
        flush=True,
    )


def _write_outputs(args, meta: dict, results: dict, skipped: dict, seconds: float) -> None:
    meta["run"]["seconds"] = round(seconds, 1)
    print()
    for name, result in results.items():
        if result["rows"]:
            print(report.table(name, result["rows"]))
        for note in result["notes"]:
            print(f"  note: {note}")
        print()
    written = [
        report.write_json(os.path.join(args.out, "bench.json"), meta, results, skipped),
        report.write_markdown(os.path.join(args.out, "bench.md"), meta, results, skipped),
    ]
    missing = None if args.no_plots else plots.matplotlib_missing()
    if missing:
        print(f"plots not written: {missing}")
    elif not args.no_plots:
        written += [
            plots.plot_family(name, result["rows"], args.out, FAMILIES[name].plot_ratio)
            for name, result in results.items()
            if result["rows"]
        ]
    for path in written:
        print(f"wrote {path}")
    print(f"total {seconds:.0f} s")


if __name__ == "__main__":
    sys.exit(main())

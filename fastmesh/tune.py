"""``fastmesh tune``: measures the plans of a model's fused calls on this machine and keeps them in the plan cache.

    fastmesh tune --dim 4096 --hidden 14336 --tokens 4096 --heads 32 --kv-heads 8   # one Llama block, TP=2
    fastmesh tune --case ag:2048x4096:0:384 --case rs:4096x1024:0:2048 --dtype float32
    fastmesh tune --device cuda --world 8 --fp8 rowwise --dim 8192 --hidden 28672 --tokens 8192 --heads 64 --kv-heads 8

``--world`` local ranks are started as ``fastmesh bench`` starts them (:mod:`fastmesh.bench.launch`) and run with
``FASTMESH_TUNE=measure``: the first call of each key measures every candidate plan on every rank and stores
the fastest in the cache file (:mod:`fastmesh.ops.plans`); a key the cache already covers is reported as
cached and not measured again (``--force`` measures it again and replaces its entry). Each call is made once:

* a block config: one forward and backward of ``fastmesh.testing.llama.Block`` under fastmesh's fused TP plan
  (``fused_block_plan``) on this rank's sequence shard ``x [batch, tokens/W, dim]``. Per pass: the gathers
  into wq/wk/wv and into w1/w3, the reduce-scatters out of wo and w2, and in backward each one's gradient
  through the other op. These are the calls (and cache keys) a model built from that block makes;
* ``--case SPEC``: one forward call in the benchmark's syntax (:func:`fastmesh.bench.fused_collectives.parse_spec`).

``--fp8 GRANULARITY`` tunes the FP8 forms too (the block again under ``Float8Config(granularity=...)``, each case
again with ``fp8=``). Rank 0 prints each call's plan, where it came from, and the figures it was chosen from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastmesh import settings
from fastmesh.bench import launch, machine
from fastmesh.bench.fused_collectives import Spec, parse_spec
from fastmesh.ops import plans
from fastmesh.ops._fp8_operands import GRANULARITIES
from fastmesh.ops.plan_cache import ENV_PATH, PlanCache, default_path
from fastmesh.testing.llama import LlamaArgs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Decision.source as the table says it: a plan from the cache was not measured by this run.
_SOURCES = {"measured": "measured", "cache": "cached"}


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    dim: int
    hidden: int
    tokens: int  # the whole sequence length; each rank holds tokens / W of it
    heads: int
    kv_heads: int
    batch: int


@dataclasses.dataclass(frozen=True)
class Request:
    """What the ranks run (picklable: it travels to spawned ranks)."""

    device_type: str
    dtype: str
    fp8: str | None
    block: BlockConfig | None
    cases: tuple  # Specs
    cache_path: str  # where the ranks measure into (a scratch file under --force)


@dataclasses.dataclass(frozen=True)
class Row:
    """One planned call as rank 0 saw it."""

    where: str  # "forward", "backward" or "case N", with " fp8" for the FP8 forms
    op: str
    call: str  # the call's shapes and dim
    key: str
    decision: plans.Decision


def build_parser() -> argparse.ArgumentParser:
    defaults = LlamaArgs()
    parser = argparse.ArgumentParser(
        prog="fastmesh tune",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="measure the plans of fused calls on this machine and keep them in the plan cache",
        epilog="Give a block config (--tokens and any of --dim --hidden --heads --kv-heads --batch; the others "
        "default to fastmesh.testing.llama.LlamaArgs), --case SPEC, or both.",
    )
    parser.add_argument("--world", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per rank (default: cores // ranks, as fastmesh bench)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo, the default) or cuda (NCCL, one GPU per rank)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="default bfloat16")
    parser.add_argument(
        "--fp8", choices=GRANULARITIES, default=None, help="also tune the FP8 forms, with this scaling granularity"
    )
    parser.add_argument(
        "--cache",
        default=None,
        metavar="PATH",
        help=f"the plan cache file (default: {ENV_PATH}, else {default_path()})",
    )
    parser.add_argument("--force", action="store_true", help="measure keys the cache has too, replacing their entries")
    block = parser.add_argument_group("block config (one Llama block under fastmesh's fused TP plan)")
    block.add_argument("--tokens", type=int, default=None, help="sequence length (sharded over the ranks)")
    block.add_argument("--dim", type=int, default=None, help=f"model dim (default {defaults.dim})")
    block.add_argument(
        "--hidden", type=int, default=None, help=f"feed-forward hidden dim (default {defaults.ffn_hidden})"
    )
    block.add_argument("--heads", type=int, default=None, help=f"attention heads (default {defaults.n_heads})")
    block.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads (default {defaults.n_kv_heads})")
    block.add_argument("--batch", type=int, default=None, help="sequences per call (default 1)")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="SPEC",
        help="an explicit call in fastmesh bench's syntax, e.g. ag:2048x4096:0:384 or rs:4096x1024:0:2048 (repeatable)",
    )
    return parser


def _block_config(args, parser) -> BlockConfig | None:
    given = {name: getattr(args, name) for name in ("dim", "hidden", "heads", "kv_heads", "batch")}
    if args.tokens is None:
        named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
        if named:
            parser.error(f"{', '.join(named)} describe a block, which needs --tokens (its sequence length)")
        return None
    defaults = LlamaArgs()
    fallback = {
        "dim": defaults.dim,
        "hidden": defaults.ffn_hidden,
        "heads": defaults.n_heads,
        "kv_heads": defaults.n_kv_heads,
        "batch": 1,
    }
    block = BlockConfig(
        tokens=args.tokens, **{name: fallback[name] if value is None else value for name, value in given.items()}
    )
    world = args.world
    for option, value in (
        ("--tokens", block.tokens),
        ("--dim", block.dim),
        ("--hidden", block.hidden),
        ("--heads", block.heads),
        ("--kv-heads", block.kv_heads),
        ("--batch", block.batch),
    ):
        if value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    # The fused plan shards the sequence, the heads and the hidden dim over the ranks.
    for option, value in (
        ("--tokens", block.tokens),
        ("--heads", block.heads),
        ("--kv-heads", block.kv_heads),
        ("--hidden", block.hidden),
    ):
        if value % world:
            parser.error(f"{option} {value} must be divisible by --world {world} (TP shards it over the ranks)")
    if block.dim % block.heads:
        parser.error(f"--dim {block.dim} must be divisible by --heads {block.heads} (head dim = dim / heads)")
    if block.heads % block.kv_heads:
        parser.error(f"--heads {block.heads} must be a multiple of --kv-heads {block.kv_heads}")
    if args.fp8 == "mx":  # the styles' MX rules (fastmesh/parallel/_common.py, _fp8_operands.check_fp8_contraction)
        head_dim = block.dim // block.heads
        contractions = {
            "--dim": block.dim,
            "--dim / --world": block.dim // world,
            "--hidden / --world": block.hidden // world,
            "the q, k and v columns per rank": (block.heads + 2 * block.kv_heads) * head_dim // world,
            "the w1 and w3 columns per rank": 2 * block.hidden // world,
        }
        bad = [f"{name} = {value}" for name, value in contractions.items() if value % 32]
        if bad:
            parser.error(
                f"--fp8 mx runs blocks of 32 along every contraction of the block (forward and FP8 backward), "
                f"but {', '.join(bad)}: pick sizes that 32 divides"
            )
    return block


def _cases(args, parser) -> tuple:
    cases = []
    for text in args.case:
        try:
            spec = parse_spec(text, args.world)
        except ValueError as error:
            parser.error(f"--case: {error}")  # the error quotes the spec
        if spec.pieces:
            parser.error(
                f"--case {text!r}: a piece count (:{spec.pieces}) fixes the plan, so there is nothing to "
                "measure; leave it out"
            )
        if args.fp8 and spec.op == "all_gather_matmul" and spec.dim in (-1, len(spec.shape) - 1):
            parser.error(
                f"--case {text!r} with --fp8: the FP8 form gathers rows, so the gathered dim must not be the last"
            )
        cases.append(spec)
    return tuple(cases)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.world < 2:
        parser.error(f"--world must be >= 2 (a single rank has no plan to choose), got {args.world}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        parser.error(
            f"--device cuda --world {args.world}: one GPU per rank, but torch sees {torch.cuda.device_count()}"
        )
    block = _block_config(args, parser)
    cases = _cases(args, parser)
    if block is None and not cases:
        parser.error(
            "nothing to tune: give a block config (--tokens, with --dim --hidden --heads --kv-heads) or --case SPEC"
        )
    cache_path = os.path.abspath(args.cache or default_path())
    threads, warning = launch.threads_per_rank(args.world, machine.cores(), args.threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(
        f"fastmesh tune: {args.world} ranks on {backend} ({args.device}), {threads} intra-op thread(s) per rank, "
        f"{plans.ENV_MODE}=measure, cache {cache_path}",
        flush=True,
    )
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    # --force: the ranks measure into an empty scratch cache, whose entries then replace the file's.
    scratch = tempfile.mkdtemp(prefix="fastmesh-tune-") if args.force else None
    try:
        request = Request(
            args.device,
            args.dtype,
            args.fp8,
            block,
            cases,
            os.path.join(scratch, "plans.json") if scratch else cache_path,
        )
        rows = launch.launch(args.world, threads, _rank_main, request)
        if scratch:
            target = PlanCache(cache_path)
            for key, entry in PlanCache(request.cache_path).entries().items():
                target.store(key, entry)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(format_table(rows))
    measured = len({row.key for row in rows if row.decision.source == "measured"})
    cache = PlanCache(cache_path)
    written = f"{measured} plan(s) measured and written to" if measured else "nothing measured; nothing written to"
    print(f"\n{written} {cache.path} ({len(cache.entries())} plan(s) for this machine, section {cache.section})")
    return 0


def format_table(rows: list[Row]) -> str:
    """One line per distinct key: where it was called, op, call, plan, source, figures (ms)."""
    merged: dict[str, list] = {}
    for row in rows:
        if row.key in merged:
            merged[row.key][0] += f", {row.where}"
        else:
            decision = row.decision
            figures = ", ".join(f"{label} {ms:.3g}" for label, ms in decision.figures)
            merged[row.key] = [
                row.where,
                row.op.removeprefix("fastmesh::"),
                row.call,
                decision.plan.label,
                _SOURCES.get(decision.source, decision.source),
                figures,
            ]
    header = ["called in", "op", "call", "plan", "source", "figures (ms: slowest rank's median per plan)"]
    table = [header] + list(merged.values())
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in table
    )


class _Recorder(TorchDispatchMode):
    """Records the plan of every planned fastmesh op call, as the dispatcher sees the calls (forward and backward,
    whatever module or autograd formula makes them)."""

    def __init__(self):
        super().__init__()
        self.where = ""
        self.rows: list[Row] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func._schema.name
        # Right after the call, the op's latest decision is this call's.
        latest = plans.last_decision(op) if op.startswith("fastmesh::") else None
        if latest is not None:
            named = dict(zip((argument.name for argument in func._schema.arguments), args), **(kwargs or {}))
            self.rows.append(Row(self.where, op, _describe_call(op, named), *latest))
        return out


def _describe_call(op: str, named: dict) -> str:
    if "bs" in named:
        ns = ",".join(str(b.shape[1]) for b in named["bs"])
        return f"a_shard {list(named['a_shard'].shape)} gather_dim {named['gather_dim']} -> N {ns}"
    if "scatter_dim" in named:
        where = f" scatter_dim {named['scatter_dim']}"
    else:  # matmul_all_reduce / matmul_all_gather: the whole product moves
        where = " all-gathered" if op == "fastmesh::matmul_all_gather" else " all-reduced"
    return f"a {list(named['a'].shape)} @ b {list(named['b'].shape)}{where}"


def _rank_main(threads: int, request: Request) -> list[Row] | None:
    """A rank started by :func:`fastmesh.bench.launch.launch`: every requested call once, planned by measuring."""
    import torch.distributed as dist

    import fastmesh

    launch.keep_freed_memory()
    torch.set_num_threads(threads)
    os.environ[plans.ENV_MODE] = "measure"
    os.environ[ENV_PATH] = request.cache_path
    settings.reload()

    def run(mesh) -> list[Row] | None:
        recorder = _Recorder()
        fp8_forms = [None] + ([fastmesh.fp8.Float8Config(granularity=request.fp8)] if request.fp8 else [])
        with recorder:
            for fp8 in fp8_forms:
                suffix = " fp8" if fp8 else ""
                if request.block:
                    _run_block(request, mesh, fp8, recorder, suffix)
                for index, spec in enumerate(request.cases, 1):
                    recorder.where = f"case {index}{suffix}"
                    _run_case(spec, request, mesh, fp8)
        return recorder.rows if dist.get_rank() == 0 else None

    return launch.on_world_mesh(request.device_type, run)


def _run_block(request: Request, mesh, fp8, recorder: _Recorder, suffix: str) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from fastmesh.testing.llama import Block, fused_block_plan, rope_tables

    config, dtype, device = request.block, DTYPES[request.dtype], mesh.device_type
    args = LlamaArgs(dim=config.dim, n_heads=config.heads, n_kv_heads=config.kv_heads, ffn_hidden=config.hidden)
    block = parallelize_module(Block(args).to(device=device, dtype=dtype), mesh, fused_block_plan(fp8=fp8))
    rope = tuple(t.to(device) for t in rope_tables(config.tokens, args.head_dim, args.rope_theta))
    x = torch.randn(
        config.batch, config.tokens // mesh.size(), config.dim, device=device, dtype=dtype, requires_grad=True
    )
    recorder.where = "forward" + suffix
    out = block(x, rope)
    recorder.where = "backward" + suffix
    out.sum().backward()


def _run_case(spec: Spec, request: Request, mesh, fp8) -> None:
    import fastmesh

    dtype, device, world = DTYPES[request.dtype], mesh.device_type, mesh.size()
    a = torch.randn(spec.shape, device=device, dtype=dtype)
    group = mesh.get_group()
    with torch.no_grad():
        if spec.op == "all_gather_matmul":
            last = spec.dim in (-1, len(spec.shape) - 1)
            k = spec.shape[-1] * (world if last else 1)  # gathering the last dim gathers the contraction
            bs = [torch.randn(k, n, device=device, dtype=dtype) for n in spec.ns]
            fastmesh.all_gather_matmul(a, bs, spec.dim, group=group, fp8=fp8)
        elif spec.op == "matmul_all_reduce":
            b = torch.randn(spec.shape[-1], spec.ns[0], device=device, dtype=dtype)
            fastmesh.matmul_all_reduce(a, b, group=group, fp8=fp8)
        elif spec.op == "matmul_all_gather":  # no FP8 form: tuned in the high-precision dtype
            b = torch.randn(spec.shape[-1], spec.ns[0], device=device, dtype=dtype)
            fastmesh.matmul_all_gather(a, b, group=group)
        else:
            b = torch.randn(spec.shape[-1], spec.ns[0], device=device, dtype=dtype)
            fastmesh.matmul_reduce_scatter(a, b, spec.dim, group=group, fp8=fp8)


if __name__ == "__main__":
    sys.exit(main())

"""The fused ops against the best unfused sequence over many shapes: where fusing pays, with the plan each took.

Each case is an op, a dtype and a shape: few rows against a large weight, square, many rows against a small one;
gathered / scattered along dim 0 or the middle dim of a 3-D shape. In interleaved rounds (each call after a
barrier, as long as its slowest rank), after every result is checked against ``unfused_tensor``'s:

* ``fastmesh`` (kernel): the fused op with its default plan (``fastmesh.ops.plans``), as ``fused_collectives``
  calls it; ``float8``: the scaled ops on row-wise scales, bf16 out;
* ``unfused_tensor`` (baseline): c10d's all-gather / reduce-scatter into one tensor with the matmuls, as
  ``fused_collectives``' ``unfused``; ``unfused_list`` (baseline): the same through c10d's list forms
  (``all_gather(list, x)``, ``reduce_scatter(out, list)``) on blocks of the same buffers;
* ``best_unfused`` (baseline): whichever of those two has the lower median, with its own rounds;
  ``speedup_vs_best_unfused`` is the figure;
* ``comm`` and ``matmul`` (parts) and ``bound`` = max(comm, matmul) per round.

After the cases, the summary (the JSON's ``summary`` and the notes), per dtype and overall: the shapes, the
geometric mean of ``speedup_vs_best_unfused``, the worst case and how many are below 1.0. The plot shows that
speedup per case, sorted, as bars from a line at 1.0.

Cases: ``--case sweep=ag:64x4096:0:4096``, the syntax of ``fused_collectives``, each in every ``--dtype``.
"""

from __future__ import annotations

import functools
import statistics

import torch.distributed as dist
from fastmesh.bench.family import Context, Family, plan_text
from fastmesh.bench.figures import Case, Contender
from fastmesh.bench.fused_collectives import (
    TORCH_DTYPES,
    _Gather,
    _Scatter,
    case_params,
    cases,
    parse_spec,
    plan_taken,
    skipped,
)
from fastmesh.bench.timing import time_slowest_rank

RATIO = "speedup_vs_best_unfused"
# Sizes for 2 gloo ranks of 1 thread on the 2-core dev machine (fp32 matmul ~75-100 GFLOP/s per thread, bf16 ~200,
# FP8 _scaled_mm ~15-35 and it converts all of b per call; gloo ~0.5-1.5 GB/s): each call ~5-300 ms. Per dtype:
# few rows by a large weight (the losers among them), square, many rows by a small weight, where the
# transfer is a larger share (comm/matmul ~ 70 / N for gathers, 70 / K for scatters).
FULL_CASES = {
    "float32": [
        "ag:64x4096:0:4096",
        "rs:128x4096:0:4096",
        "ag:2x32x4096:1:2048",
        "rs:2x128x2048:1:4096",
        "ag:1024x1024:0:1024",
        "rs:1024x1024:0:1024",
        "ag:4x256x1024:1:1024",
        "ag:8192x256:0:256",
        "rs:8192x128:0:512",
        "ag:4x2048x96:1:128",
        "rs:4x2048x128:1:256",
    ],
    "bfloat16": [
        "ag:256x2048:0:8192",
        "rs:512x8192:0:1024",
        "ag:2x64x8192:1:2048",
        "rs:2x64x4096:1:8192",
        "rs:1024x2048:0:4096",
        "ag:1024x2048:0:2048",
        "rs:2048x2048:0:2048",
        "ag:8192x512:0:96",
        "rs:8192x96:0:1024",
        "ag:4x2048x256:1:256",
        "rs:4x2048x256:1:512",
    ],
    "float8": [
        "ag:64x4096:0:1024",
        "rs:128x4096:0:1024",
        "ag:2x32x4096:1:1024",
        "ag:512x1024:0:512",
        "rs:1024x1024:0:512",
        "ag:8192x128:0:128",
        "rs:8192x128:0:256",
        "rs:4x2048x128:1:128",
    ],
}
QUICK_CASES = {
    "float32": ["ag:128x1024:0:1024", "rs:2x512x256:1:512"],
    "bfloat16": ["rs:1024x512:0:512"],
    "float8": ["ag:1024x256:0:256"],
}


class _GatherForms(_Gather):
    """``_Gather`` with c10d's all-gather in list form too."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gathered_blocks = list(self.gathered.chunk(self.world))
        self.scale_blocks = None if self.scale_gathered is None else list(self.scale_gathered.chunk(self.world))

    def unfused_list(self):
        dist.all_gather(self.gathered_blocks, self.shard, group=self.group)
        if self.scale_blocks is not None:
            dist.all_gather(self.scale_blocks, self.scale_shard, group=self.group)
        return self.multiply_gathered()


class _ScatterForms(_Scatter):
    """``_Scatter`` with c10d's reduce-scatter in list form too."""

    def __init__(self, *args):
        super().__init__(*args)
        self.send_blocks = list(self.send.chunk(self.world))

    def unfused_list(self):
        self.product_blocks()
        dist.reduce_scatter(self.out, self.send_blocks, group=self.group)
        return self.out


def run(ctx: Context) -> None:
    todo = list(cases(ctx, FULL_CASES, QUICK_CASES, fp8_granularities=("rowwise",)))
    ctx.expect(len(todo))
    for spec, dtype_name, granularity in todo:
        reason = skipped(spec, granularity, ctx.device)
        if reason:
            ctx.note(reason)
            continue
        runner = (_GatherForms if spec.op == "all_gather_matmul" else _ScatterForms)(
            spec, dtype_name, granularity, ctx.group, ctx.device
        )
        runner.check(dtype_name)
        runner.check(dtype_name, runner.unfused_list)
        timings = time_slowest_rank(
            {
                "fastmesh": runner.fastmesh,
                "unfused_tensor": runner.unfused,
                "unfused_list": runner.unfused_list,
                "comm": runner.comm,
                "matmul": runner.matmul,
            },
            ctx.group,
            ctx.warmup,
            ctx.repeats,
            ctx.clock,
        )
        flops = (runner.flops, "flops")
        # The faster form by its median, with its own rounds: a per-round minimum of two noisy forms would sit
        # below both forms' typical times and count noise as a loss.
        best = min(("unfused_tensor", "unfused_list"), key=lambda name: statistics.median(timings[name]))
        contenders = {
            "fastmesh": Contender("kernel", timings["fastmesh"], *flops),
            "best_unfused": Contender("baseline", timings[best], *flops),
            "unfused_tensor": Contender("baseline", timings["unfused_tensor"], *flops),
            "unfused_list": Contender("baseline", timings["unfused_list"], *flops),
            "comm": Contender("part", timings["comm"], runner.comm_bytes, "bytes"),
            "matmul": Contender("part", timings["matmul"], *flops),
            "bound": Contender("bound", list(map(max, timings["comm"], timings["matmul"])), *flops),
        }
        ctx.emit(
            Case(
                "sweep",
                runner.label,
                dtype_name,
                "fastmesh",
                contenders,
                params=case_params(spec, granularity, ctx.group.size()),
                plan=plan_taken(runner),
            )
        )
    if ctx.rows:
        ctx.summary = summarize(ctx.rows)
        for name, s in ctx.summary.items():
            worst = s["worst"]
            ctx.note(
                f"summary {name}: {s['shapes']} shapes, speedup vs best unfused: geomean {s['geomean']:.3f}, "
                f"worst {worst['speedup']:.3f} ({worst['case']} {worst['dtype']}, plan {worst['plan']}), "
                f"{s['below_1']} below 1.0"
            )


def summarize(rows: list[dict]) -> dict:
    """Per dtype, then over all rows ("all"): the shapes, the geometric mean of the rows' median speedup over the
    best unfused sequence, the worst row, and how many rows are below 1.0."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["dtype"], []).append(row)
    groups["all"] = rows
    summary = {}
    for name, group in groups.items():
        speedups = [row["ratios"][RATIO]["median"] for row in group]
        worst = min(group, key=lambda row: row["ratios"][RATIO]["median"])
        summary[name] = {
            "shapes": len(group),
            "geomean": statistics.geometric_mean(speedups),
            "worst": {
                "case": worst["case"],
                "dtype": worst["dtype"],
                "speedup": worst["ratios"][RATIO]["median"],
                "plan": plan_text(worst),
            },
            "below_1": sum(s < 1.0 for s in speedups),
        }
    return summary


FAMILY = Family(
    "sweep",
    "all_gather_matmul and matmul_reduce_scatter over many shapes (fp32, bf16, FP8 row-wise), "
    "each with the plan it took, against the best unfused c10d sequence",
    distributed=True,
    dtypes=tuple(TORCH_DTYPES),
    run=run,
    parse_case=functools.partial(parse_spec, family="sweep"),
    plot_ratio=RATIO,
)

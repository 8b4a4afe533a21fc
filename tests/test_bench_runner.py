"""The ``fastmesh bench`` runner on tiny sizes: its JSON's structure, every figure positive and finite, its ranks.

These are correctness tests of the runner (it measures what it says, writes what it promises, rejects bad
options), not timed tests: nothing here compares speeds.
"""

import json
import math
import statistics
import subprocess
import sys

import pytest
import torch
from fastmesh.bench import figures, fused_collectives, report, runner
from fastmesh.bench.family import Context, dtype_text

TINY_CASES = [
    "fp8_quantize=256x256",
    "amax=256x256",
    "fused_collectives=ag:64x128:0:32",
    "fused_collectives=rs:2x64x32:1:64",
    "fused_collectives=ag:2x32x128:1:16,8:2",
    "fused_collectives=ag:64x64:-1:16",
    "fused_collectives=ar:2x32x48:40",
    "sweep=rs:64x32:0:64",
    "tp_block=2x64x256x256",
    "tp_block=2x64x256x256:plain",
    "hf_model=1x16x256x512",
]
TINY = ["--repeats", "2", "--warmup", "0"]
META_KEYS = {"date", "machine", "versions", "commit", "command", "run"}
RUN_KEYS = {"device", "quick", "repeats", "warmup", "launcher", "world", "threads_per_rank", "backend", "allocator"}


def _run(args, tmp_path, launcher=(sys.executable, "-m", "fastmesh.bench.runner"), timeout=900):
    out = tmp_path / "out"
    result = subprocess.run(
        [*launcher, *args, "--out", str(out)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )
    assert result.returncode == 0, f"runner failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    with open(out / "bench.json") as f:
        return json.load(f), result.stdout, out


def _numbers(node, path=""):
    """Every number in a JSON tree, with its path."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{path}/{i}")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


def _check_rows(rows, family):
    assert rows, f"{family}: no rows"
    for row in rows:
        where = f"{family} / {row['case']} / {row['dtype']}"
        assert row["family"] == family and row["kernel"] in row["figures"], where
        kinds = {figure["kind"] for figure in row["figures"].values()}
        assert kinds <= set(figures.KINDS) and {"kernel", "baseline", "bound"} <= kinds, (where, kinds)
        for name, figure in row["figures"].items():
            assert set(figure["ms"]) == {"median", "q1", "q3", "min", "max"}, (where, name)
            ms = figure["ms"]
            assert ms["min"] <= ms["q1"] <= ms["median"] <= ms["q3"] <= ms["max"], (where, name, ms)
            if figure["kind"] != "bound":  # a bound is derived per round from measured parts
                assert len(row["samples_s"][name]) == 2, (where, name)
        for name, figure in row["figures"].items():
            if figure["kind"] == "baseline":
                assert f"speedup_vs_{name}" in row["ratios"], (where, name)
            if figure["kind"] == "bound":
                assert f"{row['kernel']}_over_{name}" in row["ratios"], (where, name)
        for path, value in [*_numbers(row["figures"]), *_numbers(row["ratios"]), *_numbers(row["samples_s"])]:
            assert math.isfinite(value) and value > 0, f"{where}{path} = {value}"


def _hf_model_why_not():
    from fastmesh.bench import hf_model

    return hf_model.load_integration()[1]


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_runner_every_family_on_tiny_sizes(tmp_path):
    cases = [arg for case in TINY_CASES for arg in ("--case", case)]
    result, stdout, out = _run(["--quick", "--dtype", "float32", "float8", *cases, *TINY], tmp_path)
    assert set(result["meta"]) >= META_KEYS and set(result["meta"]["run"]) >= RUN_KEYS
    meta, run = result["meta"], result["meta"]["run"]
    assert {"cpu", "cores", "memory_gib", "gpus"} <= set(meta["machine"])
    assert {"torch", "triton", "fastmesh", "python"} <= set(meta["versions"])
    assert meta["commit"] and meta["command"].startswith("fastmesh bench --quick")
    assert run["launcher"] == "elastic_launch" and run["world"] == 2 and run["device"] == "cpu"
    assert run["world"] * run["threads_per_rank"] <= max(meta["machine"]["cores"], run["world"])
    assert list(result["families"]) == list(runner.FAMILIES), "every family, in the runner's order"
    rows = result["families"]
    if _hf_model_why_not():  # transformers is an optional dependency: the family says so and measures nothing
        assert rows["hf_model"]["rows"] == [] and rows["hf_model"]["notes"][0].startswith("nothing measured: ")
        del rows["hf_model"]
    else:  # --quick: eager only
        assert {*rows["hf_model"]["rows"][0]["figures"]} == {"fastmesh", "native", "bound"}
    for family, data in rows.items():
        _check_rows(data["rows"], family)
    # float32 and float8 only: the quantize families measure float32; fused collectives both, in both ops' FP8 forms.
    assert {r["dtype"] for r in rows["fp8_quantize"]["rows"]} == {"float32"}
    assert len(rows["fp8_quantize"]["rows"]) == 7  # 4 granularities, the given scale, the MX cast (floor, rceil)
    fused = rows["fused_collectives"]["rows"]
    # float32: 5 cases; float8: each case row-wise and tensor-wise, but for the gather of the last dim (noted);
    # row-wise only where torch's CPU _scaled_mm takes it
    granularities = {"rowwise", "tensorwise"} if fused_collectives.rowwise_scaled_mm_on_cpu() else {"tensorwise"}
    assert len(fused) == 5 + len(granularities) * 4
    assert len([r["plan"] for r in fused if r["params"]["op"] == "matmul_all_reduce" and r["plan"]]) == 1 + len(
        granularities
    )
    assert {r["params"]["granularity"] for r in fused if r["dtype"] == "float8"} == granularities
    block = {(r["params"]["sequence_parallel"], r["dtype"]): r for r in rows["tp_block"]["rows"]}
    assert sorted(block) == [(False, "float32"), (False, "float8"), (True, "float32"), (True, "float8")], block
    for sequence_parallel in (True, False):
        figures_ = block[sequence_parallel, "float32"]["figures"]
        assert {"native", "native_c", "native_c+pass", "fastmesh_c"} <= set(figures_), sequence_parallel
        assert "pass_speedup" in block[sequence_parallel, "float32"]["ratios"], sequence_parallel
    assert "native" in block[True, "float8"]["figures"] and block[False, "float32"]["case"].endswith(" plain")
    assert {"native", "fastmesh"} <= set(block[False, "float8"]["figures"]), "plain TP in FP8 against bf16 native"
    assert sum("pieces=2" in r["case"] and r["params"]["pieces"] == 2 for r in fused) == 1 + len(granularities)
    assert all(r["plan"]["label"] == "rowsx2" for r in fused if r["params"]["pieces"] == 2)
    notes = " ".join(rows["fused_collectives"]["notes"])
    assert "symm_mem baseline not run" in notes and "[64, 64] d-1 N=16 float8 skipped" in notes
    # The table and the progress lines.
    assert "[tp_block 4/4" in stdout and "speedup_vs_unfused" in stdout
    markdown = (out / "bench.md").read_text()
    assert all(f"\n{name} (medians" in markdown for name in runner.FAMILIES) and "| case | dtype |" in markdown
    pngs = sorted(p.name for p in out.glob("*.png"))
    if _matplotlib():
        assert pngs == sorted(f"{name}.png" for name in runner.FAMILIES)
        for png in pngs:
            assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not pngs and "plots not written: matplotlib is not installed" in stdout


def test_sweep_names_each_plan_and_summarizes(tmp_path):
    cases = ["--case", "sweep=ag:2x32x64:1:48", "--case", "sweep=rs:64x32:0:64:2"]
    result, stdout, out = _run(
        ["--only", "sweep", "--dtype", "float32", "float8", "--no-plots", *cases, *TINY], tmp_path
    )
    sweep = result["families"]["sweep"]
    rows = sweep["rows"]
    _check_rows(rows, "sweep")
    # The sweep's FP8 cases are row-wise: skipped (and noted) where torch's CPU _scaled_mm does not take them.
    dtypes = ["float32", "float8"] if fused_collectives.rowwise_scaled_mm_on_cpu() else ["float32"]
    shapes = 2 * len(dtypes)
    ops = ("all_gather_matmul", "matmul_reduce_scatter")
    assert [(r["params"]["op"], r["dtype"]) for r in rows] == [(op, dtype) for dtype in dtypes for op in ops]
    for row in rows:
        samples = row["samples_s"]
        better = min(("unfused_tensor", "unfused_list"), key=lambda name: statistics.median(samples[name]))
        assert samples["best_unfused"] == samples[better]
        assert row["plan"]["label"] and row["plan"]["source"] and row["plan"]["label"] in row["plan"]["decision"]
        assert f"({row['plan']['label']}, {row['plan']['source']})" in stdout, "the progress line names the plan"
    # a piece count given in the case is the plan the timed calls ran
    assert [r["plan"]["label"] for r in rows if r["params"]["pieces"] == 2] == ["rowsx2"] * len(dtypes)
    speedups = [r["ratios"]["speedup_vs_best_unfused"]["median"] for r in rows]
    summary = sweep["summary"]
    assert list(summary) == [*dtypes, "all"] and summary["all"]["shapes"] == shapes
    assert summary["all"]["worst"]["speedup"] == min(speedups)
    assert summary["all"]["below_1"] == sum(s < 1.0 for s in speedups)
    assert min(speedups) <= summary["all"]["geomean"] <= max(speedups)
    assert sum(note.startswith("summary ") for note in sweep["notes"]) == len(dtypes) + 1
    assert f"- note: summary all: {shapes} shapes" in (out / "bench.md").read_text()


def test_fused_collectives_block_scaled_forms(tmp_path):
    # MX and block scales in each op with an FP8 form: a gather of dim 1 (the scales reordered with their rows)
    # into two b's, and a K that MX cannot block (48: noted, block runs); each checked against its baseline.
    cases = ["ag:2x32x128:1:16,8", "rs:64x48:0:64", "ar:2x32x64:40"]
    result, stdout, _ = _run(
        ["--only", "fused_collectives", "--dtype", "float8", "--fp8", "mx", "block", "--no-plots", *TINY]
        + [arg for case in cases for arg in ("--case", f"fused_collectives={case}")],
        tmp_path,
    )
    assert result["meta"]["run"]["fp8"] == ["mx", "block"]
    family = result["families"]["fused_collectives"]
    rows = family["rows"]
    _check_rows(rows, "fused_collectives")
    assert [(r["params"]["op"], r["params"]["granularity"]) for r in rows] == [
        ("all_gather_matmul", "mx"),
        ("all_gather_matmul", "block"),
        ("matmul_reduce_scatter", "block"),
        ("matmul_all_reduce", "mx"),
        ("matmul_all_reduce", "block"),
    ]
    assert all(r["details"]["multiply"] == "dequantize to bf16 + torch.matmul" for r in rows)
    notes = " ".join(family["notes"])
    assert "N=64 float8 mx skipped: MX scales need the contraction dim (K = 48)" in notes
    for granularity in ("mx", "block"):
        assert f"float8 {granularity}: fastmesh, unfused and matmul multiply by dequantize to bf16" in notes
    assert "fp8 block" in stdout


@pytest.mark.smoke
def test_runner_single_process_family(tmp_path):
    result, _, _ = _run(
        ["--only", "amax", "--case", "amax=256x256", "--dtype", "bfloat16", "--no-plots", *TINY], tmp_path
    )
    assert list(result["families"]) == ["amax"]
    _check_rows(result["families"]["amax"]["rows"], "amax")


def test_runner_under_torchrun_uses_its_world(tmp_path):
    torchrun = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fastmesh.bench.runner",
    )
    result, stdout, _ = _run(
        [
            "--only",
            "amax",
            "fused_collectives",
            "--dtype",
            "bfloat16",
            "--no-plots",
            "--case",
            "amax=256x256",
            "--case",
            "fused_collectives=ag:64x128:0:32",
            *TINY,
        ],
        tmp_path,
        launcher=torchrun,
    )
    run = result["meta"]["run"]
    assert run["launcher"] == "torchrun" and run["world"] == 2 and run["local_ranks"] == 2
    # rank 0 ran the single-process family while the other rank waited, then both ran the distributed one
    _check_rows(result["families"]["amax"]["rows"], "amax")
    _check_rows(result["families"]["fused_collectives"]["rows"], "fused_collectives")
    assert stdout.count("wrote ") == 2, "bench.json and bench.md, by rank 0 only"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--case", "fused_collectives=rs:3x64:0:64"], "must be divisible by the 2 ranks"),
        (["--case", "fused_collectives=xx:64:0:32"], 'expected "ag|rs:DxDx..:dim:N[,N..][:PIECES]"'),
        (["--case", "fused_collectives=ag:64x128:0:32:-1"], "PIECES must be >= 0"),
        (["--case", "sweep=ag:64x128:0"], "sweep case 'ag:64x128:0': expected"),
        (["--case", "tp_block=2x64x200x256"], "must be positive and divisible by the 2 ranks"),
        (["--case", "tp_block=2x64x256x256:sp"], 'expected "BxSxDxF" or "BxSxDxF:plain"'),
        (["--case", "fp8_quantize=100x256"], "multiples of 128"),
        (["--case", "nosuch=1"], "expected NAME=SPEC with NAME one of fp8_quantize"),
        (["--only", "amax", "--case", "tp_block=2x64x256x256"], "--case given for tp_block, which --only leaves out"),
        (["--repeats", "1"], "--repeats must be at least 2"),
        (["--world", "0"], "--world must be >= 1"),
        (["--dtype", "float32", "--fp8", "mx"], "--fp8 selects the FP8 forms of fused_collectives"),
    ],
)
def test_bad_options_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        runner.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        runner.main(["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


def test_plot_of_a_rate_whose_quartile_equals_its_median(tmp_path):
    """A GB/s plot's error bar from q1 == median: rate * median / q1 falls 1 ulp below the rate for some values
    (58.803 GB/s, 4.4504 ms), and matplotlib refused the negative bar (a CI run of the tiny-sizes test failed so)."""
    pytest.importorskip("matplotlib")
    from fastmesh.bench import plots

    ms = {"median": 4.4504, "q1": 4.4504, "q3": 5.0, "min": 4.4504, "max": 5.0}
    row = {
        "case": "c",
        "dtype": "float32",
        "kernel": "k",
        "figures": {"k": {"kind": "kernel", "ms": ms, "rate": {"value": 58.803, "unit": "GB/s"}}},
    }
    assert 58.803 * ms["median"] / ms["q1"] < 58.803  # the rounding the plot must absorb
    assert (tmp_path / "demo.png").samefile(plots.plot_family("demo", [row], str(tmp_path), None))


def test_ratios_are_per_round_and_figures_must_be_positive():
    case = figures.Case(
        "demo",
        "c",
        "float32",
        "k",
        {
            "k": figures.Contender("kernel", [1.0, 2.0, 4.0], 8.0, "bytes"),
            "base": figures.Contender("baseline", [2.0, 2.0, 2.0]),
            "bound": figures.Contender("bound", [0.5, 1.0, 1.0]),
        },
    )
    row = case.row()
    # per round: base / k = 2, 1, 0.5 (median 1); the medians' ratio would be 2 / 2 = 1 too, but the spread differs
    assert row["ratios"]["speedup_vs_base"] == {"median": 1.0, "q1": 0.75, "q3": 1.5, "min": 0.5, "max": 2.0}
    assert row["ratios"]["k_over_bound"]["median"] == 2.0
    assert row["figures"]["k"]["rate"] == {"value": 8.0 / 2.0 / 1e9, "unit": "GB/s"}
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        broken = figures.Case("demo", "c", "float32", "k", {"k": figures.Contender("kernel", [1.0, bad])})
        with pytest.raises(ValueError, match="is not a positive finite number"):
            broken.row()


def _context(quick: bool, cases: list[str]) -> Context:
    emulated = {"bfloat16": "this CPU (AVX2) has no native bfloat16 matmul: 1.3 GFLOP/s"}
    return Context(
        family="tp_block",
        device=torch.device("cpu"),
        quick=quick,
        repeats=2,
        warmup=0,
        dtypes=("float32", "bfloat16", "float8"),
        cases=cases,
        clock=None,
        emulated=emulated,
        leader=False,
    )


def test_emulated_dtypes_are_left_out_of_quick_and_marked_elsewhere():
    matmul_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8": torch.bfloat16}
    quick = _context(quick=True, cases=[])
    assert quick.measured_dtypes(matmul_dtypes) == ["float32"]
    assert quick.notes == [
        "bfloat16 left out of --quick: this CPU (AVX2) has no native bfloat16 matmul: 1.3 GFLOP/s "
        "(run it with --only tp_block --dtype bfloat16)",
        "float8 left out of --quick: its cases multiply in bfloat16 too, and this CPU (AVX2) has no native "
        "bfloat16 matmul: 1.3 GFLOP/s (run it with --only tp_block --dtype float8)",
    ]
    # A float8 whose cases multiply in FP8 is not emulated.
    assert _context(quick=True, cases=[]).measured_dtypes({**matmul_dtypes, "float8": torch.float8_e4m3fn}) == [
        "float32",
        "float8",
    ]
    # Asked for by --case, or a full run: measured, each row's dtype marked in the tables.
    for ctx in (_context(quick=True, cases=["2x64x256x256"]), _context(quick=False, cases=[])):
        assert ctx.measured_dtypes(matmul_dtypes) == ["float32", "bfloat16", "float8"]
        for dtype in ("float32", "bfloat16"):
            ctx.emit(
                figures.Case(
                    "tp_block", "block", dtype, "fastmesh", {"fastmesh": figures.Contender("kernel", [1.0, 1.1])}
                )
            )
        float32_row, bfloat16_row = ctx.rows
        assert dtype_text(float32_row) == "float32" and "emulated" not in float32_row
        assert dtype_text(bfloat16_row) == "bfloat16 (emulated)"
        assert bfloat16_row["emulated"] == "this CPU (AVX2) has no native bfloat16 matmul: 1.3 GFLOP/s"
        assert "bfloat16 (emulated)" in report.markdown("tp_block", ctx.rows)

"""``fastmesh tune`` on 2 CPU ranks: it measures every fused call of a Llama block's forward and backward into the
plan cache, reports a second run's keys as cached without measuring them, and ``--force`` measures again.

Correctness of the tool, not of the plans: which plan wins on this machine is not asserted, only that each
entry's plan is the one its own figures choose (the planner's rule, ``fastmesh.ops.plans.measure``).
"""

import json
import subprocess
import sys

import pytest

from fastmesh import tune
from fastmesh.ops import plans

BLOCK = [
    "--world",
    "2",
    "--threads",
    "1",
    "--dim",
    "64",
    "--hidden",
    "128",
    "--tokens",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "4",
    "--dtype",
    "float32",
]
CASE = "ag:8x64:0:48"
_AG, _RS = "fastmesh::all_gather_matmul", "fastmesh::matmul_reduce_scatter"
# The block's calls on 2 ranks (x [1, 16, 64] per rank; q = k = v = 64 columns, 32 per rank; hidden 64 per rank):
# forward wq/wk/wv, wo, w1/w3, w2, then backward each one's gradient through the other op.
BLOCK_CALLS = {
    (_AG, "a=[1, 16, 64]|ns=[32, 32, 32]"),  # forward: wq, wk, wv
    (_RS, "a=[1, 32, 32]|n=64"),  # forward: wo; backward of w1/w3 has the same key only when hidden = q
    (_AG, "a=[1, 16, 64]|ns=[64, 64]"),  # forward: w1, w3
    (_RS, "a=[1, 32, 64]|n=64"),  # forward: w2
    (_AG, "a=[1, 16, 64]|ns=[64]"),  # backward of w2: grad [1, 16, 64] @ w2 (shard [64, 64])
    (_RS, "a=[1, 32, 128]|n=64"),  # backward of w1/w3: cat(G1, G3) [1, 32, 128] @ cat(w1, w3).T
    (_AG, "a=[1, 16, 64]|ns=[32]"),  # backward of wo
    (_RS, "a=[1, 32, 96]|n=64"),  # backward of wq/wk/wv: cat(Gq, Gk, Gv) [1, 32, 96]
}


def _tune(*args):
    result = subprocess.run(
        [sys.executable, "-m", "fastmesh", "tune", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"fastmesh tune failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result.stdout


def _plans(path):
    with open(path) as f:
        (section,) = json.load(f)["machines"].values()
    return section["plans"]


def _block_key(key):
    op, _backend, _device, *fields = key.split("|")
    named = dict(field.split("=", 1) for field in fields)
    columns = f"ns={named['ns']}" if "ns" in named else f"n={named['n']}"
    return op, f"a={named['a']}|{columns}"


def _check_entry(entry):
    """A measured entry: its plan is one of the candidates it was measured against, each with a positive time.
    (Which one wins is judged by per-round ratios to the unfused plan, not kept in the entry.)"""
    figures = entry["ms"]
    chosen = plans.Plan(entry["split"], entry["pieces"]).label
    assert chosen in figures, (chosen, figures)
    assert plans.UNFUSED.label in figures or entry["split"] == "rows", figures
    assert all(ms > 0 for ms in figures.values()), figures


def _table_rows(stdout):
    """(source, call) of each table row."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("called in"))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_tune_block_measures_then_reports_cached(tmp_path):
    cache = tmp_path / "plans.json"
    first = _tune(*BLOCK, "--cache", str(cache))
    measured = _plans(cache)
    assert {_block_key(key) for key in measured} == BLOCK_CALLS
    for entry in measured.values():
        _check_entry(entry)
    rows = _table_rows(first)
    assert len(rows) == len(BLOCK_CALLS) and all(" measured " in row for row in rows), first
    assert [row.split()[0] for row in rows] == ["forward"] * 4 + ["backward"] * 4
    assert f"8 plan(s) measured and written to {cache}" in first

    # Again with a case: the block's keys come from the cache (their entries untouched), the case is measured.
    second = _tune(*BLOCK, "--case", CASE, "--cache", str(cache))
    rows = _table_rows(second)
    assert [" cached " in row for row in rows] == [True] * 8 + [False], second
    assert rows[-1].startswith("case 1 ") and " measured " in rows[-1]
    after = _plans(cache)
    assert {key: after[key] for key in measured} == measured
    (case_key,) = set(after) - set(measured)
    assert case_key.startswith(f"{_AG}|gloo|cpu|a=[8, 64]|ns=[48]|dim=0|")

    # --force measures the cached key again and replaces its entry.
    forced = _tune(
        "--world", "2", "--threads", "1", "--dtype", "float32", "--case", CASE, "--cache", str(cache), "--force"
    )
    rows = _table_rows(forced)
    assert len(rows) == 1 and " measured " in rows[0], forced
    replaced = _plans(cache)
    assert set(replaced) == set(after)
    _check_entry(replaced[case_key])
    assert replaced[case_key]["ms"] != after[case_key]["ms"]  # fresh timings (never equal to the microsecond)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dim", "64"], "--dim describe a block, which needs --tokens"),
        (["--tokens", "33"], "--tokens 33 must be divisible by --world 2"),
        (["--tokens", "32", "--heads", "6"], "--dim 64 must be divisible by --heads 6"),
        (["--tokens", "32", "--heads", "8", "--kv-heads", "3"], "--kv-heads 3 must be divisible by --world 2"),
        (["--tokens", "32", "--hidden", "0"], "--hidden must be >= 1, got 0"),
        (["--case", "rs:3x64:0:64"], "must be divisible by the 2 ranks"),
        (["--case", "rs:64x32:0:-16"], "every N must be >= 1, got -16"),
        (["--tokens", "16", "--fp8", "mx"], "(forward and FP8 backward), but --hidden / --world = 48: pick sizes"),
        (["--case", "ag:64x64:0:32:4"], "a piece count (:4) fixes the plan"),
        (["--case", "ag:64x64:-1:32", "--fp8", "rowwise"], "the FP8 form gathers rows"),
        (["--world", "1", "--tokens", "32"], "--world must be >= 2"),
        (["--threads", "0", "--tokens", "32"], "--threads must be >= 1, got 0"),
        ([], "nothing to tune"),
        (["--fp8", "mx"], "nothing to tune"),  # every granularity the fused ops take passes the parser
        (["--fp8", "block128x128"], "invalid choice: 'block128x128'"),
    ],
)
def test_bad_options_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

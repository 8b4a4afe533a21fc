"""When a rank fails (docs/faults.md): a peer that exits or stalls makes the survivors' fused ops raise, at once
or at the group's timeout, with an error naming the op, the group, the peer and the piece, the backend's
error kept as the cause.

The ranks are fresh processes (tests/fault_ranks.py), not the shared pool: one of them dies. One launch per
scenario loops over the ops, each on a group of its own.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
TIMEOUT = 5.0  # the ops' groups' timeout, in seconds

# The C++ op each front runs, as the error names it, and whether its pieces travel point-to-point on gloo.
OPS = {
    "all_gather_matmul": ("fastmesh::all_gather_matmul", True),
    "matmul_reduce_scatter": ("fastmesh::matmul_reduce_scatter", True),
    "matmul_all_reduce": ("fastmesh::matmul_all_reduce", False),
    "matmul_all_gather": ("fastmesh::matmul_all_gather", True),
    "all_gather_matmul_fp8": ("fastmesh::all_gather_scaled_matmul", True),
}


def _launch(tmp_path, scenario: str, world: int, ops: list[str], limit: float) -> list[dict]:
    """Runs the scenario on `world` fresh ranks; returns what the survivors (every rank but the last) saw."""
    env = {var: value for var, value in os.environ.items() if var not in LAUNCHER_VARS}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)  # DETAIL would check shapes on every call, before the pipeline
    env["PYTHONPATH"] = os.pathsep.join([REPO_DIR, TESTS_DIR, env.get("PYTHONPATH", "")])
    store = str(tmp_path / "store")
    procs = []
    with contextlib.ExitStack() as logs:
        try:
            for rank in range(world):
                log = logs.enter_context(open(tmp_path / f"rank{rank}.log", "w"))
                command = [sys.executable, os.path.join(TESTS_DIR, "fault_ranks.py"), scenario, str(rank), str(world)]
                command += [str(TIMEOUT), store, str(tmp_path / f"rank{rank}.json"), *ops]
                procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + limit
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {scenario} scenario did not end within {limit} s:\n{_logs(tmp_path, world)}")
        finally:  # nothing outlives the test, whatever failed
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    results = []
    for rank in range(world - 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results:\n{_logs(tmp_path, world)}"
        results += json.loads(path.read_text())
    return results


def _logs(tmp_path, world: int) -> str:
    return "\n".join(f"--- rank {r}:\n{(tmp_path / f'rank{r}.log').read_text()}" for r in range(world))


def _check_message(result: dict, world: int, peer: int, cause: str):
    op, p2p = OPS[result["op"]]
    assert "classes" in result, f"{result['op']} on rank {result['rank']} did not raise"
    # A DistBackendError: a RuntimeError in Python, as torch's own failed collectives.
    assert result["classes"][:2] == ["DistBackendError", "DistError"], result
    assert "RuntimeError" in result["classes"], result
    message = result["message"]
    assert message.startswith(f"{op}: the transfer of piece 1 of "), message
    assert re.search(r"piece 1 of [1-9]\d* failed on rank \d+ of group ", message), message
    assert f'of group "{result["group"]}" ({world} ranks)' in message, message
    if p2p:
        assert re.search(rf"the (send to|receive from) rank {peer} did not complete", message), message
    else:
        assert f"a collective of the group's {world} ranks" in message, message
    assert "docs/faults.md" in message, message
    # The backend's own error, kept in the text.
    assert re.search(rf"\nCaused by the backend's error: .*{cause}", message, re.S), message


def test_a_peer_that_exits_fails_the_survivor_at_once(tmp_path):
    results = _launch(tmp_path, "exit", 2, list(OPS), limit=90)
    assert [r["op"] for r in results] == list(OPS)
    for result in results:
        _check_message(result, world=2, peer=1, cause="Connection (reset|closed) by peer")
        assert result["seconds"] < 3, result


def test_a_peer_that_stalls_fails_the_survivor_at_the_timeout(tmp_path):
    results = _launch(tmp_path, "stall", 2, list(OPS), limit=90 + len(OPS) * TIMEOUT)
    assert [r["op"] for r in results] == list(OPS)
    for result in results:
        _check_message(result, world=2, peer=1, cause="(Timed out|timeout)")
        assert TIMEOUT - 1 < result["seconds"] < TIMEOUT + 20, result


def test_a_peer_that_exits_fails_every_survivor_of_three(tmp_path):
    # Ranks 0 and 1 survive rank 2: each names rank 2, whichever of its transfers with it failed first.
    ops = ["all_gather_matmul", "matmul_reduce_scatter"]
    results = _launch(tmp_path, "exit", 3, ops, limit=90)
    assert [(r["rank"], r["op"]) for r in results] == [(rank, op) for rank in (0, 1) for op in ops]
    for result in results:
        _check_message(result, world=3, peer=2, cause="Connection (reset|closed) by peer")
        assert result["seconds"] < 3, result

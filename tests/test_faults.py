"""When a rank fails (docs/faults.md): a peer that exits, stalls or raises, before or inside a fused op's call, in
its forward or backward, or part-way through a fused TP training step, makes every surviving rank raise, at once
or at the group's timeout, with an error naming the op, the group, the peer and the piece, the backend's error
kept in the text. Ranks of another group of a 2-D mesh are not disturbed.

The ranks are fresh processes (tests/fault_ranks.py), not the shared pool: one of them dies. One launch per
scenario runs many cases, each on groups of its own. The pool itself recovers from a rank that raises inside an op
(the last test).
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from rank_pool import PACKAGE_ROOT, RankFailure, get_pool

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
TIMEOUT = 2.0  # the cases' groups' timeout, in seconds: far above what a healthy call of these sizes takes
AT_ONCE = 3.0  # a survivor of a peer that exited fails within this (measured: milliseconds)

# The C++ op a case's failing call runs, as the error names it, and whether its pieces travel point-to-point on
# gloo (else by the group's collectives). A backward runs the other op of the pair.
FAILING_OP = {
    "all_gather_matmul": ("fastmesh::all_gather_matmul", True),
    "matmul_reduce_scatter": ("fastmesh::matmul_reduce_scatter", True),
    "matmul_all_reduce": ("fastmesh::matmul_all_reduce", False),
    "matmul_all_gather": ("fastmesh::matmul_all_gather", True),
    "all_gather_matmul/fp8": ("fastmesh::all_gather_scaled_matmul", True),
    "matmul_reduce_scatter/fp8": ("fastmesh::scaled_matmul_reduce_scatter", True),
    "matmul_all_reduce/fp8": ("fastmesh::scaled_matmul_all_reduce", False),
    "all_gather_matmul/bwd": ("fastmesh::matmul_reduce_scatter", True),
    "matmul_reduce_scatter/bwd": ("fastmesh::all_gather_matmul", True),
    "all_gather_matmul/fp8/bwd": ("fastmesh::scaled_matmul_reduce_scatter", True),
    "matmul_reduce_scatter/fp8/bwd": ("fastmesh::all_gather_scaled_matmul", True),
    "all_gather_matmul/plan": ("fastmesh::all_gather_matmul", False),
    "matmul_all_reduce/plan": ("fastmesh::matmul_all_reduce", False),
}
EXITED = "Connection (reset|closed) by peer"
TIMED_OUT = "(Timed out|timeout)"


def _launch(tmp_path, fault: str, world: int, cases: list[str], mesh: str = "1d") -> dict[int, list[dict]]:
    """Runs the cases on ``world`` fresh ranks whose last rank fails with ``fault``; returns what each rank that
    lived to write saw, by rank."""
    failing = world - 1
    config = {
        "world": world,
        "timeout": TIMEOUT,
        "mesh": mesh,
        "fault": fault,
        "cases": cases,
        "failing_rank": failing,
        "store": str(tmp_path / "store"),
        "out": str(tmp_path),
    }
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    env = {var: value for var, value in os.environ.items() if var not in LAUNCHER_VARS}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)  # DETAIL would check shapes on every call, before the pipeline
    env.pop("FASTMESH_SHAPE_CHECK", None)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, TESTS_DIR, env.get("PYTHONPATH", "")])
    # Starting the ranks takes seconds each on a busy machine, then every case may take the timeout.
    limit = 60 + 10 * world + len(cases) * (TIMEOUT + 5)
    procs = []
    with contextlib.ExitStack() as logs:
        try:
            for rank in range(world):
                log = logs.enter_context(open(tmp_path / f"rank{rank}.log", "w"))
                command = [sys.executable, os.path.join(TESTS_DIR, "fault_ranks.py"), str(config_path), str(rank)]
                procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + limit
            # The failing rank may be stuck for good (a stall): the survivors' exits end the launch.
            for proc in procs[:failing]:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {fault} launch did not end within {limit:.0f} s:\n{_logs(tmp_path, world)}")
        finally:  # nothing outlives the test, whatever failed
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    results = {}
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    for rank in range(failing):
        assert rank in results, f"rank {rank} wrote no results:\n{_logs(tmp_path, world)}"
        assert [r["case"] for r in results[rank]] == cases, (results[rank], _logs(tmp_path, world))
    return results


def _logs(tmp_path, world: int) -> str:
    return "\n".join(f"--- rank {r}:\n{(tmp_path / f'rank{r}.log').read_text()}" for r in range(world))


def _check_fastmesh_error(result: dict, group_size: int, peer: int, cause: str, first_call: bool = False):
    """A survivor's fused op raised fastmesh's error for a failed transfer with ``peer`` (a rank of its group).
    ``first_call``: the op had not run on the group yet, so its cross-rank shape check is what failed (a backward
    whose op the healthy forward did not call, with its peer already gone)."""
    op, p2p = FAILING_OP[result["case"]]
    assert not result["ok"], f"{result['case']} on rank {result['rank']} did not raise"
    # A DistBackendError: a RuntimeError in Python, as torch's own failed collectives.
    assert result["classes"][:2] == ["DistBackendError", "DistError"], result
    assert "RuntimeError" in result["classes"], result
    message = result["message"]
    if result["case"].endswith("/plan"):  # a new shape: the ranks' plan agreement, an all-reduce, goes first
        what = r"the ranks' plan agreement \(before the pieces\)"
    elif first_call:
        what, p2p = r"the cross-rank shape check \(before the pieces\)", False  # an all-gather of the group
    else:
        what = r"(piece [1-9]\d* of [1-9]\d*|a_scale \(gathered before the pieces\))"
    assert re.match(rf"{re.escape(op)}: the transfer of {what} failed on rank \d+ of group ", message), message
    assert f'of group "{result["group"]}" ({group_size} ranks)' in message, message
    if p2p:
        assert re.search(rf"the (send to|receive from) rank {peer} did not complete", message), message
    else:
        assert f"a collective of the group's {group_size} ranks" in message, message
    assert "docs/faults.md" in message, message
    # The backend's own error, kept in the text.
    assert re.search(rf"\nCaused by the backend's error: .*{cause}", message, re.S), message


def _check_at_once(result: dict):
    assert result["seconds"] < AT_ONCE, result


def _check_at_timeout(result: dict):
    assert TIMEOUT - 0.5 < result["seconds"] < TIMEOUT + 20, result


ALL_OP_CASES = list(FAILING_OP)


def test_a_peer_that_exits_fails_the_survivor_at_once(tmp_path):
    # The first case's peer exits inside its call (after its first piece started); every later case then runs
    # without it, before the call: forward and backward of every op, bf16 and FP8.
    results = _launch(tmp_path, "exit", 2, ALL_OP_CASES)
    for i, result in enumerate(results[0]):
        first_call = i > 0 and result["case"].endswith("/bwd")
        _check_fastmesh_error(result, group_size=2, peer=1, cause=EXITED, first_call=first_call)
        _check_at_once(result)


def test_a_peer_that_exits_before_the_call_fails_the_survivor_at_once(tmp_path):
    cases = ["matmul_all_reduce", "all_gather_matmul/fp8", "matmul_reduce_scatter/fp8/bwd", "all_gather_matmul/plan"]
    results = _launch(tmp_path, "exit_before", 2, cases)
    for result in results[0]:
        _check_fastmesh_error(result, group_size=2, peer=1, cause=EXITED, first_call=result["case"].endswith("/bwd"))
        _check_at_once(result)


def test_a_peer_that_stalls_fails_the_survivor_at_the_timeout(tmp_path):
    # The first case's peer stalls inside its call; the others it never calls.
    cases = ["matmul_reduce_scatter", "all_gather_matmul", "matmul_all_reduce", "matmul_all_gather"]
    cases += ["matmul_all_reduce/fp8"]
    results = _launch(tmp_path, "stall", 2, cases)
    for result in results[0]:
        _check_fastmesh_error(result, group_size=2, peer=1, cause=TIMED_OUT)
        _check_at_timeout(result)


def test_a_peer_that_exits_fails_every_survivor_of_three(tmp_path):
    # Ranks 0 and 1 survive rank 2, which exits inside a backward: each names rank 2, whichever of its transfers
    # with it failed first.
    cases = ["matmul_reduce_scatter/bwd", "all_gather_matmul", "matmul_all_gather"]
    results = _launch(tmp_path, "exit", 3, cases)
    for rank in (0, 1):
        for result in results[rank]:
            _check_fastmesh_error(result, group_size=3, peer=2, cause=EXITED)
            _check_at_once(result)


def test_a_peer_that_raises_inside_the_op_on_a_2d_mesh(tmp_path):
    # A 2 x 2 (dp, tp) mesh whose rank 3 raises inside each op (after its first piece started): it sees the error,
    # its tp peer (rank 2) times out waiting for the pieces it never sends, and the other tp group (ranks 0, 1)
    # runs its ops as if nothing happened.
    cases = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_gather"]
    cases += ["all_gather_matmul/fp8/bwd", "matmul_reduce_scatter/fp8"]
    results = _launch(tmp_path, "raise", 4, cases, mesh="2x2")
    for result in results[3]:
        op, _ = FAILING_OP[result["case"]]
        assert not result["ok"] and "RuntimeError" in result["classes"], result
        assert re.match(
            rf"{re.escape(op)}: injected fault \(fastmesh._C.inject_fault\) after starting piece 1 on "
            rf"rank 1 of group \"{re.escape(result['group'])}\"",
            result["message"],
        ), result
    for result in results[2]:
        _check_fastmesh_error(result, group_size=2, peer=1, cause=TIMED_OUT)
        _check_at_timeout(result)
    for rank in (0, 1):
        assert all(r["ok"] for r in results[rank]), results[rank]


def test_a_rank_that_exits_mid_step_fails_every_survivor_of_a_2d_mesh(tmp_path):
    # A fused TP training step on a 2 x 2 (dp, tp) mesh; rank 3 exits inside the step's fourth piece. Its tp peer
    # fails in a fused op and then exits (as a process whose step raised); ranks 0 and 1, in the other tp group,
    # fail in the dp all-reduce of their gradients, with the dp peer that is gone. Nobody waits for the timeout.
    results = _launch(tmp_path, "exit", 4, ["block"], mesh="2x2")
    for rank in (0, 1, 2):
        (result,) = results[rank]
        # torch's gloo collectives raise a plain RuntimeError; fastmesh's ops a DistBackendError (one).
        assert not result["ok"] and "RuntimeError" in result["classes"], result
        assert re.search(EXITED, result["message"]), result
        _check_at_once(result)
    tp_peer = results[2][0]
    assert tp_peer["classes"][0] == "DistBackendError", tp_peer
    assert re.match(r"fastmesh::\w+: the transfer of piece \d+ of \d+ failed on rank 0 ", tp_peer["message"]), tp_peer


def _raise_inside_an_op(group_ranks: list[int]):
    import datetime

    import fastmesh

    group = dist.new_group(group_ranks, timeout=datetime.timedelta(seconds=TIMEOUT))
    if dist.get_rank() not in group_ranks:
        return "not in the group"
    if dist.get_rank() == group_ranks[-1]:
        fastmesh._cpp_lib.load().inject_fault(0, "raise")
    a = torch.ones(8, 4)
    fastmesh.matmul_reduce_scatter(a, torch.ones(4, 2), 0, group=group, pieces=4)


def _all_reduce_world():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_the_rank_pool_recovers_from_a_rank_that_raises_inside_an_op():
    # One rank raises inside an op, its peer times out: the run fails naming both, with both errors.
    pool = get_pool(2)
    with pytest.raises(RankFailure, match=r"failed on rank\(s\) \[0, 1\]") as failure:
        pool.run(_raise_inside_an_op, {"group_ranks": [0, 1]}, timeout=60)
    assert "injected fault" in str(failure.value) and "did not complete" in str(failure.value)
    # A gloo group whose transfer timed out may still hold its receive buffers' registrations (torch: a failed
    # group is not to be used again), so these processes are not reused: the pool starts afresh, and works.
    pool.close()
    assert get_pool(2).run(_all_reduce_world, timeout=60) == [2.0, 2.0]

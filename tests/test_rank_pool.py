"""Tests of the rank-pool harness itself, through its API: each would fail if the harness
hid a rank's result, its error, or a hang."""

import os

import pytest
import torch
import torch.distributed as dist
from rank_pool import RankFailure, RankPool, RankTimeout, get_pool, on_ranks


def _sum_of_ranks():
    rank = torch.tensor([dist.get_rank()])
    dist.all_reduce(rank)
    return dist.get_rank(), dist.get_world_size(), rank.item()


def _pid():
    return os.getpid()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError(f"boom from rank {dist.get_rank()}")


def _raise_on_rank_1_while_rank_0_waits():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up before the barrier")
    dist.barrier()


def _block_rank_1_in_barrier():
    if dist.get_rank() == 1:
        dist.barrier()  # rank 0 never enters it


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)


def _print_rank(marker):
    print(f"{marker} on rank {dist.get_rank()}")


def _inductor_cache_dir():
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _print_then_raise():
    print("output before the failure")
    raise RuntimeError("after printing")


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_from_every_rank(world_size):
    results = get_pool(world_size).run(_sum_of_ranks)
    total = sum(range(world_size))
    assert results == [(rank, world_size, total) for rank in range(world_size)]


def test_pool_is_reused():
    pool = get_pool(2)
    first = pool.run(_pid)
    assert pool.run(_pid) == first == pool.pids
    assert get_pool(2) is pool
    assert os.getpid() not in first and len(set(first)) == 2


def test_kwargs_reach_ranks():
    assert get_pool(2).run(pow, {"base": 3, "exp": 2}) == [9, 9]


def test_rank_exception_fails_with_its_traceback():
    pool = get_pool(2)
    pids = pool.run(_pid)
    with pytest.raises(RankFailure) as failure:
        pool.run(_raise_on_rank_1)
    message = str(failure.value)
    assert "_raise_on_rank_1 failed on rank(s) [1] of 2" in message
    assert "===== rank 0: ok" in message
    assert "===== rank 1: failed\nTraceback (most recent call last):" in message
    assert 'in _raise_on_rank_1\n    raise ValueError(f"boom from rank {dist.get_rank()}")' in message
    assert "ValueError: boom from rank 1" in message
    assert not isinstance(failure.value, RankTimeout)
    assert pool.run(_pid) == pids  # every rank finished, so the pool was kept


def test_failure_while_other_ranks_wait_restarts_pool():
    pool = get_pool(2)
    pids = pool.run(_pid)
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] were still busy") as failure:
        pool.run(_raise_on_rank_1_while_rank_0_waits)
    message = str(failure.value)
    assert "ValueError: rank 1 gives up before the barrier" in message
    assert "===== rank 0: did not finish" in message
    assert "in _raise_on_rank_1_while_rank_0_waits" in message.split("===== rank 1")[0]  # rank 0's stack
    new_pids = pool.run(_pid)
    assert set(new_pids).isdisjoint(pids)


def test_timeout_kills_stuck_ranks_and_next_run_gets_fresh_pool():
    pool = get_pool(2)
    pids = pool.run(_pid)
    with pytest.raises(RankTimeout, match=r"timed out after 3 s on rank\(s\) \[1\] of 2") as failure:
        pool.run(_block_rank_1_in_barrier, timeout=3)
    message = str(failure.value)
    assert "===== rank 0: ok" in message
    assert "===== rank 1: did not finish" in message
    assert "in _block_rank_1_in_barrier" in message  # the stuck rank's stack at the kill
    assert not any(_alive(pid) for pid in pids)
    new_pids = pool.run(_pid)
    assert set(new_pids).isdisjoint(pids)
    assert pool.run(_sum_of_ranks) == [(0, 2, 1), (1, 2, 1)]


def test_dead_rank_fails_and_pool_restarts():
    pool = get_pool(2)
    pids = pool.run(_pid)
    with pytest.raises(RankFailure, match=r"===== rank 1: failed\nits process exited with code 3"):
        pool.run(_exit_on_rank_1)
    assert set(pool.run(_pid)).isdisjoint(pids)


def test_rank_output_is_echoed(capsys):
    get_pool(2).run(_print_rank, {"marker": "hello"})
    out = capsys.readouterr().out
    assert "----- rank 0 output -----\nhello on rank 0\n" in out
    assert "----- rank 1 output -----\nhello on rank 1\n" in out


def test_rank_output_is_quoted_in_failure():
    with pytest.raises(RankFailure) as failure:
        get_pool(2).run(_print_then_raise)
    assert "----- rank 1 output -----\noutput before the failure" in str(failure.value)


def test_local_function_is_refused_before_reaching_ranks():
    def local():
        pass

    with pytest.raises(ValueError, match="define it at module level"):
        get_pool(2).run(local)


def test_ranks_inherit_the_runs_fresh_inductor_cache():
    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert os.path.basename(cache_dir).startswith("fastmesh-inductor-")
    assert get_pool(2).run(_inductor_cache_dir) == [cache_dir, cache_dir]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the error on a machine without 2 GPUs")
def test_nccl_pool_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setenv("FASTMESH_TEST_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match=r"FASTMESH_TEST_BACKEND=nccl needs a GPU per rank: 2 ranks, [01] GPUs"):
        RankPool(2).run(_pid)


@on_ranks(2, 4)
def test_on_ranks_runs_body_on_every_rank(world_size):
    assert dist.get_world_size() == world_size
    assert os.environ["RANK"] == str(dist.get_rank())
    assert torch.get_num_threads() == 1
    total = torch.tensor([1])
    dist.all_reduce(total)
    assert total.item() == world_size


@pytest.mark.parametrize("value", [3, 5])
@on_ranks(2)
def test_on_ranks_passes_parametrize_arguments(value, tmp_path):
    assert value in (3, 5)
    assert tmp_path.exists()  # fixtures are made in the test process and pickled to the ranks


def test_on_ranks_failure_fails_the_test_with_rewritten_assert():
    with pytest.raises(RankFailure, match=r"failed on rank\(s\) \[1\] of 2") as failure:
        _failing_on_ranks(world_size=2)
    assert "AssertionError: assert 1 == 0\n +  where 1 = <function get_rank" in str(failure.value)


@on_ranks(2)
def _failing_on_ranks():
    assert dist.get_rank() == 0


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

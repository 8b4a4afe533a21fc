"""One rank of tests/test_faults.py, a fresh process that may die:
``python fault_ranks.py SCENARIO RANK WORLD TIMEOUT STORE_PATH OUT_PATH [OP ...]``.

Every rank makes one group per op (``dist.new_group(timeout=TIMEOUT)``) and runs the op once on it while
every rank is alive, so that the first call's cross-rank shape check is behind it. Then the last rank fails:

- ``exit``: it exits, right before the others call each op again on its group;
- ``stall``: it stays alive but never calls, as a rank stuck in its own work would.

The others time each op's call and write what they saw (op, group, seconds until the error, the exception's
classes and message) to OUT_PATH as JSON. The group of an op is used only for that op: a group whose peer
failed is not used again.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import fastmesh
from fastmesh.fp8 import Float8Config


def _operands(rank: int):
    torch.manual_seed(rank)
    a = torch.randint(-4, 5, (12, 16)).float()  # rows divisible by 2 and 3 ranks
    b = torch.randint(-4, 5, (16, 8)).float()
    return a, b


# Each op's forward on `group`, with two pieces (pieces= given: no plan exchange between the ranks).
OPS = {
    "all_gather_matmul": lambda a, b, g: fastmesh.all_gather_matmul(a, [b], 0, group=g, pieces=2),
    "matmul_reduce_scatter": lambda a, b, g: fastmesh.matmul_reduce_scatter(a, b, 0, group=g, pieces=2),
    "matmul_all_reduce": lambda a, b, g: fastmesh.matmul_all_reduce(a, b, group=g, pieces=2),
    "matmul_all_gather": lambda a, b, g: fastmesh.matmul_all_gather(a, b, group=g, pieces=2),
    "all_gather_matmul_fp8": lambda a, b, g: fastmesh.all_gather_matmul(
        a, [b], 0, group=g, pieces=2, fp8=Float8Config()
    ),
}


def main(scenario: str, rank: int, world: int, timeout: float, store_path: str, out_path: str, ops: list[str]):
    store = dist.FileStore(store_path, world)
    # The default group only sets up and synchronizes (ranks start seconds apart on a busy machine): a long
    # timeout. The ops' groups have the short one under test.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    groups = {name: dist.new_group(timeout=datetime.timedelta(seconds=timeout)) for name in ops}
    a, b = _operands(rank)
    for name in ops:
        OPS[name](a, b, groups[name])
    dist.barrier()

    failing = rank == world - 1
    if failing and scenario == "exit":
        store.set("exiting", "1")
        os._exit(0)  # no clean-up: as a crash, the process's sockets close with it
    if failing:  # stall: alive, but never calls again, until the others are done
        store.wait([f"done {r}" for r in range(world - 1)], datetime.timedelta(seconds=300))
        os._exit(0)
    if scenario == "exit":
        store.wait(["exiting"])
        time.sleep(0.5)  # the peer is gone (os._exit takes milliseconds)
    results = []
    for name in ops:
        start = time.monotonic()
        record = {"op": name, "group": groups[name].group_name, "rank": rank}
        try:
            OPS[name](a, b, groups[name])
        except Exception as error:  # what the survivor sees is the result
            record.update(
                classes=[cls.__name__ for cls in type(error).__mro__],
                message=str(error),
                cause=repr(error.__cause__),
            )
        record["seconds"] = time.monotonic() - start
        results.append(record)
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(out_path + ".tmp", out_path)
    store.set(f"done {rank}", "1")
    os._exit(0)  # destroy_process_group could wait on the failed peer


if __name__ == "__main__":
    scenario, rank, world, timeout, store_path, out_path, *ops = sys.argv[1:]
    main(scenario, int(rank), int(world), float(timeout), store_path, out_path, ops or list(OPS))

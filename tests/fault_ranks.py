"""One rank of tests/test_faults.py, a fresh process that may die: ``python fault_ranks.py CONFIG RANK``.

CONFIG is a JSON file the test writes: ``world``, ``timeout`` (seconds, of every group the cases use), ``mesh``,
``fault``, ``cases``, ``failing_rank``, ``store`` and ``out`` (where each rank writes what it saw, as JSON).

Each case runs on groups of its own, made up front: ``mesh`` ``"1d"``, a new group of every rank; ``"2x2"``, the
tp group of a new ``fastmesh.init_mesh(dp=2, tp=2, timeout=...)`` (the failing rank's tp group is then half of
the world). A case (:data:`CASES`) is one fused op's forward or backward (bf16 small integers, or FP8), or
``"block"``: a training step of a Llama block under the fused TP plan, its gradients then all-reduced over dp.

The fault, of the failing rank:

- ``exit_before`` / ``stall_before``: every case runs once while every rank is alive (a backward case keeps its
  forward's graph), then the failing rank exits (as a crash) / stays alive but never calls again, and the others
  run each case again (the backward cases: the backward of that healthy forward);
- ``exit`` / ``raise`` / ``stall``: the failing rank arms ``fastmesh._C.inject_fault`` right before its call of
  each case (the op, or the backward; for ``block`` the step), so that it fails inside the op once its first
  pipeline piece has started (``block``: its fourth). ``raise``: it records the op's error and goes on with the
  next case once every rank is done with this one; ``exit`` and ``stall`` fail the first case, and the others
  then fail every later case without it.

A rank that saw an error in ``block`` exits right after recording it, as a process whose step raised would: its
dp peers must then fail too.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import fastmesh
from fastmesh.fp8 import Float8Config
from fastmesh.testing.llama import Llama, LlamaArgs, parallelize_llama

PIECES = 4  # every piece after the first is one the failing rank never sends (inject_fault strikes at the first)
FP8 = Float8Config()


def _ints(shape, seed, requires_grad):
    t = torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return t.requires_grad_(requires_grad)


def _operands(rank: int, backward: bool, rows: int = 24):
    # 24 rows: divisible by 2, 3 and 4 ranks, 4 pieces of whole rows for every op.
    return _ints((rows, 16), 10 + rank, backward), _ints((16, 8), 20 + rank, backward)


def _all_gather_matmul(a, b, group, fp8, pieces=PIECES):
    return fastmesh.all_gather_matmul(a, [b], 0, group=group, pieces=pieces, fp8=fp8)[1][0]


def _matmul_reduce_scatter(a, b, group, fp8, pieces=PIECES):
    return fastmesh.matmul_reduce_scatter(a, b, 0, group=group, pieces=pieces, fp8=fp8)


def _matmul_all_reduce(a, b, group, fp8, pieces=PIECES):
    return fastmesh.matmul_all_reduce(a, b, group=group, pieces=pieces, fp8=fp8)


def _matmul_all_gather(a, b, group, fp8, pieces=PIECES):
    assert fp8 is None, "matmul_all_gather has no FP8 form"
    return fastmesh.matmul_all_gather(a, b, group=group, pieces=pieces)


# "op[/fp8][/bwd]": the op's forward, or its backward (ops whose backward communicates), bf16 or FP8; "op/plan": its
# forward on a shape the healthy call did not have, planned (no pieces=): the ranks' plan agreement travels first.
OPS = {
    "all_gather_matmul": _all_gather_matmul,
    "matmul_reduce_scatter": _matmul_reduce_scatter,
    "matmul_all_reduce": _matmul_all_reduce,
    "matmul_all_gather": _matmul_all_gather,
}
CASES = [
    *OPS,
    *(f"{op}/fp8" for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")),
    *(f"{op}/bwd" for op in ("all_gather_matmul", "matmul_reduce_scatter")),
    *(f"{op}/fp8/bwd" for op in ("all_gather_matmul", "matmul_reduce_scatter")),
    *(f"{op}/plan" for op in ("all_gather_matmul", "matmul_all_reduce")),
    "block",
]


class OpCase:
    """A fused op's forward, or its backward (of a forward made while every rank was alive)."""

    def __init__(self, name: str, rank: int, group):
        op, *flags = name.split("/")
        self.fn, self.fp8, self.backward = OPS[op], FP8 if "fp8" in flags else None, "bwd" in flags
        self.planned = "plan" in flags
        self.rank, self.group, self.out = rank, group, None

    def prepare(self):
        """A healthy call while every rank is alive (the first call's shape check and plan are then behind): the
        forward, kept for the backward of a backward case."""
        out = self.fn(*_operands(self.rank, self.backward), self.group, self.fp8)
        self.out = out if self.backward else None

    def run(self):
        if self.backward:
            self.out.float().sum().backward()
        elif self.planned:
            self.fn(*_operands(self.rank, False, rows=48), self.group, self.fp8, pieces=None)
        else:
            self.fn(*_operands(self.rank, False), self.group, self.fp8)


class BlockCase:
    """One training step of a one-layer Llama under the fused TP plan on the tp axis of a (dp, tp) mesh; the
    gradients are then all-reduced over dp (data parallelism)."""

    ARGS = LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64)

    def __init__(self, mesh):
        torch.manual_seed(0)
        self.model = parallelize_llama(Llama(self.ARGS), mesh["tp"], "fastmesh", pieces=PIECES)
        self.dp = mesh.get_group("dp")
        dp_rank = mesh.get_local_rank("dp")
        g = torch.Generator().manual_seed(dp_rank)
        self.tokens = torch.randint(self.ARGS.vocab_size, (2, 9), generator=g)

    def prepare(self):
        """A healthy step while every rank is alive."""
        self.run()

    def run(self):
        logits = self.model(self.tokens[:, :-1])
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten()).backward()
        for p in self.model.parameters():
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=self.dp)
            p.grad = None


def _make_cases(config: dict, rank: int):
    """Each case with the groups it runs on; every rank makes every group, in the same order."""
    timeout = config["timeout"]
    cases = []
    for name in config["cases"]:
        if config["mesh"] == "2x2":
            mesh = fastmesh.init_mesh(dp=2, tp=2, timeout=timeout)
            group = mesh.get_group("tp")
        else:
            mesh, group = None, dist.new_group(timeout=datetime.timedelta(seconds=timeout))
        cases.append((name, group, BlockCase(mesh) if name == "block" else OpCase(name, rank, group)))
    return cases


def _barrier(store, name: str, ranks):
    store.set(f"{name} {dist.get_rank()}", "1")
    store.wait([f"{name} {r}" for r in ranks], datetime.timedelta(seconds=300))


def _record(name: str, group, rank: int, call) -> dict:
    record = {"case": name, "group": group.group_name, "rank": rank}
    start = time.monotonic()
    try:
        call()
        record["ok"] = True
    except Exception as error:  # what a rank sees is the result
        record.update(ok=False, classes=[cls.__name__ for cls in type(error).__mro__], message=str(error))
    record["seconds"] = time.monotonic() - start
    return record


def _write(path: str, results: list) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def main(config: dict, rank: int):
    world, failing, fault = config["world"], config["failing_rank"], config["fault"]
    store = dist.FileStore(config["store"], world)
    # The default group only sets up and synchronizes (ranks start seconds apart on a busy machine): a long
    # timeout. The cases' groups have the short one under test.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    cases = _make_cases(config, rank)
    out_path = os.path.join(config["out"], f"rank{rank}.json")
    ext = fastmesh._cpp_lib.load()
    results = []

    for _, _, case in cases:
        case.prepare()
    dist.barrier()
    if fault.endswith("_before"):
        if rank == failing:
            if fault == "exit_before":
                os._exit(0)  # no clean-up: as a crash, the process's sockets close with it
            store.wait([f"done {r}" for r in range(world) if r != failing], datetime.timedelta(seconds=300))
            os._exit(0)
        time.sleep(0.5)  # the failing rank is gone (os._exit takes milliseconds)

    others = [r for r in range(world) if r != failing]
    for i, (name, group, case) in enumerate(cases):
        if rank == failing:
            ext.inject_fault(3 if name == "block" else 0, fault)
        record = _record(name, group, rank, case.run)
        ext.inject_fault(0, "none")
        results.append(record)
        _write(out_path, results)
        if not record["ok"] and name == "block":
            os._exit(1)  # as a process whose step raised: its dp peers must notice
        # A raising rank lives on: the next case starts when every rank is done with this one.
        _barrier(store, f"case {i}", range(world) if fault == "raise" else others)
    store.set(f"done {rank}", "1")
    os._exit(0)  # destroy_process_group could wait on the failed peer


if __name__ == "__main__":
    config_path, rank = sys.argv[1:]
    with open(config_path) as f:
        main(json.load(f), int(rank))

"""GPU check of ``fastmesh.matmul_all_reduce`` and its FP8 form on CUDA tensors: correctness, then speed.

For a machine with an NVIDIA GPU; one GPU is enough:

    python bench/gpu_check_matmul_all_reduce.py [--quick] [--json results.json] [--device cpu]

Two ranks (``torch.multiprocessing``): with two or more GPUs one GPU per rank over NCCL, with one GPU both
ranks on it over gloo (which all-reduces CUDA tensors through the host). Either way the ops run their CUDA
path: the C++ schedule's pieces of the product on CUDA tensors, each piece's all-reduce beside the next
multiply, the FP8 form's ``torch._scaled_mm`` on the GPU. ``--device cpu`` runs the same checks on CPU over gloo
(a self-test of this script).

1. Correctness against ``mm`` then ``dist.all_reduce`` (FP8: ``torch._scaled_mm`` then ``dist.all_reduce``):
   float32 and bfloat16, 2-D and 3-D ``a``, odd shapes, pieces automatic / 1 / 3, ``sum`` and ``avg``;
   small-integer inputs, so every form is bit-exact. The FP8 op with tensor-wise and row-wise scales (bf16 out).
   The front's autograd (grad a = G @ b.T, grad b = a.T @ G, no communication) and ``fp8=`` (random inputs,
   against the same quantization multiplied unfused, to bf16 rounding).
2. Speed, bfloat16 (the slowest rank, median of rounds after warm-up): the op (its plan's choice) against the
   unfused sequence, per shape, with the plan it took. Reported, not judged: over gloo the transfer goes
   through the host.

Exit status: 0 all good; 1 a result disagrees; 2 no GPU / setup failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
E4M3 = torch.float8_e4m3fn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ints(shape, seed, device, dtype=torch.float32, low=-2, high=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(device=device, dtype=dtype)


def _unfused(a, b, group, reduce_op="sum"):
    c = torch.matmul(a, b)
    dist.all_reduce(c, group=group)
    return c / dist.get_world_size(group) if reduce_op == "avg" else c


def _scaled_unfused(a, a_scale, b, b_scale, out_dtype, group):
    rows = a.reshape(-1, a.shape[-1])
    rowwise = a_scale.dim() > 0 or b_scale.dim() > 0
    sa = a_scale.reshape(-1, 1).expand(rows.shape[0], 1).contiguous() if rowwise else a_scale
    sb = b_scale.expand(1, b.shape[1]).contiguous() if rowwise else b_scale
    c = torch._scaled_mm(rows, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype).view(*a.shape[:-1], b.shape[1])
    dist.all_reduce(c, group=group)
    return c


def check_correctness(device, group, rank, quick) -> list[str]:
    import fastmesh

    failures = []

    def expect_equal(got, want, case):
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
            failures.append(f"{case}: differs (max abs diff {diff}, {tuple(got.shape)} vs {tuple(want.shape)})")

    shapes = [((5, 24), 7), ((3, 11, 40), 33), ((256, 128), 96)] + ([] if quick else [((2, 1000, 512), 1024)])
    for (a_shape, n), dtype, pieces, reduce_op in (
        (s, d, p, r)
        for s in shapes
        for d in (torch.float32, torch.bfloat16)
        for p in (None, 1, 3)
        for r in ("sum", "avg")
    ):
        a = _ints(a_shape, 10 + rank, device, dtype)
        b = _ints((a_shape[-1], n), 20 + rank, device, dtype)
        got = fastmesh.matmul_all_reduce(a, b, group=group, reduce_op=reduce_op, pieces=pieces)
        expect_equal(
            got, _unfused(a, b, group, reduce_op), f"matmul_all_reduce {a_shape}x{n} {dtype} {pieces} {reduce_op}"
        )

    # Autograd: the gradient of the replicated result is the same on every rank.
    a = _ints((3, 9, 48), 30 + rank, device).requires_grad_()
    b = _ints((48, 20), 40 + rank, device).requires_grad_()
    grad = _ints((3, 9, 20), 50, device)
    fastmesh.matmul_all_reduce(a, b, group=group).backward(grad)
    expect_equal(a.grad, grad @ b.detach().t(), "matmul_all_reduce grad a")
    expect_equal(b.grad, a.detach().flatten(0, -2).t() @ grad.flatten(0, -2), "matmul_all_reduce grad b")

    # The FP8 op: small integers are exact in float8_e4m3fn; unit scales, tensor-wise or row-wise.
    name = group.group_name
    for (a_shape, n), rowwise, pieces in (
        (s, r, p) for s in (((48, 32), 16), ((2, 24, 64), 48)) for r in (False, True) for p in (0, 1, 3)
    ):
        a = _ints(a_shape, 60 + rank, device).to(E4M3)
        b = _ints((n, a_shape[-1]), 70 + rank, device).to(E4M3).t()  # column-major, as _scaled_mm takes b
        one = torch.ones((), device=device)
        a_scale = torch.ones((*a_shape[:-1], 1), device=device) if rowwise else one
        b_scale = torch.ones((1, n), device=device) if rowwise else one
        got = torch.ops.fastmesh.scaled_matmul_all_reduce(a, a_scale, b, b_scale, "sum", name, torch.bfloat16, pieces)
        want = _scaled_unfused(a, a_scale, b, b_scale, torch.bfloat16, group)
        expect_equal(got, want, f"scaled_matmul_all_reduce {a_shape}x{n} rowwise={rowwise} pieces={pieces}")

    # The front's fp8=: random inputs, against the same quantization multiplied unfused.
    granularities = ("tensorwise", "rowwise") if device.type == "cuda" or _rowwise_on_cpu() else ("tensorwise",)
    for granularity in granularities:
        g = torch.Generator().manual_seed(80 + rank)
        a = torch.randn((64, 128), generator=g).to(device=device, dtype=torch.bfloat16)
        b = (torch.randn((128, 96), generator=g) * 128**-0.5).to(device=device, dtype=torch.bfloat16)
        config = fastmesh.fp8.Float8Config(granularity=granularity)
        got = fastmesh.matmul_all_reduce(a, b, group=group, fp8=config)
        qa = fastmesh.fp8.quantize(a, dtype=E4M3, granularity=granularity)
        qb = fastmesh.fp8.quantize(b.t().contiguous(), dtype=E4M3, granularity=granularity)
        want = _scaled_unfused(qa.data, qa.scale, qb.data.t(), qb.scale.t(), torch.bfloat16, group)
        try:
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2)
        except AssertionError as error:
            failures.append(f"matmul_all_reduce fp8={granularity}: {str(error).splitlines()[0]}")
    return failures


def _rowwise_on_cpu() -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _time(fn, group, device, rounds, warmup=3) -> list[float]:
    times = []
    for i in range(warmup + rounds):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.tolist()


def check_speed(device, group, rank, quick) -> list[dict]:
    import fastmesh
    from fastmesh.ops import plans

    cuda = device.type == "cuda"
    shapes = [(4096, 1024, 4096), (8192, 2048, 4096)] if cuda else [(512, 256, 512)]
    shapes = shapes[:1] if quick else shapes
    rows = []
    for m, k, n in shapes:
        g = torch.Generator().manual_seed(rank)
        a = torch.randn((m, k), generator=g).to(device=device, dtype=torch.bfloat16)
        b = (torch.randn((k, n), generator=g) * (k * WORLD) ** -0.5).to(device=device, dtype=torch.bfloat16)
        fused = lambda: fastmesh.matmul_all_reduce(a, b, group=group)  # noqa: E731
        unfused = lambda: _unfused(a, b, group)  # noqa: E731
        rounds = 5 if quick else 15
        fused_ms, unfused_ms = [], []
        for _ in range(rounds):  # interleaved
            fused_ms += _time(fused, group, device, 1, warmup=1)
            unfused_ms += _time(unfused, group, device, 1, warmup=1)
        last = plans.last_decision("fastmesh::matmul_all_reduce")
        row = {
            "shape": [m, k, n],
            "dtype": "bfloat16",
            "fastmesh_ms": statistics.median(fused_ms) * 1e3,
            "unfused_ms": statistics.median(unfused_ms) * 1e3,
            "plan": last[1].describe() if last else None,
        }
        row["speedup_vs_unfused"] = row["unfused_ms"] / row["fastmesh_ms"]
        rows.append(row)
    return rows


def _rank_main(rank, port, device_type, quick, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device_type == "cuda" and torch.cuda.device_count() >= WORLD else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    dist.init_process_group(backend, rank=rank, world_size=WORLD, device_id=device if backend == "nccl" else None)
    group = dist.group.WORLD
    try:
        failures = check_correctness(device, group, rank, quick)
        speed = check_speed(device, group, rank, quick)
        error = None
    except Exception:  # reported as the rank's failure
        failures, speed, error = [], [], traceback.format_exc()
    results[rank] = {"backend": backend, "device": str(device), "failures": failures, "speed": speed, "error": error}
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rounds")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_matmul_all_reduce: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), args.device, args.quick, results), nprocs=WORLD)
        results = dict(results)
    if len(results) != WORLD:
        print(f"gpu_check_matmul_all_reduce: {WORLD - len(results)} rank(s) reported nothing", file=sys.stderr)
        return 2
    status = 0
    for rank in sorted(results):
        r = results[rank]
        if r["error"]:
            print(f"rank {rank} failed:\n{r['error']}", file=sys.stderr)
            status = max(status, 2)
        for failure in r["failures"]:
            print(f"rank {rank}: FAIL {failure}")
            status = max(status, 1)
    first = results[0]
    print(f"backend {first['backend']}, rank 0 on {first['device']}")
    print("correctness: " + ("ok" if status == 0 else "FAILED"))
    for row in first["speed"]:
        print(
            f"speed {row['dtype']} {row['shape']}: fastmesh {row['fastmesh_ms']:.3f} ms, unfused "
            f"{row['unfused_ms']:.3f} ms, speedup {row['speedup_vs_unfused']:.2f}x, plan {row['plan']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"status": status, "ranks": [results[r] for r in sorted(results)]}, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the chunk-waiting consumer GEMM (``fastmesh.kernels.chunked_matmul``): correctness, then speed.

For a machine with an NVIDIA GPU (torch 2.11+, triton 3.6+); one GPU is enough (loopback mode):

    python bench/gpu_check_chunked_matmul.py [--quick] [--json results.json]

1. Correctness, against ``torch.mm`` on the same GPU: all flags pre-set (bf16, fp16, fp32; odd shapes,
   uneven chunks, a shuffled arrival order); loopback mode, where a side stream copies A chunk by chunk with
   delays while the kernel spins (the waiting logic on real hardware); a chunk that never arrives ends in
   ``ChunkWaitTimeout`` rather than a hang.
2. Speed (CUDA events, median of repetitions), bf16: ``torch.mm`` vs the consumer GEMM with every flag set
   (the cost of the chunk machinery itself; target: within 5% of ``torch.mm``), the same with the capped
   grid that ``all_gather_matmul`` launches beside NCCL (``fastmesh.ops.chunked_gather.consumer_programs``),
   loopback mode against copy-then-``torch.mm`` (the overlap the kernel buys), and the fused all-gather's
   own path (``all_gather_chunked_matmul``, 4 simulated ranks, loopback transport) against
   ``torch.cat`` of the shards then ``torch.mm``.

Exit status: 0 all good; 1 a result disagrees; 2 no GPU / setup failed; 3 correct, but slower than the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from fastmesh.ops import chunked_gather

TARGET_RATIO = 1.05  # consumer GEMM time / torch.mm time


def _setup():
    if not torch.cuda.is_available():
        print("gpu_check_chunked_matmul: no CUDA device; nothing to check", file=sys.stderr)
        sys.exit(2)
    from fastmesh.kernels import chunked_matmul as cm

    return cm


def _flags_set(num_chunks: int) -> torch.Tensor:
    return torch.ones(num_chunks, dtype=torch.int32, device="cuda")


def _starts(m: int, sizes: list[int]) -> torch.Tensor:
    bounds = [0]
    for size in sizes:
        bounds.append(min(m, bounds[-1] + size))
    bounds[-1] = m
    return torch.tensor(bounds, dtype=torch.int64)


def check_correctness(cm, quick: bool) -> list[str]:
    failures = []
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, 42, 33), (127, 257, 65), (1000, 512, 384)] + ([] if quick else [(4099, 4096, 1031)])
    for (m, k, n), dtype in ((s, d) for s in shapes for d in (torch.bfloat16, torch.float16, torch.float32)):
        a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        b = torch.randn(k, n, device="cuda", generator=g).to(dtype)
        sizes = [max(1, m // 3), max(1, m // 5), m]
        starts = _starts(m, sizes)
        order = list(reversed(range(len(sizes))))
        got = cm.chunked_matmul(a, b, _flags_set(len(sizes)), starts, order=order)
        want = torch.mm(a, b)
        tol = {"atol": 1e-2, "rtol": 1e-2} if dtype != torch.float32 else {"atol": 1e-3, "rtol": 1e-4}
        if not torch.allclose(got.float(), want.float(), **tol):
            failures.append(f"flags set {m}x{k}x{n} {dtype}: max diff {(got.float() - want.float()).abs().max():.3g}")
        got = cm.loopback_chunked_matmul(a, b, num_chunks=4, delay_cycles=200_000)
        if not torch.allclose(got.float(), want.float(), **tol):
            failures.append(f"loopback {m}x{k}x{n} {dtype}: max diff {(got.float() - want.float()).abs().max():.3g}")
    a = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    flags = torch.tensor([1, 0], dtype=torch.int32, device="cuda")  # chunk 1 never arrives
    try:
        cm.chunked_matmul(a, a.t().contiguous(), flags, _starts(256, [128, 128]), max_spins=1000, check=True)
        failures.append("lost chunk: no ChunkWaitTimeout")
    except cm.ChunkWaitTimeout:
        pass
    return failures


def _time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def benchmark(cm, quick: bool) -> list[dict]:
    rows = []
    shapes = [(8192, 8192, 8192), (16384, 4096, 4096)] + ([] if quick else [(4096, 8192, 28672), (32768, 8192, 1024)])
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16).t().contiguous().t()
        chunks = 8
        starts = _starts(m, [m // chunks] * chunks)
        flags = _flags_set(chunks)
        error = torch.zeros(1, dtype=torch.int32, device="cuda")
        mm = _time_ms(lambda: torch.mm(a, b), 20)
        consumer = _time_ms(lambda: cm.chunked_matmul(a, b, flags, starts, error=error), 20)
        staging = torch.empty_like(a)
        copy_then_mm = _time_ms(lambda: (staging.copy_(a), torch.mm(staging, b)), 20)
        programs = chunked_gather.consumer_programs(a.device)
        capped = _time_ms(lambda: cm.chunked_matmul(a, b, flags, starts, error=error, max_programs=programs), 20)
        loopback = _time_ms(lambda: cm.loopback_chunked_matmul(a, b, num_chunks=chunks, check=False), 20)
        cm.check_chunk_wait(error)
        shards = list(a.chunk(4))
        transport = chunked_gather.LoopbackTransport(shards, rank=0)
        cat_then_mm = _time_ms(lambda: torch.mm(torch.cat(shards), b), 20)
        gather_path = _time_ms(
            lambda: chunked_gather.all_gather_chunked_matmul(shards[0], [b], 0, transport, False), 20
        )
        chunked_gather.raise_pending_timeouts(block=True)
        rows.append(
            {
                "m": m,
                "k": k,
                "n": n,
                "torch_mm_ms": mm,
                "consumer_ms": consumer,
                "ratio": consumer / mm,
                "consumer_capped_ms": capped,
                "capped_programs": programs,
                "copy_then_mm_ms": copy_then_mm,
                "loopback_ms": loopback,
                "cat_then_mm_ms": cat_then_mm,
                "gather_path_ms": gather_path,
            }
        )
        print(
            f"{m}x{k}x{n} bf16: torch.mm {mm:.3f} ms, consumer (flags set) {consumer:.3f} ms "
            f"({consumer / mm:.3f}x, target <= {TARGET_RATIO}), capped to {programs} programs {capped:.3f} ms "
            f"({capped / mm:.3f}x); copy+mm {copy_then_mm:.3f} ms, loopback {loopback:.3f} ms; "
            f"cat+mm {cat_then_mm:.3f} ms, all_gather_chunked_matmul (loopback, 4 ranks) {gather_path:.3f} ms",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    cm = _setup()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    failures = check_correctness(cm, args.quick)
    for failure in failures:
        print("FAIL", failure)
    if failures:
        return 1
    print("correctness: ok", flush=True)
    rows = benchmark(cm, args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 3 if any(r["ratio"] > TARGET_RATIO for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

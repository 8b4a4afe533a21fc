"""The cost model behind the fused collectives' default plans: an estimate of each candidate plan's time.

It counts what a plan costs on a device: the bytes each rank sends (over the transport's bandwidth, plus a
latency per piece), the multiplies' flops (over the device's rate) and, per multiply call, one pass over
the slice of ``b`` it reads (over the bandwidth a GEMM reads a weight with: a call with few rows is bound by
it, which is why cutting rows into pieces can lose). A pipelined plan costs about
``max(compute + exposed transfer, transfer + exposed compute)``; on CPU the transfer also takes a share of
the cores (gloo copies through loopback TCP on the same cores), added to the compute.

The constants are per device type and dtype, fixed (so that every rank computes the same estimate without
talking to the others), and were measured on the machines named beside them. Where they are off, measured
plans (``FASTMESH_TUNE=measure``, ``fastmesh tune``) take over.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Device:
    flops: dict  # dtype name -> multiply rate per thread (CPU) or per device, flop/s
    weight_pass: dict  # dtype name -> bytes/s at which one multiply call reads its b
    call_s: float  # fixed cost of one multiply call
    link_bytes_s: float  # bytes/s one rank sends to its peers
    piece_s: float  # fixed cost of one piece's transfer
    comm_cpu_share: float  # share of a transfer's time that takes compute away (CPU transports)


# 2-core Xeon (AVX-512, AMX), 1 thread per rank, gloo over loopback, torch 2.14 (/tmp/calib.py-style runs of
# torch.mm and isend/irecv, 2026-12-01): fp32 ~100 GFLOP/s, bf16 ~205; a [4096, 4096] b read in ~7 ms
# (fp32) / ~4 ms (bf16) per call; send/recv ~1.5 GB/s with ~0.3 ms per exchange. FP8: torch's CPU
# _scaled_mm converts all of b on every call (~6 ns per element).
_CPU = Device(
    flops={"float32": 100e9, "bfloat16": 200e9, "float16": 40e9, "float64": 50e9, "float8": 35e9},
    weight_pass={"float32": 9e9, "bfloat16": 8e9, "float16": 8e9, "float64": 9e9, "float8": 0.17e9},
    call_s=20e-6,
    link_bytes_s=1.5e9,
    piece_s=300e-6,
    comm_cpu_share=0.5,
)
# H100/H200 (datasheet-scale figures, not yet measured here): dense bf16 ~700 TFLOP/s, HBM ~3.5 TB/s, NCCL
# over NVLink ~300 GB/s per rank, ~15 us per collective.
_CUDA = Device(
    flops={"float32": 60e12, "bfloat16": 700e12, "float16": 700e12, "float64": 60e12, "float8": 1300e12},
    weight_pass={name: 3.5e12 for name in ("float32", "bfloat16", "float16", "float64", "float8")},
    call_s=8e-6,
    link_bytes_s=300e9,
    piece_s=15e-6,
    comm_cpu_share=0.0,
)

# A fused plan must beat the unfused one by this much in the model to be chosen: the model is rough, and
# "never slower than not fusing" is worth more than the last few percent.
MODEL_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the model needs of one call (every rank has the same)."""

    op: str  # "all_gather", "reduce_scatter", "all_reduce" or "product_all_gather" (matmul_all_gather)
    world: int
    rows: int  # all_gather: rows of the shard; the others: rows of a (reduce_scatter: all ranks' blocks)
    k: int  # contraction size of one multiply (all_gather of the last dim: one rank's part)
    ns: tuple  # columns of each b
    outer: int  # product of the dims before the gathered / scattered dim (1: rank blocks are row ranges)
    last_dim: bool  # gathers the contraction / scatters the columns
    comm_bytes: int  # bytes of one element that travels
    b_bytes: int  # bytes of one element of b
    dtype: str  # the multiply's dtype name (a key of Device.flops)
    threads: int
    device_type: str


def _device(shape: Shape) -> Device:
    return _CUDA if shape.device_type == "cuda" else _CPU


def estimate(shape: Shape, split: str, pieces: int) -> float:
    """Seconds for one call run as ``split`` ("rows", "columns", "none") with ``pieces`` pieces."""
    d = _device(shape)
    threads = max(1, shape.threads) if shape.device_type == "cpu" else 1
    flop_rate = d.flops[shape.dtype] * threads
    pass_rate = d.weight_pass[shape.dtype] * (threads if shape.device_type == "cpu" else 1)
    w, k, n = shape.world, shape.k, sum(shape.ns)
    p = 1 if split == "none" else max(1, pieces)

    def passes(calls_per_b: float, b_fraction: float = 1.0) -> float:
        """Time of ``calls_per_b`` multiply calls per b, each reading ``b_fraction`` of it."""
        return sum(calls_per_b * (d.call_s + k * ni * b_fraction * shape.b_bytes / pass_rate) for ni in shape.ns)

    if shape.op == "all_gather":
        sent = (w - 1) * shape.rows * k * shape.comm_bytes
        transfer = sent / d.link_bytes_s + d.piece_s * p
        flops = 2 * w * shape.rows * k * n / flop_rate
        if split == "none":
            return transfer + passes(1) + flops
        if shape.last_dim:  # every rank's part multiplies its own slice of b, per piece
            local, remote = passes(p, 1 / w) + flops / w, passes((w - 1) * p, 1 / w) + flops * (w - 1) / w
        else:  # one call per rank part and piece (per slab when the rank blocks are not row ranges)
            calls = shape.outer if shape.outer > 1 else p
            local = passes(shape.outer) + flops / w
            remote = passes((w - 1) * calls) + flops * (w - 1) / w
        compute = local + remote + d.comm_cpu_share * transfer
        return max(compute, transfer + remote / p)

    if shape.op in ("all_reduce", "product_all_gather"):  # pieces of the product's rows, each sent while the next
        # is multiplied. A ring all-reduce sends 2 (W-1)/W of the product (a reduce-scatter and an all-gather of
        # it); the all-gather of this rank's product sends it to the W-1 others.
        share = 2 * (w - 1) / w if shape.op == "all_reduce" else w - 1
        sent = share * shape.rows * n * shape.comm_bytes
        transfer = sent / d.link_bytes_s + d.piece_s * p
        compute = passes(p) + 2 * shape.rows * k * n / flop_rate  # every piece reads all of b
        if split == "none":
            return compute + transfer
        compute += d.comm_cpu_share * transfer
        return max(compute + transfer / p, compute / p + transfer)

    # reduce-scatter: rows of a = w blocks of the product's rows (or all of them, for the columns)
    block_rows = shape.rows if shape.last_dim else shape.rows // w
    block_cols = n // w if shape.last_dim else n
    sent = (w - 1) * block_rows * block_cols * shape.comm_bytes
    transfer = sent / d.link_bytes_s + d.piece_s * p
    flops = 2 * shape.rows * k * n / flop_rate
    a_pass = shape.rows * k * shape.b_bytes / pass_rate  # reading a once (columns plans read it per piece)
    if split == "rows":
        calls = shape.outer * w if (shape.outer > 1 and not shape.last_dim) else w * p
        compute = passes(calls, 1 / w if shape.last_dim else 1.0) + flops
    else:  # "columns" / "none": every call reads its own slice of b, so b is read once
        calls = w * p if shape.last_dim else p
        compute = passes(calls, 1 / calls) + flops + (p - 1) * a_pass
    if split == "none":
        return compute + transfer
    compute += d.comm_cpu_share * transfer
    return max(compute + transfer / p, compute / p + transfer)


def best(shape: Shape, candidates: list) -> tuple:
    """(the chosen candidate, {label: seconds}) among ``candidates`` (objects with ``split``, ``pieces`` and
    ``label``); a fused candidate is chosen over "none" only if it is MODEL_MARGIN faster."""
    times = {c.label: estimate(shape, c.split, c.pieces) for c in candidates}
    chosen = min(candidates, key=lambda c: times[c.label])
    unfused = next((c for c in candidates if c.split == "none"), None)
    if (
        unfused is not None
        and chosen is not unfused
        and times[chosen.label] > (1 - MODEL_MARGIN) * times[unfused.label]
    ):
        chosen = unfused
    return chosen, times


def pieces_up_to(units: int, top: int = 8) -> list:
    """Piece counts worth trying for ``units`` units: powers of two up to ``top``, at most ``units``."""
    return [p for p in (2**i for i in range(int(math.log2(top)) + 1)) if p <= max(1, units)]

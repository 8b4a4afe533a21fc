"""The Triton path of all_gather_matmul (fastmesh/ops/chunked_gather.py): layout, transports, the CUDA kernel's
choice, on CPU and, where present, GPU.

Like tests/test_chunked_matmul.py, the kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child pytest
(:func:`test_under_triton_interpreter`); the plain run checks the host-side layout and the path choice. Under
the interpreter the transports complete before the consumer starts (CPU has no streams), so these tests check
the layout, the flags, the row map and the results; the waiting itself is tested by the kernel's own tests
and, on a GPU, by the loopback tests here.

Inputs are small integers, so every product is exact in any summation order and the results must equal the
reference (``torch.cat`` of the shards, then ``@``) bit for bit.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.distributed as dist
from log_capture import plan_log
from rank_pool import on_ranks
from triton_interpreter import INTERPRETED, run_module_under_interpreter

import fastmesh
from fastmesh import _cpp_lib, settings
from fastmesh.ops import chunked_gather

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child started by test_under_triton_interpreter"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA GPU")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.triton_interpreter
def test_under_triton_interpreter():
    run_module_under_interpreter(__file__)


def small_ints(shape, dtype, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(dtype).to(device)


def reference(shards, bs, dim):
    a = torch.cat([s.cpu().double() for s in shards], dim=dim)
    return a, [(a @ b.cpu().double()) for b in bs]


def assert_same(got, expected, what):
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape)
    assert torch.equal(got, expected), (what, int((got != expected).sum()))


# ---- plain run: layout and choice ----

# (shard shape, gather dim, pieces): a plain row range (P == 1); slabs of Q rows (P > 1); one piece.
LAYOUT_CASES = [
    ((7, 5), 0, ((0, 3), (3, 5), (5, 7))),
    ((1, 6, 4), 1, ((0, 2), (2, 6))),
    ((3, 4, 2, 5), 1, ((0, 16), (16, 24))),  # P = 3 slabs of Q = 8 rows: pieces of whole slabs
    ((4, 3, 5), 0, ((0, 12),)),
    ((2, 3, 5), 2, ((0, 6),)),  # Q = 1
]


@pytest.mark.parametrize("shape, dim, pieces", LAYOUT_CASES)
@pytest.mark.parametrize("world, rank", [(2, 0), (2, 1), (3, 2), (4, 1)])
def test_gather_layout_puts_every_row_where_the_gather_does(shape, dim, pieces, world, rank):
    """Each arrival row (piece-major, rank-minor) maps to the row of the gathered a that holds the same
    shard row of the same rank; this rank's pieces come first in the arrival order."""
    layout = chunked_gather.gather_layout(shape, dim, world, rank, pieces)
    rows, k = math.prod(shape[:-1]), shape[-1]
    # Label every row: rank j's shard row s is j * 1000 + s.
    shards = [(j * 1000 + torch.arange(rows)).view(*shape[:-1], 1).expand(*shape[:-1], k) for j in range(world)]
    gathered = torch.cat(shards, dim=dim).reshape(-1, k)[:, 0]
    arrival = [j * 1000 + s for begin, end in pieces for j in range(world) for s in range(begin, end)]
    row_map = layout.row_map.tolist() if layout.row_map is not None else range(len(arrival))
    assert [int(gathered[r]) for r in row_map] == arrival
    assert sorted(row_map) == list(range(world * rows))
    sizes = [end - begin for begin, end in pieces for _ in range(world)]
    assert list(layout.chunk_starts) == [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    assert list(layout.order[: len(pieces)]) == [i * world + rank for i in range(len(pieces))]
    assert sorted(layout.order) == list(range(len(sizes)))
    # No permutation exactly where the arrival order is the gathered order.
    assert (layout.row_map is None) == (len(pieces) == 1 and math.prod(shape[:dim]) == 1)


def test_gather_layout_rejects_pieces_that_do_not_cover_the_shard():
    with pytest.raises(ValueError, match=r"pieces must cover the shard's 7 rows in order, got \[\(0, 3\), \(4, 7\)\]"):
        chunked_gather.gather_layout((7, 5), 0, 2, 0, ((0, 3), (4, 7)))


@pytest.mark.parametrize("shape, dim", [((1000, 64), 0), ((6, 50, 32), 1), ((3, 4, 2, 5), 1), ((5, 3), 0)])
@pytest.mark.parametrize("requested", [0, 1, 3, 100])
def test_row_pieces_follow_the_cpu_schedule(shape, dim, requested):
    """The CUDA path's pieces are the CPU kernel's (csrc/include/fastmesh/pipeline.h): consecutive, covering,
    whole [Q, K] slabs when the dims before gather_dim are not all 1, as many as asked (up to the units)."""
    ext = _cpp_lib.load()
    pieces = ext.gather_row_pieces(list(shape), dim, 4, requested)
    rows = math.prod(shape[:-1])
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim:-1])
    units, unit_rows = (outer, inner) if outer > 1 else (inner, 1)
    assert pieces[0][0] == 0 and pieces[-1][1] == rows
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(pieces, pieces[1:] + [(rows, rows + 1)]))
    assert all(begin % unit_rows == 0 for begin, _ in pieces)
    expected = [
        (b * unit_rows, e * unit_rows) for b, e in ext.pipeline_pieces(units, unit_rows * shape[-1] * 4, requested)
    ]
    assert pieces == expected
    if requested:
        assert len(pieces) == min(requested, units)


def test_unsupported_reasons():
    reason = chunked_gather.unsupported_reason
    assert reason(torch.ones(4, 8), 0, 2) is None
    assert reason(torch.ones(2, 4, 8, dtype=torch.bfloat16), 1, 4) is None
    assert "float64" in reason(torch.ones(4, 8, dtype=torch.float64), 0, 2)
    assert "contraction" in reason(torch.ones(4, 8), 1, 2)
    assert reason(torch.ones(4, 8), 0, 1) == "nothing to gather"
    assert reason(torch.ones(0, 8), 0, 2) == "nothing to gather"


def test_consumer_programs(monkeypatch):
    assert chunked_gather.consumer_programs(torch.device("cpu")) is None
    for bad in ("0", "x", "-3"):
        monkeypatch.setenv(chunked_gather.ENV_FREE_SMS, bad)
        settings.reload()
        with pytest.raises(ValueError, match=rf"FASTMESH_CONSUMER_FREE_SMS must be an int >= 1 .*got '{bad}'"):
            chunked_gather.consumer_programs(torch.device("cpu"))


def test_cuda_kernel_plans_in_python():
    """CPU and CUDA: the C++ kernel (csrc/fused/kernels.cpp), whose first call of a key asks the Python planner, which
    picks the consumer GEMM or the pipeline on CUDA."""
    name = "fastmesh::all_gather_matmul"
    _cpp_lib.load()
    table = torch._C._dispatch_dump_table(name)
    for key in ("CPU", "CUDA"):
        line = next(line for line in table.splitlines() if line.startswith(key + ":"))
        assert "kernels.cpp" in line, line
    from fastmesh.ops import plans

    assert plans._planned_runs["all_gather_matmul"].__name__ == "_all_gather_matmul_planned"


def test_loopback_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        chunked_gather.LoopbackTransport([torch.ones(2, 2)] * 2, rank=2)
    with pytest.raises(ValueError, match=r"delay_cycles must be >= 0, got -1"):
        chunked_gather.LoopbackTransport([torch.ones(2, 2)] * 2, rank=0, delay_cycles=-1)


# ---- interpreter: the kernel on CPU ----

# (shard shape, gather dim, world, rank, pieces, number of bs)
LOOPBACK_CASES = [
    ((1, 7), 0, 2, 1, 0, 1),  # one shard row
    ((5, 7), 0, 2, 0, 3, 2),  # row pieces, a permuted layout
    ((127, 9), 0, 3, 2, 0, 1),  # odd shard rows, the auto piece count
    ((3, 4, 6), 1, 2, 1, 2, 3),  # P = 3 slabs of 4 rows, Q, K, V
    ((2, 3, 5, 6), 2, 4, 3, 1, 1),  # P = 6, Q = 5, one piece
    ((1, 33, 20), 1, 2, 0, 1, 2),  # P = 1, one piece: the arrival order is the gathered order
]


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape, dim, world, rank, pieces, num_bs", LOOPBACK_CASES)
def test_loopback_equals_gather_then_matmul(shape, dim, world, rank, pieces, num_bs, dtype):
    shards = [small_ints(shape, dtype, seed=j) for j in range(world)]
    k = shape[-1]
    bs = [small_ints((k, n), dtype, seed=100 + n) for n in (5, 18, 3)[:num_bs]]
    bs[0] = bs[0].t().contiguous().t()  # a transposed weight, as nn.Linear's w.t()
    transport = chunked_gather.LoopbackTransport(shards, rank)
    a_full, outs = chunked_gather.all_gather_chunked_matmul(
        shards[rank], bs, dim, transport, return_a=True, pieces=pieces
    )
    a_ref, outs_ref = reference(shards, bs, dim)
    assert_same(a_full, a_ref.to(dtype), "gathered a")
    for i, (out, expected) in enumerate(zip(outs, outs_ref)):
        assert_same(out, expected.to(dtype), f"out {i}")
    a_none, outs_again = chunked_gather.all_gather_chunked_matmul(
        shards[rank], bs, dim, transport, return_a=False, pieces=pieces
    )
    assert a_none is None and all(torch.equal(x, y) for x, y in zip(outs, outs_again))


@needs_interpreter
def test_loopback_with_an_empty_b():
    """A b with no columns gives an empty product beside the others (nothing to launch for it)."""
    shards = [small_ints((3, 5), torch.float32, seed=j) for j in range(2)]
    bs = [small_ints((5, 0), torch.float32, seed=1), small_ints((5, 4), torch.float32, seed=2)]
    a_full, outs = chunked_gather.all_gather_chunked_matmul(
        shards[1], bs, 0, chunked_gather.LoopbackTransport(shards, 1), return_a=True, pieces=2
    )
    a_ref, outs_ref = reference(shards, bs, 0)
    assert outs[0].shape == (6, 0)
    assert_same(outs[1], outs_ref[1].float(), "the other b")
    assert_same(a_full, a_ref.float(), "gathered a")


class _LosingTransport(chunked_gather.LoopbackTransport):
    """Never sets the flags of piece `lost`."""

    def __init__(self, shards, rank, lost):
        super().__init__(shards, rank)
        self.lost = lost

    def start(self, layout, arrival, flags):
        flags = list(flags)
        flags[self.lost] = torch.empty_like(flags[self.lost])  # the fill goes elsewhere
        super().start(layout, arrival, flags)


@needs_interpreter
def test_a_lost_piece_raises():
    """Flags that never come: after max_spins the consumer gives up and the call raises, naming the chunk."""
    from fastmesh.kernels.chunked_matmul import ChunkWaitTimeout

    world, rank = 2, 0
    shards = [small_ints((8, 4), torch.float32, seed=j) for j in range(world)]
    transport = _LosingTransport(shards, rank, lost=1)
    with pytest.raises(ChunkWaitTimeout, match=r"gave up waiting for chunk 3\b") as raised:
        chunked_gather.all_gather_chunked_matmul(
            shards[rank], [torch.ones(4, 3)], 0, transport, return_a=False, pieces=2, max_spins=3
        )
    assert raised.value.chunk == 3  # piece 1, rank 1


def _through_the_cuda_kernel(shape, dim, pieces, return_a, enabled):
    """Rank body: the op's planned run as on CUDA, called on CPU tensors over gloo (the consumer GEMM's path is
    device-agnostic Python apart from the side stream), against the CPU op; and the path it logged."""
    from fastmesh.ops import fused_collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [small_ints(shape, torch.bfloat16, seed=10 + j) for j in range(world)]
    k = shape[-1] * (world if dim == len(shape) - 1 else 1)
    bs = [small_ints((k, 6), torch.bfloat16, seed=1), small_ints((k, 11), torch.bfloat16, seed=2)]
    os.environ[chunked_gather.ENV_ENABLE] = "1" if enabled else "0"
    settings.reload()
    try:
        with plan_log() as messages:
            name = fastmesh.group_name(dist.group.WORLD)
            (a_full, outs), _ = fused_collectives._all_gather_matmul_planned(
                shards[rank], bs, dim, name, return_a, pieces, cuda=True
            )
            expected_a, expected = torch.ops.fastmesh.all_gather_matmul(shards[rank], bs, dim, name, True, pieces)
    finally:
        os.environ.pop(chunked_gather.ENV_ENABLE)
        settings.reload()
    _, outs_ref = reference(shards, bs, dim)
    for out, cpu_out, ref in zip(outs, expected, outs_ref):
        assert_same(out, cpu_out, "against the CPU op")
        assert_same(out, ref.bfloat16(), "against the reference")
    if return_a:
        assert_same(a_full, expected_a, "gathered a")
    else:
        assert a_full is None
    return messages


@needs_interpreter
@on_ranks(2, 3)
def test_cuda_kernel_takes_the_consumer_gemm_when_enabled():
    for shape, dim, pieces, return_a in [((4, 6), 0, 0, True), ((2, 5, 6), 1, 2, False), ((3, 2, 7), 0, 1, True)]:
        messages = _through_the_cuda_kernel(shape, dim, pieces, return_a, enabled=True)
        # The CUDA kernel's plan first (the CPU op it is compared with logs its own after it).
        assert messages[0].endswith(": plan consumer_gemm (FASTMESH_CUDA_CONSUMER_GEMM=1)"), messages


@needs_interpreter
@on_ranks(2)
def test_cuda_kernel_falls_back_and_says_why():
    messages = _through_the_cuda_kernel((4, 6), 0, 0, True, enabled=False)
    assert (
        "(not the Triton consumer GEMM: it is opt-in until measured on GPUs: FASTMESH_CUDA_CONSUMER_GEMM=1)"
        in messages[0]
    ), messages
    messages = _through_the_cuda_kernel((4, 6), 1, 0, True, enabled=True)  # the contraction dim
    assert "the gathered dim is the contraction dim" in messages[0], messages


# ---- GPU: the waiting, for real ----


@needs_cuda
@pytest.mark.parametrize("shape, dim, world, rank, pieces", [((2048, 1024), 0, 4, 1, 0), ((4, 512, 1024), 1, 2, 0, 3)])
def test_cuda_loopback_with_late_pieces(shape, dim, world, rank, pieces):
    """Pieces copied in up to ~1 ms late on a side stream while the consumer's capped grid spins."""
    shards = [small_ints(shape, torch.bfloat16, seed=j, device="cuda") for j in range(world)]
    bs = [small_ints((shape[-1], 1536), torch.bfloat16, seed=7, device="cuda")]
    transport = chunked_gather.LoopbackTransport(shards, rank, delay_cycles=1_000_000)
    a_full, outs = chunked_gather.all_gather_chunked_matmul(shards[rank], bs, dim, transport, True, pieces)
    chunked_gather.raise_pending_timeouts(block=True)
    a_ref, outs_ref = reference(shards, bs, dim)
    assert_same(a_full.cpu(), a_ref.bfloat16(), "gathered a")
    assert_same(outs[0].cpu(), outs_ref[0].bfloat16(), "a @ b")


@needs_cuda
def test_cuda_lost_piece_is_reported_later():
    from fastmesh.kernels.chunked_matmul import ChunkWaitTimeout

    shards = [small_ints((256, 128), torch.bfloat16, seed=j, device="cuda") for j in range(2)]
    transport = _LosingTransport(shards, 0, lost=1)
    chunked_gather.all_gather_chunked_matmul(
        shards[0], [shards[1][:128].t()], 0, transport, False, pieces=2, max_spins=1000
    )
    with pytest.raises(ChunkWaitTimeout, match=r"chunk 3\b"):
        chunked_gather.raise_pending_timeouts(block=True)

"""The Triton path of ``fastmesh::all_gather_matmul`` on CUDA: the transfer flags each chunk as it lands, and the
consumer GEMM (``fastmesh/kernels/chunked_matmul.py``) multiplies the rows that have landed while the others are
in flight. A *chunk* is what one flag guards: rank ``j``'s part of pipeline piece ``i`` (chunk ``i*W + j``).

Plain-PyTorch equivalent of :func:`all_gather_chunked_matmul`, the op's for ``gather_dim`` below the last dim (a
gathered contraction dim stays with the pipelined kernel); shapes are the op's (``fused_collectives.py``)::

    a = torch.cat(all_gather(shard), dim=gather_dim)       # every rank's shard, in rank order
    result = (a if return_a else None, [a @ b for b in bs])

Layout: the shard's rows are cut into the CPU kernel's pipeline pieces (``_C.gather_row_pieces``); piece ``i`` of
every rank arrives as one ``[W, rows_i, K]`` block. This rank's own chunks are flagged before any transfer starts,
so they are multiplied first. The consumer writes each arrival row's products where the gathered ``a`` has that
row (its row map): no output is permuted afterwards.

Transports: :class:`CollectiveTransport` (one c10d all-gather per piece, then the piece's flags, on a
high-priority side stream; the consumer's grid leaves :func:`free_sms` SMs to it) and :class:`LoopbackTransport`
(one process plays every rank, to test on one GPU). On CPU (gloo) every flag is set before the consumer starts.

Errors: a chunk whose flag never comes leaves its tiles unwritten after ``max_spins`` reads and sets the call's
error word, raised as ``ChunkWaitTimeout`` at the next call of this path or by :func:`raise_pending_timeouts`.
Design (layout, SMs, error words): ``docs/design/fused-collectives.md``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math

import torch
import torch.distributed as dist

from fastmesh import _cpp_lib, settings
from fastmesh.ops._collectives import all_gather_into

ENV_ENABLE = "FASTMESH_CUDA_CONSUMER_GEMM"
ENV_FREE_SMS = "FASTMESH_CONSUMER_FREE_SMS"
# SMs left free of consumer programs for the producer's kernels (NCCL's channels, the flag fills); not tuned on
# hardware (docs/design/fused-collectives.md).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT32_MAX = 2**31 - 1


def _kernels():
    from fastmesh.kernels import chunked_matmul  # needs triton: imported where the path is taken

    return chunked_matmul


# ---- when the path applies ----


def enabled() -> bool:
    """The Triton path is opt-in (``FASTMESH_CUDA_CONSUMER_GEMM=1``) until it has been measured on GPUs."""
    return settings.get(ENV_ENABLE) == "1"


def unsupported_reason(a_shard: torch.Tensor, gather_dim: int, world: int) -> str | None:
    """None when :func:`all_gather_chunked_matmul` can serve this call (arguments already checked), else why
    not, in words for the path log."""
    if a_shard.dtype not in KERNEL_DTYPES:
        return f"{a_shard.dtype} (the consumer GEMM multiplies float32, bfloat16 and float16)"
    if gather_dim == a_shard.dim() - 1:
        return "the gathered dim is the contraction dim (the consumer GEMM waits on rows)"
    if world == 1 or a_shard.numel() == 0:
        return "nothing to gather"
    if a_shard.numel() // a_shard.shape[-1] * world > _INT32_MAX:
        return "more gathered rows than the kernel's int32 row offsets hold"
    if a_shard.is_cuda and torch.cuda.is_current_stream_capturing():
        # Per call it allocates pinned memory, records an event and may read an earlier call's error word.
        return "a CUDA graph is being captured (the path reads its error words back on the host)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


# ---- the layout of one call ----


@dataclasses.dataclass(frozen=True, eq=False)
class GatherLayout:
    """Where each rank's rows arrive and where the gathered ``a`` puts them (module docstring, "Layout")."""

    pieces: tuple[tuple[int, int], ...]  # the shard's row ranges, one per pipeline piece
    chunk_starts: tuple[int, ...]  # arrival rows: piece-major, rank-minor
    order: tuple[int, ...]  # this rank's chunks first, then the other chunks piece by piece
    row_map: torch.Tensor | None  # int64 [W * shard rows]: arrival row -> gathered row; None where the same


def gather_layout(
    shape: tuple[int, ...], dim: int, world: int, rank: int, pieces: tuple[tuple[int, int], ...]
) -> GatherLayout:
    """The layout of a contiguous shard of ``shape`` gathered along ``dim`` (not the last) over ``world`` ranks,
    sent in ``pieces`` (row ranges covering the shard's rows in order)."""
    shard_rows = math.prod(shape[:-1])
    inner = math.prod(shape[dim:-1])  # Q: rows of one [Q, K] slab
    if pieces[0][0] != 0 or pieces[-1][1] != shard_rows or any(a[1] != b[0] for a, b in itertools.pairwise(pieces)):
        raise ValueError(f"pieces must cover the shard's {shard_rows} rows in order, got {list(pieces)}")
    sizes = [end - begin for begin, end in pieces for _ in range(world)]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    # Arrival rows piece by piece, rank by rank: rank j's shard row s = p*Q + q lands at (p*W + j)*Q + q.
    parts = []
    for begin, end in pieces:
        s = torch.arange(begin, end)
        for j in range(world):
            parts.append(s + (s // inner) * (world - 1) * inner + j * inner)
    row_map = torch.cat(parts)
    own = [i * world + rank for i in range(len(pieces))]
    order = own + [c for c in range(len(sizes)) if c % world != rank]
    identity = torch.equal(row_map, torch.arange(row_map.numel()))
    return GatherLayout(tuple(pieces), tuple(starts), tuple(order), None if identity else row_map)


@functools.lru_cache(maxsize=64)
def _prepared(
    shape: tuple[int, ...],
    dim: int,
    world: int,
    rank: int,
    element_size: int,
    pieces: int,
    config,
    device: torch.device,
):
    """(layout, the kernel's plan, the row map as an int64 index on the device or None), per call signature."""
    ext = _cpp_lib.load()
    row_ranges = tuple(tuple(piece) for piece in ext.gather_row_pieces(list(shape), dim, element_size, pieces))
    layout = gather_layout(shape, dim, world, rank, row_ranges)
    plan = _kernels().chunk_plan(
        layout.chunk_starts,
        layout.order,
        config=config,
        device=device,
        row_map=layout.row_map,
        out_rows=layout.chunk_starts[-1],
    )
    index = None if layout.row_map is None else layout.row_map.to(device)
    return layout, plan, index


# ---- transports ----


@functools.cache
def _high_priority_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device, priority=-1)


class _SideStream:
    """The producer's stream: a high-priority side stream per CUDA device; nothing on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = _high_priority_stream(device) if device.type == "cuda" else None

    def enter(self):
        """Context for the producer's work: the side stream, after everything already on the current one."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        """The current stream waits for the producer's work (so later uses and frees are ordered after it)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class CollectiveTransport:
    """Pieces gathered with c10d collectives over ``group`` (module docstring, "Transports")."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world = group.size()
        self.rank = group.rank()
        self._side = None

    def start(self, layout: GatherLayout, arrival: list[torch.Tensor], flags: list[torch.Tensor]) -> None:
        """Fill ``arrival[i]`` (``[W, rows_i, K]``, this rank's block already in place), then set ``flags[i]``
        (``[W]`` int32) to 1, piece after piece."""
        self._side = _SideStream(arrival[0].device)
        with self._side.enter():
            for piece, piece_flags in zip(arrival, flags):
                work = all_gather_into(
                    piece.view(-1, piece.shape[-1]), piece[self.rank], group=self.group, async_op=True
                )
                work.wait()  # CUDA: the side stream waits for the transfer; CPU: the host does
                piece_flags.fill_(1)

    def join(self) -> None:
        self._side.join()


class LoopbackTransport:
    """One process plays all ``len(shards)`` ranks: the other ranks' parts are copied from ``shards`` (module
    docstring, "Transports"), each piece after ``delay_cycles`` GPU cycles of sleep on CUDA."""

    def __init__(self, shards: list[torch.Tensor], rank: int, delay_cycles: int = 0):
        if not 0 <= rank < len(shards):
            raise ValueError(f"rank must be in [0, {len(shards)}), got {rank}")
        if delay_cycles < 0:
            raise ValueError(f"delay_cycles must be >= 0, got {delay_cycles}")
        self.shards = [shard.contiguous() for shard in shards]
        self.world = len(shards)
        self.rank = rank
        self.delay_cycles = delay_cycles
        self._side = None

    def start(self, layout: GatherLayout, arrival: list[torch.Tensor], flags: list[torch.Tensor]) -> None:
        device = arrival[0].device
        self._side = _SideStream(device)
        rows = [shard.view(-1, shard.shape[-1]) for shard in self.shards]
        with self._side.enter():
            for (begin, end), piece, piece_flags in zip(layout.pieces, arrival, flags):
                if self.delay_cycles and device.type == "cuda":
                    torch.cuda._sleep(self.delay_cycles)
                for j in range(self.world):
                    if j != self.rank:
                        piece[j].copy_(rows[j][begin:end])
                piece_flags.fill_(1)

    def join(self) -> None:
        self._side.join()


# ---- the consumer's grid and errors ----


def free_sms() -> int:
    """The SMs the consumer leaves to the producer: ``FASTMESH_CONSUMER_FREE_SMS`` (an int >= 1), default 16."""
    return settings.get(ENV_FREE_SMS)


def consumer_programs(device: torch.device) -> int | None:
    """The consumer's grid cap on CUDA: the SM count less :func:`free_sms` (at least 1 program). None on CPU."""
    free = free_sms()
    if device.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, sms - free)


def describe_cuda_path() -> str:
    """What all_gather_matmul runs on CUDA under the current settings, for ``fastmesh info``. Raises
    ValueError for a bad ``FASTMESH_CONSUMER_FREE_SMS``."""
    if not enabled():
        return f"the pipelined decomposition (the Triton consumer GEMM is opt-in: {ENV_ENABLE}=1)"
    return (
        f"the Triton consumer GEMM where it applies ({ENV_ENABLE}=1; {free_sms()} SMs left to the transfer), "
        "else the pipelined decomposition"
    )


_pending: collections.deque = collections.deque()  # (event, pinned error word) of CUDA calls not yet checked


def raise_pending_timeouts(block: bool = False) -> None:
    """Raise :class:`~fastmesh.kernels.chunked_matmul.ChunkWaitTimeout` if an earlier CUDA call's consumer gave
    up on a chunk. Checks the calls whose error word has reached the host (all of them with ``block``)."""
    while _pending:
        event, word = _pending[0]
        if not block and not event.query():
            return
        event.synchronize()
        _pending.popleft()
        if word.item():
            _pending.clear()  # one report; the words behind it describe the same failed transfer
            _kernels().check_chunk_wait(word)


def _defer_check(error: torch.Tensor) -> None:
    if error.device.type != "cuda":
        _kernels().check_chunk_wait(error)
        return
    word = torch.empty(1, dtype=torch.int32, pin_memory=True)
    word.copy_(error, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending.append((event, word))


# ---- the op ----


def all_gather_chunked_matmul(
    shard: torch.Tensor,
    bs: list[torch.Tensor],
    gather_dim: int,
    transport,
    return_a: bool,
    pieces: int = 0,
    max_spins: int | None = None,
):
    """``(a if return_a else None, [a @ b for b in bs])`` with ``a`` the shards of ``transport``'s ranks
    concatenated along ``gather_dim`` (not the last), through the consumer GEMM (module docstring).

    ``transport``: a :class:`CollectiveTransport` or :class:`LoopbackTransport`. ``pieces``: pipeline pieces
    per rank, 0 for the CPU kernel's choice. ``max_spins``: the consumer's bound on each wait (default
    :data:`~fastmesh.kernels.chunked_matmul.DEFAULT_MAX_SPINS`). The arguments are those of a valid op call
    for which :func:`unsupported_reason` is None; they are not checked again here.
    """
    cm = _kernels()
    raise_pending_timeouts()
    shard = shard.contiguous()
    world, rank, device = transport.world, transport.rank, shard.device
    config = cm.default_config(shard.dtype)
    layout, plan, index = _prepared(
        tuple(shard.shape), gather_dim, world, rank, shard.element_size(), pieces, config, device
    )
    k = shard.shape[-1]
    shard_rows = shard.view(-1, k)

    arrival = torch.empty(plan.m, k, dtype=shard.dtype, device=device)
    blocks = []
    offset = 0
    for begin, end in layout.pieces:
        block = arrival[offset : offset + world * (end - begin)].view(world, end - begin, k)
        block[rank].copy_(shard_rows[begin:end])
        blocks.append(block)
        offset += world * (end - begin)
    flags = torch.zeros(len(layout.pieces), world, dtype=torch.int32, device=device)
    flags[:, rank] = 1
    error = torch.zeros(1, dtype=torch.int32, device=device)

    transport.start(layout, blocks, list(flags))
    full_shape = list(shard.shape)
    full_shape[gather_dim] *= world
    spins = cm.DEFAULT_MAX_SPINS if max_spins is None else max_spins
    programs = consumer_programs(device)  # once per call, not per b: it reads the settings and the device
    outs = []
    for b in bs:
        out = torch.empty(full_shape[:-1] + [b.shape[1]], dtype=shard.dtype, device=device)
        cm.launch_chunked_matmul(
            plan,
            arrival,
            b,
            out.view(plan.out_rows, b.shape[1]),
            flags.view(-1),
            error,
            max_spins=spins,
            max_programs=programs,
        )
        outs.append(out)
    transport.join()
    a_full = None
    if return_a:
        a_full = (
            arrival.view(full_shape)
            if index is None
            else (
                torch.empty(full_shape, dtype=shard.dtype, device=device)
                .view(-1, k)
                .index_copy_(0, index, arrival)
                .view(full_shape)
            )
        )
    _defer_check(error)
    return a_full, outs

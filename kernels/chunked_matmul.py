"""The consumer GEMM of the fused all-gather + matmul on CUDA: ``C = A @ B`` while A's rows are still arriving.

A *chunk* is what one flag guards: a contiguous range of A's rows and its 32-bit flag. The producer (a side
stream) sets a chunk's flag once its rows have landed; this kernel, running at the same time, spins on the flags
of every chunk a tile's rows touch before it reads them. Once every flag has reached ``expected``::

    c = a @ b        # fp32 accumulation, rounded once to a.dtype; with a row_map: c[row_map] = a @ b

Shapes (``chunk_starts`` splits A's rows into ``num_chunks`` contiguous chunks, of any sizes)::

    a              [M, K]  fp32 / bf16 / fp16  any strides
    b              [K, N]  a.dtype             any strides (b = w.t() of a row-major w is fine)
    flags          [num_chunks]  int32         chunk c has landed once flags[c] >= expected
    chunk_starts   [num_chunks + 1]  int       0 = s_0 <= ... <= s_num_chunks = M; chunk c: rows [s_c, s_c+1)
    order          [num_chunks]  int           the order in which the chunks arrive (default 0, 1, ...)
    error          [1]  int32                  0, or 1 + the highest chunk whose wait timed out
    row_map        [M]  int (optional)         row r of A @ B is written to row row_map[r] of c
    c (returned)   [M, N]  a.dtype             ``out`` if given (any strides); [R, N] with a row_map

Tiles run in arrival order (:func:`block_schedule`). Each wait is bounded (``max_spins``): a lost chunk leaves its
tiles unwritten and sets ``error`` (:func:`check_chunk_wait` raises :class:`ChunkWaitTimeout`) instead of hanging
the GPU. The producer must never need an SM the spinning consumer holds: copy engines, stream memory operations,
or a capped grid (``max_programs``). Not differentiable. Errors: TypeError / ValueError naming the argument.
Design (tile order, waiting, memory ordering, the interpreter): ``docs/design/fused-collectives.md``.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "DEFAULT_MAX_SPINS",
    "ChunkPlan",
    "ChunkWaitTimeout",
    "MatmulConfig",
    "block_schedule",
    "check_chunk_wait",
    "chunk_plan",
    "chunked_matmul",
    "default_config",
    "launch_chunked_matmul",
    "loopback_chunked_matmul",
]

# Some tens of seconds of spinning (an estimate: docs/design/fused-collectives.md), where real chunks arrive
# within milliseconds: a lost chunk turns into an error instead of a hung GPU.
DEFAULT_MAX_SPINS = 1 << 26
_INT32_MAX = 2**31 - 1
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCHEDULE_COLUMNS = 5  # m_block, group_start, group_size, first_chunk, last_chunk


class ChunkWaitTimeout(RuntimeError):
    """A consumer program gave up waiting for a chunk's flag. ``chunk`` is the highest such chunk.
    The tiles that read that chunk's rows were not written."""

    def __init__(self, chunk: int, message: str):
        super().__init__(message)
        self.chunk = chunk


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tile sizes and launch options of the consumer GEMM."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two >= 16 (tl.dot), got {value}")
        if self.group_m < 1:
            raise ValueError(f"MatmulConfig.group_m must be >= 1, got {self.group_m}")


def default_config(dtype: torch.dtype, interpreted: bool | None = None) -> MatmulConfig:
    """Fixed tiles, no autotuning. These are the usual Hopper (H100/H200) choices for a
    tensor-core GEMM; they have not been tuned on this kernel yet. Under the interpreter (default:
    whether this process interprets the kernel), 16-wide tiles keep small test matrices cheap and
    put chunk boundaries inside tiles."""
    if interpreted is None:
        interpreted = _is_interpreted()
    if interpreted:
        return MatmulConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        # Half the K depth of the 16-bit config: the same bytes per stage.
        return MatmulConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3)
    return MatmulConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4)


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _widen_bf16(x):
    """bf16 -> fp32 by shifting the bits (exact)."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _to_output(acc, dtype: tl.constexpr):
    """Round the fp32 accumulator to the output dtype, to nearest-even."""
    if dtype == tl.bfloat16:
        # Integer RNE, bit for bit the hardware's cvt.rn.bf16.f32 (NaN aside: canonical 0x7fc0). The
        # interpreter's own fp32 -> bf16 cast truncates.
        bits = acc.to(tl.int32, bitcast=True)
        bits = tl.where(acc != acc, 0x7FC00000, bits)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(dtype)


@triton.jit
def _chunked_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    flags_ptr,
    starts_ptr,
    schedule_ptr,
    error_ptr,
    row_map_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    num_blocks_n,
    num_tiles,
    expected,
    max_spins,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    WIDEN_BF16: tl.constexpr,
    HAS_ROW_MAP: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] tiles of C = A @ B, each after the A chunks of its rows have landed.

    Program p computes tiles p, p + num_programs, ... in schedule order (one tile each when the grid
    covers every tile). schedule: int32 [num_blocks_m, 5] (:func:`block_schedule`; the tile -> block
    mapping is in docs/design/fused-collectives.md). starts: int32 [num_chunks + 1] chunk row offsets
    (empty chunks are not waited for). row_map (HAS_ROW_MAP): int32 [M], the row of C that each row of A
    produces.
    """
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        row = schedule_ptr + (tile // num_blocks_n) * 5
        group_start = tl.load(row + 1)
        group_size = tl.load(row + 2)
        local = tile - group_start * num_blocks_n
        slot = schedule_ptr + (group_start + local % group_size) * 5
        m_block = tl.load(slot)
        n_block = local // group_size
        chunk = tl.load(slot + 3)
        last_chunk = tl.load(slot + 4)

        # Wait for every chunk the tile's rows touch. `failed` is 1 + the chunk whose wait timed out.
        failed = 0
        while (chunk <= last_chunk) & (failed == 0):
            if tl.load(starts_ptr + chunk + 1) > tl.load(starts_ptr + chunk):
                # Acquire: the A loads below cannot be performed before this read (docs/design/fused-collectives.md).
                flag = tl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
                spins = 0
                while (flag < expected) & (spins < max_spins):
                    flag = tl.atomic_add(flags_ptr + chunk, 0, sem="acquire", scope="sys")
                    spins += 1
                if flag < expected:
                    failed = chunk + 1
            chunk += 1

        if failed != 0:
            # Give up on this tile: record the chunk and leave C's tile unwritten.
            tl.atomic_max(error_ptr, failed)
        else:
            rows = m_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = n_block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            row_ok = rows < M
            col_ok = cols < N
            a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
            b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = ks < K - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if WIDEN_BF16:
                    a = _widen_bf16(a)
                    b = _widen_bf16(b)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            c = _to_output(acc, c_ptr.dtype.element_ty)
            if HAS_ROW_MAP:
                out_rows = tl.load(row_map_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            else:
                out_rows = rows
            tl.store(
                c_ptr + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn,
                c,
                mask=row_ok[:, None] & col_ok[None, :],
            )


# ------------------------------------------------------------------------------------------------
# Schedule
# ------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _host_int_tensor(name: str, value) -> torch.Tensor:
    """A 1-D int tensor (any device: a CUDA one costs a sync) or a sequence of ints, as a CPU int64 tensor."""
    if value is None:
        raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got None")
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {list(value.shape)}")
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
        return value.to(device="cpu", dtype=torch.int64)
    try:
        values = tuple(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a 1-D integer tensor or a sequence of ints, got {type(value).__name__}"
        ) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must contain ints, got {list(values)}")
    return torch.tensor(values, dtype=torch.int64).view(-1)


def _host_ints(name: str, value, allow_none: bool = False) -> tuple[int, ...] | None:
    """:func:`_host_int_tensor`'s values as a tuple (None stays None where allowed)."""
    if value is None and allow_none:
        return None
    return tuple(_host_int_tensor(name, value).tolist())


def _check_starts(starts: tuple[int, ...], m: int) -> None:
    if len(starts) < 2:
        raise ValueError(f"chunk_starts must hold num_chunks + 1 >= 2 row offsets, got {list(starts)}")
    if starts[0] != 0 or starts[-1] != m:
        raise ValueError(f"chunk_starts must start at 0 and end at M = {m} (cover the rows of a), got {list(starts)}")
    if any(lo > hi for lo, hi in itertools.pairwise(starts)):
        raise ValueError(f"chunk_starts must be non-decreasing, got {list(starts)}")
    if m > _INT32_MAX:
        raise ValueError(f"M = {m} rows do not fit the kernel's int32 row offsets")


def _check_order(order: tuple[int, ...] | None, num_chunks: int) -> tuple[int, ...]:
    if order is None:
        return tuple(range(num_chunks))
    if sorted(order) != list(range(num_chunks)):
        raise ValueError(
            f"order must be a permutation of 0..num_chunks-1 (num_chunks = {num_chunks}), got {list(order)}"
        )
    return order


def block_schedule(chunk_starts, order=None, *, block_m: int, group_m: int = 1) -> torch.Tensor:
    """The consumer's M-block schedule (docs/design/fused-collectives.md, "Tile order"), as a CPU int32 tensor.

    Args:
        chunk_starts: ``num_chunks + 1`` non-decreasing row offsets from 0 to M (tensor or ints).
        order: the arrival order of the chunks (default ``range(num_chunks)``).
        block_m: rows per M-block.
        group_m: M-blocks per L2 group (groups never span two arrival keys).

    Returns:
        int32 ``[cdiv(M, block_m), 5]``: row ``s`` = ``(m_block, group_start, group_size,
        first_chunk, last_chunk)`` of the ``s``-th M-block in arrival order.
    """
    starts = _host_ints("chunk_starts", chunk_starts)
    _check_starts(starts, starts[-1] if starts else 0)
    order = _check_order(_host_ints("order", order, allow_none=True), len(starts) - 1)
    return torch.tensor(_schedule_rows(starts, order, block_m, group_m), dtype=torch.int32).view(-1, _SCHEDULE_COLUMNS)


def _schedule_rows(starts: tuple[int, ...], order: tuple[int, ...], block_m: int, group_m: int) -> list[list[int]]:
    m = starts[-1]
    position = {chunk: i for i, chunk in enumerate(order)}
    blocks = []
    for m_block in range(_cdiv(m, block_m)):
        r0, r1 = m_block * block_m, min((m_block + 1) * block_m, m)
        # bisect_right: with empty chunks at r0, the last chunk starting there is the one holding r0.
        first = bisect.bisect_right(starts, r0) - 1
        last = bisect.bisect_left(starts, r1) - 1  # the last chunk starting before r1
        key = max(position[c] for c in range(first, last + 1) if starts[c + 1] > starts[c])
        blocks.append((key, m_block, first, last))
    blocks.sort()
    rows = []
    s = 0
    while s < len(blocks):
        run_end = s
        while run_end < len(blocks) and blocks[run_end][0] == blocks[s][0]:
            run_end += 1
        for group_start in range(s, run_end, group_m):
            group_size = min(group_m, run_end - group_start)
            for _key, m_block, first, last in blocks[group_start : group_start + group_size]:
                rows.append([m_block, group_start, group_size, first, last])
        s = run_end
    return rows


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkPlan:
    """The device tables of one chunk layout: everything the kernel reads besides the operands.

    Made by :func:`chunk_plan`, which checks the host values once. A caller that launches the same
    layout every step (the fused all-gather) keeps the plan and calls :func:`launch_chunked_matmul`,
    which copies nothing to the device. :func:`chunked_matmul` caches plans by their host values.
    """

    m: int  # rows of A
    out_rows: int  # rows of C: m, or what row_map maps into
    num_chunks: int
    config: MatmulConfig
    device: torch.device
    schedule: torch.Tensor  # int32 [cdiv(m, block_m), 5]
    starts: torch.Tensor  # int32 [num_chunks + 1]
    row_map: torch.Tensor | None  # int32 [m]


def chunk_plan(
    chunk_starts, order=None, *, config: MatmulConfig, device, row_map=None, out_rows: int | None = None
) -> ChunkPlan:
    """Check a chunk layout and build its :class:`ChunkPlan` on ``device``: build it once, launch it often.

    Args:
        chunk_starts, order: as for :func:`chunked_matmul` (tensors on any device, or ints).
        config: the tile sizes the plan is for.
        device: where the kernel runs.
        row_map: None (row ``r`` of A gives row ``r`` of C), or M distinct ints in ``[0, out_rows)``
            (an int tensor, read on the host, or ints): row ``r`` of A gives row ``row_map[r]`` of C. The
            fused all-gather receives rows in arrival order and writes them where the gathered layout
            puts them.
        out_rows: the rows of C (default M).
    """
    starts = _host_ints("chunk_starts", chunk_starts)
    _check_starts(starts, starts[-1] if starts else 0)
    order = _check_order(_host_ints("order", order, allow_none=True), len(starts) - 1)
    m = starts[-1]
    out_rows = m if out_rows is None else out_rows
    if not isinstance(out_rows, int) or isinstance(out_rows, bool) or not 0 <= out_rows <= _INT32_MAX:
        raise ValueError(f"out_rows must be an int in [0, 2**31 - 1], got {out_rows!r}")
    mapped = _checked_row_map(row_map, m, out_rows)
    device = torch.device(device)
    rows = _schedule_rows(starts, order, config.block_m, config.group_m)
    return ChunkPlan(
        m=m,
        out_rows=out_rows,
        num_chunks=len(starts) - 1,
        config=config,
        device=device,
        schedule=torch.tensor(rows, dtype=torch.int32).view(-1, _SCHEDULE_COLUMNS).to(device),
        starts=torch.tensor(starts, dtype=torch.int32).to(device),
        row_map=None if mapped is None else mapped.to(device=device, dtype=torch.int32),
    )


def _checked_row_map(row_map, m: int, out_rows: int) -> torch.Tensor | None:
    """row_map as a CPU int64 tensor, checked (vectorized: a fused all-gather's map has a row per gathered row)."""
    if row_map is None:
        if out_rows != m:
            raise ValueError(f"out_rows ({out_rows}) must equal M = {m} without a row_map")
        return None
    mapped = _host_int_tensor("row_map", row_map)
    if mapped.numel() != m:
        raise ValueError(f"row_map must hold one row of C per row of A (M = {m}), got {mapped.numel()}")
    if m and (int(mapped.min()) < 0 or int(mapped.max()) >= out_rows or torch.unique(mapped).numel() != m):
        raise ValueError(
            f"row_map must hold distinct rows in [0, out_rows = {out_rows}) (two rows of A must not "
            "write the same row of C)"
        )
    return mapped


@functools.lru_cache(maxsize=64)
def _cached_plan(
    starts: tuple[int, ...],
    order: tuple[int, ...] | None,
    row_map: tuple[int, ...] | None,
    out_rows: int | None,
    config: MatmulConfig,
    device: torch.device,
) -> ChunkPlan:
    """chunk_plan for :func:`chunked_matmul`, keyed by host values: a steady-state call copies nothing."""
    return chunk_plan(starts, order, config=config, device=device, row_map=row_map, out_rows=out_rows)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------


def _is_interpreted() -> bool:
    from triton.runtime import interpreter  # not imported by `import triton` unless TRITON_INTERPRET=1

    return isinstance(_chunked_matmul_kernel, interpreter.InterpretedFunction)


def check_chunk_wait(error: torch.Tensor) -> None:
    """Raise :class:`ChunkWaitTimeout` if ``error`` (the kernel's error word) is set.

    This reads the tensor on the host, which costs a device sync. Call it off the hot path, for
    example once per step on a persistent ``error`` that the caller resets after a failure.
    """
    code = int(error.max().item())
    if code:
        raise ChunkWaitTimeout(
            code - 1,
            f"chunked_matmul: gave up waiting for chunk {code - 1} (its flag stayed below `expected` for "
            f"max_spins reads; error code {code}); the tiles reading that chunk's rows were not written",
        )


def _check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on a's device {device}, got {t.device}")


def _check_matrices(a, b, **tensors) -> None:
    """a and b are 2-D tensors, and every other named argument a tensor."""
    for name, t in (("a", a), ("b", b), *tensors.items()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {list(a.shape)}")
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D [K, N], got shape {list(b.shape)}")


def _check_bound(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be an int in [{low}, 2**31 - 1], got {value!r}")


def launch_chunked_matmul(
    plan: ChunkPlan,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    flags: torch.Tensor,
    error: torch.Tensor,
    *,
    expected: int = 1,
    max_spins: int = DEFAULT_MAX_SPINS,
    max_programs: int | None = None,
    input_precision: str = "ieee",
    wrap: Callable | None = None,
) -> torch.Tensor:
    """Launch the kernel for a prepared layout: ``out[row_map] = a @ b`` as chunks land. No sync, no
    host-to-device copy. The arguments are those of :func:`chunked_matmul`; ``out`` and ``error`` are
    required, ``out`` has ``plan.out_rows`` rows."""
    _check_matrices(a, b, out=out, flags=flags, error=error)
    if a.dtype not in _DTYPES:
        raise TypeError(f"a must be float32, bfloat16 or float16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a [M, K] and b [K, N] disagree on K: a is {list(a.shape)}, b is {list(b.shape)}")
    if a.shape[0] != plan.m:
        raise ValueError(f"a has {a.shape[0]} rows but the chunk layout covers M = {plan.m}")
    device = a.device
    if plan.device != device:
        raise ValueError(f"the chunk plan was made for {plan.device}, but a is on {device}")
    m, k = a.shape
    n = b.shape[1]
    if tuple(out.shape) != (plan.out_rows, n) or out.dtype != a.dtype:
        raise ValueError(
            f"out must be [rows, N] = [{plan.out_rows}, {n}] of dtype {a.dtype}, got {list(out.shape)} of {out.dtype}"
        )
    if flags.dtype != torch.int32 or tuple(flags.shape) != (plan.num_chunks,):
        raise ValueError(
            f"flags must be an int32 tensor with one flag per chunk, shape [{plan.num_chunks}] "
            f"(num_chunks = {plan.num_chunks}), got {flags.dtype} of shape {list(flags.shape)}"
        )
    if error.dtype != torch.int32 or error.numel() != 1:
        raise ValueError(
            f"error must be an int32 tensor of one element, got {error.dtype} of shape {list(error.shape)}"
        )
    for name, t in (("b", b), ("out", out), ("flags", flags), ("error", error)):
        _check_same_device(name, t, device)
    _check_bound("expected", expected, 1)
    _check_bound("max_spins", max_spins, 0)
    if max_programs is not None:
        _check_bound("max_programs", max_programs, 1)
    if input_precision not in ("ieee", "tf32"):
        raise ValueError(f"input_precision must be 'ieee' or 'tf32', got {input_precision!r}")
    if m == 0 or n == 0:
        return out
    config = plan.config
    num_blocks_n = _cdiv(n, config.block_n)
    num_tiles = plan.schedule.shape[0] * num_blocks_n
    programs = num_tiles if max_programs is None else min(num_tiles, max_programs)
    kernel = _chunked_matmul_kernel if wrap is None else wrap(_chunked_matmul_kernel)
    kernel[(programs,)](
        a,
        b,
        out,
        flags,
        plan.starts,
        plan.schedule,
        error,
        plan.row_map if plan.row_map is not None else plan.starts,  # not read without a row map
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        num_blocks_n,
        num_tiles,
        expected,
        max_spins,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        INPUT_PRECISION=input_precision if a.dtype == torch.float32 else None,
        WIDEN_BF16=_is_interpreted() and a.dtype == torch.bfloat16,
        HAS_ROW_MAP=plan.row_map is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def chunked_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    flags: torch.Tensor,
    chunk_starts,
    *,
    expected: int = 1,
    order=None,
    out: torch.Tensor | None = None,
    row_map=None,
    max_spins: int = DEFAULT_MAX_SPINS,
    max_programs: int | None = None,
    error: torch.Tensor | None = None,
    check: bool | None = None,
    input_precision: str = "ieee",
    config: MatmulConfig | None = None,
    wrap: Callable | None = None,
) -> torch.Tensor:
    """``a @ b``, reading each chunk of a's rows only after its flag reaches ``expected``.

    Equivalent, once all flags are set, to ``torch.mm(a, b)`` (fp32 accumulation, one rounding to
    a.dtype), or with a ``row_map`` to ``out[row_map] = torch.mm(a, b)``. Shapes are in the module
    docstring's table.

    Args:
        a: ``[M, K]`` float32 / bfloat16 / float16, any strides; its rows arrive in chunks.
        b: ``[K, N]``, a's dtype and device, any strides.
        flags: int32 ``[num_chunks]`` on a's device. Chunk ``c`` is readable once
            ``flags[c] >= expected``. Written by a copy engine or a stream memory operation, or by a
            kernel that cannot be starved of SMs (module docstring).
        chunk_starts: ``num_chunks + 1`` non-decreasing row offsets from 0 to M: an int32/int64
            tensor or a sequence of ints. A CPU tensor or ints cost no sync. A CUDA tensor is read
            back, with a device sync. The derived tables are cached on the device, per layout.
            The first call for a new layout copies them there, so make that call before any CUDA-graph
            capture.
        expected: the epoch, an int in ``[1, 2**31 - 1]``. Flags below it are stale.
        order: arrival order of the chunks (tensor or ints; default ``0..num_chunks-1``). Tiles are
            scheduled in this order.
        out: the output in a's dtype and device (any strides): ``[M, N]``, or ``[R, N]`` with a
            ``row_map`` into R rows. Allocated (``[M, N]``) if None.
        row_map: None, or M distinct ints (tensor or ints, host values as for ``chunk_starts``) in
            ``[0, out.shape[0])``: row ``r`` of ``a @ b`` is written to ``out[row_map[r]]``.
        max_spins: the flag reads a program makes past its first before it gives up on a chunk.
        max_programs: None (one program per tile), or a cap on the grid: each program then computes
            tiles ``p, p + max_programs, ...`` in arrival order. A capped grid leaves SMs free for a
            producer that runs on SMs (module docstring).
        error: int32, one element, on a's device. On a timeout the kernel does
            ``atomic_max(error, chunk + 1)``. Give a persistent zero tensor and read it later with
            :func:`check_chunk_wait` to keep the hot path free of syncs.
        check: sync and raise :class:`ChunkWaitTimeout` if a wait timed out. Defaults to
            ``error is None`` (a private error word could not be inspected otherwise).
        input_precision: for float32 inputs, ``"ieee"`` (full fp32 products, like torch's default
            matmul) or ``"tf32"`` (tensor cores). 16-bit inputs always use their tensor-core dot.
        config: tile sizes (:func:`default_config` if None).
        wrap: applied to the kernel before launch (``torch.library.wrap_triton`` in a triton_op).

    Returns:
        ``out``. If a wait timed out, the tiles reading that chunk are left as they were.
    """
    _check_matrices(a, b, flags=flags)
    starts = _host_ints("chunk_starts", chunk_starts)
    _check_starts(starts, a.shape[0])
    if out is None:
        if row_map is not None:
            raise ValueError("out must be given with a row_map (the rows it maps into)")
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    elif not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError(
            f"out must be a 2-D tensor, got {out if not isinstance(out, torch.Tensor) else list(out.shape)}"
        )
    if check is None:
        check = error is None
    if error is None:
        error = torch.zeros(1, dtype=torch.int32, device=a.device)
    config = config or default_config(a.dtype)
    plan = _cached_plan(
        starts,
        _host_ints("order", order, allow_none=True),
        _host_ints("row_map", row_map, allow_none=True),
        out.shape[0] if row_map is not None else None,
        config,
        a.device,
    )
    launch_chunked_matmul(
        plan,
        a,
        b,
        out,
        flags,
        error,
        expected=expected,
        max_spins=max_spins,
        max_programs=max_programs,
        input_precision=input_precision,
        wrap=wrap,
    )
    if check:
        check_chunk_wait(error)
    return out


def loopback_chunked_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    num_chunks: int,
    delay_cycles: int = 0,
    order: Sequence[int] | None = None,
    max_spins: int = DEFAULT_MAX_SPINS,
    check: bool = True,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """``a @ b`` through :func:`chunked_matmul`, with a local producer (one GPU, no communication).

    A high-priority side stream copies ``a`` into a fresh buffer, chunk by chunk in ``order``
    (``num_chunks`` near-equal row ranges). It sleeps ``delay_cycles`` GPU cycles before each chunk
    (``torch.cuda._sleep``) so that chunks arrive late, and sets each chunk's flag after its copy. The
    consumer kernel is launched on the current stream right away, so its programs really wait.

    Each flag is set by a 4-byte device-to-device ``copy_`` (``cudaMemcpyAsync``: no SM slot, so the spinning
    consumer cannot starve it; docs/design/fused-collectives.md). A test harness.

    Raises ValueError for non-CUDA tensors. With ``check`` (the default), this syncs and raises
    :class:`ChunkWaitTimeout` if a wait timed out.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"loopback_chunked_matmul needs CUDA tensors (it uses CUDA streams); {name} is on {where}")
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D [M, K], got shape {list(a.shape)}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an int >= 1, got {num_chunks!r}")
    if delay_cycles < 0:
        raise ValueError(f"delay_cycles must be >= 0, got {delay_cycles}")
    m = a.shape[0]
    starts = [m * i // num_chunks for i in range(num_chunks + 1)]
    order = _check_order(None if order is None else tuple(order), num_chunks)
    device = a.device

    a = a.contiguous()  # so that every chunk copy is one cudaMemcpyAsync
    gathered = torch.empty_like(a)
    flags = torch.zeros(num_chunks, dtype=torch.int32, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device, priority=-1)
    side.wait_stream(current)  # a, zeroed flags and `one` are ready
    with torch.cuda.stream(side):
        for chunk in order:
            if delay_cycles:
                torch.cuda._sleep(delay_cycles)
            lo, hi = starts[chunk], starts[chunk + 1]
            gathered[lo:hi].copy_(a[lo:hi])
            flags[chunk : chunk + 1].copy_(one)
    out = chunked_matmul(
        gathered, b, flags, starts, order=order, max_spins=max_spins, error=error, check=False, config=config
    )
    # Every tensor the side stream touched was allocated on (or given to) the current stream, and
    # the current stream now waits for the side stream: no record_stream needed.
    current.wait_stream(side)
    if check:
        check_chunk_wait(error)
    return out

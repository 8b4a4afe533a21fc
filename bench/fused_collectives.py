"""Fused collectives on a group of ranks: fastmesh's ops against the unfused collective sequence and their bounds.

For each op, dtype and shape, the contenders run round-robin (interleaved rounds, after warm-up):

* ``fastmesh``: ``fastmesh.all_gather_matmul`` / ``matmul_reduce_scatter`` / ``matmul_all_reduce`` /
  ``matmul_all_gather``;
  for ``float8`` ``torch.ops.fastmesh.all_gather_scaled_matmul`` / ``scaled_matmul_reduce_scatter`` /
  ``scaled_matmul_all_reduce`` on FP8 data, bf16 out, with the scales of ``FP8_GRANULARITIES``: tensor-wise,
  row-wise, MX (e8m0 per 32 along K) or block (a 1x128, b 128x128);
* ``unfused`` (baseline): the c10d all-gather then ``matmul`` per b / ``matmul`` then the c10d reduce-scatter /
  ``matmul`` then the c10d all-reduce / ``matmul`` then the c10d all-gather (FP8: the FP8 bytes and their
  per-row scales gathered, e8m0 ones as bytes, then the op's multiply of those layouts: ``torch._scaled_mm``
  for tensor-wise, row-wise and, on SM90, 1x128 x 128x128 block scales, both operands dequantized to bf16 and
  ``torch.matmul`` for MX and other block scales; a note says which ran), into preallocated outputs, plus the
  block-reordering copy c10d needs when the gathered / scattered dim is not 0 (the product's columns: always);
* ``symm_mem`` (baseline, on two or more CUDA GPUs): PyTorch's ``torch.ops.symm_mem.fused_all_gather_matmul``
  / ``fused_matmul_reduce_scatter`` with symmetric memory enabled for the group;
* ``checked`` (variant): the fused op with ``FASTMESH_SHAPE_CHECK=every``, the cross-rank shape check on every
  call (by default only the first call of an op on a group checks): ``checked_over_fastmesh`` is its cost;
* ``comm`` and ``matmul`` (parts): the collective alone and the multiplies alone, same sizes;
* ``bound``: ``max(comm, matmul)`` per round, perfect overlap.

On CPU (gloo) also ``p2p`` (part): the same bytes moved as fastmesh moves them on gloo (send/recv with every
peer; for the all-reduce, gloo's own all-reduce, which fastmesh uses), and
``cpu_bound = matmul + (CPU share of p2p) x p2p``: on CPU the transfer is work for the same cores
(gloo copies through loopback TCP on its own thread), so this is what a rank's core must do however well it
overlaps. Targets (issue 4): fastmesh/bound <= 1.10, and speedup_vs_unfused >= 1.15 where comm/matmul >= 0.25.

Every call starts with a barrier and counts as long as its slowest rank. Every fastmesh result is checked
against the unfused one (random inputs) before timing. Each row names the plan the fused op took
(``fastmesh.ops.plans``: its label and where it came from).

Cases: ``--case fused_collectives=ag:2048x4096:0:384`` = op (``ag`` all_gather_matmul, ``rs``
matmul_reduce_scatter), this rank's ``a_shard`` (ag) or ``a`` (rs) shape, the gathered / scattered dim, the
columns of each b (several for ag: ``256,256,256``), and optionally the fused op's piece count (``:4``; default:
its automatic choice), to compare piece counts case by case. ``ar:4096x256:1024[:PIECES]``: matmul_all_reduce of
this rank's ``a`` (its last dim this rank's part of the contraction) by a ``[K, 1024]`` b, no dim (FP8:
``torch.ops.fastmesh.scaled_matmul_all_reduce``). ``mg:4096x256:1024[:PIECES]``: matmul_all_gather of ``a`` by
this rank's ``[K, 1024]`` columns, the products gathered along the columns (no FP8 form).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fastmesh.bench.family import Context, Family
from fastmesh.bench.figures import Case, Contender
from fastmesh.bench.timing import time_slowest_rank

import fastmesh
from fastmesh.fp8.config import Float8Config
from fastmesh.ops import plans
from fastmesh.ops._checks import MX_BLOCK
from fastmesh.ops._collectives import all_gather_into, reduce_scatter_into
from fastmesh.ops._fp8_operands import (
    E8M0,
    check_a_scale,
    check_b_scale,
    dequantizes,
    quantize_columns,
    quantize_rows,
)
from fastmesh.ops.fp8_quantize import dequantize

E4M3 = torch.float8_e4m3fn
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8": torch.bfloat16}  # float8: out dtype
# What each dtype's cases multiply in: the --quick FP8 forms (row-wise, tensor-wise) in FP8, torch._scaled_mm.
MATMUL_DTYPES = {**TORCH_DTYPES, "float8": torch.float8_e4m3fn}
# The FP8 forms (``--fp8``), by a's scale granularity, and the config that quantizes a per row and b per output
# column in it ("block": a in 1x128 blocks, b in 128x128).
_FP8_CONFIGS = {
    "rowwise": Float8Config(granularity="rowwise"),
    "tensorwise": Float8Config(granularity="tensorwise"),
    "mx": Float8Config(granularity="mx"),
    "block": Float8Config(granularity="block1x128"),
}
FP8_GRANULARITIES = tuple(_FP8_CONFIGS)
# --quick's: the MX and block forms dequantize both operands on every call, which would lengthen CI's run.
QUICK_FP8_GRANULARITIES = ("rowwise", "tensorwise")
SHAPE_CHECK = "FASTMESH_SHAPE_CHECK"
# assert_close (rtol, atol) for unit-scale outputs. fp32: a different blocking of the same dot products. bf16 (and
# FP8's bf16 output): the rounding of the output (2^-8 relative).
_TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (1.6e-2, 1e-2), "float8": (1.6e-2, 1e-2)}

# Sizes for 1 thread per rank, gloo over loopback TCP, 2 ranks, on the 2-core dev machine: fp32 matmul ~160
# GFLOP/s per core (AVX-512), bf16 ~83 (no AMX), FP8 _scaled_mm ~35 (CPU dequantizes); gloo ~0.45-0.7 GB/s
# received per rank. comm/matmul ~ (W-1)/W * bytes/elem * flop rate / (2 * N (ag) or K (rs) * bandwidth):
# so each dtype has its own widths, spanning comm/matmul ~0.25-1 with calls of ~40-200 ms.
FULL_CASES = {
    "float32": [
        "ag:2048x4096:0:384",
        "ag:2048x4096:0:768",
        "ag:1024x4096:0:896",
        "ag:1024x4096:0:256,256,256",
        "ag:4x512x4096:1:512",
        "ag:4096x2048:-1:512",
        "rs:4096x384:0:4096",
        "rs:4096x1024:0:2048",
        "rs:4x1024x768:1:3072",
        "ar:4096x256:1024",
        "ar:2048x1024:2048",
        "ar:4x512x512:1024",
        "mg:2048x1024:1024",
        "mg:4x512x512:2048",
    ],
    "bfloat16": [
        "ag:2048x4096:0:48",
        "ag:2048x4096:0:96",
        "ag:2048x4096:0:192",
        "ag:2048x4096:0:64,64,64",
        "ag:4x512x4096:1:128",
        "ag:4096x2048:-1:128",
        "rs:4096x128:0:4096",
        "rs:4096x256:0:4096",
        "rs:4x1024x192:1:4096",
        "ar:4096x128:1024",
        "ar:4096x256:1024",
        "ar:4x1024x128:1024",
        "mg:4096x256:1024",
        "mg:4x1024x128:2048",
    ],
    "float8": [
        "ag:2048x4096:0:16",
        "ag:2048x4096:0:32",
        "ag:4x512x4096:1:32",
        "rs:4096x64:0:4096",
        "rs:4x1024x64:1:4096",
        "ar:4096x64:1024",
    ],
}
QUICK_CASES = {
    "float32": [
        "ag:1024x2048:0:512",
        "ag:2x256x2048:1:128,128,128",
        "rs:2048x512:0:2048",
        "ar:1024x256:512",
        "mg:1024x256:512",
    ],
    "bfloat16": ["ag:1024x2048:0:128", "rs:2048x128:0:2048", "ar:1024x128:512", "mg:1024x128:512"],
    "float8": ["ag:1024x2048:0:32", "rs:2048x64:0:2048", "ar:1024x64:512"],
}


@dataclass(frozen=True)
class Spec:
    op: str
    shape: tuple  # this rank's a_shard (all_gather_matmul) or a (the others)
    dim: int  # gather_dim / scatter_dim, as given (may be negative); -1 for matmul_all_reduce
    ns: tuple  # columns of each b
    pieces: int = 0  # the fused op's piece count (0: its automatic choice)

    def label(self):
        repeated = len(self.ns) > 1 and len(set(self.ns)) == 1
        ns = f"{len(self.ns)}x{self.ns[0]}" if repeated else ",".join(map(str, self.ns))
        pieces = f" pieces={self.pieces}" if self.pieces else ""
        dim = f" d{self.dim}" if _KIND_OF_OP[self.op].HAS_DIM else ""
        return f"{self.op} [{', '.join(map(str, self.shape))}]{dim} N={ns}{pieces}"


def parse_spec(spec: str, world: int = 2, family: str = "fused_collectives") -> Spec:
    """A ``--case`` spec of ``family`` (see the module docstring); ValueError says the expected form."""
    try:
        fields = spec.split(":")
        kind = _KINDS[fields[0]]
        if not kind.HAS_DIM:  # the product moves whole
            fields.insert(2, "-1")
        _, shape, dim, ns, *pieces = fields
        if len(pieces) > 1:
            raise ValueError
        parsed = Spec(
            kind.OP,
            tuple(int(s) for s in shape.split("x")),
            int(dim),
            tuple(int(n) for n in ns.split(",")),
            int(pieces[0]) if pieces else 0,
        )
    except (KeyError, ValueError):
        raise ValueError(f"{family} case {spec!r}: expected {_spec_forms()}") from None
    ndim = len(parsed.shape)
    if parsed.pieces < 0:
        raise ValueError(f"{family} case {spec!r}: PIECES must be >= 0 (0: the op's automatic count)")
    if ndim < 2 or not -ndim <= parsed.dim < ndim or min(parsed.shape) <= 0:
        raise ValueError(f"{family} case {spec!r}: the shape needs >= 2 positive dims and dim in [{-ndim}, {ndim})")
    if min(parsed.ns) <= 0:
        raise ValueError(f"{family} case {spec!r}: every N must be >= 1, got {','.join(map(str, parsed.ns))}")
    if not kind.MANY_BS and len(parsed.ns) != 1:
        raise ValueError(f"{family} case {spec!r}: {parsed.op} takes one b")
    problem = kind.spec_problem(parsed, world)
    if problem:
        raise ValueError(f"{family} case {spec!r}: {problem}")
    return parsed


def _spec_forms() -> str:
    """The case forms, from the kinds: e.g. ``"ag|rs:DxDx..:dim:N[,N..][:PIECES]" or "ar:DxDx..:N[:PIECES]"``."""
    with_dim = "|".join(code for code, kind in _KINDS.items() if kind.HAS_DIM)
    without_dim = "|".join(code for code, kind in _KINDS.items() if not kind.HAS_DIM)
    forms = [f'"{with_dim}:DxDx..:dim:N[,N..][:PIECES]"'] if with_dim else []
    forms += [f'"{without_dim}:DxDx..:N[:PIECES]"'] if without_dim else []
    return " or ".join(forms) + ', e.g. "ag:2048x4096:0:384", "ag:2048x4096:0:384:4" or "ar:4096x256:1024"'


def _random(shape, dtype, seed, device, scale=1.0):
    # Normal values: never zero, so a dropped or misplaced block cannot pass the check.
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device=device, dtype=dtype)


def exchange(group, sends, receives):
    """sends[j] to rank j and receives[j] from rank j, for every other rank j (fastmesh's gloo transport)."""
    world, rank = group.size(), group.rank()
    works = []
    for step in range(1, world):
        to, source = (rank + step) % world, (rank - step) % world
        works.append(dist.isend(sends[to], dist.get_global_rank(group, to), group=group))
        works.append(dist.irecv(receives[source], dist.get_global_rank(group, source), group=group))
    for work in works:
        work.wait()


def cpu_share(fn, group, repeats=3):
    """CPU time over wall time of ``fn`` on the busiest rank (all of this process's threads)."""
    dist.barrier(group=group)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    share = torch.tensor([(time.process_time() - cpu) / (time.perf_counter() - wall)])
    dist.all_reduce(share, op=dist.ReduceOp.MAX, group=group)
    return share.item()


def _fp8_rows(x, granularity):
    """x [..., K] quantized along its rows in the FP8 form ``granularity``: data and a's scale."""
    return quantize_rows(x, E4M3, _FP8_CONFIGS[granularity])


def _fp8_columns(b, granularity):
    """b [K, N] quantized per output column in the FP8 form ``granularity``: column-major data and b's scale."""
    return quantize_columns(b, E4M3, _FP8_CONFIGS[granularity])


def _dequantizes(a_ops, b_ops, column_part=None) -> bool:
    """Whether the fused op multiplies these FP8 operands (each (data, scale)) into bf16 by dequantizing both (MX
    or block scales torch does not take: the op's own rule, ``column_part`` its), rather than through
    torch._scaled_mm; the baselines then do the same."""
    (a, a_scale), (b, b_scale) = a_ops, b_ops
    layouts = check_a_scale(a_scale, a, "bench"), check_b_scale(b_scale, b, "bench")
    return dequantizes(a.dtype, b, layouts, torch.bfloat16, column_part)


def multiply_path(dequantized: list[bool]) -> str:
    """How the FP8 contenders multiply (the note and each row's details say it), per b."""
    paths = ["dequantize to bf16 + torch.matmul" if d else "torch._scaled_mm" for d in dequantized]
    return " / ".join(dict.fromkeys(paths))


def _scaled_matmuls(a, a_scale, b_ops, outs, dequantized):
    """The baselines' multiply of FP8 ``a [..., K]`` by each FP8 ``b [K, N]`` of ``b_ops`` ((data, scale) each) into
    ``outs``, as the fused op multiplies these layouts: where ``dequantized`` (per b), a (once) and b dequantized
    to the output dtype, then torch.matmul; else torch._scaled_mm."""
    a_values = dequantize(a, a_scale, outs[0].dtype) if any(dequantized) else None
    rows = a.reshape(-1, a.shape[-1])
    scale = a_scale if a_scale.dim() == 0 else a_scale.reshape(-1, a_scale.shape[-1])
    for (b, b_scale), out, dequantize_b in zip(b_ops, outs, dequantized):
        if dequantize_b:
            torch.matmul(a_values, dequantize(b, b_scale, out.dtype), out=out)
        else:
            _scaled_mm(rows, scale, b, b_scale, out.view(-1, out.shape[-1]))
    return outs


def _scaled_mm(a2d, a_scale, b, b_scale, out):
    """The baselines' scaled matmul, in its fastest form: as fastmesh's (csrc/fused/scaled.h), tensor-wise scales
    go the row-wise way on CPU, where torch's tensor-wise CPU path can be oneDNN's reference kernel (~300x
    slower on CPUs with AVX512-FP16)."""
    if a_scale.dim() and a_scale.shape[1] > 1:  # 1x128 x 128x128 block scales
        return _block_scaled_mm(a2d, a_scale, b, b_scale, out)
    rowwise = a_scale.dim() or b_scale.dim() or (a2d.device.type == "cpu" and rowwise_scaled_mm_on_cpu())
    if rowwise:
        a_scale = a_scale.expand(a2d.shape[0], 1).contiguous()
        b_scale = b_scale.expand(1, b.shape[1]).contiguous()
    return torch._scaled_mm(a2d, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out.dtype, out=out)


def _block_scaled_mm(a2d, a_scale, b, b_scale, out):
    """torch._scaled_mm's 1x128 x 128x128 block form as fastmesh calls it (csrc/fused/scaled.h: scales
    column-major, M padded to a multiple of 4)."""
    m, pad = a2d.shape[0], -a2d.shape[0] % 4
    a2d = torch.nn.functional.pad(a2d.view(torch.uint8), (0, 0, 0, pad)).view(a2d.dtype)
    a_scale = torch.nn.functional.pad(a_scale, (0, 0, 0, pad), value=1.0).t().contiguous().t()
    b_scale = b_scale.t().contiguous().t()
    if pad == 0:
        return torch._scaled_mm(a2d, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out.dtype, out=out)
    return out.copy_(torch._scaled_mm(a2d, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out.dtype)[:m])


class _Runner:
    """The contenders of one case: one subclass per kind of case (op).

    A kind sets ``CODE`` (the spec's prefix), ``OP`` (``Spec.op``, the fastmesh front), ``FUSED_OPS`` (the
    ``torch.ops.fastmesh`` names of its high-precision and FP8 ops: the plan that ``plan_taken`` reports),
    ``HAS_DIM`` (whether the spec names a gathered / scattered dim) and ``MANY_BS`` (whether it takes several b),
    and defines the contenders ``fastmesh``, ``unfused``, ``comm``, ``matmul``, ``p2p`` and ``symm_mem`` (None
    where torch has no such fused op), and ``flops`` and ``comm_bytes``. Register it in ``_KINDS``.
    """

    CODE: str
    OP: str
    FUSED_OPS: tuple[str, str]  # (high precision, FP8)
    HAS_DIM = True
    MANY_BS = False
    FP8 = True  # it has an FP8 form
    symm_mem = None

    def __init__(self, spec, dtype_name, granularity, group):
        self.spec, self.group, self.world, self.rank = spec, group, group.size(), group.rank()
        self.label = spec.label() + (f" fp8 {granularity}" if granularity else "")
        self.fp8 = granularity is not None
        self.fused_op = self.FUSED_OPS[self.fp8]
        self.dequantized = [False]  # FP8: whether each b's multiply dequantizes (set by the kind, from its operands)

    @classmethod
    def spec_problem(cls, spec: Spec, world: int) -> str | None:
        """Why ``spec`` cannot run on ``world`` ranks (beyond the checks every kind shares), or None."""
        return None

    def atol_factor(self, dtype_name: str) -> int:
        """How many times its unit-scale atol (``_TOLERANCES``) the fused result may differ by."""
        return 1

    def check(self, dtype_name, candidate=None):
        """``candidate`` (default: the fused op) against the unfused sequence."""
        candidate = candidate or self.fastmesh
        got = candidate()
        several = isinstance(got, (list, tuple))  # one output per b
        got = [t.clone() for t in got] if several else [got.clone()]
        want = self.unfused()
        want = list(want) if several else [want]
        rtol, atol = _TOLERANCES[dtype_name]
        atol *= self.atol_factor(dtype_name)
        for i, (g, w) in enumerate(zip(got, want)):
            output = f", output {i}" if several else ""
            torch.testing.assert_close(
                g,
                w,
                rtol=rtol,
                atol=atol,
                msg=lambda m, output=output: f"rank {self.rank}, {self.label}, {candidate.__name__}{output}: {m}",
            )


class _Gather(_Runner):
    """all_gather_matmul contenders of one case."""

    CODE, OP = "ag", "all_gather_matmul"
    FUSED_OPS = ("fastmesh::all_gather_matmul", "fastmesh::all_gather_scaled_matmul")
    MANY_BS = True

    def __init__(self, spec, dtype_name, granularity, group, device):
        super().__init__(spec, dtype_name, granularity, group)
        world, rank = self.world, self.rank
        self.all_gather = all_gather_into
        dtype = TORCH_DTYPES[dtype_name]
        self.dim = spec.dim % len(spec.shape)
        k = spec.shape[-1] * (world if self.dim == len(spec.shape) - 1 else 1)
        a_shard = _random(spec.shape, dtype, 1000 + rank, device)
        # The weights are replicated: the same seed on every rank; scaled for unit-scale outputs.
        bs = [_random((k, n), dtype, 7 + i, device, k**-0.5) for i, n in enumerate(spec.ns)]
        self.full_shape = list(spec.shape)
        self.full_shape[self.dim] *= world
        self.outs = [torch.empty((*self.full_shape[:-1], n), dtype=dtype, device=device) for n in spec.ns]
        if self.fp8:
            data, scale = _fp8_rows(a_shard, granularity)
            if granularity == "tensorwise":
                # One scale for the whole gathered tensor, as torchao's TP makes it (an all-reduced amax).
                dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
                data = fastmesh.fp8.quantize(a_shard, dtype=E4M3, granularity="tensorwise", scale=scale).data
            self.a_data, self.a_scale = data, scale
            self.b_ops = [_fp8_columns(b, granularity) for b in bs]
            self.dequantized = [_dequantizes((data, scale), b_op) for b_op in self.b_ops]
            self.shard = data.view(torch.uint8)  # gloo cannot gather FP8 dtypes: their bytes travel
            # Per-row scales (row-wise, MX, block) travel with their rows; e8m0 ones as bytes too.
            per_row = granularity != "tensorwise"
            self.scale_shard = scale.view(torch.uint8) if scale.dtype == E8M0 else scale
            self.scale_gathered = (
                torch.empty((world * scale.shape[0], *scale.shape[1:]), dtype=self.scale_shard.dtype, device=device)
                if per_row
                else None
            )
            self.scale_full = (
                torch.empty((*self.full_shape[:-1], scale.shape[-1]), dtype=self.scale_shard.dtype, device=device)
                if per_row and self.dim
                else None
            )
        else:
            self.bs, self.shard, self.scale_gathered = bs, a_shard, None
        self.gathered = torch.empty((world * spec.shape[0], *spec.shape[1:]), dtype=self.shard.dtype, device=device)
        self.a_full = None if self.dim == 0 else torch.empty(self.full_shape, dtype=self.shard.dtype, device=device)
        self.local_full = _random(self.full_shape, dtype, 2000 + rank, device)
        if self.fp8:
            self.local_full = _fp8_rows(self.local_full, granularity)
        self.received = list(torch.empty_like(self.gathered).chunk(world))
        self.flops = 2 * sum(self.outs[0].numel() // self.outs[0].shape[-1] * k * n for n in spec.ns)
        self.comm_bytes = self.gathered.numel() * self.gathered.element_size()

    def fastmesh(self):
        if self.fp8:
            return torch.ops.fastmesh.all_gather_scaled_matmul(
                self.a_data,
                self.a_scale,
                [d for d, _ in self.b_ops],
                [s for _, s in self.b_ops],
                self.spec.dim,
                self.group.group_name,
                torch.bfloat16,
                False,
                self.spec.pieces,
            )[2]
        return fastmesh.all_gather_matmul(
            self.shard, self.bs, self.spec.dim, group=self.group, pieces=self.spec.pieces or None
        )[1]

    def comm(self):
        self.all_gather(self.gathered, self.shard, group=self.group)
        if self.scale_gathered is not None:
            self.all_gather(self.scale_gathered, self.scale_shard, group=self.group)

    def _reorder(self, gathered, full):
        """c10d gathers rank-major along dim 0: the rank blocks moved to dim (into ``full``)."""
        if self.dim == 0:
            return gathered
        full.unflatten(self.dim, (self.world, -1)).copy_(gathered.unflatten(0, (self.world, -1)).movedim(0, self.dim))
        return full

    def unfused(self):
        self.comm()
        return self.multiply_gathered()

    def multiply_gathered(self):
        """The unfused sequence after the all-gather into ``gathered`` (and ``scale_gathered``)."""
        a_full = self._reorder(self.gathered, self.a_full)
        if not self.fp8:
            for b, out in zip(self.bs, self.outs):
                torch.matmul(a_full, b, out=out)
            return self.outs
        if self.scale_gathered is None:
            scale = self.a_scale
        else:
            scale = self._reorder(self.scale_gathered, self.scale_full).view(self.a_scale.dtype)
        return _scaled_matmuls(a_full.view(E4M3), scale, self.b_ops, self.outs, self.dequantized)

    def matmul(self):
        if self.fp8:
            return _scaled_matmuls(*self.local_full, self.b_ops, self.outs, self.dequantized)
        for b, out in zip(self.bs, self.outs):
            torch.matmul(self.local_full, b, out=out)
        return self.outs

    def p2p(self):
        exchange(self.group, [self.shard] * self.world, self.received)

    def atol_factor(self, dtype_name):
        # K split over ranks (the last dim gathered): partial products rounded per rank
        return self.world if self.dim == len(self.spec.shape) - 1 and dtype_name != "float32" else 1

    def symm_mem(self):
        return torch.ops.symm_mem.fused_all_gather_matmul(self.shard, self.bs, self.dim, self.group.group_name)


class _Product(_Runner):
    """A kind whose ranks multiply their own ``a [..., K]`` by their own ``b [K, N]`` into ``c`` and then move
    the product (the row-parallel linear: the products are summed over the ranks). Its ``matmul`` is that
    multiply (FP8: a per row, b per output column, bf16 out)."""

    def __init__(self, spec, dtype_name, granularity, group, device):
        super().__init__(spec, dtype_name, granularity, group)
        dtype = TORCH_DTYPES[dtype_name]
        (n,) = spec.ns
        k = spec.shape[-1]
        self.a = _random(spec.shape, dtype, 1000 + self.rank, device)
        # Each rank holds its own rows of the weight; scaled so that the sum over ranks is unit-scale.
        self.b = _random((k, n), dtype, 3000 + self.rank, device, (k * self.world) ** -0.5)
        if self.fp8:
            self.a_ops, self.b_ops = _fp8_rows(self.a, granularity), _fp8_columns(self.b, granularity)
            self.dequantized = [_dequantizes(self.a_ops, self.b_ops)]
        self.c = torch.empty((*spec.shape[:-1], n), dtype=dtype, device=device)
        self.flops = 2 * self.c.numel() * k

    def matmul(self):
        if not self.fp8:
            return torch.matmul(self.a, self.b, out=self.c)
        _scaled_matmuls(*self.a_ops, [self.b_ops], [self.c], self.dequantized)
        return self.c

    def atol_factor(self, dtype_name):
        # gloo's reductions round after every addition (and fastmesh's pieces may sum in another order); the
        # fused reduce-scatter sums in fp32 and rounds once
        return self.world if dtype_name != "float32" else 1


class _Scatter(_Product):
    """matmul_reduce_scatter contenders of one case."""

    CODE, OP = "rs", "matmul_reduce_scatter"
    FUSED_OPS = ("fastmesh::matmul_reduce_scatter", "fastmesh::scaled_matmul_reduce_scatter")

    def __init__(self, spec, dtype_name, granularity, group, device):
        super().__init__(spec, dtype_name, granularity, group, device)
        world, dtype = self.world, self.c.dtype
        self.reduce_scatter = reduce_scatter_into
        self.dim = spec.dim % self.c.dim()
        if self.fp8 and self.dim == self.c.dim() - 1:  # the op multiplies each rank's n / W columns alone
            self.dequantized = [_dequantizes(self.a_ops, self.b_ops, self.b.shape[1] // world)]
        out_shape = list(self.c.shape)
        out_shape[self.dim] //= world
        self.out = torch.empty(out_shape, dtype=dtype, device=device)
        self.send = (
            self.c if self.dim == 0 else torch.empty((world * out_shape[0], *out_shape[1:]), dtype=dtype, device=device)
        )
        self.comm_send = _random(self.send.shape, dtype, 4000 + self.rank, device)
        self.partials = list(torch.empty_like(self.comm_send).chunk(world))
        self.comm_bytes = self.send.numel() * self.send.element_size()

    @classmethod
    def spec_problem(cls, spec, world):
        scattered = (spec.shape[:-1] + spec.ns)[spec.dim]
        if scattered % world:
            return f"the scattered dim ({scattered}) must be divisible by the {world} ranks"
        return None

    def fastmesh(self):
        if self.fp8:
            (a, a_scale), (b, b_scale) = self.a_ops, self.b_ops
            return torch.ops.fastmesh.scaled_matmul_reduce_scatter(
                a, a_scale, b, b_scale, self.spec.dim, "sum", self.group.group_name, torch.bfloat16, self.spec.pieces
            )
        return fastmesh.matmul_reduce_scatter(
            self.a, self.b, self.spec.dim, group=self.group, pieces=self.spec.pieces or None
        )

    def comm(self):
        self.reduce_scatter(self.out, self.comm_send, group=self.group)

    def unfused(self):
        self.reduce_scatter(self.out, self.product_blocks(), group=self.group)
        return self.out

    def product_blocks(self):
        """The unfused sequence before the reduce-scatter: the product, laid out as c10d scatters it."""
        self.matmul()
        if self.dim != 0:  # c10d scatters rank-major blocks of dim 0: bring dim's blocks there
            self.send.unflatten(0, (self.world, -1)).copy_(
                self.c.unflatten(self.dim, (self.world, -1)).movedim(self.dim, 0)
            )
        return self.send

    def p2p(self):
        exchange(self.group, list(self.comm_send.chunk(self.world)), self.partials)

    def symm_mem(self):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(self.a, self.b, "sum", self.dim, self.group.group_name)


class _AllReduce(_Product):
    """matmul_all_reduce contenders of one case (FP8: ``scaled_matmul_all_reduce``, bf16 out). fastmesh moves the
    product with the group's own all-reduce on every backend, so ``p2p`` is that all-reduce too."""

    CODE, OP = "ar", "matmul_all_reduce"
    FUSED_OPS = ("fastmesh::matmul_all_reduce", "fastmesh::scaled_matmul_all_reduce")
    HAS_DIM = False  # the product is reduced whole

    def __init__(self, spec, dtype_name, granularity, group, device):
        super().__init__(spec, dtype_name, granularity, group, device)
        self.zeros = torch.zeros_like(self.c)  # what comm() reduces: zeros stay zeros however often it runs
        self.comm_bytes = self.c.numel() * self.c.element_size()

    def fastmesh(self):
        if self.fp8:
            (a, a_scale), (b, b_scale) = self.a_ops, self.b_ops
            return torch.ops.fastmesh.scaled_matmul_all_reduce(
                a, a_scale, b, b_scale, "sum", self.group.group_name, torch.bfloat16, self.spec.pieces
            )
        return fastmesh.matmul_all_reduce(self.a, self.b, group=self.group, pieces=self.spec.pieces or None)

    def comm(self):
        dist.all_reduce(self.zeros, group=self.group)

    p2p = comm

    def unfused(self):
        dist.all_reduce(self.matmul(), group=self.group)
        return self.c

    # symm_mem: None (torch's symm_mem has no fused matmul + all-reduce)


class _ProductGather(_Product):
    """matmul_all_gather contenders of one case: every rank's product gathered along its columns (the LM head).
    No FP8 form (``skipped``)."""

    CODE, OP = "mg", "matmul_all_gather"
    FUSED_OPS = ("fastmesh::matmul_all_gather", "fastmesh::matmul_all_gather")
    HAS_DIM = False  # the columns are gathered
    FP8 = False

    def __init__(self, spec, dtype_name, granularity, group, device):
        super().__init__(spec, dtype_name, granularity, group, device)
        rows, n = self.c.numel() // self.c.shape[-1], self.c.shape[-1]
        self.gathered = torch.empty((self.world * rows, n), dtype=self.c.dtype, device=device)  # rank-major
        self.out = torch.empty((*self.c.shape[:-1], self.world * n), dtype=self.c.dtype, device=device)
        self.comm_send = _random(self.c.shape, self.c.dtype, 4000 + self.rank, device).view(rows, n)
        self.received = list(torch.empty_like(self.gathered).chunk(self.world))
        self.comm_bytes = self.gathered.numel() * self.gathered.element_size()

    def fastmesh(self):
        return fastmesh.matmul_all_gather(self.a, self.b, group=self.group, pieces=self.spec.pieces or None)

    def comm(self):
        all_gather_into(self.gathered, self.comm_send, group=self.group)

    def unfused(self):
        rows, n = self.comm_send.shape
        all_gather_into(self.gathered, self.matmul().view(rows, n), group=self.group)
        # c10d stacks the ranks along dim 0: rank j's rows go to column block j
        self.out.view(rows, self.world, n).copy_(self.gathered.view(self.world, rows, n).transpose(0, 1))
        return self.out

    def p2p(self):
        exchange(self.group, [self.comm_send] * self.world, self.received)

    def atol_factor(self, dtype_name):
        return 1  # each rank's product as it is: no sums over ranks


_KINDS = {kind.CODE: kind for kind in (_Gather, _Scatter, _AllReduce, _ProductGather)}  # the spec's prefix: its kind
_KIND_OF_OP = {kind.OP: kind for kind in _KINDS.values()}


def _checked(fused):
    """``fused()`` with the cross-rank shape check on (C++ reads the variable on every call)."""
    previous = os.environ.get(SHAPE_CHECK)
    os.environ[SHAPE_CHECK] = "every"
    try:
        return fused()
    finally:
        if previous is None:
            del os.environ[SHAPE_CHECK]
        else:
            os.environ[SHAPE_CHECK] = previous


def _symm_mem_note(ctx: Context, runner) -> str | None:
    """Why PyTorch's symm_mem fused op is not a contender here, or None when it is."""
    if runner.symm_mem is None:
        return f"symm_mem baseline not run for {runner.spec.op}: torch's symm_mem has no such fused op"
    if ctx.device.type != "cuda":
        return "symm_mem baseline not run: torch's symm_mem fused ops need CUDA GPUs (they have no CPU kernel)"
    if runner.fp8:
        return "symm_mem baseline not run for FP8 (torch's fused scaled ops take other scale layouts)"
    try:
        # Every torch fastmesh supports (2.11+) enables a group's symmetric memory on first use: the old
        # enable_symm_mem_for_group call is deprecated (2.14) and proposed for removal.
        runner.symm_mem()
    except Exception as error:  # any failure: the baseline is reported as not run, with torch's reason
        return f"symm_mem baseline not run: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


def cases(ctx: Context, full: dict, quick: dict, fp8_granularities: tuple = FP8_GRANULARITIES):
    """(spec, dtype name, FP8 granularity or None) of each case: the --case specs, else ``quick`` or ``full``'s
    specs of each dtype; float8 in each of ``fp8_granularities``."""
    for dtype_name in ctx.measured_dtypes(MATMUL_DTYPES):
        for spec in ctx.cases or (quick if ctx.quick else full)[dtype_name]:
            for granularity in fp8_granularities if dtype_name == "float8" else (None,):
                yield parse_spec(spec, ctx.group.size(), ctx.family), dtype_name, granularity


def case_params(spec: Spec, granularity: str | None, world: int) -> dict:
    """A row's params: what reproduces the case."""
    return {
        "op": spec.op,
        "shape": list(spec.shape),
        "dim": spec.dim,
        "ns": list(spec.ns),
        "pieces": spec.pieces,
        "granularity": granularity,
        "world": world,
    }


def rowwise_scaled_mm_on_cpu() -> bool:
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return version >= (2, 13)


def skipped(spec: Spec, granularity: str | None, device: torch.device) -> str | None:
    """Why a case cannot run here (the family notes it), or None."""
    if granularity == "rowwise" and device.type == "cpu" and not rowwise_scaled_mm_on_cpu():
        return f"{spec.label()} float8 rowwise skipped: torch < 2.13 has no row-wise _scaled_mm on CPU"
    if granularity and not _KIND_OF_OP[spec.op].FP8:
        return f"{spec.label()} float8 skipped: {spec.op} has no FP8 form"
    if granularity and spec.op == "all_gather_matmul" and spec.dim % len(spec.shape) == len(spec.shape) - 1:
        return f"{spec.label()} float8 skipped: the FP8 form gathers rows only (gather_dim before the last)"
    if granularity == "mx" and spec.shape[-1] % MX_BLOCK:  # every kind's FP8 form contracts a's last dim
        return (
            f"{spec.label()} float8 mx skipped: MX scales need the contraction dim (K = {spec.shape[-1]}) to be a "
            f"multiple of {MX_BLOCK}"
        )
    return None


def plan_taken(runner) -> dict | None:
    """The plan of the fused op's latest call (the timed calls': a key's plan is decided once per process), or None
    where the op plans nothing (one rank)."""
    last = plans.last_decision(runner.fused_op)
    if last is None:
        return None
    _, decision = last
    return {"label": decision.plan.label, "source": decision.source, "decision": decision.describe()}


def run(ctx: Context) -> None:
    granularities = ctx.fp8 or (QUICK_FP8_GRANULARITIES if ctx.quick else FP8_GRANULARITIES)
    todo = list(cases(ctx, FULL_CASES, QUICK_CASES, granularities))
    ctx.expect(len(todo))
    gloo = ctx.device.type == "cpu"
    for spec, dtype_name, granularity in todo:
        reason = skipped(spec, granularity, ctx.device)
        if reason:
            ctx.note(reason)
            continue
        runner = _KIND_OF_OP[spec.op](spec, dtype_name, granularity, ctx.group, ctx.device)
        runner.check(dtype_name)
        if runner.fp8:
            ctx.note(
                f"float8 {granularity}: fastmesh, unfused and matmul multiply by {multiply_path(runner.dequantized)}"
            )
        candidates = {"fastmesh": runner.fastmesh, "checked": functools.partial(_checked, runner.fastmesh)}
        candidates["unfused"] = runner.unfused
        symm_note = _symm_mem_note(ctx, runner)
        if symm_note is None:
            candidates["symm_mem"] = runner.symm_mem
        else:
            ctx.note(symm_note)
        candidates.update(comm=runner.comm, matmul=runner.matmul)
        if gloo:
            candidates["p2p"] = runner.p2p
        timings = time_slowest_rank(candidates, ctx.group, ctx.warmup, ctx.repeats, ctx.clock)
        flops = (runner.flops, "flops")
        contenders = {
            "fastmesh": Contender("kernel", timings["fastmesh"], *flops),
            "checked": Contender("variant", timings["checked"], *flops),
            "unfused": Contender("baseline", timings["unfused"], *flops),
            **({"symm_mem": Contender("baseline", timings["symm_mem"], *flops)} if "symm_mem" in timings else {}),
            "comm": Contender("part", timings["comm"], runner.comm_bytes, "bytes"),
            "matmul": Contender("part", timings["matmul"], *flops),
            "bound": Contender("bound", [max(c, m) for c, m in zip(timings["comm"], timings["matmul"])], *flops),
        }
        details = {}
        if gloo:
            share = cpu_share(runner.p2p, ctx.group)
            contenders["p2p"] = Contender("part", timings["p2p"], runner.comm_bytes, "bytes")
            contenders["cpu_bound"] = Contender(
                "bound", [m + share * t for m, t in zip(timings["matmul"], timings["p2p"])], *flops
            )
            details["p2p_cpu_share"] = share
        if runner.fp8:
            details["multiply"] = multiply_path(runner.dequantized)
        label = runner.label
        params = case_params(spec, granularity, ctx.group.size())
        ctx.emit(
            Case(
                "fused_collectives",
                label,
                dtype_name,
                "fastmesh",
                contenders,
                params=params,
                extra_ratios={"comm_over_matmul": ("comm", "matmul"), "checked_over_fastmesh": ("checked", "fastmesh")},
                details=details,
                plan=plan_taken(runner),
            )
        )


FAMILY = Family(
    "fused_collectives",
    "all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce (fp32, bf16, FP8) and matmul_all_gather (fp32, "
    "bf16) against the unfused "
    "collective sequence and max(comm, matmul)",
    distributed=True,
    dtypes=tuple(TORCH_DTYPES),
    run=run,
    parse_case=parse_spec,
)

"""Hostile values (NaN, +-inf, the dtype's largest finite values, subnormals, all zeros) end to end.

* ``fastmesh.fp8.quantize`` (the C++ CPU kernel): every granularity, e4m3fn and e5m2, fp32 / bf16 / fp16 input,
  current and given scale, transposed copy: bit for bit the reference, and the contract of docs/fp8.md checked on
  its own (a group holding NaN or inf dequantizes to NaN, every element of it; other groups finite and within
  FP8 rounding; a given scale saturates, NaN stays NaN; all-zero groups give data 0 and scale 1).
* The high-precision fused ops on 2 ranks, every piece count: output elements are NaN / +-inf exactly where the
  unfused sequence has them, and the finite ones equal it (inputs in {-1, 0, 1} and hostile rows built so that
  every sum is exact whatever its order).
* Their FP8 forms (``fp8=``, tensor-wise and row-wise): non-finite exactly where quantize -> collective ->
  dequantize -> matmul has it, which covers every non-finite element of the high-precision result (nothing
  saturated into a finite product); huge finite values stay finite and at FP8 accuracy.
* The TP styles (a linear pair, a Llama block; FP8 too), forward and backward: NaN in the input reaches the same
  output and gradient elements as torch's native plan.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from fastmesh.kernels import fp8_reference as ref
from fastmesh.kernels import fused_reference
from rank_pool import on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_support import ROWWISE_ON_CPU
from tp_models import LinearPair

import fastmesh
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel
from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
INPUTS = (torch.float32, torch.bfloat16, torch.float16)
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
FP8_MIN_NORMAL = {E4M3: 2.0**-6, E5M2: 2.0**-14}
FP8_SUBNORMAL_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16}
NAN, INF = math.nan, math.inf
# torch < 2.13 runs only tensor-wise scales in torch._scaled_mm on CPU.
FP8_GRANULARITIES = ("tensorwise", "rowwise") if ROWWISE_ON_CPU else ("tensorwise",)


@pytest.fixture
def one_thread():
    """Many small tensors: on a busy 2-core machine torch's intra-op threads made these checks ~100x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal (infinities with their sign), or both NaN."""
    return (got == want) | (got.isnan() & want.isnan())


def assert_same(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (case, got.shape, want.shape, got.dtype, want.dtype)
    match = same(got, want)
    if not bool(match.all()):
        bad = (~match).nonzero()[:5].tolist()
        raise AssertionError(
            f"{case}: {int((~match).sum())} of {got.numel()} elements differ, e.g. at {bad}: "
            f"{[got[tuple(i)].item() for i in bad]} vs {[want[tuple(i)].item() for i in bad]}"
        )


# ---- quantize ----

SHAPE = (257, 260)  # block128x128: 3 x 3 tiles, the last row and column of tiles partial; block1x128: 3 per row
GROUP = {"tensorwise": SHAPE, "rowwise": (1, SHAPE[1]), "block1x128": (1, 128), "block128x128": (128, 128)}
KINDS = ("nan", "inf", "nan and inf", "huge", "subnormal", "zeros", "mixed")


def hostile(kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A [257, 260] tensor of ordinary values (~N(0, 16)) with hostile values of one kind, or (``"mixed"``) of
    every kind in groups of their own for every granularity but tensor-wise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=generator) * 4
    info, tiny = torch.finfo(dtype), smallest_subnormal(dtype)
    subnormals = torch.randint(-3, 4, SHAPE, generator=generator).float() * tiny
    if kind == "nan":
        x[5, 7] = x[140, 200] = NAN
    elif kind == "inf":
        x[9, 130], x[200, 3] = INF, -INF
    elif kind == "nan and inf":  # one group with both (NaN wins), and an infinity alone
        x[5, 7], x[5, 8], x[140, 140] = NAN, INF, -INF
    elif kind == "huge":  # the dtype's largest finite values beside ordinary ones
        x[140, 3], x[141, 60], x[20, 259] = info.max, -info.max, info.max
    elif kind == "subnormal":  # the whole tensor: every group's amax is subnormal
        x = subnormals
    elif kind == "zeros":
        x = torch.zeros(SHAPE)
    elif kind == "mixed":
        x[5, 7], x[9, 130], x[20, 259] = NAN, INF, -INF  # tiles (0, 0), (0, 1), (0, 2); rows 5, 9, 20
        x[140, 3], x[141, 60] = info.max, -info.max  # tile (1, 0)
        x[200] = subnormals[200]  # a subnormal row
        x[250] = 0.0  # an all-zero row
        x[256, :128], x[256, 128:] = subnormals[256, :128], 0.0  # tile (2, 0) subnormal, tiles (2, 1), (2, 2) zero
    else:
        raise ValueError(kind)
    return x.to(dtype)


def per_element(per_group: torch.Tensor, granularity: str, shape) -> torch.Tensor:
    """A per-group tensor (scale layout) broadcast to every element of the ``[rows, cols]`` matrix."""
    rows, cols = shape
    group_rows, group_cols = (rows, cols) if granularity == "tensorwise" else GROUP[granularity]
    grid = per_group.reshape(1, 1) if per_group.dim() == 0 else per_group.reshape(-1, per_group.shape[-1])
    return grid.repeat_interleave(group_rows, 0)[:rows].repeat_interleave(group_cols, 1)[:, :cols]


def given_scale(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> torch.Tensor:
    """A stale scale: half of what each group's finite values need, so that its largest values saturate. At
    least the smallest normal fp32 value (from 2^-128 down the multiplier 1 / scale is inf)."""
    finite_amax = ref.group_amax(x.float().nan_to_num(0.0, 0.0, 0.0), granularity)
    scale = (finite_amax / ref.FP8_MAX[dtype] / 2).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(finite_amax == 0, torch.ones_like(scale), scale)


def check_current_scaling(x, data, scale, dtype, granularity, case) -> dict:
    """The contract of current scaling on its own, for one output (``x`` as [M, K]). Returns which group classes
    the case met."""
    amax = ref.group_amax(x, granularity)
    bad = per_element(~amax.isfinite(), granularity, x.shape)
    zero = per_element(amax == 0, granularity, x.shape)
    element_scale = per_element(scale, granularity, x.shape).double()
    dequantized = data.double() * element_scale
    assert bool(dequantized[bad].isnan().all()), f"{case}: a group with NaN or inf must dequantize to NaN"
    assert bool(data[~bad].float().isfinite().all()) and bool(element_scale[~bad].isfinite().all()), case
    assert bool((element_scale[~bad] > 0).all()), f"{case}: a finite group's scale must be positive"
    assert bool((data[zero].float() == 0).all()) and bool((element_scale[zero] == 1).all()), f"{case}: zero group"
    # Finite groups: every element within FP8 rounding (nothing clipped), relative in the normal FP8 range,
    # absolute (half the subnormal step, scaled) below it.
    fp8_max, exact = ref.FP8_MAX[dtype], x.double()
    scaled = exact.abs() / element_scale
    normal = ~bad & (scaled >= FP8_MIN_NORMAL[dtype])
    error = (dequantized - exact).abs()
    assert bool((data.float().abs()[~bad] <= fp8_max).all()), case
    relative = 2.0 ** -(MANTISSA_BITS[dtype] + 1) + 2.0**-20
    assert bool((error[normal] <= relative * exact.abs()[normal]).all()), f"{case}: finite values not at FP8 accuracy"
    small = ~bad & ~normal
    assert bool((error[small] <= (FP8_SUBNORMAL_STEP[dtype] / 2 + 2.0**-30) * element_scale[small]).all()), case
    tiny_amax = (amax > 0) & (amax < torch.finfo(torch.float32).smallest_normal)
    return {"non-finite": bool(bad.any()), "zero": bool(zero.any()), "tiny amax": bool(tiny_amax.any())}


def check_given_scale(x, data, scale, dtype, case) -> None:
    """The contract with a given scale (``scale`` per element): NaN stays NaN at its own element, infinities and
    values beyond ``scale * fp8_max`` saturate to +-fp8_max (e5m2 too), everything else is finite."""
    fp8_max = ref.FP8_MAX[dtype]
    values = data.float()
    assert bool((values.isnan() == x.isnan()).all()), f"{case}: NaN must stay NaN, and only there"
    assert bool(values[~x.isnan()].isfinite().all()), f"{case}: nothing but NaN may be non-finite"
    beyond = (x.float() * torch.reciprocal(scale)).abs() > fp8_max  # inf included
    assert bool((values[beyond] == fp8_max * x.float()[beyond].sign()).all()), f"{case}: must saturate"


def quantize_cases():
    for kind, input_dtype, dtype, granularity in itertools.product(KINDS, INPUTS, FP8, ref.GRANULARITIES):
        if kind == "mixed" and granularity == "tensorwise":
            continue  # one group: the same as "nan and inf"
        yield kind, input_dtype, dtype, granularity


@pytest.mark.parametrize("granularity", ref.GRANULARITIES)
def test_quantize_matches_reference_and_contract(granularity, one_thread):
    met = {"non-finite": 0, "zero": 0, "tiny amax": 0, "saturated": 0}
    for seed, (kind, input_dtype, dtype, _) in enumerate(c for c in quantize_cases() if c[3] == granularity):
        x = hostile(kind, input_dtype, seed)
        case = f"{kind}, {input_dtype} -> {dtype}, {granularity}"
        # Current scaling, with the transposed copy.
        got = fastmesh.fp8.quantize(x, dtype=dtype, granularity=granularity, transpose=True)
        want = ref.quantize(x, dtype, granularity, transpose=True)
        for name, g, w in zip(("data", "scale", "amax", "data_t", "scale_t"), got, want):
            match = ref.fp8_bits_equal(g, w) if g.dtype in FP8 else same(g, w)
            assert bool(match.all()), f"{case}: {name} differs from the reference at {(~match).nonzero()[:5].tolist()}"
        for classes in (
            check_current_scaling(x, got.data, got.scale, dtype, granularity, case),
            check_current_scaling(x.t(), got.data_t, got.scale_t, dtype, granularity, f"{case} (transposed)"),
        ):
            for name, hit in classes.items():
                met[name] += hit
        # A given (stale) scale: with the transposed copy where the groups of x.t() are those of x transposed.
        scale = given_scale(x, dtype, granularity)
        transpose = granularity in ("tensorwise", "block128x128")
        got = fastmesh.fp8.quantize(x, dtype=dtype, granularity=granularity, scale=scale, transpose=transpose)
        want = ref.quantize(x, dtype, granularity, scale=scale, transpose=transpose)
        assert bool(ref.fp8_bits_equal(got.data, want.data).all()), f"{case}, given scale: data"
        assert bool(same(got.scale, want.scale).all()) and bool(same(got.amax, want.amax).all()), case
        assert bool((got.amax.isfinite() == ref.group_amax(x, granularity).isfinite()).all()), case
        element_scale = per_element(scale, granularity, x.shape)
        check_given_scale(x, got.data, element_scale, dtype, f"{case}, given scale")
        if transpose:
            assert bool(ref.fp8_bits_equal(got.data_t, want.data_t).all()), f"{case}, given scale: data_t"
            check_given_scale(x.t(), got.data_t, element_scale.t(), dtype, f"{case}, given scale, transposed")
        met["saturated"] += bool(((x.float() / element_scale).abs() > ref.FP8_MAX[dtype]).any())
    assert all(met.values()), f"the cases must meet every class: {met}"


def test_all_zero_and_all_subnormal_tensors():
    """Spelled out: an all-zero tensor gives data 0 and scale 1; an all-subnormal one a finite, positive scale
    (the multiplier clamped to FLT_MAX) and finite data, for every granularity and format."""
    for granularity, dtype in itertools.product(ref.GRANULARITIES, FP8):
        zeros = fastmesh.fp8.quantize(torch.zeros(3, 130), dtype=dtype, granularity=granularity)
        assert bool((zeros.data.float() == 0).all()) and bool((zeros.scale == 1).all()), (granularity, dtype)
        x = torch.full((3, 130), smallest_subnormal(torch.float32)) * torch.arange(130).float().remainder(5)
        tiny = fastmesh.fp8.quantize(x, dtype=dtype, granularity=granularity)
        assert bool(tiny.scale.isfinite().all()) and bool((tiny.scale > 0).all()), (granularity, dtype)
        assert bool(tiny.data.float().isfinite().all()), (granularity, dtype)
        flt_max = torch.tensor(torch.finfo(torch.float32).max)
        assert bool((tiny.scale == torch.reciprocal(flt_max)).all()), (granularity, dtype)


def test_given_scale_saturates_e5m2_and_infinities():
    """With a given scale an infinity saturates (e4m3fn and e5m2 alike, unlike ``.to(torch.float8_e5m2)``), and
    the returned amax says so: the recipe sees the overflow."""
    x = torch.tensor([[INF, -INF, 1e30, 1.0, NAN]])
    for dtype in FP8:
        fp8_max = ref.FP8_MAX[dtype]
        q = fastmesh.fp8.quantize(x[:, :4], dtype=dtype, granularity="tensorwise", scale=torch.ones(()))
        assert q.data.float().tolist() == [[fp8_max, -fp8_max, fp8_max, 1.0]] and q.amax.item() == INF
        q = fastmesh.fp8.quantize(x, dtype=dtype, granularity="rowwise", scale=torch.ones(1, 1))
        assert q.data.float()[0, :4].tolist() == [fp8_max, -fp8_max, fp8_max, 1.0] and q.data.float()[0, 4].isnan()
        assert q.amax.isnan().item()


# ---- the high-precision fused ops ----

ROWS, K, N = 9, 8, 10  # rows per rank block (pieces=3 cuts it into 3 rows each); b's columns
HOSTILE_ROWS = {"nan": 0, "huge": 2, "+inf": 4, "subnormal": 6, "-inf": 8}  # one in each piece of 3 rows
PIECES = (None, 1, 2, 3)
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Where the hostile values are: in a on rank 0 or 1, in a on both (the infinities' signs swapped on rank 1, so
# that sums over ranks meet +inf and -inf), in b (on rank 0; on every rank where b is replicated).
PLACES = ("a on rank 0", "a on rank 1", "a on both", "b")


def ternary(shape, seed, dtype) -> torch.Tensor:
    return torch.randint(-1, 2, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def with_hostile_rows(a: torch.Tensor, nonfinite: bool, finite: bool, flip: bool = False) -> torch.Tensor:
    """``a`` ([blocks * 9, cols], values in {-1, 0, 1}) with, in every block of 9 rows, a NaN, a +inf and a -inf
    in rows of their own (``nonfinite``; ``flip``: the infinities' signs swapped), a row of zeros and two of the
    dtype's largest values, and a row of subnormals (``finite``; otherwise those rows are zeros). Then every dot
    product with {-1, 0, 1} and every sum over ranks is exact, or the same non-finite value, in any order: no
    sum adds ordinary values to a huge or a subnormal one, and none holds more than two huge terms."""
    a = a.clone()
    info, tiny = torch.finfo(a.dtype), smallest_subnormal(a.dtype)
    sign = -1 if flip else 1
    for block in a.split(ROWS):
        rows = {kind: row for kind, row in HOSTILE_ROWS.items() if row < len(block)}  # a last, short block
        for kind in ("huge", "subnormal"):
            if kind in rows:
                block[rows[kind]] = 0
        values = {"nan": NAN, "+inf": sign * INF, "-inf": -sign * INF}
        for kind, column in (("nan", 1), ("+inf", -3), ("-inf", 2)):
            if nonfinite and kind in rows:
                block[rows[kind], column] = values[kind]
        if finite and "huge" in rows:
            block[rows["huge"], 0] = block[rows["huge"], -1] = info.max
        if finite and "subnormal" in rows:
            block[rows["subnormal"]] = ternary(block.shape[1:], 99, torch.float32).to(a.dtype) * tiny
    return a


def operands(a_shape, b_shape, dtype, place, rank, b_replicated):
    """The operands of one call, hostile where ``place`` says (b's hostile values in columns of their own)."""
    a = ternary(a_shape, rank, dtype)
    b = ternary(b_shape, 10 if b_replicated else 10 + rank, dtype)
    both = place == "a on both"
    in_a = place == f"a on rank {rank}" or (both and rank == 0)
    a = with_hostile_rows(a, nonfinite=in_a or both, finite=in_a, flip=both and rank == 1)
    in_b = place == "b" and (b_replicated or rank == 0)
    b = with_hostile_rows(b.t(), nonfinite=in_b, finite=in_b).t()
    return a, b


def _world_name() -> str:
    return dist.group.WORLD.group_name


def hp_cases(rank: int, world: int):
    """(label, fused(pieces), reference()) for every op and form, dtype and place."""
    name = _world_name()
    for dtype, place in itertools.product(HP_DTYPES, PLACES):
        tag = f"{dtype}, hostile values in {place}"
        a, b = operands((ROWS, K), (K, N), dtype, place, rank, b_replicated=True)
        yield (
            f"all_gather_matmul rows, {tag}",
            lambda pieces, a=a, b=b: fastmesh.all_gather_matmul(a, [b], 0, return_a=True, pieces=pieces),
            lambda a=a, b=b: fused_reference.all_gather_matmul(a, [b], 0, name, return_a=True),
        )
        a, b = operands((ROWS, K), (world * K, N), dtype, place, rank, b_replicated=True)
        yield (
            f"all_gather_matmul contraction, {tag}",
            lambda pieces, a=a, b=b: fastmesh.all_gather_matmul(a, [b], -1, pieces=pieces)[1],
            lambda a=a, b=b: fused_reference.all_gather_matmul(a, [b], -1, name)[1],
        )
        a, b = operands((world * ROWS, K), (K, N), dtype, place, rank, b_replicated=False)
        for dim, reduce_op in ((0, "sum"), (-1, "sum"), (0, "avg")):
            yield (
                f"matmul_reduce_scatter dim {dim} {reduce_op}, {tag}",
                lambda pieces, a=a, b=b, d=dim, op=reduce_op: fastmesh.matmul_reduce_scatter(
                    a, b, d, reduce_op=op, pieces=pieces
                ),
                lambda a=a, b=b, d=dim, op=reduce_op: fused_reference.matmul_reduce_scatter(a, b, d, op, name),
            )
        a, b = operands((ROWS, K), (K, N), dtype, place, rank, b_replicated=False)
        for reduce_op in ("sum", "avg"):
            yield (
                f"matmul_all_reduce {reduce_op}, {tag}",
                lambda pieces, a=a, b=b, op=reduce_op: fastmesh.matmul_all_reduce(a, b, reduce_op=op, pieces=pieces),
                lambda a=a, b=b, op=reduce_op: _all_reduced(a @ b, op),
            )
        yield (
            f"matmul_all_gather, {tag}",
            lambda pieces, a=a, b=b: fastmesh.matmul_all_gather(a, b, pieces=pieces),
            lambda a=a, b=b: fused_reference.all_gather(a @ b, -1, name),
        )


def _all_reduced(c: torch.Tensor, reduce_op: str) -> torch.Tensor:
    c = c.clone()
    dist.all_reduce(c)
    return c / dist.get_world_size() if reduce_op == "avg" else c


def _as_list(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list):
        return result
    gathered, outs = result
    return ([gathered] if gathered is not None else []) + list(outs)


@on_ranks(2)
def test_fused_ops_propagate_like_the_unfused_sequence():
    """Every op, form and piece count: NaN, +inf and -inf exactly where the unfused sequence has them, the
    finite elements (huge and subnormal ones among them) equal to it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    met = dict.fromkeys(("nan", "inf", "huge", "subnormal", "ordinary"), 0)
    for label, fused, reference in hp_cases(rank, world):
        want = _as_list(reference())
        flat = torch.cat([w.flatten() for w in want])
        info = torch.finfo(flat.dtype)
        magnitude = flat.float().abs()
        met["nan"] += bool(flat.isnan().any())
        met["inf"] += bool(flat.isinf().any())
        met["huge"] += bool(((magnitude >= float(info.max) / 4) & magnitude.isfinite()).any())
        met["subnormal"] += bool(((magnitude > 0) & (magnitude < info.smallest_normal)).any())
        met["ordinary"] += bool(((magnitude >= 1) & (magnitude <= 2 * K)).any())
        for pieces in PIECES:
            for i, (got, w) in enumerate(zip(_as_list(fused(pieces)), want)):
                assert_same(got, w, f"{label}, pieces {pieces}, output {i}")
    # Not vacuous: the references met every kind of result (counted per case, over all cases).
    assert all(met.values()), met


# ---- the FP8 forms (fp8=) ----

FP8_K, FP8_N = 32, 16


def randn(shape, seed, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dequantized_rows(x: torch.Tensor, config) -> torch.Tensor:
    """``x`` ([..., K]) quantized per row (or tensor-wise) by the reference and dequantized, in float64."""
    q = ref.quantize(x.reshape(-1, x.shape[-1]), config.dtype, config.granularity)
    return (q.data.double() * q.scale.double()).reshape(x.shape)


def fp8_fronts(a, b, config):
    """(name, the front with fp8=config, its FP8 reference, its high-precision reference): the references
    quantize -> collective -> dequantize -> matmul and collective -> matmul in float64."""
    name = _world_name()
    da, db = dequantized_rows(a, config), dequantized_rows(b.t(), config).t()
    ha, hb = a.double(), b.double()
    return (
        (
            "all_gather_matmul",
            lambda: fastmesh.all_gather_matmul(a, [b], 0, fp8=config)[1][0],
            lambda: fused_reference.all_gather(da, 0, name) @ db,
            lambda: fused_reference.all_gather(ha, 0, name) @ hb,
        ),
        (
            "matmul_reduce_scatter",
            lambda: fastmesh.matmul_reduce_scatter(a, b, 0, fp8=config),
            lambda: fused_reference.reduce_scatter(da @ db, 0, name),
            lambda: fused_reference.reduce_scatter(ha @ hb, 0, name),
        ),
        (
            "matmul_all_reduce",
            lambda: fastmesh.matmul_all_reduce(a, b, fp8=config),
            lambda: _all_reduced(da @ db, "sum"),
            lambda: _all_reduced(ha @ hb, "sum"),
        ),
    )


def assert_like_fp8_reference(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    """Non-finite (NaN, +-inf) exactly where the FP8 reference is; finite elements equal to it up to the output
    dtype's rounding (and the fp32 sums'), far below FP8's own error."""
    scale = want[want.isfinite()].abs().max() if bool(want.isfinite().any()) else 1.0
    rtol = 1e-5 if got.dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(
        got.double(), want, rtol=rtol, atol=rtol * float(scale), equal_nan=True, msg=lambda m: f"{case}: {m}"
    )


def fp8_hostile_operands(kind: str, rank: int, dtype):
    a = randn((2 * 8, FP8_K), seed=rank, dtype=dtype)
    b = randn((FP8_K, FP8_N), seed=10, dtype=dtype)
    if kind == "NaN in a on rank 0" and rank == 0:
        a[3, 5] = NAN
    if kind == "inf in a on rank 1" and rank == 1:
        a[12, 0] = INF
    if kind == "-inf in b on rank 0" and rank == 0:
        b[7, 4] = -INF
    return a, b


@on_ranks(2)
def test_fp8_fronts_never_give_a_finite_wrong_answer():
    """NaN or inf in an input: the FP8 forms are non-finite exactly where quantize -> collective -> dequantize ->
    matmul is (the whole scaling group's products: its row, its column, or every element for tensor-wise), which
    holds every non-finite element of the high-precision result; the finite elements are the reference's."""
    rank = dist.get_rank()
    kinds = ("NaN in a on rank 0", "inf in a on rank 1", "-inf in b on rank 0")
    for granularity, dtype, kind in itertools.product(FP8_GRANULARITIES, (torch.bfloat16, torch.float32), kinds):
        config = fastmesh.fp8.Float8Config(granularity=granularity)
        a, b = fp8_hostile_operands(kind, rank, dtype)
        for name, front, fp8_reference, hp_reference in fp8_fronts(a, b, config):
            case = f"{name}, {granularity}, {dtype}, {kind}"
            got, want, hp = front(), fp8_reference(), hp_reference()
            assert_like_fp8_reference(got, want, case)
            covered = ~hp.isfinite() <= ~got.isfinite()
            assert bool(covered.all()), f"{case}: a non-finite high-precision result came out finite"
            assert bool(got.isfinite().any()) or granularity == "tensorwise", case


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return (10 * torch.log10(want.pow(2).sum() / (got.double() - want).pow(2).sum())).item()


# Measured (2 ranks, e4m3, torch 2.14): 27.6-30.1 dB in every case; a wrong scale or row is around 0 dB or below.
HUGE_FLOOR_DB = 25.0
HUGE_CASES = (  # (label, activation scale, weight scale): high-precision results ~1e31 and ~1e35, finite
    ("huge activations", 1e30, 1.0),
    ("huge weights", 1.0, 1e30),
)
NEAR_THE_TOP = (("activations near the top of fp32", 1e36, 0.01),)  # results ~1e35


def _huge_fronts(granularity: str, cases) -> None:
    rank = dist.get_rank()
    config = fastmesh.fp8.Float8Config(granularity=granularity)
    for (label, a_scale, b_scale), dtype in itertools.product(cases, (torch.bfloat16, torch.float32)):
        a = randn((2 * 8, FP8_K), seed=rank) * a_scale
        b = randn((FP8_K, FP8_N), seed=10) * b_scale
        for name, front, fp8_reference, hp_reference in fp8_fronts(a.to(dtype), b.to(dtype), config):
            case = f"{name}, {granularity}, {dtype}, {label}"
            got, hp = front(), hp_reference()
            assert bool(hp.isfinite().all()), case
            assert bool(got.isfinite().all()), f"{case}: {int((~got.isfinite()).sum())} of {got.numel()} non-finite"
            assert_like_fp8_reference(got, fp8_reference(), case)
            print(f"{case}: {sqnr_db(got, hp):.1f} dB")
            assert sqnr_db(got, hp) > HUGE_FLOOR_DB, case


@on_ranks(2)
def test_fp8_fronts_keep_huge_finite_values_finite():
    """Current scaling maps huge finite values onto the FP8 range: the results stay finite and at FP8 accuracy
    (SQNR against the high-precision result)."""
    for granularity in FP8_GRANULARITIES:
        _huge_fronts(granularity, HUGE_CASES + (NEAR_THE_TOP if granularity == "rowwise" else ()))


@on_ranks(2)
def test_fp8_tensorwise_keeps_results_near_the_top_of_fp32_finite():
    # torch's CPU _scaled_mm applies a tensor-wise scale_a before the products and scale_b after them, so
    # (a * scale_a) @ b_data overflowed fp32 although the result is finite; csrc/fused/scaled.h applies both after.
    _huge_fronts("tensorwise", NEAR_THE_TOP)


# ---- the TP styles ----


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()].clone()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(module, x, grad_out, *args):
    """Forward and backward: (output, input gradient, every parameter's full gradient by name)."""
    x = x.clone().requires_grad_()
    y = module(x, *args)
    (y * grad_out).sum().backward()
    return [y.detach(), x.grad] + [_full(p.grad) for _, p in sorted(module.named_parameters())]


def _pair_plans(sequence_parallel: bool):
    """(torch's styles, fastmesh's styles) for the pair, sequence-parallel (sequence dim 1) or plain TP."""
    if sequence_parallel:
        native = {"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
        fused = {
            "up": FusedColwiseParallel(input_layouts=Shard(1)),
            "down": FusedRowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        native = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        fused = {"up": FusedColwiseParallel(), "down": FusedRowwiseParallel()}
    return native, fused


def _hostile_tokens(x: torch.Tensor) -> torch.Tensor:
    """NaN, +inf and -inf in three tokens of ``x`` ([B, S, D]), on different ranks' sequence shards."""
    x = x.clone()
    x[0, 1, 3], x[1, -2, 0], x[1, 2, 7] = NAN, INF, -INF
    return x


@on_ranks(2)
def test_styles_propagate_like_torchs_plan():
    """A colwise -> rowwise pair (values in {-1, 0, 1}: every sum exact) with NaN, +inf and -inf in the input and
    NaNs in the output's gradient: the fused styles' output, input gradient and parameter gradients are NaN /
    +-inf exactly where torch's ColwiseParallel / RowwiseParallel plan and the unsharded pair have them, the
    finite elements equal."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    world = dist.get_world_size()
    for dtype, sequence_parallel in itertools.product((torch.float32, torch.bfloat16), (True, False)):
        torch.manual_seed(0)
        unsharded = LinearPair(12, 4 * world, dtype)
        with torch.no_grad():
            for i, p in enumerate(unsharded.parameters()):
                p.copy_(ternary(p.shape, 30 + i, dtype))
        x = _hostile_tokens(ternary((2, 4 * world, 12), 40, dtype))
        grad_out = ternary(x.shape, 41, dtype)
        grad_out[0, 0, 4] = grad_out[1, -1, 4] = NAN  # NaN gradients, in other tokens (on both ranks' shards)
        part = (lambda t: _shard(t, 1)) if sequence_parallel else (lambda t: t)
        want = _step(unsharded, x, grad_out)
        want[:2] = [part(t) for t in want[:2]]
        native, fused = _pair_plans(sequence_parallel)
        names = ["output", "grad x"] + sorted(n for n, _ in unsharded.named_parameters())
        for plan_name, plan in (("native", native), ("fastmesh", fused)):
            got = _step(parallelize_module(copy.deepcopy(unsharded), mesh, plan), part(x), part(grad_out))
            for name, g, w in zip(names, got, want):
                assert_same(g, w, f"{plan_name} plan, {dtype}, sequence_parallel={sequence_parallel}: {name}")
        nonfinite = [int((~w.isfinite()).sum()) for w in want]
        assert nonfinite[0] and nonfinite[1] and sum(nonfinite[2:]), nonfinite  # not vacuous


@on_ranks(2)
def test_fp8_styles_cover_every_non_finite_element():
    """FP8 styles (sequence-parallel; row-wise and tensor-wise): every element that is non-finite under torch's
    high-precision plan is non-finite under the FP8 plan too (nothing saturated into a finite value), forward and
    backward. Row-wise, the forward output is non-finite in exactly the hostile tokens (a token is a row group)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    world = dist.get_world_size()
    torch.manual_seed(0)
    unsharded = LinearPair(32, 16 * world, torch.bfloat16)
    x = _hostile_tokens(randn((2, 4 * world, 32), 50, torch.bfloat16))
    grad_out = randn(x.shape, 51, torch.bfloat16)
    native, _ = _pair_plans(sequence_parallel=True)
    want = _step(parallelize_module(copy.deepcopy(unsharded), mesh, native), _shard(x, 1), _shard(grad_out, 1))
    names = ["output", "grad x"] + sorted(n for n, _ in unsharded.named_parameters())
    for granularity in FP8_GRANULARITIES:
        config = fastmesh.fp8.Float8Config(granularity=granularity)
        plan = {
            "up": FusedColwiseParallel(input_layouts=Shard(1), fp8=config),
            "down": FusedRowwiseParallel(output_layouts=Shard(1), fp8=config),
        }
        got = _step(parallelize_module(copy.deepcopy(unsharded), mesh, plan), _shard(x, 1), _shard(grad_out, 1))
        for name, g, w in zip(names, got, want):
            covered = ~w.isfinite() <= ~g.isfinite()
            assert bool(covered.all()), f"{granularity}: {name}: a non-finite element came out finite"
        if granularity == "rowwise":
            hostile_tokens = ~_shard(x, 1).isfinite().all(dim=-1, keepdim=True).expand_as(got[0])
            assert bool((~got[0].isfinite() == hostile_tokens).all()), "row-wise: non-finite outside hostile tokens"
            finite = got[0].isfinite()
            assert sqnr_db(got[0][finite], want[0][finite]) > 20, "row-wise: the ordinary tokens' outputs"


@on_ranks(2)
def test_llama_block_propagates_like_torchs_plan():
    """A NaN in one token of a Llama block's input (fp32) reaches every token of its sequence (torch's CPU
    attention masks the causal scores by adding -inf, and NaN + -inf is NaN), not the other sequence; the fused
    plans' outputs and gradients are NaN where torch's plans' are, and close to them elsewhere (sequence-parallel
    and plain TP)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    world = dist.get_world_size()
    args = LlamaArgs(dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=16 * world)
    torch.manual_seed(0)
    unsharded = Block(args)
    seq_len = 4 * world
    x = randn((2, seq_len, args.dim), 60)
    x[0, 3, 5] = NAN
    grad_out = randn(x.shape, 61)
    rope = rope_tables(seq_len, args.head_dim, args.rope_theta)
    runs = {}
    for plan in ("native", "fastmesh", "native-plain", "fastmesh-plain"):
        part = (lambda t: t) if plan.endswith("plain") else (lambda t: _shard(t, 1))
        block = parallelize_module(copy.deepcopy(unsharded), mesh, block_plan(plan))
        runs[plan] = _step(block, part(x), part(grad_out), rope)
    for fused, native in (("fastmesh", "native"), ("fastmesh-plain", "native-plain")):
        for i, (got, want) in enumerate(zip(runs[fused], runs[native])):
            torch.testing.assert_close(
                got, want, rtol=2e-5, atol=2e-5, equal_nan=True, msg=lambda m: f"{fused} vs {native}, {i}: {m}"
            )
    output = runs["native-plain"][0]
    assert bool(output[0].isnan().any()) and bool(output[1].isfinite().all()), "the other sequence stays finite"

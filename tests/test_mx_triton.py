"""The Triton MX cast (kernels/mx_quantize.py) against kernels/mx_reference.py, on CPU.

It runs like tests/test_fp8_triton.py (its docstring says why): a plain pytest run compiles the kernel for sm_90
(checking the instructions the interpreter cannot) and runs this file again in a ``TRITON_INTERPRET=1`` child,
where the kernel tests run; ``TRITON_INTERPRET=1 pytest tests/test_mx_triton.py`` runs them in-process.

The E8M0 scale bytes and the fp32 block amax must equal the reference's bit for bit. So must the FP8 data, except
where the interpreter's own fp32 -> fp8 conversion is not round-to-nearest-even: ``test_fp8_triton.check_fp8``
compares the kernel's bytes with the interpreter's conversion of the reference's fp32 values
(``mx_reference.scaled_values``) and accepts differences from the reference only in the conversion's known defect
classes. Inputs are ``test_mx.planted`` blocks (zeros, subnormals, the format's max and its neighbours, the rules'
powers of two and values a few ulps off them, the dtype's extremes, +-inf, NaN) and the blocks built below.
:func:`test_wrong_kernels_are_caught` runs mutated kernels and checks that the comparison fails.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re

import pytest
import torch
from test_fp8_triton import CATEGORIES, MET, check_fp8, fp8_name, interpreter_conversion
from test_mx import planted
from triton_interpreter import INTERPRETED, run_module_under_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON:
    # Module globals: the mutated kernels of test_wrong_kernels_are_caught look triton.language up here.
    import triton
    import triton.language as tl

pytestmark = [
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed"),
    # The interpreter evaluates kernels in numpy, which warns on inf * 0 and the like.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child started by test_kernel_under_triton_interpreter"
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUNDINGS = ("floor", "rceil")
# Odd row counts, rows past one 64-row tile, K past one 128-column tile (288 = 2 * 128 + 32), 1-D, 3-D, empty.
SHAPES = [(1, 32), (3, 96), (33, 160), (130, 288), (2, 5, 64), (32,), (7, 0)]
# 32 divides the rows; 96 and 160 rows end in a partial 64-row tile.
TRANSPOSE_SHAPES = [(32, 32), (96, 160), (2, 16, 64), (160, 288), (0, 64)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.triton_interpreter
def test_kernel_under_triton_interpreter():
    run_module_under_interpreter(__file__)


def test_kernel_compiles_for_hopper():
    """No GPU needed: compile specializations for sm_90 and check what the interpreter cannot: rceil's IEEE
    division (``div.rn.f32``; Triton's ``/`` is approximate), floor's none, the hardware's saturating RNE
    conversion, and multiplies that keep subnormals (floor scales a subnormal block by 2^126)."""
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process; compiled in the plain pytest run")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    from fastmesh.kernels import mx_quantize as mq

    cases = [
        (mq._mx_transpose_kernel, "*bf16", E4M3, True, dict(BLOCK_M=64, BLOCK_K=128)),
        (mq._mx_flat_kernel, "*fp32", E5M2, False, dict(BLOCKS=mq._FLAT_BLOCKS)),
    ]
    for kernel, x_type, fp8, rceil, tile in cases:
        signature = {}
        for param in kernel.params:
            if param.is_constexpr:
                signature[param.name] = "constexpr"
            elif param.name == "x_ptr":
                signature[param.name] = x_type
            elif param.name.startswith("data"):
                signature[param.name] = "*fp8e4nv" if fp8 == E4M3 else "*fp8e5"
            elif param.name.startswith("scale"):
                signature[param.name] = "*u8"
            elif param.name.endswith("_ptr"):
                signature[param.name] = "*fp32"
            else:
                signature[param.name] = "i32"
        constants = dict(RCEIL=rceil, FP8_MAX=mq.FP8_MAX[fp8], EMAX=mq._EMAX[fp8], **tile)
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        divisions = set(re.findall(r"\b(?:div|rcp)\.[\w.]*f32", ptx))
        assert divisions == ({"div.rn.f32"} if rceil else set()), (constants, divisions)
        assert f"cvt.rn.satfinite.{'e4m3' if fp8 == E4M3 else 'e5m2'}x2.f32" in ptx, constants
        assert re.search(r"\bmul\.(rn\.)?f32", ptx) and not re.search(r"\bmul\.[\w.]*ftz", ptx), constants


# ------------------------------------------------------------------------------------------------
# Everything below runs only under the interpreter.
# ------------------------------------------------------------------------------------------------


@functools.cache
def modules():
    """(kernels/mx_quantize.py, kernels/mx_reference.py), imported under the interpreter."""
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    import triton
    from fastmesh.kernels import mx_quantize, mx_reference

    if not isinstance(mx_quantize._mx_flat_kernel, triton.runtime.interpreter.InterpretedFunction):
        pytest.skip("mx_quantize was imported before TRITON_INTERPRET=1 took effect")
    return mx_quantize, mx_reference


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float8_e8m0fnu and actual.shape == expected.shape, (what, actual.dtype, actual.shape)
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    if not torch.equal(a, e):
        where = (a != e).nonzero()[:4].tolist()
        pairs = [(int(a[tuple(i)]), int(e[tuple(i)])) for i in where]
        pytest.fail(f"{what}: {int((a != e).sum())} E8M0 bytes differ (kernel, reference) at {where}: {pairs}")


def assert_f32_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, (what, actual.dtype, actual.shape)
    same = (actual.view(torch.int32) == expected.view(torch.int32)) | (actual.isnan() & expected.isnan())
    if not bool(same.all()):
        where = (~same).nonzero()[:4].tolist()
        pairs = [(actual[tuple(i)].item(), expected[tuple(i)].item()) for i in where]
        pytest.fail(f"{what}: {int((~same).sum())} values differ (kernel, reference) at {where}: {pairs}")


def check_mx(x: torch.Tensor, dtype: torch.dtype, rounding: str, transpose: bool = False) -> dict[str, int]:
    """Run the kernel and the reference and compare every output; returns the interpreter-defect counts."""
    mq, mx = modules()
    got = mq.quantize(x, dtype, rounding, transpose)
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(rows, k)
    want = mx.quantize_mx(x2, dtype, rounding, transpose)
    tag = f"{rounding} {fp8_name(dtype)} x={dtype_name(x.dtype)} {tuple(x.shape)} transpose={transpose}"
    scale_shape = (*x.shape[:-1], k // 32)
    assert_bytes_equal(got.scale, want.scale.reshape(scale_shape), f"{tag}: scale")
    assert_f32_equal(got.amax, want.amax.reshape(scale_shape), f"{tag}: amax")
    values = mx.scaled_values(x2, want.scale.view(torch.uint8).int(), dtype, rounding)
    counts = check_fp8(got.data, values.reshape(x.shape), want.data.reshape(x.shape), dtype, f"{tag}: data")
    if transpose:
        assert_bytes_equal(got.scale_t, want.scale_t, f"{tag}: scale_t")
        values_t = mx.scaled_values(x2.t().contiguous(), want.scale_t.view(torch.uint8).int(), dtype, rounding)
        for category, n in check_fp8(got.data_t, values_t, want.data_t, dtype, f"{tag}: data_t").items():
            counts[category] += n
    else:
        assert got.data_t is None and got.scale_t is None, tag
    return counts


def mx_input(shape, x_dtype: torch.dtype, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``test_mx.planted`` with its NaNs made the canonical quiet NaN. Its bf16 NaNs may carry a payload (0xFFFF),
    which the kernel carries through the multiply, and the interpreter's conversion turns a NaN whose top mantissa
    bits are set into a number (0xFFFF -> -256 in e4m3); the hardware writes NaN (bench/gpu_check_fp8.py)."""
    x = planted(shape, x_dtype, dtype, seed)
    return torch.where(x.isnan(), torch.full_like(x, math.nan), x)


def seed_of(*parts) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(repr(parts))) % 2**31


def next_toward(x: torch.Tensor, direction: int) -> torch.Tensor:
    """Each (positive, finite) value's neighbour in its own dtype, one ulp up (+1) or down (-1)."""
    int_dtype = torch.int32 if x.dtype == torch.float32 else torch.int16
    return (x.view(int_dtype) + direction).view(x.dtype)


def rule_edges(x_dtype: torch.dtype, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One block of 32 per row whose amax (at a random place, random sign) is a power of two 2^e, fp8_max * 2^e,
    or one ulp of x's dtype either side of them, for every e whose value is finite and not zero in x's dtype;
    the rest of the block random below the amax. These are where floor's and rceil's exponents step."""
    finfo = torch.finfo(x_dtype)
    lowest = math.floor(math.log2(finfo.smallest_normal * finfo.eps))
    exponents = torch.arange(lowest, math.floor(math.log2(finfo.max)) + 1, dtype=torch.float64)
    fp8_max = 448.0 if dtype == E4M3 else 57344.0
    bases = torch.cat([torch.exp2(exponents), fp8_max * torch.exp2(exponents)])
    bases = bases[(bases <= finfo.max) & (bases >= finfo.smallest_normal * finfo.eps)].to(x_dtype)
    amax = torch.cat([bases, next_toward(bases, 1), next_toward(bases, -1)])
    amax = amax[torch.isfinite(amax.float()) & (amax.float() > 0)]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(amax.numel(), 32, generator=g).to(x_dtype) * amax[:, None]
    blocks = blocks * torch.where(torch.rand(blocks.shape, generator=g) < 0.5, -1.0, 1.0).to(x_dtype)
    where = torch.randint(0, 32, (amax.numel(),), generator=g)
    sign = torch.where(torch.rand(amax.numel(), generator=g) < 0.5, -1.0, 1.0).to(x_dtype)
    blocks[torch.arange(amax.numel()), where] = amax * sign
    return blocks


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=fp8_name)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_matches_reference(rounding, dtype, x_dtype):
    """Planted blocks on odd and even shapes (partial tiles along both dims, 1-D, 3-D, empty), rows and columns."""
    counts = {"carry": 0}
    for shape in SHAPES:
        x = mx_input(shape, x_dtype, dtype, seed_of(shape, rounding, x_dtype))
        counts["carry"] += check_mx(x, dtype, rounding)["carry"]
    for shape in TRANSPOSE_SHAPES:
        x = mx_input(shape, x_dtype, dtype, seed_of("t", shape, rounding, x_dtype))
        counts["carry"] += check_mx(x, dtype, rounding, transpose=True)["carry"]
    if interpreter_conversion(dtype)[0] == "model":
        # Some random values meet the carry defect: the exemption must not be vacuous.
        assert counts["carry"] > 0, counts


@needs_interpreter
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=fp8_name)
def test_rule_edges(dtype, x_dtype):
    """amax at, one ulp above and one below every power of two and fp8_max times every power of two of the
    input dtype (subnormal and largest included), both rules, rows and (32 rows at a time) columns."""
    blocks = rule_edges(x_dtype, dtype, seed_of("edges", dtype, x_dtype))
    rows = blocks.shape[0] // 32 * 32
    for rounding in ROUNDINGS:
        check_mx(blocks, dtype, rounding)
        # The same blocks as columns: a [32, rows] x whose column j is block j.
        columns = blocks[:rows].t().contiguous()
        check_mx(columns, dtype, rounding, transpose=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=fp8_name)
def test_special_blocks(dtype):
    """The rules' corner cases spelled out, block by block: all zeros, all subnormal, amax at the format's max,
    an infinite element, a NaN beside finite values; then the same against the reference, columns too."""
    mq, _ = modules()
    fp8_max = 448.0 if dtype == E4M3 else 57344.0
    emax = 8 if dtype == E4M3 else 15
    x = torch.zeros(32, 32)
    x[1] = 1e-40
    x[2, 0] = fp8_max
    x[3, 0] = math.inf
    x[4, 0] = math.nan
    x[4, 1] = 3.0
    # floor: amax's exponent minus emax (0 for a zero or subnormal amax, inf's field 255 reads 2^128);
    # rceil: ceil(log2(amax / fp8_max)), 0xFE for inf. NaN: 0xFF in both.
    expected = {"floor": [0, 0, 127, 255 - emax, 0xFF], "rceil": [0, 0, 127, 0xFE, 0xFF]}
    for rounding in ROUNDINGS:
        q = mq.quantize(x, dtype, rounding)
        assert q.scale.view(torch.uint8)[:5, 0].tolist() == expected[rounding], rounding
        assert q.data[3, 0].float() == fp8_max, rounding  # inf saturates beside a finite scale
        # floor divides a NaN block by infinity (finite elements become 0), rceil multiplies it by NaN. (The
        # interpreter writes an e4m3 NaN as 0x7C, which check_mx accepts.)
        if dtype == E5M2:
            assert q.data[4, 0].float().isnan(), rounding
            assert q.data[4, 1].float().isnan() if rounding == "rceil" else q.data[4, 1].float() == 0, rounding
        elif rounding == "floor":
            assert q.data[4, 1].float() == 0
        assert (q.data[0].float() == 0).all(), rounding
        assert q.amax[3, 0] == math.inf and q.amax[4, 0].isnan() and q.amax[1, 0] == 1e-40, rounding
        check_mx(x, dtype, rounding, transpose=True)


@needs_interpreter
@pytest.mark.parametrize("tile", [(32, 32), (32, 64), (128, 64)], ids=str)
def test_tiles(monkeypatch, tile):
    """Other tile shapes (grids of many tiles along both dims, a K a tile does not divide, a transpose whose
    rows are fewer than one tile)."""
    mq, _ = modules()
    monkeypatch.setattr(mq, "_BLOCK_M", tile[0])
    monkeypatch.setattr(mq, "_BLOCK_K", tile[1])
    for shape, transpose in (((96, 160), True), ((3, 5, 96), False), ((32, 96), True)):
        x = mx_input(shape, torch.bfloat16, E4M3, seed_of("tiles", tile, shape))
        for rounding in ROUNDINGS:
            check_mx(x, E4M3, rounding, transpose=transpose)


@needs_interpreter
def test_non_contiguous_input():
    x = mx_input((96, 64), torch.float32, E5M2, 5).t()
    assert not x.is_contiguous()
    check_mx(x, E5M2, "rceil", transpose=True)


if HAVE_TRITON:
    # Mutants of kernels/mx_quantize.py's helpers, each wrong in one place only (the interpreter reruns a jit
    # function from its source, so they cannot close over the right ones).

    @triton.jit
    def rceil_without_the_ceiling(amax, FP8_MAX: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr):
        # floor(log2(amax / fp8_max)) for normal quotients: half the right scale wherever d is no power of two.
        d = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.where(d > 0x7F800000, 0xFF, tl.where(d == 0x7F800000, 0xFE, d >> 23))

    @triton.jit
    def floor_without_the_normal_clamp(b, RCEIL: tl.constexpr):
        # Divides a zero or subnormal block by 2^-127 rather than 2^-126: off by a factor 2 there only.
        power = ((254 - b) << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 0xFF, 0.0, power)


@needs_interpreter
def test_wrong_kernels_are_caught(monkeypatch):
    """The comparison is not vacuous: kernels with one rule wrong, and a data byte one code off where the
    interpreter's conversion is exact, fail it."""
    mq, _ = modules()
    x = mx_input((32, 96), torch.float32, E4M3, 11)
    x[5] = 1e-40 * torch.arange(1, 97)  # subnormal blocks: what the second mutant gets wrong
    for name, mutant, rounding, error, match in (
        ("_mx_scale_bits", rceil_without_the_ceiling, "rceil", pytest.fail.Exception, "E8M0 bytes differ"),
        ("_mx_multiplier", floor_without_the_normal_clamp, "floor", AssertionError, "differ from the interpreter"),
    ):
        check_mx(x, E4M3, rounding, transpose=True)
        with monkeypatch.context() as patch:
            patch.setattr(mq, name, mutant)
            with pytest.raises(error, match=match):
                check_mx(x, E4M3, rounding, transpose=True)
    # One data byte one code off, where the cast is exact: 1.0 in a block of ones is 2^8 = 0x78 in e4m3 (floor).
    _, mx = modules()
    ones = torch.ones(1, 32)
    q, want = mq.quantize(ones, E4M3, "floor"), mx.quantize_mx(ones, E4M3, "floor")
    assert bool((q.data.view(torch.uint8) == 0x78).all())
    q.data.view(torch.uint8)[0, 3] += 1
    values = mx.scaled_values(ones, want.scale.view(torch.uint8).int(), E4M3, "floor")
    with pytest.raises(AssertionError, match="differ from the interpreter's conversion"):
        check_fp8(q.data, values, want.data, E4M3, "corrupted data")


@needs_interpreter
def test_wrap_is_applied_to_the_launch():
    mq, _ = modules()
    launched = []

    def wrap(kernel):
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return kernel

    mq.quantize(torch.randn(64, 96), E4M3, "floor", True, wrap=wrap)
    mq.quantize(torch.randn(3, 32), E5M2, "rceil", wrap=wrap)
    assert launched == ["_mx_transpose_kernel", "_mx_flat_kernel"]
    launched.clear()
    q = mq.quantize(torch.randn(0, 64), E4M3, "floor", True, wrap=wrap)
    assert not launched and q.data.shape == (0, 64) and q.scale.shape == (0, 2) and q.scale_t.shape == (64, 0)


@needs_interpreter
def test_defects_were_met():
    """Runs last in file order: print how often the kernel tests met each interpreter defect."""
    if not MET:
        pytest.skip("no kernel test ran before this one (selection or ordering)")
    for dtype, counts in sorted(MET.items()):
        print(
            f"MX kernel tests, {dtype}: {counts['elements']} fp8 outputs compared; differing from the reference only "
            "by interpreter defects: " + ", ".join(f"{c} {counts[c]}" for c in CATEGORIES)
        )

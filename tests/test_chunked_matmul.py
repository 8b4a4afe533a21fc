"""The consumer GEMM of the fused all-gather+matmul (kernels/chunked_matmul.py), on CPU and, where present, GPU.

How this module runs (the pattern of tests/test_fp8_triton.py)
--------------------------------------------------------------
``TRITON_INTERPRET=1`` must be set before the kernel is defined, so there are two modes:

* plain ``pytest``: the kernel tests skip. :func:`test_kernels_under_triton_interpreter` runs this
  file in a child ``TRITON_INTERPRET=1 python -m pytest`` and fails with the child's output if the
  child fails. The plain run also checks, with no GPU, the host-side schedule, the argument checks,
  and the sm_90 compilation (the acquire load in the wait loop). Where CUDA is available it runs the
  loopback tests and the timeout test on the GPU.
* ``TRITON_INTERPRET=1 pytest tests/test_chunked_matmul.py``: the kernel tests run in-process and the
  spawning test skips.

Everything skips where triton is not installed. The interpreter runs programs one after another, so
a flag that is not set at launch stays unset. The interpreted tests pre-set the flags, or leave some
unset (with a small ``max_spins``) to test the timeout path.

Inputs: small integers ([-8, 8], K <= 257) keep fp32 accumulation exact in any summation order
(|sum| <= 64 * 257 < 2^24). The kernel must then equal the exact product rounded once to the output
dtype, bit for bit, in every dtype. bf16 and fp16 outputs above 256 / 2048 exercise the rounding.
Random inputs are judged against the error of torch's own matmul in the same precision
(:func:`assert_close_to_baseline`).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys

import pytest
import torch
from triton_interpreter import INTERPRETED, ROOT, run_module_under_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
HAVE_CUDA = torch.cuda.is_available()

pytestmark = [
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed"),
    # The interpreter evaluates kernels in numpy, which warns on the overflow to inf that a test provokes.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child started by test_kernels_under_triton_interpreter"
)
needs_cuda = pytest.mark.skipif(not HAVE_CUDA or INTERPRETED, reason="needs a CUDA GPU (and compiled kernels)")


@pytest.mark.triton_interpreter
def test_kernels_under_triton_interpreter():
    run_module_under_interpreter(__file__)


def _import_module():
    try:
        from fastmesh.kernels import chunked_matmul
    except ImportError:
        # The kernel does not depend on the rest of fastmesh: test the checkout's even if the package
        # does not import right now.
        sys.path.insert(0, str(ROOT / "kernels"))
        import chunked_matmul
    return chunked_matmul


@functools.cache
def module():
    return _import_module()


@functools.cache
def interpreted_module():
    """The module, with its kernel interpreted (skips otherwise)."""
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    import triton

    cm = module()
    if not isinstance(cm._chunked_matmul_kernel, triton.runtime.interpreter.InterpretedFunction):
        pytest.skip("chunked_matmul was imported before TRITON_INTERPRET=1 took effect")
    return cm


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------

NAN = float("nan")


def small_ints(shape, dtype, seed, low=-8, high=8):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, shape, generator=generator).to(dtype)


def exact_product(a, b):
    """The exact product rounded once to a.dtype (exact in fp64 for the small-integer inputs)."""
    return (a.double() @ b.double()).to(a.dtype)


def assert_bitwise_equal(got, expected, what=""):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (what, got.dtype, got.shape, expected.shape)
    same = (got == expected) | (got.isnan() & expected.isnan())
    if not bool(same.all()):
        index = (~same).nonzero()[:4].tolist()
        pairs = [(got[tuple(i)].item(), expected[tuple(i)].item()) for i in index]
        pytest.fail(f"{what}: {int((~same).sum())}/{got.numel()} values differ (kernel, expected) at {index}: {pairs}")


def assert_close_to_baseline(got, a, b, what=""):
    """|got - exact| <= 2 * |torch.mm(a, b) - exact| + eps(dtype) / 2 * max(|a| @ |b|), all in max-norm.

    ``exact`` is the fp64 product. torch's own matmul in the same precision shows how far a correct
    fp32-accumulating kernel lands. The factor 2 allows for the kernel's different summation order
    (BLOCK_K-wide partial sums). The last term is one output rounding at the largest magnitude. It
    covers the case where torch happens to round better. For a 16-bit output it is the order of the
    error both results carry anyway. A wrong or missing row gives errors of the size of the outputs
    themselves, hundreds of ulps above this bound.
    """
    exact = a.double() @ b.double()
    error = (got.double() - exact).abs().max().item()
    baseline = (torch.mm(a, b).double() - exact).abs().max().item()
    floor = torch.finfo(a.dtype).eps / 2 * (a.double().abs() @ b.double().abs()).max().item()
    assert error <= 2 * baseline + floor, (what, error, baseline, floor)


def untouched_rows(starts, lost, block_m, m):
    """Rows of the M-blocks that touch a lost chunk: the tiles the kernel gives up on."""
    rows = torch.zeros(m, dtype=torch.bool)
    for chunk in lost:
        lo, hi = starts[chunk], starts[chunk + 1]
        if hi > lo:
            rows[(lo // block_m) * block_m : min(-(-hi // block_m) * block_m, m)] = True
    return rows


# ------------------------------------------------------------------------------------------------
# Plain-run tests: schedule, argument checks, sm_90 compilation
# ------------------------------------------------------------------------------------------------


def _touched(starts, r0, r1):
    return [c for c in range(len(starts) - 1) if starts[c] < r1 and starts[c + 1] > r0]


@pytest.mark.parametrize(
    "starts, order, block_m, group_m",
    [
        ([0, 5, 20, 37], [2, 0, 1], 16, 2),
        ([0, 3, 3, 9, 40, 41, 100], [4, 1, 0, 5, 2, 3], 16, 3),  # an empty chunk; a tile over 3 chunks
        ([0, 64, 128, 192, 256], None, 16, 2),  # aligned, identity order
        ([0, 1000], None, 16, 8),
        ([0, 300, 301, 700, 1000], [3, 2, 1, 0], 128, 8),
    ],
)
def test_block_schedule(starts, order, block_m, group_m):
    """Every M-block once, sorted by the arrival of the last chunk it touches; groups of at most
    group_m never span two arrival keys; first/last chunk bound exactly the chunks touched."""
    cm = module()
    schedule = cm.block_schedule(starts, order, block_m=block_m, group_m=group_m)
    m = starts[-1]
    num_blocks = -(-m // block_m)
    assert schedule.dtype == torch.int32 and tuple(schedule.shape) == (num_blocks, 5)
    rows = schedule.tolist()
    position = {c: i for i, c in enumerate(order if order is not None else range(len(starts) - 1))}
    assert sorted(r[0] for r in rows) == list(range(num_blocks))
    keys = []
    for slot, (m_block, group_start, group_size, first, last) in enumerate(rows):
        touched = _touched(starts, m_block * block_m, min((m_block + 1) * block_m, m))
        assert touched and touched[0] == first and touched[-1] == last, (slot, touched, first, last)
        keys.append(max(position[c] for c in touched))
        assert group_start <= slot < group_start + group_size and 1 <= group_size <= group_m
        # Every slot of a group names the same group, and a group shares one key.
        assert all(rows[s][1:3] == [group_start, group_size] for s in range(group_start, group_start + group_size))
    assert keys == sorted(keys)
    for group_start, group_size in {(r[1], r[2]) for r in rows}:
        assert len({keys[s] for s in range(group_start, group_start + group_size)}) == 1
    # Ties keep row order (stripes of one chunk go top to bottom).
    for s in range(1, num_blocks):
        if keys[s] == keys[s - 1]:
            assert rows[s][0] > rows[s - 1][0]


def test_block_schedule_example():
    """Chunks [0,5) [5,20) [20,37) arriving 2, 0, 1 with 16-row blocks: block 2 (rows 32-36, chunk 2)
    is ready first; blocks 0 and 1 both wait for chunk 1 (the last to arrive) and form one group."""
    cm = module()
    expected = [[2, 0, 1, 2, 2], [0, 1, 2, 0, 1], [1, 1, 2, 1, 2]]
    assert (
        cm.block_schedule(torch.tensor([0, 5, 20, 37]), torch.tensor([2, 0, 1]), block_m=16, group_m=2).tolist()
        == expected
    )


def test_rejects_bad_arguments():
    """Each check names the argument. (CPU tensors: every call fails before any launch.)"""
    cm = module()
    a, b = torch.ones(10, 4), torch.ones(4, 3)
    flags = torch.ones(2, dtype=torch.int32)
    starts = [0, 4, 10]
    cases = [
        (ValueError, r"a must be 2-D \[M, K\], got shape \[10\]", dict(a=torch.ones(10))),
        (ValueError, r"b must be 2-D \[K, N\], got shape \[4, 3, 1\]", dict(b=torch.ones(4, 3, 1))),
        (
            TypeError,
            r"a must be float32, bfloat16 or float16, got torch.int32",
            dict(a=torch.ones(10, 4, dtype=torch.int32)),
        ),
        (TypeError, r"b must have a's dtype torch.float32, got torch.bfloat16", dict(b=b.bfloat16())),
        (ValueError, r"disagree on K: a is \[10, 4\], b is \[5, 3\]", dict(b=torch.ones(5, 3))),
        (ValueError, r"b must be on a's device cpu, got meta", dict(b=torch.ones(4, 3, device="meta"))),
        (
            ValueError,
            r"chunk_starts must start at 0 and end at M = 10 \(cover the rows of a\), got \[0, 4, 9\]",
            dict(chunk_starts=[0, 4, 9]),
        ),
        (ValueError, r"chunk_starts must start at 0 and end at M = 10", dict(chunk_starts=[1, 4, 10])),
        (ValueError, r"chunk_starts must be non-decreasing, got \[0, 6, 4, 10\]", dict(chunk_starts=[0, 6, 4, 10])),
        (ValueError, r"chunk_starts must hold num_chunks \+ 1 >= 2 row offsets, got \[10\]", dict(chunk_starts=[10])),
        (
            TypeError,
            r"chunk_starts must be int32 or int64, got torch.float32",
            dict(chunk_starts=torch.tensor([0.0, 4.0, 10.0])),
        ),
        (ValueError, r"chunk_starts must be 1-D, got shape \[1, 3\]", dict(chunk_starts=torch.tensor([[0, 4, 10]]))),
        (
            ValueError,
            r"flags must be an int32 tensor with one flag per chunk, shape \[2\] \(num_chunks = 2\), "
            r"got torch.int32 of shape \[3\]",
            dict(flags=torch.ones(3, dtype=torch.int32)),
        ),
        (
            ValueError,
            r"flags must be an int32 tensor .* got torch.int64 of shape \[2\]",
            dict(flags=torch.ones(2, dtype=torch.int64)),
        ),
        (
            ValueError,
            r"flags must be on a's device cpu, got meta",
            dict(flags=torch.ones(2, dtype=torch.int32, device="meta")),
        ),
        (
            ValueError,
            r"order must be a permutation of 0..num_chunks-1 \(num_chunks = 2\), got \[1, 1\]",
            dict(order=[1, 1]),
        ),
        (ValueError, r"expected must be an int in \[1, 2\*\*31 - 1\], got 0", dict(expected=0)),
        (ValueError, r"expected must be an int in \[1, 2\*\*31 - 1\], got 2147483648", dict(expected=2**31)),
        (ValueError, r"max_spins must be an int in \[0, 2\*\*31 - 1\], got -1", dict(max_spins=-1)),
        (ValueError, r"input_precision must be 'ieee' or 'tf32', got 'bf16x3'", dict(input_precision="bf16x3")),
        (
            ValueError,
            r"out must be \[rows, N\] = \[10, 3\] of dtype torch.float32, got \[3, 10\] of torch.float32",
            dict(out=torch.empty(3, 10)),
        ),
        (ValueError, r"out must be given with a row_map", dict(row_map=list(range(10)))),
        (
            ValueError,
            r"row_map must hold one row of C per row of A \(M = 10\), got 9",
            dict(row_map=list(range(9)), out=torch.empty(12, 3)),
        ),
        (
            ValueError,
            r"row_map must hold distinct rows in \[0, out_rows = 12\)",
            dict(row_map=[0] * 10, out=torch.empty(12, 3)),
        ),
        (
            ValueError,
            r"row_map must hold distinct rows in \[0, out_rows = 12\)",
            dict(row_map=list(range(3, 13)), out=torch.empty(12, 3)),
        ),
        (
            TypeError,
            r"row_map must be int32 or int64, got torch.float32",
            dict(row_map=torch.arange(10.0), out=torch.empty(12, 3)),
        ),
        (ValueError, r"max_programs must be an int in \[1, 2\*\*31 - 1\], got 0", dict(max_programs=0)),
        (
            ValueError,
            r"error must be an int32 tensor of one element, got torch.int32 of shape \[2\]",
            dict(error=torch.zeros(2, dtype=torch.int32)),
        ),
    ]
    for error_type, message, override in cases:
        kwargs = dict(a=a, b=b, flags=flags, chunk_starts=starts) | override
        with pytest.raises(error_type, match=message):
            cm.chunked_matmul(
                kwargs.pop("a"), kwargs.pop("b"), kwargs.pop("flags"), kwargs.pop("chunk_starts"), **kwargs
            )
    with pytest.raises(ValueError, match=r"MatmulConfig.block_k must be a power of two >= 16 \(tl.dot\), got 24"):
        cm.MatmulConfig(16, 16, 24)


def test_launch_checks_the_plan():
    """A prepared plan is launched only on the rows and the device it was made for."""
    cm = module()
    config = cm.default_config(torch.float32, interpreted=True)
    plan = cm.chunk_plan([0, 4, 10], config=config, device="cpu", row_map=list(range(10, 0, -1)), out_rows=11)
    assert (plan.m, plan.out_rows, plan.num_chunks) == (10, 11, 2)
    assert plan.row_map.tolist() == list(range(10, 0, -1)) and plan.starts.tolist() == [0, 4, 10]
    assert (
        cm.chunk_plan(
            [0, 4, 10], config=config, device="cpu", row_map=torch.arange(10, 0, -1), out_rows=11
        ).row_map.tolist()
        == plan.row_map.tolist()
    )
    flags, error = torch.ones(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"a has 9 rows but the chunk layout covers M = 10"):
        cm.launch_chunked_matmul(plan, torch.ones(9, 4), torch.ones(4, 3), torch.empty(11, 3), flags, error)
    with pytest.raises(ValueError, match=r"out must be \[rows, N\] = \[11, 3\]"):
        cm.launch_chunked_matmul(plan, torch.ones(10, 4), torch.ones(4, 3), torch.empty(10, 3), flags, error)
    with pytest.raises(ValueError, match=r"the chunk plan was made for cpu, but a is on meta"):
        cm.launch_chunked_matmul(
            plan, torch.ones(10, 4, device="meta"), torch.ones(4, 3), torch.empty(11, 3), flags, error
        )
    with pytest.raises(ValueError, match=r"out_rows \(11\) must equal M = 10 without a row_map"):
        cm.chunk_plan([0, 4, 10], config=config, device="cpu", out_rows=11)


def test_loopback_rejects_non_cuda_tensors():
    cm = module()
    with pytest.raises(
        ValueError, match=r"loopback_chunked_matmul needs CUDA tensors \(it uses CUDA streams\); a is on cpu"
    ):
        cm.loopback_chunked_matmul(torch.ones(4, 4), torch.ones(4, 4), num_chunks=2)


def _signature(kernel, dtype, contiguous):
    """A launch-like specialization: stride-1 dims as constexprs, 16-divisible sizes and pointers."""
    constants = dict(stride_ak=1, stride_bn=1, stride_cn=1) if contiguous else dict(stride_cn=1)
    divisible = {"a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bk", "stride_cm", "M", "N", "K"}
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        if param.is_constexpr or param.name in constants:
            signature[param.name] = "constexpr"
        elif param.name in ("a_ptr", "b_ptr", "c_ptr"):
            signature[param.name] = dtype
        elif param.name.endswith("_ptr"):
            signature[param.name] = "*i32"
        else:
            signature[param.name] = "i32"
        if param.name in divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def test_kernel_compiles_for_hopper():
    """No GPU needed: compile for sm_90 and check what the interpreter cannot: the flag is read with
    acquire semantics, in a loop before the first load of A; the timeout path is an atomic max; the
    16-bit dot runs on tensor cores (wgmma) with pipelined cp.async loads."""
    if INTERPRETED:
        pytest.skip("the kernel is interpreted in this process; compiled in the plain pytest run")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    cm = module()
    kernel = cm._chunked_matmul_kernel
    # The contiguous bf16 case also writes through a row map (the fused all-gather's layout).
    for dtype, torch_dtype, precision, contiguous in [
        ("*bf16", torch.bfloat16, None, True),
        ("*fp32", torch.float32, "ieee", False),
    ]:
        config = cm.default_config(torch_dtype)
        signature, constants, attrs = _signature(kernel, dtype, contiguous)
        constants |= dict(
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            INPUT_PRECISION=precision,
            WIDEN_BF16=False,
            HAS_ROW_MAP=contiguous,
        )
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        # triton lowers atomic_add(ptr, 0, sem="acquire") to an acquire load (or keeps an acquire atom).
        acquires = [match.start() for match in re.finditer(r"\b(?:ld|atom)\.global\.[\w.]*acquire", ptx)]
        assert acquires, (dtype, "no acquire load/atomic in the PTX")
        assert re.search(r"\batom\.global\.[\w.]*max\.s32", ptx), (dtype, "no atomic max for the error word")
        a_loads = [match.start() for match in re.finditer(r"\bcp\.async\.c[ag]\.shared\.global", ptx)]
        assert a_loads and min(a_loads) > min(acquires), (dtype, "a tile load precedes the first flag read")
        # The spin: an acquire between a label and a branch back to that label.
        labels = {match.group(1): match.start() for match in re.finditer(r"^(\$L__\w+):", ptx, re.M)}
        back_edges = [
            (labels[match.group(1)], match.start())
            for match in re.finditer(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ptx)
            if match.group(1) in labels
        ]
        assert any(start < acquire < end for start, end in back_edges for acquire in acquires), (dtype, "no spin loop")
        if dtype == "*bf16":
            assert "wgmma.mma_async" in ptx and "cp.async" in ptx, "bf16: expected pipelined wgmma"


# ------------------------------------------------------------------------------------------------
# Interpreter tests: the kernel on CPU
# ------------------------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_M = 16  # default_config(interpreted=True): chunk boundaries below are not multiples of it

# (M, K, N, chunk_starts, order): odd sizes, uneven chunks, boundaries inside tiles (the [5, 8) chunk
# of 3 rows makes tile 0 span three chunks), an empty chunk, non-identity arrival orders.
EXACT_CASES = [
    (1, 42, 7, [0, 1], None),
    (3, 257, 42, [0, 1, 1, 3], [2, 0, 1]),
    (127, 33, 19, [0, 5, 8, 40, 127], [3, 1, 0, 2]),
    (1000, 9, 5, [0, 333, 334, 700, 1000], [1, 3, 0, 2]),
]


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("m, k, n, starts, order", EXACT_CASES)
def test_exact_small_integers(m, k, n, starts, order, dtype):
    cm = interpreted_module()
    a = small_ints((m, k), dtype, seed=m + k)
    b = small_ints((k, n), dtype, seed=n)
    flags = torch.ones(len(starts) - 1, dtype=torch.int32)
    out = torch.full((m, n), NAN, dtype=dtype)
    got = cm.chunked_matmul(a, b, flags, starts, order=order, out=out)
    assert got is out
    assert_bitwise_equal(got, exact_product(a, b), f"{dtype} {m}x{k}x{n} chunks {starts} order {order}")
    if dtype == torch.bfloat16 and k >= 33 and m * n >= 100:
        # The rounding to bf16 was exercised: some sums (odd, above 256) are not representable.
        assert not torch.equal(got.double(), a.double() @ b.double())


@needs_interpreter
def test_bf16_output_rounding():
    """fp32 sums rounded to bf16 to nearest-even, as torch (and the GPU's cvt.rn.bf16.f32) round:
    ties to even (257 -> 256, 259 -> 260), a carry into the exponent (511 -> 512), overflow to inf,
    NaN. The interpreter's own fp32 -> bf16 cast truncates, so the kernel rounds with integer ops."""
    cm = interpreted_module()
    big = torch.finfo(torch.bfloat16).max
    columns = [
        (256, 1),
        (256, 3),
        (256, 2),
        (510, 1),
        (-510, -1),
        (big, big),
        (NAN, 0),
        (1, 2**-8),
        (1, 3 * 2**-8),
        (-1, -(2**-8) - 2**-16),
    ]
    b = torch.tensor(columns, dtype=torch.bfloat16).t().contiguous()
    a = torch.ones(1, 2, dtype=torch.bfloat16)
    got = cm.chunked_matmul(a, b, torch.ones(1, dtype=torch.int32), [0, 1])
    sums = torch.tensor([x + y for x, y in b.float().t().tolist()])
    expected = sums.bfloat16()[None]
    assert expected[0, :6].tolist() == [256, 260, 258, 512, -512, float("inf")]
    assert_bitwise_equal(got, expected, "bf16 rounding")


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_random_within_baseline_tolerance(dtype):
    cm = interpreted_module()
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(130, 257, generator=generator).to(dtype)
    b = torch.randn(257, 42, generator=generator).to(dtype)
    starts = [0, 7, 60, 61, 130]
    got = cm.chunked_matmul(a, b, torch.ones(4, dtype=torch.int32), starts, order=[2, 3, 0, 1])
    assert got.dtype == dtype
    assert_close_to_baseline(got, a, b, str(dtype))


@needs_interpreter
def test_strided_operands():
    """Transposed a and b (b = w.t() of a row-major [N, K] weight), a column-sliced b and a
    transposed out: results equal the contiguous product bit for bit."""
    cm = interpreted_module()
    m, k, n = 45, 37, 21
    a_t = small_ints((k, m), torch.bfloat16, seed=3)
    w = small_ints((n, k), torch.bfloat16, seed=4)
    wide = small_ints((k, 2 * n), torch.bfloat16, seed=5)
    out_t = torch.full((n, m), NAN, dtype=torch.bfloat16)
    starts = [0, 20, 21, 45]
    flags = torch.ones(3, dtype=torch.int32)
    got = cm.chunked_matmul(a_t.t(), w.t(), flags, starts, out=out_t.t())
    assert_bitwise_equal(out_t.t(), exact_product(a_t.t(), w.t()), "a.t() @ w.t() into out.t()")
    assert got.stride() == (1, m)
    sliced = wide[:, ::2]
    assert_bitwise_equal(cm.chunked_matmul(a_t.t(), sliced, flags, starts), exact_product(a_t.t(), sliced), "b[:, ::2]")


@needs_interpreter
@pytest.mark.parametrize("max_programs", [None, 1, 3, 1000])
def test_row_map_and_capped_grid(max_programs):
    """out[row_map] = a @ b: every mapped row exact, the rows nothing maps to untouched; a grid capped
    below the tile count computes every tile (each program several, in arrival order)."""
    cm = interpreted_module()
    m, k, n, out_rows = 70, 12, 37, 90
    a = small_ints((m, k), torch.bfloat16, seed=20)
    b = small_ints((k, n), torch.bfloat16, seed=21)
    row_map = torch.randperm(out_rows, generator=torch.Generator().manual_seed(22))[:m]
    out = torch.full((out_rows, n), NAN, dtype=torch.bfloat16)
    cm.chunked_matmul(
        a,
        b,
        torch.ones(4, dtype=torch.int32),
        [0, 10, 37, 50, 70],
        order=[2, 0, 3, 1],
        out=out,
        row_map=row_map,
        max_programs=max_programs,
    )
    expected = torch.full((out_rows, n), NAN, dtype=torch.bfloat16)
    expected[row_map] = exact_product(a, b)
    assert_bitwise_equal(out, expected, f"row map, max_programs {max_programs}")


@needs_interpreter
def test_capped_grid_skips_only_lost_tiles():
    """With a capped grid, a program that gives up on one tile still computes its later tiles."""
    cm = interpreted_module()
    m, k, n = 83, 10, 18
    starts = [0, 3, 19, 40, 41, 83]
    a = small_ints((m, k), torch.float32, seed=23)
    b = small_ints((k, n), torch.float32, seed=24)
    flags = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
    out = torch.full((m, n), NAN)
    error = torch.zeros(1, dtype=torch.int32)
    cm.chunked_matmul(a, b, flags, starts, out=out, error=error, max_spins=2, max_programs=2)
    assert error.tolist() == [2]
    untouched = untouched_rows(starts, [1], BLOCK_M, m)
    assert bool(out[untouched].isnan().all())
    assert_bitwise_equal(out[~untouched], exact_product(a, b)[~untouched], "capped grid, lost chunk 1")


@needs_interpreter
def test_epochs_and_stale_flags():
    """flags >= expected count as arrived (a later epoch too); a flag below expected is stale: the
    tiles over that chunk are left alone, all others are right, and error names the chunk."""
    cm = interpreted_module()
    m, k, n = 70, 12, 20
    a = small_ints((m, k), torch.float32, seed=6)
    b = small_ints((k, n), torch.float32, seed=7)
    starts = [0, 10, 37, 50, 70]
    exact = exact_product(a, b)
    assert_bitwise_equal(
        cm.chunked_matmul(a, b, torch.tensor([5, 5, 6, 9], dtype=torch.int32), starts, expected=5), exact, "epoch 5"
    )
    flags = torch.tensor([5, 4, 5, 5], dtype=torch.int32)
    error = torch.zeros(1, dtype=torch.int32)
    out = torch.full((m, n), NAN)
    cm.chunked_matmul(a, b, flags, starts, expected=5, out=out, error=error, max_spins=4)
    assert error.tolist() == [2]
    lost = untouched_rows(starts, [1], BLOCK_M, m)  # rows 0..47: tiles 0-2 touch [10, 37)
    assert lost.nonzero().flatten().tolist() == list(range(48))
    assert bool(out[lost].isnan().all())
    assert_bitwise_equal(out[~lost], exact[~lost], "tiles away from the stale chunk")
    with pytest.raises(cm.ChunkWaitTimeout, match=r"gave up waiting for chunk 1 .*error code 2"):
        cm.check_chunk_wait(error)


@needs_interpreter
@pytest.mark.parametrize("lost", [[0], [3], [1, 3]], ids=str)
def test_lost_chunk_times_out(lost):
    """A flag that is never set: the waiting programs give up after max_spins, error holds the
    highest lost chunk + 1, and every tile that does not touch a lost chunk is still right."""
    cm = interpreted_module()
    m, k, n = 83, 10, 18
    starts = [0, 3, 19, 40, 41, 83]
    a = small_ints((m, k), torch.float16, seed=8)
    b = small_ints((k, n), torch.float16, seed=9)
    flags = torch.ones(5, dtype=torch.int32)
    flags[lost] = 0
    out = torch.full((m, n), NAN, dtype=torch.float16)
    error = torch.zeros(1, dtype=torch.int32)
    cm.chunked_matmul(a, b, flags, starts, order=[4, 2, 0, 1, 3], out=out, error=error, max_spins=3)
    assert error.tolist() == [max(lost) + 1]
    untouched = untouched_rows(starts, lost, BLOCK_M, m)
    assert bool(out[untouched].isnan().all()) and not bool(out[~untouched].isnan().any())
    assert_bitwise_equal(out[~untouched], exact_product(a, b)[~untouched], f"lost {lost}")
    # Without an error tensor of its own, the call checks (syncs) and raises, naming the chunk.
    with pytest.raises(cm.ChunkWaitTimeout, match=rf"chunk {max(lost)}\b") as raised:
        cm.chunked_matmul(a, b, flags, starts, max_spins=0)
    assert raised.value.chunk == max(lost)
    # A caller's error word is not checked unless asked, and is sticky (only ever maxed).
    error = torch.full((1,), 99, dtype=torch.int32)
    cm.chunked_matmul(a, b, flags, starts, error=error, max_spins=0)
    assert error.tolist() == [99]


@needs_interpreter
def test_empty_dims_and_zero_spins():
    cm = interpreted_module()
    one = torch.ones(1, dtype=torch.int32)
    assert cm.chunked_matmul(torch.ones(0, 5), torch.ones(5, 3), torch.ones(2, dtype=torch.int32), [0, 0, 0]).shape == (
        0,
        3,
    )
    assert cm.chunked_matmul(torch.ones(4, 5), torch.ones(5, 0), one, [0, 4]).shape == (4, 0)
    got = cm.chunked_matmul(torch.ones(4, 0), torch.ones(0, 3), one, [0, 4], out=torch.full((4, 3), NAN))
    assert_bitwise_equal(got, torch.zeros(4, 3), "K = 0")
    a, b = small_ints((20, 6), torch.float32, 10), small_ints((6, 4), torch.float32, 11)
    assert_bitwise_equal(
        cm.chunked_matmul(a, b, torch.ones(2, dtype=torch.int32), torch.tensor([0, 9, 20]), max_spins=0),
        exact_product(a, b),
        "max_spins=0, flags set",
    )


@needs_interpreter
def test_wrap_is_applied():
    cm = interpreted_module()
    launched = []

    def wrap(kernel):
        launched.append(kernel)
        return kernel

    a, b = small_ints((5, 3), torch.float32, 12), small_ints((3, 2), torch.float32, 13)
    cm.chunked_matmul(a, b, torch.ones(1, dtype=torch.int32), [0, 5], wrap=wrap)
    assert launched == [cm._chunked_matmul_kernel]


# ------------------------------------------------------------------------------------------------
# GPU tests (compiled kernels; skipped without CUDA)
# ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
def test_loopback_matches_mm(dtype):
    """Chunks copied on a side stream, late by up to ~0.5 ms each, while the consumer spins: the
    result equals torch.mm within the same-precision tolerance and no wait timed out."""
    cm = module()
    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2000, 1000, device="cuda", generator=generator).to(dtype)
    b = torch.randn(1000, 1500, device="cuda", generator=generator).to(dtype).t().contiguous().t()
    for num_chunks, delay, order in [(1, 0, None), (4, 1_000_000, None), (7, 200_000, [6, 0, 5, 1, 4, 2, 3])]:
        got = cm.loopback_chunked_matmul(a, b, num_chunks=num_chunks, delay_cycles=delay, order=order)
        torch.cuda.synchronize()
        assert_close_to_baseline(got.cpu(), a.cpu(), b.cpu(), f"{dtype} chunks {num_chunks} delay {delay}")


@needs_cuda
def test_loopback_exact_small_integers():
    cm = module()
    a = small_ints((777, 257), torch.bfloat16, 14).cuda()
    b = small_ints((257, 300), torch.bfloat16, 15).cuda()
    got = cm.loopback_chunked_matmul(a, b, num_chunks=5, delay_cycles=500_000, order=[4, 3, 2, 1, 0])
    assert_bitwise_equal(got.cpu(), exact_product(a.cpu(), b.cpu()), "loopback bf16")


@needs_cuda
def test_cuda_lost_chunk_times_out():
    """On the GPU, a flag that is never set ends in an error code, not a hang."""
    cm = module()
    m, k, n = 1000, 128, 256
    starts = [0, 300, 650, 1000]
    a = small_ints((m, k), torch.bfloat16, 16).cuda()
    b = small_ints((k, n), torch.bfloat16, 17).cuda()
    flags = torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda")
    out = torch.full((m, n), NAN, dtype=torch.bfloat16, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    cm.chunked_matmul(a, b, flags, starts, out=out, error=error, max_spins=10_000)
    assert error.tolist() == [2]
    untouched = untouched_rows(starts, [1], cm.default_config(torch.bfloat16).block_m, m)
    out = out.cpu()
    assert bool(out[untouched].isnan().all())
    assert_bitwise_equal(out[~untouched], exact_product(a.cpu(), b.cpu())[~untouched], "GPU, lost chunk 1")

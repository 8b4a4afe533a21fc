"""fastmesh.fp8.quantize (fastmesh::fp8_quantize) on the CPU kernels, against the plain-PyTorch reference.

Equality is bit for bit (``fp8_bits_equal``: only a NaN's sign bit may differ) for data, scales and amax.
"""

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from fastmesh.kernels import fp8_reference as ref
from rank_pool import on_ranks
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh.ops.fp8_quantize import fp8_quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
INPUTS = (torch.float32, torch.bfloat16, torch.float16)
GRANULARITIES = ref.GRANULARITIES
MODES = ("current", "amax", "scale")
SHAPES = [(1, 1), (3, 127), (130, 128), (129, 129), (5, 1023), (2, 4097), (2, 65, 257), (257, 130)]
ONE_DIM_SHAPES = [(1,), (127,), (128,), (129,), (1023,), (4097,)]


def wide_range(shape, dtype, seed):
    """Random values whose magnitudes span ~2^-24..2^24 (clipped to the input dtype's range)."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-24, 25, shape, generator=generator).float()
    x = torch.randn(shape, generator=generator) * torch.exp2(exponents)
    limit = torch.finfo(dtype).max / 2
    return x.clamp(-limit, limit).to(dtype)


def given_args(mode, x, dtype, granularity, seed):
    """A plausible given scale or amax (random, positive) in the scale layout, or neither."""
    if mode == "current":
        return None, None
    generator = torch.Generator().manual_seed(seed + 1)
    per_group = ref.scale_shape(x.shape, granularity)
    values = torch.rand(per_group, generator=generator) * 4 + 0.25
    amax = ref.group_amax(x, granularity) * values
    if mode == "amax":
        return None, amax
    return amax / ref.FP8_MAX[dtype], None


def assert_quantized_equal(actual, expected):
    names = ("data", "scale", "amax", "data_t", "scale_t")
    for name, a, e in zip(names, actual, expected):
        if e is None:
            assert a is None, name
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, e.shape, a.dtype, e.dtype)
        if a.dtype in FP8:
            same = ref.fp8_bits_equal(a, e)
        else:
            same = (a == e) | (torch.isnan(a) & torch.isnan(e))
        if not bool(same.all()):
            bad = (~same).nonzero()[:5].tolist()
            raise AssertionError(
                f"{name}: {int((~same).sum())} of {a.numel()} differ, e.g. at {bad}: "
                f"{[a[tuple(i)].item() for i in bad]} vs {[e[tuple(i)].item() for i in bad]}"
            )


def quantize_both(x, dtype, granularity, scale=None, amax=None, transpose=False, power_of_two=False):
    result = fp8_quantize(x, dtype, granularity, scale, amax, transpose, power_of_two)
    expected = ref.quantize(x.contiguous(), dtype, granularity, scale, amax, transpose, power_of_two)
    return result, expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_dtype", INPUTS, ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_matches_reference(granularity, dtype, input_dtype, mode):
    for index, shape in enumerate(SHAPES):
        x = wide_range(shape, input_dtype, seed=index)
        scale, amax = given_args(mode, x, dtype, granularity, seed=index)
        for transpose, power_of_two in itertools.product((False, True), (False, True)):
            if transpose and mode != "current" and granularity in ("rowwise", "block1x128"):
                continue  # rejected by design: tested in test_transpose_with_given_needs_matching_groups
            if power_of_two and mode == "scale":
                continue  # rejected by design: tested in test_errors
            result, expected = quantize_both(x, dtype, granularity, scale, amax, transpose, power_of_two)
            assert_quantized_equal(result, expected)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block1x128"])
def test_one_dim_inputs(granularity):
    for index, shape in enumerate(ONE_DIM_SHAPES):
        x = wide_range(shape, torch.bfloat16, seed=100 + index)
        assert_quantized_equal(*quantize_both(x, E4M3, granularity))


def test_zero_dim_input_is_tensorwise_only():
    x = torch.tensor(-3.5)
    assert_quantized_equal(*quantize_both(x, E4M3, "tensorwise"))
    with pytest.raises(ValueError, match=r"granularity 'rowwise' needs x with at least 1 dim"):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="rowwise")


def test_non_contiguous_input_is_read_through_a_copy():
    base = wide_range((96, 300), torch.float32, seed=7)
    x = base.t()[::2]  # [150, 96], strided both ways
    assert not x.is_contiguous()
    for granularity in GRANULARITIES:
        assert_quantized_equal(*quantize_both(x, E4M3, granularity, transpose=True))


def fp8_grid(dtype):
    """Every finite non-negative FP8 value of ``dtype``, ascending, as fp32."""
    codes = torch.arange(0, 0x80, dtype=torch.uint8).view(dtype).float()
    return codes[torch.isfinite(codes)].unique()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_rounding_ties_and_exact_values(dtype):
    # With a given scale of 1 the input is cast as is: every FP8 value must survive exactly and every
    # midpoint between neighbours must round to the neighbour with the even mantissa.
    grid = fp8_grid(dtype)
    midpoints = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    x = torch.cat([grid, midpoints, -grid, -midpoints]).reshape(1, -1)
    one = torch.ones(())
    result, expected = quantize_both(x, dtype, "tensorwise", scale=one)
    assert_quantized_equal(result, expected)
    # Independent of the reference: ties go to the even code.
    codes = result.data.view(torch.uint8)[0, len(grid) : len(grid) + len(midpoints)].int()
    assert bool((codes % 2 == 0).all())


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_adversarial_values(granularity, dtype):
    inf, nan = float("inf"), float("nan")
    tiny = torch.finfo(torch.float32).tiny
    rows = [
        torch.zeros(260),  # all zeros: scale stays finite (1)
        torch.full((260,), 1e-3).index_fill(0, torch.tensor([5]), 3e38),  # one huge value
        torch.linspace(-4, 4, 260).index_fill(0, torch.tensor([7]), inf),  # +inf
        torch.linspace(-4, 4, 260).index_fill(0, torch.tensor([9]), -inf),  # -inf
        torch.linspace(-4, 4, 260).index_fill(0, torch.tensor([11]), nan),  # NaN
        torch.full((260,), tiny / 8).index_fill(0, torch.tensor([1]), -tiny / 3),  # fp32 subnormals only
        torch.exp2(torch.arange(-149, 111).float()),  # powers of two, subnormal to huge
        torch.arange(260).float() * 0.5 + 0.25,  # many ties after scaling
    ]
    x = torch.stack(rows)
    for transpose, mode in itertools.product((False, True), ("current", "scale")):
        if transpose and mode == "scale" and granularity in ("rowwise", "block1x128"):
            continue
        scale = None
        if mode == "scale":
            scale = torch.full(ref.scale_shape(x.shape, granularity), 0.5)
        result, expected = quantize_both(x, dtype, granularity, scale, None, transpose)
        assert_quantized_equal(result, expected)
    if granularity == "rowwise":
        current = fastmesh.fp8.quantize(x, dtype=dtype, granularity="rowwise")
        assert current.scale[0].item() == 1.0 and current.amax[0].item() == 0.0  # zeros: finite scale
        assert math.isinf(current.scale[2].item())  # inf amax: inf scale
        assert math.isnan(current.scale[4].item())  # NaN poisons its group
        assert bool(torch.isnan(current.data[4].float()).all())
        assert 0 < current.scale[5].item() < tiny  # FLT_MAX clamp, finite


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_empty_tensors_give_empty_results(granularity):
    for shape in [(0, 5), (4, 0), (0, 0), (2, 0, 7)]:
        x = torch.empty(shape)
        result, expected = quantize_both(x, E4M3, granularity, transpose=True)
        assert_quantized_equal(result, expected)
        assert result.data.shape == shape and bool((result.scale == 1).all())


def test_power_of_two_scales():
    x = wide_range((64, 300), torch.float32, seed=3)
    for granularity in GRANULARITIES:
        q = fastmesh.fp8.quantize(x, dtype=E4M3, granularity=granularity, power_of_two=True)
        mantissa, _ = torch.frexp(q.scale)
        assert bool((mantissa == 0.5).all()), granularity


def _scale_per_element(scale, granularity, shape2d):
    """The scale of each element of x as [M, K], spelled out per granularity (the reference for dequantize)."""
    m, k = shape2d
    s = scale.float()
    if granularity == "tensorwise":
        return s.expand(m, k)
    if granularity == "block128x128":
        return s.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :k]
    s = s.reshape(m, -1)
    block = {"rowwise": k, "block1x128": 128, "mx": 32}[granularity]
    return s.repeat_interleave(max(block, 1), 1)[:, :k]


@pytest.mark.parametrize("granularity", (*GRANULARITIES, "mx"))
def test_dequantize_applies_each_scale_to_its_group(granularity):
    """Float8Quantized.dequantize: data times the scale of each element's group, for N-D x, partial blocks, the
    transposed pair and an output dtype; an MX block whose scale is NaN comes back NaN."""
    for shape in [(3, 5, 288), (130, 257), (64, 96), (96,)] if granularity != "mx" else [(3, 32, 64), (64, 96), (96,)]:
        if granularity == "block128x128" and len(shape) < 2:
            continue
        x = wide_range(shape, torch.float32, seed=len(shape))
        if granularity == "mx":
            x.view(-1)[5] = float("nan")
        transpose = len(shape) > 1
        q = fastmesh.fp8.quantize(x, dtype=E4M3, granularity=granularity, transpose=transpose)
        m, k = math.prod(shape[:-1]), shape[-1]
        expected = q.data.float().reshape(m, k) * _scale_per_element(q.scale, granularity, (m, k))
        got = q.dequantize()
        assert got.dtype == torch.float32 and got.shape == x.shape
        torch.testing.assert_close(got.reshape(m, k), expected, rtol=0, atol=0, equal_nan=True)
        if granularity == "mx":
            assert bool(got.view(-1)[:32].isnan().all()) and not bool(got.view(-1)[32:].isnan().any())
        torch.testing.assert_close(q.dequantize(torch.bfloat16), got.bfloat16(), rtol=0, atol=0, equal_nan=True)
        if transpose:
            expected_t = q.data_t.float() * _scale_per_element(q.scale_t, granularity, (k, m))
            torch.testing.assert_close(q.dequantize(transposed=True), expected_t, rtol=0, atol=0, equal_nan=True)
        else:
            with pytest.raises(ValueError, match=r"transposed=True needs a quantize\(\.\.\., transpose=True\)"):
                q.dequantize(transposed=True)
    empty = fastmesh.fp8.quantize(torch.randn(3, 4, 0), dtype=E4M3, granularity=granularity)  # no K: no reshape(-1, 0)
    assert empty.dequantize().shape == (3, 4, 0)


def test_e5m2_saturates_unlike_plain_cast():
    x = torch.tensor([[70000.0, -1e9, 1.0]])
    q = fastmesh.fp8.quantize(x, dtype=E5M2, granularity="tensorwise", scale=torch.ones(()))
    assert q.data.float().tolist() == [[57344.0, -57344.0, 1.0]]
    assert math.isinf(x.to(E5M2)[0, 0].float().item())  # what the plain cast does


def sqnr_db(signal, noisy):
    return (20 * torch.log10(signal.norm() / (signal - noisy).norm())).item()


@pytest.mark.smoke
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_scaled_mm_sqnr(granularity):
    if granularity == "rowwise" and not ROWWISE_ON_CPU:
        pytest.skip("torch < 2.13 runs only tensor-wise scales in torch._scaled_mm on CPU")
    # FP8 matmul quality: both operands quantized, torch._scaled_mm on CPU vs the fp32 product.
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per element); a K=512 dot product averages
    # that noise down: these operands measure 28.6 dB with either granularity (torch 2.14.1). Floor: 25 dB;
    # ceiling 35 dB: operands left unquantized would give float32's rounding (~130 dB).
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(128, 512, generator=generator)
    b = torch.randn(256, 512, generator=generator)
    qa = fastmesh.fp8.quantize(a, dtype=E4M3, granularity=granularity)
    qb = fastmesh.fp8.quantize(b, dtype=E4M3, granularity=granularity)
    out = torch._scaled_mm(qa.data, qb.data.t(), scale_a=qa.scale, scale_b=qb.scale.t(), out_dtype=torch.float32)
    assert 25.0 < sqnr_db(a @ b.t(), out) < 35.0


@pytest.mark.smoke
def test_opcheck():
    x = wide_range((33, 260), torch.bfloat16, seed=1)
    for granularity in GRANULARITIES:
        for args in [(x, E4M3, granularity), (x, E5M2, granularity, None, None, True, True)]:
            torch.library.opcheck(torch.ops.fastmesh.fp8_quantize, args)
            torch.library.opcheck(torch.ops.fastmesh.fp8_quantize_native, args)
        torch.library.opcheck(torch.ops.fastmesh.amax, (x, granularity))
    scale = torch.full((33, 1), 0.01)
    torch.library.opcheck(torch.ops.fastmesh.fp8_quantize, (x, E4M3, "rowwise", scale))
    torch.library.opcheck(torch.ops.fastmesh.fp8_quantize, (torch.empty(5, 0), E4M3, "rowwise", None, None, True))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    def quantize_and_dequantize(x, w):
        qx = fastmesh.fp8.quantize(x, dtype=E4M3, granularity="rowwise", transpose=True)
        qw = fastmesh.fp8.quantize(w, dtype=E4M3, granularity="block128x128")
        return qx.data.float() * qx.scale, qx.data_t, qw.data, qw.scale

    x, w = wide_range((64, 200), torch.bfloat16, 1), wide_range((130, 260), torch.float32, 2)
    compiled = torch.compile(quantize_and_dequantize, fullgraph=True, backend=backend)
    for got, want in zip(compiled(x, w), quantize_and_dequantize(x, w)):
        if got.dtype in FP8:
            assert bool(ref.fp8_bits_equal(got, want).all())
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_amax_per_group_matches_reference():
    x = wide_range((3, 130, 257), torch.float16, seed=5)
    x[1, 7, 3] = float("nan")
    for granularity in GRANULARITIES:
        got, want = fastmesh.amax(x, granularity), ref.group_amax(x, granularity)
        assert got.shape == want.shape
        assert bool(((got == want) | (torch.isnan(got) & torch.isnan(want))).all()), granularity


# --- errors --------------------------------------------------------------------------------------

BAD_INPUTS = [
    (
        dict(x=torch.zeros(4, 4, dtype=torch.int32)),
        TypeError,
        r"x must be float32, bfloat16 or float16, got torch.int32",
    ),
    (dict(x=torch.zeros(4, 4, dtype=torch.bool)), TypeError, r"x must be float32, bfloat16 or float16, got torch.bool"),
    (dict(x=torch.zeros(4, 4, dtype=torch.complex64)), TypeError, r"x must be float32.*got torch.complex64"),
    (dict(x=torch.zeros(4, 4).to(E4M3)), TypeError, r"x must be float32.*got torch.float8_e4m3fn"),
    (dict(dtype=torch.bfloat16), TypeError, r"dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
    (dict(granularity="block64"), ValueError, r"granularity must be one of 'tensorwise'.*got 'block64'"),
    (dict(granularity="block128x128", x=torch.zeros(256)), ValueError, r"needs x with at least 2 dim"),
    (dict(scale=torch.ones(4)), ValueError, r"scale must have shape \[4, 1\] for granularity 'rowwise'"),
    (dict(scale=torch.ones(4, 1, dtype=torch.float64)), TypeError, r"scale must be float32, got torch.float64"),
    (dict(scale=torch.ones(4, 1, device="meta")), ValueError, r"scale must be on x's device cpu, got meta"),
    (dict(scale=torch.ones(4, 1), power_of_two=True), ValueError, r"power_of_two applies to computed scales"),
    (dict(transpose=True, x=torch.zeros(8)), ValueError, r"transpose=True needs x with at least 2 dims"),
    (dict(transpose=True, scale=torch.ones(4, 1)), ValueError, r"transpose=True with a given scale or amax"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_INPUTS)
def test_errors(overrides, error, message):
    args = dict(x=torch.zeros(4, 4), dtype=E4M3, granularity="rowwise")
    args.update(overrides)
    x = args.pop("x")
    with pytest.raises(error, match=message):
        fastmesh.fp8.quantize(x, **args)
    # Direct op calls get the same checks (the op body validates before any kernel runs).
    with pytest.raises(error, match=message):
        torch.ops.fastmesh.fp8_quantize(
            x,
            args["dtype"],
            args["granularity"],
            args.get("scale"),
            None,
            args.get("transpose", False),
            args.get("power_of_two", False),
        )


def test_front_errors_name_the_argument():
    """What only the front sees: the granularities it takes (MX included), and a scale or x that is no tensor."""
    x = torch.zeros(4, 64)
    known = r"'tensorwise', 'rowwise', 'block1x128', 'block128x128', 'mx'"
    with pytest.raises(ValueError, match=rf"granularity must be one of {known}, got 'row'"):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="row")
    with pytest.raises(TypeError, match=r"scale must be a float32 tensor in the scale layout .*got float"):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="tensorwise", scale=0.01)
    for granularity in ("rowwise", "mx"):
        with pytest.raises(TypeError, match=r"fastmesh.fp8.quantize: x must be a torch.Tensor, got list"):
            fastmesh.fp8.quantize([[1.0] * 32], dtype=E4M3, granularity=granularity)
        # Arguments the op's schema would refuse with the dispatcher's words, or take (transpose=1).
        with pytest.raises(TypeError, match=r"quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
            fastmesh.fp8.quantize(x, dtype="e4m3", granularity=granularity)
        for flag, value in (("transpose", 1), ("transpose", "yes")):
            with pytest.raises(TypeError, match=rf"quantize: {flag} must be a bool, got {type(value).__name__}"):
                fastmesh.fp8.quantize(x, dtype=E4M3, granularity=granularity, **{flag: value})
    with pytest.raises(TypeError, match=r"quantize: power_of_two must be a bool, got str"):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="rowwise", power_of_two="no")
    with pytest.raises(ValueError, match=r"quantize: amax_group: .*no process group is registered under the name 'tp'"):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="rowwise", amax_group="tp")
    with pytest.raises(TypeError, match=r"Float8Config: backward_in_fp8 must be a bool, got int"):
        fastmesh.fp8.Float8Config(backward_in_fp8=1)


def test_native_kernel_checks_bypassing_python():
    # fp8_quantize_native is internal, but its C++ checks must still stop out-of-bounds reads.
    native = torch.ops.fastmesh.fp8_quantize_native
    with pytest.raises(ValueError, match=r"scale must have shape \[4, 1\]"):
        native(torch.zeros(4, 4), E4M3, "rowwise", torch.ones(3), None, False, False)
    with pytest.raises(TypeError, match=r"x must be float32"):
        native(torch.zeros(4, 4, dtype=torch.int8), E4M3, "rowwise", None, None, False, False)
    with pytest.raises(ValueError, match=r"granularity must be one of"):
        native(torch.zeros(4, 4), E4M3, "columnwise", None, None, False, False)


def test_amax_group_rejections():
    x = torch.ones(4, 4)
    with pytest.raises(ValueError, match=r"amax_group .* cannot be combined with scale="):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="tensorwise", scale=torch.ones(()), amax_group="x")
    with pytest.raises(ValueError, match=r"amax_group applies to granularity 'tensorwise' or 'rowwise'"):
        fastmesh.fp8.quantize(x, dtype=E4M3, granularity="block1x128", amax_group="x")


# --- amax_group on several ranks -----------------------------------------------------------------


@on_ranks(2, 4)
def test_amax_group_gives_unsharded_scales():
    rank, world = dist.get_rank(), dist.get_world_size()
    full = wide_range((6, 64 * world), torch.bfloat16, seed=11)
    full[3, 5] = 1e4  # the tensor's amax lives on one rank only
    for granularity in ("tensorwise", "rowwise"):
        shard = full.chunk(world, dim=-1)[rank]
        expected = ref.quantize(full, E4M3, granularity)
        got = fastmesh.fp8.quantize(shard, dtype=E4M3, granularity=granularity, amax_group=dist.group.WORLD)
        assert torch.equal(got.scale, expected.scale), granularity
        assert torch.equal(got.amax, expected.amax), granularity
        assert bool(ref.fp8_bits_equal(got.data, expected.data.chunk(world, dim=-1)[rank]).all()), granularity
    # NaN on one rank reaches every rank (a float max could drop it).
    local = torch.ones(4, 8)
    if rank == world - 1:
        local[0, 0] = float("nan")
    got = fastmesh.fp8.quantize(local, dtype=E4M3, granularity="tensorwise", amax_group=dist.group.WORLD)
    assert math.isnan(got.amax.item())


def test_registered_schemas_are_the_one_homes():
    from fastmesh.ops import _library

    for op in ("fp8_quantize", "fp8_quantize_native", "amax", "mx_quantize", "mx_quantize_native"):
        registered = str(getattr(torch.ops.fastmesh, op).default._schema)
        assert registered == f"fastmesh::{op}{_library.signature(op)}", registered


def test_triton_kernels_are_visible_in_a_compiled_cuda_graph():
    # On CUDA the op body launches Triton kernels through wrap_triton; traced on fake CUDA tensors
    # (no GPU needed) the graph holds the kernels themselves, not an opaque call.
    pytest.importorskip("triton")
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    def quantize_rows(x):
        return torch.ops.fastmesh.fp8_quantize(x, E4M3, "rowwise", None, None, True, False)

    with FakeTensorMode():
        x = torch.empty(256, 512, dtype=torch.bfloat16, device="cuda")
        data, scale, _, data_t, scale_t = aot_function(quantize_rows, fw_compiler=capture)(x)
    assert (data.shape, scale.shape, data_t.shape, scale_t.shape) == ((256, 512), (256, 1), (512, 256), (512, 1))
    code = graphs[0].code
    assert "triton_kernel_wrapper_functional" in code
    assert "fp8_quantize_native" not in code

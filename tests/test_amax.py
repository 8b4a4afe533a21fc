"""fastmesh::amax against its plain-PyTorch equivalent, on the CPU kernel."""

import pytest
import torch

import fastmesh


def reference_amax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    return x.abs().amax().float()


def wide_range(shape, dtype, generator):
    # Magnitudes spread over ~2^-20..2^20 so the max is not just "the largest of similar numbers".
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-20, 21, shape, generator=generator).float())
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (127,), (128,), (129,), (1023,), (4097,), (3, 5, 7), (257, 130)])
def test_matches_reference(dtype, shape):
    generator = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    x = wide_range(shape, dtype, generator)
    result = fastmesh.amax(x)
    assert result.dtype == torch.float32 and result.shape == ()
    torch.testing.assert_close(result, reference_amax(x), rtol=0, atol=0)


def test_large_input_uses_every_grain():
    # Larger than several parallel_reduce grains; the maximum sits in the last one.
    x = torch.rand(1 << 20)
    x[-1] = -7.5
    assert fastmesh.amax(x).item() == 7.5


def test_non_contiguous_and_negative_maximum():
    x = torch.arange(-60.0, 60.0).reshape(10, 12).t()[::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(fastmesh.amax(x), reference_amax(x), rtol=0, atol=0)


@pytest.mark.parametrize("special, expected", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "inf")])
def test_special_values_propagate(special, expected):
    x = torch.randn(1000)
    x[517] = special
    result = fastmesh.amax(x).item()
    assert (result != result) if expected == "nan" else result == float("inf")


def test_nan_beats_inf():
    x = torch.tensor([float("inf"), float("nan"), 1.0])
    assert torch.isnan(fastmesh.amax(x))


def test_empty_is_zero():
    assert fastmesh.amax(torch.empty(0, 4)).item() == 0.0


def test_result_never_requires_grad():
    x = torch.randn(8, requires_grad=True)
    assert not fastmesh.amax(x).requires_grad


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float64, torch.complex64, torch.float8_e4m3fn])
def test_rejects_unsupported_dtype(dtype):
    x = torch.zeros(4).to(dtype)
    with pytest.raises(TypeError, match=r"fastmesh.amax: x must be float32, bfloat16 or float16"):
        fastmesh.amax(x)
    # The C++ kernel checks too, for callers that bypass the Python front.
    with pytest.raises(TypeError, match=r"fastmesh::amax: x must be float32, bfloat16 or float16"):
        torch.ops.fastmesh.amax(x)


@pytest.mark.smoke
def test_opcheck():
    for x in (torch.randn(33, 5), torch.randn(7, dtype=torch.bfloat16), torch.randn(2, 3, 4).transpose(0, 2)):
        torch.library.opcheck(torch.ops.fastmesh.amax, (x,))


@pytest.mark.smoke
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    def scale_of(x):
        return 448.0 / torch.ops.fastmesh.amax(x)

    x = torch.randn(64, 48) * 3
    compiled = torch.compile(scale_of, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), scale_of(x), rtol=0, atol=0)

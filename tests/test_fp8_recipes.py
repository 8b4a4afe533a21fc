"""FP8 recipe state: Float8Config validation and DelayedScaling's history and scale."""

import pytest
import torch
from fastmesh.kernels import fp8_reference as ref

import fastmesh
from fastmesh.fp8 import DelayedScaling, Float8Config


def test_config_defaults_and_frozen():
    config = Float8Config()
    assert (config.dtype, config.grad_dtype, config.granularity, config.scaling) == (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        "tensorwise",
        "current",
    )
    with pytest.raises(AttributeError):
        config.granularity = "rowwise"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dtype=torch.bfloat16), TypeError, r"dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
        (dict(grad_dtype=torch.float16), TypeError, r"grad_dtype must be"),
        (dict(granularity="colwise"), ValueError, r"granularity must be one of"),
        (dict(scaling="dynamic"), ValueError, r"scaling must be one of \('current', 'delayed'\)"),
        (
            dict(scaling="delayed", granularity="rowwise"),
            ValueError,
            r"delayed scaling .* needs granularity='tensorwise'",
        ),
        (dict(history_len=0), ValueError, r"history_len must be an int >= 1, got 0"),
        (dict(amax_compute="mean"), ValueError, r"amax_compute must be one of"),
        (dict(margin=-1), ValueError, r"margin must be an int >= 0"),
    ],
)
def test_config_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        Float8Config(**kwargs)


def test_history_length_must_be_positive():
    with pytest.raises(ValueError, match=r"DelayedScaling: history_len must be an int >= 1, got 0"):
        DelayedScaling(history_len=0)


def test_first_step_uses_scale_one_then_history():
    recipe = DelayedScaling(history_len=3)
    assert recipe.scale().item() == 1.0  # empty (all-zero) history
    x = torch.tensor([[1.0, -8.0, 2.0]])
    first = recipe.quantize(x)
    assert torch.equal(first.data, ref.quantize(x, torch.float8_e4m3fn, "tensorwise", scale=torch.ones(())).data)
    assert first.amax.item() == 8.0
    assert recipe.amax_history.tolist() == [8.0, 0.0, 0.0]
    assert recipe.scale().item() == pytest.approx(8.0 / 448.0)


def test_max_and_most_recent_over_a_rolling_window():
    by_max, by_recent = DelayedScaling(history_len=2), DelayedScaling(history_len=2, amax_compute="most_recent")
    for amax in (4.0, 16.0, 2.0):
        for recipe in (by_max, by_recent):
            recipe.update(torch.tensor(amax))
    assert by_max.amax_history.tolist() == [2.0, 16.0]  # 4.0 rolled out
    assert by_max.scale().item() == pytest.approx(16.0 / 448.0)
    assert by_recent.scale().item() == pytest.approx(2.0 / 448.0)


def test_margin_and_format():
    recipe = DelayedScaling(margin=2, dtype=torch.float8_e5m2)
    recipe.update(torch.tensor(1000.0))
    assert recipe.scale().item() == pytest.approx(4 * 1000.0 / 57344.0)


def test_delayed_scale_feeds_the_op_and_saturates():
    recipe = DelayedScaling(history_len=4)
    recipe.update(torch.tensor(1.0))
    x = torch.tensor([[0.5, 3.0]])  # 3.0 exceeds the stale amax: it saturates at 448 * scale
    q = recipe.quantize(x)
    assert q.data.float().tolist() == [[224.0, 448.0]]
    assert q.amax.item() == 3.0 and recipe.amax_history[0].item() == 3.0


def test_update_needs_tensorwise_amax():
    with pytest.raises(ValueError, match=r"amax must be 0-d"):
        DelayedScaling().update(torch.ones(3, 1))


def test_front_is_exported():
    assert fastmesh.fp8.quantize is fastmesh.ops.quantize


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_stale_scale_saturates_and_counts_overflows(dtype):
    """A scale from small values meets a much larger tensor: the cast saturates at +-fp8_max (e5m2 too, no inf)
    and the step is counted; steps in range are not, nor one whose largest value rounds to fp8_max anyway."""
    fp8_max = ref.FP8_MAX[dtype]
    recipe = DelayedScaling(history_len=4, dtype=dtype)
    assert recipe.overflows.dtype == torch.int64 and recipe.overflows.shape == ()
    counts = []
    for amax in (1.0, 0.5, 1000.0, 500.0, 1e6, 1e6, 1.03e6):
        x = torch.tensor([[amax, -amax, amax / 3, 0.0]])
        scale = recipe.scale()
        q = recipe.quantize(x)
        assert torch.equal(
            q.data.view(torch.uint8), ref.quantize(x, dtype, "tensorwise", scale=scale).data.view(torch.uint8)
        )
        if amax / scale.item() > fp8_max:
            assert q.data.float()[0, :2].tolist() == [fp8_max, -fp8_max]
        counts.append(recipe.overflows.item())
    # 1 fits the first scale (1: an empty history), 0.5 the next; 1000 and the first 1e6 overflow. 1e6 again
    # is at fp8_max up to rounding, 1.03e6 beyond it by less than half an FP8 step: both cast to fp8_max anyway.
    assert counts == [0, 0, 1, 1, 2, 2, 2]


def test_non_finite_amax_enters_the_history():
    """An infinity saturates (counted); the history then holds inf, so the next steps' scale is inf and they
    dequantize to NaN (not counted: nothing saturates) until it leaves the window. A NaN stays NaN and is
    counted (it may hide infinities, which saturate); the next scale is NaN."""
    inf, nan = float("inf"), float("nan")
    ordinary = torch.tensor([[1.0, -2.0]])
    for amax_compute, poisoned_steps in (("max", 2), ("most_recent", 1)):
        recipe = DelayedScaling(history_len=2, amax_compute=amax_compute)
        recipe.quantize(ordinary)
        q = recipe.quantize(torch.tensor([[inf, 1.0]]))
        assert q.data.float()[0, 0].item() == 448.0 and recipe.overflows.item() == 1
        for _ in range(poisoned_steps):
            q = recipe.quantize(ordinary)
            assert bool((q.data.float() * q.scale).isnan().all()) and recipe.overflows.item() == 1
        q = recipe.quantize(ordinary)
        assert bool(q.scale.isfinite()) and bool((q.data.float() * q.scale).isfinite().all())
        q = recipe.quantize(torch.tensor([[nan, 1.0, inf]]))
        assert q.data.float()[0, 0].isnan() and q.data.float()[0, 2].item() == 448.0 and recipe.overflows.item() == 2
        assert recipe.scale().isnan()
        q = recipe.quantize(ordinary)
        assert bool((q.data.float() * q.scale).isnan().all()) and recipe.overflows.item() == 2


def test_tiny_and_huge_histories_give_finite_scales():
    """A subnormal amax gives a scale of at least 2^-126 (its reciprocal, the op's multiplier, finite: below
    2^-128 it would be inf and zeros would become NaN); a huge amax with a margin a finite scale (the margin
    multiplies after the division)."""
    recipe = DelayedScaling(history_len=2)
    recipe.update(torch.tensor(1e-40))
    assert recipe.scale().item() == torch.finfo(torch.float32).tiny
    q = recipe.quantize(torch.tensor([[0.0, 1e-40, -3e-41]]))
    assert bool(q.data.float().isfinite().all()) and q.data.float()[0, 0].item() == 0.0
    recipe = DelayedScaling(history_len=2, margin=2)
    recipe.update(torch.tensor(3e38))
    assert recipe.scale().item() == pytest.approx(4 * 3e38 / 448)
    x = torch.tensor([[3e38, -1e38, 1.0]])
    q = recipe.quantize(x)
    assert bool((q.data.float().double() * q.scale.double()).isfinite().all()) and recipe.overflows.item() == 0

"""torchao's float8 pieces as baselines for fastmesh's benchmarks; used only when torchao is importable.

* :func:`quantize`: torchao's dynamic cast to e4m3 (tensor-wise or row-wise), against ``fastmesh.fp8.quantize``.
  Its data equals fastmesh's bit for bit; torchao keeps the multiplier ``fp8_max / amax``, returned here as
  its reciprocal, fastmesh's dequantization scale (also bit for bit, except for an all-zero group, where
  torchao divides by ``amax`` clamped to 1e-12 and fastmesh uses a multiplier of 1).
* :func:`mx_cast`: torchao's MX cast (``to_mx``, blocks of 32, FLOOR or RCEIL scales), against
  ``fastmesh.fp8.quantize(granularity="mx")``: bit for bit, except that torchao's eager RCEIL takes
  ``ceil(log2())`` in fp32, which rounds a quotient within a few ulps above a power of two down to it (a scale
  half fastmesh's, exact rule's: ``tests/test_mx.py``).
* :func:`convert` and :func:`block_plan`: torchao's float8 tensor parallelism for
  ``fastmesh.testing.llama.Block`` (the tensor-wise recipe, as torchtitan uses it), against fastmesh's fused
  FP8 plan. It casts activations to float8 before the all-gathers, and the gradients before the backward
  all-gathers, so it needs a backend that carries float8 tensors: NCCL does, gloo does not.

Install with ``pip install torchao``.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

GRANULARITIES = ("tensorwise", "rowwise")
_INSTALL_HINT = "pip install torchao"


def _float8_api() -> types.SimpleNamespace:
    """The torchao names this module uses, imported on first use: torchao is an optional extra."""
    import torchao
    from torchao.float8 import Float8LinearConfig, ScalingGranularity, convert_to_float8_training
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )
    from torchao.float8.float8_training_tensor import LinearMMConfig

    return types.SimpleNamespace(
        torchao=torchao,
        Float8LinearConfig=Float8LinearConfig,
        ScalingGranularity=ScalingGranularity,
        convert_to_float8_training=convert_to_float8_training,
        hp_tensor_to_float8_dynamic=hp_tensor_to_float8_dynamic,
        Float8ColwiseParallel=Float8ColwiseParallel,
        Float8RowwiseParallel=Float8RowwiseParallel,
        PrepareFloat8ModuleInput=PrepareFloat8ModuleInput,
        LinearMMConfig=LinearMMConfig,
    )


def status() -> tuple[bool, str]:
    """``(True, "torchao X.Y.Z")`` when torchao's float8 pieces import, else ``(False, why)``."""
    try:
        api = _float8_api()
    # Not only ImportError: a torchao built for another torch can fail with any error while importing.
    except Exception as error:
        return False, f"torchao's float8 modules do not import ({type(error).__name__}: {error}); {_INSTALL_HINT}"
    return True, f"torchao {api.torchao.__version__}"


@torch.no_grad()
def quantize(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's dynamic cast of ``x`` to e4m3: ``(data, scale)`` with ``x ~= data.float() * scale``.

    ``granularity`` is ``"tensorwise"`` (scale ``[]``) or ``"rowwise"`` (one scale per row, over the last dim:
    scale ``[..., 1]``), the layouts of ``fastmesh.fp8.quantize``.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES} for torchao's cast, got {granularity!r}")
    api = _float8_api()
    rowwise = granularity == "rowwise"
    cast = api.hp_tensor_to_float8_dynamic(
        x,
        torch.float8_e4m3fn,
        api.LinearMMConfig(),
        scaling_granularity=api.ScalingGranularity.AXISWISE if rowwise else api.ScalingGranularity.TENSORWISE,
        axiswise_dim=-1 if rowwise else None,
    )
    return cast._data, cast._scale.reciprocal()


def mx_status() -> tuple[bool, str]:
    """``(True, "torchao X.Y.Z")`` when torchao's MX cast imports, else ``(False, why)``."""
    try:
        _mx_api()
    except Exception as error:  # as in status(): any import failure
        return False, f"torchao's MX cast does not import ({type(error).__name__}: {error}); {_INSTALL_HINT}"
    import torchao

    return True, f"torchao {torchao.__version__}"


def _mx_api():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    return to_mx, {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


@torch.no_grad()
def mx_cast(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's MX cast of ``x`` to e4m3 (blocks of 32 along the last dim): ``(data, scale)``, scale E8M0."""
    to_mx, modes = _mx_api()
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, modes[rounding])
    return data, scale


def convert(block: torch.nn.Module) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``block`` for torchao's ``Float8Linear`` (tensor-wise recipe), in place.

    All of them: :func:`block_plan`'s float8 styles apply only to ``Float8Linear`` modules. The float8 styles
    cast with tensor-wise scales whatever the recipe, so the tensor-wise one is the one they match.
    """
    api = _float8_api()
    return api.convert_to_float8_training(block, config=api.Float8LinearConfig.from_recipe_name("tensorwise"))


def block_plan(mesh: DeviceMesh | None = None) -> dict:
    """torchao's float8 TP plan for a :func:`convert`-ed ``Block``: ``native_block_plan()`` with float8 styles.

    Same module names and layouts as ``fastmesh.testing.llama.native_block_plan()``. Raises ``RuntimeError``
    for a mesh on gloo (``mesh``'s device type is ``cpu``, or with no mesh given, a gloo default group), whose
    collectives reject float8 tensors.
    """
    _require_float8_collectives(mesh)
    api = _float8_api()
    return {
        "attention_norm": SequenceParallel(),
        "attention": api.PrepareFloat8ModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": api.Float8ColwiseParallel(),
        "attention.wk": api.Float8ColwiseParallel(),
        "attention.wv": api.Float8ColwiseParallel(),
        "attention.wo": api.Float8RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": api.PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": api.Float8ColwiseParallel(),
        "feed_forward.w2": api.Float8RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": api.Float8ColwiseParallel(),
    }


def _require_float8_collectives(mesh: DeviceMesh | None) -> None:
    if mesh is not None:
        on_gloo = mesh.device_type == "cpu"
    else:
        on_gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    if on_gloo:
        # Without this check the plan fails only at its first all-gather, deep in DTensor, with
        # "RuntimeError: Invalid scalar type" (gloo has no float8 dtypes; torch 2.14.1).
        raise RuntimeError(
            "torchao's float8 TP plan all-gathers float8 tensors (activations forward, gradients backward), "
            "and gloo, the CPU backend, rejects float8 dtypes ('Invalid scalar type'): run it on CUDA with NCCL"
        )

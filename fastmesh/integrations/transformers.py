"""Hugging Face transformers' tensor parallelism, run by fastmesh's fused styles.

transformers (>=5.20,<6) shards a model for ``from_pretrained(..., tp_plan="auto")`` or
``distributed_config=DistributedConfig(tp_plan=...)`` by looking each string of the plan up in its registry of
styles (``transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES``). :func:`register` puts fastmesh's there:

==========================================  =====================================================
plan string                                 style
==========================================  =====================================================
``colwise``                                 ``FusedColwiseParallel()``
``colwise_gather_output``, ``colwise_rep``  ``FusedColwiseParallel(output_layouts=Replicate())``
``rowwise``                                 ``FusedRowwiseParallel()``
``rowwise_split_input``, ``rowwise_rep``    ``FusedRowwiseParallel(input_layouts=Replicate())``
==========================================  =====================================================

each also as ``fastmesh_<string>``, for plans that mix the two libraries' styles. The strings stay the same, so
transformers' own checks of them (``generate()`` sizes its KV cache by ``"colwise"`` on ``k_proj``) still hold.
Every other string (``embedding_rowwise``, ``sequence_parallel``, ``packed_colwise``, ...) stays transformers'. A
module under a replaced string that is not a plain ``nn.Linear`` (a subclass with its own forward, a quantized
linear) runs transformers' own style, said once (WARNING, logger ``fastmesh.integrations``). Parameters are
DTensors placed as transformers places them, so checkpoints load and save as without fastmesh. Styles are looked up
while ``from_pretrained`` shards the model: register before it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import weakref
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from fastmesh._log import log_once
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel

if TYPE_CHECKING:
    from fastmesh.fp8 import Float8Config

__all__ = ["STYLE_NAMES", "SUPPORTED_TRANSFORMERS", "FusedStyle", "register", "registered", "unregister"]

SUPPORTED_TRANSFORMERS = ">=5.20,<6"
_OLDEST, _FIRST_UNSUPPORTED = (5, 20), (6, 0)
_INSTALL = "pip install 'fastmesh[transformers]'"
# The plan strings fastmesh serves (module plans on nn.Linear), in the order they are registered.
STYLE_NAMES = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep")

try:
    import transformers
except ImportError as error:
    raise ImportError(
        f"fastmesh.integrations.transformers needs Hugging Face transformers{SUPPORTED_TRANSFORMERS} and accelerate "
        f"(which transformers' tensor parallelism uses): {_INSTALL}"
    ) from error


def _check_version(version: str) -> None:
    """ImportError unless ``version`` is in :data:`SUPPORTED_TRANSFORMERS`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not _OLDEST <= (int(match[1]), int(match[2])) < _FIRST_UNSUPPORTED:
        raise ImportError(
            f"fastmesh.integrations.transformers supports transformers{SUPPORTED_TRANSFORMERS} (the tensor-parallel "
            f"style registry of transformers.distributed), found transformers {version}: {_INSTALL}"
        )


_check_version(getattr(transformers, "__version__", "unknown"))

try:
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import TensorParallelLayer
except ImportError as error:
    raise ImportError(
        f"fastmesh.integrations.transformers: transformers {transformers.__version__} has no tensor-parallel style "
        f"registry where {SUPPORTED_TRANSFORMERS} has it ({error}): {_INSTALL}"
    ) from error

logger = logging.getLogger("fastmesh.integrations")


def _not_served(module: nn.Module) -> str | None:
    """Why fastmesh's styles cannot run ``module`` (None: they can). fastmesh replaces a linear's forward with its
    own, so anything the module's forward does beyond ``nn.Linear``'s would be lost."""
    if not isinstance(module, nn.Linear):
        return "it is not an nn.Linear"
    if type(module).forward is not nn.Linear.forward:
        return "it is a subclass of nn.Linear with its own forward"
    if "forward" in vars(module):
        return "its forward was replaced"
    if getattr(module, "_hf_quantized_needs_local_tp", False):
        return "it is a quantized linear"
    return None


class FusedStyle(TensorParallelLayer):
    """A transformers TP style that runs ``fused`` (a fastmesh ``ParallelStyle``) on each plain ``nn.Linear`` and
    ``fallback`` (what the plan string ran before) on any other module, saying so once.

    transformers calls ``shard_param`` for each of a module's parameters, then ``install_forward`` for the module.
    fastmesh shards a linear itself (``parallelize_module``, into the placements transformers gives it), so the
    parameters ``fallback`` sharded are put back as they were first. A plan that names a linear's parameter but not
    the linear gets ``fallback``'s sharding alone, as without fastmesh.
    """

    def __init__(self, name: str, fused: ParallelStyle, fallback: TensorParallelLayer):
        self.name, self.fused, self.fallback = name, fused, fallback
        # transformers' own styles carry these, and code that inspects a style reads them.
        self.input_layouts, self.output_layouts = fused.input_layouts[0], fused.output_layouts[0]
        self.use_local_output = fused.use_local_output
        self._unsharded = weakref.WeakKeyDictionary()  # module -> {parameter name: the parameter before sharding}

    def validate_param(self, module, param, mesh, parameter_name=None):
        return self.fallback.validate_param(module, param, mesh, parameter_name=parameter_name)

    def shard_param(self, module, param, mesh, *, config=None, mesh_manager=None):
        if _not_served(module) is None:
            self._unsharded.setdefault(module, {}).setdefault(param, module._parameters.get(param))
        return self.fallback.shard_param(module, param, mesh, config=config, mesh_manager=mesh_manager)

    def install_forward(self, module, mesh, *, config=None, mesh_manager=None):
        why = _not_served(module)
        if why is not None:
            log_once(
                logger,
                logging.WARNING,
                (__name__, self.name, type(module)),
                "tp_plan style %r: %s runs transformers' own style, not fastmesh's: %s",
                self.name,
                type(module).__qualname__,
                why,
            )
            return self.fallback.install_forward(module, mesh, config=config, mesh_manager=mesh_manager)
        for name, param in self._unsharded.pop(module, {}).items():
            module._parameters[name] = param
        # src_data_rank=None: each rank keeps its own slice (of a meta placeholder the loader fills, or of weights
        # every rank initialized alike), as transformers' styles do; no collective per linear.
        parallelize_module(module, mesh, self.fused, src_data_rank=None)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.fused!r}, fallback={type(self.fallback).__name__})"


def _fused_styles(fp8: Float8Config | None) -> dict[str, ParallelStyle]:
    """The fastmesh style of each of :data:`STYLE_NAMES`. A gathered output is an LM head's: it stays in high
    precision under ``fp8``, as torchao's and torchtitan's FP8 recipes leave the output layer."""
    head = FusedColwiseParallel(output_layouts=Replicate())
    split_input = FusedRowwiseParallel(input_layouts=Replicate(), fp8=fp8)
    return {
        "colwise": FusedColwiseParallel(fp8=fp8),
        "colwise_gather_output": head,
        "colwise_rep": head,
        "rowwise": FusedRowwiseParallel(fp8=fp8),
        "rowwise_split_input": split_input,
        "rowwise_rep": split_input,
    }


# What register() replaced: registry name -> (whether the registry instance had its own entry, that entry).
_saved: dict[str, tuple[bool, object]] = {}
_current: dict | None = None  # register()'s arguments while registered


def _local_entries() -> dict:
    return getattr(ALL_PARALLEL_STYLES, "_local_mapping", {})


def register(*, override: bool = True, fp8: Float8Config | None = None) -> tuple[str, ...]:
    """Register fastmesh's fused styles in transformers' TP style registry; returns the names registered.

    Keyword Args:
        override (bool, optional): also under transformers' own strings (:data:`STYLE_NAMES`), so that
            ``tp_plan="auto"`` runs them; else only as ``fastmesh_<string>``. Default: True.
        fp8 (Float8Config, optional): run the colwise and rowwise matmuls in FP8 (not the gathered-output LM
            head's).

    Registering again replaces the earlier registration. Only the registry instance's own entries are written
    (``ALL_PARALLEL_STYLES[name] = ...``); :func:`unregister` restores what was there.

    Example::
        >>> # xdoctest: +SKIP("needs torchrun and a checkpoint")
        >>> import fastmesh.integrations.transformers as fastmesh_hf
        >>> from transformers import AutoModelForCausalLM
        >>> from transformers.distributed import DistributedConfig
        >>> fastmesh_hf.register()
        >>> model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))
        >>> model.train()  # from_pretrained returns the model in eval mode
    """
    global _current
    unregister()
    names = []
    for base, fused in _fused_styles(fp8).items():
        fallback = ALL_PARALLEL_STYLES.get(base)  # what the string runs without fastmesh (unregistered above)
        if fallback is None:  # a string this transformers does not have
            continue
        for name in (f"fastmesh_{base}", base) if override else (f"fastmesh_{base}",):
            local = _local_entries()
            _saved[name] = (name in local, local.get(name))
            ALL_PARALLEL_STYLES[name] = FusedStyle(name, fused, fallback)
            names.append(name)
    _current = {"override": override, "fp8": fp8}
    return tuple(names)


def unregister() -> None:
    """Restore the registry entries :func:`register` replaced (a no-op when nothing is registered). Models already
    sharded keep the styles they were sharded with."""
    global _current
    for name, (had_local, entry) in _saved.items():
        if had_local:
            ALL_PARALLEL_STYLES[name] = entry
        else:
            with contextlib.suppress(KeyError):
                del ALL_PARALLEL_STYLES[name]
    _saved.clear()
    _current = None


@contextlib.contextmanager
def registered(*, override: bool = True, fp8: Float8Config | None = None):
    """:func:`register` for the ``with`` block; on leaving it, the registration before it comes back.

    Example::
        >>> # xdoctest: +SKIP("needs torchrun and a checkpoint")
        >>> with fastmesh.integrations.transformers.registered():
        ...     model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    """
    before = _current
    register(override=override, fp8=fp8)
    try:
        yield
    finally:
        unregister()
        if before is not None:
            register(**before)

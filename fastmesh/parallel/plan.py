"""``fused(plan)``: torch's tensor-parallel plan, with fastmesh's fused styles wherever they compute the same thing.

The switch from torch's styles is one call: ``parallelize_module(model, mesh, fused(plan))``. What changes:

* ``ColwiseParallel`` / ``RowwiseParallel`` (torch's own classes, any arguments) become
  ``FusedColwiseParallel`` / ``FusedRowwiseParallel`` with the same arguments, whose defaults are torch's; on a
  module that is not an ``nn.Linear`` (an embedding under ``RowwiseParallel``), torch's style runs.
* A ``PrepareModuleInput`` that makes its module's first input ``Replicate()``, together with the
  ``ColwiseParallel()`` linears the plan lists under that module (attention's q/k/v, the SwiGLU's w1/w3),
  become one ``FusedColwiseParallel(linears=...)``: one fused gather for all of them, as torch's plan gathers once.

Everything else stays torch's, and ``fused`` says once (INFO, logger ``fastmesh.parallel``) what and why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from fastmesh._log import log_once
from fastmesh.parallel._common import check_fp8
from fastmesh.parallel.shared_gather import first_parameter
from fastmesh.parallel.style import FusedColwiseParallel, FusedRowwiseParallel

logger = logging.getLogger("fastmesh.parallel")

__all__ = ["fused"]

_FUSED = (FusedColwiseParallel, FusedRowwiseParallel)
_GLOB = frozenset("*?[")


def fused(plan, *, fp8=None):
    """The fused form of a torch tensor-parallel plan, for ``parallelize_module``.

    Plain-PyTorch equivalent: ``plan`` itself (``parallelize_module(model, mesh, plan)``); the fused plan computes
    the same outputs, placements and gradients with fewer, fused collectives.

    Args:
        plan (ParallelStyle or dict[str, ParallelStyle]): a plan as ``parallelize_module`` takes it: one style, or
            module paths (with ``fnmatch`` wildcards, ``"layers.*.attention.wq"``) to styles.
        fp8 (Float8Config, optional): run the fused linears in FP8 (``fastmesh.fp8.Float8Config``). A row-wise
            linear whose output layout FP8 cannot serve (``Shard(-1)``, ``Partial()``) stays high precision, and
            ``fused`` says so.

    Returns:
        A plan of the same form. Per entry:

        =================================================  ==================================================
        torch's entry                                      fused entry
        =================================================  ==================================================
        ``ColwiseParallel(**kw)``                          ``FusedColwiseParallel(**kw)``
        ``RowwiseParallel(**kw)``                          ``FusedRowwiseParallel(**kw)``
        ``PrepareModuleInput`` making input 0              ``FusedColwiseParallel(linears=..., input_layouts=
        ``Replicate()``, plus the ``ColwiseParallel()``    <its input 0 layout>)`` on the parent: one gather
        linears listed under it                            for all of them; the linears' entries folded in
        fastmesh's styles                                  as they are
        anything else (``SequenceParallel``,               as it is, said once with the reason
        ``PrepareModuleOutput``, subclasses, ...)
        =================================================  ==================================================

        A fused entry meeting a module it cannot fuse (not an ``nn.Linear``) applies torch's entry to it instead
        and says so once.

    Raises:
        TypeError: ``plan`` (or one of its values) is not a ParallelStyle or a dict of them.

    Example::
        >>> # xdoctest: +SKIP("needs a process group")
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> from fastmesh.parallel import fused
        >>> plan = {
        ...     "attention": PrepareModuleInput(
        ...         input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ...     ),
        ...     "attention.wq": ColwiseParallel(),
        ...     "attention.wk": ColwiseParallel(),
        ...     "attention.wv": ColwiseParallel(),
        ...     "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        ... }
        >>> parallelize_module(block, tp_mesh, fused(plan))  # one fused gather for q/k/v, a fused reduce-scatter
    """
    fp8 = check_fp8(fp8, "fused")
    if isinstance(plan, ParallelStyle):
        return _fused_style(plan, "", fp8)
    if not isinstance(plan, Mapping):
        raise TypeError(f"fused: plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    out, folded = {}, set()
    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"fused: plan keys must be module paths (str), got {key!r}")
        if isinstance(style, Mapping):  # a nested plan, as parallelize_module takes it
            out[key] = fused(style, fp8=fp8)
            continue
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"fused: plan[{key!r}] must be a ParallelStyle, got {type(style).__name__}")
        if type(style) is PrepareModuleInput:
            shared = _shared_gather(plan, key, style, fp8)
            if shared is not None:
                out[key] = shared
                folded.update(f"{key}.{name}" if key else name for name in shared.fused.linears)
                continue
        out[key] = _fused_style(style, key, fp8)
    return {key: style for key, style in out.items() if key not in folded}


def _fused_style(style: ParallelStyle, key: str, fp8) -> ParallelStyle:
    """The fused form of one entry (wrapped to run torch's entry on a module that is not an ``nn.Linear``), or the
    entry itself."""
    if isinstance(style, _FUSED + (_LinearsFused,)):
        return style
    kind = type(style)
    if kind not in (ColwiseParallel, RowwiseParallel):
        why = (
            "a subclass of torch's style: its own methods define it"
            if isinstance(style, (ColwiseParallel, RowwiseParallel))
            else "no matmul of its own to fuse a collective into"
        )
        _say(key, kind.__name__, why)
        return style
    kwargs = {
        "input_layouts": style.input_layouts[0],
        "output_layouts": style.output_layouts[0],
        "use_local_output": style.use_local_output,
    }
    if kind is ColwiseParallel:
        return _LinearsFused(FusedColwiseParallel(**kwargs, fp8=fp8), style, key)
    output = kwargs["output_layouts"]
    if fp8 is not None and not (isinstance(output, Replicate) or (isinstance(output, Shard) and output.dim != -1)):
        _say(key, "RowwiseParallel", f"fp8 cannot serve output_layouts={output!r}: it runs in high precision")
        fp8 = None
    return _LinearsFused(FusedRowwiseParallel(**kwargs, fp8=fp8), style, key)


def _shared_gather(plan: Mapping, key: str, prepare: PrepareModuleInput, fp8) -> _LinearsFused | None:
    """One ``FusedColwiseParallel(linears=...)`` for ``prepare`` at ``key`` and the plain ``ColwiseParallel`` linears
    the plan lists under it, or None (said once, why) when torch's plan there does something else."""
    prefix = f"{key}." if key else ""
    children = {
        path[len(prefix) :]: style
        for path, style in plan.items()
        if path.startswith(prefix) and type(style) is ColwiseParallel and not _GLOB & set(path[len(prefix) :])
    }
    found = _input_to_gather(prepare)
    why = found if isinstance(found, str) else _why_not_shared(prepare, children)
    if why is not None:
        _say(key, "PrepareModuleInput", why)
        return None
    input_name, layout = found
    style = next(iter(children.values()))  # all alike
    shared = FusedColwiseParallel(
        input_layouts=layout,
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
        linears=tuple(children),
        fp8=fp8,
    )
    one_by_one = {name: _fused_style(s, prefix + name, fp8) for name, s in children.items()}
    return _LinearsFused(shared, prepare, key, one_by_one, input_name)


def _input_to_gather(prepare: PrepareModuleInput) -> tuple[str | None, Placement] | str:
    """The one input ``prepare`` makes ``Replicate()`` (None: the first positional one; else its keyword) and its
    layout; or why there is none the shared gather can take."""
    layouts, desired = prepare.input_layouts or (), prepare.desired_input_layouts or ()
    by_name, desired_by_name = prepare.input_kwarg_layouts, prepare.desired_input_kwarg_layouts
    if layouts:
        if any(layout is not None for layout in layouts[1:]) or by_name:
            return "it places inputs besides the first, which the shared gather does not"
        name, layout, want = None, layouts[0], desired[0]
    elif len(by_name) == 1:
        ((name, layout),) = by_name.items()
        want = desired_by_name.get(name)
    else:
        return f"it places {len(by_name)} inputs by keyword, where the shared gather takes one"
    if layout is None or not isinstance(want, Replicate):
        return "it does not make its input Replicate()"
    if not isinstance(layout, (Shard, Replicate)):
        return f"its input is placed {layout!r}, which no fused op gathers"
    return name, layout


def _why_not_shared(prepare: PrepareModuleInput, children: dict) -> str | None:
    """Why ``prepare``'s module and ``children`` cannot share one gather, or None when they can: the module gets a
    DTensor (as the shared gather hands it), and the children take torch's default input and one output form."""
    if not children:
        return "the plan lists no ColwiseParallel linears under it to share its gather"
    if prepare.use_local_output:
        return "use_local_output=True hands the module a plain tensor, where the shared gather hands a DTensor"
    forms = {(s.input_layouts, s.output_layouts, s.use_local_output) for s in children.values()}
    if len(forms) > 1 or not isinstance(next(iter(forms))[0][0], Replicate):
        return "its ColwiseParallel linears differ in layouts, or take an input other than Replicate()"
    return None


def _say(key: str, what: str, why: str) -> None:
    where = key or "<root>"
    log_once(logger, logging.INFO, ("fused", key, what), "fused: %s at %r stays torch's: %s", what, where, why)


class _LinearsFused(ParallelStyle):
    """A fused style for ``nn.Linear`` modules, torch's entry for any other: ``torch_style`` (with ``children``, the
    fused forms of the linears it folded in, by path) where the fused style cannot apply."""

    def __init__(
        self, fused_style, torch_style: ParallelStyle, key: str, children: dict | None = None, input_name=None
    ):
        super().__init__()
        self.fused, self.torch_style, self.key = fused_style, torch_style, key
        # With linears: the fused forms of the linears torch_style's entry folded in, by path; the keyword the
        # parent's input is placed by (None: its first positional argument).
        self.children, self.input_name = children or {}, input_name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in (self.fused, self.torch_style, *self.children.values()):
            style.src_data_rank = self.src_data_rank  # parallelize_module sets it on the style it applies
        modules = {name: _submodule(module, name) for name in getattr(self.fused, "linears", None) or ("",)}
        not_linear = {name or "<the module>": type(m).__name__ for name, m in modules.items() if not _is_linear(m)}
        first = first_parameter(module.forward)
        if not_linear:
            why = f"not an nn.Linear: {not_linear}"
        elif self.input_name not in (None, first):
            why = f"it places {self.input_name!r}, where the shared gather takes the forward's first input {first!r}"
        else:
            return self.fused._apply(module, device_mesh)
        _say(self.key, type(self.torch_style).__name__, why)
        self.torch_style._apply(module, device_mesh)
        for name, style in self.children.items():
            if modules[name] is not None:  # torch's plan skips a path it cannot resolve, as here
                style._apply(modules[name], device_mesh)
        return module

    def __repr__(self) -> str:
        return f"fused({self.torch_style!r}) -> {self.fused!r}"


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name) if name else module
    except AttributeError:
        return None


def _is_linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear)

"""One all-gather shared by sibling linears: the machinery of ``FusedColwiseParallel(linears=(...))``.

Who owns what:

* A :class:`SharedGather` belongs to one parent module (``attention``, ``feed_forward``). It shards the listed
  linears' parameters, replaces each listed linear's ``forward`` and wraps the parent's.
* The parent's wrapped forward runs one fused gather + matmuls (``all_gather_matmul`` with every listed
  linear's weight), then the parent's own forward with the gathered input, a ``Replicate()`` DTensor. The
  linears' outputs ride on that DTensor (attribute ``_fastmesh_sibling_outputs``: name -> output) and nowhere
  else. A replicated plain-tensor input (``input_layouts=Replicate()``) has nothing to gather: the linears
  multiply locally and their input gradients share one fused all-reduce; a ``Replicate()`` DTensor input is
  passed on as it is, and each linear runs as torch's ``ColwiseParallel``.
* A listed linear called with that DTensor returns its output from it. In eager, an alias of it (same data
  pointer, shape, stride, dtype and placement: what a module with backward hooks receives) counts as it.

Release: when the parent's forward returns or raises, eager mode deletes the attribute and forgets the
gathered input, so a gathered input kept past the call never hands out outputs of weights changed since.
Compiled, nothing outlives the traced call.

A listed linear called without its parent, or with another input, runs alone, as under
``FusedColwiseParallel()`` (its own fused gather); called so during its parent's forward, it says so once
(WARNING, logger ``fastmesh.parallel``).

Gradients: any other use of the gathered input in the parent's forward is a DTensor op with its own
gradient; only the group's rank 0 passes that gradient on, so the fused op's reduce-scatter counts it once.
"""

from __future__ import annotations

import inspect
import logging
import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from fastmesh._log import log_once
from fastmesh.ops._shards import count_replicated_grad_once
from fastmesh.parallel._common import check_input_features, check_linear

logger = logging.getLogger("fastmesh.parallel")

_COLWISE = "FusedColwiseParallel"  # the style whose linears= builds a SharedGather

# On the gathered input itself, so that each sibling finds its output by its argument alone: compiled
# activation checkpointing forbids state outside the call.
_SIBLING_OUTPUTS = "_fastmesh_sibling_outputs"
# On the modules, not in closures, so that copy.deepcopy of a parallelized model gives a copy that runs its own
# weights: the parent holds its SharedGather, each listed linear (its SharedGather, its name), and their forwards
# are module-level functions bound to them (a deep copy rebinds a bound method to the copy of its module).
_SHARED_GATHER = "_fastmesh_shared_gather"
_SIBLING = "_fastmesh_sibling"


class SharedGather:
    """The listed linears of ``parent`` under ``style`` (a ``FusedColwiseParallel`` with ``linears``), and the
    gather they share. Built by the style's ``_apply``: it shards the linears and replaces their forwards and the
    parent's."""

    def __init__(self, style, mesh: DeviceMesh, parent: nn.Module):
        self.style, self.mesh = style, mesh
        self.named_linears = []
        for name in style.linears:
            try:
                child = parent.get_submodule(name)
            except AttributeError as error:
                raise ValueError(
                    f"{_COLWISE}: linears names {name!r}, which {type(parent).__name__} does not have"
                ) from error
            linear = check_linear(child, _COLWISE, name, mesh, "out_features", style.fp8)
            self.named_linears.append((name, linear))
        in_features = {linear.in_features for _, linear in self.named_linears}
        if len(in_features) != 1:
            raise ValueError(
                f"{_COLWISE}: the linears sharing a gather must read the same input, but their "
                f"in_features differ: {[(n, lin.in_features) for n, lin in self.named_linears]}"
            )
        # Eager only: the gathered input of the parent's call in progress, to recognize aliases of it.
        self.eager_gathered: DTensor | None = None
        for name, linear in self.named_linears:
            style._partition_linear_fn(linear, mesh)
            setattr(linear, _SIBLING, (self, name))
            linear.forward = types.MethodType(_sibling_forward, linear)
        self.parent_forward = parent.forward  # bound to the parent
        # Callers may pass the input by keyword (Hugging Face's decoder layers call ``self_attn(hidden_states=...)``).
        self.input_name = first_parameter(self.parent_forward)
        setattr(parent, _SHARED_GATHER, self)
        parent.forward = types.MethodType(_gathered_forward, parent)

    def gather_and_multiply(self, parent: nn.Module, args: tuple, kwargs: dict):
        """The parent's arguments with its input replaced by the gathered input, which carries the outputs."""
        if args:
            given, rest = args[0], args[1:]
        elif self.input_name in kwargs:
            given, rest = kwargs[self.input_name], ()
            kwargs = {k: v for k, v in kwargs.items() if k != self.input_name}
        else:
            raise TypeError(
                f"{_COLWISE}(linears={self.style.linears}): {type(parent).__name__}'s input must be its "
                f"first argument ({self.input_name or 'positional'}), which this call does not pass"
            )
        x, placement, rows = self.style._prepare_input_fn(given, self.mesh)
        in_features = self.named_linears[0][1].in_features
        check_input_features(x, in_features, _COLWISE, type(parent).__name__, linears=self.style.linears)
        if isinstance(x, DTensor):  # a Replicate() DTensor: each linear runs as torch's ColwiseParallel
            return (x, *rest), kwargs
        if isinstance(placement, Replicate):
            # Nothing to gather: the linears multiply locally, and their input gradients share one all-reduce.
            outs = self.style._replicated_matmul(self.mesh, self.named_linears, x)
            gathered = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        else:
            a, outs = self.style._gather_matmul(self.mesh, self.named_linears, x, placement, True, rows)
            a = count_replicated_grad_once(a, self.mesh)
            gathered = DTensor.from_local(a, self.mesh, [Replicate()], run_check=False)
        setattr(gathered, _SIBLING_OUTPUTS, {name: out for (name, _), out in zip(self.named_linears, outs)})
        if not torch.compiler.is_compiling():
            self.eager_gathered = gathered
        return (gathered, *rest), kwargs

    def release(self) -> None:
        if not torch.compiler.is_compiling() and self.eager_gathered is not None:
            delattr(self.eager_gathered, _SIBLING_OUTPUTS)
            self.eager_gathered = None

    def _outputs_for(self, x) -> dict | None:
        """The outputs ``x`` carries: ``x`` is the gathered input, or (eager) an alias of it; else None."""
        outputs = getattr(x, _SIBLING_OUTPUTS, None)
        gathered = self.eager_gathered
        if outputs is not None or gathered is None or not isinstance(x, DTensor):
            return outputs
        mine, theirs = x._local_tensor, gathered._local_tensor
        same = (
            x.placements == gathered.placements
            and mine.data_ptr() == theirs.data_ptr()
            and mine.shape == theirs.shape
            and mine.stride() == theirs.stride()
            and mine.dtype == theirs.dtype
        )
        return getattr(gathered, _SIBLING_OUTPUTS) if same else None

    def sibling_forward(self, linear: nn.Linear, name: str, x):
        """The forward of the listed linear ``name``: its shared output, or a run of its own."""
        outputs = self._outputs_for(x)
        if outputs is not None:
            return outputs[name]
        if self.eager_gathered is not None:
            log_once(
                logger,
                logging.WARNING,
                ("fastmesh.parallel", id(self), name),
                "%s: %s was called with an input other than the gathered input of its "
                "parent, so it runs on its own (no shared gather)",
                _COLWISE,
                name,
            )
        return self.style._forward(linear, x, self.mesh, name)


def _gathered_forward(parent: nn.Module, *args, **kwargs):
    """The parent's forward: the shared gather, the parent's own forward on the gathered input, release."""
    shared: SharedGather = getattr(parent, _SHARED_GATHER)
    args, kwargs = shared.gather_and_multiply(parent, args, kwargs)
    try:
        return shared.parent_forward(*args, **kwargs)
    finally:
        shared.release()


def _sibling_forward(linear: nn.Linear, x):
    shared, name = getattr(linear, _SIBLING)
    return shared.sibling_forward(linear, name, x)


def first_parameter(forward) -> str | None:
    """The name of ``forward``'s first parameter if it can be passed by keyword, else None."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C++ forward: positional only
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameters[0].name if parameters and parameters[0].kind in keyword else None

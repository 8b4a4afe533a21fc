"""The one home of fastmesh's ops: each ``torch.ops.fastmesh`` op's spec, from which everything else takes it.

An :class:`OpSpec` says what an op is (its schema) and which parts of fastmesh serve it; the parts themselves live
next to their kind and iterate :data:`SPECS`, and ``tests/test_op_specs.py`` fails where a spec and a part disagree
(an op the library does not define, a planned op without its C++ kernel, an autocast op without its Autocast kernel,
a fused op the compile pass or the benchmark does not know). Adding an op: CONTRIBUTING.md ("Adding an op").

Schemas live in Python rather than in ``_C`` so that the ops, their fake impls and therefore ``torch.compile``
tracing exist even where the extension failed to load. Ops with C++/CUDA kernels are defined here, and their kernels
register against them from ``csrc/`` (``TORCH_LIBRARY_IMPL(fastmesh, CPU|CUDA|Autograd, m)``). Ops whose Python body
launches Triton kernels are ``torch.library.triton_op``s (so compiled graphs see the kernels); their modules create
them from the signature here, because a triton_op defines its own schema.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

NAMESPACE = "fastmesh"

_QUANTIZE_ARGUMENTS = (
    "(Tensor x, ScalarType dtype, str granularity, Tensor? scale=None, Tensor? amax=None, bool transpose=False, "
    "bool power_of_two=False)"
)
_MX_ARGUMENTS = '(Tensor x, ScalarType dtype, str scale_rounding="floor", bool transpose=False)'


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op: what it is, and which parts of fastmesh serve it.

    ``planned``: a fused op planned per call, whose C++ kernel remembers each key's plan (``csrc/fused/kernels.cpp``,
    ``planned.h``; its module registers the planned run with ``plans.planned_run``). ``autograd``: ``"cpp"``
    (``csrc/fused/autograd.cpp``), ``"front"`` (the Python front's autograd Function, for the FP8 forms, which take
    quantized data), or ``""`` (not differentiable). ``autocast``: its operands are high-precision matrices, cast to
    an autocast region's dtype by an Autocast kernel per device type (``autocast.py``). ``traced``: inductor may
    trace an unfused plan of it as torch's collectives (its module registers the trace with
    ``traced_unfused.trace``). ``compile_pass``: the compile pass produces it (``fastmesh/compile/rewrite.py``).
    ``front``: the public Python function that calls it. ``host_bench``: the host benchmark times its front
    (``bench/host.py``).
    """

    name: str
    signature: str  # the schema without the name
    module: str  # the module that holds its checks, fake impl, planned run or body, and front
    planned: bool = False
    autograd: str = ""
    autocast: bool = False
    traced: bool = False
    compile_pass: bool = False
    triton_op: bool = False
    front: str = ""
    host_bench: bool = False


def _fused(name, signature, module, *, fp8=False, front, **parts):
    """A fused collective: planned per call; high precision (C++ autograd, autocast) or its FP8 form (autograd in
    the front, no autocast: its operands are FP8 data)."""
    if fp8:
        return OpSpec(name, signature, module, planned=True, autograd="front", front=front, **parts)
    return OpSpec(name, signature, module, planned=True, autograd="cpp", autocast=True, front=front, **parts)


SPECS = (
    # Fused collectives (fastmesh/ops/fused_collectives.py). pieces: pipeline pieces of rows, 0 = the call's plan.
    # keep_gathered: autograd saves the gathered a for the bs' gradients rather than the shard (gathered again).
    _fused(
        "all_gather_matmul",
        "(Tensor a_shard, Tensor[] bs, int gather_dim, str group_name, bool return_a=False, int pieces=0, "
        "bool keep_gathered=False) -> (Tensor?, Tensor[])",
        "fastmesh.ops.fused_collectives",
        front="fastmesh.all_gather_matmul",
        traced=True,
        compile_pass=True,
        host_bench=True,
    ),
    _fused(
        "matmul_reduce_scatter",
        "(Tensor a, Tensor b, int scatter_dim, str reduce_op, str group_name, int pieces=0) -> Tensor",
        "fastmesh.ops.fused_collectives",
        front="fastmesh.matmul_reduce_scatter",
        traced=True,
        compile_pass=True,
        host_bench=True,
    ),
    # all_reduce(a @ b), pieces of the product's rows (fastmesh/ops/matmul_all_reduce.py).
    _fused(
        "matmul_all_reduce",
        "(Tensor a, Tensor b, str reduce_op, str group_name, int pieces=0) -> Tensor",
        "fastmesh.ops.matmul_all_reduce",
        front="fastmesh.matmul_all_reduce",
        traced=True,
        compile_pass=True,
        host_bench=True,
    ),
    # cat(all_gather(a @ b), -1), pieces of the product's rows (fastmesh/ops/matmul_all_gather.py).
    _fused(
        "matmul_all_gather",
        "(Tensor a, Tensor b, str group_name, int pieces=0) -> Tensor",
        "fastmesh.ops.matmul_all_gather",
        front="fastmesh.matmul_all_gather",
        traced=True,
        compile_pass=True,
        host_bench=True,
    ),
    # Their FP8 forms: FP8 data with tensor-wise, row-wise, MX or block scales. The fronts' fp8= reaches them.
    _fused(
        "all_gather_scaled_matmul",
        "(Tensor a_shard, Tensor a_scale, Tensor[] bs, Tensor[] b_scales, int gather_dim, str group_name, "
        "ScalarType out_dtype, bool return_a=False, int pieces=0) -> (Tensor?, Tensor?, Tensor[])",
        "fastmesh.ops.fused_collectives_fp8",
        fp8=True,
        front="fastmesh.all_gather_matmul(fp8=)",
        compile_pass=True,
        host_bench=True,
    ),
    _fused(
        "scaled_matmul_reduce_scatter",
        "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, int scatter_dim, str reduce_op, str group_name, "
        "ScalarType out_dtype, int pieces=0) -> Tensor",
        "fastmesh.ops.fused_collectives_fp8",
        fp8=True,
        front="fastmesh.matmul_reduce_scatter(fp8=)",
        compile_pass=True,
        host_bench=True,
    ),
    _fused(
        "scaled_matmul_all_reduce",
        "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, str reduce_op, str group_name, ScalarType out_dtype, "
        "int pieces=0) -> Tensor",
        "fastmesh.ops.matmul_all_reduce",
        fp8=True,
        front="fastmesh.matmul_all_reduce(fp8=)",
        compile_pass=True,
        host_bench=True,
    ),
    # matmul_all_gather's backward: this rank's column block of a replicated gradient, the rank read at run time.
    OpSpec("rank_columns", "(Tensor t, str group_name) -> Tensor", "fastmesh.ops.matmul_all_gather"),
    # The FP8 ops' scaled multiply alone and local (fastmesh/ops/scaled_matmul.py): a plain-TP colwise linear in FP8.
    OpSpec(
        "scaled_matmul",
        "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype) -> Tensor",
        "fastmesh.ops.scaled_matmul",
    ),
    # FP8 cast-and-scale: the triton_op users call, and the C++/CUDA kernels it dispatches to on CUDA when the CUDA
    # C++ implementation is selected (a CPU call runs the C++ kernel directly). A triton_op's schema must be
    # expressible as Python annotations on torch 2.11, which have no optional returns: data_t and scale_t are empty
    # tensors unless transpose=True.
    OpSpec(
        "fp8_quantize",
        _QUANTIZE_ARGUMENTS + " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        "fastmesh.ops.fp8_quantize",
        triton_op=True,
        front="fastmesh.fp8.quantize",
        host_bench=True,
    ),
    OpSpec(
        "fp8_quantize_native",
        _QUANTIZE_ARGUMENTS + " -> (Tensor data, Tensor scale, Tensor amax, Tensor? data_t, Tensor? scale_t)",
        "fastmesh.ops.fp8_quantize",
    ),
    # The MX cast (fastmesh/ops/mx_quantize.py): the triton_op users call and the C++/CUDA kernels, as above.
    OpSpec(
        "mx_quantize",
        _MX_ARGUMENTS + " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        "fastmesh.ops.mx_quantize",
        triton_op=True,
        front='fastmesh.fp8.quantize(granularity="mx")',
        host_bench=True,
    ),
    OpSpec(
        "mx_quantize_native",
        _MX_ARGUMENTS + " -> (Tensor data, Tensor scale, Tensor amax, Tensor? data_t, Tensor? scale_t)",
        "fastmesh.ops.mx_quantize",
    ),
    OpSpec("amax", '(Tensor x, str granularity="tensorwise") -> Tensor', "fastmesh.ops.amax", front="fastmesh.amax"),
)
_BY_NAME = {spec.name: spec for spec in SPECS}

library = torch.library.Library(NAMESPACE, "FRAGMENT")
for _spec in SPECS:
    if not _spec.triton_op:
        library.define(_spec.name + _spec.signature, tags=(torch.Tag.pt2_compliant_tag,))


def spec(op: str) -> OpSpec:
    """The spec of ``op`` (``"amax"``); a KeyError listing the ops for another name."""
    found = _BY_NAME.get(op)
    if found is None:
        raise KeyError(f"fastmesh defines no op {op!r}; known ops: {sorted(_BY_NAME)}")
    return found


def qualified_name(op: str) -> str:
    """``"amax"`` -> ``"fastmesh::amax"``."""
    return f"{NAMESPACE}::{spec(op).name}"


def signature(op: str) -> str:
    """The schema of ``op`` without its name, e.g. for ``torch.library.triton_op(..., schema=...)``."""
    return spec(op).signature


def below_autograd():
    """Where the casts are called: below autograd. They are not differentiable, and the autograd kernel torch gives a
    triton_op is Python (measured ~10 us of a 30 us CPU cast). Nothing to skip while dynamo traces (and it cannot
    trace the guard)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()

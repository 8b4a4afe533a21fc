"""The one home of fastmesh's op schemas.

Every ``torch.ops.fastmesh`` op's signature is written here, once. Ops with only C++/CUDA kernels are
defined here; kernels register against them from ``csrc/`` (``TORCH_LIBRARY_IMPL(fastmesh, CPU|CUDA,
m)``) and fake impls come from the op modules next to this file. Ops whose Python body launches Triton
kernels are ``torch.library.triton_op``s (so compiled graphs see the kernels); they are created in their
op module from the signature given here, because a triton_op defines its own schema.

Schemas live in Python rather than in ``_C`` so that the ops, their fake impls and therefore
``torch.compile`` tracing exist even where the extension failed to load.
"""

import torch

NAMESPACE = "fastmesh"

_QUANTIZE_ARGUMENTS = (
    "(Tensor x, ScalarType dtype, str granularity, Tensor? scale=None, Tensor? amax=None, bool transpose=False, "
    "bool power_of_two=False)"
)

_MX_ARGUMENTS = '(Tensor x, ScalarType dtype, str scale_rounding="floor", bool transpose=False)'

# name -> signature (without the name)
_SIGNATURES = {
    "amax": '(Tensor x, str granularity="tensorwise") -> Tensor',
    # FP8 cast-and-scale: the triton_op users call, and the C++/CUDA kernels it dispatches to for CPU
    # tensors and for CUDA tensors when the CUDA C++ implementation is selected.
    # (A triton_op's schema must be expressible as Python annotations on torch 2.11, which have no
    # optional returns: data_t and scale_t are empty tensors unless transpose=True.)
    "fp8_quantize": _QUANTIZE_ARGUMENTS + " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fp8_quantize_native": _QUANTIZE_ARGUMENTS
    + " -> (Tensor data, Tensor scale, Tensor amax, Tensor? data_t, Tensor? scale_t)",
    # MXFP8 cast (fastmesh/ops/mx_quantize.py): the triton_op users call and the C++/CUDA kernels, as above.
    "mx_quantize": _MX_ARGUMENTS + " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "mx_quantize_native": _MX_ARGUMENTS
    + " -> (Tensor data, Tensor scale, Tensor amax, Tensor? data_t, Tensor? scale_t)",
    # Fused collectives (fastmesh/ops/fused_collectives.py). pieces: pipeline pieces of rows, 0 = the call's plan
    # (fastmesh/ops/plans.py).
    "all_gather_matmul": "(Tensor a_shard, Tensor[] bs, int gather_dim, str group_name, bool return_a=False, "
    "int pieces=0) -> (Tensor?, Tensor[])",
    "matmul_reduce_scatter": "(Tensor a, Tensor b, int scatter_dim, str reduce_op, str group_name, int pieces=0) "
    "-> Tensor",
    # fastmesh/ops/matmul_all_reduce.py: all_reduce(a @ b), pieces of the product's rows.
    "matmul_all_reduce": "(Tensor a, Tensor b, str reduce_op, str group_name, int pieces=0) -> Tensor",
    # fastmesh/ops/matmul_all_gather.py: cat(all_gather(a @ b), -1), pieces of the product's rows.
    "matmul_all_gather": "(Tensor a, Tensor b, str group_name, int pieces=0) -> Tensor",
    # Its backward's slice: this rank's column block of a replicated gradient, the rank read at run time.
    "rank_columns": "(Tensor t, str group_name) -> Tensor",
    "scaled_matmul_all_reduce": "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, str reduce_op, str group_name, "
    "ScalarType out_dtype, int pieces=0) -> Tensor",
    # Their FP8 forms (fastmesh/ops/fused_collectives_fp8.py): FP8 data with tensor-wise, row-wise, MX or block scales.
    "all_gather_scaled_matmul": "(Tensor a_shard, Tensor a_scale, Tensor[] bs, Tensor[] b_scales, int gather_dim, "
    "str group_name, ScalarType out_dtype, bool return_a=False, int pieces=0) -> (Tensor?, Tensor?, Tensor[])",
    "scaled_matmul_reduce_scatter": "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, int scatter_dim, "
    "str reduce_op, str group_name, ScalarType out_dtype, int pieces=0) -> Tensor",
    # Their local multiply alone (fastmesh/ops/scaled_matmul.py): a plain-TP column-parallel linear in FP8.
    "scaled_matmul": "(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype) -> Tensor",
}

# Created by torch.library.triton_op in their op module, with the signature above.
_TRITON_OPS = {"fp8_quantize", "mx_quantize"}

library = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _signature in _SIGNATURES.items():
    if _name not in _TRITON_OPS:
        library.define(_name + _signature, tags=(torch.Tag.pt2_compliant_tag,))


def qualified_name(op: str) -> str:
    """``"amax"`` -> ``"fastmesh::amax"``."""
    if op not in _SIGNATURES:
        raise KeyError(f"fastmesh defines no op {op!r}; known ops: {sorted(_SIGNATURES)}")
    return f"{NAMESPACE}::{op}"


def signature(op: str) -> str:
    """The schema of ``op`` without its name, e.g. for ``torch.library.triton_op(..., schema=...)``."""
    qualified_name(op)
    return _SIGNATURES[op]

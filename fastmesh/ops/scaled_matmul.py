"""``fastmesh::scaled_matmul``: the scaled multiply of the FP8 fused ops, alone and local. A column-parallel linear
with a replicated input (plain TP, :mod:`fastmesh.ops.replicated_input`) runs it: there is nothing to gather.

Plain-PyTorch equivalent (``deq(d, s)``: ``d.float() * s``, each scale element covering its block, in the layouts
of ``_fp8_operands.py``)::

    result = (deq(a, a_scale) @ deq(b, b_scale)).to(out_dtype)

Shapes (``out_dtype``: float32, bfloat16 or float16)::

    a  [..., K] FP8                    a_scale  [], [..., 1], [..., K/32] e8m0, [..., ceil(K/128)]
    b  [K, N]   FP8                    b_scale  [], [1, N], [K/32, N] e8m0, [ceil(K/128), ceil(N/128)]
    result [..., N] out_dtype

It multiplies as the fused FP8 ops do (``csrc/fused/scaled.h``): ``torch._scaled_mm`` for tensor-wise and row-wise
scales and, on SM90, 1x128 x 128x128 block scales; otherwise both operands dequantized to ``out_dtype`` and
multiplied. The op says which once in the log. No autograd (the operands are FP8). Errors: TypeError
/ ValueError naming the argument, as the fused FP8 ops'.
"""

from __future__ import annotations

import torch

from fastmesh import _cpp_lib
from fastmesh.ops._fp8_operands import check_scaled_operands, log_multiply
from fastmesh.ops._library import library, qualified_name

_OP = "fastmesh::scaled_matmul"


@torch.library.register_fake(qualified_name("scaled_matmul"))
def _scaled_matmul_fake(a, a_scale, b, b_scale, out_dtype):
    check_scaled_operands(a, a_scale, b, b_scale, out_dtype, _OP)
    return a.new_empty(list(a.shape[:-1]) + [b.shape[1]], dtype=out_dtype)


def _scaled_matmul_kernel(a, a_scale, b, b_scale, out_dtype):
    log_multiply(_OP, a.dtype, b, check_scaled_operands(a, a_scale, b, b_scale, out_dtype, _OP), out_dtype)
    return _cpp_lib.load().scaled_matmul(a, a_scale, b, b_scale, out_dtype)


for _device in ("CPU", "CUDA"):
    library.impl("scaled_matmul", _scaled_matmul_kernel, _device)

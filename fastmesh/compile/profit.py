"""Whether fusing a matched collective pays: the plan the fused op would run (``fastmesh/ops/plans.py``).

:func:`unprofitable` asks the planner offline (no collectives during compilation: the cached measured plan,
else the cost model) on the graph's fake tensors. When that plan is the unfused sequence it gives the reason
to leave the collective to inductor; otherwise, and for symbolic shapes (the op then plans each call at run
time), it gives None. Why ranks decide alike: ``docs/design/compile.md``.
"""

from __future__ import annotations

import torch

from fastmesh.compile import patterns
from fastmesh.ops import plans
from fastmesh.ops.fused_collectives import gather_plan_call, scatter_plan_call
from fastmesh.ops.fused_collectives_fp8 import scaled_gather_plan_call, scaled_scatter_plan_call
from fastmesh.ops.matmul_all_gather import plan_call as product_gather_plan_call
from fastmesh.ops.matmul_all_reduce import plan_call as all_reduce_plan_call
from fastmesh.ops.matmul_all_reduce import scaled_plan_call as scaled_all_reduce_plan_call


def _gather_call(match: patterns.GatherMatch) -> plans.Call | None:
    shard = patterns.fake_value(match.shard)
    bs = [patterns.fake_value(c.b) for c in match.consumers]
    if not plans.has_static_shape(shard, *bs):
        return None
    dim = match.gather_dim % shard.dim()
    if match.a_scale is None:
        return gather_plan_call(shard, bs, dim, match.group_name)
    a_scale = patterns.fake_value(match.a_scale)
    if match.scale_gather is not None:  # row-wise: the shard's scales, one per row
        a_scale = shard.new_empty(list(shard.shape[:-1]) + [1], dtype=torch.float32)
    return scaled_gather_plan_call(shard, a_scale, bs, dim, match.group_name, match.out_dtype)


def _product_gather_call(match: patterns.ProductGatherMatch) -> plans.Call | None:
    a, b = (patterns.fake_value(operand) for operand in match.matmul.args[:2])
    return product_gather_plan_call(a, b, match.group_name) if plans.has_static_shape(a, b) else None


def _scatter_call(match: patterns.ScatterMatch) -> plans.Call | None:
    product = patterns.fake_value(match.product)
    terms = [tuple(map(patterns.fake_value, patterns.matmul_operands(t))) for t in match.terms]
    if not plans.has_static_shape(product, *(t for term in terms for t in term)):
        return None
    shape = [patterns.size_value(s) for s in match.shape_args]
    if not all(isinstance(s, int) for s in shape):
        return None
    a0, b0 = terms[0]
    k = sum(a.shape[-1] for a, _ in terms)
    a = a0.new_empty(shape[:-1] + [k])  # the op's a: the product's leading dims, the terms' contractions
    b = b0.new_empty([k, b0.shape[-1]])
    if match.scaled is None:
        if match.scatter_dim is None:
            return all_reduce_plan_call(a, b, match.group_name)
        return scatter_plan_call(a, b, match.scatter_dim % len(shape), match.group_name)
    a_scale, b_scale = (patterns.fake_value(match.scaled[name]) for name in ("scale_a", "scale_b"))
    a_scale = a.new_empty(shape[:-1] + [1], dtype=torch.float32) if a_scale.dim() else a_scale
    out_dtype = match.scaled["out_dtype"] or product.dtype
    if match.scatter_dim is None:
        return scaled_all_reduce_plan_call(a, a_scale, b, b_scale, match.group_name, out_dtype)
    return scaled_scatter_plan_call(a, a_scale, b, b_scale, match.scatter_dim % len(shape), match.group_name, out_dtype)


def unprofitable(match) -> str | None:
    """Why fusing ``match`` (a GatherMatch, a ProductGatherMatch, or a ScatterMatch of a reduce-scatter or an
    all-reduce) would not pay, or None to fuse it."""
    if isinstance(match, patterns.GatherMatch):
        call = _gather_call(match)
    elif isinstance(match, patterns.ProductGatherMatch):
        call = _product_gather_call(match)
    else:
        call = _scatter_call(match)
    decision = None if call is None else plans.unfused_offline(call)
    if decision is None:
        return None
    return f"not profitable: {call.op}'s plan for these shapes is {decision.describe()}"

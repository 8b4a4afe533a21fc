"""``torch.compile`` integration: an opt-in inductor pass that fuses native TP graphs into fastmesh ops.

    import fastmesh.compile
    fastmesh.compile.enable_fusion()                 # or enable_fusion(strict=True)
    model = torch.compile(model_with_native_tp_plan)
    ...
    print(fastmesh.compile.fusion_report())          # what was fused, what was left and why

The pass (``post_grad_custom_post_pass``) rewrites, in the forward and backward graphs inductor compiles:

==========================================================  ==========================================
native pattern (post-grad FX, functional collectives)       becomes
==========================================================  ==========================================
``wait(all_gather(x))`` [split/cat to dim d] [reshape 2-D]  ``fastmesh::all_gather_matmul(x, [b_1..b_n],
-> ``mm(., b_i)`` / ``addmm(bias_i, ., b_i)``, n >= 1          d, group, return_a)`` (+ ``bias_i``); one call
                                                            for every matmul of the gathered tensor
``mm(x, b)`` or a sum of ``mm(x_j, b_j)`` [reshape]           ``fastmesh::matmul_reduce_scatter(x, b, d,
[split/cat from dim d] -> ``wait(reduce_scatter(., op))``    op, group)``; a sum becomes one matmul of
                                                            ``cat(x_j, -1)`` by ``cat(b_j, 0)``
the same -> ``wait(all_reduce(., op))``                     ``fastmesh::matmul_all_reduce(x, b, op, group)``
either reduction of ``addmm(bias / W, x, b)`` (or ``mm`` +   the fused op, then ``+ bias`` once: DTensor's
``bias / W``), ``bias`` a DTensor's replicated bias, op sum  partial form of a replicated bias
any of them, with ``_scaled_mm`` of FP8 data               ``all_gather_scaled_matmul`` /
                                                            ``scaled_matmul_reduce_scatter`` /
                                                            ``scaled_matmul_all_reduce``
==========================================================  ==========================================

The fused graph computes what the native one computes, up to summation order. Any other all-gather or
reduce-scatter, any all-reduce of a matmul, and one whose fused plan would not pay, is left as it is, logged on
the ``fastmesh.compile`` logger and listed in :func:`fusion_report` with the reason (all-reduces of anything but
a matmul are not listed); ``strict=True`` makes those that cannot be fused a :class:`FusionError`.
With the pass, the native plan's gathered inputs are kept for backward as their shards and gathered again there
(``fastmesh/compile/saved_shards.py``; ``enable_fusion(keep_gathered=True)`` keeps them gathered, as torch does).
``fusion_options()`` gives the same as ``torch.compile`` options for one compile. How the pass works and why:
``docs/design/compile.md``.
"""

from fastmesh.compile.fusion import (
    FusionEntry,
    FusionError,
    FusionPass,
    FusionReport,
    disable_fusion,
    enable_fusion,
    fuse_graph,
    fusion_enabled,
    fusion_options,
    fusion_report,
)

__all__ = [
    "FusionEntry",
    "FusionError",
    "FusionPass",
    "FusionReport",
    "disable_fusion",
    "enable_fusion",
    "fuse_graph",
    "fusion_enabled",
    "fusion_options",
    "fusion_report",
]

"""What the installed torch can do, where a test depends on its version (fastmesh supports torch 2.11 to 2.14)."""

import pytest
import torch
from fastmesh.bench.fused_collectives import rowwise_scaled_mm_on_cpu

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# torch._scaled_mm takes row-wise scales on CPU from 2.13 (tensor-wise only before): the rule the benchmarks skip by.
ROWWISE_ON_CPU = rowwise_scaled_mm_on_cpu()
# For a row-wise case parametrized on the ranks' tests: a skip raised in a rank's body would be that rank's failure.
NEEDS_ROWWISE_ON_CPU = pytest.mark.skipif(
    not ROWWISE_ON_CPU, reason=f"torch {torch.__version__}'s CPU _scaled_mm takes tensor-wise scales only (2.13 on)"
)

# torch 2.11 gives a *leaf* DTensor sharded unevenly along a dim past the first a wrong gradient through to_local
# (the backward's DTensor has the stride of an even shard; AccumulateGrad then makes it Replicate() with rank 0's
# values). A layer's input that an earlier layer computed is not a leaf, and gets its gradient right.
UNEVEN_LEAF_GRADIENTS = TORCH_VERSION >= (2, 12)

# torch 2.11's to_local turns a missing gradient into zeros (2.12 on leaves it None), so a weight whose local tensor
# fed an output nothing used gets a zero gradient there.
TO_LOCAL_KEEPS_NO_GRADIENT = TORCH_VERSION >= (2, 12)

# torch's native sequence-parallel plan runs sequences of a length the TP degree does not divide from 2.13 (before,
# its attention's view of the gathered sequence fails).
NATIVE_PLAN_RUNS_UNEVEN_SEQUENCES = TORCH_VERSION >= (2, 13)


def layer_input(leaf):
    """What a test gives a module for the DTensor ``leaf`` whose gradient it reads: ``leaf`` itself, or on torch 2.11,
    whose leaves sharded unevenly get wrong gradients (``UNEVEN_LEAF_GRADIENTS``), a product of it, as a layer's
    input is."""
    return leaf if UNEVEN_LEAF_GRADIENTS else leaf * 1

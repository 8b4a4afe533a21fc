"""The one home of fastmesh's op schemas.

Every ``torch.ops.fastmesh`` op is defined here, once; kernels register against these schemas from
C++/CUDA (``TORCH_LIBRARY_IMPL(fastmesh, CPU|CUDA, m)`` in ``csrc/``), and fake impls and autograd
formulas from the op modules next to this file. Schemas live in Python rather than in ``_C`` so that
the ops, their fake impls and therefore ``torch.compile`` tracing exist even where the extension
failed to load, and so that Triton-backed ops can share the namespace.
"""

import torch

NAMESPACE = "fastmesh"

_SCHEMAS = {
    "amax": "amax(Tensor x) -> Tensor",
}

library = torch.library.Library(NAMESPACE, "FRAGMENT")
for _schema in _SCHEMAS.values():
    library.define(_schema, tags=(torch.Tag.pt2_compliant_tag,))


def qualified_name(op: str) -> str:
    """``"amax"`` -> ``"fastmesh::amax"``."""
    if op not in _SCHEMAS:
        raise KeyError(f"fastmesh defines no op {op!r}; known ops: {sorted(_SCHEMAS)}")
    return f"{NAMESPACE}::{op}"

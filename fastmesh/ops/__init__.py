"""fastmesh's custom ops: schemas (``_library``), fake impls, autograd and Python fronts."""

from fastmesh.ops import _library
from fastmesh.ops.amax import amax

__all__ = ["amax"]

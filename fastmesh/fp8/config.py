"""FP8 recipe configuration: ``Float8Config``, defined with the ops that take it (``fastmesh/ops/fp8_config.py``)."""

from fastmesh.ops.fp8_config import Float8Config, check_history

__all__ = ["Float8Config", "check_history"]

"""Adapters that run fastmesh's fused styles inside other frameworks' own tensor parallelism.

Each adapter is a submodule that imports its framework; importing this package imports none of them:

* :mod:`fastmesh.integrations.transformers`: Hugging Face transformers' ``tp_plan`` strings
  (``pip install fastmesh[transformers]``).
"""

__all__: list[str] = []

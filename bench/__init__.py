"""fastmesh's microbenchmarks and their runner, ``fastmesh bench`` (installed as ``fastmesh.bench``).

Each family (``fp8_quantize``, ``amax``, ``fused_collectives``, ``sweep``, ``tp_block``, ``hf_model``) times
fastmesh's kernel beside its baselines and its bound in the same interleaved rounds; ``runner`` starts the ranks,
prints the table and writes the JSON and the plots. See ``fastmesh bench --help`` and the README's "Benchmarks" section.
"""

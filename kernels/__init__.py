"""fastmesh's Triton kernels, installed as ``fastmesh.kernels``.

Each kernel family lands here with its plain-PyTorch reference; the ops in ``fastmesh.ops`` reach
them through ``torch.library.triton_op`` so that compiled graphs see the kernels themselves.
"""

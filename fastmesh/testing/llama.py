"""A small Llama-style model and its two sequence-parallel TP plans: torch's native one and fastmesh's fused one.

Tests, the block benchmark and the training example all use it, so that they compare the same thing. The
model is the usual pre-norm decoder: RMSNorm, attention with rotary position embeddings (RoPE) and grouped
key/value heads, a SwiGLU feed-forward, residuals; names follow torchtitan's (``attention.wq`` ...
``feed_forward.w3``) so that the plans read like the ones users write.

Per block, with ``tp`` ranks and a sequence-sharded block input ``[B, S/tp, D]``:

=================  ==========================================  ===================================================
module             native plan (torch)                         fastmesh plan
=================  ==========================================  ===================================================
attention_norm     SequenceParallel()                          SequenceParallel()
attention          PrepareModuleInput(Shard(1) -> Replicate)   FusedColwiseParallel(linears=("wq","wk","wv"),
                                                                                    input_layouts=Shard(1))
attention.wq/wk/wv ColwiseParallel()                           (the parent's style)
attention.wo       RowwiseParallel(output_layouts=Shard(1))    FusedRowwiseParallel(output_layouts=Shard(1))
ffn_norm           SequenceParallel()                          SequenceParallel()
feed_forward       PrepareModuleInput(Shard(1) -> Replicate)   FusedColwiseParallel(linears=("w1","w3"),
                                                                                    input_layouts=Shard(1))
feed_forward.w1/w3 ColwiseParallel()                           (the parent's style)
feed_forward.w2    RowwiseParallel(output_layouts=Shard(1))    FusedRowwiseParallel(output_layouts=Shard(1))
=================  ==========================================  ===================================================

The plain TP plans (``block_plan("native-plain" | "fastmesh-plain")``, no sequence parallelism: block input
``[B, S, D]`` replicated) drop the norms' and PrepareModuleInput's styles; torch's has ``ColwiseParallel()`` /
``RowwiseParallel()`` on each linear, fastmesh's ``FusedColwiseParallel(linears=...)`` on ``attention`` and
``feed_forward`` and ``FusedRowwiseParallel()`` on ``wo``, ``w2`` (torch's defaults: a replicated input, an
all-reduced output).

The whole model adds the token embedding (``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``
in both plans), the final norm (``SequenceParallel``) and the output head, column-parallel with vocab-sharded
logits (a DTensor ``Shard(-1)``, for ``loss_parallel``): ``ColwiseParallel(input_layouts=Shard(1))`` natively,
``FusedColwiseParallel(input_layouts=Shard(1))`` in fastmesh's plan.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel


@dataclasses.dataclass(frozen=True)
class LlamaArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 96
    vocab_size: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[seq_len, head_dim / 2]`` float32, of the rotary embedding's angles."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` ``[B, S, H, head_dim]`` by its position's angle."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under TP each rank holds its share of the (query and key/value) heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, S]`` -> logits ``[B, S, vocab]`` (vocab-sharded DTensor under either TP plan)."""
        rope = rope_tables(tokens.shape[1], self.args.head_dim, self.args.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))


def native_block_plan() -> dict:
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def fused_block_plan(fp8=None, pieces: int | None = None, keep_gathered: bool = False) -> dict:
    """fastmesh's sequence-parallel plan: one fused gather per parent, matmul + reduce-scatter; the parents' shards
    kept for backward (``keep_gathered``: their gathered inputs)."""
    colwise = dict(input_layouts=Shard(1), fp8=fp8, pieces=pieces, keep_gathered=keep_gathered)
    rowwise = dict(output_layouts=Shard(1), fp8=fp8, pieces=pieces)
    return {
        "attention_norm": SequenceParallel(),
        "attention": FusedColwiseParallel(linears=("wq", "wk", "wv"), **colwise),
        "attention.wo": FusedRowwiseParallel(**rowwise),
        "ffn_norm": SequenceParallel(),
        "feed_forward": FusedColwiseParallel(linears=("w1", "w3"), **colwise),
        "feed_forward.w2": FusedRowwiseParallel(**rowwise),
    }


def native_plain_block_plan() -> dict:
    """torch's plain TP plan (no sequence parallelism): block input and output replicated ``[B, S, D]``."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }


def fused_plain_block_plan(fp8=None, pieces: int | None = None) -> dict:
    """fastmesh's plain TP plan: local colwise matmuls whose input gradients share one fused all-reduce per
    parent, rowwise matmul + all-reduce; in FP8 with ``fp8``."""
    options = dict(fp8=fp8, pieces=pieces)  # torch's default layouts: Replicate() in, Replicate() out
    return {
        "attention": FusedColwiseParallel(linears=("wq", "wk", "wv"), **options),
        "attention.wo": FusedRowwiseParallel(**options),
        "feed_forward": FusedColwiseParallel(linears=("w1", "w3"), **options),
        "feed_forward.w2": FusedRowwiseParallel(**options),
    }


def block_plan(plan: str, fp8=None, pieces: int | None = None, keep_gathered: bool = False) -> dict:
    """``"native"`` or ``"fastmesh"`` (sequence-parallel), ``"native-plain"`` or ``"fastmesh-plain"`` (plain TP:
    the block's input and output replicated). ``fp8`` and ``pieces`` apply to fastmesh's plans, ``keep_gathered``
    to its sequence-parallel one."""
    if plan in ("native", "native-plain"):
        if fp8 is not None:
            raise ValueError("the native plan has no fp8 option here; use plan='fastmesh'")
        return native_block_plan() if plan == "native" else native_plain_block_plan()
    if plan == "fastmesh":
        return fused_block_plan(fp8, pieces, keep_gathered)
    if plan == "fastmesh-plain":
        return fused_plain_block_plan(fp8, pieces)
    raise ValueError(f"plan must be 'native', 'fastmesh', 'native-plain' or 'fastmesh-plain', got {plan!r}")


def parallelize_llama(model: Llama, tp_mesh: DeviceMesh, plan: str, fp8=None, pieces: int | None = None) -> Llama:
    """Apply one of the TP plans of :func:`block_plan` to the whole model, in place. Sequence-parallel plans shard
    the embedding's output and the final norm's input along the sequence; plain ones keep them replicated. Logits
    come out as a vocab-sharded DTensor (use ``torch.distributed.tensor.parallel.loss_parallel`` for the loss)."""
    layers = block_plan(plan, fp8, pieces)  # checks the plan's name and options first
    plain = plan.endswith("-plain")
    sequence = Replicate() if plain else Shard(1)
    if plan.startswith("native"):
        head = ColwiseParallel(input_layouts=sequence, use_local_output=False)
    else:
        head = FusedColwiseParallel(input_layouts=sequence, use_local_output=False, fp8=fp8, pieces=pieces)
    outer = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence), "output": head}
    if not plain:
        outer["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, outer)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layers)
    return model

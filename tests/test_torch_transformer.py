"""torch's own test Transformer (``torch.testing._internal.distributed._tensor.common_dtensor``: LayerNorm,
biased GELU MLP, position embeddings, tied embedding and LM head), a model fastmesh did not write,
parallelized by its own plan (``Transformer.parallelize``) and by fastmesh's, on 2 and 4 gloo ranks.

* Its sequence-parallel and its plain-TP plan: 3 SGD steps from the same weights give the same losses and
  every gradient at every step.
* The collectives of a training step, counted with CommDebugMode: the native plan's, one for one (the plain-TP
  plan's sibling linears share one all-reduce where the native plan has one each).
* Every parameter placed as torch's plan places it; the plain-TP plan inside FSDP2 on a 2-D (dp, tp) mesh.
* torch's own ``Transformer.parallelize`` with each plan it builds passed through ``fastmesh.parallel.fused``: the
  one-line switch trains as the native plan, with the same collectives, fused.
"""

from __future__ import annotations

import itertools
import logging
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from log_capture import captured_log
from rank_pool import on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.distributed._tensor import common_dtensor
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from fastmesh import _log
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel, fused


def _tp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def parallelize_fused(model: Transformer, mesh, sequence_parallel: bool, share: bool = True) -> Transformer:
    """``Transformer.parallelize`` with fastmesh's styles wherever torch's plan has ColwiseParallel /
    RowwiseParallel (the embeddings and norms keep torch's styles). ``share``: q, k and v share one fused
    collective (``linears=``) rather than one each, as in torch's plan (plain TP only)."""
    assert share or not sequence_parallel
    rows, columns_in = (Shard(1), Shard(1)) if sequence_parallel else (Replicate(), Replicate())
    if sequence_parallel:
        root = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "norm": SequenceParallel(),
        }
    else:
        root = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        }
    parallelize_module(model, mesh, root)
    for layer in model.layers:
        # q, k, v leave as local tensors and each rank attends with its heads: torch's plan with
        # local_output_for_attn=True (with global heads, q, k and v are DTensors, and DTensor has no sharding
        # rule for CPU attention; tests/test_parallel.py checks linears= with use_local_output=False).
        if share:
            plan = {"attention": FusedColwiseParallel(linears=("wq", "wk", "wv"), input_layouts=columns_in)}
        else:
            plan = {f"attention.{name}": FusedColwiseParallel(input_layouts=Replicate()) for name in ("wq", "wk", "wv")}
        plan["attention.wo"] = FusedRowwiseParallel(output_layouts=rows)
        plan["feed_forward.w1"] = FusedColwiseParallel(input_layouts=columns_in)
        plan["feed_forward.w2"] = FusedRowwiseParallel(output_layouts=rows)
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(layer, mesh, plan)
        layer.attention.n_heads //= mesh.size()
    # The LM head: logits gathered over the vocabulary.
    parallelize_module(model.output, mesh, FusedColwiseParallel(input_layouts=columns_in, output_layouts=Replicate()))
    if model.model_args.weight_tying:
        model.output.weight = model.tok_embeddings.weight
    return model


def parallelize_through_fused(model: Transformer, mesh, sequence_parallel: bool) -> Transformer:
    """torch's ``Transformer.parallelize``, unchanged, with every plan it applies passed through ``fused``."""

    def parallelize_module_fused(module, device_mesh, plan, **kwargs):
        return parallelize_module(module, device_mesh, fused(plan), **kwargs)

    with mock.patch.object(common_dtensor, "parallelize_module", parallelize_module_fused):
        return Transformer.parallelize(model, mesh, sequence_parallel, local_output_for_attn=True)


def _model(args: ModelArgs, plan: str, sequence_parallel: bool) -> Transformer:
    torch.manual_seed(0)  # the same weights on every rank and under every plan
    model = Transformer(args).to(torch.float64)
    mesh = _tp_mesh()
    if plan == "native":
        return Transformer.parallelize(model, mesh, sequence_parallel, local_output_for_attn=True)
    if plan == "fused(plan)":
        return parallelize_through_fused(model, mesh, sequence_parallel)
    return parallelize_fused(model, mesh, sequence_parallel, share=plan == "fastmesh")


def _tokens(args: ModelArgs, batch: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, args.vocab_size, (batch, args.max_seq_len + 1), generator=torch.Generator().manual_seed(seed)
    )


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # [B, S, V], every rank the whole of it
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train(args: ModelArgs, plan: str, sequence_parallel: bool, steps: int = 3, batch: int = 2):
    """Each step's loss and every parameter's full gradient, over ``steps`` SGD steps on fresh batches."""
    model = _model(args, plan, sequence_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(steps):
        optimizer.zero_grad()
        loss = _loss(model, _tokens(args, batch, seed=step))
        loss.backward()
        losses.append(loss.item())
        grads.append({name: _full(p.grad).clone() for name, p in model.named_parameters()})
        optimizer.step()
    return losses, grads


def _args(world: int, weight_tying: bool) -> ModelArgs:
    """Tiny and divisible by the TP degree (heads, hidden 4*dim, vocabulary, sequence); no dropout."""
    return ModelArgs(
        n_layers=2,
        vocab_size=13 * world,  # more than dim: the LM head gathers its output columns as it multiplies
        max_seq_len=2 * world + 4,
        dim=24,
        n_heads=4 if world < 4 else 8,
        dropout_p=0.0,
        weight_tying=weight_tying,
    )


# float64, but the model rounds its logits to float32 (``self.output(h).float()``). The plans differ only in
# summation order: measured, the losses are equal and the gradients within 2e-15 of the largest of each (2 and 4
# ranks). A reordering could move one float32 rounding of a logit by an ulp (6e-8 relative), about a 1e-9 chance
# per logit; a wrong block, bias or missing term is off by 1e-3 or more.
TOLERANCE = dict(rtol=1e-9, atol=1e-12)


@on_ranks(2, 4, timeout=300)
def test_training_matches_torchs_plan(world_size):
    for sequence_parallel, weight_tying in itertools.product((False, True), (True, False)):
        if world_size == 4 and not weight_tying:
            continue  # 4 ranks on 2 cores: the tied model only
        args = _args(world_size, weight_tying)
        want_losses, want_grads = train(args, "native", sequence_parallel)
        got_losses, got_grads = train(args, "fastmesh", sequence_parallel)
        case = f"sequence_parallel={sequence_parallel}, weight_tying={weight_tying}"
        torch.testing.assert_close(got_losses, want_losses, **TOLERANCE, msg=lambda m: f"{case}: losses: {m}")
        assert want_losses[-1] < want_losses[0], (case, want_losses)  # the steps do train
        for step, (got, want) in enumerate(zip(got_grads, want_grads)):
            assert got.keys() == want.keys(), (case, got.keys(), want.keys())
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name], **TOLERANCE, msg=lambda m: f"{case}, step {step}: grad {name}: {m}"
                )


@on_ranks(2)
def test_parameters_placed_as_torchs_plan():
    """Every parameter a DTensor of the native plan's placement and local shape: checkpoints interchangeable."""
    for sequence_parallel in (False, True):
        args = _args(dist.get_world_size(), weight_tying=True)
        native = dict(_model(args, "native", sequence_parallel).named_parameters())
        fused = dict(_model(args, "fastmesh", sequence_parallel).named_parameters())
        assert fused.keys() == native.keys()
        for name, p in native.items():
            q = fused[name]
            assert isinstance(q, DTensor) == isinstance(p, DTensor), name
            if isinstance(p, DTensor):
                assert q.placements == p.placements, (name, q.placements, p.placements)
                assert q.to_local().shape == p.to_local().shape, name
            torch.testing.assert_close(_full(q), _full(p), rtol=0, atol=0, msg=name)


# Each fused op as the collective it holds.
_FUSED_AS = {
    torch.ops.fastmesh.all_gather_matmul: "all_gather_into_tensor",
    torch.ops.fastmesh.matmul_reduce_scatter: "reduce_scatter_tensor",
    torch.ops.fastmesh.matmul_all_reduce: "all_reduce",
    torch.ops.fastmesh.matmul_all_gather: "all_gather_into_tensor",
}


def _step_counts(model: Transformer, tokens: torch.Tensor) -> dict:
    """The collectives of one training step, by phase and name (a fused op as the collective it holds)."""
    mode = CommDebugMode()
    mode.comm_registry.update(_FUSED_AS)
    with mode:
        _loss(model, tokens).backward()
    counts = {}
    for phase in ("forward", "backward"):
        counts[phase] = {}
        for op, n in mode.comm_module_counts["Global"][phase].items():
            name = _FUSED_AS.get(op) or op.__name__
            counts[phase][name] = counts[phase].get(name, 0) + n
    return counts


def _with_shard_gathers(counts: dict, gathers: int) -> dict:
    """The native step's collectives plus, in backward, the all-gathers of the shards fastmesh's sequence-parallel
    column linears keep in place of their gathered inputs (two per layer: q/k/v's, w1's)."""
    if not gathers:
        return counts
    backward = dict(counts["backward"])
    backward["all_gather_into_tensor"] = backward.get("all_gather_into_tensor", 0) + gathers
    return {**counts, "backward": backward}


@on_ranks(2)
def test_training_step_issues_torchs_collectives():
    args = _args(dist.get_world_size(), weight_tying=True)
    tokens = _tokens(args, 2, seed=0)
    for sequence_parallel in (False, True):
        plans = ("native", "fastmesh") if sequence_parallel else ("native", "fastmesh", "one-to-one")
        counts = {plan: _step_counts(_model(args, plan, sequence_parallel), tokens) for plan in plans}
        case = f"sequence_parallel={sequence_parallel}"
        want = counts["native"]
        if not sequence_parallel:
            assert counts["one-to-one"] == want, (case, counts)
            # torch's plan all-reduces q's, k's and v's input gradients apart; linears= shares one all-reduce.
            want = {phase: dict(n) for phase, n in want.items()}
            want["backward"]["all_reduce"] -= 2 * args.n_layers
        else:
            want = _with_shard_gathers(want, 2 * args.n_layers)
        assert counts["fastmesh"] == want, (case, counts)


@on_ranks(2)
def test_lm_head_gathers_its_logits_as_it_multiplies():
    # out_features (the vocabulary) > in_features: the output columns' gather is the one overlapped.
    args = _args(dist.get_world_size(), weight_tying=False)
    for sequence_parallel in (False, True):
        mode = CommDebugMode()
        mode.comm_registry.add(torch.ops.fastmesh.matmul_all_gather)
        with mode:
            _loss(_model(args, "fastmesh", sequence_parallel), _tokens(args, 2, seed=0))
        assert mode.get_comm_counts().get(torch.ops.fastmesh.matmul_all_gather) == 1, mode.get_comm_counts()


@on_ranks(4, timeout=300)
def test_fsdp2_2d_plain_tp_matches_torchs_plan():
    """dp=2 x tp=2: the plain-TP plans inside FSDP2 (``fully_shard`` over dp around each block, then the root),
    trained 3 SGD steps on batches that differ between dp groups: the same losses and trained parameters."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    args = _args(2, weight_tying=True)
    dp_rank = mesh["dp"].get_local_rank()
    runs = {}
    for plan in ("native", "fastmesh"):
        torch.manual_seed(0)
        model = Transformer(args).to(torch.float64)
        if plan == "native":
            Transformer.parallelize(model, mesh["tp"], False, local_output_for_attn=True)
        else:
            parallelize_fused(model, mesh["tp"], False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            optimizer.zero_grad()
            loss = _loss(model, _tokens(args, 2, seed=10 * step + dp_rank))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs[plan] = losses, {name: p.full_tensor() for name, p in model.named_parameters()}
    (losses, params), (want_losses, want_params) = runs["fastmesh"], runs["native"]
    torch.testing.assert_close(losses, want_losses, **TOLERANCE)
    assert params.keys() == want_params.keys()
    for name, p in want_params.items():
        torch.testing.assert_close(params[name], p, **TOLERANCE, msg=lambda m: f"{name}: {m}")


@on_ranks(2, timeout=300)
def test_fused_plan_trains_as_torchs_plan_with_its_collectives_fused():
    """``fused(plan)`` on torch's own plans: the losses and gradients of the native plan, the native step's
    collectives one for one, each linear's collective inside a fused op (the sequence-parallel attention's q, k and
    v under one gather, as the native plan's PrepareModuleInput gathers once), and the embeddings and norms, which
    no fused op serves, left to torch's styles with the reason said."""
    args = _args(dist.get_world_size(), weight_tying=True)
    tokens = _tokens(args, 2, seed=0)
    for sequence_parallel in (False, True):
        case = f"sequence_parallel={sequence_parallel}"
        _log.forget(lambda key: isinstance(key, tuple) and key[0] == "fused")  # said once per process
        with captured_log("fastmesh.parallel", logging.INFO) as messages:
            model = _model(args, "fused(plan)", sequence_parallel)
        said = " ".join(messages)
        assert "fused: RowwiseParallel at 'tok_embeddings' stays torch's: not an nn.Linear" in said, (case, said)
        assert ("fused: SequenceParallel at 'norm' stays torch's" in said) == sequence_parallel, (case, said)
        want_losses, want_grads = train(args, "native", sequence_parallel)
        got_losses, got_grads = train(args, "fused(plan)", sequence_parallel)
        torch.testing.assert_close(got_losses, want_losses, **TOLERANCE, msg=lambda m: f"{case}: losses: {m}")
        for step, (got, want) in enumerate(zip(got_grads, want_grads)):
            assert got.keys() == want.keys(), (case, got.keys(), want.keys())
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name], **TOLERANCE, msg=lambda m: f"{case}, step {step}: grad {name}: {m}"
                )
        native = _step_counts(_model(args, "native", sequence_parallel), tokens)
        shard_gathers = 2 * args.n_layers if sequence_parallel else 0
        assert _step_counts(model, tokens) == _with_shard_gathers(native, shard_gathers), case
        mode = CommDebugMode()
        mode.comm_registry.update(_FUSED_AS)
        with mode:
            _loss(model, tokens).backward()
        ops = mode.comm_module_counts["Global"]["forward"]
        n = args.n_layers
        if sequence_parallel:  # per layer: one gather for q/k/v, one for w1; wo and w2 reduce-scatter
            assert ops[torch.ops.fastmesh.all_gather_matmul] == 2 * n, (case, ops)
            assert ops[torch.ops.fastmesh.matmul_reduce_scatter] == 2 * n, (case, ops)
        else:  # per layer: wo and w2 all-reduce, fused
            assert ops[torch.ops.fastmesh.matmul_all_reduce] == 2 * n, (case, ops)
        assert ops[torch.ops.fastmesh.matmul_all_gather] == 1, (case, ops)  # the LM head's logits

"""fastmesh's fused TP plan composed with the rest of torch.distributed: FSDP2 on a 2-D (dp, tp) mesh, and
``torch.distributed.checkpoint`` (DCP) across the fused and the native plan, on 4 and 2 gloo ranks.

Training equivalence: the same small ``Llama`` (one seed) is parallelized with fastmesh's plan and with torch's
native plan, each wrapped by ``fully_shard`` over the dp axis (blocks, then the root: torchtitan's order),
and trained for a few SGD steps on batches that differ between dp groups. Both must follow the trajectory of
the unsharded model trained on the whole batch in one process. The plans compute the same sums in a
different order (pipelined pieces, split contractions), so they agree to fp32 rounding, not bit for bit; each
parameter's error is judged against how far training moved it (see ``UPDATE_RTOL``).

FSDP2 gathers a module's parameters in that module's pre-forward, so its groups must each hold all the linears
that share a fused gather (the block, or ``attention`` / ``feed_forward``); around single linears the fused
style refuses with an error rather than reading dp-sharded weights.

Checkpoints: both plans place every parameter alike (colwise ``Shard(0)``, rowwise ``Shard(1)``, norms
``Replicate()``), so a DCP checkpoint of one loads into the other bit for bit, and the loaded model computes
what the saved one computed, and trains on as it would.

Each rank function runs several checks so that the pools' per-call overhead is paid once per test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from rank_pool import on_ranks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import fastmesh
from fastmesh.testing.llama import Llama, LlamaArgs, parallelize_llama

# Small but with every feature of the plans: grouped kv heads (2 query heads per kv head on each of 2 TP
# ranks), odd-ish widths, two blocks so that FSDP2 has several groups.
ARGS = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64)
BATCH, SEQ = 2, 8  # per dp group; SEQ divides by tp=2 (the plans shard the sequence)
STEPS = 5
LR = 0.5  # plain SGD (no Adam: its first step is ~lr*sign(g), which turns rounding noise on tiny
#           gradient entries into full-size updates); large enough that later steps see moved weights.

# A parameter trained two ways may differ by UPDATE_RTOL of how far training moved it (update = trained -
# initial, max over the tensor), plus one fp32 ulp of the parameter per step (each step rounds p - lr * g to
# fp32, and a norm weight near 1.0 moving by ~5e-3 is only ~4e4 ulps: its rounding shows on this scale).
# Gradients that are sums of a few hundred terms in a different order differ by ~1e-6 relative; measured
# after five steps, fused vs native and either vs the unsharded model: every difference within the ulp term,
# <= 10% of the whole allowance.
# A real bug is off by a whole update: injected into the fused path while writing this test, a colwise weight
# gradient doubled, a colwise input gradient not reduce-scattered over TP, and a rowwise weight gradient lost
# each put several parameters 0.96 to 1.12 of their update off, ~1e4 times UPDATE_RTOL.
UPDATE_RTOL = 1e-4
# Losses (~4.5) and logits (|x| < 2) computed two correct ways, fp32 sums in a different order: measured
# <= 4.8e-7 (one ulp of the loss), a twentieth of this.
VALUE_ATOL = 1e-5


def build(seed: int) -> Llama:
    torch.manual_seed(seed)
    return Llama(ARGS)


def batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS (tokens, targets) batches of dp group ``dp_rank`` (the same on its TP ranks)."""
    g = torch.Generator().manual_seed(1000 + dp_rank)
    return [
        (
            torch.randint(ARGS.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(ARGS.vocab_size, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def whole_batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of all ``dp`` groups, concatenated in dp order: what the unsharded model trains on."""
    per_group = [batches(dp_rank) for dp_rank in range(dp)]
    return [tuple(torch.cat(parts) for parts in zip(*step)) for step in zip(*per_group)]


def loss_of(model: Llama, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; call inside ``loss_parallel()`` for vocab-sharded logits."""
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train(model: Llama, data) -> list[float]:
    """One SGD step per batch; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens, targets in data:
        with loss_parallel():
            loss = loss_of(model, tokens, targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses


def full_parameters(model: Llama) -> dict[str, torch.Tensor]:
    """Every parameter, whole (a collective when they are DTensors: all ranks call it together)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def assert_same_updates(got: dict, want: dict, init: dict, what: str, steps: int = STEPS) -> None:
    """Every parameter of ``got`` within tolerance of ``want`` after ``steps`` steps from ``init`` (see
    UPDATE_RTOL); the failures, worst first."""
    assert got.keys() == want.keys() == init.keys(), what
    failures = []
    for name, w in want.items():
        scale = (w - init[name]).abs().max().item()
        assert scale > 0, f"{what}: {name} did not move; the comparison would prove nothing"
        err = (got[name] - w).abs().max().item()
        ulps = steps * torch.finfo(w.dtype).eps * w.abs().max().item()
        if err > UPDATE_RTOL * scale + ulps:
            failures.append((err / scale, f"{name} off by {err:.3g}, {err / scale:.3g} of its update {scale:.3g}"))
    assert not failures, f"{what}: " + "; ".join(line for _, line in sorted(failures, reverse=True))


def fsdp_tp_model(plan: str, mesh, seed: int, shard_fused_parents: bool = False) -> Llama:
    """TP over mesh["tp"], then FSDP2 over mesh["dp"]: each block, then the root (torchtitan's order); with
    ``shard_fused_parents`` also ``attention`` and ``feed_forward`` first, the finest grouping the fused styles
    allow (each holds all the linears that share a gather)."""
    model = parallelize_llama(build(seed), mesh["tp"], plan)
    for block in model.layers:
        if shard_fused_parents:
            fully_shard(block.attention, mesh=mesh["dp"])
            fully_shard(block.feed_forward, mesh=mesh["dp"])
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


# name: (plan, shard_fused_parents)
FSDP_TP_MODELS = {
    "fastmesh": ("fastmesh", False),
    "fastmesh, attention and feed_forward sharded apart": ("fastmesh", True),
    "native": ("native", False),
}


@on_ranks(4)
def test_fsdp2_tp_training_matches_native_plan_and_unsharded_model():
    """dp=2 x tp=2: fastmesh's plan under FSDP2 trains like torch's native plan under FSDP2 and like the unsharded
    model on the whole batch (gradients reduced over dp, TP shards and replicas consistent); also with FSDP2
    groups around the fused parents, whose parameters are then gathered just before their fused matmuls."""
    mesh = fastmesh.init_mesh(dp=2, tp=2)
    dp_rank = mesh["dp"].get_local_rank()
    init = full_parameters(build(seed=0))

    reference = build(seed=0)
    want_losses = train(reference, whole_batches(dp=2))
    assert want_losses[-1] < want_losses[0], "the reference did not train"
    want = full_parameters(reference)

    results = {}
    for name, (plan, shard_fused_parents) in FSDP_TP_MODELS.items():
        model = fsdp_tp_model(plan, mesh, seed=0, shard_fused_parents=shard_fused_parents)
        losses = torch.tensor(train(model, batches(dp_rank)))
        results[name] = full_parameters(model)
        # Each dp group sees half the batch: the mean of the two groups' losses is the whole batch's.
        dist.all_reduce(losses, group=mesh.get_group("dp"))
        torch.testing.assert_close(
            losses / 2, torch.tensor(want_losses), rtol=0, atol=VALUE_ATOL, msg=lambda m: f"{name} losses: {m}"
        )
        assert_same_updates(results[name], want, init, f"{name} vs the unsharded model")
    for name in results.keys() - {"native"}:
        assert_same_updates(results[name], results["native"], init, f"{name} vs native plan")


@on_ranks(4)
def test_fsdp2_around_single_fused_linears_is_refused():
    """fully_shard on linears that share a gather leaves their weights dp-sharded when the parent's fused matmul
    reads them (FSDP2 gathers a module's parameters in its own pre-forward): a clear error, not wrong numbers."""
    mesh = fastmesh.init_mesh(dp=2, tp=2)
    model = parallelize_llama(build(seed=0), mesh["tp"], "fastmesh")
    for linear in (model.layers[0].attention.wq, model.layers[0].attention.wk, model.layers[0].attention.wv):
        fully_shard(linear, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    tokens, _ = batches(0)[0]
    with pytest.raises(RuntimeError, match=r"wq\.weight is still sharded over a 2-D mesh"):
        model(tokens)


def tp_model(plan: str, mesh, seed: int) -> Llama:
    return parallelize_llama(build(seed), mesh, plan)


def local_parameters(model: Llama) -> dict[str, DTensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def save_and_load(source: Llama, target: Llama, path: str) -> None:
    dcp.save(source.state_dict(), checkpoint_id=path)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=path)
    target.load_state_dict(state)


@on_ranks(2)
def test_checkpoint_round_trip_between_fused_and_native_plans(tmp_path):
    """A DCP checkpoint of a trained fastmesh-plan model loads bit for bit into a native-plan model built from
    another seed, and back (and fastmesh into fastmesh); the loaded model computes the saved model's logits,
    and a further training step moves it as it moves the saved model (gradients reach the loaded parameters)."""
    mesh = fastmesh.init_mesh(tp=2)
    (tokens, targets), next_batch = batches(0)[:2]
    for source_plan, target_plan in (("fastmesh", "native"), ("native", "fastmesh"), ("fastmesh", "fastmesh")):
        what = f"{source_plan} -> {target_plan}"
        same_plan = source_plan == target_plan
        source = tp_model(source_plan, mesh, seed=1)
        train(source, [(tokens, targets)])  # saved values are not the initial ones
        target = tp_model(target_plan, mesh, seed=2)
        saved = local_parameters(source)
        assert saved.keys() == local_parameters(target).keys(), what
        assert not any(torch.equal(p.to_local(), target.get_parameter(n).to_local()) for n, p in saved.items()), what

        save_and_load(source, target, str(tmp_path / what.replace(" -> ", "_to_")))

        for name, p in local_parameters(target).items():
            assert p.placements == saved[name].placements, f"{what}: {name}"
            assert torch.equal(p.to_local(), saved[name].to_local()), f"{what}: {name} differs after loading"
        with torch.no_grad():
            got, want = target(tokens).full_tensor(), source(tokens).full_tensor()
        if same_plan:
            assert torch.equal(got, want), what
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=VALUE_ATOL, msg=lambda m: f"{what} logits: {m}")

        loaded = full_parameters(source)
        train(source, [next_batch])
        train(target, [next_batch])
        got, want = full_parameters(target), full_parameters(source)
        if same_plan:
            assert all(torch.equal(got[n], want[n]) for n in want), f"{what}: the step after loading differs"
        else:
            assert_same_updates(got, want, loaded, f"{what}, the step after loading", steps=1)

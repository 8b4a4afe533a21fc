r"""Train a small Llama-style model with sequence-parallel tensor parallelism (TP) on CPU, under torch's native
TP plan and/or fastmesh's fused one, and report the loss, the throughput and the exposed communication.

    torchrun --nproc-per-node 2 examples/train_llama_tp.py --plan both
    # dp=2 x tp=2 on 2 machines, dp across them, tp within each; on every machine:
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id JOB \
        examples/train_llama_tp.py --tp 2

Options: ``--tp N`` (default 2; the rest of the world is the dp axis), ``--plan native|fastmesh|both`` (default
both: one after the other in the same processes, from the same initial weights on the same batches, then a
comparison table), ``--steps N`` (default 200), ``--fp8 tensorwise|rowwise|mx|block1x128`` (fastmesh's plan in
FP8), ``--compile`` (both plans under ``torch.compile``; TP-only meshes) with ``--fusion-pass`` (the native plan
compiled with fastmesh's fusion pass, ``fastmesh.compile``), model and batch sizes (``--help``; ``--batch`` is a
whole step's). One intra-op thread per rank (``--threads``), gloo; ``--plan both`` with the defaults on two ranks
took 100 s on the 2-core dev machine, shared with other work (``time torchrun`` of the first command).

The data is learnable and synthetic: sequences from a fixed random Markov chain over the vocabulary, in which
each token has a few possible successors. The lowest loss a model can reach is the chain's entropy rate,
printed at the start; a freshly initialized model starts near log(vocab).

The model is ``fastmesh.testing.llama.Llama`` parallelized by ``parallelize_llama`` over ``mesh["tp"]`` of
``init_mesh(dp=-1, tp=N)``: activations between blocks are sharded along the sequence, and each block's linears
gather their input and reduce-scatter their output, as separate collectives (native) or fused into the matmuls
(fastmesh). The logits leave vocab-sharded, and the loss is computed on the shards under ``loss_parallel``. With
dp > 1, FSDP2 (``fully_shard`` over ``mesh["dp"]``) wraps each block, then the root; each dp group trains on its
rows of every batch, and the printed loss is the whole batch's, as in a TP-only run of the same arguments. Rank 0
then prints the mesh: each rank's (dp, tp), node (torchrun's ``GROUP_RANK``), host, agent, and the token sum of
its rows.

Exposed communication is the time a rank's main thread is blocked on communication (in a collective or
point-to-point call, or waiting for one), measured by profiling a few steps after warm-up
(``fastmesh/testing/comm_profile.py`` says which events count and how nesting is handled). It includes waiting
for the other rank when it is behind; communication that gloo's threads carry out while the main thread
computes is hidden, not exposed.
"""

import argparse
import gc
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

import fastmesh
import fastmesh.compile
from fastmesh.fp8 import Float8Config
from fastmesh.testing.comm_profile import STEP_EVENT, cpu_profile, step_comm_times
from fastmesh.testing.llama import Llama, LlamaArgs, parallelize_llama

PLANS = ("native", "fastmesh")


# ---- data: a fixed Markov chain ----


def markov_chain(vocab: int, branching: int, generator: torch.Generator) -> torch.Tensor:
    """A ``[vocab, vocab]`` transition matrix: each token goes to ``branching`` random successors with random
    probabilities."""
    successors = torch.rand(vocab, vocab, generator=generator).argsort(dim=1)[:, :branching]
    weights = torch.rand(vocab, branching, generator=generator) + 0.1
    return torch.zeros(vocab, vocab).scatter_(1, successors, weights / weights.sum(1, keepdim=True))


def stationary(transitions: torch.Tensor, iterations: int = 1000) -> torch.Tensor:
    """The chain's stationary distribution, by power iteration from uniform."""
    p = torch.full((transitions.shape[0],), 1.0 / transitions.shape[0], dtype=torch.float64)
    for _ in range(iterations):
        p = p @ transitions.double()
    return p


def entropy_rate(transitions: torch.Tensor) -> float:
    """Nats per token: the lowest cross-entropy any next-token predictor reaches on the chain's sequences."""
    t = transitions.double()
    per_state = -(t * t.clamp_min(1e-30).log()).sum(1)
    return float(stationary(transitions) @ per_state)


def sample_sequences(transitions, start, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[count, length]`` token sequences, the first token drawn from ``start`` (the stationary distribution,
    so that every position's best loss is the entropy rate)."""
    tokens = [torch.multinomial(start, count, replacement=True, generator=generator)]
    for _ in range(length - 1):
        tokens.append(torch.multinomial(transitions[tokens[-1]], 1, generator=generator).squeeze(1))
    return torch.stack(tokens, dim=1)


def dp_slice(batches: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's dp group's rows of ``batches [steps, B, S + 1]``: ``[steps, B / dp, S + 1]``. The TP ranks of a
    dp group share their tokens."""
    rows = batches.shape[1] // mesh["dp"].size()
    first = mesh["dp"].get_local_rank() * rows
    return batches[:, first : first + rows]


# ---- training ----


def train_step(model, optimizer, tokens):
    """One step on ``tokens [B, S + 1]``; returns the loss, a replicated DTensor."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)  # [B, S, vocab], a DTensor sharded over the vocabulary
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def build_model(plan: str, args, mesh) -> torch.nn.Module:
    """The model under ``plan`` over ``mesh["tp"]`` (in FP8 with ``--fp8``, compiled with ``--compile``), and with
    dp > 1 FSDP2 over ``mesh["dp"]``: each block, then the root (torchtitan's order, as in
    tests/test_parallel_2d.py). FSDP2 gathers a module's parameters in that module's pre-forward, so each of its
    groups must hold all the linears that share a fused gather: a block does."""
    fp8 = Float8Config(granularity=args.fp8) if args.fp8 and plan == "fastmesh" else None
    model = parallelize_llama(Llama(model_args(args)), mesh["tp"], plan, fp8=fp8)
    if mesh["dp"].size() > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])
    if args.compile:
        fusion = args.fusion_pass and plan == "native"
        options = {"post_grad_custom_post_pass": fastmesh.compile.FusionPass(strict=False)} if fusion else None
        model = torch.compile(model, options=options)
    return model


def global_loss(loss, mesh) -> float:
    """The whole batch's loss from this dp group's ``loss`` (a DTensor replicated over TP)."""
    local = loss.full_tensor()  # replicated: no communication
    dp = mesh["dp"].size()
    if dp == 1:
        return local.item()
    # Every dp group's loss is the mean over an equal share of the batch, so their mean is the whole batch's.
    # A sum: gloo has no AVG.
    total = local.clone()
    dist.all_reduce(total, group=mesh.get_group("dp"))
    return total.item() / dp


def train(plan: str, args, mesh, batches) -> dict:
    """Trains one model under ``plan`` on ``batches`` ``[steps, B / dp, S + 1]`` (this dp group's); returns its
    logged losses (the whole batch's) and measurements (every rank's)."""
    torch.manual_seed(args.seed)  # the same initial weights under either plan and on every rank
    model = build_model(plan, args, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    leader = dist.get_rank() == 0
    losses = {}

    def run(first: int, last: int):
        for step in range(first, last + 1):
            with torch.profiler.record_function(STEP_EVENT):  # marks the step in the profiled ones' trace
                loss = train_step(model, optimizer, batches[step - 1])
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                losses[step] = global_loss(loss, mesh)
                if leader:
                    print(f"[{plan}] step {step:4d}  loss {losses[step]:.4f}", flush=True)

    profile_end = args.warmup + args.profile_steps
    run(1, args.warmup)
    with cpu_profile() as prof:
        run(args.warmup + 1, profile_end)
    # Throughput from the steps after the profiled ones, without the profiler's overhead; the slowest rank's.
    begin = time.perf_counter()
    run(profile_end + 1, args.steps)
    elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    timed_steps = args.steps - profile_end
    step_s = elapsed.item() / timed_steps

    # Per rank: the profiled steps' mean duration and exposed communication (total and by event).
    times = step_comm_times(prof)
    by_name = {}
    for t in times:
        for name, seconds in t.by_name.items():
            by_name[name] = by_name.get(name, 0.0) + seconds / len(times)
    mine = {
        "step_s": sum(t.duration for t in times) / len(times),
        "exposed_s": sum(t.exposed for t in times) / len(times),
        "by_name_s": by_name,
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"losses": losses, "step_s": step_s, "tokens_per_s": args.batch * args.seq_len / step_s, "ranks": ranks}


def model_args(args) -> LlamaArgs:
    return LlamaArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn_hidden,
        vocab_size=args.vocab,
    )


# ---- report ----


def report(plan: str, result: dict, args) -> None:
    print(
        f"[{plan}] {result['tokens_per_s']:.0f} tokens/s ({1e3 * result['step_s']:.1f} ms/step over steps "
        f"{args.warmup + args.profile_steps + 1}-{args.steps}); exposed communication per step over the profiled "
        f"steps {args.warmup + 1}-{args.warmup + args.profile_steps}:"
    )
    for rank, r in enumerate(result["ranks"]):
        events = ", ".join(f"{name} {1e3 * t:.1f}" for name, t in sorted(r["by_name_s"].items(), key=lambda kv: -kv[1]))
        print(f"[{plan}]   rank {rank}: {1e3 * r['exposed_s']:.1f} ms of {1e3 * r['step_s']:.1f} ms ({events})")


def _per_rank(result: dict, fn) -> str:
    return " / ".join(fn(r) for r in result["ranks"])


def compare(results: dict) -> None:
    rows = {
        plan: (
            _per_rank(r, lambda rank: f"{1e3 * rank['exposed_s']:.1f}"),
            _per_rank(r, lambda rank: f"{100 * rank['exposed_s'] / rank['step_s']:.0f}"),
        )
        for plan, r in results.items()
    }
    # Wide enough for every rank's figures (the widths of two ranks' by default).
    exposed_w = max(21, *(len(exposed) for exposed, _ in rows.values()))
    share_w = max(10, *(len(share) for _, share in rows.values()))
    print(
        f"\n{'plan':10s} {'final loss':>10s} {'tokens/s':>9s} {'ms/step':>8s} {'exposed comm ms/step':>{exposed_w}s} "
        f"{'% of step':>{share_w}s}"
    )
    for plan, r in results.items():
        exposed, share = rows[plan]
        print(
            f"{plan:10s} {r['losses'][max(r['losses'])]:10.4f} {r['tokens_per_s']:9.0f} {1e3 * r['step_s']:8.1f} "
            f"{exposed:>{exposed_w}s} {share:>{share_w}s}"
        )
    native, fused = results["native"], results["fastmesh"]
    gap = max(abs(native["losses"][s] - fused["losses"][s]) for s in native["losses"])
    exposed_ratio = sum(r["exposed_s"] for r in fused["ranks"]) / sum(r["exposed_s"] for r in native["ranks"])
    ranks = " / ".join(f"rank {rank}" for rank in range(len(fused["ranks"])))
    print(
        f"(exposed comm and its share of the profiled step: {ranks})\n"
        f"fastmesh / native: {fused['tokens_per_s'] / native['tokens_per_s']:.2f}x tokens/s, {exposed_ratio:.2f}x "
        f"exposed comm; largest loss difference at the logged steps {gap:.2e}"
    )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="TP ranks per dp group; dp is the rest of the world")
    parser.add_argument("--plan", choices=(*PLANS, "both"), default="both")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--fp8",
        choices=("tensorwise", "rowwise", "mx", "block1x128"),
        default=None,
        help="run fastmesh's plan in FP8 with this scaling granularity",
    )
    parser.add_argument("--compile", action="store_true", help="run both plans under torch.compile (inductor)")
    parser.add_argument(
        "--fusion-pass", action="store_true", help="with --compile: compile the native plan with fastmesh's fusion pass"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, split among the dp groups")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn-hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--branching", type=int, default=4, help="successors per token in the Markov chain")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the profiled ones")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    if args.fp8 and args.plan == "native":
        parser.error("--fp8 applies to fastmesh's plan; use --plan fastmesh or both")
    if args.fusion_pass and not args.compile:
        parser.error("--fusion-pass is a compiler pass: add --compile")
    # torchrun's world size, before init_mesh starts the process group, so that every rank fails alike here.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world % args.tp:
        parser.error(f"--tp {args.tp} must divide the world's {world} ranks")
    if args.compile and world > args.tp:
        # torch 2.14.1, gloo: compiling the FSDP2-wrapped model fails ("Mixing fake modes NYI"), and compiling each
        # block before fully_shard runs but gets the embedding's gradient wrong from the first step.
        parser.error("--compile runs on a TP-only mesh (--tp equal to the world size), not with FSDP2 over dp")
    if args.batch % (world // args.tp):
        parser.error(f"--batch {args.batch} must divide among the {world // args.tp} dp groups")
    if args.steps <= args.warmup + args.profile_steps:
        parser.error(
            f"--steps must exceed --warmup + --profile-steps ({args.warmup + args.profile_steps}), "
            "leaving steps to time"
        )
    return args


def describe_ranks(mesh, batches: torch.Tensor) -> list[dict]:
    """Every rank's place in the mesh and the machines, and a checksum of the tokens it trains on (its dp group's
    ``batches``): what shows that the tp groups stay inside a node and that the dp groups split the batch."""
    mine = {
        "dp": mesh["dp"].get_local_rank(),
        "tp": mesh["tp"].get_local_rank(),
        "node": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's rank of this rank's agent
        "host": socket.gethostname(),
        "agent_pid": os.getppid(),  # torchrun starts each rank as a child of its node's agent
        "token_sum": int(batches.sum()),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def print_layout(mesh, ranks: list[dict], batches: torch.Tensor) -> None:
    tp_groups = " ".join(str(group) for group in mesh.mesh.tolist())
    dp_groups = " ".join(str(group) for group in mesh.mesh.t().tolist())
    print(
        f"mesh dp={mesh['dp'].size()} x tp={mesh['tp'].size()}: tp groups {tp_groups}, dp groups {dp_groups}; "
        f"{batches.shape[1] // mesh['dp'].size()} of the {batches.shape[1]} sequences per step to each dp group"
    )
    for rank, r in enumerate(ranks):
        print(
            f"  rank {rank}: dp {r['dp']} tp {r['tp']}, node {r['node']} (host {r['host']}, agent pid "
            f"{r['agent_pid']}); token sum of its batches {r['token_sum']}"
        )
    print(f"  token sum of all batches {int(batches.sum())}", flush=True)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    mesh = fastmesh.init_mesh(dp=-1, tp=args.tp)
    dp = mesh["dp"].size()
    transitions = markov_chain(args.vocab, args.branching, torch.Generator().manual_seed(args.seed))
    # Every batch up front, from one seed: the same data on every rank, each dp group then taking its rows, under
    # either plan; and no sampling inside the timed steps. The whole batch does not depend on dp.
    sequences = sample_sequences(
        transitions,
        stationary(transitions).float(),
        args.steps * args.batch,
        args.seq_len + 1,
        torch.Generator().manual_seed(args.seed + 1),
    )
    batches = sequences.view(args.steps, args.batch, args.seq_len + 1)
    group_batches = dp_slice(batches, mesh)
    ranks = describe_ranks(mesh, group_batches) if dp > 1 else None
    if dist.get_rank() == 0:
        compiled = "native plan with fastmesh's fusion pass" if args.fusion_pass else "yes" if args.compile else "no"
        layout = f"DP={dp} x TP={args.tp} (FSDP2 over dp)" if dp > 1 else f"TP={args.tp}"
        print(
            f"{layout} over {dist.get_backend()}, {args.threads} intra-op thread(s) per rank; model "
            f"{model_args(args)}; batch {args.batch} x {args.seq_len} tokens; fp8: {args.fp8 or 'off'}; "
            f"compiled: {compiled}\n"
            f"data: Markov chain, {args.branching} successors per token; entropy rate (lowest possible loss) "
            f"{entropy_rate(transitions):.4f}, log(vocab) {math.log(args.vocab):.4f}",
            flush=True,
        )
        if ranks is not None:
            print_layout(mesh, ranks, batches)
    results = {}
    for plan in PLANS if args.plan == "both" else (args.plan,):
        results[plan] = train(plan, args, mesh, group_batches)
        if dist.get_rank() == 0:
            report(plan, results[plan], args)
    if dist.get_rank() == 0 and len(results) == 2:
        compare(results)
    # The mesh goes before the process groups, or they outlive destroy_process_group (docs/faults.md, "Ending a run").
    del mesh
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

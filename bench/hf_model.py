"""A Hugging Face transformers model's training step under transformers' own tensor parallelism against the same
model under fastmesh's (``fastmesh.integrations.transformers``), eager and compiled.

The model is a ``LlamaForCausalLM`` built from a config (``--case hf_model=BxSxDxF``: batch, sequence length, hidden
size, intermediate size; 2 layers, heads of 64, half as many key/value heads, a vocabulary of 1024), the same
weights on every rank, loaded through transformers' own entry point:
``from_pretrained(None, config=, state_dict=, distributed_config=DistributedConfig(tp_plan="auto"))``, which shards
it with the plan strings of Llama's ``base_model_tp_plan`` and LM head. The step is a forward with labels (the
causal-LM loss) and its backward, the token ids the same on every rank (plain TP: transformers' plans are not
sequence-parallel).

Contenders, timed in the same interleaved rounds (each round counts as long as its slowest rank):

* ``native`` (baseline): transformers' own styles, eager; ``fastmesh`` (kernel): the same ``from_pretrained`` after
  ``fastmesh.integrations.transformers.register()`` (the row-parallel all-reduces and the LM head's gather fused
  into their matmuls, each column-parallel input gradient's all-reduce into its matmul);
* ``bound``: the ``native`` step without its exposed communication (the time its main thread is blocked in c10d
  calls, profiled over a few steps as ``tp_block`` profiles, the slowest rank's): the step if every collective
  were free or hidden. It still counts transformers' DTensor dispatch, which fastmesh's styles do not do, so
  fastmesh can go below it;
* without ``--quick``, also compiled (``torch.compile(fullgraph=True)``, inductor): ``native_c`` and
  ``fastmesh_c``, ratio ``compiled_speedup = native_c / fastmesh_c``. ``--quick`` leaves them out (compiling
  the two models takes ~35 s on 2 CPU cores) and says so.

Every contender's loss and input-embedding gradient is checked against ``native``'s before timing (bitwise would
hold in float32 on gloo; the check allows inductor's rounding). Needs transformers and accelerate
(``pip install 'fastmesh[transformers]'``); without them the family measures nothing and says why.
"""

from __future__ import annotations

import contextlib
import statistics
import warnings

import torch
import torch._functorch.config
import torch._inductor.config
from fastmesh.bench.family import Context, Family
from fastmesh.bench.figures import Case, Contender
from fastmesh.bench.timing import time_slowest_rank
from fastmesh.bench.tp_block import exposed_communication

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYERS, HEAD_DIM, VOCAB = 2, 64, 1024
FULL_SHAPES = ["4x128x256x512", "8x256x512x1024", "1x32x256x512", "2x512x256x1024"]
QUICK_SHAPES = ["4x128x256x512"]
# (rtol, atol) of a contender's loss and embedding gradient against native's. Eager float32 is bitwise equal
# (tests/test_transformers_integration.py); inductor fuses the elementwise work and rounds differently, and bf16
# rounds each op's result: measured up to 1e-6 relative on the fp32 loss compiled.
_TOLERANCES = {"float32": (1e-4, 1e-5), "bfloat16": (3e-2, 3e-2)}


def parse_case(spec: str, world: int = 2) -> tuple[int, int, int, int]:
    """``"BxSxDxF"`` -> (batch, seq_len, hidden, intermediate)."""
    try:
        batch, seq_len, hidden, intermediate = (int(s) for s in spec.split("x"))
    except ValueError:
        raise ValueError(f'hf_model case {spec!r}: expected "BxSxDxF", e.g. "4x128x256x512"') from None
    if min(batch, seq_len, hidden, intermediate) <= 0 or hidden % (2 * HEAD_DIM * world) or intermediate % world:
        raise ValueError(
            f"hf_model case {spec!r}: F and D/{2 * HEAD_DIM} (the key/value heads) must be positive and divisible "
            f"by the {world} ranks"
        )
    return batch, seq_len, hidden, intermediate


def load_integration():
    """(fastmesh.integrations.transformers, None), or (None, why the family cannot run)."""
    try:
        import fastmesh.integrations.transformers as integration
    except ImportError as error:
        return None, f"nothing measured: {error}"
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model and rank otherwise
    return integration, None


def _config(shape, dtype_name):
    from transformers import LlamaConfig

    _, seq_len, hidden, intermediate = shape
    heads = hidden // HEAD_DIM
    return LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=intermediate,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=seq_len,
        dtype=dtype_name,
    )


def _model(config, state_dict, integration, fused: bool):
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own deprecations
        with integration.registered() if fused else contextlib.nullcontext():
            model = LlamaForCausalLM.from_pretrained(
                None, config=config, state_dict=state_dict, distributed_config=DistributedConfig(tp_plan="auto")
            )
    return model.train()  # from_pretrained returns it in eval mode


def _step(model, tokens, compiled: bool):
    forward = torch.compile(model, fullgraph=True) if compiled else model

    def step():
        model.zero_grad(set_to_none=True)
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        embedding = model.get_input_embeddings().weight.grad
        return loss.detach(), embedding.full_tensor() if hasattr(embedding, "full_tensor") else embedding

    return step


def model_steps(shape, dtype_name, integration, compiled: bool, device, rank):
    """{contender: step()} on the same weights and tokens, after checking each against native's."""
    from transformers import LlamaForCausalLM

    batch, seq_len, _, _ = shape
    config = _config(shape, dtype_name)
    torch.manual_seed(0)  # the same weights on every rank
    state_dict = LlamaForCausalLM(config).to(TORCH_DTYPES[dtype_name]).state_dict()
    tokens = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    variants = {"native": (False, False), "fastmesh": (True, False)}
    if compiled:
        variants.update({"native_c": (False, True), "fastmesh_c": (True, True)})
    torch._dynamo.reset()  # earlier cases' graphs: each case compiles its own
    steps, results = {}, {}
    for name, (fused, compile_it) in variants.items():
        steps[name] = _step(_model(config, state_dict, integration, fused), tokens, compile_it)
        results[name] = steps[name]()  # compiles a compiled contender
    rtol, atol = _TOLERANCES[dtype_name]
    for name, got in results.items():
        for what, want, value in zip(("loss", "embedding gradient"), results["native"], got):
            where = f"rank {rank}, hf_model {'x'.join(map(str, shape))} {dtype_name}, {name} {what}"
            torch.testing.assert_close(value, want, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}")
    return steps


def run(ctx: Context) -> None:
    integration, why_not = load_integration()
    if integration is None:
        ctx.note(why_not)
        return
    # A compiled contender that silently fell back to eager would be timed as if compiled; inductor's caches would
    # try (and fail, warning) to pickle the graphs' process groups.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    world, rank = ctx.group.size(), ctx.mesh.get_local_rank()
    compiled = not ctx.quick
    if ctx.quick:
        ctx.note("--quick: eager only (without --quick the compiled steps are timed too)")
    cases = []
    for dtype_name in ctx.measured_dtypes(TORCH_DTYPES):
        for spec in ctx.cases or (QUICK_SHAPES if ctx.quick else FULL_SHAPES):
            cases.append((parse_case(spec, world), spec, dtype_name))
    ctx.expect(len(cases))
    for shape, spec, dtype_name in cases:
        steps = model_steps(shape, dtype_name, integration, compiled, ctx.device, rank)
        timings = time_slowest_rank(steps, ctx.group, ctx.warmup, ctx.repeats, ctx.clock)
        native_exposed = exposed_communication(steps["native"], ctx.group)
        # The timed step, not the profiled one, so that the profiler's own overhead is not counted as computation.
        compute = statistics.median(timings["native"]) - native_exposed["exposed_s"]
        kinds = {"fastmesh": "kernel", "fastmesh_c": "kernel"}
        contenders = {name: Contender(kinds.get(name, "baseline"), seconds) for name, seconds in timings.items()}
        contenders["bound"] = Contender("bound", [compute] * len(timings["native"]))
        extra = {"compiled_speedup": ("native_c", "fastmesh_c")} if compiled else {}
        batch, seq_len, hidden, intermediate = shape
        ctx.emit(
            Case(
                "hf_model",
                f"Llama {spec}",
                dtype_name,
                "fastmesh",
                contenders,
                extra_ratios=extra,
                details={"compute_s": compute, "native_exposed": native_exposed},
                params={
                    "batch": batch,
                    "seq_len": seq_len,
                    "hidden": hidden,
                    "intermediate": intermediate,
                    "layers": LAYERS,
                    "vocab": VOCAB,
                    "world": world,
                },
            )
        )


FAMILY = Family(
    "hf_model",
    "a Hugging Face Llama's training step under transformers' tp_plan=\"auto\": its own styles against fastmesh's "
    "(fastmesh.integrations.transformers), eager and compiled",
    distributed=True,
    dtypes=tuple(TORCH_DTYPES),
    run=run,
    parse_case=parse_case,
)

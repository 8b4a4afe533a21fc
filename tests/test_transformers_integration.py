"""fastmesh under Hugging Face transformers' tensor parallelism (``fastmesh.integrations.transformers``).

A tiny ``LlamaForCausalLM`` (float32; 8 heads, 4 KV heads: divisible by 4 ranks; vocabulary 128 > hidden 64, so its
LM head gathers its logits as it multiplies), the same weights on every rank, trained 3 SGD steps on 2 and 4 gloo
ranks in each mode:

* the plans of :data:`PLANS` through ``parallelize_module``: ``"torch"`` (torch's ColwiseParallel / RowwiseParallel,
  the LM head ``ColwiseParallel(output_layouts=Replicate())``) and ``"swapped"`` (the same plan with fastmesh's
  style names: its defaults are torch's), ``"fused_plan"`` (torch's plan through ``fastmesh.parallel.fused``);
* transformers' ``from_pretrained(None, config=, state_dict=, distributed_config=DistributedConfig(tp_plan="auto"))``
  with its own styles (``"transformers"``), and with :func:`register` (``"registered"``).

Every mode's losses and full gradients equal the ``"torch"`` mode's, bitwise; the fastmesh modes run fastmesh's
ops (counted with CommDebugMode, as tests/test_parallel.py counts them). The swapped plan compiled with the fusion
pass gives eager's loss. register / unregister / registered restore transformers' registry; a linear fastmesh
cannot serve runs transformers' style and is said once; a missing or unsupported transformers is a clear
ImportError.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import pathlib
import sys
import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tensor parallelism needs it

import torch
import torch.distributed as dist
from log_capture import captured_log
from rank_pool import on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig

import fastmesh.integrations.transformers as fastmesh_hf
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel, fused

STEPS, BATCH, SEQ = 3, 2, 16
COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWS = ("self_attn.o_proj", "mlp.down_proj")


def _config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=layers,
        vocab_size=128,
        max_position_embeddings=64,
        dtype="float32",
    )


def _plan(colwise, rowwise) -> dict:
    """transformers' Llama plan (its ``base_model_tp_plan`` and LM head) in torch's form, embedding left
    replicated."""
    plan = {f"model.layers.*.{name}": colwise() for name in COLUMNS}
    plan.update({f"model.layers.*.{name}": rowwise() for name in ROWS})
    plan["lm_head"] = colwise(output_layouts=Replicate())
    return plan


# Plans for parallelize_module, by mode name; the test trains each. A new mode is one more entry here.
PLANS = {
    "torch": lambda: _plan(ColwiseParallel, RowwiseParallel),
    "swapped": lambda: _plan(FusedColwiseParallel, FusedRowwiseParallel),
    "fused_plan": lambda: fused(_plan(ColwiseParallel, RowwiseParallel)),
}
# The modes that must run fastmesh's ops.
FUSED_MODES = {"swapped", "fused_plan", "registered"}
_FUSED_OPS = (torch.ops.fastmesh.matmul_all_reduce, torch.ops.fastmesh.matmul_all_gather)


def _reference(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank and in every mode
    return LlamaForCausalLM(_config(layers))


def _from_pretrained(register: bool) -> LlamaForCausalLM:
    """transformers' own entry point, from a state dict (no checkpoint on disk), with or without fastmesh."""
    state_dict = _reference().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations, not ours
        if register:
            with fastmesh_hf.registered():
                model = LlamaForCausalLM.from_pretrained(
                    None,
                    config=_config(),
                    state_dict=state_dict,
                    distributed_config=DistributedConfig(tp_plan="auto"),
                )
        else:
            model = LlamaForCausalLM.from_pretrained(
                None, config=_config(), state_dict=state_dict, distributed_config=DistributedConfig(tp_plan="auto")
            )
    return model.train()  # from_pretrained returns it in eval mode


def _model(mode: str, layers: int = 2) -> LlamaForCausalLM:
    if mode in PLANS:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return parallelize_module(_reference(layers), mesh, PLANS[mode]())
    return _from_pretrained(register=mode == "registered")


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, _config().vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model):
    """Each step's loss, every parameter's full gradient per step, and the fastmesh ops the first step ran (by
    phase; the other steps run the same code, uncounted: CommDebugMode slows every op down)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens = _tokens(step)
        mode = CommDebugMode() if step == 0 else contextlib.nullcontext()
        if step == 0:
            mode.comm_registry.update(_FUSED_OPS)
        with mode:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        if step == 0:
            counts = mode.comm_module_counts["Global"]
            fused = {phase: {op.__name__: counts[phase].get(op, 0) for op in _FUSED_OPS} for phase in counts}
        losses.append(loss.item())
        grads.append({name: _full(p.grad).clone() for name, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, fused


def _expected_fused_ops(layers: int) -> dict:
    """Per training step: forward, each row-parallel linear's all-reduce inside its matmul and the LM head's logits
    gathered inside its (vocabulary 128 > hidden 64: the output's gather moves more); backward, each column-parallel
    linear's input gradient all-reduced inside its matmul (one per linear, as torch's plan has), the LM head's
    included."""
    return {
        "forward": {"matmul_all_reduce": len(ROWS) * layers, "matmul_all_gather": 1},
        "backward": {"matmul_all_reduce": len(COLUMNS) * layers + 1, "matmul_all_gather": 0},
    }


@on_ranks(2, 4, timeout=300)
def test_every_mode_trains_as_torchs_plan(world_size):
    """Bitwise: the modes compute the same products and reduce the same partial sums over the same ranks (the fused
    ops reduce in rank order, as gloo's all-reduce does at these sizes: measured equal at 2 and 4 ranks), and the
    embedding's masked lookup under transformers' embedding_rowwise sums one row with zeros."""
    modes = [*PLANS, "transformers", "registered"]
    runs = {mode: train(_model(mode)) for mode in modes}
    want_losses, want_grads, _ = runs["torch"]
    assert want_losses[-1] < want_losses[0], want_losses  # the steps do train
    expected = _expected_fused_ops(_config().num_hidden_layers)
    for mode, (losses, grads, fused_ops) in runs.items():
        assert losses == want_losses, (mode, losses, want_losses)
        for step, (got, want) in enumerate(zip(grads, want_grads)):
            assert got.keys() == want.keys(), (mode, sorted(got.keys() ^ want.keys()))
            for name, grad in want.items():
                assert torch.equal(got[name], grad), f"{mode}, step {step}: grad {name}"
        assert fused_ops == (expected if mode in FUSED_MODES else _no_fused_ops()), (mode, fused_ops)


def _no_fused_ops() -> dict:
    return {phase: {op.__name__: 0 for op in _FUSED_OPS} for phase in ("forward", "backward")}


@on_ranks(2, timeout=300)
def test_registered_model_places_parameters_as_transformers():
    """Every parameter a DTensor of transformers' own placement and local shape, every linear under a replaced string
    runs fastmesh's forward, and a no_grad forward (transformers' inference path) gives the same logits."""
    native, fused = _from_pretrained(register=False), _from_pretrained(register=True)
    native_params, fused_params = dict(native.named_parameters()), dict(fused.named_parameters())
    assert native_params.keys() == fused_params.keys()
    for name, p in native_params.items():
        q = fused_params[name]
        assert type(q) is type(p), name
        if isinstance(p, DTensor):
            assert (q.placements, q.to_local().shape) == (p.placements, p.to_local().shape), name
    layer = fused.model.layers[0]
    for name in (*COLUMNS, *ROWS):
        assert "Fused" in layer.get_submodule(name).forward.__qualname__, name
    assert "Fused" in fused.lm_head.forward.__qualname__
    tokens = _tokens(0)
    with torch.no_grad():
        assert torch.equal(fused.eval()(input_ids=tokens).logits, native.eval()(input_ids=tokens).logits)


@on_ranks(2, timeout=300)
def test_swapped_plan_compiled_with_the_fusion_pass_gives_eagers_loss():
    """One layer (each layer is the same code; inductor takes ~30 s for it on 2 CPU cores). The fused ops'
    plans fixed (FASTMESH_TUNE=off: at these sizes the planner would run them unfused, traced as native
    collectives), so the compiled graphs hold fastmesh's ops, the pass finds nothing left to fuse, and nothing
    native is left beside them. Inductor computes the float32 elementwise work in its own kernels, so the loss is
    compared within float32 rounding of a loss of ~4.9, not bitwise (measured: equal, or 1 ulp apart)."""
    from test_compile_fusion import _fusion

    import fastmesh.compile

    tokens, layers = _tokens(0), 1
    with _fusion(strict=True, tune="off") as census:
        want = _model("swapped", layers)(input_ids=tokens, labels=tokens).loss.item()
        model = _model("swapped", layers)
        compiled = torch.compile(model, fullgraph=True)
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        report = fastmesh.compile.fusion_report()
    assert loss.item() == pytest.approx(want, rel=1e-6, abs=0), (loss.item(), want)
    assert report.unfused == [] and report.fused == [], str(report)
    assert sorted(census.graphs) == [
        # rank_columns: the LM head's backward takes this rank's columns of the gathered product's gradient
        ("backward", {"fastmesh.matmul_all_reduce": len(COLUMNS) * layers + 1, "fastmesh.rank_columns": 1}),
        ("forward", {"fastmesh.matmul_all_reduce": len(ROWS) * layers, "fastmesh.matmul_all_gather": 1}),
    ], census.graphs
    assert all(p.grad is not None for p in model.parameters())


# ---- the registry ----


def _registry() -> dict:
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return {name: ALL_PARALLEL_STYLES[name] for name in ALL_PARALLEL_STYLES}


def test_register_and_unregister_restore_transformers_styles():
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    original = _registry()
    names = fastmesh_hf.register()
    try:
        assert set(names) == {*fastmesh_hf.STYLE_NAMES, *(f"fastmesh_{n}" for n in fastmesh_hf.STYLE_NAMES)}
        for name in names:
            style = ALL_PARALLEL_STYLES[name]
            assert isinstance(style, fastmesh_hf.FusedStyle), name
            assert style.fallback is original[name.removeprefix("fastmesh_")], name
        # Only the strings fastmesh serves are replaced.
        assert {n: s for n, s in _registry().items() if n not in names} == {
            n: s for n, s in original.items() if n not in names
        }
        assert isinstance(ALL_PARALLEL_STYLES["colwise"].fused, FusedColwiseParallel)
        assert isinstance(ALL_PARALLEL_STYLES["rowwise_split_input"].fused, FusedRowwiseParallel)
        assert ALL_PARALLEL_STYLES["colwise_gather_output"].fused.output_layouts == (Replicate(),)
        # Registering again replaces the registration: aliases only.
        assert set(fastmesh_hf.register(override=False)) == {f"fastmesh_{n}" for n in fastmesh_hf.STYLE_NAMES}
        assert ALL_PARALLEL_STYLES["colwise"] is original["colwise"]
    finally:
        fastmesh_hf.unregister()
    assert _registry() == original
    fastmesh_hf.unregister()  # nothing registered: a no-op
    assert _registry() == original


def test_registered_restores_the_registration_before_it():
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    from fastmesh.fp8 import Float8Config

    original = _registry()
    someone_elses = object()
    ALL_PARALLEL_STYLES["rowwise"] = someone_elses  # another library's override, in the same registry
    try:
        fastmesh_hf.register(override=False)
        fp8 = Float8Config(granularity="tensorwise")
        with fastmesh_hf.registered(fp8=fp8):
            assert ALL_PARALLEL_STYLES["colwise"].fused.fp8 == fp8
            assert ALL_PARALLEL_STYLES["colwise_gather_output"].fused.fp8 is None  # the LM head: high precision
            assert ALL_PARALLEL_STYLES["rowwise"].fallback is someone_elses
        assert ALL_PARALLEL_STYLES["colwise"] is original["colwise"]  # back to aliases only
        assert ALL_PARALLEL_STYLES["fastmesh_colwise"].fused.fp8 is None
        fastmesh_hf.unregister()
        assert ALL_PARALLEL_STYLES["rowwise"] is someone_elses
    finally:
        fastmesh_hf.unregister()
        del ALL_PARALLEL_STYLES["rowwise"]
    assert _registry() == original


class _ScaledLinear(nn.Linear):
    """A linear whose forward does more than nn.Linear's (as a quantized or adapter linear's does): fastmesh, which
    replaces a linear's forward, must leave it to transformers' style."""

    def forward(self, x):
        return super().forward(x) * 2


@on_ranks(2, timeout=300)
def test_a_linear_fastmesh_cannot_serve_runs_transformers_style_and_says_so():
    def distributed(register: bool):
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config())
        for layer in model.model.layers:
            scaled = _ScaledLinear(layer.mlp.up_proj.in_features, layer.mlp.up_proj.out_features, bias=False)
            scaled.weight = layer.mlp.up_proj.weight
            layer.mlp.up_proj = scaled
        config, _, mesh_manager = LlamaForCausalLM.prepare_distribute_model(DistributedConfig(tp_plan="auto"))
        if register:
            with fastmesh_hf.registered():
                return LlamaForCausalLM.maybe_distribute_model(model, config, mesh_manager)
        return LlamaForCausalLM.maybe_distribute_model(model, config, mesh_manager)

    with captured_log("fastmesh.integrations", logging.WARNING) as messages:
        fused = distributed(register=True)
    assert messages == [
        "tp_plan style 'colwise': _ScaledLinear runs transformers' own style, not fastmesh's: it is a subclass of "
        "nn.Linear with its own forward"
    ], messages
    assert "Fused" not in fused.model.layers[0].mlp.up_proj.forward.__qualname__
    assert "Fused" in fused.model.layers[0].mlp.gate_proj.forward.__qualname__
    tokens = _tokens(0)
    losses = [m(input_ids=tokens, labels=tokens).loss.item() for m in (fused, distributed(register=False))]
    assert losses[0] == losses[1], losses


# ---- an optional dependency ----


def test_importing_fastmesh_does_not_import_transformers():
    """No module of the package but the integration imports transformers or the integration, at module level or in
    a function, so ``import fastmesh`` (and any of its modules) never does."""
    root = pathlib.Path(fastmesh_hf.__file__).resolve().parents[2]
    integration = pathlib.Path(fastmesh_hf.__file__).resolve()
    found = []
    for folder in (root / "fastmesh", root / "kernels"):
        for path in folder.rglob("*.py"):
            if path.resolve() == integration:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):  # relative too: `from . import transformers`
                    names = [node.module or "", *(alias.name for alias in node.names)]
                    names += [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                forbidden = ("transformers.", "fastmesh.integrations.transformers")
                if any(n == "transformers" or n.startswith(forbidden) for n in names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def test_missing_or_unsupported_transformers_is_a_clear_import_error(monkeypatch):
    import importlib
    import types

    monkeypatch.delitem(sys.modules, "fastmesh.integrations.transformers")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs Hugging Face transformers>=5\.20,<6 .*pip install 'fastmesh\["):
        importlib.import_module("fastmesh.integrations.transformers")
    for version in ("4.57.1", "6.0.0", "5.19.2"):
        monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__=version))
        with pytest.raises(ImportError, match=rf"found transformers {version}: pip install 'fastmesh\[transformers\]'"):
            importlib.import_module("fastmesh.integrations.transformers")

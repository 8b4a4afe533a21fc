"""``fastmesh.parallel.fused``: what each entry of a torch plan becomes, what stays torch's and why, and, on 2
ranks, modules the fused styles cannot serve (left to torch's entry) and a parent called with its input by name.
torch's own Transformer through ``fused`` is in tests/test_torch_transformer.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from log_capture import captured_log
from rank_pool import on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fastmesh import _log
from fastmesh.fp8 import Float8Config
from fastmesh.parallel import FusedColwiseParallel, FusedRowwiseParallel, fused


@pytest.fixture(autouse=True)
def _said_anew():
    _log.forget(lambda key: isinstance(key, tuple) and key[0] == "fused")


def _said(plan, **kwargs) -> tuple[object, str]:
    with captured_log("fastmesh.parallel", logging.INFO) as messages:
        out = fused(plan, **kwargs)
    return out, " ".join(messages)


def _attention_plan(**prepare):
    prepare = {"input_layouts": (Shard(1), None), "desired_input_layouts": (Replicate(), None)} | prepare
    return {
        "layers.*.attention": PrepareModuleInput(**prepare),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
    }


def test_each_style_takes_its_fused_form_with_torchs_arguments():
    for style, fused_type in (
        (ColwiseParallel(), FusedColwiseParallel),
        (ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False), None),
        (RowwiseParallel(), FusedRowwiseParallel),
        (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), None),
    ):
        got = fused(style).fused
        assert isinstance(got, fused_type or (FusedColwiseParallel, FusedRowwiseParallel)), got
        assert (got.input_layouts, got.output_layouts, got.use_local_output) == (
            style.input_layouts,
            style.output_layouts,
            style.use_local_output,
        ), (got, style)
    mine = FusedRowwiseParallel()
    assert fused(mine) is mine and fused({"wo": mine})["wo"] is mine


def test_siblings_under_one_prepare_module_input_share_one_gather():
    out, said = _said(_attention_plan())
    assert list(out) == ["layers.*.attention", "layers.*.attention.wo", "layers.*.attention_norm"], out
    shared = out["layers.*.attention"].fused
    assert isinstance(shared, FusedColwiseParallel) and shared.linears == ("wq", "wk", "wv"), shared
    assert shared.input_layouts == (Shard(1),) and shared.output_layouts == (Shard(-1),), shared
    assert isinstance(out["layers.*.attention.wo"].fused, FusedRowwiseParallel)
    assert isinstance(out["layers.*.attention_norm"], SequenceParallel)
    assert "SequenceParallel at 'layers.*.attention_norm' stays torch's: no matmul of its own" in said, said
    # A plan applied to the parent itself ("" is the module parallelize_module is given).
    out = fused(
        {"": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()), "w1": ColwiseParallel()}
    )
    assert list(out) == [""] and out[""].fused.linears == ("w1",), out


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"use_local_output": True}, "use_local_output=True hands the module a plain tensor"),
        (
            {"input_layouts": (Shard(1), Shard(1)), "desired_input_layouts": (Replicate(), Replicate())},
            "it places inputs besides the first",
        ),
        (
            {"input_layouts": (Replicate(), None), "desired_input_layouts": (Shard(1), None)},
            "it does not make its input Replicate()",
        ),
        ({"input_layouts": (Partial(), None)}, "its input is placed Partial(sum), which no fused op gathers"),
        (
            {
                "input_layouts": None,
                "desired_input_layouts": None,
                "input_kwarg_layouts": {"x": Shard(1), "mask": Replicate()},
                "desired_input_kwarg_layouts": {"x": Replicate(), "mask": Replicate()},
            },
            "it places 2 inputs by keyword, where the shared gather takes one",
        ),
    ],
)
def test_a_prepare_module_input_that_does_more_stays_torchs(change, why):
    out, said = _said(_attention_plan(**change))
    assert type(out["layers.*.attention"]) is PrepareModuleInput, out
    assert isinstance(out["layers.*.attention.wq"].fused, FusedColwiseParallel), out  # each linear its own
    assert f"PrepareModuleInput at 'layers.*.attention' stays torch's: {why}" in said, said


def test_siblings_that_differ_do_not_share():
    plan = _attention_plan()
    plan["layers.*.attention.wv"] = ColwiseParallel(use_local_output=False)
    out, said = _said(plan)
    assert type(out["layers.*.attention"]) is PrepareModuleInput and "linears differ in layouts" in said, said
    out, said = _said({"ffn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())})
    assert "lists no ColwiseParallel linears under it" in said, said


def test_what_fused_cannot_serve_stays_as_it_is():
    class MyColwise(ColwiseParallel):
        pass

    plan = {"a": MyColwise(), "b": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())}
    out, said = _said(plan)
    assert out == plan, out
    assert "MyColwise at 'a' stays torch's: a subclass of torch's style" in said, said
    assert "PrepareModuleOutput at 'b' stays torch's: no matmul" in said, said


def test_fp8_serves_the_layouts_it_can():
    config = Float8Config()
    out, said = _said(
        {"wq": ColwiseParallel(), "wo": RowwiseParallel(), "wp": RowwiseParallel(output_layouts=Partial())}, fp8=config
    )
    assert out["wq"].fused.fp8 == config and out["wo"].fused.fp8 == config, out
    assert out["wp"].fused.fp8 is None, out
    assert "fp8 cannot serve output_layouts=Partial(sum): it runs in high precision" in said, said


def test_bad_plans_are_named():
    with pytest.raises(TypeError, match="fused: plan must be a ParallelStyle or a dict of them, got list"):
        fused([ColwiseParallel()])
    with pytest.raises(TypeError, match=r"fused: plan\['wq'\] must be a ParallelStyle, got str"):
        fused({"wq": "colwise"})
    assert fused({"block": {"wq": ColwiseParallel()}})["block"]["wq"].fused.linears is None  # nested plans


# ---- on 2 ranks ----


class _Block(nn.Module):
    """An embedding (no fused form) feeding a parent whose forward takes its input by name, as Hugging Face's
    decoder layers call ``self_attn(hidden_states=...)``."""

    def __init__(self, attention: type[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(16, 8, dtype=torch.float64)
        self.attention = attention()

    def forward(self, tokens):
        return self.attention(hidden_states=self.embed(tokens))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(8, 8, dtype=torch.float64)
        self.wk = nn.Linear(8, 8, dtype=torch.float64)
        self.wo = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, hidden_states):
        return self.wo(self.wq(hidden_states) * self.wk(hidden_states))


class _AttentionInputSecond(_Attention):
    """Its placed input is not its forward's first: the shared gather, which takes the first, cannot serve it."""

    def forward(self, cache=None, hidden_states=None):
        return super().forward(hidden_states)


def _block_plan():
    by_name = {"input_kwarg_layouts": {"hidden_states": Shard(1)}}
    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "attention": PrepareModuleInput(**by_name, desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def _run(model: nn.Module, tokens: torch.Tensor):
    """The output's full tensor, every parameter's full gradient, and the fused ops' forward counts."""
    mode = CommDebugMode()
    mode.comm_registry.update({torch.ops.fastmesh.all_gather_matmul, torch.ops.fastmesh.matmul_reduce_scatter})
    with mode:
        out = model(tokens)
    full = DTensor.from_local(out, model.embed.weight.device_mesh, [Shard(1)]).full_tensor()
    (full * full).sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return full, grads, dict(mode.comm_module_counts["Global"]["forward"])


@on_ranks(2)
def test_fused_plan_serves_what_it_can_and_leaves_the_rest_to_torch():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    for attention in (_Attention, _AttentionInputSecond):
        torch.manual_seed(0)
        model = _Block(attention)
        want, want_grads, _ = _run(parallelize_module(copy.deepcopy(model), mesh, _block_plan()), tokens)
        _log.forget(lambda key: isinstance(key, tuple) and key[0] == "fused")
        with captured_log("fastmesh.parallel", logging.INFO) as messages:
            got, got_grads, counts = _run(parallelize_module(model, mesh, fused(_block_plan())), tokens)
        said = " ".join(messages)
        assert "RowwiseParallel at 'embed' stays torch's: not an nn.Linear: {'<the module>': 'Embedding'}" in said
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-12, atol=1e-12, msg=name)
        assert counts[torch.ops.fastmesh.matmul_reduce_scatter] == 1, counts  # wo
        if attention is _Attention:  # q and k share one fused gather, their input passed by name
            assert counts[torch.ops.fastmesh.all_gather_matmul] == 1, counts
        else:  # torch's PrepareModuleInput gathers; each linear takes its own entry's form
            assert (
                "PrepareModuleInput at 'attention' stays torch's: it places 'hidden_states', where the shared gather "
                "takes the forward's first input 'cache'"
            ) in said, said
            assert torch.ops.fastmesh.all_gather_matmul not in counts, counts

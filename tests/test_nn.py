"""Plain-tensor tensor-parallel linears (``fastmesh.nn``) on 2 and 3 gloo ranks.

* Every flag combination of ``ColumnParallelLinear`` / ``RowParallelLinear`` against the unsharded ``nn.Linear``:
  small-integer data make every product and sum exact, so forward outputs and all gradients (input, weight shards,
  biases) must match bit for bit; the fused ops each path runs are counted.
* A Megatron MLP (column -> ReLU -> row), sequence parallel and not; eager vs ``torch.compile(fullgraph=True)``.
* FP8: the same fused ops' FP8 forms called directly (bit for bit), and an SQNR floor against high precision.
* State dicts (shards saved and loaded, the full tensors, DTensors, a wrong shape), ``from_linear``, and bad arguments
  raising errors that name them.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from log_capture import captured_log
from rank_pool import on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch_support import ROWWISE_ON_CPU

import fastmesh
from fastmesh import _log
from fastmesh.fp8 import Float8Config
from fastmesh.nn import ColumnParallelLinear, RowParallelLinear
from fastmesh.ops.replicated_input import replicated_input_matmul

FP8_GRANULARITY = "rowwise" if ROWWISE_ON_CPU else "tensorwise"  # torch < 2.13: tensor-wise only on CPU
FUSED = {
    torch.ops.fastmesh.all_gather_matmul: "all_gather_matmul",
    torch.ops.fastmesh.matmul_reduce_scatter: "matmul_reduce_scatter",
    torch.ops.fastmesh.matmul_all_reduce: "matmul_all_reduce",
    torch.ops.fastmesh.matmul_all_gather: "matmul_all_gather",
}


def _ints(shape, seed, low=-3, high=4) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed)).float()


def _randn(shape, seed) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _block(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's block of ``t`` along ``dim``."""
    return t.chunk(dist.get_world_size(), dim)[dist.get_rank()].clone()


def _int_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        for i, p in enumerate(linear.parameters()):
            p.copy_(_ints(p.shape, seed + i))
    return linear


def _reference(linear: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor, add_bias: bool = True):
    """The unsharded layer's output (with or without its bias) and its gradients for ``grad_out``."""
    linear = copy.deepcopy(linear)
    x = x.clone().requires_grad_()
    y = F.linear(x, linear.weight, linear.bias if add_bias else None)
    (y * grad_out).sum().backward()
    bias_grad = linear.bias.grad if linear.bias is not None and add_bias else None
    return y.detach(), x.grad, linear.weight.grad, bias_grad


def _issued(fn) -> tuple[dict, dict]:
    """The fused ops (by name) and other collectives ``fn``'s forward and backward issue on this rank."""
    mode = CommDebugMode()
    mode.comm_registry.update(FUSED)
    with mode:
        fn()
    counts = mode.comm_module_counts["Global"]
    return tuple({FUSED.get(op, op.__name__): n for op, n in counts[p].items()} for p in ("forward", "backward"))


# ---- ColumnParallelLinear: every flag combination, bit for bit ----


def _column_cases():
    # (sequence_parallel, gather_output, sequence_dim, input shape as (sequence, batch) order)
    yield False, False, 0, "sbh"
    yield False, True, 0, "sbh"
    yield True, False, 0, "sbh"  # Megatron's [s, b, h]
    yield True, False, 1, "bsh"
    yield True, False, -2, "bsh"


@on_ranks(2, 3)
def test_column_parallel_linear_matches_nn_linear_bit_for_bit(world_size):
    in_features, out_features, seq, batch = 6, 3 * world_size, 2 * world_size, 3
    for (sp, gather, seq_dim, layout), bias, skip in itertools.product(_column_cases(), (True, False), (False, True)):
        case = f"sequence_parallel={sp}, gather_output={gather}, sequence_dim={seq_dim}, bias={bias}, skip={skip}"
        linear = _int_linear(in_features, out_features, bias, seed=1)
        shape = (seq, batch, in_features) if layout == "sbh" else (batch, seq, in_features)
        x = _ints(shape, seed=10)
        grad_out = _ints((*shape[:-1], out_features), seed=11)
        add_bias = bias and not (skip and gather)  # a gathered output's shard bias cannot be added by the caller
        want_y, want_dx, want_dw, want_db = _reference(linear, x, grad_out, add_bias)

        module = ColumnParallelLinear(
            in_features,
            out_features,
            bias=bias,
            gather_output=gather,
            sequence_parallel=sp,
            sequence_dim=seq_dim,
            skip_bias_add=skip,
        )
        assert module.weight.shape == (3, in_features) and module.output_size_per_partition == 3, case
        with torch.no_grad():
            module.weight.copy_(_block(linear.weight, 0))
            if bias:
                module.bias.copy_(_block(linear.bias, 0))
        xs = (_block(x, seq_dim) if sp else x.clone()).requires_grad_()
        out = {}

        def step():
            y, y_bias = module(xs)
            out.update(y=y, y_bias=y_bias)
            if y_bias is not None and not gather:
                y = y + y_bias
            (y * (grad_out if gather else _block(grad_out, -1))).sum().backward()

        forward, backward = _issued(step)
        y, y_bias = out["y"], out["y_bias"]
        with torch.no_grad():  # inference takes no gradient paths: the same output
            assert torch.equal(module(xs)[0], y.detach()), case
        if skip and bias:
            # Megatron's and vLLM's contract: this rank's bias itself (CommDebugMode's module hooks wrap it above).
            assert module(xs)[1] is module.bias and torch.equal(y_bias, module.bias), case
            if not gather:
                y = y + y_bias
        else:
            assert y_bias is None, case
        assert torch.equal(y.detach(), want_y if gather else _block(want_y, -1)), case
        assert torch.equal(xs.grad, _block(want_dx, seq_dim) if sp else want_dx), case
        assert torch.equal(module.weight.grad, _block(want_dw, 0)), case
        if bias:
            assert torch.equal(module.bias.grad, _block(want_db, 0)) if add_bias else module.bias.grad is None, case
        if sp:
            assert forward == {"all_gather_matmul": 1}, (case, forward)
            # and the shard kept for the weight's gradient gathered again
            assert backward == {"matmul_reduce_scatter": 1, "all_gather_into_tensor": 1}, (case, backward)
        else:
            fused = {"matmul_all_gather": 1} if gather else {}
            bias_gather = {"all_gather_into_tensor": 1} if gather and bias and not skip else {}
            assert forward == {**fused, **bias_gather}, (case, forward)
            assert backward == {"matmul_all_reduce": 1}, (case, backward)


# ---- RowParallelLinear ----


def _row_cases():
    # (sequence_parallel, input_is_parallel, reduce_results, sequence_dim, layout)
    yield False, True, True, 0, "sbh"
    yield False, False, True, 0, "sbh"
    yield False, True, False, 0, "sbh"
    yield False, False, False, 0, "sbh"
    yield True, True, True, 0, "sbh"
    yield True, True, True, 1, "bsh"


@on_ranks(2, 3)
def test_row_parallel_linear_matches_nn_linear_bit_for_bit(world_size):
    in_features, out_features, seq, batch = 4 * world_size, 5, 2 * world_size, 3
    rank = dist.get_rank()
    for (sp, parallel_in, reduce, seq_dim, layout), bias, skip in itertools.product(
        _row_cases(), (True, False), (False, True)
    ):
        case = (
            f"sequence_parallel={sp}, input_is_parallel={parallel_in}, reduce_results={reduce}, "
            f"sequence_dim={seq_dim}, bias={bias}, skip={skip}"
        )
        linear = _int_linear(in_features, out_features, bias, seed=2)
        shape = (seq, batch, in_features) if layout == "sbh" else (batch, seq, in_features)
        x = _ints(shape, seed=20)
        grad_out = _ints((*shape[:-1], out_features), seed=21)
        want_y, want_dx, want_dw, want_db = _reference(linear, x, grad_out)

        module = RowParallelLinear(
            in_features,
            out_features,
            bias=bias,
            input_is_parallel=parallel_in,
            sequence_parallel=sp,
            sequence_dim=seq_dim,
            reduce_results=reduce,
            skip_bias_add=skip,
        )
        assert module.weight.shape == (out_features, 4) and module.input_size_per_partition == 4, case
        with torch.no_grad():
            module.weight.copy_(_block(linear.weight, 1))
            if bias:
                module.bias.copy_(linear.bias)
        xs = (_block(x, -1) if parallel_in else x.clone()).requires_grad_()
        g = _block(grad_out, seq_dim) if sp else grad_out  # a replicated (or partial) output's gradient: the whole
        out = {}

        def step():
            y, y_bias = module(xs)
            out.update(y=y, y_bias=y_bias)
            if y_bias is not None and reduce:  # the caller's add: to its rows, or to the reduced output
                y = y + y_bias
            loss = (y * g).sum()
            if y_bias is not None and not reduce:  # added after the caller reduces the partial sums
                loss = loss + (y_bias * grad_out.sum((0, 1))).sum()
            loss.backward()

        forward, backward = _issued(step)
        y, y_bias = out["y"].detach(), out["y_bias"]
        with torch.no_grad():  # inference takes no gradient paths: the same output
            assert torch.equal(module(xs)[0], y), case
        assert (y_bias is not None) == (skip and bias), case
        if skip and bias and not sp:  # the bias itself (CommDebugMode's module hooks wrap it above)
            assert module(xs)[1] is module.bias, case
        if y_bias is not None and reduce:
            y = y + y_bias.detach()
        if reduce:
            assert torch.equal(y, _block(want_y, seq_dim) if sp else want_y), case
        else:  # a partial sum, the bias on the first rank only (or for the caller)
            summed = y.clone()
            dist.all_reduce(summed)
            if y_bias is not None:
                summed = summed + y_bias.detach()
            assert torch.equal(summed, want_y), case
            if bias and not skip and rank > 0:  # no bias here
                assert torch.equal(y, _block(x, -1) @ module.weight.detach().t()), case
        assert torch.equal(xs.grad, _block(want_dx, -1) if parallel_in else want_dx), case
        assert torch.equal(module.weight.grad, _block(want_dw, 1)), case
        if bias:  # the whole gradient on every rank's replica
            assert torch.equal(module.bias.grad, want_db), case
        if sp:
            assert forward == {"matmul_reduce_scatter": 1}, (case, forward)
            # The bias's gradient, summed over this rank's rows, is all-reduced.
            assert backward == {"all_gather_matmul": 1, **({"all_reduce": 1} if bias else {})}, (case, backward)
        else:
            assert forward == ({"matmul_all_reduce": 1} if reduce else {}), (case, forward)
            assert backward == ({} if parallel_in else {"all_gather_into_tensor": 1}), (case, backward)


# ---- a Megatron MLP ----


def _mlp_reference(hidden: int, ffn: int, x: torch.Tensor, grad_out: torch.Tensor):
    mlp = nn.Sequential(_int_linear(hidden, ffn, True, seed=3), nn.ReLU(), _int_linear(ffn, hidden, True, seed=5))
    xr = x.clone().requires_grad_()
    y = mlp(xr)
    (y * grad_out).sum().backward()
    return mlp, y.detach(), xr.grad


class MegatronMLP(nn.Module):
    """Megatron's ParallelMLP: fc1's bias returned and added with the activation, fc2's added after it (as Megatron's
    bias-dropout-add does).
    ``sequence_parallel=None``: neither, but fc1 gathers its output and fc2 splits it again and returns partial sums
    (every path the other flags take)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, sequence_parallel: bool | None, skip_bias_add: bool):
        super().__init__()
        flags = dict(sequence_parallel=bool(sequence_parallel), skip_bias_add=skip_bias_add)
        other = {} if sequence_parallel is not None else dict(input_is_parallel=False, reduce_results=False)
        self.fc1 = ColumnParallelLinear.from_linear(fc1, gather_output=sequence_parallel is None, **flags)
        self.fc2 = RowParallelLinear.from_linear(fc2, **flags, **other)

    def forward(self, x):
        h, b1 = self.fc1(x)
        h = F.relu(h if b1 is None else h + b1)
        y, b2 = self.fc2(h)
        return y if b2 is None else y + b2


@on_ranks(2)
def test_megatron_mlp_matches_unsharded_bit_for_bit():
    hidden, ffn, seq, batch = 6, 8, 4, 3
    x, grad_out = _ints((seq, batch, hidden), seed=30), _ints((seq, batch, hidden), seed=31)
    mlp, want_y, want_dx = _mlp_reference(hidden, ffn, x, grad_out)
    fc1, fc2 = mlp[0], mlp[2]
    for sp, skip in itertools.product((True, False), (False, True)):
        case = f"sequence_parallel={sp}, skip_bias_add={skip}"
        module = MegatronMLP(fc1, fc2, sp, skip)
        part = (lambda t: _block(t, 0)) if sp else (lambda t: t)
        xs = part(x).clone().requires_grad_()
        y = module(xs)
        (y * part(grad_out)).sum().backward()
        assert torch.equal(y, part(want_y)), case
        assert torch.equal(xs.grad, part(want_dx)), case
        for name, linear, dim in (("fc1", fc1, 0), ("fc2", fc2, 1)):
            layer = getattr(module, name)
            assert torch.equal(layer.weight.grad, _block(linear.weight.grad, dim)), f"{case}: {name}.weight"
            want_db = _block(linear.bias.grad, 0) if name == "fc1" else linear.bias.grad
            assert torch.equal(layer.bias.grad, want_db), f"{case}: {name}.bias"


@on_ranks(2, timeout=300)
def test_compiled_mlp_matches_eager():
    """fullgraph compile of the MLP (one graph, no break), sequence parallel, not, and through the gathered output,
    split input and partial sums: eager's outputs and gradients bit for bit, randn data."""
    from torch._dynamo.testing import CompileCounterWithBackend

    hidden, ffn = 8, 12
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    for sp in (True, False, None):
        module = MegatronMLP(fc1, fc2, sp, skip_bias_add=False)
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        results = []
        for fn in (module, torch.compile(module, fullgraph=True, backend=counter)):
            x = _randn((4, 2, hidden), seed=40 + (dist.get_rank() if sp else 0)).requires_grad_()  # shards or whole
            y = fn(x)
            (y * _randn(y.shape, seed=41)).sum().backward()
            results.append((y.detach(), x.grad, [p.grad.clone() for p in module.parameters()]))
            module.zero_grad()
        (y, dx, grads), (y_eager, dx_eager, grads_eager) = results[1], results[0]
        assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager), sp
        assert all(torch.equal(g, w) for g, w in zip(grads, grads_eager)), sp
        assert len([g for g in counter.graphs if len(g.graph.nodes)]) == 1, (sp, counter.graphs)
        assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters["graph_break"]


# ---- FP8 ----


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return (20 * torch.log10(want.norm() / (got - want).norm())).item()


def _fp8_runs(config: Float8Config, world: int):
    """(label, module, the same computation from the fused ops' own FP8 forms, this rank's part of the whole
    input)."""
    name = dist.group.WORLD.group_name
    first = dist.get_rank() == 0
    columns, rows = (lambda t: _block(t, -1)), (lambda t: _block(t, 0))

    def column(**flags):
        return ColumnParallelLinear(64, 32 * world, fp8=config, **flags)

    def row(**flags):
        return RowParallelLinear(64 * world, 32, fp8=config, **flags)

    yield (
        "column, sequence parallel",
        column(sequence_parallel=True),
        lambda m, x: fastmesh.all_gather_matmul(x, [m.weight.t()], 0, fp8=config)[1][0] + m.bias,
        rows,
    )
    yield (
        "column",
        column(),
        lambda m, x: replicated_input_matmul(x, [m.weight], name, fp8=config)[0] + m.bias,
        lambda t: t,
    )
    yield (
        "row, sequence parallel",
        row(sequence_parallel=True),
        lambda m, x: fastmesh.matmul_reduce_scatter(x, m.weight.t(), 0, fp8=config) + m.bias,
        columns,
    )
    yield (
        "row",
        row(),
        lambda m, x: fastmesh.matmul_all_reduce(x, m.weight.t(), fp8=config) + m.bias,
        columns,
    )
    yield (
        "row, partial",
        row(reduce_results=False),
        lambda m, x: (
            replicated_input_matmul(x, [m.weight], name, fp8=config, reduce_input_grad=False)[0]
            + (m.bias if first else 0)
        ),
        columns,
    )


# Measured on 2 ranks (randn, K = 64 or 128 per rank, e4m3 forward; rowwise and mx): outputs 28-36 dB, FP8 input and
# weight gradients 21-33 dB (the high-precision backward parts are exact). A wrong shard or a missing term is around
# 0 dB.
FP8_FLOOR_DB = 18.0


@on_ranks(2)
def test_fp8_modules_run_the_fused_ops_fp8_forms():
    """Each module with fp8= equals the fused op's own FP8 form called directly (outputs and every gradient, bit for
    bit); its output differs from high precision's (FP8 really ran), and all track high precision above an SQNR
    floor."""
    world = dist.get_world_size()
    for granularity, backward_in_fp8 in itertools.product((FP8_GRANULARITY, "mx"), (True, False)):
        config = Float8Config(granularity=granularity, backward_in_fp8=backward_in_fp8)
        for label, module, direct, input_part in _fp8_runs(config, world):
            case = f"{label}, {granularity}, backward_in_fp8={backward_in_fp8}"
            torch.manual_seed(0)
            module.reset_parameters()
            with torch.no_grad():
                module.bias.copy_(_randn(module.bias.shape, seed=50))
            whole_in = module.in_features
            x = _randn((4 * world, 2, whole_in), seed=51)
            runs = {}
            for how in ("module", "direct", "high precision"):
                m = copy.deepcopy(module)
                if how == "high precision":
                    m.fp8 = None
                xs = input_part(x).clone().requires_grad_()
                y = m(xs)[0] if how != "direct" else direct(m, xs)
                g = _randn(y.shape, seed=52)  # the same on every rank: a replicated output's gradient
                (y * g).sum().backward()
                runs[how] = (y.detach(), xs.grad, m.weight.grad, m.bias.grad)
            for what, got, same, high in zip(
                ("output", "grad x", "grad weight", "grad bias"), runs["module"], runs["direct"], runs["high precision"]
            ):
                # The bias's gradient is the output gradient's sum over rows, whatever the matmul: the high-precision
                # module's (the direct calls leave a row-sharded or first-rank bias's partial).
                assert torch.equal(got, high if what == "grad bias" else same), f"{case}: {what}"
                if what == "output":
                    assert not torch.equal(got, high), f"{case}: the output equals high precision's"
                if what == "grad x":  # FP8 where the config says so (matmul_all_reduce's backward: always local)
                    high_dgrad = not backward_in_fp8 or label == "row"
                    assert torch.equal(got, high) == high_dgrad, f"{case}: grad x in FP8 is {not high_dgrad}"
                db = _sqnr_db(got, high)
                print(f"{case}: {what} {db:.1f} dB")
                assert db > FP8_FLOOR_DB, (case, what, db)


@on_ranks(2)
def test_fp8_gather_output_gathers_after_the_fp8_matmul_and_says_so():
    world = dist.get_world_size()
    config = Float8Config(granularity=FP8_GRANULARITY)
    torch.manual_seed(0)
    module = ColumnParallelLinear(64, 32 * world, gather_output=True, fp8=config)
    plain = copy.deepcopy(module)
    plain.gather_output = False
    x = _randn((3, 64), seed=60)
    _log.forget(lambda key: key == ("ColumnParallelLinear", "fp8 gather_output"))
    with captured_log("fastmesh.nn") as messages:
        y, _ = module(x)
        module(x)
    assert messages == [
        "ColumnParallelLinear: gather_output with fp8: the output's gather follows the FP8 matmul (no FP8 "
        "matmul_all_gather)"
    ]
    parts = [torch.empty(3, 32) for _ in range(world)]
    dist.all_gather(parts, plain(x)[0].detach())
    assert torch.equal(y.detach(), torch.cat(parts, -1))


# ---- state dicts and from_linear ----


@on_ranks(2)
def test_state_dicts_hold_shards_and_load_shards_full_tensors_or_dtensors():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = {"column": _int_linear(6, 8, True, seed=70), "row": _int_linear(8, 6, True, seed=72)}
    torch_styles = {"column": ColwiseParallel(), "row": RowwiseParallel()}
    for kind, cls, dims in (("column", ColumnParallelLinear, (0, 0)), ("row", RowParallelLinear, (1, None))):
        linear = full[kind]
        want = {"0.weight": _block(linear.weight.detach(), dims[0])}
        want["0.bias"] = linear.bias.detach() if dims[1] is None else _block(linear.bias.detach(), dims[1])
        model = nn.Sequential(cls(linear.in_features, linear.out_features))
        model.load_state_dict({f"0.{k}": v for k, v in linear.state_dict().items()})  # the full tensors
        state = model.state_dict()
        assert state.keys() == want.keys() and all(torch.equal(state[k], w) for k, w in want.items()), kind

        fresh = nn.Sequential(cls(linear.in_features, linear.out_features))
        fresh.load_state_dict(state)  # this rank's shards (a Megatron / vLLM sharded checkpoint)
        assert all(torch.equal(fresh.state_dict()[k], w) for k, w in want.items()), kind
        assert fresh[0].weight.tensor_model_parallel and fresh[0].weight.partition_dim == dims[0], kind

        native = parallelize_module(copy.deepcopy(linear), mesh, torch_styles[kind])  # DTensor shards
        replicated = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in linear.state_dict().items()}
        for dtensors in (native.state_dict(), replicated):  # this rank's shard taken, or the whole gathered
            fresh = nn.Sequential(cls(linear.in_features, linear.out_features, group=mesh))
            fresh.load_state_dict({f"0.{k}": v for k, v in dtensors.items()})
            assert all(torch.equal(fresh.state_dict()[k], w) for k, w in want.items()), kind

        local, whole = list(want["0.weight"].shape), [linear.out_features, linear.in_features]
        bad = dict(state, **{"0.weight": torch.zeros(7, 7)})
        message = (
            rf"0\.weight has shape \[7, 7\], expected this rank's shard \[{local[0]}, {local[1]}\] \(rank "
            rf"{dist.get_rank()} of a group of 2\) or the full tensor \[{whole[0]}, {whole[1]}\]"
        )
        with pytest.raises(RuntimeError, match=message):
            fresh.load_state_dict(bad)
        with pytest.raises(RuntimeError, match=message):  # not a missing key: the shape is what is wrong
            fresh.load_state_dict(bad, strict=False)
        with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"0\.bias\""):
            fresh.load_state_dict({"0.weight": state["0.weight"]})


@on_ranks(2)
def test_from_linear_copies_this_ranks_part():
    linear = _int_linear(6, 4, True, seed=80).double()
    linear.bias.requires_grad_(False)
    x = _ints((3, 6), seed=81).double()
    column = ColumnParallelLinear.from_linear(linear, gather_output=True)
    assert column.weight.dtype == torch.float64 and column.gather_output
    assert torch.equal(column.weight, _block(linear.weight.detach(), 0))
    assert column.weight.requires_grad and not column.bias.requires_grad
    assert column.weight.tensor_model_parallel and column.weight.partition_dim == 0
    assert torch.equal(column(x)[0], linear(x))
    row = RowParallelLinear.from_linear(linear, input_is_parallel=False)
    assert torch.equal(row.weight, _block(linear.weight.detach(), 1)) and torch.equal(row.bias, linear.bias)
    assert not hasattr(row.bias, "tensor_model_parallel")
    assert torch.equal(row(x)[0], linear(x))
    with pytest.raises(TypeError, match=r"linear must be an nn\.Linear, got Conv1d"):
        ColumnParallelLinear.from_linear(nn.Conv1d(2, 2, 1))
    with pytest.raises(TypeError, match="bias, dtype come"):
        RowParallelLinear.from_linear(linear, bias=False, dtype=torch.float32)


@on_ranks(2)
def test_group_forms_and_a_group_of_one():
    """A ProcessGroup, a 1-D DeviceMesh and None name the same group; a group of one runs nn.Linear's math."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    linear = _int_linear(6, 4, True, seed=90)
    x = _ints((4, 3, 6), seed=91)
    outs = []
    for group in (None, dist.group.WORLD, mesh):
        module = ColumnParallelLinear.from_linear(linear, group=group, sequence_parallel=True)
        assert (module.tp_size, module.tp_rank) == (2, rank)
        outs.append(module(_block(x, 0))[0])
    assert all(torch.equal(out, outs[0]) for out in outs)
    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    for flags in (dict(sequence_parallel=True), {}):
        column = ColumnParallelLinear.from_linear(linear, group=singles[rank], **flags)
        row = RowParallelLinear.from_linear(linear, group=singles[rank], **flags)
        assert column.tp_size == row.tp_size == 1
        assert torch.equal(column(x)[0], linear(x)) and torch.equal(row(x)[0], linear(x)), flags


# ---- errors ----


@on_ranks(2)
def test_bad_arguments_raise_errors_naming_them():
    build = [
        (lambda: ColumnParallelLinear(6, 5), ValueError, r"out_features=5 must be divisible by the group size 2"),
        (lambda: RowParallelLinear(5, 6), ValueError, r"in_features=5 must be divisible by the group size 2"),
        (lambda: ColumnParallelLinear(0, 4), ValueError, r"in_features must be >= 1, got 0"),
        (lambda: RowParallelLinear(4, 2.0), TypeError, r"out_features must be an int, got float"),
        (
            lambda: ColumnParallelLinear(6, 4, gather_output=True, sequence_parallel=True),
            ValueError,
            r"gather_output=True and sequence_parallel=True conflict",
        ),
        (
            lambda: RowParallelLinear(4, 6, input_is_parallel=False, sequence_parallel=True),
            ValueError,
            r"sequence_parallel=True needs input_is_parallel=True",
        ),
        (
            lambda: RowParallelLinear(4, 6, reduce_results=False, sequence_parallel=True),
            ValueError,
            r"reduce_results=False conflicts",
        ),
        (lambda: ColumnParallelLinear(6, 4, bias=1), TypeError, r"bias must be a bool, got int"),
        (lambda: RowParallelLinear(4, 6, sequence_dim=None), TypeError, r"sequence_dim must be an int, got NoneType"),
        (lambda: ColumnParallelLinear(6, 4, group=3), TypeError, r"group must be a ProcessGroup, a 1-D DeviceMesh"),
        (
            lambda: ColumnParallelLinear(6, 4, group=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))),
            ValueError,
            r"group must be a 1-D DeviceMesh \(the TP axis, e.g. mesh\['tp'\]\), got a 2-D mesh",
        ),
        (lambda: ColumnParallelLinear(6, 4, fp8="e4m3"), TypeError, r"fp8 must be a fastmesh.fp8.Float8Config"),
        (
            lambda: ColumnParallelLinear(48, 64, fp8=Float8Config(granularity="mx")),
            ValueError,
            r"ColumnParallelLinear: fp8 granularity 'mx' needs each rank's contraction \(in_features = 48\)",
        ),
        (
            lambda: RowParallelLinear(96, 64, fp8=Float8Config(granularity="mx")),
            ValueError,
            r"RowParallelLinear: fp8 granularity 'mx' needs each rank's contraction \(in_features / group size = 48\)",
        ),
        (
            lambda: RowParallelLinear(128, 6, fp8=Float8Config(), dtype=torch.float64),
            TypeError,
            r"RowParallelLinear: fp8= quantizes operands of dtype",
        ),
    ]
    for make, error, match in build:
        with pytest.raises(error, match=match):
            make()

    column = ColumnParallelLinear(6, 4, sequence_parallel=True)
    row = RowParallelLinear(8, 6, sequence_parallel=True, sequence_dim=1)
    last_dim = ColumnParallelLinear(6, 4, sequence_parallel=True, sequence_dim=-1)
    mx_dgrad = ColumnParallelLinear(64, 32, fp8=Float8Config(granularity="mx"))  # 16 columns per rank
    mx_dgrad(torch.ones(2, 64))  # no gradient to take: no FP8 dgrad, nothing to refuse
    mesh = init_device_mesh("cpu", (2,))
    forward = [
        (lambda: column(torch.ones(2, 3, 5)), ValueError, r"the input's last dim must be in_features=6, got shape"),
        (lambda: column([[1.0] * 6]), TypeError, r"the input must be a plain torch.Tensor, got <class 'list'>"),
        (
            lambda: row(torch.ones(2, 4, 8)),
            ValueError,
            r"last dim must be this rank's in_features / 2 = 4 \(input_is_parallel=True\), got shape \[2, 4, 8\]",
        ),
        (
            lambda: row(torch.ones(2, 3, 4)),
            ValueError,
            r"sequence_parallel scatters the output along sequence_dim=1, whose size 3 \(input shape \[2, 3, 4\]\) is "
            r"not divisible by the group size 2",
        ),
        (lambda: last_dim(torch.ones(2, 6)), ValueError, r"sequence_dim=-1 must name a sequence dim of the input"),
        (lambda: column(torch.ones(2, 3, 6, dtype=torch.float64)), (TypeError, RuntimeError), r"dtype"),
        (
            lambda: column(DTensor.from_local(torch.ones(2, 6), mesh, [Replicate()])),
            TypeError,
            r"the input must be a plain torch.Tensor, got a DTensor \(use fastmesh.parallel's styles",
        ),
        (
            lambda: mx_dgrad(torch.ones(2, 64, requires_grad=True)),
            ValueError,
            r"ColumnParallelLinear: fp8 granularity 'mx' with backward_in_fp8 needs the product's columns \(N = 16",
        ),
    ]
    for run, error, match in forward:
        with pytest.raises(error, match=match):
            run()

"""An FP8 tensor-parallel Llama block traced by AOTAutograd on fake CUDA tensors: fastmesh's Triton kernels
(``fastmesh::fp8_quantize`` is a ``torch.library.triton_op``) are in the forward graph *and* in the backward
graph, as ``triton_kernel_wrapper_functional`` nodes, next to the fused FP8 collectives. No GPU is needed. The MX
cast (``fastmesh::mx_quantize``, a ``triton_op`` as well) is traced alone the same way, and with
``FASTMESH_FP8_CUDA_IMPL=cuda``, where its graph calls the C++ op instead.

The block is the real one: ``fastmesh.testing.llama.Block`` parallelized with ``parallelize_module(block, mesh,
block_plan("fastmesh", fp8=Float8Config(...)))`` on a ``DeviceMesh("cuda")`` over torch's fake process group
(``FakeStore``, world size 2), its parameters DTensors of fake CUDA tensors. ``aot_function`` traces forward and
backward with capturing compilers (no inductor, nothing compiles).

Without a GPU, two things are stood in for, and only in the subprocess that traces (which also owns the fake
default process group, so the pytest process never has one):

* The autograd engine. On fake CUDA tensors ``FakeTensorMode`` swaps in a no-op CUDA device guard that reports one
  device, so the C++ engine (``GraphTask::stash_current_streams``) asks the CUDA hooks whether device 0 has a
  primary context, which raises without a GPU (pytorch/pytorch#92627: backward on fake CUDA needs a CUDA
  context). That hits AOTAutograd's joint trace (``torch.autograd.grad``) and the backward call alike. So
  :func:`grad_in_python` runs the same autograd nodes (the C++ formulas, and the custom Functions' ``backward``)
  in dependency order, as the engine does, and the trace patches ``torch.autograd.grad`` with it while AOTAutograd
  captures the joint graph. Partitioning into forward and backward graphs is AOTAutograd's own.
  :func:`test_grad_in_python_matches_the_engine` checks it against the engine on CPU.
* Triton's driver. Triton's mutation analysis of a wrapped kernel asks the active driver for its target; with no
  driver it warns and assumes every argument mutated. A stub driver naming an sm_90 target makes it exact.

The control, ``backward_in_fp8=False``, has no Triton kernel in its backward: the kernels found in the FP8
backward are the gradients' quantization (e5m2), not forward work the partitioner moved.
"""

from __future__ import annotations

import heapq
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

TP = 2
BATCH, SEQ = 2, 16  # the block input is this rank's sequence shard [BATCH, SEQ / TP, dim]

# Float8Config keywords per traced case (current scaling; the fused fronts take tensor-wise and row-wise).
CONFIGS = {
    "rowwise": {"granularity": "rowwise"},
    "tensorwise": {"granularity": "tensorwise"},
    "rowwise, backward not in fp8": {"granularity": "rowwise", "backward_in_fp8": False},
}

WRAPPER = "triton_kernel_wrapper_functional"
KERNEL_MODULE = "fastmesh.kernels.fp8_quantize"
# Tensors quantized per pass. Forward: each fused colwise call its input and weights (attention: x, wq, wk, wv;
# feed-forward: x, w1, w3), each rowwise call its input and weight (wo, w2). Backward, per fused call (the
# dgrad): the output gradient (e5m2) and the weights (e4m3, transposed).
QUANTIZED_FORWARD = 4 + 2 + 3 + 2
QUANTIZED_BACKWARD = 2 * 4
MX_KERNELS = {
    False: "fastmesh.kernels.mx_quantize._mx_flat_kernel",
    True: "fastmesh.kernels.mx_quantize._mx_transpose_kernel",
}
MX_ROWS, MX_COLS = 64, 256


# ---- the autograd engine's loop, in Python ----


def grad_in_python(outputs, inputs, grad_outputs=None, allow_unused=None, **unused):
    """``torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=...)`` without the C++ engine.

    Runs the nodes on a path from ``outputs`` to ``inputs`` (the engine's ``exec_info``) once all their
    gradients have arrived, highest sequence number first, as the engine's CPU ready queue does; sums the
    gradients a node receives per input slot and casts / sums-to-shape them to the slot's metadata (the
    engine's ``validate_outputs``). A custom Function's ``backward`` returns one gradient per forward argument;
    those of tensors that require grad map, in order, onto its edges that lead somewhere. Tensor hooks are
    not run (the block registers none). Undefined gradients go in as ``None``: a Function relying on
    materialized zeros would fail here, loudly, rather than differ silently.
    """
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if grad_outputs is None:
        grad_outputs = [torch.ones_like(out) for out in outputs]
    elif isinstance(grad_outputs, torch.Tensor):
        grad_outputs = [grad_outputs]
    targets = {}
    for i, t in enumerate(inputs):
        edge = torch.autograd.graph.get_gradient_edge(t)
        targets[(edge.node, edge.output_nr)] = i
    target_nodes = {node for node, _ in targets}
    result = [None] * len(inputs)
    buffers: dict = {}

    def send(node, slot, grad):
        if grad is None:
            return
        meta = node._input_metadata[slot]
        if grad.dtype != meta.dtype:
            grad = grad.to(meta.dtype)
        if list(grad.shape) != list(meta.shape):
            grad = grad.sum_to_size(meta.shape)
        slots = buffers.setdefault(node, {})
        slots[slot] = grad if slot not in slots else slots[slot] + grad

    roots = []
    for out, grad in zip(outputs, grad_outputs):
        edge = torch.autograd.graph.get_gradient_edge(out)
        send(edge.node, edge.output_nr, grad)
        roots.append(edge.node)

    # runs[node]: the node leads to an input, so it runs; an input's own node only collects its gradient.
    runs: dict = {}
    stack, seen = [(node, False) for node in roots], set()
    while stack:
        node, children_done = stack.pop()
        if children_done:
            runs[node] = any(n in target_nodes or runs[n] for n, _ in node.next_functions if n is not None)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in seen)
    wanted = {node for node, run in runs.items() if run or node in target_nodes}
    pending: dict = {}
    for node in wanted:
        if runs[node]:
            for n, _ in node.next_functions:
                if n in wanted:
                    pending[n] = pending.get(n, 0) + 1

    order = itertools.count()
    ready = [
        (-node._sequence_nr(), next(order), node)
        for node in dict.fromkeys(roots)
        if node in wanted and not pending.get(node)
    ]
    heapq.heapify(ready)
    while ready:
        node = heapq.heappop(ready)[2]
        slots = buffers.pop(node, {})
        grads = [slots.get(slot) for slot in range(len(node._input_metadata))]
        for slot, grad in enumerate(grads):
            if (node, slot) in targets:
                result[targets[(node, slot)]] = grad
        if not runs[node]:
            continue
        if hasattr(node, "_forward_cls"):  # a custom autograd.Function
            out = node.apply(*grads)
            out = out if isinstance(out, tuple) else (out,)
            out = [grad for grad, needed in zip(out, node.needs_input_grad) if needed]
            edges = [edge for edge in node.next_functions if edge[0] is not None]
        else:
            out = node(*grads)
            out = out if isinstance(out, tuple) else (out,)
            edges = list(node.next_functions)
        assert len(out) == len(edges), f"{node.name()}: {len(out)} gradients for {len(edges)} edges"
        for grad, (n, slot) in zip(out, edges):
            if n not in wanted:
                continue
            send(n, slot, grad)
            pending[n] -= 1
            if pending[n] == 0:
                heapq.heappush(ready, (-n._sequence_nr(), next(order), n))
    assert not any(pending.values()), "some nodes on the way to the inputs never ran"
    if not allow_unused and any(grad is None for grad in result):
        raise RuntimeError("grad_in_python: an input was not used in the graph (pass allow_unused=True)")
    return tuple(result)


@contextmanager
def autograd_grad_in_python():
    """``torch.autograd.grad`` is :func:`grad_in_python` (AOTAutograd's joint trace calls it by that name)."""
    engine_grad = torch.autograd.grad
    torch.autograd.grad = grad_in_python
    try:
        yield
    finally:
        torch.autograd.grad = engine_grad


def test_grad_in_python_matches_the_engine():
    # A Llama block's parts (attention with RoPE and SDPA, SwiGLU, RMSNorm) and a custom Function with
    # non-tensor arguments on both sides of its tensors, an unused output, a gradient returned for a tensor
    # that needs none, one in another dtype and one of a broadcast shape (the engine casts and sums them), and
    # inputs used twice (gradients summed), a non-leaf input among them.
    from fastmesh.testing.llama import Block, LlamaArgs, rope_tables

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, factor, a, name, b, c, bias, power):
            ctx.save_for_backward(a, b)
            ctx.factor = factor
            ctx.set_materialize_grads(False)
            return a * b * factor + c + bias, (a**power).sum(-1)

        @staticmethod
        def backward(ctx, grad, grad_unused):
            assert grad_unused is None
            a, b = ctx.saved_tensors
            return None, (grad * b * ctx.factor).float(), None, grad * a * ctx.factor, grad, grad, None

    torch.manual_seed(0)
    args = LlamaArgs()
    block = Block(args).double()
    rope = rope_tables(SEQ, args.head_dim, args.rope_theta)
    x = torch.randn(BATCH, SEQ, args.dim, dtype=torch.float64, requires_grad=True)
    c = torch.randn(args.dim, dtype=torch.float64)
    bias = torch.randn(args.dim, dtype=torch.float64, requires_grad=True)
    h = x * 2  # a non-leaf input
    y, _ = Scaled.apply(0.5, block(h, rope), "name", h, c, bias, 2)
    loss_terms = [y, y.sum(-1, keepdim=True) * x]
    grad_outputs = [torch.randn_like(t) for t in loss_terms]
    inputs = [x, h, bias, *block.parameters()]
    expected = torch.autograd.grad(loss_terms, inputs, grad_outputs, retain_graph=True)
    actual = grad_in_python(loss_terms, inputs, grad_outputs)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


# ---- the traced block (in a subprocess) ----


def _skip_reason() -> str | None:
    if torch.version.cuda is None:
        return (
            "needs a CUDA build of torch: the op takes its Triton branch on CUDA tensors (fake ones here), "
            f"and torch {torch.__version__} has no CUDA"
        )
    if importlib.util.find_spec("triton") is None:
        return "needs triton: the CUDA branch of fastmesh::fp8_quantize wraps Triton kernels"
    if not torch.distributed.is_available():
        return "needs torch.distributed (a fake process group names the TP group)"
    return None


def _use_stub_triton_driver() -> None:
    """An sm_90 target for Triton's mutation analysis of wrapped kernels (this machine has no driver)."""
    import triton
    from triton.backends.compiler import GPUTarget

    class StubDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(StubDriver())


def _triton_kernels(graph_module) -> list[str]:
    """``module.name`` of the Triton kernel each ``triton_kernel_wrapper_functional`` node launches."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []
    for node in graph_module.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            while hasattr(kernel, "fn"):  # Autotuner -> JITFunction -> the Python function
                kernel = kernel.fn
            names.append(f"{kernel.__module__}.{kernel.__qualname__}")
    return names


def _trace_block(mesh, config) -> dict:
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.parallel import parallelize_module

    from fastmesh.testing.llama import Block, LlamaArgs, block_plan, rope_tables

    graphs = {}

    def capture(kind):
        def compiler(graph_module, example_inputs):
            graphs[kind] = graph_module
            return make_boxed_func(graph_module)

        return compiler

    args = LlamaArgs()
    with FakeTensorMode():
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # Module.to() cannot swap fake parameters
        try:
            with torch.device("cuda"):
                block = Block(args)
        finally:
            torch.set_default_dtype(default_dtype)
        parallelize_module(block, mesh, block_plan("fastmesh", fp8=config))
        params = dict(block.named_parameters())
        rope = rope_tables(SEQ, args.head_dim, args.rope_theta, device="cuda")
        x = torch.randn(BATCH, SEQ // TP, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(params, x, rope):
            return torch.func.functional_call(block, params, (x, rope))

        compiled = aot_function(step, fw_compiler=capture("forward"), bw_compiler=capture("backward"))
        with autograd_grad_in_python():
            out = compiled(params, x, rope)
        inputs = [x, *params.values()]
        # The backward graph is compiled when the backward first runs.
        grads = grad_in_python([out], inputs, [torch.ones_like(out)])
    assert out.shape == (BATCH, SEQ // TP, args.dim) and out.device.type == "cuda", (out.shape, out.device)
    for t, grad in zip(inputs, grads, strict=True):
        assert grad is not None and grad.shape == t.shape and type(grad) is type(t), (t.shape, grad)
    assert set(graphs) == {"forward", "backward"}, set(graphs)
    return {kind: {"code": gm.code, "kernels": _triton_kernels(gm)} for kind, gm in graphs.items()}


def _trace_mx_cast() -> dict:
    """``fastmesh::mx_quantize`` on a fake CUDA x, traced by AOTAutograd (an inference graph: x needs no grad)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastmesh import settings

    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module)

    results = {}
    with FakeTensorMode():
        x = torch.randn(MX_ROWS, MX_COLS, device="cuda", dtype=torch.bfloat16)
        for impl, transpose in itertools.product(("triton", "cuda"), (False, True)):
            graphs.clear()
            os.environ["FASTMESH_FP8_CUDA_IMPL"] = impl
            settings.reload()

            def cast(t, transpose=transpose):
                return torch.ops.fastmesh.mx_quantize(t, torch.float8_e4m3fn, "rceil", transpose)

            out = aot_function(cast, fw_compiler=capture)(x)
            assert len(graphs) == 1, len(graphs)
            results[f"{impl} transpose={transpose}"] = {
                "code": graphs[0].code,
                "kernels": _triton_kernels(graphs[0]),
                "shapes": [[str(t.dtype), list(t.shape), t.device.type] for t in out],
            }
    os.environ["FASTMESH_FP8_CUDA_IMPL"] = "triton"
    settings.reload()
    return results


def _trace_all(out_path: str) -> None:
    """Subprocess entry: trace every case on a fake 2-rank CUDA mesh; write the graphs' code and kernels."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fastmesh.fp8 import Float8Config

    _use_stub_triton_driver()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        mesh = init_device_mesh("cuda", (TP,))
        results = {name: _trace_block(mesh, Float8Config(**kwargs)) for name, kwargs in CONFIGS.items()}
        results["mx cast"] = _trace_mx_cast()
    finally:
        dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out_path = tmp_path_factory.mktemp("compile_triton") / "graphs.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", FASTMESH_FP8_CUDA_IMPL="triton")
    proc = subprocess.run(
        [sys.executable, __file__, str(out_path)], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(f"tracing subprocess failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out_path.read_text())


def _assert_no_opaque_quantize(code: str) -> None:
    assert "fp8_quantize_native" not in code  # the CPU C++ op
    assert "fastmesh.fp8_quantize.default" not in code  # the triton_op is traced into its kernels


@pytest.mark.parametrize("case", ["rowwise", "tensorwise"])
def test_fp8_block_graphs_hold_fastmesh_triton_kernels(traced, case):
    forward, backward = traced[case]["forward"], traced[case]["backward"]
    for kind, graph in (("forward", forward), ("backward", backward)):
        assert WRAPPER in graph["code"], f"{kind} graph has no {WRAPPER}"
        assert graph["kernels"], f"{kind} graph launches no Triton kernel"
        assert {name.rpartition(".")[0] for name in graph["kernels"]} == {KERNEL_MODULE}, graph["kernels"]
        _assert_no_opaque_quantize(graph["code"])
        # Forward: colwise gather (FP8 a travels) and rowwise scatter; backward: the dgrads, in FP8 too.
        assert "fastmesh.all_gather_scaled_matmul" in graph["code"], kind
        assert "fastmesh.scaled_matmul_reduce_scatter" in graph["code"], kind
    # Every quantization is there: the same number of kernels for each quantized tensor, in both passes.
    per_tensor, rest = divmod(len(forward["kernels"]), QUANTIZED_FORWARD)
    assert per_tensor >= 1 and rest == 0, forward["kernels"]
    assert len(backward["kernels"]) == per_tensor * QUANTIZED_BACKWARD, (per_tensor, backward["kernels"])
    # Activations and weights quantize to e4m3 in both passes; only the backward quantizes gradients, to e5m2.
    assert "torch.float8_e4m3fn" in forward["code"] and "torch.float8_e4m3fn" in backward["code"]
    assert "torch.float8_e5m2" not in forward["code"]
    assert "torch.float8_e5m2" in backward["code"]


def test_backward_not_in_fp8_has_no_triton_kernels(traced):
    # The control: with the backward in bf16 the forward is unchanged and the backward launches no Triton
    # kernel, so those found above come from the FP8 backward, not from forward work moved by the partitioner.
    control = traced["rowwise, backward not in fp8"]
    forward, backward = control["forward"], control["backward"]
    assert forward["kernels"] == traced["rowwise"]["forward"]["kernels"]
    assert WRAPPER not in backward["code"] and not backward["kernels"]
    # FP8 in this backward only as the FP8 shard saved in forward, gathered again (as bytes) and dequantized for the
    # weights' gradients: no quantization.
    assert "_c10d_functional.all_gather_into_tensor" in backward["code"]
    _assert_no_opaque_quantize(backward["code"])
    assert "fastmesh.matmul_reduce_scatter.default" in backward["code"]
    assert "fastmesh.all_gather_matmul.default" in backward["code"]


def test_mx_cast_graph_holds_its_triton_kernel(traced):
    # fastmesh::mx_quantize is a triton_op too: on CUDA its Triton kernel (the flat one; with transpose the tile
    # kernel) is in the graph, not the C++ op; with FASTMESH_FP8_CUDA_IMPL=cuda the graph calls the C++ op instead.
    e4m3, e8m0 = str(torch.float8_e4m3fn), str(torch.float8_e8m0fnu)
    scale = [e8m0, [MX_ROWS, MX_COLS // 32], "cuda"]
    for impl, transpose in itertools.product(("triton", "cuda"), (False, True)):
        graph = traced["mx cast"][f"{impl} transpose={transpose}"]
        if impl == "triton":
            assert graph["kernels"] == [MX_KERNELS[transpose]], graph["kernels"]
            assert WRAPPER in graph["code"] and "mx_quantize_native" not in graph["code"]
        else:
            assert not graph["kernels"] and WRAPPER not in graph["code"]
            assert "fastmesh.mx_quantize_native.default" in graph["code"]
        assert "fastmesh.mx_quantize.default" not in graph["code"]
        data_t = [[e4m3, [MX_COLS, MX_ROWS], "cuda"], [e8m0, [MX_COLS, MX_ROWS // 32], "cuda"]]
        empty = [[e4m3, [0], "cuda"], [e8m0, [0], "cuda"]]
        expected = [[e4m3, [MX_ROWS, MX_COLS], "cuda"], scale, [str(torch.float32), scale[1], "cuda"]]
        assert graph["shapes"] == expected + (data_t if transpose else empty), graph["shapes"]


if __name__ == "__main__":
    _trace_all(sys.argv[1])

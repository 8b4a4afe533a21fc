"""Each op's spec (fastmesh/ops/_library.py) against the parts that serve it: an op added to the specs but missing
from the library, the C++ kernels, the planner, autograd, autocast, the unfused traces, the compile pass or the
benchmarks fails here, and so does a part that serves an op its spec does not name."""

from __future__ import annotations

import ast
import importlib
import pathlib

import torch
from fastmesh.bench import fused_collectives, host

import fastmesh
from fastmesh import _cpp_lib
from fastmesh.ops import plans, traced_unfused
from fastmesh.ops._library import NAMESPACE, SPECS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _names(predicate) -> set[str]:
    return {spec.name for spec in SPECS if predicate(spec)}


def _kernel_source(op: str, key: str) -> str | None:
    """Where the dispatcher's kernel of ``fastmesh::op`` for ``key`` was registered (None: no kernel)."""
    for line in torch._C._dispatch_dump_table(f"{NAMESPACE}::{op}").splitlines():
        if line.startswith(f"{key}:") and "registered at" in line:
            return line.split("registered at ")[1]
    return None


def test_every_op_is_defined_with_its_schema():
    for spec in SPECS:
        schema = str(getattr(torch.ops.fastmesh, spec.name).default._schema)
        assert schema == f"{NAMESPACE}::{spec.name}{spec.signature}", (spec.name, schema)
        module = importlib.import_module(spec.module)
        assert module.__name__ == spec.module
    defined = {
        name
        for name in dir(torch.ops.fastmesh)
        if isinstance(getattr(torch.ops.fastmesh, name), torch._ops.OpOverloadPacket)
    }
    assert defined == {spec.name for spec in SPECS}, defined ^ {spec.name for spec in SPECS}


def test_planned_ops_have_the_c_kernels_and_a_planned_run():
    planned = _names(lambda s: s.planned)
    assert set(_cpp_lib.load().planned_op_names()) == planned
    assert set(plans._planned_runs) == planned
    for op in planned:
        for key in ("CPU", "CUDA"):
            assert "csrc/fused/kernels.cpp" in (_kernel_source(op, key) or ""), (op, key)


def test_autograd_where_the_spec_says():
    for spec in SPECS:
        source = _kernel_source(spec.name, "AutogradCPU") or ""
        assert ("csrc/fused/autograd.cpp" in source) == (spec.autograd == "cpp"), (spec.name, source)


def test_autocast_kernels_where_the_spec_says():
    for spec in SPECS:
        source = _kernel_source(spec.name, "AutocastCPU") or ""  # a kernel of the op's own, not autocast's fallback
        assert source.endswith("[kernel]") == spec.autocast, (spec.name, source)


def test_unfused_traces_where_the_spec_says():
    assert set(traced_unfused._traces) == _names(lambda s: s.traced)


def _ops_named_in(path: pathlib.Path) -> set[str]:
    """The fastmesh ops a module's code names: ``torch.ops.fastmesh.NAME`` (or an alias of ``torch.ops.fastmesh``)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in {s.name for s in SPECS}:
            value = node.value
            chain = ast.unparse(value)
            if chain.endswith("fastmesh") or chain.endswith("fastmesh_ops"):
                named.add(node.attr)
    return named


def test_the_compile_pass_produces_what_the_spec_says():
    produced = _ops_named_in(ROOT / "fastmesh" / "compile" / "rewrite.py")
    assert produced == _names(lambda s: s.compile_pass), produced ^ _names(lambda s: s.compile_pass)


def test_the_benchmarks_time_every_fused_op():
    assert set(host.CASES) == _names(lambda s: s.host_bench)
    benched = {op.removeprefix(f"{NAMESPACE}::") for kind in fused_collectives._KINDS.values() for op in kind.FUSED_OPS}
    assert benched == _names(lambda s: s.planned), benched ^ _names(lambda s: s.planned)


def test_every_front_exists():
    for spec in SPECS:
        if spec.front:
            path = spec.front.split("(")[0].split(".")[1:]
            target = fastmesh
            for part in path:
                target = getattr(target, part)
            assert callable(target), spec.front

"""`fastmesh info`: reports what the dispatcher and the build hold; exit code says whether usable."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fastmesh
from fastmesh import _cpp_lib, info, settings
from fastmesh.ops.plan_cache import PlanCache
from fastmesh.version import TESTED_TORCH


def run_cli(*args, env=None, prelude=""):
    code = f"import sys\n{prelude}\nfrom fastmesh.__main__ import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


@pytest.mark.smoke
def test_json_report_matches_dispatcher():
    result = run_cli("info", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["usable"] and report["problems"] == []
    assert report["fastmesh"] == fastmesh.__version__
    assert report["torch"]["version"] == torch.__version__
    # Every torch this suite runs under (CI's three legs) is one the report calls tested.
    assert report["torch"]["tested"] is (torch.__version__.split("+")[0].rsplit(".", 1)[0] in TESTED_TORCH)
    assert report["torch"]["tested"], f"torch {torch.__version__} is not in fastmesh.version.TESTED_TORCH"
    assert report["extension"]["loaded"]
    build = report["extension"]["build_info"]
    assert build["torch_version"] == torch.__version__
    assert "csrc/cpu/amax.cpp" in build["sources"]
    assert ("csrc/cuda/amax.cu" in build["sources"]) == build["build_cuda"]
    assert "fastmesh::amax" in report["ops"]
    for op, keys in report["ops"].items():
        for key in ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd", "Autograd"):
            assert (key in keys) == torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)
    # C++ ops: their own CPU (and, when built, CUDA) kernels; the triton_op: one body for every device.
    assert "CPU" in report["ops"]["fastmesh::fp8_quantize_native"]
    assert ("CUDA" in report["ops"]["fastmesh::fp8_quantize_native"]) == build["build_cuda"]
    assert "CompositeExplicitAutograd" in report["ops"]["fastmesh::fp8_quantize"]


def test_console_script_and_module_agree():
    # Both entry points the README documents; the console script is what `pip install` put on PATH.
    module = subprocess.run([sys.executable, "-m", "fastmesh", "info"], capture_output=True, text=True, timeout=300)
    assert module.returncode == 0, module.stdout + module.stderr
    assert "status          usable" in module.stdout
    assert "fastmesh::amax" in module.stdout
    script = os.path.join(os.path.dirname(sys.executable), "fastmesh")
    if os.path.exists(script):
        scripted = subprocess.run([script, "info"], capture_output=True, text=True, timeout=300)
        assert scripted.returncode == 0 and "fastmesh::amax" in scripted.stdout


def test_missing_extension_is_explained_and_fails():
    result = run_cli("info", prelude="sys.modules['fastmesh._C'] = None  # as if never built")
    assert result.returncode == 1, result.stdout
    assert "fastmesh._C     NOT LOADED: fastmesh._C is not built" in result.stdout
    assert "pip install --no-build-isolation -e ." in result.stdout
    assert "NOT USABLE" in result.stdout
    # Import still works and warns once instead of failing deep inside a stack.
    assert "RuntimeWarning: fastmesh kernels are unavailable" in result.stderr


def test_front_raises_extension_error_when_kernels_missing():
    code = (
        "import sys, warnings; sys.modules['fastmesh._C'] = None\n"
        "warnings.simplefilter('ignore')\nimport torch, fastmesh\n"
        "try:\n    fastmesh.amax(torch.ones(3))\nexcept fastmesh.ExtensionError as e:\n    print('ERR', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "ERR fastmesh._C is not built" in result.stdout, result.stdout + result.stderr


def test_report_text_lists_sections():
    text = info.format_report(info.collect())
    for heading in (
        "fastmesh ",
        "torch ",
        "triton ",
        "fastmesh._C ",
        "ops (dispatch keys",
        "CUDA ",
        "distributed ",
        "symmetric mem ",
        "CUDA all-gather ",
        "CPU matmul ",
        "plan choice ",
        "plan cache ",
        "status ",
    ):
        assert heading in text, heading


def test_reports_whether_the_cpu_multiplies_half_precision_natively(monkeypatch):
    report = info.cpu_matmul()
    assert report["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(report["gflops"]) == {"float32", "bfloat16", "float16"} and min(report["gflops"].values()) > 0
    for name in ("bfloat16", "float16"):
        assert (info.half_precision_note(name) is None) == report["native"][name], name
    # An emulated dtype, as on AVX2: the note says how much slower, and the text marks it.
    emulated = {**report, "gflops": {"float32": 60.0, "bfloat16": 1.0, "float16": 30.0}}
    emulated["native"] = {"bfloat16": False, "float16": True}
    monkeypatch.setattr(info, "cpu_matmul", lambda: emulated)
    assert info.half_precision_note("float16") is None
    assert "no native bfloat16 matmul: 1.0 GFLOP/s on one thread, 60x slower than float32" in info.half_precision_note(
        "bfloat16"
    )
    assert "bfloat16 1.0 (emulated), float16 30.0" in info.format_report({**info.collect(), "cpu_matmul": emulated})


def test_loaded_build_info_is_the_compiled_metadata():
    build = _cpp_lib.build_info()
    assert build["mode"] in ("setup", "jit")
    assert build["python_version"] == sys.version.split()[0]
    assert build["cxx_flags"] and isinstance(build["sources"], list)


def test_reports_the_cuda_all_gather_path(monkeypatch):
    """Which path all_gather_matmul takes on CUDA under the current settings, and a bad setting as a problem."""
    monkeypatch.delenv("FASTMESH_CUDA_CONSUMER_GEMM", raising=False)
    monkeypatch.delenv("FASTMESH_CONSUMER_FREE_SMS", raising=False)
    settings.reload()
    assert (
        "CUDA all-gather the pipelined decomposition (the Triton consumer GEMM is opt-in: "
        "FASTMESH_CUDA_CONSUMER_GEMM=1)" in info.format_report(info.collect())
    )
    monkeypatch.setenv("FASTMESH_CUDA_CONSUMER_GEMM", "1")
    monkeypatch.setenv("FASTMESH_CONSUMER_FREE_SMS", "24")
    settings.reload()
    assert (
        "the Triton consumer GEMM where it applies (FASTMESH_CUDA_CONSUMER_GEMM=1; 24 SMs left to the "
        "transfer)" in info.format_report(info.collect())
    )
    monkeypatch.setenv("FASTMESH_CONSUMER_FREE_SMS", "0")
    settings.reload()
    report = info.collect()
    assert not report["usable"]
    assert (
        report["problems"][0] == "FASTMESH_CONSUMER_FREE_SMS must be an int >= 1 (SMs kept free for the "
        "transfers), got '0'"
    )


def test_reports_the_plan_choice_and_the_plan_cache(monkeypatch, tmp_path):
    """FASTMESH_TUNE (a bad value is a problem) and the plan cache: its path, this machine's plans, its sections."""
    path = tmp_path / "plans.json"
    monkeypatch.setenv("FASTMESH_TUNE_CACHE", str(path))
    monkeypatch.delenv("FASTMESH_TUNE", raising=False)
    settings.reload()
    report = info.collect()
    assert report["tuning"] == {
        "mode": "model",
        "env": None,
        "error": None,
        "cache": {
            "path": str(path),
            "exists": False,
            "section": PlanCache().section,
            "entries": 0,
            "sections": 0,
            "unreadable": None,
        },
    }
    text = info.format_report(report)
    assert "plan choice     FASTMESH_TUNE=model (the default)" in text
    assert f"plan cache      {path}: not written yet" in text

    here, elsewhere = PlanCache(str(path)), PlanCache(str(path), section="another-machine")
    here.store("key-1", {"split": "rows", "pieces": 2})
    here.store("key-2", {"split": "none", "pieces": 1})
    elsewhere.store("key-1", {"split": "rows", "pieces": 4})
    monkeypatch.setenv("FASTMESH_TUNE", "measure")
    settings.reload()
    report = info.collect()
    assert report["usable"], report["problems"]
    assert report["tuning"]["mode"] == "measure" and report["tuning"]["cache"]["exists"]
    assert (report["tuning"]["cache"]["entries"], report["tuning"]["cache"]["sections"]) == (2, 2)
    text = info.format_report(report)
    assert "plan choice     FASTMESH_TUNE=measure\n" in text
    assert f"plan cache      {path}: 2 plan(s) for this machine (section {here.section}), 2 section(s)" in text

    path.write_text("not json")
    report = info.collect()
    assert report["usable"]  # the ops ignore an unreadable cache (the cost model decides): worth a line, not a problem
    assert report["tuning"]["cache"]["unreadable"].startswith(f"fastmesh: ignoring the plan cache {path} (")

    monkeypatch.setenv("FASTMESH_TUNE", "fast")
    settings.reload()
    report = info.collect()
    assert not report["usable"]
    assert report["problems"] == ["FASTMESH_TUNE must be one of off, model, measure, got 'fast'"]
    assert (
        "plan choice     INVALID: FASTMESH_TUNE must be one of off, model, measure, got 'fast'"
        in info.format_report(report)
    )

"""The extension loader's diagnosis of stale, mismatched and missing builds, and the JIT path."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fastmesh import _build_config, _cpp_lib, settings


def build_info(**overrides):
    return {**_cpp_lib.build_info(), **overrides}


def test_current_build_passes_checks():
    _cpp_lib._check_build_info(build_info())


def test_metadata_is_read_from_the_binary_without_loading_it():
    binary = _cpp_lib.load().__file__
    assert _build_config.read_embedded_build_info(binary) == _cpp_lib.build_info()


def test_other_torch_is_an_abi_error():
    with pytest.raises(_cpp_lib.ExtensionError, match=r"built against torch 2\.0\.0 but torch .* is running"):
        _cpp_lib._check_build_info(build_info(torch_version="2.0.0"))


def test_changed_sources_are_stale(monkeypatch):
    if not os.path.isdir(_build_config.csrc_dir()):
        pytest.skip("installed without a source checkout: nothing to be stale against")
    monkeypatch.delenv("FASTMESH_ALLOW_STALE", raising=False)
    settings.reload()
    with pytest.raises(_cpp_lib.ExtensionError, match=r"stale: sources under .*csrc changed.*pip install"):
        _cpp_lib._check_build_info(build_info(source_digest="0" * 64))
    monkeypatch.setenv("FASTMESH_ALLOW_STALE", "1")
    settings.reload()
    _cpp_lib._check_build_info(build_info(source_digest="0" * 64))


def test_undefined_symbol_is_explained(monkeypatch):
    def broken_import(name):
        raise ImportError(f"{name}: undefined symbol: _ZN3c104impl8GPUTrace")

    monkeypatch.setattr(_cpp_lib.importlib, "import_module", broken_import)
    with pytest.raises(_cpp_lib.ExtensionError, match=r"built against a different torch.*pip install --no-build"):
        _cpp_lib._import_installed()


@pytest.mark.slow  # compiles every C++ source: ~3 minutes on 2 cores
def test_jit_build_compiles_sources_into_cache(tmp_path):
    if not os.path.isdir(_build_config.csrc_dir()):
        pytest.skip("the JIT path needs a source checkout")
    code = (
        "import json, torch, fastmesh\nfrom fastmesh import _cpp_lib\n"
        "print(json.dumps({'info': _cpp_lib.build_info(), 'amax': fastmesh.amax(torch.tensor([2.0, -5.0])).item(),"
        " 'file': _cpp_lib.load().__file__}))"
    )
    env = {**os.environ, "FASTMESH_JIT": "1", "FASTMESH_JIT_CACHE": str(tmp_path), "FASTMESH_BUILD_CUDA": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["amax"] == 5.0
    assert report["info"]["mode"] == "jit" and not report["info"]["build_cuda"]
    assert report["file"].startswith(str(tmp_path))
    assert report["info"]["source_digest"] == _build_config.source_digest()


@pytest.mark.skipif(not os.path.isdir(_build_config.csrc_dir()), reason="build plans list the sources of a checkout")
class TestBuildPlan:
    def test_wrapper_nvcc_is_not_a_toolkit(self, tmp_path, monkeypatch):
        wrapper = tmp_path / "wrapper"
        (wrapper / "bin").mkdir(parents=True)
        (wrapper / "bin" / "nvcc").write_text("#!/bin/sh\n")
        toolkit = tmp_path / "toolkit"
        (toolkit / "bin").mkdir(parents=True)
        (toolkit / "include").mkdir()
        (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (toolkit / "bin" / "nvcc").chmod(0o755)
        (toolkit / "include" / "cuda_runtime.h").write_text("")
        monkeypatch.setenv("CUDA_HOME", str(wrapper))
        monkeypatch.delenv("CUDA_PATH", raising=False)
        monkeypatch.setenv("PATH", f"{toolkit / 'bin'}{os.pathsep}{os.environ['PATH']}")
        assert _build_config.find_cuda_home() == str(toolkit)

    def test_forced_off(self, monkeypatch):
        monkeypatch.setenv("FASTMESH_BUILD_CUDA", "0")
        plan = _build_config.plan_build()
        assert not plan.build_cuda and plan.reason == "skipping CUDA sources: FASTMESH_BUILD_CUDA=0"
        assert plan.sources and not any(s.endswith(".cu") for s in plan.sources)

    def test_forced_on_without_cuda_torch_fails(self, monkeypatch):
        monkeypatch.setenv("FASTMESH_BUILD_CUDA", "1")
        monkeypatch.setattr(torch.version, "cuda", None)
        with pytest.raises(RuntimeError, match=r"FASTMESH_BUILD_CUDA=1 but torch .* is not a CUDA build"):
            _build_config.plan_build()

    def test_cpu_torch_skips_with_reason(self, monkeypatch):
        monkeypatch.delenv("FASTMESH_BUILD_CUDA", raising=False)
        monkeypatch.setattr(torch.version, "cuda", None)
        plan = _build_config.plan_build()
        assert not plan.build_cuda and "is not a CUDA build" in plan.reason

    def test_bad_flag_value(self, monkeypatch):
        monkeypatch.setenv("FASTMESH_BUILD_CUDA", "yes")
        with pytest.raises(ValueError, match=r"FASTMESH_BUILD_CUDA must be 0 or 1, got 'yes'"):
            _build_config.plan_build()

    def test_default_arch_list_without_gpu(self, monkeypatch):
        if torch.version.cuda is None or _build_config.find_cuda_home() is None or torch.cuda.is_available():
            pytest.skip("needs a CUDA torch, a toolkit and no visible GPU")
        monkeypatch.delenv("FASTMESH_BUILD_CUDA", raising=False)
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")
        plan = _build_config.plan_build()
        assert plan.build_cuda and plan.cuda_arch_list == "8.0;9.0a"
        assert any(s.endswith(".cu") for s in plan.sources)
        assert set(_build_config.pip_cuda_include_dirs()) <= set(plan.include_dirs)

    def test_build_info_header_roundtrips(self):
        plan = _build_config.plan_build()
        header = _build_config.build_info_header(plan)
        payload = header.split('R"fmbuild(', 1)[1].split(')fmbuild"', 1)[0]
        assert _build_config.parse_build_info(payload)["sources"] == plan.sources

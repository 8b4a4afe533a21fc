"""Session setup shared by all fastmesh tests."""

import os
import shutil
import sys
import tempfile

# Under --import-mode=importlib pytest does not put this directory on sys.path; the harness and
# the rank processes (which import test modules by name) need it there.
sys.path.insert(0, os.path.dirname(__file__))

import pytest
import rank_pool
import triton_interpreter
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

_inductor_cache_dir = None


def pytest_configure(config):
    global _inductor_cache_dir
    # AOTAutograd keys a triton_op by its Triton source only, not by its Python body, so a cache
    # from an earlier run can replay stale graphs. Each run gets a fresh one, and so do its
    # rank processes, which inherit this environment.
    _inductor_cache_dir = tempfile.mkdtemp(prefix="fastmesh-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache_dir
    # One inductor compile worker per process: the tests' processes (ranks, launched benchmarks) share the cores,
    # and a pool of workers per process oversubscribes them (measured 39 s against 30 s for one compile, 2 ranks).
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # Plans measured on an earlier run (or by the user) must not steer the tests: an empty cache of their own.
    os.environ["FASTMESH_TUNE_CACHE"] = os.path.join(_inductor_cache_dir, "fastmesh-plans.json")
    # Hypothesis stores nothing in the checkout or the working directory (CI's CPU-only phase runs from /): its
    # example database and whatever else it keeps go under this run's temporary directory.
    hypothesis_dir = os.path.join(_inductor_cache_dir, "hypothesis")
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = hypothesis_dir
    settings.register_profile(
        "fastmesh", database=DirectoryBasedExampleDatabase(os.path.join(hypothesis_dir, "examples"))
    )
    settings.load_profile("fastmesh")
    _reload_fastmesh_settings()


def _reload_fastmesh_settings():
    from fastmesh import settings as fastmesh_settings

    fastmesh_settings.reload()


@pytest.fixture(autouse=True)
def _fastmesh_settings_follow_the_environment():
    """fastmesh reads its settings once (fastmesh.settings): a test that changes them in this process reloads them
    itself (tests/environment.py does), and they are read again once it ends, when monkeypatch has restored the
    environment."""
    yield
    _reload_fastmesh_settings()


def pytest_collection_finish(session):
    triton_interpreter.start_in_background(
        item.path for item in session.items if item.get_closest_marker(triton_interpreter.MARK)
    )


def pytest_unconfigure(config):
    triton_interpreter.stop_background()
    rank_pool.close_pools()
    shutil.rmtree(_inductor_cache_dir, ignore_errors=True)

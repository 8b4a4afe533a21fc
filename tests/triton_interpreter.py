"""Running a Triton test module under ``TRITON_INTERPRET=1`` from a plain pytest run.

``@triton.jit`` picks the interpreter when a kernel is defined, so a pytest process that may already have
imported the kernels cannot switch it on: the kernel tests of such a module skip in the plain run, and one
test of the module runs the whole module again in a child process with the interpreter on.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_module_under_interpreter(test_file: str, timeout_s: float = 600) -> None:
    """Run ``test_file`` with ``TRITON_INTERPRET=1`` in a child pytest; fail with its output unless it passes."""
    if INTERPRETED:
        pytest.skip("already running under TRITON_INTERPRET=1")
    # One intra-op thread: the interpreter is single-threaded numpy, the tensors are small, and on a
    # busy 2-core machine torch's OpenMP threads made the comparisons several times slower.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEP", str(pathlib.Path(test_file))]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the TRITON_INTERPRET=1 run timed out:\n{(error.stdout or '')[-6000:]}")
    output = done.stdout + done.stderr
    print(output[-12000:])
    if done.returncode != 0 or " passed" not in done.stdout:
        pytest.fail(f"the TRITON_INTERPRET=1 run failed (exit {done.returncode}):\n{output[-12000:]}")

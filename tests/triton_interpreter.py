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


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def interpreter_incompatibility() -> str | None:
    """Why this Triton interpreter cannot run the kernels here, or None. Triton 3.6's interpreter turns
    one-element arrays into loop bounds with ``int()``, which numpy 2.4 refuses (TypeError: only
    0-dimensional arrays can be converted to Python scalars; seen with triton 3.6.0 + numpy 2.4.6, while
    numpy 2.3.5 works); triton 3.8 squeezes them first."""
    import numpy
    import triton

    if _version(triton.__version__) < (3, 8) and _version(numpy.__version__) >= (2, 4):
        return (
            f"the interpreter of triton {triton.__version__} cannot run with numpy {numpy.__version__} "
            "(int() of one-element arrays); install numpy<2.4 to run these tests"
        )
    return None


def run_module_under_interpreter(test_file: str, timeout_s: float = 600) -> None:
    """Run ``test_file`` with ``TRITON_INTERPRET=1`` in a child pytest; fail with its output unless it passes."""
    if INTERPRETED:
        pytest.skip("already running under TRITON_INTERPRET=1")
    reason = interpreter_incompatibility()
    if reason:
        pytest.skip(reason)
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

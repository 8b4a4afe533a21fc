"""Running a Triton test module under ``TRITON_INTERPRET=1`` from a plain pytest run.

``@triton.jit`` picks the interpreter when a kernel is defined, so a pytest process that may already have
imported the kernels cannot switch it on: the kernel tests of such a module skip in the plain run, and one
test of the module (marked ``triton_interpreter``) runs the whole module again in a child process with the
interpreter on.
"""

import concurrent.futures
import os
import pathlib
import subprocess
import sys
import tempfile

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

    try:
        import triton
    except ImportError:
        return "triton is not installed (a CPU-only torch does not bring it)"

    if _version(triton.__version__) < (3, 8) and _version(numpy.__version__) >= (2, 4):
        return (
            f"the interpreter of triton {triton.__version__} cannot run with numpy {numpy.__version__} "
            "(int() of one-element arrays); install numpy<2.4 to run these tests"
        )
    return None


# The child runs are single-threaded and the rest of the suite leaves part of the cores idle (rank processes wait
# on each other), so they start in the background when collection ends (conftest.py), one at a time and niced, and
# each module's test waits for its own run: measured, ~2 minutes of the suite's wall time on 2 cores.
_background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-interpreter")
_runs: dict[str, concurrent.futures.Future] = {}
_children: list[subprocess.Popen] = []
MARK = "triton_interpreter"  # the marker of a test that runs its module under the interpreter


def _child_run(test_file: str, timeout_s: float, niceness: int) -> tuple[str, int | None]:
    """The child pytest's output and exit status (None: it timed out and was killed)."""
    # One intra-op thread: the interpreter is single-threaded numpy, the tensors are small, and on a
    # busy 2-core machine torch's OpenMP threads made the comparisons several times slower.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEP", test_file]
    with tempfile.TemporaryFile(mode="w+") as output:
        child = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=(lambda: os.nice(niceness)) if niceness else None,
        )
        _children.append(child)
        try:
            status = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            status = None
        output.seek(0)
        return output.read(), status


def _why_not() -> str | None:
    return "already running under TRITON_INTERPRET=1" if INTERPRETED else interpreter_incompatibility()


def start_in_background(test_files, timeout_s: float = 600) -> None:
    """Start the interpreter runs of ``test_files`` (in order, one at a time, niced) for their tests to collect."""
    test_files = [os.path.realpath(path) for path in test_files]
    if not test_files or _why_not():
        return
    for test_file in test_files:
        if test_file not in _runs:
            _runs[test_file] = _background.submit(_child_run, test_file, timeout_s, 10)


def stop_background() -> None:
    """Kill what still runs (a session that ended early, e.g. under -x) and drop what has not started."""
    _background.shutdown(wait=False, cancel_futures=True)
    for child in _children:
        if child.poll() is None:
            child.kill()


def run_module_under_interpreter(test_file: str, timeout_s: float = 600) -> None:
    """Run ``test_file`` with ``TRITON_INTERPRET=1`` in a child pytest (or collect the run started in the
    background); fail with its output unless it passes."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    test_file = os.path.realpath(test_file)
    run = _runs.get(test_file)
    output, status = run.result() if run is not None else _child_run(test_file, timeout_s, 0)
    print(output[-12000:])
    if status is None:
        pytest.fail(f"the TRITON_INTERPRET=1 run timed out after {timeout_s:.0f} s:\n{output[-6000:]}")
    if status != 0 or " passed" not in output:
        pytest.fail(f"the TRITON_INTERPRET=1 run failed (exit {status}):\n{output[-12000:]}")

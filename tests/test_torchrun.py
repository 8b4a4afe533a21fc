"""init_mesh under a real torchrun launch: the env:// startup path."""

import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)


def test_init_mesh_under_torchrun():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_DIR, os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(TESTS_DIR, "torchrun_mesh.py"),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: mesh ('tp',) (2,) on " in output, output
    assert output.count("all_reduce sum 3") == 2, output

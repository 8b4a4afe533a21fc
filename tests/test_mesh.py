"""Tests of fastmesh.mesh: init_mesh and group_name on 1, 2 and 4 ranks, and every error they raise.

Three settings: checks that must fail before any process group starts run in this (pytest)
process, which has none; the world-of-1 startup runs in a fresh Python process, so that it
really starts the group; 2 and 4 ranks run on the session's rank pools, whose default group
already exists, so init_mesh reuses it there.
"""

import datetime
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from rank_pool import on_ranks
from torch._C._distributed_c10d import _resolve_process_group

from fastmesh.mesh import group_name, init_mesh

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def no_process_group(monkeypatch):
    """A process with no default group and no launcher environment; checks none gets started."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized(), "an earlier test left a default process group in the pytest process"
    yield
    assert not dist.is_initialized(), "init_mesh started a process group before raising"


# ---- errors raised before any process group starts (this process) ----


@pytest.mark.parametrize(
    "axes, error, match",
    [
        ({}, ValueError, r"init_mesh\(\) needs at least one mesh axis, e\.g\. init_mesh\(tp=2\)"),
        ({"tp": 2.0}, TypeError, r"init_mesh\(tp=2\.0\): the size of axis 'tp' must be an int .*not float"),
        ({"tp": True}, TypeError, r"the size of axis 'tp' must be an int .*not bool"),
        ({"dp": 2, "tp": "2"}, TypeError, r"init_mesh\(dp=2, tp='2'\): the size of axis 'tp' must be an int"),
        ({"tp": 0}, ValueError, r"init_mesh\(tp=0\): the size of axis 'tp' is 0; sizes must be positive, or -1"),
        ({"dp": -2, "tp": 1}, ValueError, r"the size of axis 'dp' is -2"),
        ({"dp": -1, "tp": -1}, ValueError, r"init_mesh\(dp=-1, tp=-1\): only one axis may be -1, but dp, tp are"),
        ({"dp": 2, "tp": 4}, ValueError, r"^init_mesh\(dp=2, tp=4\) needs 8 ranks but the world has 1$"),
        (
            {"dp": -1, "tp": 2},
            ValueError,
            r"dp=-1 takes the rest of the world, but the world's 1 ranks are not divisible by 2 \(the product",
        ),
    ],
)
def test_bad_axes(no_process_group, axes, error, match):
    with pytest.raises(error, match=match):
        init_mesh(device_type="cpu", **axes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"backend": "nccl"},
            r"init_mesh\(device_type='cpu', backend='nccl'\): backend 'nccl' cannot serve "
            r"device 'cpu'; it serves cuda$",
        ),
        ({"backend": "cuda:nccl"}, r"backend 'cuda:nccl' cannot serve device 'cpu'; it serves cuda$"),
        (
            {"backend": "cpu:nccl,cuda:nccl"},
            r"init_mesh\(backend='cpu:nccl,cuda:nccl'\): backend 'nccl' cannot "
            r"serve device 'cpu'; it serves cuda$",
        ),
        ({"backend": "nosuch"}, r"unknown backend 'nosuch'; torch knows .*gloo, .*nccl"),
        ({"backend": "cpu:gloo,cpu:gloo"}, r"expected a backend name or distinct device:backend pairs"),
        ({"backend": "cpu:"}, r"expected a backend name or distinct device:backend pairs"),
        (
            {"device_type": "cuda:0"},
            r"init_mesh\(device_type='cuda:0'\): pass a device type such as 'cuda', "
            r"without an index",
        ),
        ({"timeout": 0}, r"init_mesh\(timeout=0\): the timeout must be positive"),
        ({"timeout": datetime.timedelta(seconds=-1)}, r"the timeout must be positive"),
    ],
)
def test_bad_device_backend_or_timeout(no_process_group, kwargs, match):
    kwargs.setdefault("device_type", "cpu")
    with pytest.raises(ValueError, match=match):
        init_mesh(tp=1, **kwargs)


def test_timeout_of_wrong_type(no_process_group):
    with pytest.raises(TypeError, match=r"init_mesh\(timeout=\.\.\.\) takes seconds or a timedelta, not str"):
        init_mesh(tp=1, device_type="cpu", timeout="60")


def test_backend_capability_comes_from_torch(no_process_group, monkeypatch):
    monkeypatch.setitem(dist.Backend.backend_capability, "nccl", ["cuda", "cpu"])
    with pytest.raises(ValueError, match="needs 2 ranks"):  # nccl now passes the device check
        init_mesh(tp=2, device_type="cpu", backend="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a machine without CUDA")
def test_cuda_unavailable(no_process_group):
    with pytest.raises(
        RuntimeError,
        match=r"init_mesh\(device_type='cuda'\): torch\.cuda\.is_available\(\) "
        r"is False .*pass device_type='cpu'",
    ):
        init_mesh(tp=1, device_type="cuda")


def test_default_device_is_cpu_without_cuda(no_process_group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="backend 'nccl' cannot serve device 'cpu'"):
        init_mesh(tp=1, backend="nccl")


def test_local_rank_out_of_range(no_process_group, monkeypatch):
    # Pretend to have 2 GPUs: the check must fire before anything touches CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        RuntimeError,
        match=r"init_mesh\(device_type='cuda'\): LOCAL_RANK=3 but this process sees "
        r"2 cuda device\(s\) \(CUDA_VISIBLE_DEVICES=4,5\)",
    ):
        init_mesh(tp=1)


def test_partial_launcher_environment(no_process_group, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError,
        match=r"init_mesh: RANK, WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not; "
        r"launch with torchrun",
    ):
        init_mesh(tp=2, device_type="cpu")


def test_group_name_without_process_group(no_process_group):
    with pytest.raises(
        RuntimeError,
        match=r"group_name\(None\) names the default process group, but none is "
        r"initialized",
    ):
        group_name()
    with pytest.raises(ValueError, match=r"no process group is registered under the name '0'"):
        group_name("0")


@pytest.mark.parametrize("group", [3, ["tp"], (None, "tp"), b"0"])
def test_group_name_of_wrong_type(group):
    with pytest.raises(
        TypeError,
        match=r"group_name\(\) takes a ProcessGroup, a 1-D DeviceMesh, a "
        r"\(DeviceMesh, axis_name\) tuple, a group-name string or None, not",
    ):
        group_name(group)


def test_group_name_on_a_rank_outside_the_group():
    """new_group returns GroupMember.NON_GROUP_MEMBER (an int) on the ranks it leaves out: say so, not "wrong type"."""
    with pytest.raises(ValueError, match=r"NON_GROUP_MEMBER: this rank is not a member of the group"):
        group_name(int(str(dist.GroupMember.NON_GROUP_MEMBER)))  # equal, not the same object


# ---- a world of 1, started by init_mesh (a fresh process) ----


def _run_in_fresh_process(fn):
    env = {var: value for var, value in os.environ.items() if var not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([REPO_DIR, TESTS_DIR, env.get("PYTHONPATH", "")])
    module = fn.__module__
    code = f"import {module}; {module}.{fn.__name__}()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{fn.__name__} failed in a fresh process:\n{proc.stdout}\n{proc.stderr}"


def _check_world_of_one():
    mesh = init_mesh(dp=-1, tp=1, device_type="cpu", timeout=42)
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    assert mesh.mesh_dim_names == ("dp", "tp") and mesh.shape == (1, 1) and mesh.device_type == "cpu"
    assert dist.get_backend_config() == "cpu:gloo,cuda:gloo"
    world = dist.group.WORLD
    assert world._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=42)
    # Axes spanning the whole world use the default group itself.
    for group in (None, world, mesh["tp"], (mesh, "dp"), world.group_name):
        assert group_name(group) == world.group_name, group
    t = torch.tensor([5.0])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == 5.0

    again = init_mesh(tp=1, backend="gloo")  # reuses the group: same backend, explicitly
    assert dist.group.WORLD is world and again.mesh_dim_names == ("tp",)
    with pytest.raises(ValueError, match=re.escape("init_mesh(tp=2) needs 2 ranks but the world has 1")):
        init_mesh(tp=2)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "init_mesh(backend='ucc'): the default process group already exists with backend 'cpu:gloo,cuda:gloo', "
            "which differs: cpu: gloo (requested ucc); cuda: gloo (requested ucc)"
        ),
    ):
        init_mesh(tp=1, backend="ucc")


def _check_existing_group_without_the_device():
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.is_available = lambda: True  # pretend, to reach the check; nothing else runs on CUDA
    torch.cuda.device_count = lambda: 1
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "init_mesh(device_type='cuda'): the default process group already exists with backend 'cpu:gloo', "
            "which cannot serve 'cuda'; it serves cpu"
        ),
    ):
        init_mesh(tp=1)
    with pytest.raises(RuntimeError, match=re.escape("which differs: cpu: gloo (requested mpi)")):
        init_mesh(tp=1, device_type="cpu", backend="cpu:mpi")


def test_world_of_one_started_by_init_mesh():
    _run_in_fresh_process(_check_world_of_one)


def test_existing_group_that_cannot_serve_the_device():
    _run_in_fresh_process(_check_existing_group_without_the_device)


# ---- 2 and 4 ranks (the pools' default group is reused) ----


@on_ranks(2, 4)
def test_one_axis(world_size):
    mesh = init_mesh(tp=world_size)
    assert mesh.mesh_dim_names == ("tp",) and mesh.shape == (world_size,)
    assert mesh.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    name = mesh.get_group().group_name
    for group in (mesh, mesh["tp"], (mesh, "tp"), mesh.get_group(), name):
        assert group_name(group) == name, group
    assert group_name(None) == dist.group.WORLD.group_name
    assert dist.get_process_group_ranks(_resolve_process_group(name)) == list(range(world_size))
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total, group=_resolve_process_group(group_name(mesh)))
    assert total.item() == sum(range(world_size))


@on_ranks(2, 4)
def test_rest_of_world(world_size):
    mesh = init_mesh(dp=-1, tp=2)
    assert mesh.mesh_dim_names == ("dp", "tp") and mesh.shape == (world_size // 2, 2)
    mesh = init_mesh(tp=2, dp=-1)
    assert mesh.mesh_dim_names == ("tp", "dp") and mesh.shape == (2, world_size // 2)


@on_ranks(4)
def test_two_axes_groups():
    rank = dist.get_rank()
    mesh = init_mesh(dp=2, tp=2)
    assert mesh.shape == (2, 2)
    expected = {"tp": [rank // 2 * 2, rank // 2 * 2 + 1], "dp": [rank % 2, rank % 2 + 2]}
    for axis, ranks in expected.items():
        name = group_name((mesh, axis))
        assert name == group_name(mesh[axis]) == mesh.get_group(axis).group_name
        group = _resolve_process_group(name)
        assert dist.get_process_group_ranks(group) == ranks, axis
        gathered = [torch.zeros(1, dtype=torch.long) for _ in ranks]
        dist.all_gather(gathered, torch.tensor([rank]), group=group)
        assert [t.item() for t in gathered] == ranks, axis
    assert group_name((mesh, "tp")) != group_name((mesh, "dp"))


@on_ranks(4, timeout=120)
def test_timeout_applies_to_every_axis_group():
    # A stalled peer in a tp group: the survivor's collective on that group fails after the mesh's timeout, not
    # torch's 30-minute default for new groups.
    import time

    rank = dist.get_rank()
    mesh = init_mesh(dp=2, tp=2, timeout=3)
    tp = mesh.get_group("tp")
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=tp)  # rank 1, its tp peer, never joins
        waited = time.monotonic() - start
        assert 2 < waited < 30, waited
    elif rank in (2, 3):
        t = torch.ones(1)
        dist.all_reduce(t, group=tp)
        assert t.item() == 2
    dist.barrier()  # the default group (the pool's timeout) waits out rank 0; the tp group of 0, 1 is not used again
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("dp"))  # the dp groups still work
    assert t.item() == 2


@on_ranks(4)
def test_group_name_of_two_axis_mesh_errors():
    mesh = init_mesh(dp=2, tp=2)
    with pytest.raises(
        ValueError,
        match=r"^group_name: the mesh has axes \('dp', 'tp'\); pass one axis, "
        r"e\.g\. mesh\['tp'\] or \(mesh, 'tp'\)$",
    ):
        group_name(mesh)
    with pytest.raises(ValueError, match=r"^group_name: the mesh has no axis 'pp'; its axes are \('dp', 'tp'\)$"):
        group_name((mesh, "pp"))


@pytest.mark.smoke
@on_ranks(2)
def test_group_name_of_process_groups():
    subgroup = dist.new_group([0, 1])
    assert group_name(subgroup) == subgroup.group_name != group_name(None)
    assert group_name(subgroup.group_name) == subgroup.group_name
    with pytest.raises(ValueError, match=r"^group_name: no process group is registered under the name 'nosuch'$"):
        group_name("nosuch")


@on_ranks(2, 4)
def test_sizes_that_do_not_fit_the_world(world_size):
    with pytest.raises(ValueError, match=rf"^init_mesh\(dp=2, tp=4\) needs 8 ranks but the world has {world_size}$"):
        init_mesh(dp=2, tp=4)
    with pytest.raises(
        ValueError,
        match=rf"init_mesh\(dp=-1, tp=3\): dp=-1 takes the rest of the world, but the "
        rf"world's {world_size} ranks are not divisible by 3",
    ):
        init_mesh(dp=-1, tp=3)


@on_ranks(2)
def test_backend_conflicting_with_existing_group():
    with pytest.raises(
        RuntimeError,
        match=r"^init_mesh\(backend='ucc'\): the default process group already exists "
        r"with backend 'cpu:gloo,cuda:\w+', which differs: cpu: gloo \(requested "
        r"ucc\); cuda: \w+ \(requested ucc\)\. Omit backend= to reuse it",
    ):
        init_mesh(tp=2, backend="ucc")
    assert init_mesh(tp=2, device_type="cpu", backend="cpu:gloo").shape == (2,)  # agrees where it says anything

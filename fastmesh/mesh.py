"""Device meshes and process-group names for fastmesh.

fastmesh has no mesh class of its own: :func:`init_mesh` returns torch's
:class:`~torch.distributed.device_mesh.DeviceMesh`, so everything that takes a mesh
(``parallelize_module``, DTensor) takes this one. Naming follows torchtitan: an
*axis* is a mesh axis (what torch calls a mesh dim), a *dim* is a tensor dimension.

The fastmesh ops identify a process group by its ``group_name`` string, the
convention of ``torch.ops._c10d_functional`` and ``torch.ops.symm_mem``: a string
survives ``torch.compile`` tracing where a ``ProcessGroup`` object does not.
:func:`group_name` turns whatever the caller holds into that string.

How :func:`init_mesh` gets the default process group:

* one is already initialized: it is reused, after checking it serves the device (and the
  backend, if one was asked for);
* torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set: it is
  started with ``init_method="env://"``;
* none of them are set: it is a world of 1 over an in-process ``HashStore`` (no ports).

This module imports only torch and the standard library.
"""

import datetime
import math
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["group_name", "init_mesh"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_mesh(
    *,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    **axes: int,
) -> DeviceMesh:
    """Create a :class:`DeviceMesh` over all ranks, starting the process group if needed.

    Each keyword names one mesh axis and gives its size, in order: ``init_mesh(dp=2, tp=4)``
    makes a 2 x 4 mesh whose axes are named ``("dp", "tp")``. One axis may have size -1,
    meaning the rest of the world. The mesh is torch's own, made by
    :func:`~torch.distributed.device_mesh.init_device_mesh`; index it by axis name
    (``mesh["tp"]``) for a 1-D mesh over that axis.

    Keyword Args:
        device_type (str, optional): the mesh's device type. Default: ``"cuda"`` when
            ``torch.cuda.is_available()``, else ``"cpu"``.
        backend (str, optional): the process-group backend, as
            :func:`torch.distributed.init_process_group` takes it: a name (``"gloo"``) or
            device:backend pairs (``"cpu:gloo,cuda:nccl"``). It must serve ``device_type``
            according to ``torch.distributed.Backend.backend_capability``. Default:
            ``"gloo"`` for CPU; for an accelerator, gloo for CPU tensors and torch's default
            backend for the accelerator (``"cpu:gloo,cuda:nccl"`` for CUDA).
        timeout (float or timedelta, optional): seconds after which a collective fails
            instead of waiting forever, on every group of the returned mesh (each axis's group,
            which for an axis spanning the world is the default group) and on the default group
            when this call starts it. Default: torch's (30 min for gloo, 10 min for NCCL).
        **axes (int): mesh axis sizes by name, in mesh order; one may be -1.

    Returns:
        DeviceMesh: a mesh with ``mesh_dim_names`` equal to the axis names.

    Raises:
        ValueError: no axes; a size that is not positive or -1; more than one -1; axis
            sizes that do not fit the world size; a backend that cannot serve the device.
        TypeError: a size that is not an int, or a bad ``timeout``.
        RuntimeError: the device is not available; ``LOCAL_RANK`` is out of range; the
            torchrun environment is incomplete; an existing default process group cannot
            serve the device or conflicts with ``backend``.

    Example::

        >>> # xdoctest: +SKIP("needs torchrun")
        >>> # torchrun --nproc-per-node 8 train.py
        >>> mesh = fastmesh.init_mesh(dp=-1, tp=2)
        >>> mesh.mesh_dim_names, mesh.shape
        (('dp', 'tp'), (4, 2))
        >>> tp_mesh = mesh["tp"]
    """
    call = "init_mesh(" + ", ".join(f"{name}={size!r}" for name, size in axes.items()) + ")"
    _check_axes(axes, call)
    timeout = _as_timedelta(timeout)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = _check_device(device_type)
    chosen_backend = backend if backend is not None else _default_backend(device_type)
    backend_map = _check_backend(device_type, chosen_backend)

    starts_group = not dist.is_initialized()
    if starts_group:
        world_size = _torchrun_world_size()
    else:
        _check_existing_group(device_type, backend, backend_map)
        world_size = dist.get_world_size()
    sizes = _resolve_sizes(axes, world_size, call)

    if starts_group:
        if local_rank is not None:
            torch.get_device_module(device_type).set_device(local_rank)
        _init_default_group(chosen_backend, timeout)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=tuple(axes))
    if timeout is not None:
        # torch creates the per-axis groups with its own default timeout.
        for axis in range(mesh.ndim):
            _set_timeout(timeout, mesh.get_group(axis))
    return mesh


def group_name(group: ProcessGroup | DeviceMesh | tuple[DeviceMesh, str] | str | None = None) -> str:
    """Return the ``group_name`` string that fastmesh ops take, for any way of naming a group.

    Args:
        group: one of

            * a ``ProcessGroup``;
            * a 1-D ``DeviceMesh`` (such as ``mesh["tp"]``): its group;
            * ``(mesh, axis_name)``: the group of that axis of ``mesh``;
            * a group-name string: checked to name a registered group, and returned;
            * ``None``: the default (world) process group.

    Returns:
        str: the name under which the group is registered with c10d.

    Raises:
        ValueError: a multi-axis mesh without an axis, an unknown axis name, a string
            that names no registered group, or ``GroupMember.NON_GROUP_MEMBER`` (this rank is not in the group).
        TypeError: anything else.
        RuntimeError: ``None`` while no default process group is initialized.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> mesh = fastmesh.init_mesh(dp=2, tp=2)
        >>> name = fastmesh.group_name(mesh["tp"])
        >>> name == fastmesh.group_name((mesh, "tp")) == mesh.get_group("tp").group_name
        True
    """
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "group_name(None) names the default process group, but none is initialized; "
                "call fastmesh.init_mesh(...) or torch.distributed.init_process_group(...) first"
            )
        return dist.group.WORLD.group_name
    if isinstance(group, ProcessGroup):
        return group.group_name
    if isinstance(group, DeviceMesh):
        return _mesh_group_name(group)
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return _axis_group_name(*group)
    if isinstance(group, str):
        return _registered_group_name(group)
    # An int (-100): what new_group returns on the ranks it leaves out, compared by value (an int's identity is not).
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "group_name() got GroupMember.NON_GROUP_MEMBER: this rank is not a member of the group "
            "(torch.distributed.new_group returns it on the ranks it leaves out); call the op on the group's ranks only"
        )
    raise TypeError(
        "group_name() takes a ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, axis_name) tuple, "
        f"a group-name string or None, not {type(group).__name__}"
    )


def _check_axes(axes: dict[str, int], call: str) -> None:
    if not axes:
        raise ValueError("init_mesh() needs at least one mesh axis, e.g. init_mesh(tp=2) or init_mesh(dp=-1, tp=2)")
    for name, size in axes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(
                f"{call}: the size of axis {name!r} must be an int (-1 for the rest of the world), "
                f"not {type(size).__name__}"
            )
        if size < 1 and size != -1:
            raise ValueError(
                f"{call}: the size of axis {name!r} is {size}; sizes must be positive, or -1 for the rest of the world"
            )
    rest = [name for name, size in axes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"{call}: only one axis may be -1, but {', '.join(rest)} are")


def _resolve_sizes(axes: dict[str, int], world_size: int, call: str) -> tuple[int, ...]:
    fixed = math.prod(size for size in axes.values() if size != -1)
    rest = [name for name, size in axes.items() if size == -1]
    if rest:
        if world_size % fixed:
            raise ValueError(
                f"{call}: {rest[0]}=-1 takes the rest of the world, but the world's {world_size} "
                f"ranks are not divisible by {fixed} (the product of the other axes)"
            )
        return tuple(world_size // fixed if size == -1 else size for size in axes.values())
    if fixed != world_size:
        raise ValueError(f"{call} needs {fixed} ranks but the world has {world_size}")
    return tuple(axes.values())


# torch >= 2.12 names it set_timeout (and deprecates the old name, the only one torch 2.11 has).
_set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout


def _as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = timeout
    else:
        raise TypeError(f"init_mesh(timeout=...) takes seconds or a timedelta, not {type(timeout).__name__}")
    if not seconds > 0:
        raise ValueError(f"init_mesh(timeout={timeout!r}): the timeout must be positive")
    return datetime.timedelta(seconds=seconds)


def _check_device(device_type: str) -> int | None:
    """Check that ``device_type`` is usable; return the device index to select, if any."""
    if not device_type.isalpha():
        raise ValueError(
            f"init_mesh(device_type={device_type!r}): pass a device type such as 'cuda', "
            "without an index; the device comes from LOCAL_RANK"
        )
    if device_type == "cpu":
        return None
    try:
        module = torch.get_device_module(device_type)
    except RuntimeError as e:
        raise ValueError(f"init_mesh(device_type={device_type!r}): {e}") from None
    if not module.is_available():
        raise RuntimeError(
            f"init_mesh(device_type={device_type!r}): torch.{device_type}.is_available() is False "
            f"(torch {torch.__version__}); pass device_type='cpu' to run on CPU"
        )
    if "LOCAL_RANK" not in os.environ:
        return None
    local_rank, count = os.environ["LOCAL_RANK"], module.device_count()
    if not (local_rank.isdigit() and int(local_rank) < count):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise RuntimeError(
            f"init_mesh(device_type={device_type!r}): LOCAL_RANK={local_rank} but this process "
            f"sees {count} {device_type} device(s) (CUDA_VISIBLE_DEVICES={visible}); "
            "run at most one process per device on each node"
        )
    return int(local_rank)


def _check_backend(device_type: str, backend: str) -> dict[str, str]:
    """Return ``backend`` as a device -> backend map, checking that it serves ``device_type``."""
    backend_map = _parse_backend(backend)
    for device, name in backend_map.items():
        if device not in _devices_served_by(name):
            raise ValueError(
                f"init_mesh(backend={backend!r}): backend {name!r} cannot serve device {device!r}; "
                f"it serves {', '.join(_devices_served_by(name))}"
            )
    if device_type not in backend_map:
        raise ValueError(
            f"init_mesh(device_type={device_type!r}, backend={backend!r}): backend {backend!r} "
            f"cannot serve device {device_type!r}; it serves {', '.join(backend_map)}"
        )
    return backend_map


def _default_backend(device_type: str) -> str:
    # Gloo serves CPU tensors next to an accelerator, so CPU-side collectives keep working on GPU runs.
    if device_type == "cpu":
        return "gloo"
    try:
        return f"cpu:gloo,{device_type}:{dist.Backend.default_device_backend_map[device_type]}"
    except KeyError:
        raise ValueError(
            f"init_mesh(device_type={device_type!r}): torch has no default backend for {device_type!r}; pass backend="
        ) from None


def _parse_backend(backend: str) -> dict[str, str]:
    """Map each device type to its backend, for a backend string as ``init_process_group`` takes it."""
    backend = backend.lower()
    if ":" not in backend:
        return dict.fromkeys(_devices_served_by(backend), backend)
    backend_map = {}
    for pair in backend.split(","):
        device, _, name = pair.partition(":")
        if not device or not name or ":" in name or device in backend_map:
            raise ValueError(
                f"init_mesh(backend={backend!r}): expected a backend name or distinct "
                "device:backend pairs, such as 'cpu:gloo,cuda:nccl'"
            )
        backend_map[device] = name
    return backend_map


def _devices_served_by(name: str) -> list[str]:
    try:
        return dist.Backend.backend_capability[name]
    except KeyError:
        raise ValueError(
            f"init_mesh: unknown backend {name!r}; torch knows {', '.join(sorted(dist.Backend.backend_capability))}"
        ) from None


def _check_existing_group(device_type: str, backend: str | None, backend_map: dict[str, str]) -> None:
    existing = dist.get_backend_config()
    existing_map = _parse_backend(existing)
    if device_type not in existing_map:
        raise RuntimeError(
            f"init_mesh(device_type={device_type!r}): the default process group already exists "
            f"with backend {existing!r}, which cannot serve {device_type!r}; it serves "
            f"{', '.join(existing_map)}"
        )
    if backend is None:
        return
    differing = [
        f"{device}: {existing_map.get(device)} (requested {name})"
        for device, name in backend_map.items()
        if existing_map.get(device) != name
    ]
    if differing:
        raise RuntimeError(
            f"init_mesh(backend={backend!r}): the default process group already exists with "
            f"backend {existing!r}, which differs: {'; '.join(differing)}. Omit backend= to "
            "reuse it, or destroy it first"
        )


def _torchrun_world_size() -> int:
    present = [var for var in _TORCHRUN_VARS if var in os.environ]
    if not present:
        return 1
    missing = [var for var in _TORCHRUN_VARS if var not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_mesh: {', '.join(present)} set but {', '.join(missing)} not; launch with "
            "torchrun, or unset them all for a 1-process world"
        )
    return int(os.environ["WORLD_SIZE"])


def _init_default_group(backend: str, timeout: datetime.timedelta | None) -> None:
    if "RANK" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        # An in-process store: a world of 1 needs no rendezvous, so no port to pick or collide on.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _mesh_group_name(mesh: DeviceMesh) -> str:
    if mesh.ndim == 1:
        return mesh.get_group().group_name
    if mesh.mesh_dim_names is None:
        raise ValueError(
            f"group_name: the mesh has {mesh.ndim} unnamed axes; pass a 1-D mesh or mesh.get_group(axis_index)"
        )
    axis = mesh.mesh_dim_names[-1]
    raise ValueError(
        f"group_name: the mesh has axes {mesh.mesh_dim_names}; pass one axis, e.g. mesh[{axis!r}] or (mesh, {axis!r})"
    )


def _axis_group_name(mesh: DeviceMesh, axis: str) -> str:
    axes = mesh.mesh_dim_names or ()
    if axis not in axes:
        raise ValueError(f"group_name: the mesh has no axis {axis!r}; its axes are {axes}")
    return mesh.get_group(axis).group_name


def _registered_group_name(name: str) -> str:
    if torch.compiler.is_compiling():  # the registry is not traceable; the op resolves the name when it runs
        return name
    try:
        _resolve_process_group(name)
    except RuntimeError:
        raise ValueError(f"group_name: no process group is registered under the name {name!r}") from None
    return name

"""Run by tests/test_torchrun.py under torchrun: init_mesh from the launcher's environment."""

import torch
import torch.distributed as dist

from fastmesh.mesh import group_name, init_mesh


def main():
    mesh = init_mesh(tp=2, timeout=60)
    rank = dist.get_rank()
    assert mesh.mesh_dim_names == ("tp",) and mesh.shape == (2,)
    total = torch.tensor([rank + 1], device=mesh.device_type)
    dist.all_reduce(total, group=mesh["tp"].get_group())
    assert total.item() == 3, total
    print(
        f"rank {rank}: mesh {mesh.mesh_dim_names} {tuple(mesh.shape)} on {mesh.device_type}, "
        f"group {group_name(mesh['tp'])!r}, all_reduce sum {total.item()}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

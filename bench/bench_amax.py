"""Microbenchmark of fastmesh::amax against eager PyTorch, torch.compile and a read-bandwidth bound.

amax reads every element once and writes 4 bytes, so its bound is the machine's read bandwidth,
measured in the same run as ``sum()`` over a float32 tensor of the same byte size (for bf16/fp16 the
input's own ``sum`` is compute-bound on CPU, so it is no bound).
Timings are interleaved round-robin and reported as medians with the interquartile spread.

    python bench/bench_amax.py [--rows 4096 --cols 8192 --dtype bfloat16 --threads 2 --repeats 30]
"""

import argparse
import platform

import torch

import fastmesh
from timing import median_iqr, time_interleaved




def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads on CPU")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(args.rows, args.cols, device=device).to(getattr(torch, args.dtype))
    read_probe = torch.randn(x.numel() * x.element_size() // 4, device=device)
    compiled = torch.compile(lambda t: t.abs().amax().float())
    candidates = {
        "fastmesh.amax": lambda: fastmesh.amax(x),
        "eager x.abs().amax()": lambda: x.abs().amax().float(),
        "torch.compile": lambda: compiled(x),
        "bound: fp32 sum, same bytes": lambda: read_probe.sum(),
    }
    expected = x.abs().amax().float()
    for name in ("fastmesh.amax", "torch.compile"):
        assert torch.equal(candidates[name](), expected), f"{name} disagrees with eager"
    time_interleaved(candidates, 3, sync)  # warm-up: compile, caches, page faults

    timings = time_interleaved(candidates, args.repeats, sync)
    nbytes = x.numel() * x.element_size()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"machine: {platform.node()} {device_name}; {args.threads} threads; {platform.platform()}")
    print(f"versions: fastmesh {fastmesh.__version__}, torch {torch.__version__}, python {platform.python_version()}")
    print(f"input: [{args.rows}, {args.cols}] {args.dtype} on {device} ({nbytes / 1e6:.1f} MB read)")
    bound_median = median_iqr(timings["bound: fp32 sum, same bytes"])[0]
    print(f"{'candidate':30s} {'median ms':>10s} {'IQR ms':>8s} {'GB/s':>8s} {'% of bound':>10s}")
    for name, samples in timings.items():
        median, iqr = median_iqr(samples)
        print(f"{name:30s} {median * 1e3:10.3f} {iqr * 1e3:8.3f} {nbytes / median / 1e9:8.1f} "
              f"{100 * bound_median / median:9.0f}%")


if __name__ == "__main__":
    main()

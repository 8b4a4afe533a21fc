"""GPU check: every fused op and cast captured in a CUDA graph and replayed, against eager calls.

For a machine with an NVIDIA GPU; one is enough:

    python bench/gpu_check_graphs.py [--json results.json] [--device cpu]

One process, a group of one rank over NCCL (the CUDA path: the op's C++ kernel, its remembered plan, its CUDA
schedule; a group of one multiplies locally). Per case: two eager calls (the first plans the call's key, the second
runs the remembered plan), then the call captured in a CUDA graph (``torch.cuda.graph``), then the graph replayed
after new values are copied into its inputs, against an eager call on those values (bitwise: the same kernels on the
same values). A host synchronization, a collective or a plan decision that needs one inside the capture fails the
capture, and the case with it. Then one call whose key was never warmed up, captured: its plan is the model's alone,
said once in the log (``fastmesh.plans``). ``--device cpu`` runs the eager calls only, over gloo (a self-test of this
script; nothing is captured).

Cases: the four high-precision fused ops (float32 and bfloat16), their FP8 forms (``fp8=``, tensor-wise and
row-wise scales, bfloat16), ``fastmesh.fp8.quantize`` per granularity and the MX cast, with
``FASTMESH_FP8_CUDA_IMPL`` triton and cuda.

Exit status: 0 all good; 1 a case failed; 2 no GPU / setup failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

E4M3 = torch.float8_e4m3fn


def _values(shape, seed, device, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype=dtype, device=device)


def _cases(fastmesh, device):
    """(name, inputs, call(inputs) -> tensors) for every case."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")

        def ops(a, b, c, d):
            return [
                ("all_gather_matmul", lambda: fastmesh.all_gather_matmul(a, [b], 0)[1][0]),
                ("matmul_reduce_scatter", lambda: fastmesh.matmul_reduce_scatter(c, d, 0)),
                ("matmul_all_reduce", lambda: fastmesh.matmul_all_reduce(a, b)),
                ("matmul_all_gather", lambda: fastmesh.matmul_all_gather(a, b)),
            ]

        inputs = [
            _values((64, 128), 1, device, dtype),
            _values((128, 256), 2, device, dtype),
            _values((64, 128), 3, device, dtype),
            _values((128, 256), 4, device, dtype),
        ]
        for name, call in ops(*inputs):
            cases.append((f"{name} {tag}", inputs, call))
    for granularity in ("tensorwise", "rowwise"):
        config = fastmesh.fp8.Float8Config(granularity=granularity)
        a, b = _values((64, 128), 5, device, torch.bfloat16), _values((128, 256), 6, device, torch.bfloat16)
        for name, call in (
            ("all_gather_matmul", lambda c=config, a=a, b=b: fastmesh.all_gather_matmul(a, [b], 0, fp8=c)[1][0]),
            ("matmul_reduce_scatter", lambda c=config, a=a, b=b: fastmesh.matmul_reduce_scatter(a, b, 0, fp8=c)),
            ("matmul_all_reduce", lambda c=config, a=a, b=b: fastmesh.matmul_all_reduce(a, b, fp8=c)),
        ):
            cases.append((f"{name} fp8 {granularity}", [a, b], call))
    x = _values((256, 512), 7, device, torch.bfloat16)
    for granularity in ("tensorwise", "rowwise", "block1x128", "block128x128", "mx"):

        def cast(g=granularity):
            q = fastmesh.fp8.quantize(x, dtype=E4M3, granularity=g)
            return [q.data.view(torch.uint8), q.scale.view(torch.uint8) if g == "mx" else q.scale]

        cases.append((f"quantize {granularity}", [x], cast))
    return cases


def _as_list(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _check_case(name, inputs, call, capture: bool) -> dict:
    """Eager twice, then (``capture``) the captured call replayed on new values against an eager call on them."""
    first = [t.clone() for t in _as_list(call())]
    second = _as_list(call())
    if not all(torch.equal(x, y) for x, y in zip(first, second)):
        return {"case": name, "ok": False, "error": "the remembered plan's call differs from the first call"}
    if not capture:
        return {"case": name, "ok": True, "captured": False}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _as_list(call())
    for i, t in enumerate(inputs):
        t.copy_(_values(t.shape, 100 + i, t.device, t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    eager = _as_list(call())
    same = all(torch.equal(x, y) for x, y in zip(captured, eager))
    return {"case": name, "ok": same, "captured": True, **({} if same else {"error": "replay differs from eager"})}


def _cold_capture(fastmesh, device) -> dict:
    """A key never called eagerly, captured: the model plans it alone, and says so."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("fastmesh.plans")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    a, b = _values((48, 96), 8, device, torch.float32), _values((96, 40), 9, device, torch.float32)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fastmesh.matmul_all_reduce(a, b)
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(out, fastmesh.matmul_all_reduce(a, b))
    finally:
        logger.removeHandler(handler)
    said = stream.getvalue()
    return {"case": "cold key captured", "ok": ok, "log": said.strip()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_graphs: no CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    import fastmesh
    from fastmesh import settings

    results = []
    try:
        for impl in ("triton", "cuda"):
            os.environ["FASTMESH_FP8_CUDA_IMPL"] = impl
            settings.reload()
            for name, inputs, call in _cases(fastmesh, device):
                label = f"{name} ({impl} casts)" if name.startswith("quantize") or "fp8" in name else name
                if impl == "cuda" and label == name:
                    continue  # the high-precision ops once
                try:
                    results.append(_check_case(label, inputs, call, capture=device.type == "cuda"))
                except Exception:  # every case reports: one failing does not hide the rest
                    results.append({"case": label, "ok": False, "error": traceback.format_exc(limit=4)})
        if device.type == "cuda":
            try:
                results.append(_cold_capture(fastmesh, device))
            except Exception:  # as the cases
                results.append({"case": "cold key captured", "ok": False, "error": traceback.format_exc(limit=4)})
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    for r in results:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}" + (f": {r.get('error')}" if not r["ok"] else ""))
        if r.get("log"):
            print(f"     log: {r['log']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "results": results}, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the CUDA FP8 kernels and the MX cast: correctness against the plain-PyTorch references, then bandwidth.

Standalone, for a machine with an NVIDIA GPU (torch 2.11+ with CUDA; fastmesh built with its CUDA sources):

    python bench/gpu_check_fp8.py                       # checks, then the benchmark
    python bench/gpu_check_fp8.py --quick               # fewer shapes (about a minute of checks)
    python bench/gpu_check_fp8.py --skip-bench | --skip-check
    python bench/gpu_check_fp8.py --library /path/fm.so # ops from a separately built library (no fastmesh import)
    python bench/gpu_check_fp8.py --device cpu --quick  # dry run of the checks on the CPU kernels (no GPU needed)

1. Correctness. ``torch.ops.fastmesh.fp8_quantize_native`` (with ``--impl triton``: ``fastmesh::fp8_quantize``
   running the Triton kernels) and ``torch.ops.fastmesh.amax`` on CUDA against ``kernels/fp8_reference.py`` computed
   on the CPU: every granularity x FP8 dtype x input dtype x scale source (current, current + power_of_two, given
   amax, given amax + power_of_two, given scale) x transpose, on odd and even shapes (1-D, 3-D, empty, unaligned
   storage, K below one vector, rows longer than the kernels' register cache, more work than one grid), with data of
   wide dynamic range plus adversarial values (+-0, +-inf, NaN, fp32/bf16 subnormals, all-zero and tiny-amax groups,
   FP8 rounding ties and their neighbours, values past the FP8 maximum). Every call runs twice, each time on output
   memory poisoned with a different byte, and must be bit-identical (NaN: any NaN) to the reference both times, so an
   element the kernel forgot to write cannot pass. Calls the contract forbids must raise: checked in a child process
   (``--rejections-only``), so that a process dying while it raises is reported, not fatal to the rest. The MX cast
   the same way: ``torch.ops.fastmesh.mx_quantize_native`` (``--impl triton``: ``fastmesh::mx_quantize`` running its
   Triton kernel) against ``kernels/mx_reference.py``, both roundings, with and without transpose, on shapes 32
   divides, the data above plus blocks whose amax sits at and one ulp around the rules' powers of two.
2. Bandwidth. 8192 x 8192 bfloat16 per granularity (and with transpose), and the MX cast per rounding (and
   with transpose), timed with CUDA events (median of many runs) two ways: one eager call on an idle GPU (host
   launch work included) and one call of a replayed CUDA graph (the kernels alone). GB/s of logical bytes (x read
   once + every output written once) from the graph time, against a device-to-device copy of x timed the same way
   (bytes read + written). Target: >= 85% of copy. ``--sweep`` (with ``--impl triton``) also times each Triton
   work-per-program setting through a few values, each variant's output bytes checked equal to the default's.

Exit status: 0 all checks pass; 1 a kernel disagrees with the reference (or raised); 2 setup failed;
3 the kernels agree, but only with a corrected reference (see ``reference_self_check`` / ``expected_quantize``);
4 no disagreement, but the checks ran out of time (--check-seconds) before the end, or the MX reference
did not load (``--library`` without an importable fastmesh).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu
MX_ROUNDINGS = ("floor", "rceil")
FP8_DTYPES = (E4M3, E5M2)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRANULARITIES = ("tensorwise", "rowwise", "block1x128", "block128x128")
# (source, power_of_two): where q comes from.
SCALE_MODES = (("current", False), ("current", True), ("amax", False), ("amax", True), ("scale", False))
POISONS = (0x5A, 0xC3)
DEVICE = "cuda"  # --device cpu: a dry run of the checks on the CPU kernels


# ----------------------------------------------------------------------------------------------------
# Setup
# ----------------------------------------------------------------------------------------------------


def _load_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # keeps it alive: the schemas' torch.library.Library lives in it
    spec.loader.exec_module(module)
    return module


def load_ops(library: str | None) -> str:
    """Make torch.ops.fastmesh.* available; returns a description of where they came from."""
    if library:
        # Schemas from the one file that defines them (it imports only torch), kernels from the library.
        _load_file("fastmesh_library_schemas", os.path.join(ROOT, "fastmesh", "ops", "_library.py"))
        torch.ops.load_library(library)
        return f"library {library}"
    import fastmesh
    from fastmesh import _cpp_lib

    _cpp_lib.load()
    return f"fastmesh {getattr(fastmesh, '__version__', '?')} from {os.path.dirname(fastmesh.__file__)}"


def load_reference() -> types.ModuleType:
    try:
        from fastmesh.kernels import fp8_reference

        return fp8_reference
    except ImportError:
        return _load_file("fp8_reference", os.path.join(ROOT, "kernels", "fp8_reference.py"))


def load_mx_reference() -> types.ModuleType | str:
    """kernels/mx_reference.py, or why it cannot load (it imports fastmesh.kernels.fp8_reference)."""
    try:
        from fastmesh.kernels import mx_reference

        return mx_reference
    except ImportError as error:
        return f"{type(error).__name__}: {error}"


def reference_self_check(ref: types.ModuleType) -> bool:
    """True if ref.quant_scale_from_amax computes q = fp8_max / amax with one IEEE fp32 division.

    That is the contract (fastmesh/fp8_math.h: "fp8_max / amax -> rounded to nearest fp32"). In PyTorch,
    ``python_float / tensor`` is ``tensor.reciprocal() * python_float`` (two roundings), which differs for
    about a quarter of all amax values. If the reference has that form, it is replaced here by the
    one-division form (the run then ends with exit status 3 so that the reference gets fixed).
    """
    amax = torch.cat([torch.rand(100_000) * 1000 + 1e-3, torch.tensor([0.0, 1e-42, float("inf"), float("nan")])])
    ok = True
    for dtype in FP8_DTYPES:
        for power_of_two in (False, True):
            got = ref.quant_scale_from_amax(amax, dtype, power_of_two)
            want = ieee_quant_scale_from_amax(amax, dtype, power_of_two, ref)
            ok &= bool(same_f32_bits(got, want).all())
    return ok


def ieee_quant_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool, ref) -> torch.Tensor:
    q = torch.where(amax == 0, torch.ones_like(amax), torch.full_like(amax, ref.FP8_MAX[dtype]) / amax)
    q = torch.where(q > ref.FLOAT32_MAX, torch.full_like(q, ref.FLOAT32_MAX), q)
    if power_of_two:
        floored = (q.view(torch.int32) & torch.tensor(0xFF800000 - 2**32, dtype=torch.int32)).view(torch.float32)
        q = torch.where((q > 0) & (q <= ref.FLOAT32_MAX), floored, q)
    return q


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def next_toward(x: torch.Tensor, direction: int) -> torch.Tensor:
    """The neighbour of each (positive, finite) value in its own dtype, one ulp up (+1) or down (-1)."""
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype]
    return (x.view(int_dtype) + direction).view(x.dtype)


def fp8_grid(fp8_dtype: torch.dtype, in_dtype: torch.dtype) -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours (rounding ties), the values one input ulp
    either side of each, and values past the maximum; both signs; in the input dtype."""
    codes = torch.arange(0, 0x80, dtype=torch.uint8).view(fp8_dtype).float()
    values = torch.unique(codes[torch.isfinite(codes)])
    top = values[-1]
    mids = (values[:-1] + values[1:]) / 2
    beyond = torch.stack([top * 1.0625, top * 1.125, top * 1.5, top * 4, torch.tensor(3e38)])
    grid = torch.cat([values, mids, beyond]).to(in_dtype)
    finite = grid[torch.isfinite(grid) & (grid > 0)]
    grid = torch.cat([grid, next_toward(finite, 1), next_toward(finite, -1)])
    grid = grid[torch.isfinite(grid) | (grid.float().abs() == float("inf"))]
    return torch.cat([grid, -grid])


def make_input(shape, in_dtype, fp8_dtype, variant: str, gen: torch.Generator, offset: bool) -> torch.Tensor:
    numel = math.prod(shape)
    if variant == "grid":
        grid = fp8_grid(fp8_dtype, in_dtype)
        idx = torch.randint(0, grid.numel(), (max(numel, 1),), generator=gen)[:numel]
        flat = grid[idx].float()
    else:
        # Magnitudes over ~2^-24..2^24 per element, and per row a factor 2^-20..2^20, so groups differ.
        flat = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-24, 25, (numel,), generator=gen).float())
        if numel:
            rows = flat.view(-1, shape[-1]) if len(shape) else flat.view(1, 1)
            rows *= torch.exp2(torch.randint(-20, 21, (rows.shape[0], 1), generator=gen).float())
            if rows.shape[0] > 2:
                rows[1] = 0.0  # an all-zero row: q = 1
                rows[2] *= 2.0**-135  # tiny amax: in fp32/bf16, subnormal (q clamps to FLT_MAX)
            if rows.shape[0] > 3 and rows.shape[1] > 200:
                rows[3, 130:200] = 0.0  # an all-zero 1x128 group where K allows one
            flat[torch.randint(0, numel, (max(1, numel // 50),), generator=gen)] = -0.0
        if variant == "special" and numel:
            picks = torch.randint(0, numel, (4,), generator=gen)
            flat[picks[0]] = float("inf")
            flat[picks[1]] = float("-inf")
            flat[picks[2]] = float("nan")
            flat[picks[3]] = 1e-40  # fp32 subnormal
    x = flat.to(in_dtype)
    if offset:
        # Contiguous but not 16-byte aligned: one element into a larger buffer.
        storage = torch.empty(numel + 1, dtype=in_dtype)
        storage[1:] = x
        x = storage[1:]
    return x.view(shape)


def given_tensor(kind: str, x: torch.Tensor, granularity: str, fp8_dtype, variant: str, ref, gen) -> torch.Tensor:
    amax = expected_amax(ref, x, granularity)
    fp8_max = ref.FP8_MAX[fp8_dtype]
    if variant == "grid":
        value = fp8_max if kind == "amax" else 1.0  # q = 1 exactly: the grid's ties stay ties
        return torch.full_like(amax, value)
    factor = torch.exp2(torch.randint(-3, 4, amax.shape, generator=gen).float()) * (
        1 + torch.rand(amax.shape, generator=gen)
    )
    base = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    given = base * factor if kind == "amax" else base / fp8_max * factor
    flat = given.view(-1)
    if variant == "special" and flat.numel() >= 4:
        flat[0] = 0.0  # amax 0 -> q 1; scale 0 -> q inf
        flat[1] = float("inf")
        flat[2] = float("nan")
        flat[3] = 1e-42
    return given


# ----------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------


def same_f32_bits(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return (a.contiguous().view(torch.int32) == e.contiguous().view(torch.int32)) | (torch.isnan(a) & torch.isnan(e))


def compare(name: str, actual, expected, ref) -> str | None:
    """None if equal bit for bit (NaN: any NaN), else a one-line description of the difference."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return None
        expected_what, actual_what = ("None" if t is None else "a tensor" for t in (expected, actual))
        return f"{name}: expected {expected_what}, got {actual_what}"
    actual = actual.cpu()
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"{name}: dtype/shape {actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}"
    if expected.numel() == 0:
        return None
    if expected.dtype in FP8_DTYPES:
        equal = ref.fp8_bits_equal(actual, expected)
        fmt = lambda t, i: f"0x{int(t.reshape(-1).view(torch.uint8)[i]):02x}"  # noqa: E731
    elif expected.dtype == E8M0:
        equal = actual.view(torch.uint8) == expected.view(torch.uint8)
        fmt = lambda t, i: f"0x{int(t.reshape(-1).view(torch.uint8)[i]):02x}"  # noqa: E731
    else:
        equal = same_f32_bits(actual, expected)
        fmt = lambda t, i: f"{float(t.reshape(-1)[i])!r}"  # noqa: E731
    bad = (~equal).reshape(-1).nonzero().flatten()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    index = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), expected.shape)) if expected.dim() else ()
    return (
        f"{name}: {bad.numel()}/{expected.numel()} differ; first at {index}: got {fmt(actual, i)}, "
        f"expected {fmt(expected, i)}"
    )


REFERENCE_NOTES: dict[str, set[str]] = {}  # reference function -> cases it could not compute


def expected_quantize(ref, x, fp8_dtype, granularity, scale, amax, transpose, power_of_two):
    """ref.quantize, or for an empty x it cannot handle, the contract's rule for empty tensors: every
    group has no elements, amax 0 (or the given one), q from it (or 1 / the given scale)."""
    try:
        return ref.quantize(x, fp8_dtype, granularity, scale, amax, transpose, power_of_two)
    except RuntimeError:
        if x.numel() != 0:
            raise
        REFERENCE_NOTES.setdefault("quantize", set()).add(f"{granularity} {list(x.shape)}")

    def groups(shape, given_scale, given_amax):
        layout = ref.scale_shape(shape, granularity)
        out_amax = torch.zeros(layout) if given_amax is None else given_amax.float().clone()
        q = (
            torch.reciprocal(given_scale.float())
            if given_scale is not None
            else ref.quant_scale_from_amax(out_amax, fp8_dtype, power_of_two)
        )
        return torch.reciprocal(q), (torch.zeros(layout) if given_scale is not None else out_amax)

    scale_out, amax_out = groups(tuple(x.shape), scale, amax)
    data_t = scale_t = None
    if transpose:
        rows = math.prod(x.shape[:-1])
        shape_t = (x.shape[-1], rows)

        def t(g):
            return None if g is None else (g.t() if granularity == "block128x128" else g)

        scale_t = groups(shape_t, t(scale), t(amax))[0]
        data_t = torch.empty(shape_t, dtype=fp8_dtype)
    return ref.Quantized(torch.empty(x.shape, dtype=fp8_dtype), scale_out, amax_out, data_t, scale_t)


def expected_amax(ref, x, granularity):
    try:
        return ref.group_amax(x, granularity).float()
    except RuntimeError:
        if x.numel() != 0:
            raise
        REFERENCE_NOTES.setdefault("group_amax", set()).add(f"{granularity} {list(x.shape)}")
        return torch.zeros(ref.scale_shape(tuple(x.shape), granularity))


def output_nbytes(expected) -> list[int]:
    sizes = [expected.data.numel(), expected.scale.numel() * 4, expected.amax.numel() * 4]
    if expected.data_t is not None:
        sizes += [expected.data_t.numel(), expected.scale_t.numel() * 4]
    return sizes


class Poisoner:
    """Fills blocks of the CUDA caching allocator with a byte pattern, then frees them, so that the next
    allocations of those sizes (the op's outputs) start out poisoned. Counts how often that worked."""

    def __init__(self):
        self.hits = 0
        self.outputs = 0

    def run(self, fn, nbytes: list[int], poison: int):
        if DEVICE != "cuda":
            return fn()
        blocks = [torch.full((max(n, 1),), poison, dtype=torch.uint8, device="cuda") for n in nbytes]
        pointers = {b.data_ptr() for b in blocks}
        del blocks
        result = fn()
        tensors = [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if t is not None]
        self.outputs += len(tensors)
        self.hits += sum(t.data_ptr() in pointers for t in tensors)
        return result


# ----------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------


def shapes_for(quick: bool):
    # (shape, unaligned storage)
    shapes = [
        ((0,), False),
        ((0, 5), False),
        ((5, 0), False),
        ((2, 0, 3), False),
        ((), False),
        ((1,), False),
        ((7,), False),
        ((300,), False),
        ((1, 1), False),
        ((3, 5), False),
        ((517, 8), False),
        ((9, 3), False),
        ((127, 129), False),
        ((128, 128), False),
        ((129, 255), False),
        ((33, 1000), False),
        ((2, 3, 130), False),
        ((256, 384), False),
        ((1023, 257), False),
        ((64, 4097), False),
        ((5, 9000), False),
        ((40, 300), True),
        ((131, 256), True),
    ]
    if quick:
        keep = {(), (7,), (3, 5), (517, 8), (127, 129), (129, 255), (2, 3, 130), (1023, 257), (5, 9000), (0, 5), (5, 0)}
        shapes = [(s, o) for s, o in shapes if s in keep or o]
    return shapes


def valid_case(shape, granularity: str, source: str, transpose: bool) -> bool:
    dims = len(shape)
    if granularity in ("rowwise", "block1x128") and dims < 1:
        return False
    if granularity == "block128x128" and dims < 2:
        return False
    if transpose and dims < 2:
        return False
    # rejected by the op (checked separately)
    return not (transpose and source != "current" and granularity in ("rowwise", "block1x128"))


class OutOfTime(Exception):
    pass


DEADLINE = [math.inf]  # time.perf_counter() after which the checks stop (--check-seconds)


def check_quantize(ref, quick: bool, failures: list, poisoner: Poisoner) -> int:
    gen = torch.Generator().manual_seed(1234)
    cases = 0
    for (shape, offset), in_dtype, fp8_dtype, granularity, (source, power_of_two), transpose in itertools.product(
        shapes_for(quick), INPUT_DTYPES, FP8_DTYPES, GRANULARITIES, SCALE_MODES, (False, True)
    ):
        if not valid_case(shape, granularity, source, transpose):
            continue
        if time.perf_counter() > DEADLINE[0]:
            raise OutOfTime(f"after {cases} quantize cases, at shape {list(shape)}")
        variants = ("wide", "special", "grid") if source != "current" or not quick else ("wide", "special")
        for variant in variants:
            x_cpu = make_input(shape, in_dtype, fp8_dtype, variant, gen, offset)
            scale = amax = None
            if source == "scale":
                scale = given_tensor("scale", x_cpu, granularity, fp8_dtype, variant, ref, gen)
            elif source == "amax":
                amax = given_tensor("amax", x_cpu, granularity, fp8_dtype, variant, ref, gen)
            cases += 1
            label = (
                f"{granularity} {str(in_dtype)[6:]}->{str(fp8_dtype)[6:]} {list(shape)}"
                f"{' unaligned' if offset else ''} "
                f"{source}{' pow2' if power_of_two else ''}{' T' if transpose else ''} {variant}"
            )
            expected = expected_quantize(ref, x_cpu, fp8_dtype, granularity, scale, amax, transpose, power_of_two)
            x = to_device(x_cpu, offset)
            args = (
                x,
                fp8_dtype,
                granularity,
                None if scale is None else scale.to(DEVICE),
                None if amax is None else amax.to(DEVICE),
                transpose,
                power_of_two,
            )
            for poison in POISONS:
                try:
                    out = poisoner.run(lambda: quantize_op(*args), output_nbytes(expected), poison)
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
                except Exception as error:
                    failures.append(f"{label}: raised {type(error).__name__}: {str(error).splitlines()[0]}")
                    break
                problems = [
                    compare(name, got, want, ref)
                    for name, got, want in zip(("data", "scale", "amax", "data_t", "scale_t"), out, expected)
                ]
                problems = [p for p in problems if p]
                if problems:
                    failures.append(f"{label} (poison 0x{poison:02x}): " + "; ".join(problems))
                    break
    return cases


def to_device(x_cpu: torch.Tensor, offset: bool) -> torch.Tensor:
    """x on DEVICE; with offset, contiguous but not 16-byte aligned (one element into a larger buffer)."""
    if not offset:
        return x_cpu.to(DEVICE)
    storage = torch.empty(x_cpu.numel() + 1, dtype=x_cpu.dtype, device=DEVICE)
    storage[1:] = x_cpu.reshape(-1).to(DEVICE)
    x = storage[1:].view(x_cpu.shape)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    return x


def check_large(ref, failures: list, poisoner: Poisoner) -> int:
    """Shapes with more work than one grid holds (the kernels' grid-stride loops), aligned and not."""
    gen = torch.Generator().manual_seed(99)
    cases = 0
    for shape, in_dtype, granularity, (source, power_of_two), transpose in itertools.product(
        ((2112, 4224), (1999, 3001)),
        (torch.bfloat16, torch.float32),
        GRANULARITIES,
        (("current", False), ("scale", False)),
        (False, True),
    ):
        if not valid_case(shape, granularity, source, transpose):
            continue
        x_cpu = make_input(shape, in_dtype, E4M3, "wide", gen, False)
        scale = given_tensor("scale", x_cpu, granularity, E4M3, "wide", ref, gen) if source == "scale" else None
        expected = ref.quantize(x_cpu, E4M3, granularity, scale, None, transpose, power_of_two)
        label = f"large {granularity} {str(in_dtype)[6:]} {list(shape)} {source}{' T' if transpose else ''}"
        args = (
            x_cpu.to(DEVICE),
            E4M3,
            granularity,
            None if scale is None else scale.to(DEVICE),
            None,
            transpose,
            power_of_two,
        )
        cases += 1
        try:
            out = poisoner.run(lambda: quantize_op(*args), output_nbytes(expected), POISONS[0])
        except Exception as error:
            failures.append(f"{label}: raised {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        names = ("data", "scale", "amax", "data_t", "scale_t")
        problems = [compare(n, g, w, ref) for n, g, w in zip(names, out, expected)]
        problems = [p for p in problems if p]
        if problems:
            failures.append(f"{label}: " + "; ".join(problems))
    return cases


def check_amax(ref, quick: bool, failures: list, poisoner: Poisoner) -> int:
    gen = torch.Generator().manual_seed(4321)
    cases = 0
    shapes = shapes_for(quick) + [((2112, 4224), False)]
    for (shape, offset), in_dtype, granularity, variant in itertools.product(
        shapes, INPUT_DTYPES, GRANULARITIES, ("wide", "special")
    ):
        if not valid_case(shape, granularity, "current", False):
            continue
        x_cpu = make_input(shape, in_dtype, E4M3, variant, gen, offset)
        expected = expected_amax(ref, x_cpu, granularity)
        x = to_device(x_cpu, offset)
        cases += 1
        label = f"amax {granularity} {str(in_dtype)[6:]} {list(shape)}{' unaligned' if offset else ''} {variant}"
        try:
            got = poisoner.run(lambda: torch.ops.fastmesh.amax(x, granularity), [expected.numel() * 4], POISONS[1])
        except Exception as error:
            failures.append(f"{label}: raised {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        problem = compare("amax", got, expected, ref)
        if problem:
            failures.append(f"{label}: {problem}")
    # Non-contiguous input (read through a contiguous copy).
    x_cpu = make_input((64, 300), torch.bfloat16, E4M3, "wide", gen, False).t()
    for granularity in GRANULARITIES:
        problem = compare(
            "amax", torch.ops.fastmesh.amax(x_cpu.to(DEVICE), granularity), ref.group_amax(x_cpu, granularity), ref
        )
        cases += 1
        if problem:
            failures.append(f"amax {granularity} non-contiguous: {problem}")
    return cases


def check_rejections(failures: list) -> int:
    """Calls the contract forbids must raise (on CUDA as on CPU), not run."""
    d = DEVICE
    x = torch.randn(4, 300, device=d)
    bad = [
        ("rowwise + transpose + given scale", (x, E4M3, "rowwise", torch.ones(4, 1, device=d), None, True, False)),
        ("block1x128 + transpose + given amax", (x, E4M3, "block1x128", None, torch.ones(4, 3, device=d), True, False)),
        ("scale and amax", (x, E4M3, "tensorwise", torch.ones((), device=d), torch.ones((), device=d), False, False)),
        ("scale shape", (x, E4M3, "rowwise", torch.ones(4, device=d), None, False, False)),
        ("scale float64", (x, E4M3, "rowwise", torch.ones(4, 1, device=d, dtype=torch.float64), None, False, False)),
        ("block128x128 on 1-d", (x[0], E4M3, "block128x128", None, None, False, False)),
        ("fp16 target", (x, torch.float16, "rowwise", None, None, False, False)),
        ("unknown granularity", (x, E4M3, "colwise", None, None, False, False)),
    ]
    if d == "cuda":
        bad.append(("scale on cpu", (x, E4M3, "rowwise", torch.ones(4, 1), None, False, False)))
    if quantize_op is _quantize_native:
        # The kernels read x as row-major; the public op copies a strided x first, the native op refuses it.
        bad.append(("non-contiguous x", (x.t(), E4M3, "rowwise", None, None, False, False)))
    for name, args in bad:
        try:
            quantize_op(*args)
            failures.append(f"rejection '{name}': the call ran instead of raising")
        except (TypeError, ValueError, RuntimeError):
            pass
    return len(bad)


# ----------------------------------------------------------------------------------------------------
# The MX cast (fastmesh::mx_quantize)
# ----------------------------------------------------------------------------------------------------


def mx_shapes_for(quick: bool):
    # (shape, unaligned storage): 32 divides the last dim; odd row counts; rows and columns past a tile.
    shapes = [
        ((0, 32), False),
        ((7, 0), False),
        ((32,), False),
        ((1, 32), False),
        ((3, 96), False),
        ((33, 160), False),
        ((64, 32), False),
        ((2, 5, 64), False),
        ((2, 16, 64), False),
        ((96, 160), False),
        ((130, 288), False),
        ((1024, 1056), False),
        ((160, 4096), False),
        ((40, 320), True),
        ((96, 256), True),
    ]
    if quick:
        keep = {(7, 0), (32,), (3, 96), (33, 160), (2, 16, 64), (96, 160), (130, 288), (1024, 1056)}
        shapes = [(s, o) for s, o in shapes if s in keep or o]
    return shapes


def mx_edges(shape, in_dtype, fp8_dtype, gen: torch.Generator) -> torch.Tensor:
    """Blocks of 32 whose amax is a power of two 2^e, fp8_max * 2^e or one input ulp either side of them (where
    the rules' exponents step), the rest of each block random below it; random signs."""
    numel = math.prod(shape)
    finfo = torch.finfo(in_dtype)
    smallest = finfo.smallest_normal * finfo.eps
    exponents = torch.arange(math.floor(math.log2(smallest)), math.floor(math.log2(finfo.max)) + 1).double()
    fp8_max = 448.0 if fp8_dtype == E4M3 else 57344.0
    bases = torch.cat([torch.exp2(exponents), fp8_max * torch.exp2(exponents)])
    bases = bases[(bases >= smallest) & (bases <= finfo.max)].to(in_dtype)
    edges = torch.cat([bases, next_toward(bases, 1), next_toward(bases, -1)])
    edges = edges[torch.isfinite(edges.float()) & (edges.float() > 0)]
    blocks = max(numel // 32, 1)
    amax = edges[torch.randint(0, edges.numel(), (blocks,), generator=gen)].float()
    x = torch.rand(blocks, 32, generator=gen) * amax[:, None]
    x[torch.arange(blocks), torch.randint(0, 32, (blocks,), generator=gen)] = amax
    x *= torch.where(torch.rand(blocks, 32, generator=gen) < 0.5, -1.0, 1.0)
    return x.reshape(-1)[:numel].to(in_dtype).view(shape)


def expected_mx(mx_ref, x: torch.Tensor, fp8_dtype, rounding: str, transpose: bool):
    """mx_reference.quantize_mx of x as [M, K], its row-wise outputs in x's layout."""
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    want = mx_ref.quantize_mx(x.reshape(rows, k), fp8_dtype, rounding, transpose)
    scale_shape = (*x.shape[:-1], k // 32)
    return want._replace(
        data=want.data.reshape(x.shape), scale=want.scale.reshape(scale_shape), amax=want.amax.reshape(scale_shape)
    )


def mx_output_nbytes(expected) -> list[int]:
    sizes = [expected.data.numel(), expected.scale.numel(), expected.amax.numel() * 4]
    if expected.data_t is not None:
        sizes += [expected.data_t.numel(), expected.scale_t.numel()]
    return sizes


def check_mx(ref, mx_ref, quick: bool, failures: list, poisoner: Poisoner) -> int:
    """The MX cast against kernels/mx_reference.py: shapes x input dtypes x FP8 dtypes x roundings x transpose
    (where 32 divides the rows) x data (wide range with zeros and tiny rows, +-inf / NaN / subnormals, the FP8
    grid and its ties, amax at and around the rules' powers of two), twice on poisoned output memory."""
    gen = torch.Generator().manual_seed(2468)
    cases = 0
    variants = ("wide", "special", "edges") if quick else ("wide", "special", "grid", "edges")
    for (shape, offset), in_dtype, fp8_dtype, rounding, transpose in itertools.product(
        mx_shapes_for(quick), INPUT_DTYPES, FP8_DTYPES, MX_ROUNDINGS, (False, True)
    ):
        if transpose and (len(shape) < 2 or math.prod(shape[:-1]) % 32):
            continue
        if time.perf_counter() > DEADLINE[0]:
            raise OutOfTime(f"after {cases} MX cases, at shape {list(shape)}")
        for variant in variants:
            if variant == "edges":
                x_cpu = mx_edges(shape, in_dtype, fp8_dtype, gen)
            else:
                x_cpu = make_input(shape, in_dtype, fp8_dtype, variant, gen, False)
            expected = expected_mx(mx_ref, x_cpu, fp8_dtype, rounding, transpose)
            x = to_device(x_cpu, offset)
            label = (
                f"mx {rounding} {str(in_dtype)[6:]}->{str(fp8_dtype)[6:]} {list(shape)}"
                f"{' unaligned' if offset else ''}{' T' if transpose else ''} {variant}"
            )
            cases += 1
            for poison in POISONS:
                try:
                    out = poisoner.run(
                        lambda: mx_op(x, fp8_dtype, rounding, transpose), mx_output_nbytes(expected), poison
                    )
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
                except Exception as error:
                    failures.append(f"{label}: raised {type(error).__name__}: {str(error).splitlines()[0]}")
                    break
                names = ("data", "scale", "amax", "data_t", "scale_t")
                problems = [p for p in (compare(n, g, w, ref) for n, g, w in zip(names, out, expected)) if p]
                if problems:
                    failures.append(f"{label} (poison 0x{poison:02x}): " + "; ".join(problems))
                    break
    return cases


def check_mx_rejections(failures: list) -> int:
    d = DEVICE
    bad = [
        ("last dim 48", (torch.randn(4, 48, device=d), E4M3, "floor", False)),
        ("transpose, 4 rows", (torch.randn(4, 64, device=d), E4M3, "floor", True)),
        ("float64 x", (torch.randn(32, 64, device=d, dtype=torch.float64), E4M3, "floor", False)),
        ("fp16 target", (torch.randn(32, 64, device=d), torch.float16, "floor", False)),
        ("rounding 'ceil'", (torch.randn(32, 64, device=d), E4M3, "ceil", False)),
    ]
    for name, args in bad:
        try:
            mx_op(*args)
            failures.append(f"MX rejection '{name}': the call ran instead of raising")
        except (TypeError, ValueError, RuntimeError):
            pass
    return len(bad)


def run_rejections(mx_loaded: bool) -> int:
    """--rejections-only (the child of start_rejections_child): the rejected-call checks, reported as one JSON line."""
    failures: list[str] = []
    counts = {"rejected calls": check_rejections(failures)}
    if mx_loaded:
        counts["rejected MX calls"] = check_mx_rejections(failures)
    print(json.dumps({"counts": counts, "failures": failures}))
    return 1 if failures else 0


def start_rejections_child(args) -> subprocess.Popen:
    command = [sys.executable, os.path.abspath(__file__), "--rejections-only", "--impl", args.impl, "--device", DEVICE]
    if args.library:
        command += ["--library", args.library]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_rejections_child(child: subprocess.Popen, failures: list, timeout_s: float = 120) -> dict:
    """The child's counts; its failures appended to ``failures``, and one failure if it died or said nothing."""
    try:
        output, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        output, _ = child.communicate()
    lines = output.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        code = child.returncode
        how = f"died by signal {-code}" if code is not None and code < 0 else f"exited {code}"
        tail = " | ".join(lines[-3:]) or "no output"
        failures.append(f"rejected calls NOT CHECKED: the checking process {how} before reporting ({tail})")
        return {}
    failures.extend(report["failures"])
    return report["counts"]


# ----------------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------------


def time_ms(fn, repeats: int, warmup: int = 5) -> tuple[float, float]:
    """Median and interquartile range (ms) of one eager call on an idle GPU, CUDA events around it: the kernels'
    time plus whatever of the host's launch work the GPU waits for."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


GRAPH_CALLS = 10


def time_graph_ms(fn, repeats: int) -> tuple[float, float]:
    """Median and interquartile range (ms) of one call inside a CUDA graph of GRAPH_CALLS calls, replayed: the
    kernels' time alone (host launch work is out of it), which is what the bandwidth target is about."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except RuntimeError as error:  # e.g. a host sync inside the call: reported, and the eager time still stands
        print(f"  (no CUDA graph: {type(error).__name__}: {str(error).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return math.nan, math.nan
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPH_CALLS)
    del graph
    torch.cuda.empty_cache()
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


def timed_row(name: str, fn, nbytes: int, copy_gbs: float, repeats: int) -> tuple:
    """(name, eager ms, graph ms, graph IQR ms, GB/s and % of copy from the graph time)."""
    eager_ms, _ = time_ms(fn, repeats)
    ms, iqr = time_graph_ms(fn, repeats)
    gbs = nbytes / ms / 1e6
    return (name, eager_ms, ms, iqr, gbs, 100 * gbs / copy_gbs)


def output_bytes(out) -> int:
    return sum(t.numel() * t.element_size() for t in out if t is not None)


def bench_input() -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(7)
    return (
        torch.randn(8192, 8192, device="cuda", generator=gen)
        * torch.exp2(torch.randint(-8, 9, (8192, 1), device="cuda", generator=gen).float())
    ).to(torch.bfloat16)


def copy_row(x: torch.Tensor, repeats: int) -> tuple:
    """The bound's row: a device-to-device copy of x (bytes read + written), 100% by definition."""
    copy_out = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    *row, _ = timed_row("device-to-device copy (bound)", lambda: copy_out.copy_(x), nbytes, 1.0, repeats)
    return (*row, 100.0)


def bench(ref, mx_ref, repeats: int) -> list[tuple]:
    x = bench_input()
    rows = [copy_row(x, repeats)]
    copy_gbs = rows[0][4]
    rows.append(
        timed_row(
            "fastmesh.amax tensorwise (read only)",
            lambda: torch.ops.fastmesh.amax(x, "tensorwise"),
            x.numel() * x.element_size(),
            copy_gbs,
            repeats,
        )
    )
    scale_given = torch.ones((), device="cuda")
    for granularity, transpose, given in [(g, False, False) for g in GRANULARITIES] + [
        ("tensorwise", False, True),
        ("tensorwise", True, False),
        ("rowwise", True, False),
        ("block1x128", True, False),
        ("block128x128", True, False),
    ]:
        scale = scale_given if given else None

        def call(granularity=granularity, scale=scale, transpose=transpose):
            return quantize_op(x, E4M3, granularity, scale, None, transpose, False)

        nbytes = x.numel() * x.element_size() + output_bytes(call())
        name = f"{granularity}{' given scale' if given else ''}{' +transpose' if transpose else ''}"
        rows.append(timed_row(name, call, nbytes, copy_gbs, repeats))
    if mx_ref is not None:
        for rounding, transpose in (("floor", False), ("rceil", False), ("floor", True), ("rceil", True)):

            def mx_call(rounding=rounding, transpose=transpose):
                return mx_op(x, E4M3, rounding, transpose)

            nbytes = x.numel() * x.element_size() + output_bytes(mx_call())
            name = f"mx {rounding}{' +transpose' if transpose else ''}"
            rows.append(timed_row(name, mx_call, nbytes, copy_gbs, repeats))
    # Context: the plain-PyTorch reference on the GPU (several kernels, fp32 intermediates).
    nbytes = x.numel() * (x.element_size() + 1)
    rows.append(
        timed_row(
            "reference rowwise (eager torch)", lambda: ref.quantize(x, E4M3, "rowwise"), nbytes, copy_gbs, repeats // 5
        )
    )
    if mx_ref is not None:
        nbytes = x.numel() * (x.element_size() + 1) + x.numel() // 32 * 5
        rows.append(
            timed_row(
                "reference mx floor (eager torch)",
                lambda: mx_ref.quantize_mx(x, E4M3, "floor"),
                nbytes,
                copy_gbs,
                repeats // 5,
            )
        )
    return rows


# The Triton kernels' work per program, as module settings of kernels/fp8_quantize.py and kernels/mx_quantize.py that
# their launchers read at each call: (module, setting, values). The first value of each is the one the code has.
SWEEP = (
    ("mx_quantize", "_FLAT_BLOCKS", (128, 64, 256, 1024)),
    ("mx_quantize", "_FLAT_WARPS", (8, 4, 16)),
    ("mx_quantize", "_BLOCK_M", (32, 64, 128)),
    ("mx_quantize", "_BLOCK_K", (128, 256)),
    ("mx_quantize", "_TRANSPOSE_WARPS", (4, 2, 8)),
    ("fp8_quantize", "_FLAT_BLOCK", (4096, 2048, 8192, 16384)),
    ("fp8_quantize", "_TRANSPOSE_TILE", (64, 32, 128)),
    ("fp8_quantize", "_BLOCK1X128_ROWS", (32, 16, 64)),
    ("fp8_quantize", "_ROW_BLOCK", (8192, 4096, 16384)),
    ("fp8_quantize", "_LARGE_TILE_WARPS", (8, 4, 16)),
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def sweep(repeats: int) -> list[tuple]:
    """Each Triton work-per-program setting through its values (the others at their defaults), timed on the cases it
    governs; each variant's output bytes must equal the default's, or the row says MISMATCH."""
    from fastmesh.kernels import fp8_quantize as fq
    from fastmesh.kernels import mx_quantize as mq

    modules = {"fp8_quantize": fq, "mx_quantize": mq}
    x = bench_input()
    rows = [copy_row(x, repeats)]
    copy_gbs = rows[0][4]
    cases = {
        "_FLAT_BLOCKS": [("mx floor", lambda: _mx_triton(x, E4M3, "floor", False))],
        "_BLOCK_M": [("mx floor +transpose", lambda: _mx_triton(x, E4M3, "floor", True))],
        "_FLAT_BLOCK": [("tensorwise", lambda: _quantize_triton(x, E4M3, "tensorwise", None, None, False, False))],
        "_TRANSPOSE_TILE": [
            ("tensorwise +transpose", lambda: _quantize_triton(x, E4M3, "tensorwise", None, None, True, False)),
            ("rowwise +transpose", lambda: _quantize_triton(x, E4M3, "rowwise", None, None, True, False)),
        ],
        "_BLOCK1X128_ROWS": [("block1x128", lambda: _quantize_triton(x, E4M3, "block1x128", None, None, False, False))],
        "_ROW_BLOCK": [("rowwise", lambda: _quantize_triton(x, E4M3, "rowwise", None, None, False, False))],
    }
    cases["_LARGE_TILE_WARPS"] = [
        (f"{granularity} +transpose", lambda g=granularity: _quantize_triton(x, E4M3, g, None, None, True, False))
        for granularity in ("block1x128", "block128x128")
    ]
    cases["_FLAT_WARPS"] = cases["_FLAT_BLOCKS"]
    cases["_BLOCK_K"] = cases["_TRANSPOSE_WARPS"] = cases["_BLOCK_M"]
    for module_name, setting, values in SWEEP:
        module = modules[module_name]
        default = getattr(module, setting)
        try:
            for name, call in cases[setting]:
                setattr(module, setting, default)
                want = call()
                for value in values:
                    setattr(module, setting, value)
                    label = f"{name}: {setting}={value}{' (default)' if value == default else ''}"
                    try:
                        got = call()
                        # The same kernel source writes the same NaN bytes: the outputs' bytes must be equal.
                        same = all(a is None or bool(torch.equal(_bytes(a), _bytes(b))) for a, b in zip(got, want))
                        nbytes = x.numel() * x.element_size() + output_bytes(got)
                        row = timed_row(label, call, nbytes, copy_gbs, repeats)
                        rows.append(row if same else (f"{label} MISMATCH", *row[1:]))
                    except Exception as error:  # a variant that does not compile or launch is reported, not fatal
                        rows.append((f"{label} FAILED {type(error).__name__}: {str(error)[:80]}", 0, 0, 0, 0, 0))
        finally:
            setattr(module, setting, default)
    return rows


def print_rows(rows: list[tuple]) -> None:
    print(f"{'case':58s} {'eager ms':>9s} {'graph ms':>9s} {'IQR ms':>7s} {'GB/s':>7s} {'% of copy':>10s}")
    for name, eager_ms, ms, iqr, gbs, percent in rows:
        print(f"{name:58s} {eager_ms:9.3f} {ms:9.3f} {iqr:7.3f} {gbs:7.0f} {percent:9.0f}%")


# ----------------------------------------------------------------------------------------------------


def describe_machine(source: str) -> None:
    try:
        commit = (
            subprocess.run(
                ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "?"
        )
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--", "csrc", "bench"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        commit += " (+local changes)" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(
            f"GPU: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
            f"capability {props.major}.{props.minor}"
        )
    else:
        print(f"DRY RUN on the CPU kernels ({platform.processor() or 'cpu'}, {torch.get_num_threads()} threads)")
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}, "
        f"{platform.platform()}"
    )
    print(f"ops: {source}; repository commit {commit}")


def _quantize_native(*args):
    return torch.ops.fastmesh.fp8_quantize_native(*args)


def _quantize_triton(*args):
    # The public op with FASTMESH_FP8_CUDA_IMPL=triton (set in main); it returns empty data_t/scale_t
    # where the native op returns None.
    data, scale, amax, data_t, scale_t = torch.ops.fastmesh.fp8_quantize(*args)
    return (data, scale, amax, data_t, scale_t) if args[5] else (data, scale, amax, None, None)


quantize_op = _quantize_native


def _mx_native(x, dtype, rounding, transpose):
    return torch.ops.fastmesh.mx_quantize_native(x, dtype, rounding, transpose)


def _mx_triton(x, dtype, rounding, transpose):
    # The public op with FASTMESH_FP8_CUDA_IMPL=triton; empty data_t/scale_t where the native op returns None.
    data, scale, amax, data_t, scale_t = torch.ops.fastmesh.mx_quantize(x, dtype, rounding, transpose)
    return (data, scale, amax, data_t, scale_t) if transpose else (data, scale, amax, None, None)


mx_op = _mx_native


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and data variants")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the Triton kernels' work-per-program settings (--impl triton)"
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--check-seconds",
        type=float,
        default=420,
        help="stop the correctness checks after this long (reported as INCOMPLETE, exit status 4)",
    )
    parser.add_argument("--library", help="load the ops from this shared library instead of importing fastmesh")
    parser.add_argument(
        "--rejections-only", action="store_true", help=argparse.SUPPRESS
    )  # the child process of the checks
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: dry run of the checks on the CPU kernels (tests this script; no benchmark)",
    )
    parser.add_argument(
        "--impl",
        default="cuda",
        choices=["cuda", "triton"],
        help="which CUDA implementation to check: the CUDA C++ kernels (fp8_quantize_native) or "
        "the Triton kernels (fp8_quantize with FASTMESH_FP8_CUDA_IMPL=triton)",
    )
    args = parser.parse_args()

    global DEVICE, quantize_op, mx_op
    if args.impl == "triton":
        os.environ["FASTMESH_FP8_CUDA_IMPL"] = "triton"
        quantize_op = _quantize_triton
        mx_op = _mx_triton
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible", file=sys.stderr)
        return 2
    if args.sweep and args.impl != "triton":
        parser.error("--sweep times the Triton kernels: add --impl triton")
    if DEVICE != "cuda":
        args.skip_bench = True
        args.sweep = False
    try:
        source = load_ops(args.library)
        ref = load_reference()
    except Exception as error:
        print(f"setup failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    mx_ref = load_mx_reference()
    if args.rejections_only:
        return run_rejections(not isinstance(mx_ref, str))
    describe_machine(source)
    mx_not_checked = None
    if isinstance(mx_ref, str):
        mx_not_checked = f"MX cast NOT CHECKED: kernels/mx_reference.py did not load ({mx_ref})"
        mx_ref = None

    reference_patched = False
    if not reference_self_check(ref):
        reference_patched = True
        print(
            "WARNING: fp8_reference.quant_scale_from_amax is not one IEEE division (torch's float / Tensor is "
            "reciprocal(amax) * fp8_max, two roundings); checking against fp8_max / amax instead, as "
            "fastmesh/fp8_math.h specifies. Fix kernels/fp8_reference.py: "
            "torch.full_like(amax, FP8_MAX[dtype]) / amax"
        )
        ref.quant_scale_from_amax = lambda amax, dtype, pow2: ieee_quant_scale_from_amax(amax, dtype, pow2, ref)

    failures: list[str] = []
    incomplete = None
    if not args.skip_check:
        poisoner = Poisoner()
        started = time.perf_counter()
        DEADLINE[0] = started + args.check_seconds
        counts = {}
        # The rejected calls run in a child process beside the checks below: a crash while raising (on the
        # 2026-12-04 GPU image every C++ error message formatting an integer crashed the process) must not take
        # the correctness results with it.
        rejections = start_rejections_child(args)
        counts["amax"] = check_amax(ref, args.quick, failures, poisoner)
        counts[f"{quantize_op.__name__.lstrip('_')}, large"] = check_large(ref, failures, poisoner)
        try:
            if mx_ref is not None:
                counts[mx_op.__name__.lstrip("_")] = check_mx(ref, mx_ref, args.quick, failures, poisoner)
            counts[quantize_op.__name__.lstrip("_")] = check_quantize(ref, args.quick, failures, poisoner)
        except OutOfTime as stop:
            incomplete = f"correctness checks INCOMPLETE: out of time (--check-seconds {args.check_seconds:.0f}) {stop}"
        counts.update(finish_rejections_child(rejections, failures))
        print(
            f"\ncorrectness ({time.perf_counter() - started:.0f} s): "
            + ", ".join(f"{n} {name}" for name, n in counts.items())
            + f"; outputs landing in poisoned memory: {poisoner.hits}/{poisoner.outputs}"
        )
        for line in failures[:40]:
            print("  MISMATCH", line)
        if len(failures) > 40:
            print(f"  ... and {len(failures) - 40} more")
        if incomplete:
            print(incomplete)
        if mx_not_checked:
            print(mx_not_checked)
            incomplete = incomplete or mx_not_checked
        verdict = "FAIL" if failures else "all bit-identical to the reference" + (" (so far)" if incomplete else "")
        print("correctness:", verdict)

    if not args.skip_bench:
        print(
            "\nbandwidth, 8192 x 8192 bfloat16 -> float8_e4m3fn (current scaling unless noted); logical bytes = "
            "x read once + outputs written once; copy counts read + write"
        )
        print(
            f"eager ms: one call on an idle GPU (CUDA events; host launch work included); graph ms: one call of a CUDA "
            f"graph of {GRAPH_CALLS} (kernels alone), whose time gives GB/s and % of copy"
        )
        print_rows(bench(ref, mx_ref, args.repeats))
        print("target: >= 85% of copy for the one-pass cases (tensorwise current scaling reads x twice by contract)")
        if mx_not_checked:
            print(mx_not_checked)
    if args.sweep:
        print("\nTriton work per program (one setting at a time, the others at their defaults; 8192 x 8192 bfloat16):")
        print_rows(sweep(args.repeats))

    for function, cases in sorted(REFERENCE_NOTES.items()):
        print(
            f"REFERENCE: fp8_reference.{function} raises for these empty inputs, checked against the contract's "
            f"rule for empty tensors instead (amax 0 or the given one): {', '.join(sorted(cases))}"
        )
    if failures:
        return 1
    if reference_patched or REFERENCE_NOTES:
        return 3
    return 4 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())

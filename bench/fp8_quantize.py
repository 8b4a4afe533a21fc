"""FP8 cast-and-scale and amax, one process: fastmesh against eager PyTorch, torch.compile, torchao and memory bounds.

``fp8_quantize``, per input size, dtype and granularity (plus the given-scale path):

* ``fastmesh``: ``fastmesh.fp8.quantize`` (the kernel);
* ``eager``: the same math in ordinary torch ops, its result written into a preallocated FP8 tensor;
* ``compile``: that function under ``torch.compile`` (inductor's fused C++ on CPU, Triton on GPU);
* ``torchao``: torchao's dynamic float8 cast (tensor-wise and row-wise, when torchao is installed);

and for the MX cast (``granularity="mx"``, e4m3, FLOOR and RCEIL scales): ``eager``/``compile`` the MX rules in
torch ops (``eager_mx``), ``torchao`` and ``torchao_compile`` torchao's ``to_mx`` eager and under
``torch.compile``. The FP8 data and E8M0 scales of every baseline are checked against fastmesh's (torchao's
RCEIL away from its fp32 ``log2`` rounding, ``torchao_baselines.mx_cast``).
* ``copy`` (part): ``y.copy_(x)`` into a preallocated tensor of x's dtype, measured in the same run; ``bound``: the
  kernel's bytes at the copy's bandwidth (the copy's time x kernel bytes / copy bytes, per round).

GB/s counts logical bytes: the input read once and the FP8 data written once (the copy: read and written once).
Every result is checked against ``fastmesh.kernels.fp8_reference`` (fastmesh: bit-exact) or against fastmesh's
(the baselines) before timing. Each timed call follows an untimed call of the same contender (``settle``): these
calls are short, and the one before would otherwise leave its write-backs to the next.

``amax``: ``fastmesh.amax`` against ``x.abs().amax()`` eager and compiled; its bound is the read bandwidth,
measured as the ``max()`` of x's own bytes viewed as int32 (a reduction torch vectorizes at memory speed; 16-bit
float reductions are compute-bound on CPU, and a separate buffer of the same size measured up to 2x slower than
x itself in these rounds on the dev VM, where x stays warm from the other contenders).
"""

from __future__ import annotations

import torch
from fastmesh.bench import torchao_baselines
from fastmesh.bench.family import Context, Family
from fastmesh.bench.figures import Case, Contender
from fastmesh.bench.timing import time_interleaved
from fastmesh.kernels import fp8_reference as ref
from fastmesh.kernels import mx_reference as mx_ref

import fastmesh

E4M3 = torch.float8_e4m3fn
# [rows, cols]; both multiples of 128 (the block granularities). Sizes span cache-resident to memory-bound.
QUICK_SIZES = ["4096x4096"]
FULL_SIZES = ["1024x1024", "2048x4096", "4096x8192"]
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_size(spec: str, world: int = 1) -> tuple[int, int]:
    try:
        rows, cols = (int(s) for s in spec.split("x"))
    except ValueError:
        raise ValueError(f'size {spec!r}: expected "ROWSxCOLS", e.g. "4096x8192"') from None
    if rows <= 0 or cols <= 0 or rows % 128 or cols % 128:
        raise ValueError(f"size {spec!r}: rows and cols must be positive multiples of 128 (the block granularities)")
    return rows, cols


def _exact_divide(numerator, denominator):
    """The correctly rounded float32 quotient, which the contract asks for: divided in float64, then rounded (53 >=
    2 * 24 + 2 bits, so the double rounding is harmless). A float32 division that inductor compiles for a GPU is
    Triton's approximate one, and the compiled baseline would then differ from fastmesh's bits."""
    return (numerator.double() / denominator.double()).float()


def eager_quantize(x, granularity, out, scale=None):
    """Plain-PyTorch quantize of a [M, K] x (dims divisible by 128) into the preallocated ``out``."""
    m, k = x.shape
    if scale is not None:
        q = _exact_divide(torch.ones_like(scale), scale)
    else:
        a = x.abs()
        if granularity == "tensorwise":
            amax = a.amax().float()
        elif granularity == "rowwise":
            amax = a.amax(dim=-1, keepdim=True).float()
        elif granularity == "block1x128":
            amax = a.view(m, k // 128, 128).amax(dim=-1).float()
        else:
            amax = a.view(m // 128, 128, k // 128, 128).amax(dim=(1, 3)).float()
        q = torch.where(amax == 0, 1.0, _exact_divide(torch.full_like(amax, 448.0), amax))
    if granularity == "block1x128":
        q = q.repeat_interleave(128, dim=-1)
    elif granularity == "block128x128":
        q = q.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    out.copy_((x.float() * q).clamp(-448.0, 448.0))
    return out


def eager_mx(x, rounding, out):
    """The MX cast of a [M, K] x (32 | K) in plain torch ops, the data written into ``out``; returns (data, E8M0
    scale bytes). The rules of ``kernels/mx_reference.py`` on the fp32 bits, for e4m3 (emax 8, max 448)."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    if rounding == "floor":
        e = (((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 8).clamp(-127, 128)
        bits = torch.where(amax.isnan(), 255, e + 127)
        q = torch.where(bits == 0, 2.0**126, ((254 - bits).clamp(min=1) << 23).view(torch.float32))
        q = torch.where(bits >= 254, torch.where(bits == 254, 2.0**-127, 0.0), q)
    else:
        d = _exact_divide(amax, torch.full_like(amax, 448.0)).view(torch.int32)
        field, mantissa = d >> 23, d & 0x7FFFFF
        e = torch.where(field != 0, field - 127 + (mantissa != 0).int(), torch.where(mantissa > 2**22, -126, -127))
        bits = torch.where(amax.isnan(), 255, torch.where(field == 255, 254, e.clamp(-127, 127) + 127)).int()
        q = torch.where(bits == 0, 1.0, ((254 - bits).clamp(min=1) << 23).view(torch.float32))
        q = torch.where(bits >= 254, torch.where(bits == 254, 2.0**-127, torch.nan), q)
    out.view(m, k // 32, 32).copy_((blocks * q.unsqueeze(-1)).clamp(-448.0, 448.0))
    return out, bits.to(torch.uint8)


def _random_input(rows, cols, dtype, device):
    # Normal values, never zeros: a skipped block would be caught by the checks.
    generator = torch.Generator().manual_seed(rows * 31 + cols)
    return (torch.randn(rows, cols, generator=generator) * 4).to(device=device, dtype=dtype)


def _fresh_compiles():
    """Forget earlier compiled graphs: each size and dtype compiles its granularities afresh, which keeps them under
    dynamo's recompile limit. Hitting it would fall back to eager and be timed as compiled; it fails instead."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def _check_fastmesh(x, granularity, scale):
    got = fastmesh.fp8.quantize(x, dtype=E4M3, granularity=granularity, scale=scale)
    want = ref.quantize(x.cpu(), E4M3, granularity, scale=None if scale is None else scale.cpu())
    if not bool(ref.fp8_bits_equal(got.data.cpu(), want.data).all()) or not torch.equal(got.scale.cpu(), want.scale):
        raise AssertionError(f"fastmesh.fp8.quantize disagrees with fp8_reference for {granularity}, {x.dtype}")
    return got


def _check_baseline(name, data, want_data):
    """The baselines compute the same quantization: measured bit-identical to fastmesh's (eager, compiled and
    torchao, every granularity, fp32 and bf16 inputs)."""
    differ = ~ref.fp8_bits_equal(data, want_data)
    if bool(differ.any()):
        raise AssertionError(f"{name} disagrees with fastmesh in {int(differ.sum())} of {differ.numel()} FP8 values")


def _sizes_and_dtypes(ctx: Context):
    specs = ctx.cases or (QUICK_SIZES if ctx.quick else FULL_SIZES)
    return [parse_size(s) for s in specs], [d for d in ctx.dtypes if d in TORCH_DTYPES]


def run_quantize(ctx: Context) -> None:
    sizes, dtypes = _sizes_and_dtypes(ctx)
    granularities = [(g, None) for g in ref.GRANULARITIES] + [("tensorwise", "given")]
    ctx.expect(len(sizes) * len(dtypes) * (len(granularities) + 2))
    compiled = torch.compile(eager_quantize, dynamic=False)
    compiled_mx = torch.compile(eager_mx, dynamic=False)
    ao_ok, ao_status = torchao_baselines.status()
    if not ao_ok:
        ctx.note(f"torchao baseline not run: {ao_status}")
    ao_mx_ok, ao_mx_status = torchao_baselines.mx_status()
    if not ao_mx_ok:
        ctx.note(f"torchao MX baselines not run: {ao_mx_status}")
    compiled_ao = torch.compile(torchao_baselines.mx_cast, dynamic=False) if ao_mx_ok else None
    for rows, cols in sizes:
        for dtype_name in dtypes:
            _fresh_compiles()
            x = _random_input(rows, cols, TORCH_DTYPES[dtype_name], ctx.device)
            copy_out, fp8_out = torch.empty_like(x), torch.empty(x.shape, dtype=E4M3, device=ctx.device)
            in_bytes = x.numel() * x.element_size()
            moved = in_bytes + x.numel()  # read x, write the FP8 data
            for granularity, mode in granularities:
                scale = torch.full((), 4.0 / 448.0, device=ctx.device) if mode == "given" else None
                want = _check_fastmesh(x, granularity, scale)
                candidates = {
                    "fastmesh": lambda: fastmesh.fp8.quantize(x, dtype=E4M3, granularity=granularity, scale=scale),
                    "eager": lambda: eager_quantize(x, granularity, fp8_out, scale),
                    "compile": lambda: compiled(x, granularity, fp8_out, scale),
                }
                if ao_ok and mode is None and granularity in torchao_baselines.GRANULARITIES:
                    candidates["torchao"] = lambda: torchao_baselines.quantize(x, granularity)
                candidates["copy"] = lambda: copy_out.copy_(x)
                for name in ("eager", "compile"):
                    _check_baseline(name, candidates[name](), want.data)
                if "torchao" in candidates:
                    _check_baseline("torchao", candidates["torchao"]()[0], want.data)
                time_interleaved(candidates, ctx.warmup, ctx.clock)
                timings = time_interleaved(candidates, ctx.repeats, ctx.clock, settle=True)
                kinds = {"fastmesh": "kernel", "copy": "part"}
                contenders = {
                    name: Contender(
                        kinds.get(name, "baseline"), seconds, 2 * in_bytes if name == "copy" else moved, "bytes"
                    )
                    for name, seconds in timings.items()
                }
                # The bound: the kernel's bytes moved at the copy's bandwidth, per round.
                contenders["bound"] = Contender(
                    "bound", [t * moved / (2 * in_bytes) for t in timings["copy"]], moved, "bytes"
                )
                label = f"{granularity}{' given scale' if mode else ''} [{rows}, {cols}]"
                ctx.emit(
                    Case(
                        "fp8_quantize",
                        label,
                        dtype_name,
                        "fastmesh",
                        contenders,
                        params={"rows": rows, "cols": cols, "granularity": granularity, "scale": mode or "current"},
                    )
                )
            for rounding in ("floor", "rceil"):
                _run_mx(ctx, x, rounding, compiled_mx, compiled_ao if ao_mx_ok else None, fp8_out, copy_out)


def _check_mx_baseline(name, data, scale_bits, want, rceil_quirks=None):
    """``name``'s MX data and scale bytes equal fastmesh's, but in the blocks of ``rceil_quirks`` (a bool per block)."""
    blocks = want.scale.shape
    same = (scale_bits.view(torch.uint8) == want.scale.view(torch.uint8)) & ref.fp8_bits_equal(data, want.data).view(
        *blocks, 32
    ).all(-1)
    if rceil_quirks is not None:
        same |= rceil_quirks
    if not bool(same.all()):
        differ = int((~same).sum())
        raise AssertionError(f"{name} disagrees with fastmesh's MX cast in {differ} of {same.numel()} blocks")


def _run_mx(ctx: Context, x, rounding, compiled_mx, compiled_ao, fp8_out, copy_out) -> None:
    rows, cols = x.shape
    want = fastmesh.fp8.quantize(x, dtype=E4M3, granularity="mx", scale_rounding=rounding)
    reference = mx_ref.quantize_mx(x.cpu(), E4M3, rounding)
    _check_mx_baseline("fastmesh", want.data.cpu(), want.scale.cpu(), reference)
    candidates = {
        "fastmesh": lambda: fastmesh.fp8.quantize(x, dtype=E4M3, granularity="mx", scale_rounding=rounding),
        "eager": lambda: eager_mx(x, rounding, fp8_out),
        "compile": lambda: compiled_mx(x, rounding, fp8_out),
    }
    if compiled_ao is not None:
        candidates["torchao"] = lambda: torchao_baselines.mx_cast(x, rounding)
        candidates["torchao_compile"] = lambda: compiled_ao(x, rounding)
    candidates["copy"] = lambda: copy_out.copy_(x)
    # torchao's eager RCEIL rounds ceil(log2()) in fp32 (torchao_baselines.mx_cast); its compiled form may not.
    descale = want.amax / 448.0
    log2 = torch.log2(descale)
    quirks = (log2 == log2.round()) & ((descale.view(torch.int32) & 0x7FFFFF) != 0) if rounding == "rceil" else None
    for name in [n for n in candidates if n not in ("fastmesh", "copy")]:
        _check_mx_baseline(name, *candidates[name](), want, None if name in ("eager", "compile") else quirks)
    time_interleaved(candidates, ctx.warmup, ctx.clock)
    timings = time_interleaved(candidates, ctx.repeats, ctx.clock, settle=True)
    in_bytes = x.numel() * x.element_size()
    moved = in_bytes + x.numel() + x.numel() // 32  # read x, write the FP8 data and the scales
    contenders = {
        name: Contender(
            {"fastmesh": "kernel", "copy": "part"}.get(name, "baseline"),
            seconds,
            2 * in_bytes if name == "copy" else moved,
            "bytes",
        )
        for name, seconds in timings.items()
    }
    contenders["bound"] = Contender("bound", [t * moved / (2 * in_bytes) for t in timings["copy"]], moved, "bytes")
    ctx.emit(
        Case(
            "fp8_quantize",
            f"mx {rounding} [{rows}, {cols}]",
            str(x.dtype).removeprefix("torch."),
            "fastmesh",
            contenders,
            params={"rows": rows, "cols": cols, "granularity": "mx", "scale_rounding": rounding},
        )
    )


def run_amax(ctx: Context) -> None:
    sizes, dtypes = _sizes_and_dtypes(ctx)
    ctx.expect(len(sizes) * len(dtypes))
    compiled = torch.compile(lambda t: t.abs().amax().float(), dynamic=False)
    for rows, cols in sizes:
        for dtype_name in dtypes:
            _fresh_compiles()
            x = _random_input(rows, cols, TORCH_DTYPES[dtype_name], ctx.device)
            nbytes = x.numel() * x.element_size()
            input_words = x.view(torch.int32)  # the same bytes (sizes are multiples of 128)
            candidates = {
                "fastmesh": lambda: fastmesh.amax(x),
                "eager": lambda: x.abs().amax().float(),
                "compile": lambda: compiled(x),
                "read": lambda: input_words.max(),
            }
            expected = candidates["eager"]()
            for name in ("fastmesh", "compile"):
                if not torch.equal(candidates[name](), expected):
                    raise AssertionError(f"amax: {name} disagrees with eager for [{rows}, {cols}] {dtype_name}")
            time_interleaved(candidates, ctx.warmup, ctx.clock)
            timings = time_interleaved(candidates, ctx.repeats, ctx.clock, settle=True)
            kinds = {"fastmesh": "kernel", "read": "bound"}
            contenders = {
                name: Contender(kinds.get(name, "baseline"), seconds, nbytes, "bytes")
                for name, seconds in timings.items()
            }
            ctx.emit(
                Case(
                    "amax",
                    f"tensorwise [{rows}, {cols}]",
                    dtype_name,
                    "fastmesh",
                    contenders,
                    params={"rows": rows, "cols": cols},
                )
            )


FAMILIES = (
    Family(
        "fp8_quantize",
        "FP8 cast-and-scale per granularity: GB/s against eager, torch.compile, torchao and copy bandwidth",
        distributed=False,
        dtypes=tuple(TORCH_DTYPES),
        run=run_quantize,
        parse_case=parse_size,
    ),
    Family(
        "amax",
        "tensor-wise amax: GB/s against eager, torch.compile and read bandwidth",
        distributed=False,
        dtypes=tuple(TORCH_DTYPES),
        run=run_amax,
        parse_case=parse_size,
    ),
)

"""The result rows every benchmark family produces: timed contenders, their spreads, rates and ratios.

A row is one case (shape, dtype) of one family, as plain JSON-ready data::

    {"family": "fused_collectives", "case": "all_gather_matmul [1024, 2048] d0 N=512", "dtype": "float32",
     "params": {...},                       # what the family needs to reproduce the case
     "kernel": "fastmesh",                  # the contender the ratios are about
     "figures": {"fastmesh": {"kind": "kernel", "ms": SPREAD, "rate": {"value": 41.2, "unit": "GFLOP/s"}},
                 "unfused": {"kind": "baseline", ...}, "comm": {"kind": "part", ...},
                 "bound": {"kind": "bound", ...}},
     "ratios": {"speedup_vs_unfused": SPREAD, "fastmesh_over_bound": SPREAD, ...},
     "notes": ["..."],
     "plan": {"label": "rowsx4", "source": "model", "decision": "..."}}  # fused ops only: the plan they took

with SPREAD = {"median", "q1", "q3", "min", "max"}. Kinds: ``kernel`` (fastmesh), ``variant`` (the kernel with
one option changed, e.g. the every-call shape check), ``baseline`` (what fastmesh replaces), ``bound`` (the best
any implementation could do, measured), ``part`` (a piece a bound is made of, e.g. the communication alone).
Ratios are computed per round from contenders timed in the same round, then summarized, so a drift of the machine
during the run cancels out of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastmesh.bench.timing import spread

KINDS = ("kernel", "variant", "baseline", "bound", "part")
_RATE_UNITS = {"bytes": ("GB/s", 1e9), "flops": ("GFLOP/s", 1e9)}


@dataclass
class Contender:
    """One timed contender of a case: seconds per round, and optionally the work one call does."""

    kind: str
    seconds: list[float]
    work: float | None = None
    work_unit: str | None = None  # "bytes" or "flops"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Contender kind must be one of {KINDS}, got {self.kind!r}")
        if (self.work is None) != (self.work_unit is None) or self.work_unit not in (None, *_RATE_UNITS):
            raise ValueError(
                f"Contender work_unit must be one of {tuple(_RATE_UNITS)} when work is given, got {self.work_unit!r}"
            )


@dataclass
class Case:
    """The measurements of one case, turned into a row by :meth:`row`."""

    family: str
    case: str
    dtype: str
    kernel: str
    contenders: dict[str, Contender]
    params: dict = field(default_factory=dict)
    extra_ratios: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (numerator, denominator)
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # family-specific figures (JSON only)
    plan: dict | None = None  # the plan the kernel took (fastmesh.ops.plans): label, source, decision

    def row(self) -> dict:
        figures = {}
        for name, c in self.contenders.items():
            figure = {"kind": c.kind, "ms": spread([1e3 * s for s in c.seconds])}
            if c.work is not None:
                unit, scale = _RATE_UNITS[c.work_unit]
                figure["rate"] = {"value": c.work / figure["ms"]["median"] * 1e3 / scale, "unit": unit}
            figures[name] = figure
        pairs = {
            f"speedup_vs_{name}": (name, self.kernel) for name, c in self.contenders.items() if c.kind == "baseline"
        }
        pairs.update(
            {
                f"{self.kernel}_over_{name}": (self.kernel, name)
                for name, c in self.contenders.items()
                if c.kind == "bound"
            }
        )
        pairs.update(self.extra_ratios)
        ratios = {}
        for name, (numerator, denominator) in pairs.items():
            rounds = zip(self.contenders[numerator].seconds, self.contenders[denominator].seconds)
            ratios[name] = spread([n / d for n, d in rounds])
        row = {
            "family": self.family,
            "case": self.case,
            "dtype": self.dtype,
            "params": self.params,
            "kernel": self.kernel,
            "figures": figures,
            "ratios": ratios,
            "notes": self.notes,
            "samples_s": {name: c.seconds for name, c in self.contenders.items()},
        }
        if self.details:
            row["details"] = self.details
        if self.plan:
            row["plan"] = self.plan
        check_row(row)
        return row


def check_row(row: dict) -> None:
    """Raises ValueError unless every figure and ratio of ``row`` is a positive finite number."""
    where = f"{row.get('family')} / {row.get('case')} / {row.get('dtype')}"
    if row.get("kernel") not in row.get("figures", {}):
        raise ValueError(f"{where}: the kernel {row.get('kernel')!r} has no figure")
    values = [(f"{name} {key}", v) for name, fig in row["figures"].items() for key, v in fig["ms"].items()]
    values += [(f"{name} rate", fig["rate"]["value"]) for name, fig in row["figures"].items() if "rate" in fig]
    values += [(f"ratio {name} {key}", v) for name, r in row["ratios"].items() for key, v in r.items()]
    for label, value in values:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where}: {label} = {value!r} is not a positive finite number")

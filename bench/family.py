"""What a benchmark family is and what it is given to run: the contract between the runner and the families."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from fastmesh.bench.figures import Case

from fastmesh.info import half_precision_note

DTYPES = ("float32", "bfloat16", "float8")
# Marks a row's dtype, in the tables, where this CPU emulates that dtype's matmul (the family's notes say so).
EMULATED_MARK = "(emulated)"


@dataclass(frozen=True)
class Family:
    """A family of benchmark cases.

    ``run(ctx)`` measures its cases and hands each to ``ctx.emit``; ``parse_case(spec, world)`` validates one
    ``--case NAME=SPEC`` (raising ValueError that says the expected form) before any rank starts;
    ``dtypes``: the ``--dtype`` values it measures (others are ignored for it); ``plot_ratio``: a ratio its plot
    shows per case as sorted bars against 1.0 (None: each contender's figure across the cases).
    """

    name: str
    description: str
    distributed: bool
    dtypes: tuple[str, ...]
    run: Callable[[Context], None]
    parse_case: Callable[[str, int], object]
    plot_ratio: str | None = None


@dataclass
class Context:
    """Everything a family's ``run`` needs; ``group`` and ``mesh`` are set for distributed families."""

    family: str
    device: torch.device
    quick: bool
    repeats: int
    warmup: int
    dtypes: tuple[str, ...]
    cases: list[str]  # --case specs for this family; empty: the family's defaults
    clock: object
    fp8: tuple[str, ...] = ()  # --fp8: the FP8 forms of fused_collectives' float8 cases; empty: its defaults
    # dtype name -> why figures in it say little: this CPU emulates its matmul (emulated_dtypes); measured once by
    # the runner, so that every rank leaves out the same cases
    emulated: dict = field(default_factory=dict)
    leader: bool = True  # prints progress and keeps the rows
    group: object = None
    mesh: object = None
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # figures over all the family's cases (JSON only)
    _total: int = 0
    _marked: dict = field(default_factory=dict)  # the emulated dtypes measured_dtypes kept
    _started: float = field(default_factory=time.perf_counter)

    def expect(self, total: int) -> None:
        """Announce how many cases the family will emit (for the progress line)."""
        self._total = total

    def measured_dtypes(self, matmul_dtypes: dict[str, torch.dtype]) -> list[str]:
        """The ``--dtype`` values this family measures, of ``matmul_dtypes`` (each name's cases -> the dtype their
        matmuls run in). ``--quick`` without ``--case`` leaves out one whose matmul this CPU emulates (a case would
        take minutes, not seconds), noting why and how to run it; a measured one is noted, and its rows' dtype is
        marked in the tables."""
        kept = []
        for name in (d for d in self.dtypes if d in matmul_dtypes):
            matmul = str(matmul_dtypes[name]).removeprefix("torch.")
            slow = self.emulated.get(matmul)
            if slow and matmul != name:
                slow = f"its cases multiply in {matmul} too, and {slow}"
            if slow and self.quick and not self.cases:
                self.note(f"{name} left out of --quick: {slow} (run it with --only {self.family} --dtype {name})")
                continue
            if slow:
                self._marked[name] = slow
            kept.append(name)
        return kept

    def emit(self, case: Case) -> None:
        row = case.row()
        slow = self._marked.get(row["dtype"])
        if slow:  # beside the figure, not only in the family's notes: the row is read alone too
            row["emulated"] = slow
            self.note(f"{EMULATED_MARK} {row['dtype']}: {slow}")
        self.rows.append(row)
        if self.leader:
            print(
                f"  [{self.family} {len(self.rows)}/{self._total or '?'}, {time.perf_counter() - self._started:.0f} s] "
                f"{progress_line(row)}",
                flush=True,
            )

    def note(self, message: str) -> None:
        """Something the reader must know about the family's run (a case skipped, a baseline not run), printed and
        kept in the JSON (once)."""
        if message in self.notes:
            return
        self.notes.append(message)
        if self.leader:
            print(f"  [{self.family}] note: {message}", flush=True)


def emulated_dtypes(device_type: str) -> dict[str, str]:
    """The ``DTYPES`` whose matmul this machine emulates (40-80x slower than float32 on an AVX2 CPU without
    AVX512-BF16 / AMX), each with the sentence that says so."""
    if device_type != "cpu":
        return {}
    notes = {name: half_precision_note(name) for name in DTYPES}
    return {name: note for name, note in notes.items() if note}


def progress_line(row: dict) -> str:
    kernel = row["kernel"]
    figure = row["figures"][kernel]
    parts = [f"{row['case']} {dtype_text(row)}: {kernel} {figure['ms']['median']:.3g} ms"]
    if "plan" in row:
        parts[0] += f" ({plan_text(row)})"
    if "rate" in figure:
        parts.append(f"{figure['rate']['value']:.3g} {figure['rate']['unit']}")
    parts += [f"{name} {r['median']:.2f}" for name, r in row["ratios"].items()]
    return ", ".join(parts)


def dtype_text(row: dict) -> str:
    """A row's dtype as the tables show it: marked where this CPU emulates its matmul."""
    return f"{row['dtype']} {EMULATED_MARK}" if row.get("emulated") else row["dtype"]


def plan_text(row: dict) -> str:
    """The plan a row's kernel took, as its table and progress line show it ("-": none recorded)."""
    plan = row.get("plan")
    return f"{plan['label']}, {plan['source']}" if plan else "-"

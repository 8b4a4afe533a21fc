"""The runner's outputs: the terminal table and the markdown table per family, and the JSON file."""

from __future__ import annotations

import json
import os

from fastmesh.bench.family import dtype_text, plan_text
from fastmesh.bench.machine import summary_lines

_KIND_ORDER = {"kernel": 0, "variant": 1, "baseline": 2, "part": 3, "bound": 4}


def contender_order(rows: list[dict]) -> list[str]:
    """Every contender of a family's rows: kernels, variants, baselines, parts, bounds (first appearance within a
    kind)."""
    seen = {}
    for row in rows:
        for name, figure in row["figures"].items():
            seen.setdefault(name, figure["kind"])
    return sorted(seen, key=lambda name: _KIND_ORDER[seen[name]])


def _ratio_order(rows: list[dict]) -> list[str]:
    names = []
    for row in rows:
        names += [name for name in row["ratios"] if name not in names]
    return names


def _columns(rows: list[dict]) -> tuple[list[str], list[str], str | None, bool]:
    """A family's table columns: its contenders, its ratios, the unit of the kernel's rate (None: no rate), and
    whether a plan column follows the kernel's (the first contender)."""
    unit = next((r["figures"][r["kernel"]]["rate"]["unit"] for r in rows if "rate" in r["figures"][r["kernel"]]), None)
    return contender_order(rows), _ratio_order(rows), unit, any("plan" in r for r in rows)


def _cell(spread_: dict | None, fmt: str, iqr_fmt: str) -> str:
    if spread_ is None:
        return "-"
    return f"{spread_['median']:{fmt}}±{spread_['q3'] - spread_['q1']:{iqr_fmt}}"


def table(family: str, rows: list[dict]) -> str:
    """A family's rows as a text table: each contender's median ms ±IQR, the kernel's rate, every ratio."""
    contenders, ratios, kernel_rate_unit, planned = _columns(rows)
    case_width = max(len(r["case"]) for r in rows)
    dtype_width = max(8, *(len(dtype_text(r)) for r in rows))
    titles = [f"{name} ms" for name in contenders] + ([kernel_rate_unit] if kernel_rate_unit else []) + ratios
    widths = [max(len(t), 11) for t in titles]
    if planned:
        titles.insert(1, "plan")
        widths.insert(1, max(len(plan_text(r)) for r in rows))
    lines = [
        f"{family}: median ±IQR over the rounds; ratios per round (speedup_vs_X = X / kernel, "
        "kernel_over_bound = kernel / bound)",
        f"{'case':{case_width}s} {'dtype':{dtype_width}s} " + " ".join(f"{t:>{w}s}" for t, w in zip(titles, widths)),
    ]
    for row in rows:
        cells = [
            _cell(row["figures"][name]["ms"] if name in row["figures"] else None, ".3g", ".2g") for name in contenders
        ]
        if kernel_rate_unit:
            rate = row["figures"][row["kernel"]].get("rate")
            cells.append("-" if rate is None else f"{rate['value']:.1f}")
        cells += [_cell(row["ratios"].get(name), ".2f", ".2f") for name in ratios]
        if planned:
            cells.insert(1, plan_text(row))
        lines.append(
            f"{row['case']:{case_width}s} {dtype_text(row):{dtype_width}s} "
            + " ".join(f"{c:>{w}s}" for c, w in zip(cells, widths))
        )
    return "\n".join(lines)


def markdown(family: str, rows: list[dict]) -> str:
    """A family's rows as a markdown table of medians (ms, the kernel's rate, ratios); spreads are in the JSON."""
    contenders, ratios, unit, planned = _columns(rows)
    titles = ["case", "dtype", *(f"{name} ms" for name in contenders), *([unit] if unit else []), *ratios]
    if planned:
        titles.insert(3, "plan")
    lines = [f"| {' | '.join(titles)} |", "|" + "---|" * len(titles)]
    for row in rows:
        cells = [row["case"], dtype_text(row)]
        cells += [
            f"{row['figures'][name]['ms']['median']:.3g}" if name in row["figures"] else "-" for name in contenders
        ]
        if unit:
            rate = row["figures"][row["kernel"]].get("rate")
            cells.append("-" if rate is None else f"{rate['value']:.3g}")
        cells += [f"{row['ratios'][name]['median']:.2f}" if name in row["ratios"] else "-" for name in ratios]
        if planned:
            cells.insert(3, plan_text(row))
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def write_json(path: str, meta: dict, families: dict, skipped: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "families": families, "skipped": skipped}, f, indent=1)
    return path


def write_markdown(path: str, meta: dict, families: dict, skipped: dict) -> str:
    """The machine lines, the families not run and why, then each family's markdown table and notes."""
    with open(path, "w") as f:
        f.write("\n".join(summary_lines(meta)) + "\n")
        for name, reason in skipped.items():
            f.write(f"\n{name}: not run: {reason}\n")
        for name, result in families.items():
            if result["rows"]:
                f.write(
                    f"\n{name} (medians over {meta['run']['repeats']} rounds; spreads in bench.json)\n\n"
                    f"{markdown(name, result['rows'])}\n"
                )
                if result["notes"]:
                    f.write("\n" + "".join(f"- note: {note}\n" for note in result["notes"]))
    return path

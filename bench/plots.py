"""One PNG per family: each contender's figure across the family's cases, kernels and baselines against bounds.

Memory-bound families (their kernel has a GB/s rate) plot GB/s, so the bound (copy or read bandwidth) is the
ceiling; the others plot milliseconds per call, so the bound is the floor. Bars span the interquartile range.
A family with a ``plot_ratio`` (``sweep``) plots that ratio instead: one bar per case from a line at 1.0,
sorted, labelled with the plan the kernel took. Needs matplotlib (``pip install 'fastmesh[bench]'``).
"""

from __future__ import annotations

import os

from fastmesh.bench.family import plan_text
from fastmesh.bench.report import contender_order

_STYLE = {"kernel": ("o", "-"), "baseline": ("s", "--"), "bound": ("", ":"), "part": ("^", "-.")}


def matplotlib_missing() -> str | None:
    """None when plots can be drawn, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'fastmesh[bench]')"
    return None


def plot_family(family: str, rows: list[dict], out_dir: str, ratio: str | None = None) -> str:
    """Writes ``out_dir/<family>.png``; returns its path. With ``ratio``: that ratio per case, as sorted bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig = _ratio_bars(plt, family, rows, ratio) if ratio else _figures(plt, family, rows)
    path = os.path.join(out_dir, f"{family}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _figures(plt, family: str, rows: list[dict]):
    in_gbs = all(r["figures"][r["kernel"]].get("rate", {}).get("unit") == "GB/s" for r in rows)
    labels = [f"{r['case']} {r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 3), 5.0))
    for name in contender_order(rows):
        xs, ys, lows, highs = [], [], [], []
        kind = None
        for x, row in enumerate(rows):
            figure = row["figures"].get(name)
            if figure is None or (in_gbs and "rate" not in figure):
                continue
            kind = figure["kind"]
            ms = figure["ms"]
            if in_gbs:
                rate = figure["rate"]["value"]  # work / median time: the quartiles of time bound it
                y, low, high = rate, rate * ms["median"] / ms["q3"], rate * ms["median"] / ms["q1"]
            else:
                y, low, high = ms["median"], ms["q1"], ms["q3"]
            xs.append(x)
            ys.append(y)
            # At 0 where a quartile equals the median: rate * median / q1 can then miss rate by a rounding error, and
            # matplotlib refuses a negative error bar.
            lows.append(max(y - low, 0.0))
            highs.append(max(high - y, 0.0))
        if kind in (None, "part", "variant"):
            continue
        marker, line = _STYLE[kind]
        ax.errorbar(xs, ys, yerr=[lows, highs], marker=marker, linestyle=line, capsize=3, label=f"{name} ({kind})")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB/s (higher is better)" if in_gbs else "ms per call (lower is better)")
    if not in_gbs:
        ax.set_yscale("log")
    ax.set_title(f"fastmesh bench: {family}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _ratio_bars(plt, family: str, rows: list[dict], ratio: str):
    """One horizontal bar per case from 1.0 to the ratio's median (interquartile range as error bars), sorted, so
    that the cases on either side of 1.0 read at a glance."""
    ordered = sorted(rows, key=lambda r: r["ratios"][ratio]["median"])
    spreads = [r["ratios"][ratio] for r in ordered]
    medians = [s["median"] for s in spreads]
    ys = range(len(ordered))
    fig, ax = plt.subplots(figsize=(12.0, 0.3 * len(ordered) + 1.8), layout="constrained")
    ax.barh(
        ys,
        [m - 1.0 for m in medians],
        left=1.0,
        color=["tab:green" if m >= 1.0 else "tab:red" for m in medians],
        xerr=[[s["median"] - s["q1"] for s in spreads], [s["q3"] - s["median"] for s in spreads]],
        capsize=2,
        error_kw={"elinewidth": 0.8},
    )
    for y, s in zip(ys, spreads):  # the value beyond the whisker of the bar's far end
        ahead = s["median"] >= 1.0
        ax.text(
            s["q3"] if ahead else s["q1"],
            y,
            f" {s['median']:.2f} ",
            va="center",
            ha="left" if ahead else "right",
            fontsize=6,
        )
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{r['case']} {r['dtype']} [{plan_text(r)}]" for r in ordered], fontsize=7)
    ax.set_xlabel(f"{ratio} (median of per-round ratios; > 1: {rows[0]['kernel']} faster)")
    ax.set_title(f"fastmesh bench: {family}")
    ax.grid(True, axis="x", alpha=0.3)
    return fig

"""Per-position |Δ logprob| plot of a `Comparison` (PNG, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from patcher.equivalence import Comparison

#: Floor for the log axis: exact zeros are drawn here.
FLOOR = 1e-9


def plot_deltas(comparison: Comparison, out: Path, title: str | None = None,
                original_max: int | None = None) -> Path:
    """One line per prompt of max |Δ logprob| against query position, log y-axis,
    with the tolerance (strict rule) and YaRN's original_max_position_embeddings
    (if given) drawn as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for row in comparison.rows:
        pts = [(q, max(d, FLOOR)) for q, d in enumerate(row.deltas) if d is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=".", markersize=3, linewidth=1,
                    label=f"{row.id}{'' if row.passed else ' (fail)'}")
    if comparison.tolerance is not None:
        ax.axhline(comparison.tolerance, color="red", linestyle="--", linewidth=1,
                   label=f"tolerance {comparison.tolerance:g}")
    if original_max is not None:
        ax.axvline(original_max, color="grey", linestyle=":", linewidth=1,
                   label=f"original_max_position_embeddings {original_max}")
    ax.set_yscale("log")
    ax.set_xlabel("query position")
    ax.set_ylabel("max |Δ logprob| over top-k")
    eng, ref = comparison.engine, comparison.reference
    ax.set_title(title or f"{eng['engine']} {eng['engine_version']} ({eng['dtype']}) vs "
                          f"{ref['engine']} {ref['engine_version']} ({ref['dtype']}): "
                          f"{'PASS' if comparison.passed else 'FAIL'}")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_bisect(result, out: Path, title: str | None = None) -> Path:
    """Heat map of a `BisectResult`: decoder layers (rows, plus one for model-level points) x
    comparison points (columns), colour = log10 of the point's error (relative L2; 1 -
    agreement for expert selection). Points above their limit are marked with a cross, the
    first divergence with a red box; blank cells were not compared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from patcher.bisect import heatmap_grid

    rows, cols, values, status = heatmap_grid(result)
    grid = np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(cols) + 2), max(3.0, 0.5 * len(rows) + 1.8)))
    finite = grid[np.isfinite(grid)]
    vmin = float(finite.min()) if finite.size else -8.0
    vmax = float(finite.max()) if finite.size else 0.0
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", vmin=min(vmin, vmax - 1e-6), vmax=vmax)
    for r in range(len(rows)):
        for c in range(len(cols)):
            s = status[r][c]
            if s in ("above", "first"):
                ax.text(c, r, "x", ha="center", va="center", color="white", fontsize=9, fontweight="bold")
            if s == "first":
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, rotation=55, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    fig.colorbar(im, ax=ax, label="log10 relative error")
    first = result.first
    sub = (f"first divergence: {first.where}" if first else "no point above its limit") + f" ({result.rule} rule)"
    ax.set_title((title or f"{result.engine} vs HF transformers, {result.dtype}") + "\n" + sub, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

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

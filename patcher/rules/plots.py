"""Per-position |Δ logprob| plot of a `Comparison` (PNG, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from patcher.rules.logits import Comparison

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


def ratio_label(metric: str, sides: list[str] | tuple[str, str]) -> str:
    """How a gated ratio is formed, in words: '<1 = first side slower' for every metric, so
    throughputs are first/second and latencies second/first."""
    from patcher.rules.speed import METRIC

    m = METRIC[metric]
    a, b = sides
    return f"{m.label}: {a} ÷ {b}" if m.higher_is_better else f"{m.label}: {b} ÷ {a}"


def plot_perf(report: dict, out: Path) -> Path:
    """The speed gate's picture, three labelled panels: output tokens/s against concurrency for
    both sides (every round a dot, the mean of the rounds a line; higher is faster), the latencies
    (means and percentiles; lower is faster), and each gated ratio with its confidence interval
    against the threshold, every ratio oriented so that < 1 means the first side is slower (its
    legend entry says which side is divided by which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from patcher.rules.speed import GATED, METRIC

    sides = report["sides"]
    a, b = sides
    points = report["points"]
    conc = [p["concurrency"] for p in points]
    colors = {a: "tab:red", b: "tab:blue"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    ax = axes[0]
    for side in sides:
        ax.plot(conc, [p["sides"][side]["output_throughput"] for p in points], marker="o", color=colors[side],
                label=f"{side}: mean of the rounds")
        xs, ys = [], []
        for p in points:
            vals = [r["output_throughput"] for r in p["per_round"][side] if r.get("output_throughput")]
            xs += [p["concurrency"]] * len(vals)
            ys += vals
        ax.scatter(xs, ys, s=10, color=colors[side], alpha=0.5, label=f"{side}: one round")
    _conc_axis(ax, conc)
    ax.set_ylabel("output tokens/s (higher is faster)")
    ax.set_title("(a) output throughput per side")
    ax.legend(fontsize=7)
    ax = axes[1]
    for side in sides:
        for key, style in (("ttft_mean", "-"), ("tpot_mean", "--"), ("e2el_p50", ":"), ("e2el_p99", "-.")):
            ys = [p["sides"][side][key] for p in points]
            ax.plot(conc, ys, linestyle=style, marker=".", color=colors[side], label=f"{side}: {METRIC[key].label}")
    _conc_axis(ax, conc)
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds (lower is faster)")
    ax.set_title("(b) latency per side: TTFT, TPOT, request latency")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[2]
    width = 0.08
    for i, key in enumerate(GATED):
        xs, ys, lo, hi = [], [], [], []
        for p in points:
            r = p["ratios"][key]
            if r["estimate"] is None:
                continue
            xs.append(p["concurrency"] * (1 + (i - 1) * width))
            ys.append(r["estimate"])
            lo.append(r["estimate"] - r["lo"])
            hi.append(r["hi"] - r["estimate"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=ratio_label(key, sides))
    ax.axhline(1.0, color="grey", linewidth=1, label="1: equal speed")
    ax.axhline(report["threshold"], color="red", linestyle="--", linewidth=1,
               label=f"threshold {report['threshold']:g}: fails when the whole interval is below")
    _conc_axis(ax, conc)
    ax.set_ylabel(f"ratio (< 1: {a} slower, > 1: {a} faster)")
    ax.set_title("(c) gated ratios, estimate and 95 % bootstrap interval")
    ax.legend(fontsize=7)
    mode = "A/A: the same build on both sides" if report.get("mode") == "aa" else f"{a} vs {b}"
    fig.suptitle(f"dsadapt perf {report['pin']} ({report['variant']}) {report['model']} {report.get('config_style') or ''} "
                 f"{report['dtype']}, {mode}: {report['verdict'].upper()}", fontsize=11)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _conc_axis(ax, conc) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc)
    ax.set_xticklabels([str(c) for c in conc])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")


def plot_bisect(result, out: Path, title: str | None = None) -> Path:
    """Heat map of a `BisectResult`: the input, each decoder layer and the output (rows, in model
    order) x comparison points (columns). Tensor cells are coloured by error / limit on a fixed log
    scale with the limit at its middle (1e-2 .. 1e2: green far below, white at the limit, red
    above), so a pass 67x under its limit looks calm and every cell reads the same way; expert
    selection is an agreement fraction on its own blue scale (0.5..1, the value printed). Points above their limit carry
    a cross, the first divergence a red box; blank cells were not compared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from patcher.rules.modules import first_divergence, heatmap_grid

    rows, cols, values, status = heatmap_grid(result)
    is_frac = np.array([[c == "experts_sel"] * 1 for c in cols]).ravel()
    grid = np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)
    tensors = np.where(is_frac[None, :], np.nan, grid)
    fracs = np.where(is_frac[None, :], grid, np.nan)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(cols) + 3), max(3.0, 0.5 * len(rows) + 1.8)))
    im = ax.imshow(np.ma.masked_invalid(tensors), aspect="auto", cmap="RdYlGn_r", vmin=-2.0, vmax=2.0)
    im2 = None
    if np.isfinite(fracs).any():
        im2 = ax.imshow(np.ma.masked_invalid(fracs), aspect="auto", cmap="Blues", vmin=0.5, vmax=1.0)
    for r in range(len(rows)):
        for c in range(len(cols)):
            s = status[r][c]
            if is_frac[c] and np.isfinite(grid[r, c]):
                ax.text(c, r, f"{grid[r, c]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if grid[r, c] > 0.8 else "black")
            if s in ("above", "first"):
                ax.text(c, r, "x", ha="center", va="center", color="black", fontsize=9, fontweight="bold")
            if s == "first":
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, rotation=55, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    bar = fig.colorbar(im, ax=ax, label="log10(error / limit): 0 is the limit", ticks=[-2, -1, 0, 1, 2])
    bar.ax.set_yticklabels(["1/100", "1/10", "limit", "10x", "100x"])
    if im2 is not None:
        fig.colorbar(im2, ax=ax, label="expert selection: agreement", ticks=[0.5, 0.75, 0.9, 1])
    first = result.first
    sub = (first_divergence(first).words() + (f" ({first.phase})" if first.phase else "") if first
           else "no point above its limit") + f" ({result.rule} rule)"
    m = getattr(result, "margin", None)
    if m and m.get("margin") is not None:
        sub += f"; worst {m['where']} {m['margin']:.2f}x {'over' if m['above'] else 'below'} its limit"
    ax.set_title((title or f"{result.engine} vs HF transformers, {result.dtype}") + "\n" + sub, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_power(result, out: Path) -> Path:
    """A power run (`patcher.rules.mde.PowerResult`): one column per (target, phase), eps on a log
    axis; every trial a marker (red cross: the gate flagged it, green circle: it did not, grey: not
    planted), the MDE of each cell a black bar, the searched range's ends dashed lines. A column
    with no bar the gate never flagged in the range; one with its bar on the lower line is flagged
    already at eps_min."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result.cells
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(cells) + 2.5), 4.5))
    search = result.search
    for x, cell in enumerate(cells):
        for t in cell.trials:
            style = ("x", "tab:red") if t.flagged else ("o", "tab:green") if t.flagged is False else ("s", "grey")
            ax.scatter([x], [t.eps], marker=style[0], color=style[1], s=28, zorder=3,
                       facecolors="none" if style[0] == "o" else None)
        hi = cell.flagged_at
        if hi is not None:
            ax.hlines(hi, x - 0.35, x + 0.35, color="black", linewidth=2.5, zorder=4)
            ax.text(x + 0.38, hi, f"{hi:.2g}", fontsize=7, va="center")
    for y, label in ((search["eps_max"], "eps_max"), (search["eps_min"], "eps_min")):
        ax.axhline(y, color="grey", linestyle="--", linewidth=1)
        ax.text(len(cells) - 0.5, y, f" {label} {y:g}", fontsize=7, va="bottom", ha="right", color="grey")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{c.target}\n{c.phase}" for c in cells], fontsize=8)
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.set_ylabel(f"eps ({result.kind}): red x flagged, green o not")
    ax.set_title(f"{result.pin} {result.model} {result.dtype}: smallest perturbation the gate flags (bar)"
                 + ("" if result.control.get("passed") else " — the control FAILS"), fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""The gate's pictures (PNG, matplotlib Agg): every curve is drawn against its limit.

- `plot_deltas`, a check's logits: float32 (strict rule): max |Δ logprob| per query position with
  the tolerance line; low precision: the engine's mean |Δ logprob| per position next to the
  reference's own in that dtype, and under it their ratio per block of positions against the
  limit, with the pooled ratio and its evidence (the rule's own quantity).
- `plot_perf`, the speed gate: both sides' throughput and latencies, and each gated ratio with its
  interval against the threshold.
- `plot_bisect`, the per-module heat map: every cell error / limit on one log scale.

Titles name the configuration (`configuration`: variant, model, config style, dtype, tp, control,
seed), single-spaced; axes are sized to the data, and a reference line that lies beyond the data
(YaRN's original_max_position_embeddings of a real model, 4096, against 255 positions) is named at
the edge instead of stretching the axis to it. Every function also takes the stored JSON of what it
draws, so a committed report can be drawn again without running anything (`redraw_check`).
"""

from __future__ import annotations

import math
from pathlib import Path

from patcher.base.errors import number
from patcher.rules.logits import Comparison
from patcher.rules.verdicts import configuration

#: Floor for the log axis: exact zeros are drawn here.
FLOOR = 1e-9


def title_of(pin: str, doc: dict, *, rescored: bool = False) -> str:
    """Pure: a plot's title for a check (or speed-gate) report or result: the pin and its
    configuration (`configuration`), '(rescored)' when today's rule was applied to stored inputs;
    one space between words, whatever is missing."""
    return " ".join(f"{pin} {configuration(doc)}{' (rescored)' if rescored else ''}".split())


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _doc(comparison: Comparison | dict) -> dict:
    return comparison.to_json() if isinstance(comparison, Comparison) else comparison


def _mark_original_max(ax, original_max: int | None, last: int) -> None:
    """YaRN's original_max_position_embeddings: a line where the data reaches it, else a note at the
    right edge (the axis stays the data's)."""
    if original_max is None:
        return
    if original_max <= last:
        ax.axvline(original_max, color="grey", linestyle=":", linewidth=1,
                   label=f"original_max_position_embeddings {original_max}")
    else:
        ax.annotate(f"original_max_position_embeddings {original_max} →\n(beyond the last position, {last})",
                    xy=(1.0, 0.02), xycoords="axes fraction", ha="right", va="bottom", fontsize=7, color="grey")


def _positions(rows: list[dict], key: str) -> list[tuple[str, list[tuple[int, float]]]]:
    out = []
    for r in rows:
        pts = [(q, max(d, FLOOR)) for q, d in enumerate(r.get(key) or []) if d is not None and math.isfinite(d)]
        out.append((str(r.get("id")), pts))
    return out


def _legend(ax, fig) -> None:
    """The legend beside the axes, never over the data (none when nothing was drawn)."""
    if not ax.get_legend_handles_labels()[1]:
        return
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_deltas(comparison: Comparison | dict, out: Path, title: str | None = None,
                original_max: int | None = None) -> Path:
    """`deltas_figure` written to `out` (PNG)."""
    return save_png(deltas_figure(comparison, title, original_max), out)


def deltas_figure(comparison: Comparison | dict, title: str | None = None, original_max: int | None = None):
    """The logits of one check against their limit (`Comparison` or its stored JSON): strict rule,
    one line per prompt of max |Δ logprob| per query position with the tolerance; low precision,
    the engine's and the reference's own mean |Δ logprob| per position and their ratio per block
    against the limit (`_plot_low_precision`). YaRN's original_max_position_embeddings (if given)
    is marked where the positions reach it."""
    plt = _plt()
    c = _doc(comparison)
    eng, ref = c.get("engine") or {}, c.get("reference") or {}
    head = title or (f"{eng.get('engine')} {eng.get('engine_version')} ({eng.get('dtype')}) vs "
                     f"{ref.get('engine')} {ref.get('engine_version')} ({ref.get('dtype')})")
    verdict = "PASS" if c.get("passed") else "FAIL"
    if c.get("rule") == "low-precision":
        fig = _plot_low_precision(plt, c, original_max)
        fig.axes[0].set_title(f"{' '.join(head.split())}: logits {verdict}\n{_lp_words(c)}", fontsize=10)
    else:
        fig, ax = plt.subplots(figsize=(11, 4.8))
        last = 0
        for rid, pts in _positions(c.get("rows") or [], "deltas"):
            if pts:
                xs, ys = zip(*pts)
                last = max(last, xs[-1])
                row: dict = next((r for r in c.get("rows") or [] if str(r.get("id")) == rid), {})
                ax.plot(xs, ys, marker=".", markersize=3, linewidth=1,
                        label=f"{rid}{'' if row.get('passed', True) else ' (fail)'}")
        tol = c.get("tolerance")
        if tol is not None:
            ax.axhline(tol, color="red", linestyle="--", linewidth=1.2, label=f"tolerance {number(tol)} (the limit)")
        _mark_original_max(ax, original_max, last)
        ax.set_xlim(-0.5, last + 0.5)
        ax.set_yscale("log")
        ax.set_xlabel("query position")
        ax.set_ylabel("max |Δ logprob| over top-k")
        worst = (c.get("summary") or {}).get("max_abs")
        sub = (f"strict rule: worst max |Δ logprob| {number(worst)}, "
               + (f"{tol / worst:.1f}x below the tolerance {number(tol)}" if worst and tol and worst < tol else
                  f"{worst / tol:.1f}x the tolerance {number(tol)}" if worst and tol else "no tolerance"))
        ax.set_title(f"{' '.join(head.split())}: logits {verdict}\n{sub}", fontsize=10)
        _legend(ax, fig)
    fig.tight_layout()
    return fig


def save_png(fig, out: Path, dpi: int = 100) -> Path:
    """Write the figure as a palette PNG (a plot has few colours: 256 keep it as drawn at a third of
    the size; reports are committed) and free it."""
    import io

    plt = _plt()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    plt.close(fig)
    try:
        from PIL import Image  # matplotlib's own dependency

        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(colors=256, dither=Image.Dither.NONE)
        tmp = out.with_name(f".{out.name}.tmp")
        img.save(tmp, format="PNG", optimize=True)
        tmp.replace(out)
    except (ImportError, OSError, ValueError):
        out.write_bytes(buf.getvalue())
    return out


def block_ratios(rows: list[dict], noise_rows: list[dict], floor: float,
                 cones: dict | None = None) -> list[tuple[str, list[tuple[float, float]]]]:
    """Pure: per prompt, (centre position, engine ÷ reference's own mean |Δ logprob|) of each block
    of `noise.BLOCK_POSITIONS` positions (what the low-precision rule sums; the reference's own at
    least `floor`), without the positions the rule left out (`cones`: after a routing flip)."""
    from patcher.rules.noise import BLOCK_POSITIONS

    by_id = {r.get("id"): r for r in noise_rows}
    out = []
    for row in rows:
        yard = by_id.get(row.get("id"))
        if yard is None:
            continue
        cone = (cones or {}).get(row.get("id"))
        acc: dict[int, list[float]] = {}
        for q, (a, b) in enumerate(zip(row.get("mean_deltas") or [], yard.get("mean_deltas") or [])):
            if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
                continue
            if cone is not None and q > cone:  # judge_logits: a flip at row t reaches entries q > t
                continue
            blk = acc.setdefault(q // BLOCK_POSITIONS, [0.0, 0.0, 0.0, 0.0])
            blk[0] += a
            blk[1] += b
            blk[2] += 1
            blk[3] += q
        pts = [(qs / n, (e / n) / max(m / n, floor)) for _, (e, m, n, qs) in sorted(acc.items()) if n]
        out.append((str(row.get("id")), [(x, max(y, FLOOR)) for x, y in pts]))
    return out


def _lp_words(c: dict) -> str:
    j = c.get("judgement") or {}
    p = j.get("prefill") or {}
    dtype = (c.get("engine") or {}).get("dtype")
    if p:
        state = (f"{p['lower'] / p['limit']:.2f}x over" if p.get("above") else
                 f"{p['limit'] / p['ratio']:.2f}x below" if p.get("ratio") else "far below")
        return (f"low-precision rule: mean |Δ logprob| {p['ratio']:.2f}x HF's own {dtype} "
                f"(at least {p['lower']:.2f}x by its evidence), limit {p['limit']:g}x: {state}")
    th, s = c.get("thresholds") or {}, c.get("summary") or {}
    if "max_mean_abs" in th and s.get("mean_abs") is not None:
        return (f"low-precision rule (no yardstick): pooled mean |Δ logprob| {number(s['mean_abs'])}, "
                f"limit {number(th['max_mean_abs'])}")
    return "low-precision rule"


def _plot_low_precision(plt, c: dict, original_max: int | None):
    """(a) mean |Δ logprob| per position, engine (solid) and the reference's own run in that dtype
    (dotted, same colour); (b) their ratio per block of positions, on a log axis, against the limit,
    with the pooled ratio and the lower end of its evidence. Without a yardstick (older reports):
    (a) alone, with the absolute rule's limit on the pooled mean."""
    noise = (c.get("noise") or {}).get("rows") or []
    two = bool(noise and (c.get("judgement") or {}).get("prefill"))
    if two:
        fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7.2), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    else:
        fig, ax = plt.subplots(figsize=(11, 4.8))
        bx = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    last = _engine_and_own_curves(ax, c, noise, colors)
    th = c.get("thresholds") or {}
    if not two and "max_mean_abs" in th:
        ax.axhline(th["max_mean_abs"], color="red", linestyle="--", linewidth=1.2,
                   label=f"limit on the pooled mean {number(th['max_mean_abs'])}")
        m = (c.get("summary") or {}).get("mean_abs")
        if m is not None:
            ax.axhline(m, color="black", linewidth=1, label=f"pooled mean {number(m)}")
    ax.set_yscale("log")
    ax.set_ylabel("mean |Δ logprob| over top-k")
    _mark_original_max(ax, original_max, last)
    ax.set_xlim(-0.5, last + 0.5)
    if bx is None:
        ax.set_xlabel("query position (prompt)")
        _legend(ax, fig)
        return fig
    ax.set_title("", fontsize=9)
    _legend(ax, fig)
    _block_ratio_panel(bx, c, noise, colors)
    _legend(bx, fig)
    return fig


def _engine_and_own_curves(ax, c: dict, noise: list[dict], colors: list[str]) -> int:
    """Panel (a)'s curves: each prompt's engine error per position (solid) and the reference's own
    run in the dtype (dotted, same colour); returns the last position drawn."""
    by_id = {str(r.get("id")): r for r in noise}
    last = 0
    for i, (rid, pts) in enumerate(_positions(c.get("rows") or [], "mean_deltas")):
        col = colors[i % len(colors)]
        if pts:
            xs, ys = zip(*pts)
            last = max(last, xs[-1])
            ax.plot(xs, ys, color=col, linewidth=1, marker=".", markersize=3, label=f"{rid}: engine")
        own = _positions([by_id[rid]], "mean_deltas")[0][1] if rid in by_id else []
        if own:
            xs, ys = zip(*own)
            ax.plot(xs, ys, color=col, linewidth=1, linestyle=":", alpha=0.8)
    if by_id:
        dtype = (c.get("engine") or {}).get("dtype")
        ax.plot([], [], color="grey", linestyle=":", label=f"dotted, same colour: HF's own {dtype} run")
    return last


def _block_ratio_panel(bx, c: dict, noise: list[dict], colors: list[str]) -> None:
    """Panel (b), the rule's own quantity: engine ÷ the reference's own error per block of positions
    (the routing-flip cones the rule applied left out), against the limit, with the pooled ratio and
    the band down to what its evidence shows at least."""
    from patcher.rules.noise import BLOCK_POSITIONS

    j = c["judgement"]
    p = j["prefill"]
    rule = j.get("rule") or {}
    dtype = (c.get("engine") or {}).get("dtype")
    ratios = block_ratios(c.get("rows") or [], noise, float(rule.get("floor") or 0.0), j.get("cones") or {})
    ys_all: list[float] = []
    for i, (rid, bpts) in enumerate(ratios):
        if bpts:
            bxs, bys = zip(*bpts)
            ys_all += bys
            bx.plot(bxs, bys, color=colors[i % len(colors)], marker="o", markersize=3, linewidth=0.6, alpha=0.8,
                    label=rid)
    limit, ratio, lower = p["limit"], p["ratio"], p["lower"]
    bx.axhline(limit, color="red", linestyle="--", linewidth=1.4, label=f"limit {limit:g}x")
    bx.axhline(1.0, color="grey", linewidth=0.8, label="1: as large as the reference's own")
    bx.axhline(ratio, color="black", linewidth=1.6, label=f"pooled {ratio:.2f}x")
    if ratio and lower and lower < ratio:
        bx.axhspan(lower, ratio, color="black", alpha=0.08, label=f"pooled, by its evidence at least {lower:.2f}x")
    bx.set_yscale("log")
    top = max([limit, ratio, *ys_all]) * 1.3
    low = max(min([0.5, (lower or 0.5) * 0.8, *ys_all]) * 0.8, 1e-2)
    bx.set_ylim(low, top)
    _ratio_ticks(bx, low, top, limit)
    bx.set_ylabel(f"engine ÷ the reference's own\n(blocks of {BLOCK_POSITIONS} positions)")
    bx.set_xlabel("query position (prompt)")
    left = (f"\n({j['left_out']} positions after a routing flip left out, as the rule leaves them)"
            if j.get("left_out") else "")
    bx.set_title(f"the rule's quantity: engine ÷ HF's own {dtype} error, failing above {limit:g}x "
                 f"beyond its evidence{left}", fontsize=8)


def _ratio_ticks(ax, low: float, top: float, *marks: float) -> None:
    """A log ratio axis labelled in plain numbers (0.5, 1, 1.4, 2, 5 ...), never 2x10^0."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = sorted({t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, *marks)
                    if low <= t <= top})
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))


def ratio_label(metric: str, sides: list[str] | tuple[str, str]) -> str:
    """How a gated ratio is formed, in words: '<1 = first side slower' for every metric, so
    throughputs are first/second and latencies second/first."""
    from patcher.rules.speed import METRIC

    m = METRIC[metric]
    a, b = sides
    return f"{m.label}: {a} ÷ {b}" if m.higher_is_better else f"{m.label}: {b} ÷ {a}"


def plot_perf(report: dict, out: Path) -> Path:
    """`perf_figure` written to `out` (PNG)."""
    return save_png(perf_figure(report), out)


def perf_figure(report: dict):
    """The speed gate's picture, three labelled panels: output tokens/s against concurrency for
    both sides (every round a dot, the mean of the rounds a line; higher is faster), the latencies
    (means and percentiles; lower is faster), and each gated ratio with its confidence interval
    against the threshold, every ratio oriented so that < 1 means the first side is slower (its
    legend entry says which side is divided by which)."""
    plt = _plt()
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
    ax.axhline(report["threshold"], color="red", linestyle="--", linewidth=1.4,
               label=f"threshold {report['threshold']:g}: fails when the whole interval is below")
    _conc_axis(ax, conc)
    ax.set_ylabel(f"ratio (< 1: {a} slower, > 1: {a} faster)")
    ax.set_title("(c) gated ratios, estimate and 95 % bootstrap interval\n" + closest_to_threshold(report), fontsize=9)
    ax.legend(fontsize=7)
    mode = "A/A: the same build on both sides" if report.get("mode") == "aa" else f"{a} vs {b}"
    fig.suptitle(f"dsadapt perf {title_of(report['pin'], report)}, {mode}: {report['verdict'].upper()}", fontsize=11)
    fig.tight_layout()
    return fig


def closest_to_threshold(report: dict) -> str:
    """Pure: the gated ratio whose interval comes closest to the threshold (its upper end: the gate
    fails when a whole interval lies below the threshold), in words."""
    from patcher.rules.speed import GATED, METRIC

    best = None
    for pt in report.get("points") or []:
        for key in GATED:
            r = (pt.get("ratios") or {}).get(key) or {}
            if r.get("hi") is not None and (best is None or r["hi"] < best[0]):
                best = (r["hi"], key, pt.get("concurrency"))
    if best is None:
        return "no gated ratio could be estimated"
    hi, key, level = best
    th = report["threshold"]
    where = f"{METRIC[key].label} at concurrency {level}"
    return (f"closest: {where},\nupper end {hi:.3f} = {hi / th:.2f}x the threshold" if hi >= th else
            f"{where}:\nthe whole interval is below the threshold (upper end {hi:.3f})")


def _conc_axis(ax, conc) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc)
    ax.set_xticklabels([str(c) for c in conc])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")


def plot_bisect(result, out: Path, title: str | None = None) -> Path:
    """`bisect_figure` written to `out` (PNG)."""
    return save_png(bisect_figure(result, title), out, dpi=110)


def bisect_figure(result, title: str | None = None):
    """Heat map of a `BisectResult`: the input, each decoder layer and the output (rows, in model
    order) x comparison points (columns). Tensor cells are coloured by error / limit on a fixed log
    scale with the limit at its middle (1e-2 .. 1e2: green far below, white at the limit, red
    above), so a pass 67x under its limit looks calm and every cell reads the same way; expert
    selection is an agreement fraction on its own blue scale (0.5..1, the value printed). Every
    tensor cell prints its error / limit (bold above 1: over its limit), the first divergence has a
    red box; blank cells were not compared. Takes the result or its stored report (JSON)."""
    plt = _plt()
    import numpy as np

    from patcher.rules.modules import first_divergence, heatmap_grid

    if isinstance(result, dict):
        result = bisect_result(result)
    rows, cols, values, status = heatmap_grid(result)
    is_frac = np.array([[c == "experts_sel"] * 1 for c in cols]).ravel()
    grid = np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)
    tensors = np.where(is_frac[None, :], np.nan, grid)
    fracs = np.where(is_frac[None, :], grid, np.nan)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(cols) + 2.5), max(3.0, 0.5 * len(rows) + 1.8)))
    im = ax.imshow(np.ma.masked_invalid(tensors), aspect="auto", cmap="RdYlGn_r", vmin=-2.0, vmax=2.0)
    im2 = None
    if np.isfinite(fracs).any():
        im2 = ax.imshow(np.ma.masked_invalid(fracs), aspect="auto", cmap="Blues", vmin=0.5, vmax=1.0)
    for r in range(len(rows)):
        for c in range(len(cols)):
            s = status[r][c]
            if not np.isfinite(grid[r, c]):
                pass
            elif is_frac[c]:
                ax.text(c, r, f"{grid[r, c]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if grid[r, c] > 0.8 else "black")
            else:  # error / limit: the cell's distance to its limit, in numbers
                ratio = 10 ** grid[r, c]
                ax.text(c, r, f"{ratio:.2g}" if ratio < 100 else f"{ratio:.0f}", ha="center", va="center",
                        fontsize=6.5, fontweight="bold" if s in ("above", "first") else "normal",
                        color="white" if abs(grid[r, c]) > 1.5 else "black")
            if s == "first":
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, rotation=55, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    side = make_axes_locatable(ax)  # the bars beside the map, each with room for its labels
    bar = fig.colorbar(im, cax=side.append_axes("right", size=0.18, pad=0.12), ticks=[-2, -1, 0, 1, 2],
                       label="error / limit (1: at the limit)")
    bar.ax.set_yticklabels(["1/100", "1/10", "1", "10", "100"])
    if im2 is not None:
        fig.colorbar(im2, cax=side.append_axes("right", size=0.18, pad=0.9), ticks=[0.5, 0.75, 0.9, 1],
                     label="expert selection: agreement")
    first = result.first
    sub = (first_divergence(first).words() + (f" ({first.phase})" if first.phase else "") if first
           else "no point above its limit") + f" ({result.rule} rule)"
    m = getattr(result, "margin", None)
    if m and m.get("margin") is not None:
        sub += f"; worst {m['where']} {m['margin']:.2f}x {'over' if m['above'] else 'below'} its limit"
    ax.set_title(" ".join((title or f"{result.engine} vs HF transformers, {result.dtype}").split()) + "\n" + sub,
                 fontsize=9)
    fig.tight_layout()
    return fig


def bisect_result(doc: dict):
    """Pure: a `BisectResult` from a stored bisect report (`<check>-bisect.json`), for drawing."""
    from dataclasses import fields

    from patcher.rules.modules import BisectResult, PointResult

    names = {f.name for f in fields(BisectResult)}
    kw = {k: v for k, v in doc.items() if k in names}
    kw["points"] = [PointResult.from_json(q) for q in doc.get("points") or []]
    first = doc.get("first")
    # the first divergence is one of the points (the heat map boxes it by identity)
    kw["first"] = next((q for q in kw["points"] if first and (q.layer, q.point) == (first.get("layer"), first.get("point"))),
                       PointResult.from_json(first) if first else None)
    return BisectResult(**kw)


def plot_power(result, out: Path) -> Path:
    """A power run (`patcher.gate.detection.PowerResult`): one column per (target, phase), eps on a log
    axis; every trial a marker (red cross: the gate flagged it, green circle: it did not, grey: not
    planted), the MDE of each cell a black bar, the searched range's ends dashed lines. A column
    with no bar the gate never flagged in the range; one with its bar on the lower line is flagged
    already at eps_min."""
    plt = _plt()
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
    return save_png(fig, out, dpi=110)

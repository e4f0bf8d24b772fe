"""Summarize speed-gate calibration runs: A/A coverage, planted-slowdown detection, the smallest
slowdown the gate detects at each concurrency.

    python3 tools/speed_calibration.py REPORT_OR_DIR... [--out summary.md] [--json summary.json]
    python3 tools/speed_calibration.py size REPORT --target 0.10 (--product-us US | --sizing-matmuls N0)

Reads `dsadapt perf` reports (dsadapt.perf-report/1): A/A runs (`--aa`, the build against
itself) and planted runs (patched vs unpatched with a known slowdown planted into the patched
build, tools/plant_decode_work.py; the report's provenance says how strong). Prints Markdown:

- every run: date, 1-minute load average before and after, CPUs, each gated ratio with its
  95 % interval per concurrency, the verdict;
- A/A: in how many runs every gated interval contains 1 (the calibration's goal: >= 9 of 10),
  and per interval; the order check: the geometric mean of the per-round ratios over the rounds
  where the first side went first and over those where the second did (an advantage of going
  first shows as the two on opposite sides of 1);
- planted: in how many runs the gate failed, and the slowdown the plant caused (1 - estimate);
- the smallest slowdown detected at each concurrency: a true ratio r is flagged when r times
  the interval's upper-end factor (hi / estimate, from the A/A runs) is below the threshold;
  with the 90th percentile of that factor over the A/A runs, r < threshold / factor is flagged
  in at least 9 runs of 10.

`size` prints the planted strength for a `target` slowdown at every concurrency level of REPORT,
as tools/plant_decode_work.py reads it ("1:N1,16:N16": N products per layer at a step of that
many tokens -- a decode step at concurrency c has c): from an A/A report's TPOT per level and the
measured cost of one product (`--product-us`, plant_decode_work.py --product-cost: the GPU, where
the product's cost does not depend on the batch), or from a sizing run planted with N0 products
per step at every level (`--sizing-matmuls`: its TPOT ratio per level; the CPU, where it does).
A constant number of products per step is a smaller fraction of a step of 16 sequences than of
one; a strength per level makes the plant cost about the same fraction at each.

Needs only the standard library and patcher.rules.speed (run from the repository, or with
dsadapt installed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher.rules import speed as P  # noqa: E402

GATED = P.GATED
SHORT = {"output_throughput": "tokens/s", "ttft_mean": "TTFT", "tpot_mean": "TPOT"}


def load(paths: list[Path]) -> list[tuple[Path, dict]]:
    files: list[Path] = []
    for p in paths:
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    out = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("schema") == P.SCHEMA and d.get("points"):
            out.append((f, d))
    return sorted(out, key=lambda x: (x[1]["provenance"].get("date", ""), str(x[0])))


def kind(d: dict) -> str:
    if d.get("mode") == "aa":
        return "aa"
    return "planted" if planted_strength(d) else "ab"


def planted_strength(d: dict) -> str:
    """The planted strength as the knob was set ("12", or per token count "1:12,16:30"); "" when
    nothing was planted (no record, 0, or 0 at every token count)."""
    prov = d.get("provenance") or {}
    raw = str((prov.get("planted") or {}).get("matmuls") or "").strip()
    try:
        counts = [int(x.split(":")[-1]) for x in raw.split(",") if x.strip()]
    except ValueError:
        return ""
    return raw if any(counts) else ""


def _ci(r: dict) -> str:
    if r.get("estimate") is None:
        return "-"
    return f"{r['estimate']:.3f} [{r['lo']:.2f}, {r['hi']:.2f}]"


def _load(d: dict) -> str:
    prov = d["provenance"]
    before, after = prov.get("load_average_before"), prov.get("load_average_after")
    return f"{before[0] if before else '?'} → {after[0] if after else '?'}"


def order_split(d: dict, conc: int, metric: str) -> tuple[float | None, float | None]:
    """Geometric means of the per-round ratios over the rounds the first side went first in, and over
    the rounds the second side did (from the recorded runs' order)."""
    a, b = d["sides"]
    spec = P.METRIC[metric]
    by = {(r["round"], r["side"]): r for r in d.get("runs", []) if r["concurrency"] == conc}
    first_a, first_b = [], []
    for rnd in sorted({k[0] for k in by}):
        ra, rb = by.get((rnd, a)), by.get((rnd, b))
        if not ra or not rb:
            continue
        recs = [P.RunRecord(x["side"], x["round"], x["concurrency"], x["duration_s"],
                            [P.RequestRecord(**q) for q in x["requests"]], x.get("order", 0)) for x in (ra, rb)]
        ratio = P.oriented_ratio(P.run_metrics(recs[0])[metric], P.run_metrics(recs[1])[metric], spec.higher_is_better)
        if ratio is None:
            continue
        (first_a if ra.get("order", 0) < rb.get("order", 0) else first_b).append(math.log(ratio))
    geo = [math.exp(sum(x) / len(x)) if x else None for x in (first_a, first_b)]
    return geo[0], geo[1]


def contains_one(d: dict, conc: int | None = None) -> tuple[int, int]:
    """(gated intervals containing 1, gated intervals), over every level or at `conc`."""
    rs = [p["ratios"][m] for p in d["points"] for m in GATED if conc is None or p["concurrency"] == conc]
    ok = [r for r in rs if r.get("lo") is not None and r["lo"] <= 1.0 <= r["hi"]]
    return len(ok), len(rs)


def flagged(d: dict, conc: int, threshold: float) -> list[str]:
    """The gated metrics whose whole interval lies below the threshold at `conc` (the gate's rule)."""
    return [m for p in d["points"] if p["concurrency"] == conc for m in GATED
            if p["ratios"][m].get("hi") is not None and p["ratios"][m]["hi"] < threshold]


def burst_spread(d: dict, conc: int) -> float | None:
    """The largest spread (ms) of a run's opening burst at `conc`, over both sides (None: not recorded)."""
    xs = [side.get("burst_spread_ms_max") for p in d["points"] if p["concurrency"] == conc
          for side in (p.get("sides") or {}).values()]
    xs = [x for x in xs if isinstance(x, (int, float))]
    return max(xs) if xs else None


def summarize(reports: list[tuple[Path, dict]]) -> tuple[str, dict]:
    lines: list[str] = []
    data: dict = {"runs": []}
    if not reports:
        return "no perf reports found\n", data
    threshold = reports[0][1]["threshold"]
    conc = sorted({p["concurrency"] for _f, d in reports for p in d["points"]})
    header = "| run | kind | date | load 1-min | CPUs | c | " + " | ".join(SHORT[m] for m in GATED) + " | verdict |"
    lines += ["## Runs", "", header, "|" + "---|" * (header.count("|") - 1)]
    for f, d in reports:
        prov = d["provenance"]
        k = kind(d) + (f" ({planted_strength(d)} matmuls)" if kind(d) == "planted" else "")
        for i, p in enumerate(d["points"]):
            lead = [f.name, k, prov.get("date", "?"), _load(d), ",".join(map(str, prov.get("cpus") or []))] if i == 0 \
                else ["", "", "", "", ""]
            lines.append("| " + " | ".join(lead + [str(p["concurrency"])] + [_ci(p["ratios"][m]) for m in GATED]
                                          + [d["verdict"] if i == 0 else ""]) + " |")
        data["runs"].append({"file": str(f), "kind": kind(d), "verdict": d["verdict"], "date": prov.get("date"),
                             "load_before": prov.get("load_average_before"),
                             "load_after": prov.get("load_average_after"), "planted": planted_strength(d),
                             "ratios": {str(p["concurrency"]): {m: p["ratios"][m] for m in GATED}
                                        for p in d["points"]}})
    aa = [(f, d) for f, d in reports if kind(d) == "aa"]
    planted = [(f, d) for f, d in reports if kind(d) == "planted"]
    lines += [""]
    if aa:
        full = sum(1 for _f, d in aa if contains_one(d)[0] == contains_one(d)[1])
        ints = [contains_one(d) for _f, d in aa]
        lines += ["## A/A", "",
                  f"- every gated interval contains 1 in **{full} of {len(aa)}** A/A runs "
                  f"({sum(i[0] for i in ints)} of {sum(i[1] for i in ints)} intervals); "
                  f"verdict pass in {sum(1 for _f, d in aa if d['verdict'] == 'pass')} of {len(aa)}", ""]
        data["aa"] = {"runs": len(aa), "all_contain_one": full, "intervals_containing_one": sum(i[0] for i in ints),
                      "intervals": sum(i[1] for i in ints), "per_level": {}}
        for c in conc:
            at = [contains_one(d, c) for _f, d in aa]
            runs_ok = sum(1 for k, n in at if n and k == n)
            spread = [x for x in (burst_spread(d, c) for _f, d in aa) if x is not None]
            lines.append(f"- concurrency {c}: every gated interval contains 1 in **{runs_ok} of {len(aa)}** A/A runs "
                         f"({sum(k for k, _n in at)} of {sum(n for _k, n in at)} intervals)"
                         + (f"; opening burst sent within {max(spread):.1f} ms" if spread else ""))
            data["aa"]["per_level"][str(c)] = {"all_contain_one": runs_ok, "runs": len(aa),
                                               "intervals_containing_one": sum(k for k, _n in at),
                                               "intervals": sum(n for _k, n in at),
                                               "burst_spread_ms_max": max(spread) if spread else None}
        lines.append("")
        lines += ["Order check (A/A): geometric mean of the per-round ratios when the first side went first / when "
                  "the second did (an advantage of going first puts them on opposite sides of 1):", "",
                  "| c | " + " | ".join(SHORT[m] for m in GATED) + " |", "|---|" + "---|" * len(GATED)]
        for c in conc:
            cells = []
            for m in GATED:
                pairs = [order_split(d, c, m) for _f, d in aa]
                fa = [math.log(x) for x, _y in pairs if x]
                fb = [math.log(y) for _x, y in pairs if y]
                cells.append(f"{math.exp(statistics.mean(fa)):.3f} / {math.exp(statistics.mean(fb)):.3f}"
                             if fa and fb else "-")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines += ["", "## Smallest slowdown detected", "",
                  f"From the A/A runs' intervals (threshold {threshold:g}): the slowdown 1 - r that the gate flags in "
                  "at least 9 of 10 runs, per gated metric (90th percentile of hi/estimate), and the smallest of them:",
                  "", "| c | " + " | ".join(SHORT[m] for m in GATED) + " | smallest |", "|---|" + "---|" * (len(GATED) + 1)]
        data["smallest_detected"] = {}
        for c in conc:
            cells, best = [], None
            for m in GATED:
                factors = sorted(p["ratios"][m]["hi"] / p["ratios"][m]["estimate"] for _f, d in aa for p in d["points"]
                                 if p["concurrency"] == c and p["ratios"][m].get("estimate"))
                if not factors:
                    cells.append("-")
                    continue
                q90 = factors[min(len(factors) - 1, math.ceil(0.9 * len(factors)) - 1)]
                s = max(0.0, 1 - threshold / q90)
                best = s if best is None else min(best, s)
                cells.append(f"{100 * s:.1f} %")
                data["smallest_detected"].setdefault(str(c), {})[m] = s
            lines.append(f"| {c} | " + " | ".join(cells) + f" | {'-' if best is None else f'{100 * best:.1f} %'} |")
        lines += [""]
    if planted:
        lines += _planted_section(planted, conc, threshold, data)
    return "\n".join(lines) + "\n", data


def _planted_section(planted: list[tuple[Path, dict]], conc: list[int], threshold: float, data: dict) -> list[str]:
    """The planted runs: how many the gate failed, at each level how many it flagged (and by which
    metric), and the slowdown the plant caused (median of 1 - estimate); the numbers into `data`."""
    fails = sum(1 for _f, d in planted if d["verdict"] == "fail")
    lines = ["## Planted", "", f"- the gate failed **{fails} of {len(planted)}** planted runs"]
    data["planted"] = {"runs": len(planted), "failed": fails, "slowdown": {}, "flagged": {}}
    for c in conc:
        per = [flagged(d, c, threshold) for _f, d in planted]
        by_metric = {m: sum(1 for f in per if m in f) for m in GATED}
        hit = sum(1 for f in per if f)
        lines.append(f"- concurrency {c}: flagged in **{hit} of {len(planted)}** planted runs ("
                     + ", ".join(f"{SHORT[m]} {k}" for m, k in by_metric.items()) + ")")
        data["planted"]["flagged"][str(c)] = {"runs": hit, "of": len(planted), **by_metric}
    lines += ["", "Slowdown the plant caused (1 - estimate; median over the planted runs):", "",
              "| c | " + " | ".join(SHORT[m] for m in GATED) + " |", "|---|" + "---|" * len(GATED)]
    for c in conc:
        cells = []
        for m in GATED:
            est = [p["ratios"][m]["estimate"] for _f, d in planted for p in d["points"]
                   if p["concurrency"] == c and p["ratios"][m].get("estimate")]
            cells.append(f"{100 * (1 - statistics.median(est)):.1f} %" if est else "-")
            if est:
                data["planted"]["slowdown"].setdefault(str(c), {})[m] = 1 - statistics.median(est)
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines + [""]


def plant_for(d: dict, target: float, *, product_us: float | None = None, sizing_matmuls: int | None = None,
              layers: int | None = None) -> str:
    """The planted strength per level ("c:n,...", by concurrency = a decode step's token count) for a
    `target` slowdown of TPOT, from a report (see the module's `size`); `layers` defaults to the
    report's model config. ValueError when the report cannot size it."""
    want = 1 / (1 - target) - 1  # extra time per step, as a fraction of the step, for a ratio 1 - target
    out = []
    for p in sorted(d["points"], key=lambda p: p["concurrency"]):
        c = int(p["concurrency"])
        if product_us is not None:
            if layers is None:
                layers = json.loads((Path(d["provenance"]["model_dir"]) / "config.json").read_text())["num_hidden_layers"]
            tpot_ms = p["sides"][d["sides"][0]]["tpot_mean"]
            n = tpot_ms * 1000 * want / (layers * product_us)
        elif sizing_matmuls is not None:
            est = p["ratios"]["tpot_mean"].get("estimate")
            cost = 1 / est - 1 if est else 0.0  # what n0 products added to a step, as a fraction of it
            if cost <= 0:
                raise ValueError(f"concurrency {c}: {sizing_matmuls} products did not slow TPOT (ratio {est}); "
                                 "size with more")
            n = sizing_matmuls * want / cost
        else:
            raise ValueError("give product_us or sizing_matmuls")
        out.append((c, max(1, round(n))))
    if not out:
        raise ValueError("the report has no concurrency level")
    return str(out[0][1]) if len(out) == 1 else ",".join(f"{c}:{n}" for c, n in out)


def _size_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="speed_calibration.py size", description="the planted strength per level")
    p.add_argument("report", type=Path)
    p.add_argument("--target", type=float, default=0.10)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--product-us", type=float)
    how.add_argument("--sizing-matmuls", type=int)
    args = p.parse_args(argv)
    try:
        print(plant_for(json.loads(args.report.read_text()), args.target, product_us=args.product_us,
                        sizing_matmuls=args.sizing_matmuls))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot size the plant from {args.report}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["size"]:
        return _size_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    p.add_argument("--json", type=Path, default=None, help="and the numbers as JSON here")
    args = p.parse_args(argv)
    text, data = summarize(load(args.paths))
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

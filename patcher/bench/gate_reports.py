"""The speed gate's part of docs/benchmarks.md (pure formatting over the committed perf reports).

`dsadapt bench` writes docs/benchmarks.md; its "Engine speed" section comes from here, read
from the `dsadapt perf` reports under reports/ (schema dsadapt.perf-report/1): one table per
report, the A/A noise band, and what the numbers say, in sentences derived from them.
"""

from __future__ import annotations

import json
from pathlib import Path

from patcher.rules.speed import GATED, METRIC, SCHEMA

SHOWN = ("output_throughput", "ttft_mean", "tpot_mean", "e2el_p50", "e2el_p99")


def read_perf_reports(reports_root: Path) -> list[tuple[str, dict]]:
    """(path relative to the project, report) for every perf report under reports/, A/A first."""
    out = []
    for path in sorted(reports_root.rglob("*.json")) if reports_root.is_dir() else []:
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(d, dict) and d.get("schema") == SCHEMA:
            out.append((str(path.relative_to(reports_root.parent)), d))
    return sorted(out, key=lambda x: (x[1].get("pin", ""), x[1].get("mode") != "aa", x[0]))


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(r: dict) -> str:
    if r.get("estimate") is None:
        return "-"
    return f"{r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"


def report_table(d: dict) -> str:
    a, b = d["sides"]
    rows = ["| concurrency | metric | " + a + " | " + b + f" | {a}/{b} [95% CI] | per-round ratios |",
            "|---|---|---|---|---|---|"]
    for p in d["points"]:
        for key in SHOWN:
            m = METRIC[key]
            r = p["ratios"][key]
            spec = ".1f"
            rows.append(f"| {p['concurrency']} | {m.label}{' (gated)' if m.gated else ''} | "
                        f"{_f(p['sides'][a][key], spec)} {m.unit} | {_f(p['sides'][b][key], spec)} {m.unit} | "
                        f"{_ratio(r)} | {', '.join(f'{x:.2f}' for x in r.get('per_round') or [])} |")
        ra, rb = p["sides"][a].get("peak_rss"), p["sides"][b].get("peak_rss")
        if ra and rb:
            rows.append(f"| {p['concurrency']} | peak RSS of the server group | {ra / 2**20:.0f} MiB | "
                        f"{rb / 2**20:.0f} MiB | | |")
    return "\n".join(rows)


def findings(d: dict) -> list[str]:
    """Sentences the numbers support, nothing more."""
    a, b = d["sides"]
    out = []
    gated = [(p["concurrency"], k, p["ratios"][k]) for p in d["points"] for k in GATED
             if p["ratios"][k].get("estimate") is not None]
    if not gated:
        return [f"No ratios: {'; '.join(d.get('reasons') or ['no measured points'])}."]
    contain = [g for g in gated if g[2]["lo"] <= 1.0 <= g[2]["hi"]]
    slower = [g for g in gated if g[2]["hi"] < 1.0]
    faster = [g for g in gated if g[2]["lo"] > 1.0]
    ests = [g[2]["estimate"] for g in gated]
    out.append(f"{len(contain)} of {len(gated)} gated intervals contain 1.0; estimates "
               f"{min(ests):.3f} to {max(ests):.3f}; the lowest upper CI end is "
               f"{min(g[2]['hi'] for g in gated):.3f} (threshold {d['threshold']:g}: verdict {d['verdict']}).")
    for label, group in ((f"{a} slower than {b}", slower), (f"{a} faster than {b}", faster)):
        if group:
            out.append(f"Intervals entirely {label}: " + ", ".join(
                f"{METRIC[k].label} at concurrency {c} ({_ratio(r)})" for c, k, r in group) + ".")
    if d.get("mode") == "aa":
        band = d.get("band") or {}
        if band:
            out.append(f"Noise band (same build on both sides): per-round ratios {band['round_ratio_min']:.2f} to "
                       f"{band['round_ratio_max']:.2f}, widest interval {band['ci_width_max']:.3f}, margin of the "
                       f"lowest upper end over the threshold {band['margin']:+.3f}.")
    return out


def against_aa(d: dict, aa: dict) -> str | None:
    """One sentence setting a patched-vs-unpatched run against the A/A run of the same setup."""
    def spread(doc):
        ests = [p["ratios"][k]["estimate"] for p in doc["points"] for k in GATED
                if p["ratios"][k].get("estimate") is not None]
        his = [p["ratios"][k]["hi"] for p in doc["points"] for k in GATED if p["ratios"][k].get("hi") is not None]
        return (min(ests), max(ests), min(his)) if ests and his else None

    a, b = spread(d), spread(aa)
    if not a or not b:
        return None
    inside = b[0] - 0.05 <= a[0] and a[1] <= b[1] + 0.15
    return (f"Against the A/A run of the same setup (estimates {b[0]:.3f} to {b[1]:.3f}, lowest upper end "
            f"{b[2]:.3f}): estimates {a[0]:.3f} to {a[1]:.3f}, lowest upper end {a[2]:.3f} — "
            + ("within the spread identical builds show: no cost this machine can resolve."
               if inside and a[2] >= d["threshold"] else "outside what identical builds show."))


def perf_markdown(reports: list[tuple[str, dict]]) -> str:
    out = ["## Engine speed (`dsadapt perf`)", ""]
    if not reports:
        return "\n".join(out + ["No `dsadapt perf` report under `reports/` yet.", ""])
    out += ["How (method, noise band and margins: docs/speed.md): both builds served at once on 127.0.0.1, the "
            "pinned wheel's own load tool, rounds alternating the sides, a warm-up round first; per-round ratios "
            "oriented so that < 1 means the first side is slower (tokens/s first/second, latencies "
            "second/first); the estimate is their geometric mean with a 95 % bootstrap interval over rounds "
            "(percentile interval expanded for the small number of rounds). `perf-aa-*` reports are A/A "
            "calibration runs (the patched build against itself); what the numbers mean for the stack is "
            "discussed in docs/speed.md.", ""]
    for rel, d in reports:
        prov = d.get("provenance") or {}
        w = d.get("workload") or {}
        mixes = ", ".join(f"{m['name']} {m['input_len']}->{m['output_len']}" for m in w.get("mixes", []))
        title = "A/A calibration" if d.get("mode") == "aa" else f"{d['sides'][0]} vs {d['sides'][1]}"
        out += [f"### {d['pin']} ({d.get('variant')}) {d.get('model')} {d.get('config_style') or ''} "
                f"{d.get('dtype')}: {title}, {d['verdict']}", "",
                f"`{rel}` — {prov.get('date')}, {prov.get('device')}; `{prov.get('command')}`; "
                f"{w.get('rounds')} rounds of {_requests(w)} requests (mixes {mixes}) after "
                f"{w.get('warmup_rounds')} warm-up round(s); CPUs {prov.get('cpus')} (compute "
                f"{prov.get('compute_cpus')}); 1/5/15-minute load average {prov.get('load_average_before')} "
                f"before, {prov.get('load_average_after')} after.", ""]
        if d.get("points"):
            out += [report_table(d), ""]
        lines = findings(d)
        if d.get("mode") != "aa" and d.get("points"):
            aa = next((x for _r, x in reports if x.get("mode") == "aa" and x.get("points") and
                       all(x.get(k) == d.get(k) for k in ("pin", "variant", "model", "config_style", "dtype"))), None)
            sentence = against_aa(d, aa) if aa else None
            if sentence:
                lines.append(sentence)
        out += [f"- {s}" for s in lines] + [""]
    return "\n".join(out)


def _requests(w: dict) -> str:
    """Requests per run: one number, or one per level ("6 at c=1, 32 at c=16")."""
    raw = w.get("requests_per_level")
    per: dict = raw if isinstance(raw, dict) else {}
    if len(set(per.values())) > 1:
        return ", ".join(f"{n} at c={c}" for c, n in per.items())
    return str(w.get("requests_per_run"))

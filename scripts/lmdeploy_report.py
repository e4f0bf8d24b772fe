"""Summarize device outputs of the LMDeploy GPU check into reports/lmdeploy/.

    python scripts/lmdeploy_report.py --run DIR [--run DIR ...] [--hf DIR] --out reports/lmdeploy

Each --run is a folder of files that came back from `bash .carry/lmdeploy/run.sh`
(ref.json, bisect_*.json or lmd_*.json, runner reports, log.txt); --hf a folder with the
HF reference reports (hf_<model>.json). Writes summary.json (every number, with where it
came from) and per_position_delta.png. Where patcher.equivalence is importable (the gate),
runner reports are also judged against the HF reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def strip(d):
    """Drop the per-position arrays (they go to the plot)."""
    if isinstance(d, dict):
        return {k: strip(v) for k, v in d.items() if k != "per_position_max_abs"}
    return d


def load_runs(dirs: list[Path]) -> dict:
    runs = {}
    for d in dirs:
        for f in sorted(d.glob("*.json")):
            runs[f"{d.name}/{f.name}"] = json.loads(f.read_text())
    return runs


def judge(runner_reports: dict[str, dict], hf_dir: Path) -> dict:
    try:
        from patcher.equivalence import LogitReport, compare
    except ImportError:
        return {"skipped": "patcher.equivalence not importable"}
    out = {}
    for name, rep in runner_reports.items():
        model = Path(rep["model"]["path"]).name
        ref_path = hf_dir / f"hf_{model}.json"
        if not ref_path.is_file():
            continue
        c = compare(LogitReport.load(ref_path), LogitReport.from_json(rep))
        n = sum(r.positions for r in c.rows)
        out[name] = {"model": model, "dtype": rep["dtype"], "engine_path": rep["engine_path"], "passed": c.passed,
                     "rule": c.rule, "thresholds": c.thresholds, "reasons": c.reasons,
                     "positions": n, "mean_abs": round(sum(r.mean_abs * r.positions for r in c.rows) / n, 5),
                     "max_abs": round(max(r.max_abs for r in c.rows), 4),
                     "topk_overlap": round(sum(r.topk_overlap * r.positions for r in c.rows) / n, 4),
                     "generated_tokens": sorted({len(p["generated_token_ids"]) for p in rep["prompts"]})}
    return out


def plot(bisects: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, dtype in zip(axes, ("bfloat16", "float16")):
        for label, doc in bisects.items():
            run = doc["runs"].get(f"v2/{dtype}")
            if not run or "vs_hf_float32" not in run:
                continue
            rows = run["vs_hf_float32"]["per_position_max_abs"]
            flat = [v for r in rows for v in r]
            ax.plot(range(len(flat)), flat, lw=0.8, label=f"LMDeploy {label}")
        for _label, doc in list(bisects.items())[:1]:
            run = doc["runs"].get(f"v2/{dtype}")
            if run and f"hf_{dtype}_vs_hf_float32" in run:
                flat = [v for r in run[f"hf_{dtype}_vs_hf_float32"]["per_position_max_abs"] for v in r]
                ax.plot(range(len(flat)), flat, lw=0.8, color="grey", label=f"HF {dtype} (noise)")
        ax.set_yscale("log")
        ax.set_title(f"tiny DeepSeek-V2, {dtype} vs HF float32")
        ax.set_xlabel("position (4 prompts x 48 tokens)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("max |Δ log-softmax| per position")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", type=Path, required=True)
    ap.add_argument("--hf", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--provenance", type=Path, help="JSON merged into summary.json under 'provenance'")
    ap.add_argument("--extra", type=Path,
                    help="JSON object whose keys are added to summary.json (measurements made elsewhere)")
    args = ap.parse_args()
    runs = load_runs(args.run)
    bisects = {name: doc for name, doc in runs.items() if "runs" in doc and "label" in doc}
    runner_reports = {k: v for k, v in runs.items() if v.get("runner") == "lmdeploy_runner"}
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"provenance": json.loads(args.provenance.read_text()) if args.provenance else {},
               "hf_reference": {k: strip(v) for k, v in runs.items() if k.endswith("/ref.json")},
               "lmdeploy_vs_hf": {name: strip(doc) for name, doc in bisects.items()},
               "gate_verdicts": judge(runner_reports, args.hf) if args.hf else {}}
    if args.extra:
        summary.update(json.loads(args.extra.read_text()))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    first = args.run[0].name + "/"
    plot({doc["label"]: doc for name, doc in bisects.items() if name.startswith(first)},
         args.out / "per_position_delta.png")
    for name, v in summary["gate_verdicts"].items():
        verdict = "pass" if v.get("passed") else "FAIL"
        print(name, verdict, v.get("mean_abs"), v.get("generated_tokens"), v.get("reasons"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

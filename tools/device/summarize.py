"""One line per command of a device run (tools/device/lmdeploy_h200.sh): stdlib only, host Python.

    python3 tools/device/summarize.py RESULTS_DIR SUMMARY.json   > summary.txt

RESULTS_DIR holds one folder per chain with, per command, NN-STACK-ARGS.json (dsadapt's --json
output), .log (its stderr) and .meta.json (chain, stack, command, exit status, seconds). Prints a
fixed-width table (chain, stack, command, rc, verdict per dtype, the margin line of each check) and
writes every row with the check results to SUMMARY.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _results(doc: dict) -> list[dict]:
    if "results" in doc and isinstance(doc["results"], list):  # several dtypes: dsadapt.check-dtypes/1
        return [_power(r) if _is_power(r) else r for r in doc["results"]]
    if _is_power(doc):
        return [_power(doc)]
    return [doc] if "verdict" in doc else []


def _is_power(doc: dict) -> bool:
    return str(doc.get("schema", "")).startswith("dsadapt.power-report/")


def _power(doc: dict) -> dict:
    """A power report (`dsadapt power`) as a summary row: its verdict and every cell's MDE."""
    cells = []
    for c in doc.get("cells") or []:
        hi = c.get("flagged_at")
        mde = {"flagged": f"{hi:.3g}" if hi is not None else "-", "not flagged": f"> {doc['search']['eps_max']:g}",
               "below range": f"<= {doc['search']['eps_min']:g}"}.get(c.get("status"), c.get("status"))
        cells.append(f"{c.get('target')}/{c.get('phase')} {mde}")
    return {**doc, "verdict": "pass" if doc.get("passed") else "fail",
            "margins": {"words": "MDE " + ", ".join(cells) if cells else ""}}


def rows(results_dir: Path) -> list[dict]:
    out = []
    for meta_file in sorted(results_dir.glob("*/*.meta.json")):
        meta = json.loads(meta_file.read_text())
        out_file = meta_file.with_name(meta_file.name.removesuffix(".meta.json") + ".json")
        try:
            doc = json.loads(out_file.read_text())
        except (OSError, json.JSONDecodeError):
            doc = {}
        checks = []
        for r in _results(doc):
            m = r.get("margins") or {}
            checks.append({"dtype": r.get("dtype"), "model": r.get("model"), "verdict": r.get("verdict"),
                           "margin": m.get("words"), "reasons": (r.get("reasons") or [])[:2],
                           "report": r.get("report_path")})
        if not checks and doc.get("error"):
            checks.append({"verdict": "error", "margin": None, "reasons": [str(doc["error"])[:200]]})
        out.append({**meta, "checks": checks, "file": str(out_file)})
    for skipped in sorted(results_dir.glob("*/*.json")):
        if skipped.name.endswith(".meta.json") or skipped.with_name(skipped.stem + ".meta.json").exists():
            continue
        try:
            doc = json.loads(skipped.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("skipped"):
            out.append({"chain": skipped.parent.name, "stack": skipped.stem.split("-")[1], "command": skipped.stem,
                        "rc": None, "seconds": 0, "checks": [{"verdict": "skipped", "margin": doc["skipped"]}]})
    return out


def main(argv: list[str]) -> int:
    results_dir, summary = Path(argv[1]), Path(argv[2])
    table = rows(results_dir)
    summary.write_text(json.dumps(table, indent=1) + "\n")
    for r in table:
        head = f"{r['chain']:>4} {r['stack']:<16} {r['command'][:44]:<44} rc={r['rc']} {r['seconds']:>4}s"
        if not r["checks"]:
            print(f"{head}  (no result)")
        for c in r["checks"]:
            print(f"{head}  {c.get('dtype') or '':<8} {c.get('verdict')}: {c.get('margin') or ''}"
                  + (f" | {'; '.join(c['reasons'])}" if c.get("verdict") != "pass" and c.get("reasons") else ""))
    verdicts = [c.get("verdict") for r in table for c in r["checks"]]
    print(f"{len(table)} commands: " + ", ".join(f"{v} {verdicts.count(v)}" for v in sorted(set(map(str, verdicts)))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

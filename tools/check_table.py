"""A markdown table of check reports (dsadapt.check-report/1): one row per report.

    python tools/check_table.py REPORTS_DIR [...]

For docs and reviews of a batch of checks, e.g. what came back from the GPU machine
(`tar xzf reports.tgz reports`, then `python tools/check_table.py reports/lmdeploy`): pin,
variant, model, dtype, patched or unpatched, verdict, the rule, top-1 agreement, top-k overlap,
mean and max |Δ logprob|, positions, the engine's and the reference's device, the engine's
torch, and the report's date.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def rows(paths: list[Path]) -> list[str]:
    out = ["| pin | variant | model | dtype | side | verdict | rule | top-1 | top-k overlap | mean \\|Δ\\| | "
           "max \\|Δ\\| | positions | engine on | reference on | torch | date |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    files = sorted(f for p in paths for f in (p.rglob("*.json") if p.is_dir() else [p]))
    for f in files:
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(d, dict) or d.get("schema") != "dsadapt.check-report/1":
            continue
        c, p = d.get("comparison") or {}, d.get("provenance") or {}
        s = c.get("summary") or {}
        gpu = (p.get("gpu") or {}).get("name")
        verdict = d.get("verdict", "?") + (" (engine failed)" if c and c.get("rule") is None else "")
        out.append("| " + " | ".join([
            d.get("pin", "?"), d.get("variant", "?"), f"{d.get('model')}{'/' + d['config_style'] if d.get('config_style') else ''}",
            d.get("dtype", "?"), "unpatched" if d.get("unpatched") else "patched", f"**{verdict}**",
            str(c.get("rule") or "-"), _fmt(s.get("top1"), ".3f"), _fmt(s.get("topk_overlap"), ".3f"),
            _fmt(s.get("mean_abs"), ".4f"), _fmt(s.get("max_abs"), ".3g"), str(s.get("positions", "-")),
            gpu or str(p.get("device", "-")), str(p.get("reference_device", "-")),
            str((p.get("engine_versions") or {}).get("torch", "-")), str(p.get("date", "-"))[:10]]) + " |")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(rows([Path(a) for a in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

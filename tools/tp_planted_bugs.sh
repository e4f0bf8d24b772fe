#!/bin/bash
# Planted parallel-only bugs against the parallel gate, through the product only (the manual run
# whose results are committed under reports/vllm/v0.32.0/tp-planted/; docs/equivalence.md,
# "Parallel runs", has the table).
#
#   bash tools/tp_planted_bugs.sh [BUG ...]      BUG: head-offset expert-rank group-limit-per-rank
#                                                (default: every tools/tp/vllm-v0.32.0-tp-*.patch)
#
# For each bug: a copy of this project whose vllm@v0.32.0 stack ends with
# tools/tp/vllm-v0.32.0-tp-BUG.patch (`dsadapt verify` first), then in that project
#   dsadapt check vllm@v0.32.0 --model v3 --json              every dtype, one process: must PASS
#   dsadapt check vllm@v0.32.0 --model v3 --tp 2 --bisect --json   every dtype, two ranks: must FAIL,
#                                                             the per-module comparison naming where
# The planted builds are installed into the shared environment (DSADAPT_VENVS, default
# <repo>/.dsadapt/venvs) one after the other; at the end the correct stack is installed back.
# Knobs: DTYPES (default: every dtype; e.g. "float32"), OUT (default reports/vllm/v0.32.0/tp-planted),
# DSADAPT (default: this checkout's patcher with .venv's python).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIN=vllm@v0.32.0
OUT=${OUT:-$ROOT/reports/vllm/v0.32.0/tp-planted}
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export DSADAPT_VENVS=${DSADAPT_VENVS:-$ROOT/.dsadapt/venvs}
export DSADAPT_CACHE=${DSADAPT_CACHE:-$ROOT/.dsadapt/cache}
export DSADAPT_SOURCES=${DSADAPT_SOURCES:-pypi}
ds() { PYTHONPATH=$ROOT "$PY" -m patcher.cli.main "$@"; }
relativize() {  # DIR PREFIX...: drop each prefix from the paths written in DIR's files
  local dir=$1; shift
  "$PY" - "$dir" "$@" <<'REL'
import sys
from pathlib import Path
prefixes = sorted({p for p in sys.argv[2:] if len(p) > 1}, key=len, reverse=True)
for f in Path(sys.argv[1]).rglob("*"):
    if f.is_file():
        text = f.read_text(errors="replace")
        for pre in prefixes:
            text = text.replace(pre, "")
        f.write_text(text)
REL
}
bugs=("$@")
if [ ${#bugs[@]} -eq 0 ]; then
  for f in "$ROOT"/tools/tp/vllm-v0.32.0-tp-*.patch; do b=${f##*/vllm-v0.32.0-tp-}; bugs+=("${b%.patch}"); done
fi
dtype_args=()
for d in ${DTYPES:-}; do dtype_args+=(--dtype "$d"); done
mkdir -p "$OUT"
T0=$SECONDS
for bug in "${bugs[@]}"; do
  patch=$ROOT/tools/tp/vllm-v0.32.0-tp-$bug.patch
  [ -f "$patch" ] || { echo "no $patch"; exit 2; }
  proj=$(mktemp -d "/tmp/dsadapt-tp-$bug.XXXX")
  cp "$ROOT/upstream.lock" "$proj/" && cp -r "$ROOT/patches" "$proj/"
  # the file name `dsadapt verify` expects: the next position in the series, from the patch's subject
  n=$(grep -cv '^\s*\(#\|$\)' "$proj/patches/vllm/v0.32.0/series")
  name=$(PYTHONPATH=$ROOT "$PY" -c "import sys; from patcher.formats.patchfile import parse_patch, patch_filename; \
p = parse_patch(open(sys.argv[1]).read(), sys.argv[1]); print(patch_filename(int(sys.argv[2]), p.subject))" \
    "$patch" $((n + 1))) || exit 2
  cp "$patch" "$proj/patches/vllm/v0.32.0/$name"
  echo "$name" >> "$proj/patches/vllm/v0.32.0/series"
  mkdir -p "$OUT/$bug"
  export DSADAPT_PROJECT=$proj
  ds verify "$PIN" > "$OUT/$bug/verify.txt" 2>&1 || { echo "$bug: the planted stack does not verify"; cat "$OUT/$bug/verify.txt"; exit 1; }
  for side in tp1 tp2; do
    args=()
    [ "$side" = tp2 ] && args=(--tp 2 --bisect)
    ds check "$PIN" --model v3 "${dtype_args[@]}" "${args[@]}" --json > "$OUT/$bug/$side.json" 2> "$OUT/$bug/$side.log"
    echo "=== $((SECONDS - T0))s $bug $side rc=$?"
  done
  # the per-module reports of the two-rank run (JSON only; heat maps are rebuilt from them)
  cp "$proj"/.dsadapt/reports/vllm/v0.32.0/v3-*-tp2-bisect.json "$OUT/$bug/" 2>/dev/null
  # committed results name project-relative paths, not this machine's
  relativize "$OUT/$bug" "$proj/" "$ROOT/" "$(dirname "$(dirname "$(dirname "$PY")")")/"
  rm -rf "$proj"
done
unset DSADAPT_PROJECT
ds install "$PIN" > /dev/null 2>&1 || echo "could not reinstall the correct stack into $DSADAPT_VENVS"
"$PY" - "$OUT" "${bugs[@]}" <<'PY'
import json, sys
from pathlib import Path
out, bugs = Path(sys.argv[1]), sys.argv[2:]

def runs(doc):
    return doc.get("results") or [doc]

summary = {}
for bug in bugs:
    row = {}
    for side in ("tp1", "tp2"):
        f = out / bug / f"{side}.json"
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            row[side] = {"error": f"no JSON in {f.name}"}
            continue
        per = {}
        for r in runs(doc):
            first = (r.get("bisect") or {}).get("first") or {}
            per[r["dtype"]] = {"verdict": r["verdict"], "reasons": r["reasons"][:2],
                               "first": {k: first.get(k) for k in ("layer", "point", "family", "rank", "layout",
                                                                   "module", "error", "limit")} if first else None}
        row[side] = per
    summary[bug] = row
(out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
print("| bug | TP 1 (every dtype) | --tp 2 | first divergence at TP 2 (per dtype) |")
print("|---|---|---|---|")
for bug, row in summary.items():
    tp1 = ", ".join(f"{d} {v['verdict']}" for d, v in row["tp1"].items()) if "error" not in row["tp1"] else row["tp1"]["error"]
    tp2 = ", ".join(f"{d} {v['verdict']}" for d, v in row["tp2"].items()) if "error" not in row["tp2"] else row["tp2"]["error"]
    firsts = "; ".join(
        f"{d}: layer {v['first']['layer']} {v['first']['point']} ({v['first']['family']}"
        + (", every rank's partial sums" if v['first']['layout'] == "partial" else f", rank {v['first']['rank']}") + ")"
        for d, v in (row["tp2"].items() if "error" not in row["tp2"] else []) if v.get("first"))
    print(f"| {bug} | {tp1} | {tp2} | {firsts or '-'} |")
PY
echo "=== $((SECONDS - T0))s done"

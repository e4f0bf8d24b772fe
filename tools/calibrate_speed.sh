#!/bin/bash
# Calibrate the speed gate (`dsadapt perf`) on this machine, through the product only: A/A runs of
# the patched build against itself and runs with a known slowdown planted into the patched build,
# interleaved (A/A, planted, A/A, planted, ...) so that the machine's load drifts over both alike,
# then the summary docs/speed.md quotes (tools/speed_calibration.py).
#
#   bash tools/calibrate_speed.sh [PIN]                  PIN: default vllm@v0.32.0
#
# Run it when the machine is quiet (it records the load average of every run; a loaded machine
# measures its load, not the gate). Knobs (environment):
#   RUNS      A/A runs and planted runs, each (default 10)
#   PERF_ARGS options for every `dsadapt perf` run (default: the gate's defaults: concurrency 1,4,16,
#             6 rounds, 1 warm-up round); e.g. "--concurrency 1,4 --requests 12" for a shorter run
#   CPUS      --cpus for every run (default: every CPU this shell may use)
#   MATMULS   the planted strength, 64x64 products per decoder layer and step (tools/plant_decode_work.py):
#             "N", or per step token count "1:N1,4:N4"; "auto" (default): sized by a first planted run
#             (SIZE_MATMULS products at every step, default 32) to slow TPOT by TARGET at each of its levels
#   TARGET    the planted slowdown to size for (default 0.10)
#   WORK      scratch folder: the project copy, its work dir, reports, logs (default .dsadapt/calibration)
#   DSADAPT   the dsadapt command (default: this checkout's, `python -m patcher.cli.main`)
#   SIZE_ARGS options of the sizing run (default "--concurrency 1,4 --rounds 2 --requests 8,16 --warmup 1":
#             its levels should be PERF_ARGS's)
# The environments come from DSADAPT_VENVS (default: the scratch work dir's venvs); point it at a
# venv root that already holds this pin's environments to save their install (the planted build is
# swapped in there; at the end `dsadapt install PIN` of this repository puts its own stack back).
# Output: WORK/reports/{aa,planted}-NN.json (+ .png), WORK/summary.md and summary.json, WORK/log.txt.
set -o pipefail
PIN=${1:-vllm@v0.32.0}
ENGINE=${PIN%@*}; TAG=${PIN#*@}
REPO=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-10}; TARGET=${TARGET:-0.10}; MATMULS=${MATMULS:-auto}
WORK=$(mkdir -p "${WORK:-$REPO/.dsadapt/calibration}" && cd "${WORK:-$REPO/.dsadapt/calibration}" && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}; [ -x "$PY" ] || PY=python3
DSADAPT=${DSADAPT:-"$PY -m patcher.cli.main"}
SIZE_ARGS=${SIZE_ARGS:-"--concurrency 1,4 --rounds 2 --requests 8,16 --warmup 1"}
CPU_ARG=${CPUS:+--cpus $CPUS}
PROJ=$WORK/project
export DSADAPT_PROJECT=$PROJ DSADAPT_WORKDIR=$WORK/dsadapt-work PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
SHARED_VENVS=${DSADAPT_VENVS:-}
export DSADAPT_VENVS=${DSADAPT_VENVS:-$WORK/dsadapt-work/venvs}
exec > >(tee -a "$WORK/log.txt") 2>&1
T0=$SECONDS
stamp() { echo "=== $((SECONDS - T0))s load $(cut -d' ' -f1-3 /proc/loadavg) $*"; }
ds() { $DSADAPT "$@"; }

stamp "calibrating the speed gate on $PIN: $RUNS A/A + $RUNS planted runs; perf ${PERF_ARGS:-(defaults)} $CPU_ARG"
if [ ! -f "$PROJ/upstream.lock" ]; then  # the project's lock and stacks, plus one planted patch
  mkdir -p "$PROJ" && cp "$REPO/upstream.lock" "$PROJ/" && cp -r "$REPO/patches" "$PROJ/" || exit 1
  ds apply "$PIN" || exit 1
  CO=$DSADAPT_WORKDIR/checkouts/$ENGINE/$TAG
  "$PY" "$REPO/tools/plant_decode_work.py" "$CO" || exit 1
  git -C "$CO" commit -q -am "deepseek_v2: planted decode work per step (speed-gate calibration)

A constant amount of device work per decoder layer and step, DSADAPT_PLANTED_MATMULS products of
64x64 (0: none), for calibrating dsadapt perf. Never shipped.

Upstream-Status: Inappropriate [speed-gate calibration]" || exit 1
  ds refresh "$PIN" || exit 1
fi
mkdir -p "$WORK/reports"

perf() {  # name matmuls extra-args...
  local name=$1 n=$2; shift 2
  DSADAPT_PLANTED_MATMULS=$n ds --report-dir "$WORK/dsadapt-work/reports-$name" perf "$PIN" $CPU_ARG "$@" > "$WORK/$name.out" 2>&1
  local rc=$? f
  f=$(ls -t "$WORK/dsadapt-work/reports-$name/$ENGINE/$TAG"/perf-*.json 2>/dev/null | head -1)
  if [ -n "$f" ]; then
    "$PY" - "$f" "$n" <<'EOF'
import json, sys
path, n = sys.argv[1], sys.argv[2]  # "N", or per token count "1:N1,4:N4"
d = json.load(open(path))
d["provenance"]["planted"] = {"matmuls": n, "by": "tools/plant_decode_work.py", "knob": "DSADAPT_PLANTED_MATMULS"}
json.dump(d, open(path, "w"), indent=1, sort_keys=True)
EOF
    local dest=$WORK/reports; [ "$name" = sizing ] && dest=$WORK  # the sizing run is not a calibration run
    cp "$f" "$dest/$name.json"; cp "${f%.json}.png" "$dest/$name.png" 2>/dev/null
  fi
  stamp "$name (matmuls $n): rc=$rc $(grep -m1 -o 'verdict: [A-Z]*' "$WORK/$name.out" 2>/dev/null)"
  return $rc
}

if [ "$MATMULS" = auto ]; then  # size the plant: TPOT at concurrency 1 is linear in the products per step
  N0=${SIZE_MATMULS:-32}
  # shellcheck disable=SC2086
  perf sizing "$N0" $SIZE_ARGS
  MATMULS=$("$PY" "$REPO/tools/speed_calibration.py" size "$WORK/sizing.json" --sizing-matmuls "$N0" --target "$TARGET") || exit 1
  stamp "sizing: $N0 products gave TPOT ratios $("$PY" -c "import json; d=json.load(open('$WORK/sizing.json')); print(', '.join(f\"c={p['concurrency']} {p['ratios']['tpot_mean']['estimate']:.3f}\" for p in d['points']))"); using $MATMULS for a $TARGET slowdown"
fi
echo "$MATMULS" > "$WORK/matmuls.txt"

for i in $(seq 1 "$RUNS"); do
  i=$(printf %02d "$i")
  # shellcheck disable=SC2086
  perf "aa-$i" 0 --aa $PERF_ARGS
  # shellcheck disable=SC2086
  perf "planted-$i" "$MATMULS" $PERF_ARGS
done
if [ -n "$SHARED_VENVS" ]; then  # a shared venv root: its environment holds the project's own stack again
  (unset DSADAPT_WORKDIR; DSADAPT_PROJECT=$REPO ds install "$PIN" > "$WORK/restore.out" 2>&1) || echo "note: restoring $PIN in $SHARED_VENVS failed: $WORK/restore.out"
fi
"$PY" "$REPO/tools/speed_calibration.py" "$WORK/reports" --out "$WORK/summary.md" --json "$WORK/summary.json"
stamp done

#!/bin/bash
# The speed gate's calibration on the GPU machine (an H200 without network), through the product only:
# A/A runs of the patched LMDeploy build against itself and runs with a planted slowdown, in parallel
# chains on split CPUs sharing the one GPU, then the summary of tools/speed_calibration.py.
#
# Here (host, with network once):   bash tools/device/perf_h200.sh prepare      (or: make gpu-perf)
#   -> .carry/perf: an offline bundle of a project copy whose LMDeploy stack is the committed one plus
#      the planted decode work of tools/plant_decode_work.py (a constant amount of GPU work per decoder
#      layer and step, inside the model's forward, so CUDA graphs capture and replay it; it costs
#      nothing unless DSADAPT_PLANTED_MATMULS > 0), with the unpatched build beside it.
# On the device (command, from this checkout; carry [".carry/perf"]; timeout_s 600):
#   bash tools/device/perf_h200.sh device
#
# Device knobs (environment):
#   CHAINS     parallel chains (default 5); the CPUs are split between them (--cpus), the GPU is shared
#   RUNS       A/A runs and planted runs, each (default 10); chain k runs aa-k, planted-k, aa-(k+CHAINS), ...
#   MATMULS    planted strength (64x64 products per layer and step: "N", or by the step's token count
#              "1:N1,16:N16"); "auto" (default): per level, from the first A/A run's TPOT at that level and
#              the measured cost of one product in a CUDA graph, for TARGET at every level
#   TARGET     planted slowdown to size for (default 0.10)
#   PERF_ARGS  default "--concurrency 1,16 --rounds 8 --requests 16,64 --warmup 1" (4 requests per stream at 16)
#   END        seconds after the start by which every run has ended (default 560, inside the device's 600):
#              a run gets --time-limit min(RUN_S, what is left), and none starts with less than MIN_RUN_S left
#   RUN_S, MIN_RUN_S   default 240 and 100
#   PIN, VARIANT, MODEL, DTYPE   default lmdeploy@v0.18.0, pytorch, v3, bfloat16
#   BUNDLE     the bundle folder (default .carry/perf);  PYTHON  the host's python (default python3)
#   SKIP_BOOTSTRAP=1 and D=<dsadapt command>: use an installed dsadapt and existing environments (a rehearsal)
# Results in $OUT (8 files at most): log.txt, install.json, summary.md, summary.json, reports.tgz (every
# report JSON and PNG, each chain's log, the servers' and load generator's logs while under 15 MB).
# Here afterwards: tar xzf OUT/reports.tgz; python3 tools/speed_calibration.py perf-calibration/reports
set -o pipefail
MODE=${1:?usage: perf_h200.sh prepare|device}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PIN=${PIN:-lmdeploy@v0.18.0}; VARIANT=${VARIANT:-pytorch}; MODEL=${MODEL:-v3}; DTYPE=${DTYPE:-bfloat16}
ENGINE=${PIN%@*}; TAG=${PIN#*@}

prepare() {
  local proj=${PERF_PROJECT:-/tmp/dsadapt-perf-project} ds=${DSADAPT:-$ROOT/.venv/bin/dsadapt}  # ds: a command, may hold spaces
  local py=${PYTHON:-$ROOT/.venv/bin/python}
  rm -rf "$proj" "$ROOT/.carry/perf" && mkdir -p "$proj"
  cp "$ROOT/upstream.lock" "$proj/" && cp -r "$ROOT/patches" "$proj/"
  export DSADAPT_WORKDIR=$proj/.dsadapt
  $ds --project "$proj" apply "$PIN" || exit 1
  local co=$proj/.dsadapt/checkouts/$ENGINE/$TAG
  "$py" "$ROOT/tools/plant_decode_work.py" "$co" || exit 1
  git -C "$co" commit -q -am "deepseek_v2: planted decode work per step (speed-gate calibration)

A constant amount of GPU work per decoder layer and step, DSADAPT_PLANTED_MATMULS products of
64x64 (0: none), for calibrating dsadapt perf. Never shipped.

Upstream-Status: Inappropriate [speed-gate calibration]" || exit 1
  $ds --project "$proj" refresh "$PIN" || exit 1
  $ds --project "$proj" bundle "$PIN" --variant "$VARIANT" --have "$ROOT/tools/device/h200-pip-list.json" \
    --out "$ROOT/.carry/perf" --max-size 58MiB || exit 1
  echo "on the GPU machine, from this checkout: command 'bash tools/device/perf_h200.sh device', carry ['.carry/perf'], timeout_s 600"
}

device() {
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  local B; B=$(cd "${BUNDLE:-$ROOT/.carry/perf}" && pwd) || exit 9
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  CHAINS=${CHAINS:-5}; RUNS=${RUNS:-10}; MATMULS=${MATMULS:-auto}; TARGET=${TARGET:-0.10}
  END=${END:-560}; RUN_S=${RUN_S:-240}; MIN_RUN_S=${MIN_RUN_S:-100}
  PERF_ARGS=${PERF_ARGS:-"--concurrency 1,16 --rounds 8 --requests 16,64 --warmup 1"}
  local PY=${PYTHON:-python3}
  local W=$B/perf-calibration; rm -rf "$W"; mkdir -p "$W/reports"
  cd "$B" || exit 9
  exec > >(tee "$OUT/log.txt") 2>&1
  T0=$SECONDS
  stamp() { echo "=== $((SECONDS - T0))s load $(cut -d' ' -f1-3 /proc/loadavg) $*"; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null; nproc
  if [ -z "${SKIP_BOOTSTRAP:-}" ]; then
    export DSADAPT_VENVS=$B/.dsadapt/venvs
    stamp bootstrap
    "$PY" bootstrap.py --system-site-packages || exit 1
    D=${D:-$B/.dsadapt/env/bin/dsadapt}
    "$D" install --offline . --system-site-packages --json > "$OUT/install.json"; echo "install rc=$?"
  fi
  : "${D:?set D to the dsadapt command}"
  if [ -n "${SKIP_BOOTSTRAP:-}" ]; then  # the chains share the environments: make them once, before
    "$D" install "$PIN" --variant "$VARIANT" > "$OUT/install.json" 2>&1 || { echo "install failed"; exit 1; }
  fi
  stamp "calibration: $RUNS A/A + $RUNS planted runs of $PIN ($VARIANT, $MODEL, $DTYPE) in $CHAINS chains; perf $PERF_ARGS"
  # the CPUs, split into CHAINS equal slices (each chain's servers and load generator stay inside its own)
  mapfile -t CPUS < <("$PY" -c "import os; print('\n'.join(map(str, sorted(os.sched_getaffinity(0)))))")
  local per=$(( ${#CPUS[@]} / CHAINS )); [ "$per" -ge 1 ] || { echo "fewer CPUs than chains"; exit 9; }
  # chain k (1-based) runs aa-k, planted-k, aa-(k+CHAINS), planted-(k+CHAINS), ...: every chain starts with
  # an A/A run (chain 1's sizes the plant), RUNS of each kind in all
  chain() {  # k
    local k=$1 slice j num name left
    slice=$(IFS=,; echo "${CPUS[*]:$(( (k - 1) * per )):$per}")
    for (( j = 0; ; j++ )); do
      num=$(( j / 2 * CHAINS + k )); [ "$num" -le "$RUNS" ] || break
      name=$(printf "%s-%02d" "$( [ $((j % 2)) -eq 0 ] && echo aa || echo planted)" "$num")
      left=$(( END - (SECONDS - T0) - 15 ))
      if [ "$left" -lt "$MIN_RUN_S" ]; then echo "=== $((SECONDS - T0))s chain $k: stopped before $name (END)"; break; fi
      [ "$left" -le "$RUN_S" ] || left=$RUN_S
      n=0
      if [ "${name%%-*}" = planted ]; then
        while [ ! -s "$W/matmuls.txt" ] && [ $(( END - (SECONDS - T0) - 15 )) -ge "$MIN_RUN_S" ]; do sleep 2; done
        n=$(cat "$W/matmuls.txt" 2>/dev/null || echo 0)
        [ -n "$n" ] && [ "$n" != 0 ] || { echo "=== chain $k: no planted strength; skipping $name"; continue; }
      fi
      # shellcheck disable=SC2086
      DSADAPT_PLANTED_MATMULS=$n DSADAPT_WORKDIR=$B/.w$k "$D" --report-dir "$W/r-$name" perf "$PIN" \
        --variant "$VARIANT" --model "$MODEL" --dtype "$DTYPE" --cpus "$slice" \
        $( [ "${name%%-*}" = aa ] && echo --aa ) $PERF_ARGS --time-limit "$left" > "$W/$name.out" 2>&1
      local rc=$? f
      f=$(ls -t "$W/r-$name/$ENGINE/$TAG"/perf-*.json 2>/dev/null | head -1)
      if [ -n "$f" ]; then
        "$PY" - "$f" "$n" "$W/reports/$name.json" <<'EOF'
import json, sys
src, n, dst = sys.argv[1], sys.argv[2], sys.argv[3]  # "N", or per token count "1:N1,16:N16"
d = json.load(open(src))
d["provenance"]["planted"] = {"matmuls": n, "by": "tools/plant_decode_work.py", "knob": "DSADAPT_PLANTED_MATMULS"}
json.dump(d, open(dst, "w"), indent=1, sort_keys=True)
EOF
        cp "${f%.json}.png" "$W/reports/$name.png" 2>/dev/null
      fi
      echo "=== $((SECONDS - T0))s chain $k (cpus $slice): $name matmuls $n rc=$rc $(grep -m1 -o 'verdict: [A-Z]*' "$W/$name.out")"
      if [ "$name" = aa-01 ] && [ "$MATMULS" = auto ] && [ -n "$f" ]; then size "$f"; fi
    done
  }
  size() {  # the planted strength for TARGET at each level from an A/A report: TPOT per level / (layers x product)
    local us
    us=$("${DSADAPT_VENVS:-$B/.dsadapt/venvs}/$ENGINE-$TAG-$VARIANT/bin/python" "$ROOT/tools/plant_decode_work.py" --product-cost 2>/dev/null \
         || "$PY" "$ROOT/tools/plant_decode_work.py" --product-cost)
    "$PY" "$ROOT/tools/speed_calibration.py" size "$1" --product-us "$us" --target "$TARGET" > "$W/matmuls.tmp" || return
    mv "$W/matmuls.tmp" "$W/matmuls.txt"
    stamp "sizing: one product ${us} us on the device, TPOT from aa-01; planted strength $(cat "$W/matmuls.txt")"
  }
  if [ "$MATMULS" != auto ]; then echo "$MATMULS" > "$W/matmuls.txt"; fi
  local pids=() k
  for (( k = 1; k <= CHAINS; k++ )); do chain "$k" > "$W/chain$k.txt" 2>&1 & pids+=($!); done
  wait "${pids[@]}"
  cat "$W"/chain*.txt
  stamp runs done
  "$PY" "$ROOT/tools/speed_calibration.py" "$W/reports" --out "$OUT/summary.md" --json "$OUT/summary.json"
  { find perf-calibration -type f \( -name '*.json' -o -name '*.png' -o -name '*.txt' -o -name '*.out' \) 2>/dev/null; } \
    > /tmp/dsadapt-perf-pack.txt
  tar czf "$OUT/reports.tgz" -T /tmp/dsadapt-perf-pack.txt
  find .w*/runs -type f -name '*.log' -size -2M 2>/dev/null >> /tmp/dsadapt-perf-pack.txt
  tar czf "$OUT/reports-full.tgz" -T /tmp/dsadapt-perf-pack.txt && [ "$(stat -c %s "$OUT/reports-full.tgz")" -lt 15000000 ] \
    && mv "$OUT/reports-full.tgz" "$OUT/reports.tgz"; rm -f "$OUT/reports-full.tgz"
  ls -la "$OUT"
  stamp end
}

case $MODE in
  prepare) prepare ;;
  device) device ;;
  *) echo "usage: perf_h200.sh prepare|device" >&2; exit 2 ;;
esac

#!/bin/bash
# The fabricated checkpoints' structure, checked on the H200 through the product only, in the same
# device call as the committed LMDeploy reports (tools/device/reports_h200.sh):
#
#   here:    bash tools/device/structure_h200.sh prepare [OUT]    # the bundle (default .carry/reports): the
#                                                                 #   pin's stack and the planted FP8 stack `fp8-act`
#   device:  bash tools/device/structure_h200.sh device [BUNDLE]  # the run (command of the device call)
#   here:    bash tools/device/reports_h200.sh unpack DIR         # the committed reports, as for reports_h200.sh
#
# `device` is tools/device/lmdeploy_h200.sh with reports/plan.txt's h200 lines (the same lines
# reports_h200.sh runs, read by tools/refresh_reports.py): every built-in model in both dtypes, one
# chain each, published; and, as that script's EXTRA, `fp8` below: the plan's made model (`dsadapt model
# make --like deepseek-v3 --layers 4 --mtp 0`, block-FP8, 17 GB, made there by the bundle's dsadapt)
# and its published fp8 check on the correct stack (the plan's lines), then on the same folder
# the planted FP8 bugs of tools/gpu/lmdeploy-v0.18.0-fp8-activation.patch (the stack `fp8-act`),
# each an fp8 check that must FAIL at its first module (docs/equivalence.md, "Block FP8: bugs
# that double the FP8 error"): activations rounded through e5m2 (layer 0 q_a_norm), one activation
# scale per 512 channels (layer 0 mlp or layer 1 q_a_norm), e5m2 in the routed experts only (layer 3
# routed). The planted checks start once the correct one's engine runs (its float32 reference is
# cached then: one reference for all), at most two engines at a time (the correct one's included,
# as tools/device/fp8_h200.sh runs them); the HF captures take the GPU in turn (the gate's
# reference slot). Planted checks that would start with less than 60 s left are reported skipped,
# in the order e5m2, moe-e5m2, group512. The plan's made model has 4 layers already, so
# no `model slice` runs here (the slicer is tested on CPU: tests/checkpoints/test_checkpoints.py).
#
# Knobs (environment): DEADLINE (seconds from the start by which every command has ended; default
# 420), BUGS ("e5m2 moe-e5m2 group512"), WORKERS (model make, 8), MADE_DIR (BUNDLE/../made), PLAN (reports/plan.txt), PYTHON (python3), OUT (/tmp/out).
# Results in $OUT (lmdeploy_h200.sh's files): summary.txt / summary.json (the control chains),
# reports.tgz: every published report (reports/ and stacks/fp8-act/reports/), extra/extra.txt (this
# script's steps with their exit status), extra/fp8act-NAME.json / .log (each planted check's --json
# output and log), extra/made-N.json / .log (the plan's made lines).
# Rehearsed on CPU with the toy engine: tests/tools/test_structure_device.py.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PLAN=${PLAN:-$ROOT/reports/plan.txt}
PY=${PYTHON:-python3}
STACK=fp8-act
PATCH=tools/gpu/lmdeploy-v0.18.0-fp8-activation.patch

plan() { "$PY" "$ROOT/tools/refresh_reports.py" --plan "$PLAN" --machine h200 "$@"; }

prepare() {
  local head
  head=$(plan --chains | head -1) || exit 2
  PIN=${head% *} VARIANT=${head#* } PLANTED="" EXTRA_PLANTED="$STACK=$PATCH" \
    bash "$ROOT/tools/device/prepare_bundle.sh" "${1:-$ROOT/.carry/reports}"
}

device() {
  local B=${1:-$ROOT/.carry/reports} head
  head=$(plan --chains | head -1) || exit 2
  PIN=${head% *}; VARIANT=${head#* }
  CHAINS=$(plan --chains | tail -n +2)
  START_EPOCH=$(date +%s)
  DEADLINE=${DEADLINE:-420}
  EXTRA="bash $ROOT/tools/device/structure_h200.sh fp8"
  export PIN VARIANT CHAINS START_EPOCH DEADLINE EXTRA PLAN PYTHON=$PY CMD_S=${CMD_S:-240}
  exec bash "$ROOT/tools/device/lmdeploy_h200.sh" "$B"
}

left() { echo $(( DEADLINE - ($(date +%s) - START_EPOCH) )); }

fp8() {  # as lmdeploy_h200.sh's EXTRA: it exports $D (the bundle's dsadapt), $B, $EXTRA_DIR, DSADAPT_CACHE
  : "${D:?run as lmdeploy_h200.sh EXTRA}" "${B:?}" "${EXTRA_DIR:?}" "${DEADLINE:?}" "${START_EPOCH:?}"
  local W=${MADE_DIR:-$B/../made} n=0 line model="" rc
  mkdir -p "$W"
  # the plan's made lines: `model make`, then the published fp8 check of the correct stack; the
  # planted checks start beside that check, once its log says its engine runs
  local lines; lines=$(plan --made "$W") || exit 2
  while IFS= read -r line; do
    n=$((n + 1))
    eval "set -- $line"
    if [ "$1 $2" = "model make" ]; then
      set -- "$@" --workers "${WORKERS:-8}"
      model=$(printf '%s\n' "$@" | grep -A1 -x -- --out | tail -1)
      run_made "$n" "$@" || { echo "=== make failed: planted checks skipped"; break; }
      continue
    fi
    if [ "$1" = check ] && [ -n "$model" ]; then
      run_made "$n" "$@" &
      local correct=$! log=$EXTRA_DIR/made-$n.log
      planted "$model" "$log" "$correct"
      wait "$correct"
      continue
    fi
    run_made "$n" "$@"
  done <<< "$lines"
  rm -rf "$W"
}

run_made() {  # N DSADAPT-ARGS...: one plan line in the main project, ended by the deadline
  local n=$1 t; shift
  t=$(left)
  if [ "$t" -lt 30 ]; then echo "=== made $n skipped (${t}s left)"; printf '{"skipped": "%ss left"}\n' "$t" \
    > "$EXTRA_DIR/made-$n.json"; return 124; fi
  DSADAPT_VENVS=$B/.dsadapt/venvs DSADAPT_WORKDIR=$B/.wmade timeout -k 10 "$t" "$D" --project "$B" "$@" \
    > "$EXTRA_DIR/made-$n.json" 2> "$EXTRA_DIR/made-$n.log"
  rc=$?
  echo "=== $(( $(date +%s) - START_EPOCH ))s made $n rc=$rc: $*"
  return $rc
}

alive() {  # PID...: how many are still running
  local n=0 p
  for p in "$@"; do kill -0 "$p" 2>/dev/null && n=$((n + 1)); done
  echo "$n"
}

wait_for() {  # LOG PATTERN PID: until LOG shows PATTERN or PID has ended
  while kill -0 "$3" 2>/dev/null && ! grep -q "$2" "$1" 2>/dev/null; do sleep 2; done
}

planted() {  # MODEL CORRECT_LOG CORRECT_PID: the planted fp8 checks, each in its own work dir
  local model=$1 log=$2 pid=$3 E=$B/stacks/$STACK bug i=0 pids=() t
  if [ ! -d "$E" ]; then echo "=== no stack $STACK in the bundle: planted checks skipped"; return; fi
  wait_for "$log" "engine: lmdeploy" "$pid"  # the float32 reference is cached: the planted checks reuse it
  for bug in ${BUGS:-e5m2 moe-e5m2 group512}; do
    while [ "$(alive "$pid" "${pids[@]}")" -ge 2 ]; do sleep 2; done  # two engines at a time, and one reference
    t=$(left)
    if [ "$t" -lt 60 ]; then echo "=== planted $bug skipped (${t}s left)"
      printf '{"skipped": "%ss left"}\n' "$t" > "$EXTRA_DIR/fp8act-$bug.json"; continue; fi
    ( DSADAPT_PLANTED_FP8_BUG=$bug DSADAPT_VENVS=$E/.dsadapt/venvs DSADAPT_WORKDIR=$E/.wfp8-$bug \
        timeout -k 10 "$t" "$D" --project "$E" check "$PIN" --variant "$VARIANT" --model "$model" --dtype fp8 \
        --publish --json > "$EXTRA_DIR/fp8act-$bug.json" 2> "$EXTRA_DIR/fp8act-$bug.log"
      rc=$?
      echo "=== $(( $(date +%s) - START_EPOCH ))s planted $bug rc=$rc (a planted bug must fail: rc 1)" ) &
    pids+=($!); i=$((i + 1))
    sleep 5
  done
  [ "${#pids[@]}" -gt 0 ] && wait "${pids[@]}"
}

cmd=${1:?prepare|device}; shift
case $cmd in prepare|device|fp8) "$cmd" "$@" ;; *) echo "unknown: $cmd (prepare|device)" >&2; exit 2 ;; esac

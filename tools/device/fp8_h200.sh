#!/bin/bash
# The gate on a DeepSeek-V3-shaped block-FP8 checkpoint, on the H200, through the product only.
#
# Here: the one bundle of the device call carries the planted FP8 stack as one more of its extra
# stacks (`fp8-scale`: tools/gpu/lmdeploy-v0.18.0-fp8-block-scale.patch), so nothing else is carried:
#   bash tools/device/fp8_h200.sh prepare [OUT]  # = EXTRA_PLANTED=fp8-scale=... tools/device/prepare_bundle.sh
#   bash tools/device/fp8_h200.sh rehearse       # the device steps on this machine, small (the LMDeploy
#                                                #    checks end with exit 6 on a machine without a GPU)
# On the device, as lmdeploy_h200.sh's EXTRA (it exports $D, $B, $EXTRA_DIR, DSADAPT_CACHE, DEADLINE):
#   EXTRA='bash tools/device/fp8_h200.sh device' bash tools/device/lmdeploy_h200.sh .carry/gpu
#
# `device`: 1. `dsadapt model make --like deepseek-v3 --layers $MAKE_LAYERS --mtp $MTP` (default 4 and
# 1: the 3 dense layers, the first MoE layer of 256 experts and the MTP module, block-FP8, 32.4 GB;
# MAKE_LAYERS=6 MTP=0 is the 40.0 GB variant with two more MoE layers) 2. `dsadapt model slice
# --layers 4`: the 3 dense layers and the first MoE layer (17.0 GB; the MTP module and any later
# layer dropped), then the source is deleted 3. `dsadapt check lmdeploy@v0.18.0 --variant pytorch
# --model SLICE --dtype fp8` (reports in its own work dir): HF transformers on the dequantized weights in float32 on the
# GPU (56 GiB of weights) against LMDeploy's blocked-FP8 path, logits and every module, each against
# HF's own FP8 arithmetic 4. the same check on the bundle's `fp8-scale` stack with
# DSADAPT_PLANTED_FP8_BUG=transposed and =inverse (each must FAIL, first divergence layer 0
# q_a_norm), overlapping the correct check (below: at most two engines and one HF reference on
# the GPU at a time). Every step runs under tools/measure_cost.py (wall time, CPU seconds, peak RSS
# and GPU memory of reference / engine / the rest) and ends by the call's DEADLINE (its own clock
# starts when lmdeploy_h200.sh starts EXTRA, after the installs: FP8_DEADLINE, default DEADLINE - 90).
# Results in $EXTRA_DIR (packed into reports.tgz): fp8-*.json (each command's --json output),
# fp8-*.log, fp8-*-cost.json, fp8-NAME-reports/ (each check's reports, in its own work dir).
# Knobs: MAKE_LAYERS (4), MTP (1), SLICE_LAYERS (4), WORKERS (12), FP8_WORK ($B/../fp8-work),
# FP8_DEADLINE, PLANTED_STACK (fp8-scale), CORRECT (1), BUGS ("transposed inverse").
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PIN=lmdeploy@v0.18.0
MAKE_LAYERS=${MAKE_LAYERS:-4}; MTP=${MTP:-1}; SLICE_LAYERS=${SLICE_LAYERS:-4}; WORKERS=${WORKERS:-12}
PLANTED_STACK=${PLANTED_STACK:-fp8-scale}

prepare() {
  EXTRA_PLANTED="${EXTRA_PLANTED:-} $PLANTED_STACK=tools/gpu/lmdeploy-v0.18.0-fp8-block-scale.patch" \
    bash "$ROOT/tools/device/prepare_bundle.sh" "${1:-$ROOT/.carry/gpu}"
}

device() {
  : "${D:?run as lmdeploy_h200.sh EXTRA}" "${B:?}" "${EXTRA_DIR:?}"
  local T0=$SECONDS W=${FP8_WORK:-$B/../fp8-work}
  local END=${FP8_DEADLINE:-$(( ${DEADLINE:-540} - 90 ))}
  local M="python3 $ROOT/tools/measure_cost.py"
  local SRC=$W/deepseek-v3-$MAKE_LAYERS SLICE=$W/deepseek-v3-slice$SLICE_LAYERS
  export DSADAPT_CACHE=${DSADAPT_CACHE:-$B/.dsadapt/cache}  # one cache: references and digests computed once
  stamp() { echo "=== $((SECONDS - T0))s fp8 $*"; }
  step() {  # NAME MIN_SECONDS COMMAND...: under measure_cost, ended by the deadline; skipped with less left
    local name=$1 need=$2; shift 2
    local left=$((END - (SECONDS - T0)))
    if [ "$left" -lt "$need" ]; then stamp "skipped (time: ${left}s left) $name"; echo "{\"skipped\": $left}" \
      > "$EXTRA_DIR/fp8-$name.json"; return 124; fi
    $M --out "$EXTRA_DIR/fp8-$name-cost.json" -- timeout -k 10 "$left" "$@" > "$EXTRA_DIR/fp8-$name.json" \
      2> "$EXTRA_DIR/fp8-$name.log"
    local rc=$?
    stamp "$name rc=$rc"
    return $rc
  }
  mkdir -p "$W" && rm -rf "$SRC" "$SLICE"
  df -h "$W" | tail -1; nproc
  step make 60 "$D" model make --like deepseek-v3 --layers "$MAKE_LAYERS" --mtp "$MTP" --workers "$WORKERS" \
    --out "$SRC" --json
  du -sh "$SRC" 2>/dev/null
  step slice 30 "$D" model slice "$SRC" --layers "$SLICE_LAYERS" --out "$SLICE" --json
  rm -rf "$SRC"
  check_one() {  # NAME PROJECT MIN_SECONDS [VAR=VALUE...]: one fp8 check of the slice in its own work dir
    local name=$1 proj=$2 need=$3; shift 3
    ( export DSADAPT_VENVS="$proj/.dsadapt/venvs" DSADAPT_WORKDIR="$proj/.wfp8-$name" "$@"
      step "$name" "$need" "$D" --project "$proj" check "$PIN" --variant pytorch --model "$SLICE" \
        --dtype fp8 --json
      cp -r "$proj/.wfp8-$name/reports" "$EXTRA_DIR/fp8-$name-reports" 2>/dev/null )
  }
  wait_for() {  # LOG PATTERN PID: until the check's log shows PATTERN (or it ended)
    while kill -0 "$3" 2>/dev/null && ! grep -q "$2" "$1" 2>/dev/null; do sleep 2; done
  }
  # The checks overlap: the second starts once the first one's references are cached (its engine
  # has started), the third once the first engine has exited; the HF references, 56 GiB each in
  # float32, take the GPU in turn (the gate's reference slot), so at most two engines and one
  # reference hold GPU memory at any time. CORRECT=0 leaves the correct stack out, BUGS names the
  # planted bugs (default both).
  local E=$B/stacks/$PLANTED_STACK names=() pids=()
  [ "${CORRECT:-1}" = 1 ] && names+=(correct)
  if [ -d "$E" ]; then for bug in ${BUGS:-transposed inverse}; do names+=("planted-$bug"); done
  else stamp "no stack $PLANTED_STACK in the bundle: planted runs skipped"; fi
  local i
  for i in "${!names[@]}"; do
    if [ "$i" -ge 1 ]; then wait_for "$EXTRA_DIR/fp8-${names[0]}.log" "engine: lmdeploy" "${pids[0]}"; fi
    if [ "$i" -ge 2 ]; then wait_for "$EXTRA_DIR/fp8-${names[0]}.log" "bisect: HF" "${pids[0]}"
      wait_for "$EXTRA_DIR/fp8-${names[1]}.log" "engine: lmdeploy" "${pids[1]}"; fi
    case ${names[$i]} in
      correct) check_one correct "$B" 120 & ;;
      planted-*) check_one "${names[$i]}" "$E" 90 DSADAPT_PLANTED_FP8_BUG="${names[$i]#planted-}" & ;;
    esac
    pids+=($!)
  done
  wait
  for w in "$B"/.wfp8-* "$E"/.wfp8-*; do
    find "$w/runs" -name '*.log' -size -2M -exec cp --parents {} "$EXTRA_DIR" \; 2>/dev/null
  done
  rm -rf "$SLICE"
  stamp done
  true
}

rehearse() {
  # The device steps here at DeepSeek-V3's real shape with 2 layers made and 1 sliced (4.9 GB and
  # 4.3 GB of disk); the LMDeploy checks end with exit 6 on a machine without a GPU. This
  # checkout's dsadapt, and a copy of the project standing in for the carried bundle.
  local scratch=${REHEARSE_DIR:-/tmp/dsadapt-fp8-rehearsal}
  rm -rf "$scratch" && mkdir -p "$scratch/gpu" "$scratch/extra"
  cp "$ROOT/upstream.lock" "$scratch/gpu/" && cp -r "$ROOT/patches" "$scratch/gpu/"
  local planted=$scratch/gpu/stacks/$PLANTED_STACK  # a stand-in planted stack: the overlapping checks run too
  mkdir -p "$planted" && cp "$ROOT/upstream.lock" "$planted/" && cp -r "$ROOT/patches" "$planted/"
  D=${DSADAPT:-$ROOT/.venv/bin/dsadapt} B=$scratch/gpu EXTRA_DIR=$scratch/extra MAKE_LAYERS=2 MTP=0 SLICE_LAYERS=1 \
    WORKERS=${WORKERS_REHEARSE:-2} FP8_DEADLINE=${FP8_DEADLINE:-3600} device
  for f in "$scratch"/extra/fp8-*-cost.json; do echo "$f: $(tr -d '\n ' < "$f")"; done
  tail -2 "$scratch"/extra/fp8-correct.log
  rm -rf "$scratch"
}

cmd=${1:?prepare|device|rehearse}; shift
"$cmd" "$@"

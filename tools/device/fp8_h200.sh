#!/bin/bash
# The gate on a DeepSeek-V3-shaped block-FP8 checkpoint, on the H200, through the product only.
#
# Here (with network once, for the LMDeploy wheel):
#   bash tools/device/fp8_h200.sh prepare     # -> .carry/fp8: a bundle of the lmdeploy@v0.18.0 stack plus
#                                             #    tools/gpu/lmdeploy-v0.18.0-fp8-block-scale.patch (~18 MiB)
#   bash tools/device/fp8_h200.sh rehearse    # the device steps on this machine at small scale (CPU: the
#                                             #    LMDeploy checks end with exit 6, everything before them runs)
# On the device, as lmdeploy_h200.sh's EXTRA (it needs that script's $D, $B, $EXTRA_DIR), carrying
# .carry/gpu and .carry/fp8 (no weights: the checkpoint is made there):
#   CHAINS="..." EXTRA='bash tools/device/fp8_h200.sh device' bash tools/device/lmdeploy_h200.sh .carry/gpu
#
# `device`: 1. `dsadapt model make --like deepseek-v3 --layers $MAKE_LAYERS --mtp 0` (6: the 3 dense
# layers and 3 MoE layers of 256 experts, ~40 GB of FP8 weights; no MTP module: it would be an 11.5 GB
# seventh layer the slice drops anyway, and the disk is 64 GiB) 2. `dsadapt model slice --layers 4`
# (the 3 dense layers and the first MoE layer, ~17 GB), then the source is deleted 3. `dsadapt check
# lmdeploy@v0.18.0 --variant pytorch --model SLICE --dtype fp8 --publish`: HF transformers on the
# dequantized weights in float32 on the GPU (~60 GB) against LMDeploy's blocked-FP8 path, logits and
# every module, the FP8 limits 4. the planted stack's bundle installed, and the same check with
# DSADAPT_PLANTED_FP8_BUG=transposed (must FAIL, first divergence in layer 0's attention), then
# =inverse if time is left (LIMIT seconds after the start). Each step runs under tools/measure_cost.py
# (wall time, peak RSS and GPU memory by reference / engine / other); results in $EXTRA_DIR
# (fp8-*.json, fp8-*.log), the published reports under reports/ and $EXTRA_DIR/fp8-planted-BUG-reports.
# Knobs: MAKE_LAYERS (6), SLICE_LAYERS (4), WORKERS (12), FP8_WORK (where the checkpoints go:
# $B/../fp8-work), LIMIT (420: no planted run starts later), CHECK_S (360: each check's timeout).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PIN=lmdeploy@v0.18.0
PATCH=tools/gpu/lmdeploy-v0.18.0-fp8-block-scale.patch
NAME=0002-Plant-a-bug-block-FP8-scales-misread-grid-transposed.patch
MAKE_LAYERS=${MAKE_LAYERS:-6}; SLICE_LAYERS=${SLICE_LAYERS:-4}; WORKERS=${WORKERS:-12}
LIMIT=${LIMIT:-420}; CHECK_S=${CHECK_S:-360}

prepare() {
  local proj=${FP8_PROJECT:-/tmp/dsadapt-fp8-project} ds=${DSADAPT:-$ROOT/.venv/bin/dsadapt}
  rm -rf "$proj" "$ROOT/.carry/fp8" && mkdir -p "$proj"
  cp "$ROOT/upstream.lock" "$proj/" && cp -r "$ROOT/patches" "$proj/"
  cp "$ROOT/$PATCH" "$proj/patches/lmdeploy/v0.18.0/$NAME"
  echo "$NAME" >> "$proj/patches/lmdeploy/v0.18.0/series"
  "$ds" --project "$proj" verify "$PIN" || exit 1
  # the host's packages and the main bundle's dsadapt environment provide everything but the engine
  "$ds" --project "$proj" bundle "$PIN" --variant pytorch --no-unpatched \
    --have "$ROOT/tools/device/h200-pip-list.json" --have transformers==5.24.0 --have gitpython==3.2.1 \
    --have gitdb==4.0.12 --have smmap==5.0.3 --have tomli-w==1.2.0 --out "$ROOT/.carry/fp8" --max-size 20MiB
}

device() {
  : "${D:?run as lmdeploy_h200.sh EXTRA}" "${B:?}" "${EXTRA_DIR:?}"
  local T0=$SECONDS W=${FP8_WORK:-$B/../fp8-work} E
  E=$(cd "${FP8_BUNDLE:-$B/../fp8}" && pwd) || { echo "no planted bundle next to $B"; E=""; }
  # one cache for both projects: the float32 reference and the slice's digests are computed once
  export DSADAPT_CACHE=$B/.fp8-cache
  local M="python3 $ROOT/tools/measure_cost.py"
  local SRC=$W/deepseek-v3-$MAKE_LAYERS SLICE=$W/deepseek-v3-slice$SLICE_LAYERS
  stamp() { echo "=== $((SECONDS - T0))s fp8 $*"; }
  mkdir -p "$W" && rm -rf "$SRC" "$SLICE"
  df -h "$W" | tail -1
  stamp "make --like deepseek-v3 --layers $MAKE_LAYERS"
  $M --out "$EXTRA_DIR/fp8-make-cost.json" -- "$D" model make --like deepseek-v3 --layers "$MAKE_LAYERS" --mtp 0 \
    --workers "$WORKERS" --out "$SRC" --json > "$EXTRA_DIR/fp8-make.json" 2> "$EXTRA_DIR/fp8-make.log"
  stamp "make rc=$?"; du -sh "$SRC" 2>/dev/null; df -h "$W" | tail -1
  $M --out "$EXTRA_DIR/fp8-slice-cost.json" -- "$D" model slice "$SRC" --layers "$SLICE_LAYERS" --out "$SLICE" \
    --json > "$EXTRA_DIR/fp8-slice.json" 2> "$EXTRA_DIR/fp8-slice.log"
  stamp "slice rc=$?"; du -sh "$SLICE" 2>/dev/null
  rm -rf "$SRC"
  check_one() {  # NAME PROJECT [env arguments...]: one fp8 check of the slice, in PROJECT's own work dir
    local name=$1 proj=$2; shift 2
    env "$@" DSADAPT_WORKDIR="$proj/.wfp8" $M --out "$EXTRA_DIR/fp8-$name-cost.json" -- \
      timeout -k 20 "$CHECK_S" "$D" --project "$proj" --publish check "$PIN" --variant pytorch --model "$SLICE" \
      --dtype fp8 --json > "$EXTRA_DIR/fp8-$name.json" 2> "$EXTRA_DIR/fp8-$name.log"
    stamp "check $name rc=$?"
  }
  check_one correct "$B"
  if [ -n "$E" ]; then
    env -u DSADAPT_VENVS "$D" --project "$E" install --offline "$E" --system-site-packages --json \
      > "$EXTRA_DIR/fp8-planted-install.json" 2> "$EXTRA_DIR/fp8-planted-install.log"
    stamp "planted install rc=$?"
    for bug in transposed inverse; do
      if [ $((SECONDS - T0)) -gt "$LIMIT" ]; then stamp "skipped (time) planted $bug"; continue; fi
      check_one "planted-$bug" "$E" DSADAPT_VENVS="$E/.dsadapt/venvs" DSADAPT_PLANTED_FP8_BUG=$bug
      cp -r "$E/reports" "$EXTRA_DIR/fp8-planted-$bug-reports" 2>/dev/null  # the next run writes the same names
    done
  fi
  find "$B/.wfp8/runs" "${E:-/nonexistent}/.wfp8/runs" -name '*.log' -size -2M -exec cp --parents {} "$EXTRA_DIR" \; 2>/dev/null
  rm -rf "$SLICE"
  stamp done
  true
}

rehearse() {
  # The device steps here at DeepSeek-V3's real shape but 2 layers made and 1 sliced (5.4 GB and
  # 4.3 GB of disk); the LMDeploy checks end with exit 6 on a machine without a GPU. This
  # checkout's dsadapt, and a copy of the project standing in for the carried bundle.
  local scratch=${REHEARSE_DIR:-/tmp/dsadapt-fp8-rehearsal}
  rm -rf "$scratch" && mkdir -p "$scratch/gpu" "$scratch/extra"
  cp "$ROOT/upstream.lock" "$scratch/gpu/" && cp -r "$ROOT/patches" "$scratch/gpu/"
  D=${DSADAPT:-$ROOT/.venv/bin/dsadapt} B=$scratch/gpu EXTRA_DIR=$scratch/extra FP8_BUNDLE=/nonexistent \
    MAKE_LAYERS=${MAKE_LAYERS_REHEARSE:-2} SLICE_LAYERS=1 WORKERS=${WORKERS_REHEARSE:-2} device
  for f in "$scratch"/extra/fp8-*-cost.json; do echo "$f: $(tr -d '\n' < "$f")"; done
  tail -2 "$scratch"/extra/fp8-correct.log
}

"${1:?prepare|device|rehearse}"

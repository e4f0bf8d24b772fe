#!/bin/bash
# LMDeploy's parallel gate on the GPU machine, with planted parallel-only bugs, through the product only.
#
# Here (host, with network once for the wheel):
#   bash tools/device/lmdeploy_tp.sh prepare [BUG ...]   # -> .carry/tp-BUG (a bundle of the planted stack each)
#       BUG: absorbed-heads-reversed group-limit-per-rank (default: both; tools/tp/lmdeploy-v0.18.0-tp-BUG.patch)
# On the device, as lmdeploy_h200.sh's EXTRA (it needs that script's $D, $B, $EXTRA_DIR), carrying
# .carry/gpu and .carry/tp-BUG:
#   EXTRA='bash tools/device/lmdeploy_tp.sh device BUG' bash tools/device/lmdeploy_h200.sh .carry/gpu
#
# `device BUG` installs the planted bundle offline with the main bundle's dsadapt (its own work dir
# and environments), then for each TP size in TPS (default "1 2") and each dtype in DTYPES (default
# "bfloat16 float16"): `dsadapt check lmdeploy@v0.18.0 --variant pytorch --model MODEL --tp N --dtype D
# --publish --json` (MODEL: MODEL, default v3). A planted parallel-only bug must PASS at TP 1 and FAIL at
# TP 2, its per-module comparison naming the layer, module and rank; on a machine with one GPU the
# TP 2 checks exit 6 ("needs 2 CUDA GPUs"), which is what a rehearsal there shows.
# PIN and VARIANT (default lmdeploy@v0.18.0, pytorch) name another pin: tests/test_device_rehearsal.py
# runs `device` on the toy engine's bundle here.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PIN=${PIN:-lmdeploy@v0.18.0}
VARIANT=${VARIANT:-pytorch}

prepare() {
  local ds=${DSADAPT:-$ROOT/.venv/bin/dsadapt} bugs=("$@") bug
  [ ${#bugs[@]} -eq 0 ] && bugs=(absorbed-heads-reversed group-limit-per-rank)
  for bug in "${bugs[@]}"; do
    local patch=$ROOT/tools/tp/lmdeploy-v0.18.0-tp-$bug.patch proj=${TP_PROJECT:-/tmp/dsadapt-tp-project}-$bug
    [ -f "$patch" ] || { echo "no $patch"; exit 2; }
    rm -rf "$proj" "$ROOT/.carry/tp-$bug" && mkdir -p "$proj"
    cp "$ROOT/upstream.lock" "$proj/" && cp -r "$ROOT/patches" "$proj/"
    local name  # the file name `dsadapt verify` expects: position 2, from the patch's subject
    name=$(PYTHONPATH=$ROOT "${PY:-$ROOT/.venv/bin/python}" -c "import sys; \
from patcher.formats.patchfile import parse_patch, patch_filename; \
p = parse_patch(open(sys.argv[1]).read(), sys.argv[1]); print(patch_filename(2, p.subject))" "$patch") || exit 2
    cp "$patch" "$proj/patches/${PIN%@*}/${PIN#*@}/$name"
    echo "$name" >> "$proj/patches/${PIN%@*}/${PIN#*@}/series"
    "$ds" --project "$proj" verify "$PIN" || exit 1
    # the host's packages and the main bundle's dsadapt environment provide everything but the engine
    "$ds" --project "$proj" bundle "$PIN" --variant "$VARIANT" --no-unpatched \
      --have "$ROOT/tools/device/h200-pip-list.json" --have transformers==5.24.0 --have gitpython==3.2.1 \
      --have gitdb==4.0.12 --have smmap==5.0.3 --have tomli-w==1.2.0 --out "$ROOT/.carry/tp-$bug" --max-size 20MiB \
      || exit 1
  done
}

device() {
  : "${D:?run as lmdeploy_h200.sh EXTRA}" "${B:?}" "${EXTRA_DIR:?}"
  # shellcheck disable=SC2086
  local bug=${1:?device BUG} E T0=$SECONDS tp dtype model=${MODEL:-v3}
  E=$(cd "$B/../tp-$bug" && pwd) || exit 9
  cd "$E" || exit 9
  env -u DSADAPT_VENVS "$D" --project "$E" install --offline . --system-site-packages --json \
    > "$EXTRA_DIR/tp-$bug-install.json" 2> "$EXTRA_DIR/tp-$bug-install.log"
  echo "=== $((SECONDS - T0))s tp-$bug install rc=$?"
  for tp in ${TPS:-1 2}; do
    for dtype in ${DTYPES:-bfloat16 float16}; do
      env -u DSADAPT_VENVS timeout -k 20 "${TP_S:-240}" "$D" --project "$E" --publish check "$PIN" --variant "$VARIANT" \
        --model "$model" --tp "$tp" --dtype "$dtype" ${CHECK_ARGS:-} --json \
        > "$EXTRA_DIR/tp-$bug-$model-tp$tp-$dtype.json" 2> "$EXTRA_DIR/tp-$bug-$model-tp$tp-$dtype.log"
      echo "=== $((SECONDS - T0))s tp-$bug $model tp$tp $dtype rc=$?"
    done
  done
  cp -r "$E/reports" "$EXTRA_DIR/tp-$bug-reports" 2>/dev/null
  true
}

"${1:?prepare|device}" "${@:2}"

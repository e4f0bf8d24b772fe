#!/bin/bash
# Here (with network once for the wheels): the one bundle a device call carries, with the pin's
# stack and, as cheap overlays on its build, every planted-bug stack of tools/gpu/ (the pin's
# stack plus one planted patch each; `dsadapt bundle --stack NAME=DIR`).
#
#   bash tools/device/prepare_bundle.sh [OUT]        OUT: default .carry/gpu
#
# Knobs: PIN (lmdeploy@v0.18.0), VARIANT (pytorch), HAVE (tools/device/h200-pip-list.json),
# PLANTED ("NAME=PATCH ..."; default the three planted LMDeploy bugs; PLANTED= for none), DSADAPT
# (.venv/bin/dsadapt).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/.carry/gpu}
PIN=${PIN:-lmdeploy@v0.18.0}; VARIANT=${VARIANT:-pytorch}
HAVE=${HAVE:-$ROOT/tools/device/h200-pip-list.json}
DS=${DSADAPT:-$ROOT/.venv/bin/dsadapt}; PY=${PY:-$(dirname "$DS")/python}
PLANTED=${PLANTED-"decode-softmax=tools/gpu/lmdeploy-v0.18.0-decode-softmax-scale.patch
kv-a-eps=tools/gpu/lmdeploy-v0.18.0-kv_a_layernorm-eps.patch
prefill-softmax=tools/gpu/lmdeploy-v0.18.0-prefill-softmax-scale.patch"}
# EXTRA_PLANTED: more NAME=PATCH stacks on top of PLANTED (tools/device/fp8_h200.sh prepare adds its own)
PLANTED="$PLANTED ${EXTRA_PLANTED:-}"
ENGINE=${PIN%@*}; TAG=${PIN#*@}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # this checkout's dsadapt, whatever the venv has installed
STACKS=$(mktemp -d); trap 'rm -rf "$STACKS"' EXIT
args=()
for item in $PLANTED; do
  name=${item%%=*}; patch=${item#*=}
  dir=$STACKS/$name; cp -r "$ROOT/patches/$ENGINE/$TAG" "$dir"
  n=$(grep -cv '^\s*\(#\|$\)' "$dir/series")
  # the file name a refresh would give it: NNNN-<subject slug>.patch (docs/patch-format.md)
  file=$(PYTHONPATH=$ROOT "$PY" -c "import sys; from patcher.formats.patchfile import patch_filename
subject = next(l for l in open(sys.argv[2]) if l.startswith('Subject:')).split('] ', 1)[-1].strip()
print(patch_filename(int(sys.argv[1]), subject))" $((n + 1)) "$ROOT/$patch")
  cp "$ROOT/$patch" "$dir/$file"; echo "$file" >> "$dir/series"
  args+=(--stack "$name=$dir")
done
"$DS" --project "$ROOT" verify "$PIN"
"$DS" --project "$ROOT" bundle "$PIN" --variant "$VARIANT" --have "$HAVE" --out "$OUT" --max-size 58MiB "${args[@]}"

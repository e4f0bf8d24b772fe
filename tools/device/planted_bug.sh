#!/bin/bash
# Bisect's GPU evidence: LMDeploy with a planted one-line bug, through the product only.
#
# Here (host, with network once for the wheel):
#   bash tools/device/planted_bug.sh prepare        # -> .carry/eps (a bundle of the planted stack, ~18 MiB)
# On the device, as lmdeploy_h200.sh's EXTRA (it needs that script's $D, $B, $EXTRA_DIR):
#   EXTRA='bash tools/device/planted_bug.sh device' bash tools/device/lmdeploy_h200.sh .carry/gpu
#
# The planted stack is the committed lmdeploy@v0.18.0 stack plus
# tools/gpu/lmdeploy-v0.18.0-kv_a_layernorm-eps.patch (RMSNorm eps 1e-6 -> 1e-2 on kv_a_layernorm).
# `device` installs it from its bundle with the main bundle's dsadapt (its own work dir and
# environments), then: `check --dtype bfloat16` (must FAIL, localized at layer 0's kv_a norm),
# `bisect --dtype bfloat16` (the same answer from the bisect command), `check --dtype float16`.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PIN=lmdeploy@v0.18.0
PATCH=tools/gpu/lmdeploy-v0.18.0-kv_a_layernorm-eps.patch
NAME=0002-Plant-a-bug-kv_a_layernorm-eps-1e-6-1e-2.patch

prepare() {
  local proj=${EPS_PROJECT:-/tmp/dsadapt-eps-project} ds=${DSADAPT:-$ROOT/.venv/bin/dsadapt}
  rm -rf "$proj" "$ROOT/.carry/eps" && mkdir -p "$proj"
  cp "$ROOT/upstream.lock" "$proj/" && cp -r "$ROOT/patches" "$proj/"
  cp "$ROOT/$PATCH" "$proj/patches/lmdeploy/v0.18.0/$NAME"
  echo "$NAME" >> "$proj/patches/lmdeploy/v0.18.0/series"
  "$ds" --project "$proj" verify "$PIN" || exit 1
  # the host's packages and the main bundle's dsadapt environment provide everything but the engine
  "$ds" --project "$proj" bundle "$PIN" --variant pytorch --no-unpatched \
    --have "$ROOT/tools/device/h200-pip-list.json" --have transformers==5.24.0 --have gitpython==3.2.1 \
    --have gitdb==4.0.12 --have smmap==5.0.3 --have tomli-w==1.2.0 --out "$ROOT/.carry/eps" --max-size 20MiB
}

device() {
  : "${D:?run as lmdeploy_h200.sh EXTRA}" "${B:?}" "${EXTRA_DIR:?}"
  local E; E=$(cd "$B/../eps" && pwd) || exit 9
  local T0=$SECONDS
  cd "$E" || exit 9
  env -u DSADAPT_VENVS "$D" --project "$E" install --offline . --system-site-packages --json \
    > "$EXTRA_DIR/eps-install.json" 2> "$EXTRA_DIR/eps-install.log"
  echo "=== $((SECONDS - T0))s eps install rc=$?"
  one() {  # NAME CMD DTYPE
    env -u DSADAPT_VENVS timeout -k 20 "${EPS_S:-200}" "$D" --project "$E" --publish "$2" "$PIN" --variant pytorch \
      --model v3 --dtype "$3" --json > "$EXTRA_DIR/eps-$1.json" 2> "$EXTRA_DIR/eps-$1.log"
    echo "=== $((SECONDS - T0))s eps $1 rc=$?"
  }
  one check-bfloat16 check bfloat16
  one bisect-bfloat16 bisect bfloat16
  one check-float16 check float16
  cp -r "$E/reports" "$EXTRA_DIR/eps-reports" 2>/dev/null
  cp -r "$E/.dsadapt/runs" "$EXTRA_DIR/eps-runs" 2>/dev/null
  true
}

"${1:?prepare|device}"

#!/bin/bash
# LMDeploy bisect on the H200, through the product (issue 14): the low-precision per-module
# verdict checked and recalibrated where LMDeploy runs (it has no float32 path).
#
# NOT RUN YET — written on a CPU machine. It relies on `dsadapt bundle` / `dsadapt install
# --offline` (issue 13, h/contract) to put lmdeploy@v0.18.0 into the device's environment; adjust
# the two `bundle`/`install` lines below to that command's final flags if they differ.
#
# Host (this machine), once:
#   bash tools/gpu/lmdeploy_bisect.sh prepare          # -> .carry/bisect (gitignored)
# Device (run tool, kind nvidia-h200, carry [".carry"], timeout_s 600), from the repo root:
#   bash tools/gpu/lmdeploy_bisect.sh device
# Then here, from the files that came back under DIR (files_at of the run):
#   python tools/measure_bisect_noise.py summarize DIR/control-*-bisect.json \
#       --bug kv_a_layernorm_eps=DIR/eps-bfloat16-bisect.json --bug kv_a_layernorm_eps_fp16=DIR/eps-float16-bisect.json
# and put the tables into docs/equivalence.md ("Bisect: thresholds"), LOW_PRECISION_POINT_RULES
# in patcher/bisect.py if the factor must move.
#
# What `device` runs (about 6 minutes: a cold LMDeploy start compiles Triton kernels, ~70 s,
# later starts ~15 s; the HF reference and its capture run on the device's CPU):
#   1. control, the stack as committed: `dsadapt check lmdeploy@v0.18.0 --model v3 --dtype
#      bfloat16` x CONTROL_RUNS (3) and `--dtype float16` x 2. Every low-precision check compares
#      modules; all must pass, and their bisect reports are the noise side of the calibration.
#   2. the planted bug (tools/gpu/lmdeploy-v0.18.0-kv_a_layernorm-eps.patch appended to a copy of
#      the stack): `dsadapt check ... --dtype bfloat16` must FAIL with the first divergence at
#      layer 0 kv_a_norm (the logit rule alone passed it on 2026-11-30), then `dsadapt bisect
#      ... --dtype bfloat16 --json` and the same in float16.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CARRY="$ROOT/.carry/bisect"
PIN=lmdeploy@v0.18.0
DS=${DSADAPT:-dsadapt}
OUT=${OUT:-$ROOT/.carry/bisect-out}
CONTROL_RUNS=${CONTROL_RUNS:-3}

prepare() {
  rm -rf "$CARRY" && mkdir -p "$CARRY"
  # the planted stack: a project copy whose v0.18.0 series ends with the planted patch
  local eps="$CARRY/eps-project"
  mkdir -p "$eps" && cp "$ROOT/upstream.lock" "$eps/" && cp -r "$ROOT/patches" "$eps/"
  cp "$ROOT/tools/gpu/lmdeploy-v0.18.0-kv_a_layernorm-eps.patch" "$eps/patches/lmdeploy/v0.18.0/"
  echo "lmdeploy-v0.18.0-kv_a_layernorm-eps.patch" >> "$eps/patches/lmdeploy/v0.18.0/series"
  "$DS" --project "$eps" verify "$PIN" || exit 1            # the planted patch applies on the pin
  # issue 13's bundle (air-gapped install): one for the stack, one for the planted stack
  "$DS" --project "$ROOT" bundle "$PIN" --variant pytorch --python 3.12 --platform manylinux_2_28_x86_64 \
      --out "$CARRY/bundle-stack" || exit 1
  "$DS" --project "$eps" bundle "$PIN" --variant pytorch --python 3.12 --platform manylinux_2_28_x86_64 \
      --out "$CARRY/bundle-eps" || exit 1
  du -sh "$CARRY"
  echo "device: bash tools/gpu/lmdeploy_bisect.sh device   (run tool: carry [\".carry\"], timeout_s 600)"
}

# one check/bisect; keeps its JSON, the check report and the bisect report (+ heat map) under $OUT,
# found through the paths the JSON names (wherever the product writes its reports)
run() {  # NAME PROJECT CMD DTYPE
  local name=$1 project=$2 cmd=$3 dtype=$4
  local t0=$SECONDS
  "$DS" --project "$project" "$cmd" "$PIN" --model v3 --dtype "$dtype" --json > "$OUT/$name.json" \
      2> "$OUT/$name.log"
  local rc=$?
  echo "$name: $cmd $dtype rc $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  python3 - "$OUT" "$name" <<'PY'
import json, shutil, sys
out, name = sys.argv[1], sys.argv[2]
try:
    doc = json.load(open(f"{out}/{name}.json"))
except ValueError:
    sys.exit(0)
b = doc.get("bisect") or doc  # check --json carries the bisect summary; bisect --json is the report
for key, suffix in (("report_path", "bisect.json"), ("plot_path", "bisect.png")):
    if b.get(key):
        shutil.copy(b[key], f"{out}/{name}-{suffix}")
if doc.get("schema") == "dsadapt.check-report/1" or "verdict" in doc:
    shutil.copy(doc["report_path"], f"{out}/{name}-check.json")
PY
  return 0
}

device() {
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
  "$DS" install --offline "$CARRY/bundle-stack" "$PIN" > "$OUT/install-stack.log" 2>&1 || { tail "$OUT/install-stack.log"; exit 1; }
  "$DS" --project "$CARRY/eps-project" install --offline "$CARRY/bundle-eps" "$PIN" > "$OUT/install-eps.log" 2>&1 \
      || { tail "$OUT/install-eps.log"; exit 1; }
  for i in $(seq "$CONTROL_RUNS"); do run "control-bfloat16-$i" "$ROOT" check bfloat16; done
  for i in 1 2; do run "control-float16-$i" "$ROOT" check float16; done
  run eps-check-bfloat16 "$CARRY/eps-project" check bfloat16
  run eps-bfloat16 "$CARRY/eps-project" bisect bfloat16
  run eps-float16 "$CARRY/eps-project" bisect float16
  # the verdicts the issue asks for, in one place
  python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import glob, json, os, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "*-bisect.json"))):
    d = json.load(open(path))
    f = d.get("first")
    print(os.path.basename(path), d.get("dtype"), "PASS" if d.get("passed") else "FAIL",
          "" if not f else f"first: layer {f['layer']} {f['point']} error {f['error']:.4g} limit {f['limit']:.4g}")
PY
}

case "${1:-}" in
  prepare) prepare ;;
  device) device ;;
  *) echo "usage: $0 prepare|device" >&2; exit 2 ;;
esac

#!/bin/bash
# Repeatable LMDeploy GPU check (`make gpu-check` wraps this).
#
#   scripts/gpu_check.sh [REPO]      REPO: the checkout the device tool sends (default: this one)
#
# Builds the carry bundle into REPO/.carry/lmdeploy (gitignored; about 21 MiB: lmdeploy 0.18.0
# without TurboMind's binaries, the v0.18.0 stack's files as an overlay, 24 cp312 wheels,
# the tiny-model code, the gate's runner scripts and prompt sets), then prints what to pass
# to the device tool. Needs pip access to PyPI here; the device needs nothing else.
# The lmdeploy wheel is cached in DSADAPT_LMDEPLOY_WHEEL_DIR (default /tmp/lmd).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
REPO=$(cd "${1:-$ROOT}" && pwd)
PY=${PYTHON:-python3}
"$PY" "$HERE/lmdeploy_gpu_bundle.py" --dest "$REPO/.carry/lmdeploy" ${GATE_SRC:+--gate-src "$GATE_SRC"} \
  ${MODEL_SRC:+--model-src "$MODEL_SRC"}
cat <<MSG

On the device machine (run tool, from $REPO, carry [".carry"], timeout_s 600):
  bash .carry/lmdeploy/run.sh
A smaller run (knobs in .carry/lmdeploy/run.sh), e.g. the float16 pair only:
  BISECT=0 CPU_SIDE=0 RUNNERS="unpatched:v2:float16 patched:v2:float16" bash .carry/lmdeploy/run.sh
Then here, from the files that came back (DIR):
  $PY scripts/lmdeploy_report.py --run DIR --hf DIR/res --out reports/lmdeploy
  (unpack DIR/cpu_side.tar.gz and DIR/runners_*.tar.gz first)
MSG

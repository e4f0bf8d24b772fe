#!/bin/bash
# The LMDeploy gate on this workplace's GPU machine (the device tool), through the product only:
# the bundle's bootstrap.py and `dsadapt install --offline`, then `dsadapt check` in parallel
# chains. `make gpu-check` writes the bundle (.carry/gpu) and prints how to call this.
#
#   bash tools/device/lmdeploy_h200.sh [BUNDLE]          BUNDLE: default .carry/gpu
#
# Knobs (environment):
#   CHAINS  chains of checks, run in parallel; chains separated by ";", checks by spaces, each
#           MODEL:DTYPE[:FLAG...] with FLAGs `unpatched`, `tpN` (`--tp N`: N GPUs a check) and `mp`
#           (LMDeploy's multiprocess executor even at TP 1: LMDEPLOY_EXECUTOR_BACKEND=mp, the TP code
#           path on one GPU), e.g. `v3:bfloat16:tp2` or `v2:float16:tp1:mp`. Each chain has its own
#           work dir (the work-dir lock serializes runs in one) and all share the bundle's
#           environments (DSADAPT_VENVS). Chains of several callers compose: join them with ";".
#   LIMIT   seconds after which no new check starts (default 420); each check may take CHECK_S (240).
#   PIN, VARIANT, CHECK_ARGS   what is checked (default lmdeploy@v0.18.0, pytorch, nothing extra);
#   PYTHON  the host's Python, whose packages the environments lend (default python3);
#   EXTRA   a command run in the background once the environments exist, with $D the bundle's
#           dsadapt, $B the bundle and $EXTRA_DIR a folder for its files (packed into reports.tgz;
#           $OUT takes 8 files at most), e.g. bisect / perf in a work dir of its own
#           (DSADAPT_WORKDIR=$B/.wx; `--publish` puts their reports into reports/ too); its
#           output goes to $OUT/extra.txt.
# Results in $OUT (8 files at most): log.txt, host-pip-list.json (the probe for the next bundle:
# tools/device/h200-pip-list.json), install.json, chain1.txt.., extra.txt, reports.tgz (the
# published reports' JSON, EXTRA's JSON and logs, the environments' install records, and the
# runner logs of each work dir's runs/ while the archive stays under 15 MB).
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
B=$(cd "${1:-.carry/gpu}" && pwd) || exit 9
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export DSADAPT_VENVS=$B/.dsadapt/venvs
CHAINS=${CHAINS:-"v2:bfloat16 v2:float16; v3:bfloat16 v2-lite:bfloat16 v3:float16 v2-lite:float16; v2:bfloat16:unpatched v2:float16:unpatched v3:bfloat16:unpatched"}
LIMIT=${LIMIT:-420}; CHECK_S=${CHECK_S:-240}
PIN=${PIN:-lmdeploy@v0.18.0}; VARIANT=${VARIANT:-pytorch}; PYTHON=${PYTHON:-python3}
cd "$B" || exit 9
exec > >(tee "$OUT/log.txt") 2>&1
T0=$SECONDS
stamp() { echo "=== $((SECONDS - T0))s $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PYTHON" -V; nproc
"$PYTHON" -m pip list --format=json > "$OUT/host-pip-list.json"
stamp bootstrap
"$PYTHON" bootstrap.py --system-site-packages || exit 1
D=$B/.dsadapt/env/bin/dsadapt
EXTRA_DIR=$B/extra; mkdir -p "$EXTRA_DIR"
export D B EXTRA_DIR
"$D" install --offline . --system-site-packages --json > "$OUT/install.json"; echo "install rc=$?"
check() {  # workdir model dtype [flags: unpatched, tpN, mp; ':'-separated]
  if [ $((SECONDS - T0)) -gt "$LIMIT" ]; then echo "skipped (time) $*"; return; fi
  local flag args=() envs=()
  IFS=: read -ra flags <<< "${4:-}"
  for flag in "${flags[@]}"; do
    case "$flag" in
      unpatched) args+=(--unpatched) ;;
      tp[0-9]*) args+=(--tp "${flag#tp}") ;;
      mp) envs+=(LMDEPLOY_EXECUTOR_BACKEND=mp) ;;
      '') ;;
      *) echo "=== chain $1: unknown flag '$flag' in $2:$3:$4"; return ;;
    esac
  done
  # shellcheck disable=SC2086
  env "${envs[@]}" DSADAPT_WORKDIR="$B/.w$1" timeout -k 20 "$CHECK_S" "$D" check "$PIN" --variant "$VARIANT" --publish \
    --model "$2" --dtype "$3" "${args[@]}" ${CHECK_ARGS:-}
  echo "=== $((SECONDS - T0))s chain $1: $2 $3 ${4:-patched} rc=$?"
}
stamp checks
pids=()  # waited for by pid: a bare `wait` would also wait for the log's tee, which never ends
if [ -n "${EXTRA:-}" ]; then (bash -c "$EXTRA") > "$OUT/extra.txt" 2>&1 & pids+=($!); fi
n=0
IFS=';' read -ra chains <<< "$CHAINS"
for chain in "${chains[@]}"; do
  n=$((n + 1))
  ( for item in $chain; do IFS=: read -r model dtype flags <<< "$item"; check "$n" "$model" "$dtype" "$flags"; done ) \
    > "$OUT/chain$n.txt" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
stamp done
# reports.tgz must stay under the device's 16 MiB a file: JSON reports and logs only (heat maps,
# plots and capture tensors are rebuilt here from the JSON), the runners' logs if room is left
{ find reports extra -type f \( -name '*.json' -o -name '*.log' -o -name '*.txt' \) 2>/dev/null
  ls .dsadapt/venvs/*/dsadapt-install.json 2>/dev/null; } > /tmp/dsadapt-pack.txt
tar czf "$OUT/reports.tgz" -T /tmp/dsadapt-pack.txt
find .w*/runs -type f \( -name '*.log' -o -name '*.json' \) -size -2M 2>/dev/null >> /tmp/dsadapt-pack.txt
tar czf "$OUT/reports-full.tgz" -T /tmp/dsadapt-pack.txt && [ "$(stat -c %s "$OUT/reports-full.tgz")" -lt 15000000 ] \
  && mv "$OUT/reports-full.tgz" "$OUT/reports.tgz"; rm -f "$OUT/reports-full.tgz"
ls -la "$OUT/reports.tgz"
ls -la reports/*/*/ 2>/dev/null
stamp end

#!/bin/bash
# The gate on an air-gapped GPU machine, through the product only:
# the bundle's bootstrap.py, `dsadapt install --offline` (the pin's environments and every extra
# stack the bundle carries, `bundle --stack NAME=DIR`), then dsadapt commands in parallel chains.
# `make gpu-check` writes the bundle (.carry/gpu) and prints how to call this.
#
#   bash tools/device/lmdeploy_h200.sh [BUNDLE] [CHAINS_FILE]
#       BUNDLE       default .carry/gpu
#       CHAINS_FILE  default tools/device/calibration.chains (the format is in that file)
#
# Knobs (environment):
#   CHAINS  chains as text instead of a file (same format; ';' may separate lines)
#   DEADLINE  seconds from the start by which every command has ended (default 540: the device
#           tool stops a call at 600 s and what this script packs after it must still come back);
#           each command may take CMD_S (200) but never past the deadline, and none starts with
#           less than MIN_S (60) left (it is reported as skipped)
#   PIN, VARIANT   what runs (default lmdeploy@v0.18.0, pytorch)
#   PYTHON  the host's Python, whose packages the environments lend (default python3)
#   EXTRA   a command run in the background once the environments exist ($D the bundle's dsadapt,
#           $B the bundle, $EXTRA_DIR a folder packed into reports.tgz); output in extra.txt there
# Results in $OUT (8 files at most, whatever the number of chains): log.txt (this script),
# summary.txt (one line per command: chain, stack, command, exit status, verdict, margin, seconds),
# summary.json (the same, with every check's --json result), install.json, host-pip-list.json,
# reports.tgz (every report dsadapt published, per stack, with its recorded inputs (`check --rescore`
# reads them); each command's --json output and log;
# EXTRA's files; the environments' install records; runner logs while the archive stays < 15 MB).
# Rehearsed on CPU with the toy engine: tests/tools/test_device_rehearsal.py.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
HERE=$(cd "$(dirname "$0")" && pwd)
B=$(cd "${1:-.carry/gpu}" && pwd) || exit 9
CHAINS_FILE=${2:-$HERE/calibration.chains}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-540}; CMD_S=${CMD_S:-200}; MIN_S=${MIN_S:-60}
PIN=${PIN:-lmdeploy@v0.18.0}; VARIANT=${VARIANT:-pytorch}; PYTHON=${PYTHON:-python3}
R=$B/results; EXTRA_DIR=$B/extra; mkdir -p "$R" "$EXTRA_DIR"
if [ -n "${CHAINS:-}" ]; then printf '%s\n' "$CHAINS" | tr ';' '\n' > "$R/chains.txt"
else cp "$CHAINS_FILE" "$R/chains.txt" || exit 9; fi
cd "$B" || exit 9
exec > >(tee "$OUT/log.txt") 2>&1
T0=$SECONDS
stamp() { echo "=== $((SECONDS - T0))s $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PYTHON" -V; nproc
"$PYTHON" -m pip list --format=json > "$OUT/host-pip-list.json" 2>/dev/null
stamp bootstrap
"$PYTHON" bootstrap.py --system-site-packages || exit 1
D=$B/.dsadapt/env/bin/dsadapt
export D B EXTRA_DIR
# the pin's environments and every extra stack's (seeded from the main one: seconds each)
DSADAPT_VENVS=$B/.dsadapt/venvs "$D" install --offline . --system-site-packages --json > "$OUT/install.json"
echo "install rc=$?"
# the HF references are pure functions of their inputs: one cache for every chain and stack
export DSADAPT_CACHE=$B/.dsadapt/cache

one() {  # CHAIN N STACK [NAME=VALUE...] DSADAPT-ARGS...: one command of a chain, its --json output and log kept
  local chain=$1 n=$2 stack=$3; shift 3
  local envs=()  # leading NAME=VALUE words: that command's environment only (e.g. LMDEPLOY_EXECUTOR_BACKEND=mp)
  while [[ "${1:-}" =~ ^[A-Z_][A-Z0-9_]*= ]]; do envs+=("$1"); shift; done
  local cmd=$1; shift
  local tag; tag=$(printf '%02d-%s-%s' "$n" "$stack" "$(echo "$cmd $*" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-60)")
  local out=$R/$chain/$tag
  local left=$((DEADLINE - (SECONDS - T0)))
  if [ "$left" -lt "$MIN_S" ]; then echo "skipped (time) $chain $stack $cmd $*"
    printf '{"skipped": "%ss left of the %ss deadline"}\n' "$left" "$DEADLINE" > "$out.json"; return; fi
  local budget=$CMD_S; [ "$left" -lt "$budget" ] && budget=$left
  local project=$B; [ "$stack" = main ] || project=$B/stacks/$stack
  local t=$SECONDS
  # shellcheck disable=SC2086
  env "${envs[@]}" DSADAPT_VENVS="$project/.dsadapt/venvs" DSADAPT_WORKDIR="$project/.w$chain" timeout -k 10 "$budget" \
    "$D" --project "$project" "$cmd" "$PIN" --variant "$VARIANT" --publish "$@" --json > "$out.json" 2> "$out.log"
  local rc=$?
  printf '{"chain": "%s", "stack": "%s", "command": "%s", "env": "%s", "rc": %d, "seconds": %d}\n' \
    "$chain" "$stack" "$cmd $*" "${envs[*]}" "$rc" "$((SECONDS - t))" > "$out.meta.json"
  echo "=== $((SECONDS - T0))s chain $chain: [$stack] ${envs[*]:+${envs[*]} }$cmd $* rc=$rc ($((SECONDS - t)) s)"
}
export -f one
export R DEADLINE CMD_S MIN_S PIN VARIANT T0
stamp chains
pids=()  # waited for by pid: a bare `wait` would also wait for the log's tee, which never ends
if [ -n "${EXTRA:-}" ]; then (bash -c "$EXTRA") > "$EXTRA_DIR/extra.txt" 2>&1 & pids+=($!); fi
run_chain() {  # CHAIN: its lines in order
  local chain=$1 n=0
  mkdir -p "$R/$chain"
  grep -v '^\s*#' "$R/chains.txt" | awk -v c="$chain" '$1 == c' | while read -r _ stack rest; do
    n=$((n + 1)); # shellcheck disable=SC2086
    one "$chain" "$n" "$stack" $rest
  done
}
# the chain named "first" runs alone before the others (one engine start compiles the Triton
# kernels every later start then finds in the cache)
if grep -q '^\s*first\s' "$R/chains.txt"; then stamp "chain first"; run_chain first > "$R/first.txt" 2>&1; fi
for chain in $(grep -v '^\s*#' "$R/chains.txt" | awk 'NF && $1 != "first" {print $1}' | awk '!seen[$0]++'); do
  mkdir -p "$R/$chain"
  run_chain "$chain" > "$R/$chain/chain.txt" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
stamp done
"$PYTHON" "$HERE/summarize.py" "$R" "$OUT/summary.json" > "$OUT/summary.txt"; cat "$OUT/summary.txt"
# reports.tgz stays under the device's 16 MiB a file: JSON reports and logs only (heat maps and
# plots are rebuilt here from the JSON), runner logs if room is left
{ find reports stacks/*/reports results extra -type f \( -name '*.json' -o -name '*.log' -o -name '*.txt' \
    -o -name '*.inputs.json.gz' \) 2>/dev/null
  ls .dsadapt/venvs/*/dsadapt-install.json stacks/*/.dsadapt/venvs/*/dsadapt-install.json 2>/dev/null; } \
  > /tmp/dsadapt-pack.txt
tar czf "$OUT/reports.tgz" -T /tmp/dsadapt-pack.txt
find .w*/runs stacks/*/.w*/runs -type f -name '*.log' -size -2M 2>/dev/null >> /tmp/dsadapt-pack.txt
tar czf "$OUT/reports-full.tgz" -T /tmp/dsadapt-pack.txt && [ "$(stat -c %s "$OUT/reports-full.tgz")" -lt 15000000 ] \
  && mv "$OUT/reports-full.tgz" "$OUT/reports.tgz"; rm -f "$OUT/reports-full.tgz"
ls -la "$OUT"
stamp end

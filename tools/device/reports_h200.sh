#!/bin/bash
# The H200's committed reports (reports/plan.txt's h200 lines) regenerated in one device call,
# through the product only (the bundle's bootstrap.py, `dsadapt install --offline`, `dsadapt check
# --publish`):
#
#   here:    bash tools/device/reports_h200.sh prepare [OUT]    # = make gpu-reports: the bundle (default
#                                                               #   .carry/reports): the pin's stack, no planted ones
#   device:  bash tools/device/reports_h200.sh device [BUNDLE]  # the run (command of the device call)
#   here:    bash tools/device/reports_h200.sh unpack DIR       # what came back (DIR/reports.tgz) into reports/:
#                                                               #   tools/device/unpack_reports.py
#
# `device`: tools/device/lmdeploy_h200.sh with the plan's checks of built-in models as one chain each
# (side by side on the GPU, each published into the bundle's reports/) and, as that script's EXTRA once
# the environments exist, the plan's made models (`made`): `dsadapt model make` (the block-FP8 V3
# slice, 17 GB, under MADE_DIR) and then their checks, published too; the made model is deleted at
# the end. Measured on the 2026-12-01 H200 calls: bootstrap and installs about 40 s, a built-in
# model's check 70-180 s side by side with others, the V3 slice's make 40-70 s and its fp8 check
# 255 s, so the whole call takes about 340 s; with FP8=0 about 220 s.
#
# Knobs (environment): DEADLINE (seconds from the start by which every command has ended; default
# 420, FP8=0: 280), FP8 (1 where DEADLINE is 380 or more, else 0; 0 leaves the made models out),
# WORKERS (model make, 8), MADE_DIR (default BUNDLE/../made), PLAN (default reports/plan.txt),
# PYTHON (the host's, default python3), OUT (default /tmp/out).
# Sharing the call with another measurement: MORE_CHAINS (a chains file, lmdeploy_h200.sh's format:
# its lines run after the plan's, a line that runs what a plan line runs is left out and the plan's
# report serves both, a chain name the plan uses becomes NAME-more), MORE_EXTRA (a command run
# beside the made models, as lmdeploy_h200.sh's EXTRA), and at `prepare` PLANTED / EXTRA_PLANTED
# (prepare_bundle.sh's: the extra stacks those chains run on; default none).
# Results in $OUT (lmdeploy_h200.sh's six files): reports.tgz (every published report with its
# recorded inputs and bisect report, each command's --json output and log), summary.txt,
# summary.json, log.txt, install.json, host-pip-list.json.
# Rehearsed on CPU with the toy engine: tests/tools/test_reports_device.py.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PLAN=${PLAN:-$ROOT/reports/plan.txt}
PY=${PYTHON:-python3}

plan() { "$PY" "$ROOT/tools/refresh_reports.py" --plan "$PLAN" --machine h200 "$@"; }

prepare() {  # the pin's stack only, unless PLANTED / EXTRA_PLANTED name stacks MORE_CHAINS runs on
  local pin
  pin=$(plan --chains | head -1 | cut -d' ' -f1) || exit 2
  PIN=$pin VARIANT=$(plan --chains | head -1 | cut -d' ' -f2) PLANTED="${PLANTED:-}" EXTRA_PLANTED="${EXTRA_PLANTED:-}" \
    bash "$ROOT/tools/device/prepare_bundle.sh" "${1:-$ROOT/.carry/reports}"
}

device() {
  local B=${1:-$ROOT/.carry/reports} head made="" all
  all=$(plan --chains ${MORE_CHAINS:+--more "$MORE_CHAINS"}) || exit 2
  head=$(printf '%s\n' "$all" | head -1)
  PIN=${head% *}; VARIANT=${head#* }
  CHAINS=$(printf '%s\n' "$all" | tail -n +2)
  START_EPOCH=$(date +%s)
  # the made models (the FP8 slice: about 340 s of the call) only where the deadline leaves room
  if [ -z "${FP8:-}" ]; then if [ "${DEADLINE:-420}" -ge 380 ]; then FP8=1; else FP8=0
    echo "FP8=0: the made models need about 340 s and DEADLINE is ${DEADLINE}s (FP8=1 runs them anyway)"; fi; fi
  if [ "$FP8" = 1 ]; then DEADLINE=${DEADLINE:-420}; made="bash $ROOT/tools/device/reports_h200.sh made"
  else DEADLINE=${DEADLINE:-280}; fi
  # MORE_EXTRA: another EXTRA sharing the call (e.g. an FP8 measurement's), beside the made models
  EXTRA=""
  [ -n "$made" ] && EXTRA="$made"
  [ -n "${MORE_EXTRA:-}" ] && EXTRA="${EXTRA:+($EXTRA) & }(${MORE_EXTRA}); wait"
  export PIN VARIANT CHAINS START_EPOCH DEADLINE EXTRA PLAN PYTHON=$PY CMD_S=${CMD_S:-240}
  exec bash "$ROOT/tools/device/lmdeploy_h200.sh" "$B"
}

made() {  # as lmdeploy_h200.sh's EXTRA: it exports $D (the bundle's dsadapt), $B, $EXTRA_DIR, DSADAPT_CACHE
  : "${D:?run as lmdeploy_h200.sh EXTRA}" "${B:?}" "${EXTRA_DIR:?}"
  local W=${MADE_DIR:-$B/../made} n=0 line left rc
  mkdir -p "$W"
  while IFS= read -r line; do
    n=$((n + 1))
    left=$(( DEADLINE - ($(date +%s) - ${START_EPOCH:-$(date +%s)}) ))
    if [ "$left" -lt 30 ]; then
      echo "=== made $n skipped (${left}s left of the ${DEADLINE}s deadline): $line"
      printf '{"skipped": "%ss left"}\n' "$left" > "$EXTRA_DIR/made-$n.json"; continue
    fi
    eval "set -- $line"  # one shell-quoted dsadapt command line (refresh_reports.py --made)
    [ "$1 $2" = "model make" ] && set -- "$@" --workers "${WORKERS:-8}"
    DSADAPT_VENVS=$B/.dsadapt/venvs DSADAPT_WORKDIR=$B/.wmade timeout -k 10 "$left" "$D" --project "$B" "$@" \
      > "$EXTRA_DIR/made-$n.json" 2> "$EXTRA_DIR/made-$n.log"
    rc=$?
    echo "=== made $n rc=$rc: $line"
    du -sh "$W" 2>/dev/null | tail -1
  done < <(plan --made "$W")
  rm -rf "$W"
}

unpack() {
  "$PY" "$ROOT/tools/device/unpack_reports.py" "$@"
}

cmd=${1:?prepare|device|unpack}; shift
case $cmd in prepare|device|made|unpack) "$cmd" "$@" ;; *) echo "unknown: $cmd (prepare|device|unpack)" >&2; exit 2 ;; esac

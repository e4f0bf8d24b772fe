#!/bin/bash
# The LMDeploy GPU check, run on the device machine from the repository root:
#   bash .carry/lmdeploy/run.sh        (the bundle from scripts/lmdeploy_gpu_bundle.py)
# Knobs (environment): BISECT (1: run the per-layer check, 0: skip), BISECT_UNPATCHED (models,
# default v2), BISECT_PATCHED (default v2,v3), BISECT_DTYPES (default bfloat16,float16),
# RUNNERS (tree:model:dtype items for the gate's runner, "" for none), CPU_SIDE (1: build the
# gate's tiny models and run the HF reference runner on the CPU, 0: skip).
# Results in $OUT (7 files at most): log.txt, ref.json, bisect_unpatched.json,
# bisect_patched.json, runners_<tree>.tar.gz (LMDeploy runner reports + logs, refreshed
# after each runner), cpu_side.tar.gz (HF reference reports, model configs, fingerprints).
set -u
C=$(cd "$(dirname "$0")" && pwd)
W=/tmp/gc
OUT=${OUT:-/tmp/out}
BISECT_UNPATCHED=${BISECT_UNPATCHED:-v2}
BISECT_PATCHED=${BISECT_PATCHED:-v2,v3}
BISECT_DTYPES=${BISECT_DTYPES:-bfloat16,float16}
BISECT=${BISECT:-1}
RUNNERS=${RUNNERS-patched:v2:bfloat16 unpatched:v2:bfloat16 patched:tm-v2-lite:bfloat16 patched:tm-v3:bfloat16}
CPU_SIDE=${CPU_SIDE:-1}
mkdir -p "$W/res" "$W/runners" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec > >(tee "$OUT/log.txt") 2>&1
T0=$(date +%s)
stamp() { echo "=== $(( $(date +%s) - T0 ))s $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import sys, torch, transformers, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__)'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$C"/whl/*.whl || exit 1
rm -rf /tmp/lmd-unpatched /tmp/lmd-patched
cp -r "$C/lmd" /tmp/lmd-unpatched && cp -r "$C/lmd" /tmp/lmd-patched && cp -r "$C/overlay/." /tmp/lmd-patched/
sha256sum /tmp/lmd-unpatched/lmdeploy/pytorch/models/deepseek_v2.py /tmp/lmd-patched/lmdeploy/pytorch/models/deepseek_v2.py
stamp ref
if [ "$BISECT" = 1 ]; then
REF_MODELS=$(echo "$BISECT_UNPATCHED,$BISECT_PATCHED" | tr ',' '\n' | sort -u | paste -sd,)
python3 "$C/lmdeploy_gpu_check.py" ref --models "$REF_MODELS" --work "$W" --tok "$C/tok" --out "$OUT"
else
  # the runners still need the probe model
  python3 -c "import sys; sys.path.insert(0, sys.argv[1]); from lmdeploy_models import build_model, save; print('v2', save(build_model('v2'), sys.argv[2], sys.argv[3]))" "$C" "$W/models/v2" "$C/tok"
fi

# CPU side: the gate's built-in models, then the HF reference runner (float32).
(
  for v in v2-lite v3; do
    PYTHONPATH="$C/tm" python3 -c "import sys, json; from pathlib import Path; from patcher.tinymodel import make_model; i = make_model(Path(sys.argv[1]), variant=sys.argv[2]); print(json.dumps({'variant': i.variant, 'params': i.params, 'weights_sha256': i.weights_sha256}))" "$W/models/tm-$v" "$v"
  done
  touch "$W/tm.ready"
  if [ "$CPU_SIDE" = 1 ]; then
    for m in v2 tm-v2-lite tm-v3; do
      python3 "$C/hf_reference.py" --model "$W/models/$m" --prompts "$C/prompts_$m.json" --dtype float32 \
        --fingerprint "$(python3 -c "import sys; sys.path.insert(0, sys.argv[1]); from lmdeploy_models import fingerprint; print(fingerprint(sys.argv[2]))" "$C" "$W/models/$m")" \
        --top-k 10 --max-tokens 16 --threads 4 --out "$W/res/hf_$m.json"
    done
  fi
) > "$W/res/cpu_side.log" 2>&1 &
CPU_PID=$!

fingerprint() { python3 -c "import sys; sys.path.insert(0, sys.argv[1]); from lmdeploy_models import fingerprint; print(fingerprint(sys.argv[2]))" "$C" "$1"; }
runner() {  # tree model dtype
  case "$2" in tm-*) while [ ! -e "$W/tm.ready" ]; do sleep 1; done ;; esac
  PYTHONPATH=/tmp/site:/tmp/lmd-$1 timeout -k 10 150 python3 "$C/lmdeploy_runner.py" --model "$W/models/$2" \
    --fingerprint "$(fingerprint "$W/models/$2")" \
    --prompts "$C/prompts_$2.json" --dtype "$3" --top-k 10 --max-tokens 16 --out "$W/runners/runner_$1_$2_$3.json" \
    > "$W/runners/runner_$1_$2_$3.log" 2>&1
  echo "runner $1 $2 $3 rc=$?"
  tar czf "$OUT/runners_$1.tar.gz" -C "$W" $(cd "$W" && ls runners/runner_"$1"_*)
}
bisect() {  # tree models
  [ "$BISECT" = 1 ] || return 0
  PYTHONPATH=/tmp/site:/tmp/lmd-$1 timeout -k 10 280 python3 "$C/lmdeploy_gpu_check.py" lmd --label "$1" \
    --models "$2" --dtypes "$BISECT_DTYPES" --work "$W" --out "$W/res"
  cp "$W/res/lmd_$1.json" "$OUT/bisect_$1.json" 2>/dev/null
}
chain() {  # tree models: the per-layer check, then this tree's runners
  bisect "$1" "$2"
  for item in $RUNNERS; do
    IFS=: read -r tree model dtype <<< "$item"
    [ "$tree" = "$1" ] && runner "$tree" "$model" "$dtype"
  done
}
stamp gpu chains
# One chain per tree (each tree compiles its Triton kernels once), both chains at once.
chain unpatched "$BISECT_UNPATCHED" & CHAIN_U=$!
chain patched "$BISECT_PATCHED" & CHAIN_P=$!
wait $CHAIN_U; stamp unpatched chain done
wait $CHAIN_P; stamp patched chain done
wait $CPU_PID; stamp cpu side done
for m in v2 v3 tm-v2-lite tm-v3; do
  cp "$W/models/$m/config.json" "$W/res/config_$m.json" 2>/dev/null
  cp "$W/models/$m/dsadapt.json" "$W/res/dsadapt_$m.json" 2>/dev/null
done
tar czf "$OUT/cpu_side.tar.gz" --exclude='res/lmd_*.json' -C "$W" res
ls -la "$OUT"
stamp done

"""Measure the noise floors behind the gate's tolerances (docs/equivalence.md).

    python tools/measure_gate_noise.py MODEL_DIR OUT_DIR [--vllm-python PY]

Runs the HF reference in several float32 configurations (repeat, 1 thread,
sdpa attention, grouped_mm experts, padded batch, float64) and in bf16/fp16,
optionally vLLM in float32/bf16/fp16, and prints each against the float32
eager reference under the gate's rule (top-k 5 and the full top-20).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher.engines.registry import engine as engine_of  # noqa: E402
from patcher.rules.logits import compare  # noqa: E402
from patcher.rules.prompts import build_prompt_set  # noqa: E402
from patcher.runners.launch import REFERENCE_RUNNER, RunnerJob, RunnerSpec, run_runner  # noqa: E402

HF_VARIANTS = {
    "repeat": ("float32", ()),
    "threads1": ("float32", ("--threads", "1")),
    "sdpa": ("float32", ("--attn", "sdpa")),
    "grouped_mm": ("float32", ("--experts", "grouped_mm")),
    "padded": ("float32", ("--batch-mode", "padded")),
    "float64": ("float64", ()),
    "bfloat16": ("bfloat16", ()),
    "float16": ("float16", ()),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--vllm-python")
    ap.add_argument("--hf-python", default=sys.executable)
    a = ap.parse_args()
    model, out = Path(a.model), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = build_prompt_set(model)
    hf = REFERENCE_RUNNER
    ref = run_runner(hf, Path(a.hf_python), RunnerJob(model, prompts, "float32", 20, 16, out / "ref.json"))
    others = {}
    for name, (dtype, extra) in HF_VARIANTS.items():
        spec = RunnerSpec(hf.name, hf.script, extra_args=extra, dtypes=hf.dtypes)
        others["hf-" + name] = run_runner(spec, Path(a.hf_python),
                                          RunnerJob(model, prompts, dtype, 20, 16, out / f"hf-{name}.json"))
    if a.vllm_python:
        for dtype in ("float32", "bfloat16", "float16"):
            others["vllm-" + dtype] = run_runner(engine_of("vllm").runner, Path(a.vllm_python),
                                                 RunnerJob(model, prompts, dtype, 20, 16, out / f"vllm-{dtype}.json"))
    rows = {}
    for name, rep in others.items():
        for k in (5, 20):
            reference, engine = (rep, ref) if rep.dtype == "float64" else (ref, rep)
            c = compare(reference, engine, top_k=k)
            rows[f"{name} k={k}"] = {"passed": c.passed, **c.summary,
                                     "mean_abs_all": sum(r.mean_abs * r.positions for r in c.rows)
                                     / max(1, c.summary["positions"]),
                                     "timings": rep.timings}
            print(name, k, json.dumps(rows[f"{name} k={k}"]), flush=True)
    (out / "noise.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

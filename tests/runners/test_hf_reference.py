"""The prompt set and the HF reference runner on the tiny V3 (fast: one subprocess run)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from equivalence_helpers import load_hf_reference, tiny_v3  # noqa: F401 (fixture)

from patcher.rules.logits import PromptResult, compare
from patcher.rules.prompts import (
    MAX_MODEL_LEN,
    MIXED_BATCH,
    PromptError,
    build_prompt_set,
    fit_tokens,
    long_prompt_length,
    prompts_from_json,
    prompts_to_json,
    rope_original_max,
)
from patcher.runners.launch import REFERENCE_RUNNER, REFERENCE_TOP_K, RunnerJob, run_runner

MAX_TOKENS = 6


def test_long_prompt_length_rules():
    yarn = {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64, "factor": 4}}
    assert rope_original_max(yarn) == 64 and long_prompt_length(yarn, 16) == 64 + 48
    tf5 = {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 100}}
    assert rope_original_max(tf5) == 100 and long_prompt_length(tf5, 16) == 148
    huge = {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}
    assert long_prompt_length(huge, 16) == MAX_MODEL_LEN - 16  # capped by the context
    assert rope_original_max({}) is None and long_prompt_length({}, 16) == MAX_MODEL_LEN - 16
    assert fit_tokens([1, 2, 3], 7) == (1, 2, 3, 1, 2, 3, 1)
    with pytest.raises(PromptError):
        fit_tokens([], 3)


def test_prompt_set_shape(tiny_v3):
    config = json.loads((tiny_v3 / "config.json").read_text())
    prompts = build_prompt_set(tiny_v3, max_tokens=16)
    by_id = {p.id: p for p in prompts}
    assert len(by_id["short"].token_ids) == 8 and len(by_id["medium"].token_ids) == 40
    orig = rope_original_max(config)
    assert orig is not None and len(by_id["long"].token_ids) > orig
    assert all(len(p.token_ids) + 16 <= MAX_MODEL_LEN for p in prompts)
    batch = [p for p in prompts if p.batch == MIXED_BATCH]
    assert len(batch) >= 3 and len({len(p.token_ids) for p in batch}) == len(batch)
    assert all(0 <= t < config["vocab_size"] for p in prompts for t in p.token_ids)
    assert build_prompt_set(tiny_v3, max_tokens=16) == prompts  # deterministic
    again = prompts_from_json(json.loads(json.dumps(prompts_to_json(prompts))))
    assert [(p.id, p.token_ids, p.batch) for p in again] == [(p.id, p.token_ids, p.batch) for p in prompts]


@pytest.fixture(scope="module")
def hf_report(tiny_v3, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "ref.json"
    prompts = build_prompt_set(tiny_v3, max_tokens=MAX_TOKENS)
    rep = run_runner(REFERENCE_RUNNER, Path(sys.executable),
                     RunnerJob(tiny_v3, prompts, "float32", REFERENCE_TOP_K, MAX_TOKENS, out, fingerprint="fp-test"))
    return prompts, rep


def test_hf_reference_report(hf_report):
    prompts, rep = hf_report
    assert rep.runner == "hf_reference" and rep.engine == "transformers" and rep.dtype == "float32"
    assert {"torch", "transformers"} <= set(rep.versions) and rep.model["fingerprint"] == "fp-test"
    assert rep.settings["greedy_flips"] == 0
    for p, r in zip(prompts, rep.prompts):
        assert r.prompt_token_ids == list(p.token_ids) and r.batch == p.batch
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p.token_ids)
        assert len(r.generated_token_ids) == MAX_TOKENS
        for i, pos in enumerate(r.prompt_logprobs[1:], start=1):
            assert pos.token_id == p.token_ids[i] and len(pos.top) == REFERENCE_TOP_K
            if pos.token_id in pos.top:
                assert pos.top[pos.token_id] == pos.logprob
        for tok, pos in zip(r.generated_token_ids, r.generated_logprobs):
            assert pos.token_id == tok == next(iter(pos.top))  # greedy = the reference's own argmax
            assert pos.logprob == max(pos.top.values()) <= 0


def test_hf_reference_matches_itself_in_process(hf_report, tiny_v3):
    """The subprocess report equals the same code run in-process (the rule sees no noise)."""
    prompts, rep = hf_report
    hfr = load_hf_reference()
    docs = prompts_to_json(prompts)["prompts"][:2]
    res, _ = hfr.run(hfr.load_model(tiny_v3), docs, REFERENCE_TOP_K, MAX_TOKENS)
    sub = replace(rep, prompts=rep.prompts[:2])
    again = replace(rep, prompts=[PromptResult.from_json(d) for d in res])
    c = compare(sub, again, top_k=REFERENCE_TOP_K)
    assert c.passed and c.summary["max_abs"] < 1e-5

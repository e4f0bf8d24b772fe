"""The comparison rule on synthetic reports: every failure mode fails, noise passes."""

from __future__ import annotations

import copy
import json
import math

import pytest
from equivalence_helpers import greedy_case, prompt_doc, report

from patcher.rules.logits import (
    STRICT_TOLERANCE,
    LogitReport,
    PositionLogprobs,
    ReportError,
    compare,
    compare_position,
    explain,
)

TOL = STRICT_TOLERANCE["float32"]


def pair(seed=0, k_eng=5, n_prompt=6, n_gen=4, pid="p", batch=None):
    ids, rows, gen = greedy_case(seed, n_prompt, n_gen)
    return (prompt_doc(pid, ids, rows, gen, 20, batch), prompt_doc(pid, ids, rows, gen, k_eng, batch), rows)


def shifted(doc, q, amount, n_prompt=6):
    """Add `amount` to every value at query position q of an engine document."""
    d = copy.deepcopy(doc)
    pos = d["prompt_logprobs"][q + 1] if q + 1 < n_prompt else d["generated_logprobs"][q + 1 - n_prompt]
    pos["logprob"] += amount
    pos["top"] = {t: v + amount for t, v in pos["top"].items()}
    return d


def test_identical_reports_pass():
    ref, eng, _ = pair()
    c = compare(report([ref]), report([eng], k=5))
    assert c.passed and c.rule == "strict" and c.reasons == []
    row = c.rows[0]
    assert row.max_abs == 0 and row.greedy_match and row.first_divergence is None
    assert row.positions == 5 + 4 and row.top1_agreement == 1.0


def test_noise_within_tolerance_passes():
    ref, eng, _ = pair()
    for q in range(9):
        eng = shifted(eng, q, 0.5 * TOL * (-1) ** q)
    c = compare(report([ref]), report([eng], k=5))
    assert c.passed
    assert 0.4 * TOL < c.summary["max_abs"] < 0.6 * TOL


@pytest.mark.parametrize("q", [0, 3, 7])
def test_delta_over_tolerance_fails_at_its_position(q):
    ref, eng, _ = pair()
    c = compare(report([ref]), report([shifted(eng, q, 3 * TOL)], k=5))
    assert not c.passed
    assert c.rows[0].first_divergence == q
    assert any("tolerance" in r for r in c.reasons)


def test_prompt_token_ids_must_be_identical():
    ref, eng, _ = pair()
    eng = copy.deepcopy(eng)
    eng["prompt_token_ids"][2] += 1
    c = compare(report([ref]), report([eng], k=5))
    assert not c.passed and "prompt token ids differ" in c.reasons[0]
    assert "token ids" in explain(c, {})[0]


def test_greedy_divergence_fails():
    ref, eng, rows = pair()
    eng = copy.deepcopy(eng)
    second = sorted(range(len(rows[6])), key=lambda t: -rows[6][t])[1]  # step 1 (q = 6)
    eng["generated_token_ids"][1] = second
    eng["generated_logprobs"][1]["token"] = second
    eng["generated_logprobs"][1]["logprob"] = rows[6][second]
    c = compare(report([ref]), report([eng], k=5))
    assert not c.passed and not c.rows[0].greedy_match and not c.rows[0].greedy_tie
    assert c.rows[0].first_divergence == 6
    assert any("greedy token differs at generated step 1" in r for r in c.reasons)


def test_greedy_tie_within_tolerance_is_not_a_failure():
    ref, eng, rows = pair()
    ref, eng = copy.deepcopy(ref), copy.deepcopy(eng)
    order = sorted(range(len(rows[6])), key=lambda t: -rows[6][t])
    a, b = order[0], order[1]
    top = rows[6][a]
    for doc in (ref, eng):  # make step 1 a near-tie between a and b on both sides
        pos = doc["generated_logprobs"][1]
        if str(b) in pos["top"]:
            pos["top"][str(b)] = top - TOL / 10
    eng["generated_token_ids"][1] = b
    eng["generated_logprobs"][1]["token"] = b
    eng["generated_logprobs"][1]["logprob"] = top - TOL / 10
    c = compare(report([ref]), report([eng], k=5))
    assert c.passed, c.reasons
    assert c.rows[0].greedy_tie and not c.rows[0].greedy_match
    assert c.rows[0].positions == 5 + 2  # compared up to and including the divergent step


def _pos(top: dict[int, float], token=None) -> PositionLogprobs:
    token = next(iter(top)) if token is None else token
    return PositionLogprobs(token, top[token], dict(sorted(top.items(), key=lambda tv: -tv[1])))


def test_topk_membership_ties_and_non_ties():
    ref = _pos({1: -1.0, 2: -2.0, 3: -3.0, 4: -3.0 - TOL / 10, 5: -4.0})
    tie = _pos({1: -1.0, 2: -2.0, 4: -3.0 - TOL / 10})  # k=3: token 4 instead of 3, within tol of k-th
    assert compare_position(ref, tie, 3, TOL).problems == []
    far = _pos({1: -1.0, 2: -2.0, 5: -4.0})  # token 5 is 1 nat below the k-th: not a tie
    problems = compare_position(ref, far, 3, TOL).problems
    assert any("below the reference's k-th value" in p for p in problems)
    # token 3 sits at the k-th value itself, so its absence alone is a tie; token 1's is not
    no_top1 = _pos({2: -2.0, 3: -3.0, 4: -3.0 - TOL / 10})
    problems = compare_position(ref, no_top1, 3, TOL).problems
    assert problems == ["reference top-3 token 1 (logprob -1) is missing from the engine's top-3"]


def test_engine_token_outside_reference_top_list_fails():
    ref = _pos({1: -1.0, 2: -2.0, 3: -3.0})
    eng = _pos({1: -1.0, 2: -2.0, 99: -3.0})
    problems = compare_position(ref, eng, 3, TOL).problems
    assert any("outside the reference's top-3" in p for p in problems)


def test_missing_prompt_and_length_mismatch_fail():
    ref, eng, _ = pair()
    ref2, _, _ = pair(seed=1, pid="q")
    c = compare(report([ref, ref2]), report([eng], k=5))
    assert not c.passed and any("missing from the engine report" in r for r in c.reasons)
    short = copy.deepcopy(eng)
    short["generated_token_ids"] = short["generated_token_ids"][:2]
    short["generated_logprobs"] = short["generated_logprobs"][:2]
    c = compare(report([ref]), report([short], k=5))
    assert not c.passed and any("generated 2 tokens" in r for r in c.reasons)


def test_reference_must_be_full_precision_and_wide_enough():
    ref, eng, _ = pair()
    with pytest.raises(ReportError):
        compare(report([ref], dtype="bfloat16"), report([eng], k=5))
    with pytest.raises(ReportError):
        compare(report([eng], k=5), report([ref], k=20))


def test_low_precision_rule_gates_prompt_positions_only():
    ref, eng, rows = pair(n_prompt=12)
    noisy = eng
    for q in range(11):
        noisy = shifted(noisy, q, 0.01 * (-1) ** q, n_prompt=12)
    noisy["generated_token_ids"] = [t + 1 for t in noisy["generated_token_ids"]]  # generation is not gated
    c = compare(report([ref]), report([noisy], dtype="bfloat16", k=5))
    assert c.rule == "low-precision" and c.passed, c.reasons
    assert c.summary["top1"] == 1.0 and not c.rows[0].greedy_match
    bad = copy.deepcopy(eng)
    for pos in bad["prompt_logprobs"][1:]:  # reverse each engine top-5: top-1 agreement collapses
        items = list(pos["top"].items())
        pos["top"] = dict(zip([t for t, _ in items][::-1], [v for _, v in items]))
    c = compare(report([ref]), report([bad], dtype="bfloat16", k=5))
    assert not c.passed and any("top-1 agreement" in r for r in c.reasons)
    assert "low-precision rule failed" in explain(c, {})[-1]


def test_batch_only_divergence_explained_as_batching():
    s_ref, s_eng, _ = pair(seed=0, pid="single")
    b_ref, b_eng, _ = pair(seed=1, pid="mixed/0", batch="mixed")
    c = compare(report([s_ref, b_ref]), report([s_eng, shifted(b_eng, 2, 0.1)], k=5))
    assert not c.passed
    assert "batching" in explain(c, {})[-1]


def test_position_zero_vs_later_explanations():
    ref, eng, _ = pair()
    at0 = compare(report([ref]), report([shifted(eng, 0, 0.1)], k=5))
    assert "query position 0" in explain(at0, {"scoring_func": "sigmoid"})[-1]
    assert "MoE routing (scoring_func=sigmoid" in explain(at0, {"scoring_func": "sigmoid"})[-1]
    later = compare(report([ref]), report([shifted(eng, 3, 0.1)], k=5))
    assert "attention" in explain(later, {})[-1]


def test_yarn_explanation_needs_divergence_only_beyond_original_context():
    ref, eng, _ = pair(n_prompt=12)
    c = compare(report([ref]), report([shifted(eng, 9, 0.1, n_prompt=12)], k=5))
    cfg = {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 8, "factor": 4}}
    assert "YaRN scaling" in explain(c, cfg)[-1]
    cfg["rope_scaling"]["original_max_position_embeddings"] = 16
    assert "attention" in explain(c, cfg)[-1]


def test_report_json_round_trip(tmp_path):
    ref, _, _ = pair()
    r = report([ref])
    r.versions = {"torch": "2.13"}
    r.engine_path = "/x/vllm/__init__.py"
    r.model = {"path": "/m", "fingerprint": "abc"}
    again = LogitReport.load(r.save(tmp_path / "r.json"))
    assert again == r
    assert again.prompts[0].prompt_logprobs[0] is None
    assert list(again.prompts[0].prompt_logprobs[1].top.values()) == sorted(
        again.prompts[0].prompt_logprobs[1].top.values(), reverse=True)


def test_malformed_reports_are_rejected():
    ref, _, _ = pair()
    doc = report([ref]).to_json()
    with pytest.raises(ReportError):
        LogitReport.from_json({**doc, "schema": "other"})
    broken = copy.deepcopy(doc)
    broken["prompts"][0]["prompt_logprobs"] = broken["prompts"][0]["prompt_logprobs"][:-1]
    with pytest.raises(ReportError):
        LogitReport.from_json(broken)
    with pytest.raises(ReportError):
        LogitReport.from_json({k: v for k, v in doc.items() if k != "dtype"})


def test_comparison_serializes_to_strict_json():
    ref, eng, _ = pair()
    eng = copy.deepcopy(eng)
    eng["prompt_token_ids"][0] += 1  # gives an infinite max_abs
    c = compare(report([ref]), report([eng], k=5))
    text = json.dumps(c.to_json(), allow_nan=False)
    assert json.loads(text)["rows"][0]["passed"] is False
    assert math.isinf(c.rows[0].max_abs)

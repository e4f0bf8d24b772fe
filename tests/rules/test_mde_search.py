"""`dsadapt power`'s pure parts (patcher/rules/mde.py): the targets and what a model lacks, the
search bounds, the bisection over eps against synthetic gates of known threshold, the verdict,
and the gathering of reference captures per run. Fast (no engine, no model)."""

from __future__ import annotations

import math

import pytest

from patcher.base.errors import UsageError
from patcher.checkpoints.tiny import deepseek_config
from patcher.rules import mde as P


def _search(cell: P.Cell, search: P.Search, gate) -> P.Cell:
    """Run `next_eps` to the end against `gate(eps) -> flagged (None: not planted)`."""
    for _ in range(100):
        eps = P.next_eps(cell, search)
        if eps is None:
            return cell
        cell.trials.append(P.Trial(eps, gate(eps)))
    raise AssertionError("the search did not end")


def _cell(phase="decode") -> P.Cell:
    return P.Cell("attention", "attn.core", "attention", phase)


@pytest.mark.parametrize("threshold", [1.3e-5, 2e-4, 3.3e-3, 0.05, 0.29])
@pytest.mark.parametrize("resolution", [1.2, 1.5, 3.0])
def test_the_bisection_brackets_the_threshold_within_the_resolution(threshold, resolution):
    search = P.Search(1e-5, 0.3, resolution)
    cell = _search(_cell(), search, lambda eps: eps >= threshold)
    assert cell.status == "flagged" and cell.monotone
    lo, hi = cell.clear_at, cell.flagged_at
    assert lo < threshold <= hi and hi / lo <= resolution * 1.002  # eps are rounded to 3 digits
    # one step per halving of log(eps_max / eps_min) down to the resolution, and an end of the
    # range when no trial bounded that side
    assert len(cell.trials) <= math.ceil(math.log2(math.log(0.3 / 1e-5) / math.log(resolution))) + 2


def test_ends_of_the_range_settle_the_search():
    search = P.Search(1e-4, 0.1, 1.5)
    never = _search(_cell(), search, lambda eps: False)
    assert never.status == "not flagged" and never.flagged_at is None and never.trials[-1].eps == 0.1
    assert P.mde_text(never, search) == "> 0.1"
    always = _search(_cell(), search, lambda eps: True)
    assert always.status == "below range" and always.flagged_at == 1e-4 and always.trials[-1].eps == 1e-4
    assert P.mde_text(always, search) == "<= 0.0001"
    # a bound found by the bisection is never replaced by an end: both ends are tried only when needed
    edge = _search(_cell(), search, lambda eps: eps >= 0.09)
    assert edge.status == "flagged" and 0.1 in {t.eps for t in edge.trials} and edge.flagged_at <= 0.1
    nowhere = _search(_cell(), search, lambda eps: None)
    assert nowhere.status == "not planted" and P.mde_text(nowhere, search) == "not planted"


def test_a_gate_that_is_not_monotone_in_eps_is_said_so():
    cell = _cell()
    cell.trials = [P.Trial(0.1, True), P.Trial(1e-4, False), P.Trial(0.05, False), P.Trial(0.003, True)]
    assert cell.flagged_at == 0.003 and not cell.monotone
    assert cell.to_json()["monotone"] is False


def test_search_bounds_and_names_are_checked_before_anything_runs():
    P.Search().check()
    for bad, needle in [(P.Search(0, 0.3), "--eps-min 0: eps must be in (0, 1)"),
                        (P.Search(1e-4, 1.0), "--eps-max 1: eps must be in (0, 1)"),
                        (P.Search(-1e-3, 0.3), "eps must be in"), (P.Search(1e-4, math.inf), "eps must be in"),
                        (P.Search(0.2, 0.1), "is not below"), (P.Search(1e-4, 0.3, 1.0), "--resolution 1")]:
        with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            bad.check()
    with pytest.raises(UsageError, match="not a phase"):
        P.check_phase("warmup")
    with pytest.raises(UsageError, match="not a perturbation kind"):
        P.check_kind("shift")
    with pytest.raises(UsageError, match="not a module family or comparison point") as e:
        P.target("attn")
    assert "attention" in (e.value.hint or "") and "attn.kv_a_norm" in (e.value.hint or "")


def test_what_each_built_in_model_has():
    v3, lite = deepseek_config("v3"), deepseek_config("v2-lite")
    for name in P.DEFAULT_TARGETS:
        assert P.lacks(P.target(name), v3) is None
    assert "q_lora_rank" in P.lacks(P.target("attn.q_a_norm"), lite, "v2-lite")
    assert P.lacks(P.target("attn.q_a_norm"), v3) is None
    assert P.layers_of(P.target("moe"), v3) == [1, 2, 3] and P.layers_of(P.target("mlp"), v3) == [0]
    assert P.layers_of(P.target("attention"), v3) is None
    dense = {**v3, "n_routed_experts": None}
    assert "no MoE layers" in P.lacks(P.target("moe"), dense)
    all_moe = {**v3, "first_k_dense_replace": 0}
    assert "no dense layer" in P.lacks(P.target("mlp"), all_moe)
    assert "no shared experts" in P.lacks(P.target("shared"), {**v3, "n_shared_experts": 0})
    assert "router.experts" not in P.TARGETS  # expert ids cannot be scaled


def test_the_verdict_fails_a_failing_control_or_a_blind_cell_under_require():
    a, b = _cell("prefill"), _cell("decode")
    a.trials = [P.Trial(0.3, True), P.Trial(1e-5, False), P.Trial(0.01, True), P.Trial(0.005, False)]
    b.trials = [P.Trial(0.3, False)]
    b.status = "not flagged"
    assert P.verdict([a, b], True, [], None) == []
    assert P.verdict([a, b], False, ["prefill: mean |Δ logprob| 2x"], None) == \
        ["the unperturbed run fails the gate: prefill: mean |Δ logprob| 2x"]
    reasons = P.verdict([a, b], True, [], 0.02)
    assert len(reasons) == 1 and "decode: not flagged in the range searched" in reasons[0]
    assert "flagged only from eps 0.01" in P.verdict([a], True, [], 0.005)[0]


def test_applied_sums_the_phases_a_cell_perturbs():
    st = {"points": {"attn.core": {"rows": {"prefill": 30, "decode": 10}, "change": {"prefill": 0.1, "decode": 0.2}}}}
    assert P.applied(st, "attn.core", "decode") == (10, 0.2)
    rows, change = P.applied(st, "attn.core", "both")
    assert rows == 40 and change == pytest.approx(math.sqrt((30 * 0.01 + 10 * 0.04) / 40))
    assert P.applied(st, "routed", "both") == (0, None) and P.applied(None, "x", "prefill") == (0, None)


def test_reference_rows_are_gathered_per_run_from_the_captures_that_hold_them():
    torch = pytest.importorskip("torch")

    def doc(prompts: dict[str, list[int]], offset: float) -> dict:
        ids = list(prompts)
        pts = []
        for layer in (0, 1):
            prompt = torch.tensor([i for i, p in enumerate(ids) for _ in prompts[p]])
            pos = torch.tensor([k for p in ids for k in range(len(prompts[p]))])
            value = (prompt * 100 + pos + offset + layer * 1000).float()[:, None].repeat(1, 3)
            pts.append({"layer": layer, "point": "out", "value": value, "prompt": prompt, "pos": pos,
                        "phase": (pos > 2).long()})
        return {"schema": "dsadapt.capture/1", "prompts": ids, "sequences": prompts, "points": pts, "missing": [],
                "meta": {"dtype": "float32"}}

    chunks = [doc({"s0": [1, 2, 3, 4], "s1": [5, 6]}, 0.0), doc({"s2": [1, 2, 9]}, 0.5)]
    out = P.assemble_capture(chunks, {"short": (1, "s2"), "long": (0, "s0")})
    assert out["prompts"] == ["short", "long"] and out["sequences"] == {"short": [1, 2, 9], "long": [1, 2, 3, 4]}
    for e in out["points"]:
        short = e["value"][e["prompt"] == 0, 0]
        long = e["value"][e["prompt"] == 1, 0]
        base = 1000 * e["layer"]
        assert short.tolist() == [base + 0.5, base + 1.5, base + 2.5]  # chunk 1's prompt 0
        assert long.tolist() == [base + 0, base + 1, base + 2, base + 3]  # chunk 0's prompt 0
        assert e["pos"].tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_logit_difference_between_two_runs():
    def rep(lp: float, gen: list[int] | None = None) -> dict:
        pos = {"token": 2, "logprob": lp, "top": {"2": lp, "3": -5.0}}
        return {"prompts": [{"id": "a", "prompt_token_ids": [1, 2], "prompt_logprobs": [None, pos],
                             "generated_token_ids": gen or [2], "generated_logprobs": [pos]}]}

    assert P.logit_difference(rep(-1.0), rep(-1.0)) == 0.0
    assert P.logit_difference(rep(-1.0), rep(-1.25)) == pytest.approx(0.25)
    assert P.logit_difference(rep(-1.0), rep(-1.0, gen=[3])) is None
    assert "identical" in P.hooks_words(0.0) and "different tokens" in P.hooks_words(None)


def test_a_cut_short_cell_reports_its_bracket_so_far():
    search = P.Search(1e-4, 0.1, 1.5)
    cell = _cell()
    cell.trials = [P.Trial(0.003, True), P.Trial(0.0005, False)]
    cell.status = "cut short"
    assert P.next_eps(cell, search) is None
    assert P.mde_text(cell, search) == "0.003 (not at 0.0005) (cut short)"
    assert "cut short by the time limit" in P.verdict([cell], True, [], 0.001)[0]
    blind = _cell()
    blind.trials = [P.Trial(0.003, False)]
    blind.status = "cut short"
    assert P.mde_text(blind, search) == "> 0.003 (cut short)"

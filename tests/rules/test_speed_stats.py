"""The speed gate's statistics (patcher/rules/speed.py): pure functions, no engine."""

from __future__ import annotations

import math
import random

import pytest

from patcher.base.errors import UsageError
from patcher.rules import speed as P


def req(mix="m", inp=16, out=8, ttft=0.1, lat=0.8, ok=True) -> P.RequestRecord:
    return P.RequestRecord(mix, inp, out, ttft, lat, ok, "" if ok else "boom")


def run(side, rnd, c, dur=1.0, n=4, out=8, ttft=0.1, lat=0.8, failed=0) -> P.RunRecord:
    reqs = [req(out=out, ttft=ttft, lat=lat) for _ in range(n)] + [req(ok=False, out=0, ttft=0, lat=0)] * failed
    return P.RunRecord(side, rnd, c, dur, reqs)


# ---------------------------------------------------------------- percentiles, bootstrap


def test_percentile_matches_linear_interpolation():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert P.percentile(xs, 50) == 2.5
    assert P.percentile(xs, 0) == 1.0 and P.percentile(xs, 100) == 4.0
    assert P.percentile(xs, 90) == pytest.approx(3.7)
    assert P.percentile([5.0], 99) == 5.0 and P.percentile([], 50) is None


def test_bootstrap_is_deterministic_and_brackets_the_mean():
    rng = random.Random(3)
    vals = [rng.gauss(0, 0.1) for _ in range(12)]
    a = P.bootstrap_ci(vals, seed=0)
    assert a == P.bootstrap_ci(vals, seed=0)
    assert a != P.bootstrap_ci(vals, seed=1)  # a different resampling stream
    mean = sum(vals) / len(vals)
    plain = P.bootstrap_ci(vals, seed=0, expand=False)
    assert min(vals) <= plain[0] < mean < plain[1] <= max(vals)
    assert a[0] < plain[0] and a[1] > plain[1]  # the small-sample expansion only widens


def test_plain_bootstrap_of_three_rounds_spans_about_the_range():
    """With 3 rounds every resample is one of 10 multisets; the plain percentile interval lands on
    the smallest and the largest value (and covers far too little: hence the expansion)."""
    lo, hi = P.bootstrap_ci([0.0, 0.1, 0.2], seed=0, expand=False)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.2, abs=1e-12)
    lo, hi = P.bootstrap_ci([0.0, 0.1, 0.2], seed=0)
    assert (lo, hi) == pytest.approx((0.1 - 0.1 * P.expansion(3), 0.1 + 0.1 * P.expansion(3)))


def test_expansion_is_the_student_t_correction():
    assert P.expansion(3) == pytest.approx((3 / 2) ** 0.5 * 4.303 / 1.96, rel=1e-3)
    assert P.expansion(5) == pytest.approx((5 / 4) ** 0.5 * 2.776 / 1.96, rel=1e-3)
    assert P.expansion(1000) == pytest.approx(1.0, abs=1e-3)
    assert P.expansion(5, level=0.9) == 1.0


def test_bootstrap_of_one_value_is_that_value():
    assert P.bootstrap_ci([0.3]) == (0.3, 0.3)
    with pytest.raises(ValueError):
        P.bootstrap_ci([])


@pytest.mark.parametrize("rounds", [3, 5])
def test_bootstrap_ci_covers_the_true_mean_95_percent_of_the_time(rounds):
    """Coverage of the interval on normal data in the regime the gate runs in (3-5 rounds):
    nominal 95 %; measured 94 % (the plain percentile interval: 74 % / 84 %)."""
    rng = random.Random(7)
    trials = 300
    hits = plain = 0
    for t in range(trials):
        xs = [rng.gauss(0.0, 0.05) for _ in range(rounds)]
        lo, hi = P.bootstrap_ci(xs, samples=500, seed=t)
        hits += lo <= 0.0 <= hi
        plo, phi = P.bootstrap_ci(xs, samples=500, seed=t, expand=False)
        plain += plo <= 0.0 <= phi
    assert 0.90 <= hits / trials <= 0.99
    assert plain / trials < 0.88


# ---------------------------------------------------------------- ratios


def test_oriented_ratio_below_one_means_patched_is_worse():
    assert P.oriented_ratio(90.0, 100.0, higher_is_better=True) == pytest.approx(0.9)   # fewer tokens/s
    assert P.oriented_ratio(110.0, 100.0, higher_is_better=False) == pytest.approx(100 / 110)  # longer latency
    for bad in (None, 0.0, -1.0, math.inf, math.nan):
        assert P.oriented_ratio(bad, 1.0, True) is None and P.oriented_ratio(1.0, bad, False) is None


def test_paired_ratio_is_the_geometric_mean_of_round_ratios():
    r = P.paired_ratio("output_throughput", [90, 100, 110], [100, 100, 100])
    assert r.per_round == pytest.approx((0.9, 1.0, 1.1))
    assert r.estimate == pytest.approx((0.9 * 1.0 * 1.1) ** (1 / 3))
    assert r.lo <= r.estimate <= r.hi and r.gated
    lat = P.paired_ratio("tpot_mean", [20.0, 20.0], [10.0, 10.0])  # patched takes twice as long
    assert lat.estimate == pytest.approx(0.5) and lat.hi == pytest.approx(0.5) and lat.below(0.95)
    assert not P.paired_ratio("e2el_p99", [1.0], [1.0]).gated


def test_paired_ratio_with_a_missing_round_value_has_no_estimate():
    r = P.paired_ratio("ttft_mean", [10.0, None], [10.0, 10.0])
    assert r.estimate is None and r.lo is None and not r.below(0.95)
    with pytest.raises(ValueError):
        P.paired_ratio("ttft_mean", [1.0], [1.0, 2.0])


def test_pairing_cancels_a_shared_drift():
    """A machine that slows down over the run moves both sides of each pair alike: the
    per-round ratios stay at 1 although the raw values halve."""
    drift = [1.0, 0.8, 0.6, 0.5]
    r = P.paired_ratio("output_throughput", [100 * d for d in drift], [100 * d for d in drift])
    assert r.estimate == pytest.approx(1.0) and r.lo == pytest.approx(1.0) and r.hi == pytest.approx(1.0)


# ---------------------------------------------------------------- runs, schedule, points


def test_run_metrics_tpot_excludes_the_first_token_and_failures_count():
    m = P.run_metrics(run("patched", 0, 1, dur=2.0, n=4, out=11, ttft=0.1, lat=1.1, failed=1))
    assert m["output_throughput"] == pytest.approx(4 * 11 / 2.0)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["ttft_mean"] == pytest.approx(100.0)
    assert m["tpot_mean"] == pytest.approx(100.0)  # (1.1 - 0.1) s / 10 tokens
    assert m["e2el_p99"] == pytest.approx(1100.0)
    assert m["completed"] == 4 and m["failed"] == 1


def test_schedule_balances_which_side_goes_first_at_every_level():
    """An advantage of going first (or second) in a pair cancels: over the default even number of
    rounds each side goes first in exactly half of them, at every level."""
    sides = ("patched", "unpatched")
    plan = P.schedule(P.DEFAULT_ROUNDS, (1, 4, 16), sides, warmup_rounds=1)
    assert P.DEFAULT_ROUNDS % 2 == 0
    assert len(plan) == (P.DEFAULT_ROUNDS + 1) * 3 * 2
    half = P.DEFAULT_ROUNDS // 2
    assert P.order_balance(plan, sides) == {c: {"patched": half, "unpatched": half} for c in (1, 4, 16)}
    for rnd in range(P.DEFAULT_ROUNDS):
        for c in (1, 4, 16):
            pair = [s for (r, cc, s) in plan if r == rnd and cc == c]
            assert sorted(pair) == ["patched", "unpatched"]


def test_schedule_alternates_run_by_run_and_warms_up_both_sides_first():
    """A side runs twice in a row only where one round ends and the next begins (never: one side
    always straight after its own run while the other waited), and every warm-up run of both
    sides comes before the first measured run."""
    plan = P.schedule(4, (1, 4, 16), warmup_rounds=2)
    for i in range(1, len(plan)):
        same = plan[i][2] == plan[i - 1][2]
        assert not same or plan[i][0] != plan[i - 1][0], plan[i - 1:i + 1]
    rounds = [r for r, _c, _s in plan]
    assert rounds == sorted(rounds) and rounds[0] == -2
    warm = [(c, s) for r, c, s in plan if r < 0]
    assert sorted(set(warm)) == sorted({(c, s) for c in (1, 4, 16) for s in ("patched", "unpatched")})


def test_points_pair_rounds_and_detect_a_slower_side():
    runs = []
    for rnd in range(4):
        runs.append(run("patched", rnd, 4, dur=1.25, lat=1.0))   # 20 % fewer tokens/s, slower tokens
        runs.append(run("unpatched", rnd, 4, dur=1.0, lat=0.8))
    (pt,) = P.build_points(runs, (4,))
    assert pt.ratios["output_throughput"].estimate == pytest.approx(0.8)
    assert pt.ratios["tpot_mean"].estimate == pytest.approx(0.7 / 0.9)
    verdict, reasons = P.decide([pt], 0.95)
    assert verdict == "fail"
    assert any("output tokens/s" in r and "below 0.95" in r for r in reasons)
    assert pt.sides["patched"]["rounds"] == 4 and set(pt.mixes) == {"m"}
    assert pt.mixes["m"]["ratios"]["tpot_mean"]["gated"] is False


def test_equal_sides_pass_and_band_reports_the_margin():
    runs = [run(s, rnd, 1) for rnd in range(3) for s in ("patched", "unpatched")]
    points = P.build_points(runs, (1,))
    assert P.decide(points) == ("pass", [])
    b = P.band(points)
    assert b["ci_hi_min"] == pytest.approx(1.0) and b["margin"] == pytest.approx(0.05)


def test_failed_requests_fail_the_gate_on_either_side():
    runs = [run("patched", 0, 1), run("unpatched", 0, 1, failed=2), run("patched", 1, 1), run("unpatched", 1, 1)]
    verdict, reasons = P.decide(P.build_points(runs, (1,)))
    assert verdict == "fail" and reasons == ["unpatched: 2 of 10 requests failed"]


def test_a_round_missing_one_side_is_an_error():
    with pytest.raises(ValueError, match="lack a side"):
        P.build_points([run("patched", 0, 1)], (1,))


def test_warmup_rounds_are_not_measured():
    runs = [run("patched", -1, 1, dur=100.0), run("unpatched", -1, 1)] + \
           [run(s, 0, 1) for s in ("patched", "unpatched")] + [run(s, 1, 1) for s in ("patched", "unpatched")]
    (pt,) = P.build_points(runs, (1,))
    assert pt.ratios["output_throughput"].estimate == pytest.approx(1.0)


# ---------------------------------------------------------------- workload


def test_default_workload_has_a_mix_past_the_yarn_original_context():
    w = P.build_workload(original_context=64, concurrency=(1, 4, 16))
    names = {m.name: m for m in w.mixes}
    assert names["long"].input_len == 64 + P.LONG_PAST_ORIGINAL > 64
    assert all(m.input_len + m.output_len <= w.max_model_len for m in w.mixes)
    reqs = w.requests()
    assert len(reqs) >= 2 * 16 and [r.mix for r in reqs[:3]] == ["short", "medium", "long"]
    assert [r.index for r in reqs] == list(range(len(reqs)))


@pytest.mark.parametrize("requests, per_mix", [(8, [3, 3, 2]), (9, [3, 3, 3]), (32, [11, 11, 10]), (3, [1, 1, 1])])
def test_a_run_sends_exactly_the_requests_asked_for(requests, per_mix):
    w = P.build_workload(original_context=64, concurrency=(4,), requests=requests)
    assert len(w.requests()) == requests == w.to_json()["requests_per_run"]
    assert [m.requests for m in w.mixes] == per_mix


def test_requests_per_level_send_the_first_of_one_fixed_list_at_each_level():
    w = P.build_workload(original_context=64, concurrency=(1, 16), requests=(6, 32))
    assert len(w.requests()) == 32 and [len(w.requests_at(c)) for c in (1, 16)] == [6, 32]
    assert w.requests_at(1) == w.requests()[:6]
    assert [r.mix for r in w.requests_at(1)] == ["short", "medium", "long"] * 2  # still interleaved
    assert w.to_json()["requests_per_level"] == {"1": 6, "16": 32}
    one = P.build_workload(original_context=64, concurrency=(1, 16), requests=(12,))
    assert one.per_level == () and [len(one.requests_at(c)) for c in (1, 16)] == [12, 12]
    with pytest.raises(UsageError, match="2 values for 3 concurrency levels"):
        P.build_workload(original_context=64, concurrency=(1, 4, 16), requests=(6, 32))
    with pytest.raises(UsageError, match="fewer than the 3"):
        P.build_workload(original_context=64, concurrency=(1, 16), requests=(2, 32))


def test_fewer_requests_than_mixes_is_refused():
    with pytest.raises(UsageError, match="fewer than the 3 prompt/output mixes"):
        P.build_workload(original_context=64, requests=2)


def test_workload_from_explicit_lengths():
    w = P.build_workload(original_context=None, input_lens=(32, 100), output_lens=(16,), requests=4)
    assert [(m.input_len, m.output_len, m.requests) for m in w.mixes] == [(32, 16, 2), (100, 16, 2)]


@pytest.mark.parametrize("kwargs, words", [
    ({"rounds": 1}, "at least 2 rounds"),
    ({"concurrency": (4, 4)}, "repeated"),
    ({"input_lens": (200,), "output_lens": (100,)}, "exceed --max-model-len 256"),
    ({"input_lens": (1, 2, 3), "output_lens": (4, 5)}, "3 values and --output-len 2"),
    ({"output_lens": (1,)}, "at least 2"),
    ({"requests": 0}, "positive"),
])
def test_workload_rejects_bad_options(kwargs, words):
    with pytest.raises(UsageError, match=words) as e:
        P.build_workload(original_context=64, **kwargs)
    assert e.value.hint


@pytest.mark.parametrize("text", ["1,x", "0", "-1", "1,,2", "4.5", "", " "])
def test_parse_int_list_rejects(text):
    with pytest.raises(UsageError):
        P.parse_int_list(text, "--concurrency")


def test_parse_int_list():
    assert P.parse_int_list(" 1, 4 ,16", "--concurrency") == (1, 4, 16)
    assert P.parse_int_list(None, "--x") is None  # not given: the default; an empty value is refused

"""The gate's pictures draw every curve against its limit, size their axes to the data, and name
the configuration in single-spaced titles: the strict rule's tolerance line, the low-precision
rule's ratio axis with its limit and pooled ratio, YaRN's original context marked where the
positions reach it (named at the edge where they do not: a real model's 4096 against 255
positions), the speed gate's threshold, the heat map's error / limit in every cell."""

from __future__ import annotations

import copy
import json
import random

import pytest
from equivalence_helpers import greedy_case, prompt_doc, report

from patcher.rules.logits import compare

pytest.importorskip("matplotlib")

PIN = "vllm@v0.32.0"


def _strict(positions: int = 6, shift: float = 0.0):
    ids, rows, gen = greedy_case(0, n_prompt=positions)
    ref = prompt_doc("a", ids, rows, gen, 20)
    eng = copy.deepcopy(prompt_doc("a", ids, rows, gen, 5))
    for p in eng["prompt_logprobs"][1:]:
        p["logprob"] += shift
        p["top"] = {t: v + shift for t, v in p["top"].items()}
    return compare(report([ref]), report([eng], k=5))


def _vlines(ax) -> list[float]:
    return [ln.get_xdata()[0] for ln in ax.lines if len(set(ln.get_xdata())) == 1 and len(ln.get_xdata()) == 2]


def _hlines(ax) -> list[float]:
    return [ln.get_ydata()[0] for ln in ax.lines if len(set(ln.get_ydata())) == 1 and len(ln.get_ydata()) == 2]


def test_plot_writes_a_small_png(tmp_path):
    from patcher.rules.plots import plot_deltas

    c = _strict(shift=2e-5)
    out = plot_deltas(c, tmp_path / "d.png", original_max=3)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5000 < len(data) < 150_000  # a palette PNG: reports are committed


def test_the_strict_plot_draws_the_tolerance_and_sizes_its_axis_to_the_positions():
    from patcher.rules.plots import deltas_figure

    c = _strict(positions=6, shift=2e-5)
    fig = deltas_figure(c, title="vllm@v0.32.0  cpu v3 float32", original_max=3)
    ax = fig.axes[0]
    assert c.tolerance in _hlines(ax)  # the limit
    assert 3 in _vlines(ax)
    last = len(c.rows[0].deltas) - 1  # 5 prompt positions and 4 generated steps
    assert ax.get_xlim() == (-0.5, last + 0.5)  # the axis is the positions'
    assert c.tolerance in _hlines(ax)
    title = ax.get_title()
    assert "  " not in title and title.startswith("vllm@v0.32.0 cpu v3 float32: logits PASS")
    assert "below the tolerance 1.0e-4" in title  # the distance to the limit, in words too


def test_a_marker_beyond_the_positions_is_named_at_the_edge_not_stretched_to():
    """A released model's original_max_position_embeddings (4096) with the gate's 255 positions."""
    from patcher.rules.plots import deltas_figure

    c = _strict(positions=8)
    fig = deltas_figure(c, original_max=4096)
    ax = fig.axes[0]
    assert ax.get_xlim()[1] == len(c.rows[0].deltas) - 0.5 and not _vlines(ax)
    note = " ".join(t.get_text() for t in ax.texts)
    assert "original_max_position_embeddings 4096" in note and "beyond the last position" in note


def _low_precision(shift: float):
    """A low-precision comparison with the reference's own run in bfloat16 as the yardstick: the
    engine off by `shift` times the yardstick's error at every position."""
    rng = random.Random(1)

    def rows(n):
        out = []
        for _ in range(n):
            top = {str(t): -1.0 - t - rng.random() * 0.01 for t in range(20)}
            out.append(top)
        return out

    ids = list(range(40))
    base = rows(len(ids) - 1)

    def side(dtype, scale, k, seed):
        r = random.Random(seed)
        plp = [None]
        for top in base:
            noisy = {t: v + scale * r.uniform(0.5, 1.5) * 1e-2 for t, v in top.items()}
            noisy = dict(sorted(noisy.items(), key=lambda kv: -kv[1])[:k])
            plp.append({"token": int(next(iter(noisy))), "logprob": next(iter(noisy.values())), "top": noisy})
        doc = {"id": "p", "batch": None, "prompt_token_ids": ids, "prompt_logprobs": plp,
               "generated_token_ids": [], "generated_logprobs": []}
        return report([doc], dtype=dtype, k=k)

    ref = side("float32", 0.0, 20, 0)
    return compare(ref, side("bfloat16", shift, 5, 2), noise=side("bfloat16", 1.0, 5, 3))


@pytest.mark.parametrize("shift, verdict", [(1.0, "PASS"), (4.0, "FAIL")])
def test_the_low_precision_plot_puts_the_rule_s_ratio_against_its_limit(shift, verdict):
    from patcher.rules.plots import deltas_figure

    c = _low_precision(shift)
    assert c.judgement and c.judgement["prefill"]
    fig = deltas_figure(c, title=f"{PIN} cpu v3 bfloat16", original_max=16)
    ax, bx = fig.axes[0], fig.axes[1]
    p = c.judgement["prefill"]
    assert p["limit"] in _hlines(bx) and p["ratio"] in _hlines(bx) and 1.0 in _hlines(bx)
    assert bx.get_yscale() == "log" and bx.get_ylim()[1] > max(p["limit"], p["ratio"])
    title = ax.get_title()
    assert f"logits {verdict}" in title and f"limit {p['limit']:g}x" in title
    assert ("x over" if verdict == "FAIL" else "x below") in title
    labels = " ".join(bx.get_legend_handles_labels()[1])
    assert f"pooled {p['ratio']:.2f}x" in labels and f"limit {p['limit']:g}x" in labels
    assert [t.get_text() for t in bx.get_yticklabels() if "^" in t.get_text() or "times" in t.get_text()] == []


def test_a_stored_comparison_draws_the_same_as_a_live_one():
    from patcher.rules.plots import deltas_figure

    c = _low_precision(1.0)
    live, stored = deltas_figure(c), deltas_figure(json.loads(json.dumps(c.to_json())))
    assert live.axes[0].get_title() == stored.axes[0].get_title()
    assert _hlines(live.axes[1]) == _hlines(stored.axes[1])


@pytest.mark.parametrize("doc, words", [
    ({"variant": "cpu", "model": "v3", "config_style": None, "dtype": "float32"}, "vllm@v0.32.0 cpu v3 float32"),
    ({"variant": "cpu", "model": "v3", "config_style": "transformers", "dtype": "bfloat16",
      "parallel": {"tp": 2, "ep": False}}, "vllm@v0.32.0 cpu v3 transformers bfloat16 tp2"),
    ({"variant": "cpu", "model": "v3", "config_style": "", "dtype": "float16", "parallel": {"tp": 2, "ep": True},
      "unpatched": True}, "vllm@v0.32.0 cpu v3 float16 tp2-ep unpatched"),
    ({"variant": "pytorch", "model": "v2", "dtype": "bfloat16", "provenance": {"prompt_seed": 2}},
     "vllm@v0.32.0 pytorch v2 bfloat16 seed2"),
])
def test_titles_name_the_configuration_single_spaced(doc, words):
    from patcher.rules.plots import title_of

    assert title_of(PIN, doc) == words
    assert title_of(PIN, doc, rescored=True) == words + " (rescored)"


def _perf_report(tp: int = 2) -> dict:
    ratio = {"estimate": 1.0, "lo": 0.9, "hi": 1.02}
    side = {"output_throughput": 10.0, "ttft_mean": 5.0, "tpot_mean": 1.0, "e2el_p50": 9.0, "e2el_p99": 12.0}
    points = [{"concurrency": c, "sides": {"patched": side, "unpatched": side},
               "per_round": {"patched": [side], "unpatched": [side]},
               "ratios": {"output_throughput": ratio, "ttft_mean": ratio, "tpot_mean": {**ratio, "hi": 1.2}}}
              for c in (1, 4)]
    return {"pin": PIN, "variant": "cpu", "model": "v3", "config_style": None, "dtype": "float32",
            "parallel": {"tp": tp, "ep": False}, "sides": ["patched", "unpatched"], "points": points,
            "threshold": 0.95, "verdict": "pass", "mode": "patched-vs-unpatched"}


def test_the_perf_plot_names_tp_and_the_gated_ratio_closest_to_its_threshold():
    from patcher.rules.plots import perf_figure

    fig = perf_figure(_perf_report())
    title = fig._suptitle.get_text()
    assert "  " not in title and title.startswith(f"dsadapt perf {PIN} cpu v3 float32 tp2, patched vs unpatched")
    c = fig.axes[2]
    assert 0.95 in _hlines(c)
    assert "upper end 1.020 = 1.07x the threshold" in c.get_title()


def test_the_heat_map_prints_each_cell_s_distance_to_its_limit_from_a_stored_report():
    from patcher.rules.plots import bisect_figure

    def point(layer, name, error, limit, status="ok"):
        return {"layer": layer, "point": name, "label": name, "family": "x", "module": name, "engine_module": None,
                "metric": "rel_l2", "error": error, "limit": limit, "status": status}

    points = [point(None, "embed", 1e-7, 1e-5), point(0, "attn_core", 3e-5, 1e-5, "above"),
              point(0, "layer_out", 5e-6, 1e-5), point(None, "logits", 2e-5, 1e-5, "above")]
    doc = {"engine": "vllm", "dtype": "float32", "rule": "strict", "points": points, "first": points[1], "layers": 1,
           "passed": False, "reasons": ["x"], "explanation": [], "thresholds": {}}
    fig = bisect_figure(doc, title=f"{PIN}  cpu v3 float32")
    ax = fig.axes[0]
    cells = {t.get_text() for t in ax.texts}
    assert {"0.01", "3", "0.5", "2"} <= cells, cells
    assert "  " not in ax.get_title() and "first divergence at layer 0 attn_core" in ax.get_title()

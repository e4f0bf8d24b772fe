"""The speed gate's calibration tools (tools/plant_decode_work.py, tools/speed_calibration.py): the
planted decode work is exactly a no-op on the numbers and a fixed number of device products per
layer and step, and the summary counts A/A coverage, planted detections and the smallest slowdown
detected the way docs/speed.md describes. The real runs: tools/calibrate_speed.sh (CPU) and
tools/device/perf_h200.sh (GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

from patcher.rules import speed as P

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ENGINE_FILE = textwrap.dedent('''\
    import math
    from typing import (
        Any,
        Optional,
    )

    import torch
    from torch import nn


    class DeepseekV2MLP(nn.Module):
        def forward(self, x):
            return x


    class DeepseekV2DecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()

        def forward(
            self,
            positions: torch.Tensor,
            hidden_states: torch.Tensor,
            residual: Optional[torch.Tensor] = None,
        ) -> torch.Tensor:
            return hidden_states * 2
    ''')


def test_the_plant_is_a_fixed_number_of_products_per_layer_and_step_and_changes_no_number(monkeypatch):
    torch = pytest.importorskip("torch")
    plant = _tool("plant_decode_work").plant
    text = plant(ENGINE_FILE)
    with pytest.raises(ValueError, match="already planted"):
        plant(text)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(a.shape) or real_mm(a, b))
    for n, expected in ((0, 0), (7, 7)):
        monkeypatch.setenv("DSADAPT_PLANTED_MATMULS", str(n))
        ns: dict = {}
        exec(compile(text, "deepseek_v2.py", "exec"), ns)  # the knob is read when the module is imported
        layer = ns["DeepseekV2DecoderLayer"]()
        h = torch.randn(5, 16)
        calls.clear()
        for batch in (h, torch.randn(40, 16)):  # the same work whatever the batch
            before = len(calls)
            out = layer(torch.arange(batch.shape[0]), batch)
            assert torch.equal(out, batch * 2)  # exactly unchanged
            assert len(calls) - before == expected
        assert all(tuple(s) == (64, 64) for s in calls)


def test_a_planted_table_sets_the_products_by_the_steps_token_count(monkeypatch):
    """"1:10,16:40": 10 products for a step of one token, 40 for 16, straight lines between and the
    nearest end outside (a 40-token prefill pays as a 16-sequence step); a tensor of (1, tokens,
    hidden), as LMDeploy passes it, counts its tokens the same way."""
    torch = pytest.importorskip("torch")
    text = _tool("plant_decode_work").plant(ENGINE_FILE)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(1) or real_mm(a, b))
    monkeypatch.setenv("DSADAPT_PLANTED_MATMULS", "16:40,1:10")  # any order
    ns: dict = {}
    exec(compile(text, "deepseek_v2.py", "exec"), ns)
    layer = ns["DeepseekV2DecoderLayer"]()
    for shape, expected in (((1, 16), 10), ((2, 16), 12), ((8, 16), 24), ((16, 16), 40), ((40, 16), 40),
                            ((1, 8, 16), 24)):
        calls.clear()
        h = torch.randn(*shape)
        assert torch.equal(layer(None, h), h * 2)
        assert len(calls) == expected, shape


def test_the_plant_refuses_a_file_without_the_decoder_layer():
    plant = _tool("plant_decode_work").plant
    with pytest.raises(ValueError, match="no class DeepseekV2DecoderLayer"):
        plant("import torch\n\nclass Other:\n    pass\n")


def _report(mode: str, ratio: float, rounds: int = 6, seed: int = 0, planted: int = 0) -> dict:
    """A perf report of `rounds` rounds at concurrency 1 and 4 whose patched side is `ratio` times as fast."""
    import random

    rng = random.Random(seed)
    sides = ("patched", "patched-2") if mode == "aa" else ("patched", "unpatched")
    runs = []
    order = 0
    for rnd in range(rounds):
        for c in (1, 4):
            for s in (sides if rnd % 2 == 0 else sides[::-1]):
                noise = 1 + rng.gauss(0, 0.01)
                lat = 1.0 * noise / (ratio if s == sides[0] else 1.0)
                runs.append(P.RunRecord(s, rnd, c, lat, [P.RequestRecord("m", 8, 11, 0.1 * lat, lat)] * 4, order))
                order += 1
    points = P.build_points(runs, (1, 4), sides)
    verdict, reasons = P.decide(points, 0.95, sides)
    return {"schema": P.SCHEMA, "mode": "aa" if mode == "aa" else "patched-vs-unpatched", "sides": list(sides),
            "threshold": 0.95, "verdict": verdict, "points": [p.to_json() for p in points],
            "runs": [r.to_json() for r in runs],
            "provenance": {"date": f"2026-12-01T00:00:{seed:02d}Z", "load_average_before": [0.5, 0.5, 0.5],
                           "load_average_after": [0.6, 0.5, 0.5], "cpus": [0, 1],
                           **({"planted": {"matmuls": planted}} if planted else {})}}


def test_the_summary_counts_coverage_detections_and_the_smallest_slowdown(tmp_path):
    cal = _tool("speed_calibration")
    for i in range(4):
        (tmp_path / f"aa-{i}.json").write_text(json.dumps(_report("aa", 1.0, seed=i)))
        (tmp_path / f"planted-{i}.json").write_text(json.dumps(_report("ab", 0.85, seed=10 + i, planted=40)))
    (tmp_path / "not-a-report.json").write_text("{}")
    text, data = cal.summarize(cal.load([tmp_path]))
    assert data["aa"]["runs"] == 4 and data["aa"]["all_contain_one"] == 4
    assert data["planted"] == {"runs": 4, "failed": 4, "slowdown": data["planted"]["slowdown"],
                               "flagged": data["planted"]["flagged"]}
    assert data["planted"]["flagged"]["1"]["runs"] == 4 and data["planted"]["flagged"]["4"]["runs"] == 4
    assert data["aa"]["per_level"]["1"]["all_contain_one"] == 4
    assert data["planted"]["slowdown"]["1"]["output_throughput"] == pytest.approx(0.15, abs=0.02)
    small = data["smallest_detected"]["1"]
    assert 0.05 < min(small.values()) < 0.1  # threshold 0.95 and a few % of noise: 6-8 %
    assert "**4 of 4** A/A runs" in text and "**4 of 4** planted runs" in text
    assert "- concurrency 4: flagged in **4 of 4** planted runs" in text


def _sizing_report(tpot: dict[int, float], ratio: dict[int, float]) -> dict:
    """A report with, per level, the first side's TPOT (ms) and the TPOT ratio's estimate."""
    return {"sides": ["patched", "unpatched"],
            "points": [{"concurrency": c, "sides": {"patched": {"tpot_mean": tpot[c]}},
                        "ratios": {"tpot_mean": {"estimate": ratio[c]}}} for c in tpot]}


def test_the_plant_is_sized_per_level_from_tpot_and_a_products_cost_or_from_a_sizing_run():
    """GPU: n = TPOT x (1/(1-t) - 1) / (layers x product cost) at each level (10 ms, 10 %, 4 layers,
    2 us: 139 products at c=1; a 16 ms step at 16: 222). CPU: a sizing run of 32 products that
    slowed TPOT to 0.8 at c=1 (25 % more per step) and 0.9 at 4 gives 32 x 0.111/0.25 = 14 and
    32 x 0.111/0.111 = 32. One level: a plain number, as the knob's older form."""
    cal = _tool("speed_calibration")
    d = _sizing_report({1: 10.0, 16: 16.0}, {1: 1.0, 16: 1.0})
    assert cal.plant_for(d, 0.10, product_us=2.0, layers=4) == "1:139,16:222"
    d = _sizing_report({4: 1.0, 1: 1.0}, {1: 0.8, 4: 0.9})
    assert cal.plant_for(d, 0.10, sizing_matmuls=32) == "1:14,4:32"
    assert cal.plant_for(_sizing_report({1: 1.0}, {1: 0.8}), 0.10, sizing_matmuls=32) == "14"
    with pytest.raises(ValueError, match="did not slow TPOT"):
        cal.plant_for(_sizing_report({1: 1.0}, {1: 1.02}), 0.10, sizing_matmuls=32)


def test_the_size_command_prints_the_table_and_fails_in_one_line(tmp_path, capsys):
    cal = _tool("speed_calibration")
    f = tmp_path / "sizing.json"
    f.write_text(json.dumps(_sizing_report({1: 1.0, 16: 1.0}, {1: 0.8, 16: 0.9})))
    assert cal.main(["size", str(f), "--sizing-matmuls", "32", "--target", "0.1"]) == 0
    assert capsys.readouterr().out.strip() == "1:14,16:32"
    f.write_text("{}")
    assert cal.main(["size", str(f), "--sizing-matmuls", "32"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot size the plant")

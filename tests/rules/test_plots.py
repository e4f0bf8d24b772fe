"""plot_deltas writes a PNG with one line per prompt."""

from __future__ import annotations

import copy

import pytest
from equivalence_helpers import greedy_case, prompt_doc, report

from patcher.rules.logits import compare


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from patcher.rules.plots import plot_deltas

    ids, rows, gen = greedy_case(0)
    ref = prompt_doc("a", ids, rows, gen, 20)
    eng = copy.deepcopy(prompt_doc("a", ids, rows, gen, 5))
    eng["prompt_logprobs"][3]["logprob"] += 0.5
    c = compare(report([ref]), report([eng], k=5))
    out = plot_deltas(c, tmp_path / "d.png", original_max=3)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000

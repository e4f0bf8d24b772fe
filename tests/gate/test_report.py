"""`dsadapt report` tells the truth: per pin and current stack, the newest verdict per
configuration (variant, model, config style, dtype, parallel config) and the worst of them; a
quick speed-gate run never stands in for the calibrated one; a verdict another rule gave is
flagged, and `check --rescore` applies the current rule to a report's recorded inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import load_stack
from patcher.rules.logits import LogitReport, PositionLogprobs, PromptResult, compare
from patcher.rules.speed import DEFAULT_ROUNDS

PIN = "vllm@v0.32.0"
HASH = load_stack(REPO_ROOT / "patches", PinRef("vllm", "v0.32.0")).hash


class Proj:
    def __init__(self, root: Path, work: Path):
        self.root, self.work = root, work

    @property
    def reports(self) -> Path:
        return self.root / "reports" / "vllm" / "v0.32.0"

    def run(self, *args: str):
        import contextlib
        import io
        import os
        from unittest import mock

        from patcher.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        env = {"DSADAPT_PROJECT": str(self.root), "DSADAPT_WORKDIR": str(self.work)}
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
        return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def proj(tmp_path) -> Proj:
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    return Proj(root, tmp_path / "work")


def logit_pair(delta: float, dtype: str = "float32") -> tuple[LogitReport, LogitReport]:
    """A reference and an engine report of one prompt whose engine logprobs are off by `delta`."""
    def pos(token: int, shift: float) -> PositionLogprobs:
        top = {t: -1.0 - t + shift for t in range(20)}
        return PositionLogprobs(token, top[token], top)

    def side(d: str, shift: float, k: int) -> LogitReport:
        p = PromptResult("p1", None, [0, 0, 0], [None, pos(0, shift), pos(0, shift)], [0], [pos(0, shift)])
        return LogitReport("r", "e", "1", d, k, 1, [p])

    return side("float32", 0.0, 20), side(dtype, delta, 5)


def write_check(proj: Proj, name: str, *, model: str, dtype: str, verdict: str, date: str,
                stack_hash: str = HASH, style: str = "transformers", inputs: tuple | None = None,
                comparison: dict | None = None, device: str = "CPU x (2 cores)",
                patches: list[str] | None = None) -> Path:
    path = proj.reports / name
    path.parent.mkdir(parents=True, exist_ok=True)
    from patcher.gate.equivalence import current_rule

    comp = comparison or {**current_rule(dtype), "rows": []}
    doc = {"schema": "dsadapt.check-report/1", "pin": PIN, "engine": "vllm", "variant": "cpu", "model": model,
           "config_style": style, "dtype": dtype, "unpatched": False, "verdict": verdict, "reasons": [],
           "explanation": [], "report_path": str(path), "plot_path": None, "timings": {}, "comparison": comp,
           "bisect": None,
           "provenance": {"date": date, "device": device, "stack_hash": stack_hash,
                          "command": f"dsadapt check {PIN} --model {model} --dtype {dtype}"}}
    if patches is not None:
        doc["provenance"]["patches"] = patches
    if inputs is not None:
        from patcher.gate.equivalence import save_inputs

        ref, eng = inputs
        save_inputs(path, ref, eng, 5)
        doc["comparison"] = compare(ref, eng, 5).to_json()
    path.write_text(json.dumps(doc))
    return path


def rows(proj: Proj) -> dict:
    rc, out, err = proj.run("report", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "dsadapt.report/1"
    return {r["pin"]: r for r in doc["pins"]}


def test_a_failure_of_the_current_stack_is_never_hidden_by_a_newer_pass_of_another_config(proj):
    write_check(proj, "v2-transformers-float16.json", model="v2", dtype="float16", verdict="fail",
                date="2026-12-01T10:00:00Z")
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                date="2026-12-01T11:00:00Z")
    r = rows(proj)[PIN]
    assert r["verdict"] == "fail" and r["check"].startswith("fail 2026-12-01T10:00:00Z")
    assert "; newest check 2026-12-01T11:00:00Z" in r["check"]
    assert "1 of 2 configs fail: cpu v2 transformers float16" in r["check"]
    assert [(c["config"], c["verdict"]) for c in r["checks"]] == [("cpu v2 transformers float16", "fail"),
                                                                 ("cpu v3 transformers float32", "pass")]
    # the same configuration checked again and passing: its newest verdict replaces the failure
    write_check(proj, "v2-transformers-float16-again.json", model="v2", dtype="float16", verdict="pass",
                date="2026-12-02T09:00:00Z")
    r = rows(proj)[PIN]
    # (its float16 report carries no yardstick, which today's rule needs: it is flagged, never hidden)
    assert r["verdict"] == "pass" and "; 2 configs pass; 1 scored by an older rule" in r["check"]
    # a newer failure of another stack (a planted bug) is not this stack's
    write_check(proj, "planted.json", model="v3", dtype="float32", verdict="fail", date="2026-12-03T00:00:00Z",
                stack_hash="planted")
    assert rows(proj)[PIN]["verdict"] == "pass"
    # the table says it too, on stdout, one line per configuration
    rc, out, err = proj.run("report")
    assert rc == 0 and "cpu v2 transformers float16" in out and "newest verdict per configuration" in out


def _perf(proj: Proj, name: str, verdict: str, date: str, rounds: int) -> None:
    proj.reports.mkdir(parents=True, exist_ok=True)
    mixes = [{"name": n, "input_len": 16, "output_len": 16, "requests": 11} for n in ("short", "medium", "long")]
    doc = {"schema": "dsadapt.perf-report/1", "pin": PIN, "variant": "cpu", "model": "v3", "config_style": "deepseek",
           "dtype": "float32", "verdict": verdict, "mode": "patched-vs-unpatched", "threshold": 0.95,
           "workload": {"concurrency": [1, 4, 16], "mixes": mixes, "requests_per_run": 64, "rounds": rounds,
                        "warmup_rounds": 1, "max_model_len": 256},
           "provenance": {"date": date, "device": "CPU x (2 cores)", "stack_hash": HASH}}
    (proj.reports / name).write_text(json.dumps(doc))


def test_a_quick_perf_run_never_replaces_the_calibrated_one_silently(proj):
    _perf(proj, "perf-v3-deepseek-float32.json", "pass", "2026-11-30T10:00:00Z", rounds=DEFAULT_ROUNDS)
    _perf(proj, "perf-quick.json", "fail", "2026-12-01T10:00:00Z", rounds=3)
    r = rows(proj)[PIN]
    assert r["perf"].startswith("pass 2026-11-30T10:00:00Z")
    assert "newer quick run 2026-12-01T10:00:00Z: fail (3 rounds)" in r["perf"]
    assert sorted(c["workload"] for c in r["perfs"]) == ["3 rounds", "calibrated"]
    (proj.reports / "perf-v3-deepseek-float32.json").unlink()
    assert rows(proj)[PIN]["perf"].startswith("fail 2026-12-01T10:00:00Z") and \
        "quick run: 3 rounds; no calibrated run" in rows(proj)[PIN]["perf"]


def test_a_verdict_the_current_rule_would_not_give_is_flagged_and_rescored(proj, monkeypatch):
    """The current rule is applied to the recorded inputs (a changed rule is seen because the rule
    itself is called: here its tolerance is widened); `check --rescore` rewrites the report."""
    import patcher.rules.logits as logits

    path = write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="fail",
                       date="2026-12-01T10:00:00Z", inputs=logit_pair(1e-3))
    assert (proj.reports / "v3-transformers-float32.inputs.json.gz").is_file()
    assert rows(proj)[PIN]["stale"] == 0
    monkeypatch.setitem(logits.STRICT_TOLERANCE, "float32", 1e-2)
    r = rows(proj)[PIN]
    assert r["stale"] == 1 and "the current rule says pass" in r["checks"][0]["stale"]
    assert "1 scored by an older rule" in r["check"]
    rc, out, err = proj.run("check", "--rescore", str(path))
    assert rc == 0, err
    assert "verdict: PASS" in out
    doc = json.loads(path.read_text())
    assert doc["verdict"] == "pass" and doc["provenance"]["rescored"]["previous_verdict"] == "fail"
    assert doc["comparison"]["tolerance"] == 1e-2 and rows(proj)[PIN]["stale"] == 0
    # rescoring again under a stricter rule fails it again (exit 1: a verdict)
    monkeypatch.setitem(logits.STRICT_TOLERANCE, "float32", 1e-4)
    rc, out, err = proj.run("check", "--rescore", str(path), "--json")
    assert rc == 1 and json.loads(out)["verdict"] == "fail"


def test_rescoring_a_tp_2_report_redraws_its_plot_with_tp2_and_the_yarn_marker(proj, monkeypatch):
    """The rescored plot names the configuration as the check did (tp2, "(rescored)") and keeps
    YaRN's original context (stored in the report: the model's folder may be on another machine)."""
    import patcher.rules.plots as plots

    path = write_check(proj, "v3-transformers-float32-tp2.json", model="v3", dtype="float32", verdict="pass",
                       date="2026-12-01T10:00:00Z", inputs=logit_pair(1e-6))
    doc = json.loads(path.read_text())
    doc["parallel"] = {"tp": 2, "ep": False, "world_size": 2, "label": "tp2"}
    doc["provenance"].update(original_max_position_embeddings=64, model_dir="/elsewhere/v3")
    path.write_text(json.dumps(doc))
    drawn = []
    real = plots.plot_deltas

    def spy(comparison, out, title=None, original_max=None):
        drawn.append((title, original_max))
        return real(comparison, out, title=title, original_max=original_max)

    monkeypatch.setattr(plots, "plot_deltas", spy)
    rc, out, err = proj.run("check", "--rescore", str(path))
    assert rc == 0, err
    assert drawn == [(f"{PIN} cpu v3 transformers float32 tp2 (rescored)", 64)]
    assert json.loads(path.read_text())["plot_path"] == str(path.with_suffix(".png")) and path.with_suffix(".png").is_file()
    # a report of a built-in model that predates the stored value: the built-in model's own config says it
    del doc["provenance"]["original_max_position_embeddings"]
    path.write_text(json.dumps(doc))
    drawn.clear()
    assert proj.run("check", "--rescore", str(path))[0] == 0
    from patcher.checkpoints.tiny import deepseek_config
    from patcher.rules.prompts import rope_original_max

    assert drawn[0][1] == rope_original_max(deepseek_config("v3")) and drawn[0][1] is not None


def test_a_report_without_inputs_is_flagged_when_its_rule_parameters_changed(proj, monkeypatch):
    import patcher.rules.logits as logits

    path = write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                       date="2026-12-01T10:00:00Z")
    assert rows(proj)[PIN]["stale"] == 0  # scored with today's tolerance: nothing to say
    monkeypatch.setitem(logits.STRICT_TOLERANCE, "float32", 1e-5)
    stale = rows(proj)[PIN]["checks"][0]["stale"]
    assert "scored by an older rule (tolerance differ)" in stale and "rerun `dsadapt check" in stale
    rc, out, err = proj.run("check", "--rescore", str(path))
    assert rc == 2 and "has no recorded inputs" in err and "hint: rerun `dsadapt check" in err
    assert json.loads(path.read_text())["verdict"] == "pass"  # nothing changed on disk


@pytest.mark.parametrize("content,words", [("{", "not a readable JSON report"),
                                           ('{"schema": "dsadapt.perf-report/1"}', "not a check report")])
def test_rescore_refuses_what_is_not_a_check_report(proj, tmp_path, content, words):
    f = tmp_path / "x.json"
    f.write_text(content)
    rc, out, err = proj.run("check", "--rescore", str(f))
    assert rc == 2 and words in err
    rc, out, err = proj.run("check", "--rescore", str(f), PIN)
    assert rc == 2 and "not both" in err


def test_committed_reports_are_scored_by_the_current_rule_or_flagged():
    """The committed reports: the float32 ones were scored with today's strict rule; the LMDeploy
    low-precision ones (the H200 calibration run) and the FP8 ones were judged by today's
    noise-relative rule, whose evidence they keep, so re-judging them gives their verdicts again."""
    from patcher.gate.equivalence import rule_drift

    drift = {}
    for f in sorted((REPO_ROOT / "reports").rglob("*.json")):
        doc = json.loads(f.read_text())
        if doc.get("schema") == "dsadapt.check-report/1" and not doc.get("unpatched"):
            drift[str(f.relative_to(REPO_ROOT))] = rule_drift(doc, f)
    strict = {k: v for k, v in drift.items() if k.endswith("float32.json")}
    assert strict and all(v is None for v in strict.values()), strict
    low = {k: v for k, v in drift.items() if k.startswith("reports/lmdeploy/v0.18.0/")}
    assert len(low) >= 8 and all(v is None for v in low.values()), low


def test_a_parallel_configuration_is_named_by_its_size(proj):
    """Check reports state their parallel configuration as a mapping; the report names it tpN
    (nothing for one process) and keeps TP 1 and TP 2 apart."""
    for name, par, verdict in (("v3-transformers-float32.json", {"tp": 1, "ep": False, "label": "tp1"}, "pass"),
                               ("v3-transformers-float32-tp2.json", {"tp": 2, "ep": False, "label": "tp2"}, "fail")):
        path = write_check(proj, name, model="v3", dtype="float32", verdict=verdict, date="2026-12-01T10:00:00Z")
        doc = json.loads(path.read_text())
        doc["parallel"] = par
        path.write_text(json.dumps(doc))
    r = rows(proj)[PIN]
    assert sorted(c["config"] for c in r["checks"]) == ["cpu v3 transformers float32",
                                                         "cpu v3 transformers float32 tp2"]
    assert r["verdict"] == "fail" and "{" not in r["check"]


def _table_rows(out: str, pin: str) -> list[str]:
    """The lines of the first table's row of `pin` (its continuation lines too)."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(pin + " "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1].strip()), len(lines))
    return lines[start:end]


def test_the_table_dates_a_pin_by_its_newest_check_and_names_the_machines(proj, monkeypatch):
    write_check(proj, "v2-transformers-float16.json", model="v2", dtype="float16", verdict="pass",
                date="2026-11-20T10:00:00Z", device="GPU NVIDIA H200")
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                date="2026-12-01T11:00:00Z")
    r = rows(proj)[PIN]
    assert r["current"] and sorted(r["machines"]) == ["CPU", "H200"], r
    assert r["newest"] == "2026-12-01T11:00:00Z" and {c["machine"] for c in r["checks"]} == {"CPU", "H200"}
    monkeypatch.setenv("COLUMNS", "300")  # the cell on one line
    rc, out, _ = proj.run("report")
    cell = " ".join(_table_rows(out, PIN))
    # the stale v2 float16 report (no yardstick) sorts first, but the row is dated by the newest check
    assert rc == 0 and "2026-12-01 (CPU, H200)" in cell.replace("(H200, CPU)", "(CPU, H200)"), out
    assert "2026-11-20" not in cell, out
    # names are never cut inside a word (the table's wrapping: tests/cli/test_output.py)
    monkeypatch.setenv("COLUMNS", "100")
    rc, out, _ = proj.run("report")
    assert "v3-transformers-" in out and "float32.json" in out and "transformers" in out, out


def test_a_planted_copy_of_the_stack_never_stands_for_the_pin(proj):
    """With no check of today's stack, an earlier version of it (its patches a subset of today's)
    speaks, "stack changed since"; a copy with a patch more (a planted bug) never does."""
    names = [e.name for e in load_stack(REPO_ROOT / "patches", PinRef("vllm", "v0.32.0")).entries]
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                date="2026-11-01T00:00:00Z", stack_hash="older", patches=names[:1])
    write_check(proj, "planted/v3-transformers-float32.json", model="v3", dtype="float32", verdict="fail",
                date="2026-12-01T00:00:00Z", stack_hash="planted", patches=[*names, "0003-planted-bug.patch"])
    r = rows(proj)[PIN]
    assert r["verdict"] == "pass" and "stack changed since" in r["check"] and not r["current"], r
    assert [c["file"].endswith("/v0.32.0/v3-transformers-float32.json") for c in r["checks"]] == [True]


def test_the_configuration_table_marks_a_verdict_of_an_earlier_stack(proj, monkeypatch):
    """Where the current stack has no verdict yet, the per-configuration table shows its earlier
    version's, and says so on the row, beside one of the current stack."""
    names = [e.name for e in load_stack(REPO_ROOT / "patches", PinRef("vllm", "v0.32.0")).entries]
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                date="2026-11-01T00:00:00Z", stack_hash="older", patches=names[:1])
    monkeypatch.setenv("COLUMNS", "300")
    rc, out, _ = proj.run("report")
    row = next(ln for ln in out.splitlines() if "v3-transformers-float32.json" in ln)
    assert rc == 0 and "check: pass (earlier stack)" in row, out
    assert "of the current stack (of an earlier version where it has none)" in out, out
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                date="2026-12-01T00:00:00Z")
    rc, out, _ = proj.run("report")
    row = next(ln for ln in out.splitlines() if "v3-transformers-float32.json" in ln)
    assert rc == 0 and "check: pass" in row and "earlier stack" not in out, out


def test_a_second_report_read_from_its_memo_says_exactly_what_the_first_did(proj):
    """`report` remembers each unchanged report's verdict in the work dir's cache: the second run,
    read from that memory (JSON: the verdict's tuples stored as lists), gives the same rows, the
    stack versions told apart by their patch names as before; a changed report is read again."""
    names = [e.name for e in load_stack(REPO_ROOT / "patches", PinRef("vllm", "v0.32.0")).entries]
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="pass",
                date="2026-11-01T00:00:00Z", stack_hash="older", patches=names[:1])
    planted = write_check(proj, "planted/v3-transformers-float32.json", model="v3", dtype="float32",
                          verdict="fail", date="2026-12-01T00:00:00Z", stack_hash="planted",
                          patches=[*names, "0003-planted-bug.patch"])
    first = rows(proj)
    memo = json.loads((proj.work / "cache" / "report-rejudged.json").read_text())
    assert str(planted) in memo["verdicts"]["check"]
    assert rows(proj) == first
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="fail",
                date="2026-12-02T00:00:00Z", patches=names)
    assert rows(proj)[PIN]["verdict"] == "fail"


def test_a_damaged_memo_entry_is_read_again_never_an_error(proj):
    """A memo entry whose fields are not a verdict's (a damaged cache) is a miss: the report is
    parsed again and says the same."""
    write_check(proj, "v3-transformers-float32.json", model="v3", dtype="float32", verdict="fail",
                date="2026-11-01T00:00:00Z")
    first = rows(proj)
    cache = proj.work / "cache" / "report-rejudged.json"
    doc = json.loads(cache.read_text())
    for entry in doc["verdicts"]["check"].values():
        entry[1] = {**entry[1], "no_such_field": 1, "verdict": "pass"}
    cache.write_text(json.dumps(doc))
    assert rows(proj) == first

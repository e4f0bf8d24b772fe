"""`dsadapt perf` from the command line without a real engine: argument errors, pins that
cannot run here, the whole pipeline with the fake engine of tests/perf_fake.py standing in
for vLLM (report JSON + PNG, exit codes, the failing-server verdicts), and `dsadapt report`
/ the CI matrix picking the speed gate up.

The project is a copy of this repository's upstream.lock and patches/; the engine's recipe
and environments are replaced (the adapter's perf_recipe through conftest.swap_engine, and
hosts.RunHost.environment), so nothing here installs or starts vLLM.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest
from conftest import REPO_ROOT, swap_engine

from patcher.engines.base import has_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import perf_fake  # noqa: E402

PIN = "vllm@v0.32.0"
needs_cpu_only = pytest.mark.skipif(has_cuda(), reason="asserts what happens on a machine without a CUDA GPU")
FAST = (0.01, 0.002)
SMALL = ("--concurrency", "2", "--rounds", "5", "--requests", "4", "--warmup", "0")


class Proj:
    def __init__(self, root: Path, work: Path):
        self.root = root
        self.work = work
        self.env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(work), "DSADAPT_SOURCES": "pypi",
                    "DSADAPT_MIRRORS": "", "DSADAPT_LOCK_TIMEOUT": "5"}

    def run(self, *args: str) -> tuple[int, str, str]:
        from patcher.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.dict(os.environ, self.env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
        return rc, out.getvalue(), " ".join(err.getvalue().split())

    def report(self, name: str = "perf-mymodel-deepseek-float32") -> Path:
        """Where a run writes its report: the work dir's scratch reports (`--publish`: the project's)."""
        return self.work / "reports" / "vllm" / "v0.32.0" / f"{name}.json"


@pytest.fixture
def proj(tmp_path) -> Proj:
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    return Proj(root, tmp_path / "work")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    from checkpoint_support import tiny_model

    return tiny_model(tmp_path / "mymodel")


@pytest.fixture
def fake_engine(monkeypatch):
    """vLLM's perf recipe and environments replaced by the fake engine; returns the speeds dict."""
    from patcher.engines.base import EngineEnv
    from patcher.gate.hosts import RunHost

    speeds = {"A": FAST, "B": FAST}
    asked = []

    def environment(self, plan, *, unpatched=False):
        asked.append((str(plan.pin), plan.variant, unpatched))
        key = "B" if unpatched else "A"
        return EngineEnv(Path(key), Path(f"/fake/{key}"), f"{key}.whl", key * 8)

    monkeypatch.setattr(RunHost, "environment", environment)
    swap_engine(monkeypatch, "vllm", perf_recipe=lambda self, entry, spec: perf_fake.FakeRecipe(speeds))
    speeds["asked"] = asked  # type: ignore[assignment]
    return speeds


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("args, words", [
    (("--concurrency", "1,x"), "--concurrency '1,x': 'x' is not a positive integer"),
    (("--concurrency", "4,4"), "repeated"),
    (("--rounds", "1"), "at least 2 rounds"),
    (("--input-len", "300", "--output-len", "16"), "exceed --max-model-len 256"),
    (("--threshold", "1.5"), "--threshold 1.5 must be in (0, 1]"),
    (("--cpus", "0,abc"), "is not a CPU list"),
    (("--cpus", "4096"), "CPU 4096 is not available here"),
    (("--dtype", "float64"), "float64"),
])
@needs_cpu_only
def test_bad_options_are_usage_errors(proj, model_dir, args, words):
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *args)
    assert rc == 2, err
    assert words in err and "Traceback" not in err
    assert not (proj.root / "reports").exists() and not proj.work.exists()  # nothing made


def test_unknown_pin_is_a_usage_error(proj):
    rc, out, err = proj.run("perf", "vllm@v9.9.9")
    assert rc == 2 and "vllm@v9.9.9" in err


@needs_cpu_only
def test_a_cuda_only_pin_cannot_run_here(proj):
    rc, out, err = proj.run("perf", "vllm@v0.3.3")
    assert rc == 6, err
    assert "needs a CUDA GPU" in err and "dsadapt perf vllm@v0.3.3" in err


@needs_cpu_only
def test_an_engine_without_a_recipe_cannot_run(proj, model_dir, monkeypatch):
    swap_engine(monkeypatch, "vllm", perf_recipe=lambda self, entry, spec: None)
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), "--json")
    assert rc == 6 and "no recipe for vllm" in json.loads(out)["error"]["message"]
    assert not proj.work.exists()


# ---------------------------------------------------------------- the pipeline with the fake engine


@needs_cpu_only
def test_equal_builds_pass_and_write_the_report_and_plot(proj, model_dir, fake_engine):
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *SMALL, "--json")
    doc = json.loads(out)
    rep = json.loads(proj.report().read_text())
    assert rep["schema"] == "dsadapt.perf-report/1"
    assert doc["report_path"] == str(proj.report()) and "runs" not in doc and len(rep["runs"]) == 2 * 5
    assert [p["concurrency"] for p in rep["points"]] == [2]
    assert rep["sides"] == ["patched", "unpatched"] and rep["mode"] == "patched-vs-unpatched"
    assert rep["provenance"]["installed"]["unpatched"]["venv"] == "/fake/B"
    # both environments come from the orchestration's RunHost, the unpatched one as the pristine wheel
    assert fake_engine["asked"] == [(PIN, "cpu", False), (PIN, "cpu", True)]
    assert not (proj.root / "reports").exists()  # scratch by default: the committed reports/ untouched
    assert rep["provenance"]["tool"] == "fake load generator"
    assert rep["provenance"]["original_max_position_embeddings"] == 64
    assert rep["workload"]["mixes"][2]["input_len"] == 64 + 48  # the default mix past YaRN's original context
    assert Path(rep["plot_path"]).is_file() and Path(rep["plot_path"]).stat().st_size > 10_000
    # equal builds: the verdict follows the rule (no hard-coded pass): every gated CI upper end >= 0.95
    his = [p["ratios"][k]["hi"] for p in rep["points"] for k in ("output_throughput", "ttft_mean", "tpot_mean")]
    assert (rc == 0) == (min(his) >= 0.95) == (rep["verdict"] == "pass")


@needs_cpu_only
def test_a_slower_patched_build_fails_with_exit_1(proj, model_dir, fake_engine):
    fake_engine["A"] = (0.04, 0.008)
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *SMALL)
    assert rc == 1, err
    assert "verdict: FAIL" in out and "failed the speed gate" in err
    assert "TPOT mean patched/unpatched" in out + err  # the verdict line says it (stdout), the error too
    rep = json.loads(proj.report().read_text())
    assert rep["verdict"] == "fail" and rep["reasons"]


@needs_cpu_only
def test_a_patched_build_that_cannot_serve_is_a_fail_verdict(proj, model_dir, fake_engine):
    fake_engine["A"] = "fail"
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *SMALL)
    assert rc == 1, err
    rep = json.loads(proj.report().read_text())
    assert rep["verdict"] == "fail" and rep["points"] == [] and rep["plot_path"] is None
    assert "ValueError: fake engine cannot load this model" in rep["reasons"][0]
    assert Path(rep["provenance"]["server_log"]).is_file()


@needs_cpu_only
def test_an_unpatched_build_that_cannot_serve_leaves_nothing_to_compare(proj, model_dir, fake_engine):
    fake_engine["B"] = "fail"
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *SMALL)
    assert rc == 6, err
    assert "the unpatched vllm@v0.32.0 cannot serve model mymodel" in err
    assert "--config-style deepseek" in err
    assert not proj.report().exists()


@needs_cpu_only
def test_aa_runs_the_patched_build_against_itself(proj, model_dir, fake_engine):
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *SMALL, "--aa", "--publish")
    published = proj.root / "reports" / "vllm" / "v0.32.0" / "perf-aa-mymodel-deepseek-float32.json"
    rep = json.loads(published.read_text())  # --publish: into the project's committed reports/
    assert not proj.report("perf-aa-mymodel-deepseek-float32").exists()
    assert rep["mode"] == "aa" and rep["sides"] == ["patched", "patched-2"]
    assert rep["provenance"]["installed"]["patched"] == rep["provenance"]["installed"]["patched-2"]
    assert set(rep["band"]) >= {"ci_hi_min", "estimate_min", "estimate_max", "margin", "ci_width_max"}


@needs_cpu_only
def test_each_run_is_one_progress_line_and_runs_send_exactly_the_requests_asked(proj, model_dir, fake_engine):
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), "--concurrency", "2", "--rounds", "2",
                            "--requests", "5", "--warmup", "1")
    for label in ("warm-up 1/1", "round 1/2", "round 2/2"):
        for side in ("patched", "unpatched"):
            assert err.count(f"{label}, concurrency 2, {side}") == 1, err
    rep = json.loads(proj.report().read_text())
    assert all(len(r["requests"]) == 5 for r in rep["runs"])
    assert rep["workload"]["requests_per_run"] == 5
    assert rep["provenance"]["went_first"] == {"2": {"patched": 1, "unpatched": 1}}


@needs_cpu_only
def test_requests_per_level_each_level_runs_its_own_number(proj, model_dir, fake_engine):
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), "--concurrency", "1,3", "--rounds", "2",
                            "--requests", "3,6", "--warmup", "0")
    assert rc in (0, 1), err
    rep = json.loads(proj.report().read_text())
    assert {r["concurrency"]: len(r["requests"]) for r in rep["runs"]} == {1: 3, 3: 6}
    assert rep["workload"]["requests_per_level"] == {"1": 3, "3": 6}
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), "--concurrency", "1,3", "--requests", "3,6,9")
    assert rc == 2 and "3 values for 2 concurrency levels" in err


def test_a_server_inherits_no_tuning_variable_of_its_engine_or_of_openmp(monkeypatch):
    """The engine's own prefixes (Engine.env_prefixes) and OpenMP's are dropped from what a server
    inherits; the recipe's settings are what it gets."""
    from patcher.engines.registry import engine
    from patcher.gate.perf import _env

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    monkeypatch.setenv("DSADAPT_KEEP", "1")
    env = _env({"OMP_NUM_THREADS": "1"}, engine("vllm").env_prefixes)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["OMP_NUM_THREADS"] == "1" and env["DSADAPT_KEEP"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" in _env({}, engine("lmdeploy").env_prefixes)  # not LMDeploy's to drop


def test_the_perf_plot_labels_every_panel_and_says_which_way_each_ratio_points(tmp_path, monkeypatch):
    """Every panel has a title and axis labels, every drawn series a legend entry, and each gated
    ratio's entry says which side is divided by which (< 1 always means the first side is slower)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from patcher.rules import speed as P
    from patcher.rules.plots import plot_perf, ratio_label

    runs = [P.RunRecord(s, rnd, c, 1.0 + 0.1 * (s == "patched"),
                        [P.RequestRecord("m", 8, 10, 0.1, 1.0 + 0.05 * rnd)] * 3)
            for rnd in range(4) for c in (1, 4) for s in ("patched", "unpatched")]
    points = P.build_points(runs, (1, 4))
    verdict, reasons = P.decide(points)
    report = {"pin": PIN, "variant": "cpu", "model": "v3", "config_style": "deepseek", "dtype": "float32",
              "mode": "patched-vs-unpatched", "sides": ["patched", "unpatched"], "threshold": 0.95,
              "verdict": verdict, "points": [p.to_json() for p in points]}
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    plot_perf(report, tmp_path / "p.png")
    (fig,) = figs
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() == "concurrency" and ax.get_ylabel()
        handles, labels = ax.get_legend_handles_labels()
        drawn = [a for a in ax.lines + ax.collections if not str(a.get_label()).startswith("_")]
        assert labels and len(labels) == len(handles) >= len(drawn) > 0, (ax.get_title(), labels)
    ratio_labels = fig.axes[2].get_legend_handles_labels()[1]
    assert ratio_label("output_throughput", ("patched", "unpatched")) == "output tokens/s: patched ÷ unpatched"
    assert ratio_label("tpot_mean", ("patched", "unpatched")) == "TPOT mean: unpatched ÷ patched"
    for key in P.GATED:
        assert ratio_label(key, ("patched", "unpatched")) in ratio_labels
    assert "< 1: patched slower" in fig.axes[2].get_ylabel()
    assert any("threshold 0.95" in lab for lab in ratio_labels)


# ---------------------------------------------------------------- report and matrix


def _perf_doc(verdict: str, date: str, mode: str = "patched-vs-unpatched", device: str = "CPU x (2 cores)") -> dict:
    return {"schema": "dsadapt.perf-report/1", "pin": PIN, "verdict": verdict, "mode": mode,
            "provenance": {"date": date, "device": device, "stack_hash": "h"}}


def test_report_shows_the_last_perf_verdict_apart_from_check(tmp_path):
    from patcher.gate.report import check_words, perf_verdict_of, read_verdicts, verdict_of

    root = tmp_path / "reports" / "vllm" / "v0.32.0"
    root.mkdir(parents=True)
    (root / "perf-v3-deepseek-float32.json").write_text(json.dumps(_perf_doc("pass", "2026-11-30T10:00:00Z")))
    (root / "perf-aa-v3-deepseek-float32.json").write_text(json.dumps(_perf_doc("fail", "2026-11-30T11:00:00Z", "aa")))
    assert verdict_of(_perf_doc("pass", "d"), "f") is None  # never a check verdict
    assert read_verdicts(tmp_path / "reports") == {}
    perfs = read_verdicts(tmp_path / "reports", of=perf_verdict_of)
    assert [v.verdict for v in perfs[PIN]] == ["pass"]  # the A/A calibration run is not a verdict
    assert check_words(perfs[PIN], "h", never="never measured")[0] == "pass 2026-11-30T10:00:00Z (CPU x (2 cores))"
    assert check_words([], "h", never="never measured")[0] == "never measured"


def test_report_command_has_a_last_perf_column(proj):
    root = proj.root / "reports" / "vllm" / "v0.32.0"
    root.mkdir(parents=True)
    (root / "perf-v3-deepseek-float32.json").write_text(json.dumps(_perf_doc("fail", "2026-11-30T10:00:00Z")))
    rc, out, err = proj.run("report", "--json")
    assert rc == 0, err
    rows = {r["pin"]: r for r in json.loads(out)["pins"]}
    assert rows[PIN]["perf"].startswith("fail 2026-11-30T10:00:00Z")
    assert rows[PIN]["check"] == "never checked" or not rows[PIN]["check"].startswith("fail 2026-11-30T10")
    assert rows["vllm@v0.3.3"]["perf"] == "never measured"


def test_matrix_cells_carry_the_speed_gate_where_a_recipe_exists(monkeypatch):
    from patcher.engines.registry import engine
    from patcher.formats.lock import load_lock
    from patcher.upstream.matrix import pin_cells

    ADAPTERS = {n: engine(n) for n in ("vllm", "lmdeploy")}

    lock = load_lock(REPO_ROOT / "upstream.lock")
    cells = pin_cells(ADAPTERS["vllm"], lock.pin(PIN), has_stack=True)
    assert all(c.steps[-1] == "perf" for c in cells)
    # recipes are per version: vLLM 0.3.3's wheel has neither `vllm serve` nor a benchmark
    old = pin_cells(ADAPTERS["vllm"], lock.pin("vllm@v0.3.3"), has_stack=True)
    assert all("perf" not in c.steps and any("no recipe for vllm 0.3.3" in s for s in c.skip) for c in old)
    assert [("perf" in c.steps) for c in pin_cells(ADAPTERS["lmdeploy"], lock.pin("lmdeploy@v0.18.0"), True)] == [True, True]
    assert not any("perf" in c.steps for c in pin_cells(ADAPTERS["lmdeploy"], lock.pin("lmdeploy@v0.4.0"), True))
    no_recipe = swap_engine(monkeypatch, "vllm", perf_recipe=lambda self, entry, spec: None)
    cells = pin_cells(no_recipe, lock.pin(PIN), has_stack=True)
    assert all("perf" not in c.steps and any(s.startswith("perf: ") for s in c.skip) for c in cells)


@needs_cpu_only
def test_rescore_recomputes_a_saved_report_deterministically(proj, model_dir, fake_engine, tmp_path):
    fake_engine["A"] = (0.04, 0.008)
    rc, out, err = proj.run("perf", PIN, "--model", str(model_dir), *SMALL)
    assert rc == 1, err
    before = json.loads(proj.report().read_text())
    rc, out, err = proj.run("perf", "--rescore", str(proj.report()), "--json")
    after = json.loads(proj.report().read_text())
    assert rc == 1 and json.loads(out)["verdict"] == "fail"
    assert after["points"] == before["points"] and after["reasons"] == before["reasons"]  # same rule, same numbers
    assert after["provenance"]["rescored"]["threshold"] == before["threshold"]
    # a looser threshold on the same data: the verdict follows the rule, nothing is re-measured
    rc, out, err = proj.run("perf", "--rescore", str(proj.report()), "--threshold", "0.01")
    assert rc == 0, err
    assert json.loads(proj.report().read_text())["runs"] == before["runs"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, out, err = proj.run("perf", "--rescore", str(bad))
    assert rc == 2 and "not a readable perf report" in err
    text = proj.report().read_text()
    rc, out, err = proj.run("perf", "vllm@v0.3.3", "--rescore", str(proj.report()))
    assert rc == 2 and "is a report of vllm@v0.32.0" in err
    assert proj.report().read_text() == text  # bad input changes nothing


def test_perf_needs_a_pin_or_a_report(proj):
    rc, out, err = proj.run("perf")
    assert rc == 2 and "name one ENGINE@TAG (or --rescore REPORT)" in err


def test_benchmarks_section_comes_from_the_committed_perf_reports(tmp_path):
    """docs/benchmarks.md's engine-speed section is generated from reports/ (perfdoc), and the
    check wall-time table never mistakes a perf report for a check report."""
    from patcher.bench.driver import read_check_timings
    from patcher.bench.gate_reports import perf_markdown, read_perf_reports

    root = tmp_path / "reports" / "vllm" / "v0.32.0"
    root.mkdir(parents=True)
    for name in ("perf-aa-v3-deepseek-float32.json", "perf-v3-deepseek-float32.json"):
        shutil.copy2(REPO_ROOT / "reports" / "vllm" / "v0.32.0" / name, root / name)
    reports = read_perf_reports(tmp_path / "reports")
    assert [d["mode"] for _p, d in reports] == ["aa", "patched-vs-unpatched"]
    md = perf_markdown(reports)
    assert "A/A calibration, pass" in md and "patched vs unpatched, pass" in md
    assert "gated intervals contain 1.0" in md and "Against the A/A run of the same setup" in md
    assert md.count("| 16 | TPOT mean (gated) |") == 2
    assert read_check_timings(tmp_path / "reports") == []
    committed = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    assert md.strip() in committed  # the committed page is what the reports say (regenerate: make bench)


# ---------------------------------------------------------------- serve: what perf serves


@needs_cpu_only
def test_serve_starts_what_perf_serves_and_stops_it(proj, model_dir, fake_engine):
    """An engine without a serving recipe of its own (vLLM) is served by its speed-gate recipe:
    the pin's environment, 127.0.0.1, ready when the recipe's ready path answers, and every
    process gone when the context ends."""
    import urllib.request

    from patcher.base.config import load_config
    from patcher.base.procs import group_members
    from patcher.formats.lock import load_lock
    from patcher.formats.pinref import parse_pinref
    from patcher.gate.serve import ServeRequest, serve_recipe

    cfg = load_config(proj.root, env={"DSADAPT_WORKDIR": str(proj.work)})
    lock = load_lock(proj.root / "upstream.lock")
    with serve_recipe(cfg, lock, ServeRequest(parse_pinref(PIN), model_dir, "mymodel")) as served:
        assert served.url.startswith("http://127.0.0.1:") and served.installed["served"] == PIN
        with urllib.request.urlopen(served.url + "/health", timeout=10) as r:
            assert r.status == 200
        pgid = served.pid
        assert group_members(pgid)
    assert not group_members(pgid)
    assert fake_engine["asked"] == [(PIN, "cpu", False)]
    with pytest.raises(Exception, match="serves float32, not bfloat16"), \
            serve_recipe(cfg, lock, ServeRequest(parse_pinref(PIN), model_dir, "mymodel", dtype="bfloat16")):
        pass


@needs_cpu_only
def test_serve_names_the_model_after_the_pin_and_ctrl_c_exits_130(proj, model_dir, fake_engine, monkeypatch):
    """`dsadapt serve` answers to `PIN/MODEL` (not a name of dsadapt's own), and ends as an interrupted
    command does (130, docs/user-guide.md's exit codes) with every process it started gone."""
    import urllib.request

    from patcher.base.procs import group_members
    from patcher.cli.commands import serve as serve_cmd

    seen = {}

    def ctrl_c(stop, served):
        with urllib.request.urlopen(served.url + "/health", timeout=10) as r:
            seen["status"], seen["pgid"], seen["model"] = r.status, served.pid, served.model
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cmd, "_wait", ctrl_c)
    rc, out, err = proj.run("serve", PIN, "--model", str(model_dir))
    assert rc == 130 and seen["status"] == 200 and "stopped." in err and "error" not in err, (out, err)
    assert seen["model"] == f"{PIN}/mymodel" and f"model: {PIN}/mymodel" in out and "dsadapt-perf" not in out
    assert not group_members(seen["pgid"])
    rc, out, _ = proj.run("serve", PIN, "--model", str(model_dir), "--unpatched", "--json")
    assert rc == 130 and json.loads(out)["model"] == f"{PIN}-unpatched/mymodel"


@needs_cpu_only
def test_serve_says_so_when_its_server_exits_on_its_own(proj, model_dir, fake_engine, monkeypatch):
    import signal

    from patcher.cli.commands import serve as serve_cmd

    real = serve_cmd._wait

    def crash_then_wait(stop, served):
        os.killpg(served.pid, signal.SIGKILL)
        real(stop, served)

    monkeypatch.setattr(serve_cmd, "_wait", crash_then_wait)
    rc, out, err = proj.run("serve", PIN, "--model", str(model_dir))
    assert rc == 7 and "the server exited on its own" in err and "server.log" in err, (out, err)


def test_perf_help_speaks_of_the_two_servers_not_of_a_reference():
    from click.testing import CliRunner

    from patcher.cli.main import cli

    text = " ".join(CliRunner().invoke(cli, ["perf", "--help"]).output.split())
    assert "the patched and the unpatched server run the same ranks" in text
    assert "reference stays one process" not in text and "HF reference" not in text

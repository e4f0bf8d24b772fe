"""The committed evidence covers the stacks that ship: in a fresh clone (the committed reports/ and
nothing else), `dsadapt report` gives every pin that some machine the project measures on can run
a verdict of its current stack, and says which machine. reports/plan.txt names those machines and
the commands that regenerate each set (`make reports` for the CPU, tools/device/reports_h200.sh for
the H200); a pin the plan gives to the H200 counts by its committed H200 reports, which nothing here
can remake.

When this fails after a change to a stack (a patch, its trailers, the series), regenerate what the
message names: `make reports` here (hours on 2 cores), and the H200's through the bundle."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.base.config import load_config
from patcher.engines.registry import engine
from patcher.formats.lock import load_lock
from patcher.formats.pinref import parse_pinref
from patcher.formats.stackfiles import load_stack
from patcher.gate.report import build_report


def _tool():
    spec = importlib.util.spec_from_file_location("refresh_reports", REPO_ROOT / "tools" / "refresh_reports.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


PLAN = _tool().load_plan()
LOCK = load_lock(REPO_ROOT / "upstream.lock")
#: the machines each shipped pin is measured on, by the plan
MACHINES: dict[str, set[str]] = {}
for _line in PLAN:
    if _line.pin:
        MACHINES.setdefault(_line.pin, set()).add(_line.machine)
MEASURED = sorted(p for p, m in MACHINES.items() if m - {"none"})


def _shipped() -> list[str]:
    """Pins of upstream.lock with a stack in patches/."""
    return [str(e.ref) for e in LOCK.sorted_pins()
            if load_stack(REPO_ROOT / "patches", e.ref, must_exist=False).exists]


@pytest.fixture(scope="module")
def fresh_clone_report(tmp_path_factory) -> dict:
    """`dsadapt report` as a fresh clone sees it: the committed reports, an empty work dir."""
    work = tmp_path_factory.mktemp("fresh-work")
    cfg = load_config(REPO_ROOT, env={"DSADAPT_WORKDIR": str(work)})
    return {r.pin: r for r in build_report(cfg, LOCK)}


def test_the_plan_names_a_machine_for_every_shipped_stack_and_only_pinned_ones():
    assert sorted(MACHINES) == sorted(set(MACHINES) & set(LOCK.pins)), "the plan names unpinned pins"
    missing = [p for p in _shipped() if p not in MACHINES]
    assert not missing, f"reports/plan.txt says nothing of {missing}: give each a machine (or `none` and why)"
    both = [p for p, m in MACHINES.items() if "none" in m and len(m) > 1]
    assert not both, f"{both}: `none` and a machine"
    for line in PLAN:
        if line.machine == "none":
            assert line.note, f"reports/plan.txt:{line.line}: say why no measured machine can run {line.pin}"


def test_a_pin_that_runs_on_a_cpu_is_measured_on_one():
    """The engine contract decides, not this machine's sources: a pin with a CPU build variant whose
    gate this Python can run is the CPU's to measure (unless its lock note says it only applies and
    builds), so a new CPU pin cannot ship without its reports."""
    for entry in LOCK.sorted_pins():
        pin = str(entry.ref)
        if pin not in _shipped() or "apply and build only" in (entry.note or ""):
            continue
        eng = engine(entry.engine)
        cpu = [v for v in eng.pinned_variants(entry) if v.device == "cpu" and eng.gate_dtypes(v)]
        runs = [v for v in cpu if not (eng.run_blocker(entry, v) or "").startswith(("needs Python", "wheels are"))]
        if runs:
            assert "cpu" in MACHINES.get(pin, set()), f"{pin} runs on a CPU ({runs[0].name}): add its cpu lines"


def test_every_plan_command_is_one_dsadapt_accepts():
    """Parsed by dsadapt's own CLI (not run): a typo would cost a whole `make reports` or a device call."""
    import click

    from patcher.cli.main import cli

    for line in PLAN:
        if line.machine == "none":
            continue
        args = line.dsadapt_args()
        ctx = cli.make_context("dsadapt", ["--project", str(REPO_ROOT), *args], resilient_parsing=False)
        group = cli.get_command(ctx, args[0])
        assert group is not None, line
        with click.Context(group, parent=ctx, info_name=args[0]) as sctx:
            group.parse_args(sctx, list(args[1:]))


@pytest.mark.parametrize("pin", MEASURED)
def test_a_measured_stack_s_newest_committed_verdicts_are_of_the_stack_that_ships(pin, fresh_clone_report):
    r = fresh_clone_report[pin]
    ref = parse_pinref(pin)
    current = load_stack(REPO_ROOT / "patches", ref).hash
    machines = MACHINES[pin] - {"none"}
    how = " and ".join({"cpu": "`make reports`", "h200": "tools/device/reports_h200.sh (the H200's)"}[m]
                       for m in sorted(machines))
    assert r.checks, f"{pin}: no committed verdict at all; regenerate with {how}"
    old = sorted({c["file"] for c in r.checks if c["stack_hash"] != current})
    assert r.current and not old, (f"{pin}: the committed verdicts are of stack {r.checks[0]['stack_hash'][:12]}, "
                                   f"not the shipped {current[:12]} ({r.check}); regenerate with {how}: {old[:4]}")
    # every configuration the pin's committed report set has (its own folder, not the dated evidence
    # under it) is judged again: a configuration left behind would hide behind the current ones
    folder = REPO_ROOT / "reports" / ref.engine / ref.tag
    top = {c["config"] for c in r.checks if Path(REPO_ROOT / c["file"]).parent == folder}
    from patcher.gate.report import read_verdicts

    stale = sorted({v.label for v in read_verdicts(folder).get(pin, []) if Path(v.file).parent == folder} - top)
    assert not stale, f"{pin}: configurations in {folder.relative_to(REPO_ROOT)} no current check covers: {stale}"
    # ... and it says which machine: the one the plan gives it
    want = {"cpu": "CPU", "h200": "H200"}
    assert set(r.machines) <= {want[m] for m in machines} and r.machines, (pin, r.machines)


@pytest.mark.parametrize("pin", sorted(p for p in MEASURED if any(ln.pin == p and ln.command == "perf" for ln in PLAN)))
def test_a_measured_stack_s_speed_gate_verdict_is_calibrated_and_current(pin, fresh_clone_report):
    r = fresh_clone_report[pin]
    current = load_stack(REPO_ROOT / "patches", parse_pinref(pin)).hash
    assert r.last_perf and r.last_perf["workload"] == "calibrated" and r.last_perf["stack_hash"] == current, \
        f"{pin}: perf says `{r.perf}`; the plan's `perf` line (the documented size) regenerates it: `make reports`"


@pytest.mark.parametrize("pin", MEASURED)
def test_a_measured_stack_s_committed_verdicts_are_today_s_rule_s(pin, fresh_clone_report):
    """A rule changed since a report was judged: `dsadapt check --rescore REPORT` applies today's rule
    to its recorded inputs (the report says when it cannot, and which command reruns it)."""
    stale = [f"{c['file']}: {c['stale']}" for c in fresh_clone_report[pin].checks if c.get("stale")]
    assert not stale, "\n".join(stale)


def test_the_docs_pictures_are_drawn_from_committed_reports():
    """tools/doc_images.py draws docs/img/ from committed reports: each one it names is committed."""
    tool = importlib.util.spec_from_file_location("doc_images", REPO_ROOT / "tools" / "doc_images.py")
    assert tool and tool.loader
    mod = importlib.util.module_from_spec(tool)
    tool.loader.exec_module(mod)
    missing = [rel for rel, _ in mod.PICTURES.values() if not (REPO_ROOT / "reports" / rel).is_file()]
    assert not missing, f"not committed (make reports publishes them): {missing}"
    assert set(mod.PICTURES) == {f.name for f in (REPO_ROOT / "docs" / "img").glob("*.png")}

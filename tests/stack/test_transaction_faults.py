"""Fault injection: kill -9 at every git start and end, every durable write and every removal of
apply, re-apply, apply --force, continue, skip, abort, refresh, refresh --force and rebase, and of
the commands that follow what the user did by hand (a `git am --continue` or `--abort` at a stop,
commits on a detached HEAD, dsadapt's record deleted, an empty and a mode-only commit, a `git rebase`
of theirs left half done) -- see tests/fault_harness.py for what is checked after each kill.

FAULT_SAMPLE=N runs every N-th point only (a quicker local loop); the default is all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import rebase_fixture as fx
from conftest import (
    MOD_V1,
    P1_MOD,
    REF1,
    TAG1,
    UTIL_V1,
    Project,
    commit_msg,
    conflicting_stack,
    edit,
    git,
    make_patches,
)
from fault_harness import ALLOWED, Scenario, Tally, Work, outcome, run_scenario

SUMMARY: dict[str, Tally] = {}

RESOLVED = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", None) or "tanh"')


def _resolve(project: Project) -> None:
    co = project.checkout()
    (co / "vllm" / "mod.py").write_text(RESOLVED)
    git(co, "add", "vllm/mod.py")


def _new_stack(project: Project) -> None:
    """A changed stack: patch 2 differs, a 4th patch is added."""
    texts = make_patches(project.upstream, project.tmp / "mk-new", TAG1, [
        (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD}),
        (commit_msg("util: step by three"), {"vllm/util.py": UTIL_V1.replace("x + 1", "x + 3")}),
        (commit_msg("add a new helper module"), {"vllm/newmod.py": "VALUE = 1\n"}),
        (commit_msg("add another module"), {"vllm/other.py": "OTHER = 2\n"}),
    ])
    project.write_stack(texts)


DIRTY = "# my uncommitted work\n"
NOTES = "untracked notes\n"


def _dirty(project: Project) -> None:
    co = project.checkout()
    (co / "vllm" / "util.py").write_text(DIRTY)
    (co / "scratch.txt").write_text(NOTES)


def build_apply(p: Project) -> None:
    _new_stack(p)


def build_reapply(p: Project) -> None:
    from conftest import clean_stack_edits

    p.write_stack(make_patches(p.upstream, p.tmp / "mk", TAG1, clean_stack_edits()))
    assert p.run("apply", REF1).rc == 0
    _new_stack(p)


def build_force(p: Project) -> None:
    build_reapply(p)
    co = p.checkout()
    (co / "README.md").write_text("local readme\n")
    git(co, "commit", "-qam", "local work")
    _dirty(p)


def build_stopped(p: Project) -> None:
    from conftest import clean_stack_edits

    p.write_stack(make_patches(p.upstream, p.tmp / "mk", TAG1, clean_stack_edits()))
    assert p.run("apply", REF1).rc == 0
    _dirty(p)
    conflicting_stack(p, [(commit_msg("add a module"), {"vllm/newmod.py": "VALUE = 1\n"})])
    assert p.run("apply", REF1, "--force").rc == 4


def build_resolved(p: Project) -> None:
    build_stopped(p)
    _resolve(p)


def build_refresh(p: Project) -> None:
    from conftest import clean_stack_edits

    p.write_stack(make_patches(p.upstream, p.tmp / "mk", TAG1, clean_stack_edits()))
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    (co / "vllm" / "mod.py").write_text((co / "vllm" / "mod.py").read_text().replace('"upstream"', '"patched"'))
    git(co, "commit", "-qam", commit_msg("mod: untouched says patched"))
    git(co, "commit", "-q", "--amend", "-m", commit_msg("mod: untouched says patched, amended"))


HAND = "Reported-by: Hand Edit <hand@example.org>"


def build_refresh_force(p: Project) -> None:
    build_refresh(p)
    f = sorted(p.stack_dir().glob("0001-*.patch"))[0]
    f.write_text(f.read_text().replace("Covered-By:", HAND + "\nCovered-By:", 1))


def _hand_work(p: Project) -> list[Work]:
    f = sorted(p.stack_dir().glob("0001-*.patch"))[0]
    return [Work("patchfile", str(f.relative_to(p.root)), f.read_text())]


def build_am_continued_by_hand(p: Project) -> None:
    """At the stop the user resolved and ran `git am --continue` themselves (it ran to the end)."""
    build_resolved(p)
    git(p.checkout(), "am", "--continue")


def build_am_aborted_by_hand(p: Project) -> None:
    """At the stop (over the user's edits) the user ran `git am --abort` themselves."""
    build_stopped(p)
    git(p.checkout(), "am", "--abort")


def build_detached_with_commit(p: Project) -> None:
    """The user checked out a commit and committed on it; then patches/ changed."""
    build_reapply(p)
    co = p.checkout()
    git(co, "checkout", "-q", "--detach", "HEAD~1")
    (co / "mine.txt").write_text("mine\n")
    git(co, "add", "mine.txt")
    git(co, "commit", "-qm", "my commit on a detached HEAD")


def build_refresh_record_lost(p: Project) -> None:
    """An unexported commit on the branch, then dsadapt's record and its copy deleted by hand:
    refresh re-derives the record from git (the base ref, the stack snapshot) and exports."""
    build_refresh(p)
    co = p.checkout()
    (co / ".git" / "dsadapt" / "state.json").unlink()
    git(co, "update-ref", "-d", "refs/dsadapt/state")


def build_resolved_record_lost(p: Project) -> None:
    """At a resolved stop, `.git/dsadapt/` (the record and the op's patches) removed by hand:
    continue takes both back from the record's copy in git."""
    build_resolved(p)
    import shutil

    shutil.rmtree(p.checkout() / ".git" / "dsadapt")


def build_empty_and_mode_commits(p: Project) -> None:
    """An empty commit and a mode-only commit on the branch: refresh leaves the first out (a note)
    and exports the second with its index line."""
    from conftest import clean_stack_edits

    p.write_stack(make_patches(p.upstream, p.tmp / "mk", TAG1, clean_stack_edits()))
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    git(co, "commit", "-q", "--allow-empty", "-m", commit_msg("an empty commit"))
    (co / "README.md").chmod(0o755)
    git(co, "commit", "-qam", commit_msg("readme: executable"))


def build_rebase_in_progress(p: Project) -> None:
    """The user's own `git rebase -i` stopped at an edit, with a commit made there: apply --force
    keeps the rebase's HEAD, the branch and the work, quits the rebase and applies patches/."""
    import subprocess

    build_reapply(p)
    co = p.checkout()
    subprocess.run(["git", "rebase", "-q", "-i", "HEAD~2"], cwd=co, capture_output=True,
                   env={**os.environ, "GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"})
    (co / "mine.txt").write_text("mine, made during my rebase\n")
    git(co, "add", "mine.txt")
    git(co, "commit", "-qm", "my commit during a rebase")


REBASE_PIN = "vllm@v1.1.0"


def rebase_project(tmp_path) -> Project:
    up = fx.make_upstream(tmp_path)
    root = fx.make_project(tmp_path, up)
    env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "work"),
           "DSADAPT_CACHE": str(tmp_path / "work" / "cache"), "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "",
           "DSADAPT_LOCK_TIMEOUT": "5"}
    (tmp_path / "work").mkdir()
    return Project(root, None, env, tmp_path)  # type: ignore[arg-type]


def _resolve_rebase(p: Project) -> None:
    co = p.checkout("v1.1.0")
    (co / "pkg" / "d.py").write_text(fx.RESOLVED_D)
    git(co, "add", "pkg/d.py")


def _ok(r) -> None:
    assert r.rc == 0, r


def build_rebase_stopped(p: Project) -> None:
    _ok(p.run("apply", "vllm@v1.0.0"))
    assert p.run("rebase", "vllm@v1.0.0", "--onto", "v1.1.0").rc == 4


def build_rebase_resolved(p: Project) -> None:
    build_rebase_stopped(p)
    _resolve_rebase(p)


SCENARIOS = {
    "apply": lambda: Scenario("apply", REF1, TAG1, ["apply", REF1], build_apply),
    "reapply": lambda: Scenario("reapply", REF1, TAG1, ["apply", REF1], build_reapply),
    "force": lambda: Scenario("force", REF1, TAG1, ["apply", REF1, "--force"], build_force,
                              work=[Work("file", "vllm/util.py", DIRTY), Work("untracked", "scratch.txt", NOTES)]),
    "continue": lambda: Scenario("continue", REF1, TAG1, ["continue", REF1], build_resolved, resolve=_resolve),
    "skip": lambda: Scenario("skip", REF1, TAG1, ["skip", REF1], build_stopped),
    "abort": lambda: Scenario("abort", REF1, TAG1, ["abort", REF1], build_stopped,
                              work=[Work("file", "vllm/util.py", DIRTY), Work("untracked", "scratch.txt", NOTES)]),
    "continue-after-git-am-continue": lambda: Scenario("continue-after-git-am-continue", REF1, TAG1,
                                                       ["continue", REF1], build_am_continued_by_hand,
                                                       resolve=_resolve),
    "abort-after-git-am-abort": lambda: Scenario("abort-after-git-am-abort", REF1, TAG1, ["abort", REF1],
                                                 build_am_aborted_by_hand,
                                                 work=[Work("file", "vllm/util.py", DIRTY),
                                                       Work("untracked", "scratch.txt", NOTES)]),
    "force-over-detached-commit": lambda: Scenario("force-over-detached-commit", REF1, TAG1,
                                                   ["apply", REF1, "--force"], build_detached_with_commit),
    "refresh": lambda: Scenario("refresh", REF1, TAG1, ["refresh", REF1], build_refresh),
    "refresh-force": lambda: Scenario("refresh-force", REF1, TAG1, ["refresh", REF1, "--force"], build_refresh_force),
    "refresh-after-record-lost": lambda: Scenario("refresh-after-record-lost", REF1, TAG1, ["refresh", REF1],
                                                  build_refresh_record_lost),
    "continue-after-record-lost": lambda: Scenario("continue-after-record-lost", REF1, TAG1, ["continue", REF1],
                                                   build_resolved_record_lost, resolve=_resolve,
                                                   work=[Work("file", "vllm/util.py", DIRTY),
                                                         Work("untracked", "scratch.txt", NOTES)]),
    "refresh-empty-and-mode-commits": lambda: Scenario("refresh-empty-and-mode-commits", REF1, TAG1,
                                                       ["refresh", REF1], build_empty_and_mode_commits),
    "force-over-a-git-rebase": lambda: Scenario("force-over-a-git-rebase", REF1, TAG1, ["apply", REF1, "--force"],
                                                build_rebase_in_progress),
    "rebase": lambda: Scenario("rebase", REBASE_PIN, "v1.1.0", ["rebase", "vllm@v1.0.0", "--onto", "v1.1.0"],
                               lambda p: _ok(p.run("apply", "vllm@v1.0.0")), resolve=_resolve_rebase),
    "rebase-continue": lambda: Scenario("rebase-continue", REBASE_PIN, "v1.1.0", ["continue", REBASE_PIN],
                                        build_rebase_resolved, resolve=_resolve_rebase),
    "rebase-abort": lambda: Scenario("rebase-abort", REBASE_PIN, "v1.1.0", ["abort", REBASE_PIN],
                                     build_rebase_stopped),
}


def _base(name: str, tmp_path, project_factory) -> tuple[Project, Scenario]:
    sc = SCENARIOS[name]()
    base = rebase_project(tmp_path / "base") if name.startswith("rebase") else project_factory(tmp_path / "base")
    sc.build(base)
    if name == "force":
        co = base.checkout()
        sc.work.append(Work("commit", git(co, "rev-parse", "HEAD")))
    if name in ("refresh", "force-over-detached-commit", "refresh-after-record-lost", "refresh-empty-and-mode-commits",
                "force-over-a-git-rebase"):
        sc.work.append(Work("commit", git(base.checkout(), "rev-parse", "HEAD")))
    if name == "refresh-force":
        sc.work += _hand_work(base)
    return base, sc


@pytest.fixture
def project_factory():
    from misuse_support import fixture_project

    return lambda root: fixture_project(root, stack=False)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kill_at_every_point(name, tmp_path, project_factory):
    base, sc = _base(name, tmp_path, project_factory)
    sample = int(os.environ.get("FAULT_SAMPLE", "1"))
    from fault_harness import copy_project, count_events

    n = len(count_events(copy_project(base, tmp_path / "n"), sc.argv))
    assert n > 5, f"{name}: only {n} fault points"
    only = list(range(1, n + 1, sample))
    tally, log = run_scenario(base, sc, tmp_path / "runs", only)
    SUMMARY[name] = tally
    (tmp_path / "log.txt").write_text("\n".join(log))
    if os.environ.get("FAULT_LOG_DIR"):
        Path(os.environ["FAULT_LOG_DIR"], f"{name}.log").write_text("\n".join(log))
    problems = tally.lost + tally.wrong + tally.manual
    assert tally.kills >= len(only) * 0.9, log
    assert not problems, "\n".join(problems[:15]) + f"\n({len(problems)} problems in {tally.kills} kills)"
    summary = os.environ.get("FAULT_SUMMARY")
    if summary:
        with open(summary, "a") as f:
            f.write(json.dumps({"scenario": name, "points": n, "kills": tally.kills, "recovered": tally.recovered,
                                "lost": len(tally.lost), "wrong": len(tally.wrong),
                                "manual": len(tally.manual)}) + "\n")


def test_the_abort_scenario_really_restores_the_pre_apply_state(tmp_path, project_factory):
    """The abort reference itself is the state before `apply --force`: work back in place, no backups."""
    base, sc = _base("abort", tmp_path, project_factory)
    co = base.checkout()
    assert base.run("abort", REF1).rc == 0
    assert (co / "vllm" / "util.py").read_text() == DIRTY and (co / "scratch.txt").read_text() == NOTES
    assert git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/") == ""
    assert outcome(base, TAG1)["op"] is False
    assert {"stopped", "interrupted"} <= ALLOWED

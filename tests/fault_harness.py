"""Kill dsadapt at chosen points and check what it leaves: the fault-injection harness.

A scenario builds a pre-state once (a fixture project, work dir, checkout); every kill runs on a
fresh copy of it. The command runs in a forked child in its own session with
`DSADAPT_FAULT=any:<k>` (patcher/base/faults.py: SIGKILL to the child's process group, git included,
at the k-th git start/end, durable write or removal). After each kill the harness checks:

- no user work is lost (uncommitted edits, untracked files, unexported commits, hand-edited
  patches are where they were or in a backup ref);
- `dsadapt status` tells the truth (a state it calls done is done: the branch holds exactly what
  patches/ says) and names the next command when something is unfinished;
- rerunning the command (then the commands status names) ends in the same branch tree, the same
  patches/ bytes and the same lock as the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from conftest import Project, git

from patcher.base import faults

ALLOWED = {"not fetched", "clean base", "stack applied", "stack outdated", "stopped", "interrupted", "dirty",
           "diverged", "absent"}


# ---------------------------------------------------------------- running a command to be killed


def fork_run(project: Project, argv: list[str], env: dict[str, str] | None = None) -> tuple[bool, int]:
    """`dsadapt argv` in a forked child, in its own session (the fault hook kills that group).
    Returns (killed, exit code or -signal)."""
    pid = os.fork()
    if pid == 0:  # child
        rc = 99
        try:
            os.setsid()
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the child never returns
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115
            os.environ.update({**project.env, **(env or {})})
            os.environ["DSADAPT_TEST_PGID"] = str(os.getpgrp())
            faults.reset()
            from patcher.cli.main import main

            rc = main(list(argv))
        except BaseException:  # noqa: B036 - the child must never return into pytest
            rc = 98
        finally:
            os._exit(rc if isinstance(rc, int) and 0 <= rc < 256 else 97)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return True, -os.WTERMSIG(status)
    return False, os.WEXITSTATUS(status)


def count_events(project: Project, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    log = project.tmp / "fault-events.log"
    log.unlink(missing_ok=True)
    fork_run(project, argv, {**(env or {}), "DSADAPT_FAULT_LOG": str(log)})
    return log.read_text().splitlines() if log.exists() else []


# ---------------------------------------------------------------- snapshots


def tree_sha(root: Path) -> dict[str, str]:
    out = {}
    if root.exists():
        for p in sorted(root.rglob("*")):
            if p.is_file() and ".tmp-" not in p.name:
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def status_of(project: Project, pin: str) -> dict:
    r = project.run("status", "--json")
    assert r.rc == 0, r
    for c in r.json()["checkouts"]:
        if c["ref"] == pin:
            return c
    # not pinned (yet) and no checkout holds an op for it: a rebase killed before it pinned NEW
    assert not any(c.get("op") for c in r.json()["checkouts"]), r.out
    return {"ref": pin, "state": "absent", "detail": "not pinned, no checkout", "next": None}


def outcome(project: Project, tag: str) -> dict:
    """What a finished run is judged by."""
    co = project.checkout(tag)
    return {
        "tree": git(co, "rev-parse", f"refs/heads/dsadapt/{tag}^{{tree}}", check=False),
        "head": git(co, "symbolic-ref", "--quiet", "HEAD", check=False) or git(co, "rev-parse", "HEAD"),
        "status": git(co, "status", "--porcelain", "--untracked-files=all"),
        "work": git(co, "diff", "HEAD"),
        "patches": tree_sha(project.root / "patches"),
        "lock": hashlib.sha256((project.root / "upstream.lock").read_bytes()).hexdigest(),
        "refs": git(co, "for-each-ref", "--format=%(refname) %(objectname)"),
        "untracked": {f: (co / f).read_text() for f in git(co, "ls-files", "-o", "--exclude-standard").split()},
        "op": json.loads((co / ".git" / "dsadapt" / "state.json").read_text()).get("op") is not None
        if (co / ".git" / "dsadapt" / "state.json").exists() else None,
    }


# ---------------------------------------------------------------- user work


@dataclass
class Work:
    """Something of the user's that must survive: a file's content in the checkout (tracked or
    untracked), a commit, or a file in patches/."""

    kind: str      # file | untracked | commit | patchfile
    path: str      # checkout-relative path, commit id, or project-relative path
    content: str = ""


def work_kept(project: Project, tag: str, w: Work) -> bool:
    co = project.checkout(tag)
    if w.kind in ("file", "untracked"):
        p = co / w.path
        if p.is_file() and p.read_text() == w.content:
            return True
        for ref in git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/").split():
            for spec in (f"{ref}:{w.path}", f"{ref}^3:{w.path}"):
                if git(co, "show", spec, check=False, strip=False) == w.content:
                    return True
        return False
    if w.kind == "commit":  # in place (HEAD reaches it: a detached HEAD's own work) or on a ref
        if bool(git(co, "for-each-ref", "--contains", w.path, "--format=%(refname)", check=False)):
            return True
        import subprocess

        return subprocess.run(["git", "merge-base", "--is-ancestor", w.path, "HEAD"], cwd=co,
                              capture_output=True).returncode == 0
    if w.kind == "patchfile":
        p = project.root / w.path
        if p.is_file() and p.read_text() == w.content:
            return True
        name = Path(w.path).name
        for ref in git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/").split():
            if git(co, "show", f"{ref}:{name}", check=False, strip=False) == w.content:
                return True
        return False
    raise ValueError(w.kind)


# ---------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    name: str
    pin: str
    tag: str
    argv: list[str]
    build: Callable[[Project], None]                 # makes the pre-state in a fresh project
    work: list[Work] = field(default_factory=list)
    resolve: Callable[[Project], None] | None = None  # what the user does at a conflict stop
    allowed: set[str] = field(default_factory=lambda: set(ALLOWED))


@dataclass
class Tally:
    kills: int = 0
    recovered: int = 0
    lost: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    manual: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.kills += other.kills
        self.recovered += other.recovered
        self.lost += other.lost
        self.wrong += other.wrong
        self.manual += other.manual


def copy_project(base: Project, dest: Path) -> Project:
    """A copy of the project and its work dir (the upstream repo is shared, read-only)."""
    dest.mkdir(parents=True)
    shutil.copytree(base.root, dest / "project", symlinks=True)
    shutil.copytree(base.workdir, dest / "work", symlinks=True)
    env = dict(base.env)
    env.update({"DSADAPT_PROJECT": str(dest / "project"), "DSADAPT_WORKDIR": str(dest / "work"),
                "DSADAPT_CACHE": str(dest / "work" / "cache")})
    return Project(dest / "project", base.upstream, env, dest)


def drive(project: Project, sc: Scenario, first: bool = True, max_steps: int = 6) -> list[str]:
    """Rerun the command, then follow what status names (resolving conflict stops the way the
    scenario does) until nothing is unfinished. Returns the commands run."""
    ran = []
    if first:
        r = project.run(*sc.argv)
        ran.append(" ".join(sc.argv) + f" -> {r.rc}")
    for _ in range(max_steps):
        st = status_of(project, sc.pin)
        if st["state"] == "stopped" and sc.resolve is not None:
            sc.resolve(project)
            r = project.run("continue", sc.pin)
            ran.append(f"resolve + continue -> {r.rc}")
            continue
        if st["state"] == "interrupted" and st["next"]:
            argv = st["next"].split()[1:]
            r = project.run(*argv)
            ran.append(f"{st['next']} -> {r.rc}")
            continue
        break
    return ran


def reference(base: Project, sc: Scenario, dest: Path) -> dict:
    p = copy_project(base, dest)
    drive(p, sc)
    return outcome(p, sc.tag)


def check_after_kill(p: Project, sc: Scenario, pre: dict, ref: dict) -> list[str]:
    """Problems with what a kill left, before anything is rerun."""
    problems = []
    for w in sc.work:
        if not work_kept(p, sc.tag, w):
            problems.append(f"LOST {w.kind} {w.path}")
    st = status_of(p, sc.pin)
    if st["state"] not in sc.allowed:
        problems.append(f"WRONG status state {st['state']!r}: {st['detail']}")
    if st["state"] in ("stopped", "interrupted") and not (st["next"] or "").startswith("dsadapt "):
        problems.append(f"WRONG status names no next command: {st['detail']}")
    if st["state"] == "stack applied":
        now = outcome(p, sc.tag)
        fits = [o for o in (pre, ref) if o and o["patches"] == now["patches"]]
        if fits and all(now["tree"] != o["tree"] for o in fits):
            problems.append(f"WRONG status says 'stack applied' but the branch tree {now['tree'][:12]} is not "
                            f"what patches/ gives")
    return problems


def run_scenario(base: Project, sc: Scenario, work_root: Path, only: list[int] | None = None,
                 env: dict[str, str] | None = None, jobs: int | None = None) -> tuple[Tally, list[str]]:
    """Kill the scenario's command at every fault point (or at `only`); returns the tally and a log.
    The points are shared out over `jobs` forked workers (FAULT_JOBS, default: the cores, at most 4)."""
    pre_p = copy_project(base, work_root / "pre")
    pre = outcome(pre_p, sc.tag) if pre_p.checkout(sc.tag).exists() else None
    ref = reference(base, sc, work_root / "ref")
    events = count_events(copy_project(base, work_root / "count"), sc.argv, env)
    points = only or list(range(1, len(events) + 1))
    jobs = jobs or int(os.environ.get("FAULT_JOBS", "0")) or min(4, len(os.sched_getaffinity(0)))
    if jobs <= 1:
        return _run_points(base, sc, work_root, points, events, pre, ref, env)
    pids = []
    for j in range(jobs):
        pid = os.fork()
        if pid == 0:  # worker
            code = 0
            try:
                tally, log = _run_points(base, sc, work_root / f"w{j}", points[j::jobs], events, pre, ref, env)
                (work_root / f"result-{j}.json").write_text(json.dumps({"tally": tally.__dict__, "log": log}))
            except BaseException as e:  # noqa: B036 - report, never return into pytest
                (work_root / f"result-{j}.json").write_text(json.dumps({"error": repr(e)}))
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    total, log = Tally(), []
    for j in range(jobs):
        data = json.loads((work_root / f"result-{j}.json").read_text())
        if "error" in data:
            raise AssertionError(f"fault worker {j} crashed: {data['error']}")
        total.add(Tally(**data["tally"]))
        log += data["log"]
    return total, log


def _run_points(base: Project, sc: Scenario, work_root: Path, points: list[int], events: list[str], pre, ref,
                env) -> tuple[Tally, list[str]]:
    tally, log = Tally(), []
    work_root.mkdir(parents=True, exist_ok=True)
    for k in points:
        p = copy_project(base, work_root / f"k{k}")
        killed, rc = fork_run(p, sc.argv, {**(env or {}), "DSADAPT_FAULT": f"any:{k}"})
        what = events[k - 1] if k <= len(events) else "?"
        if not killed:
            log.append(f"{sc.name} k={k} ({what}): not killed (rc {rc})")
            shutil.rmtree(work_root / f"k{k}", ignore_errors=True)
            continue
        tally.kills += 1
        problems = check_after_kill(p, sc, pre, ref)
        try:
            ran = drive(p, sc)
        except Exception as e:  # noqa: BLE001 - a crash is a finding
            ran = [f"crashed: {e!r}"]
        got = outcome(p, sc.tag)
        for w in sc.work:
            if not work_kept(p, sc.tag, w):
                problems.append(f"LOST after recovery {w.kind} {w.path}")
        diff = [k2 for k2 in ("tree", "head", "status", "work", "patches", "lock", "op", "refs", "untracked")
                if got[k2] != ref[k2]]
        if diff:
            problems.append(f"MANUAL end state differs from the uninterrupted run in {diff} after {ran}")
        for pr in problems:
            target = tally.lost if pr.startswith("LOST") else tally.wrong if pr.startswith("WRONG") else tally.manual
            target.append(f"{sc.name} k={k} ({what}): {pr}")
        if not any(pr.startswith("MANUAL") for pr in problems):
            tally.recovered += 1
        log.append(f"{sc.name} k={k} ({what}): {problems or 'ok'} {ran}")
        shutil.rmtree(work_root / f"k{k}", ignore_errors=True)
    return tally, log

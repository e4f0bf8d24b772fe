"""Property: for random stacks and random kill points (dsadapt's own fault points, or inside a git
process at a random instant), no work is lost, status tells the truth, and rerunning the command
(then what status names) ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from conftest import REF1, TAG1, Project, commit_msg, git, lock_text, make_patches, make_upstream
from fault_harness import Scenario, Work, check_after_kill, copy_project, count_events, drive, fork_run, outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FILES = ["vllm/mod.py", "vllm/util.py", "README.md", "vllm/__init__.py"]
edit = st.tuples(st.sampled_from(FILES), st.integers(0, 12), st.sampled_from(["alpha", "beta", "gamma", "delta"]),
                 st.booleans())

WRAPPER = """#!/bin/sh
n=$(cat "$WRAP_COUNT" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$WRAP_COUNT"
if [ "$n" = "$WRAP_AT" ]; then
  "$REAL_GIT" "$@" <&0 &
  sleep "$WRAP_DELAY"
  kill -9 -"$DSADAPT_TEST_PGID"
  wait
fi
exec "$REAL_GIT" "$@"
"""


def _texts(up, work: Path, edits, independent: bool) -> list[str]:
    """Patches from random line edits (independent ones may conflict with each other)."""
    changes = []
    contents: dict[str, list[str]] = {}
    for n, (path, line, word, insert) in enumerate(edits, 1):
        if independent or path not in contents:
            contents[path] = git(up.path, "show", f"{TAG1}:{path}", strip=False).split("\n")[:-1] or [""]
        lines = contents[path]
        i = line % len(lines)
        new = f"# {word} {n}"
        if insert:
            lines.insert(i, new)
        else:
            lines[i] = new
        changes.append((commit_msg(f"edit {n}: {word} in {path}"), {path: "\n".join(lines) + "\n"}))
    return make_patches(up, work, TAG1, changes, independent=independent)


def _project(root: Path) -> Project:
    root.mkdir(parents=True)
    up = make_upstream(root)
    proj = root / "project"
    proj.mkdir()
    env = {"DSADAPT_PROJECT": str(proj), "DSADAPT_WORKDIR": str(root / "work"),
           "DSADAPT_CACHE": str(root / "work" / "cache"), "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "",
           "DSADAPT_ARTIFACTS": str(root / "artifacts"), "DSADAPT_LOCK_TIMEOUT": "5", "DSADAPT_GIT_WAIT": "2"}
    (root / "artifacts").mkdir()
    (root / "work").mkdir()
    p = Project(proj, up, env, root)
    p.write_lock(lock_text(up))
    return p


KILLS: list[bool] = []


def _skip_stops(p: Project) -> None:
    p.run("skip", REF1)


@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", "25")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(first=st.lists(edit, min_size=1, max_size=3), second=st.lists(edit, min_size=1, max_size=4),
       independent=st.booleans(), dirty=st.booleans(), in_git=st.booleans(), frac=st.floats(0, 1),
       delay=st.sampled_from(["0", "0.002", "0.01", "0.03"]))
def test_random_stacks_random_kills(first, second, independent, dirty, in_git, frac, delay):
    with tempfile.TemporaryDirectory(prefix="dsadapt-prop-") as tmp:
        root = Path(tmp)
        base = _project(root / "base")
        base.write_stack(_texts(base.upstream, root / "mk1", first, False))
        assert base.run("apply", REF1).rc == 0
        base.write_stack(_texts(base.upstream, root / "mk2", second, independent))
        argv = ["apply", REF1]
        work = []
        if dirty:
            co = base.checkout()
            (co / "scratch.txt").write_text("untracked\n")
            (co / "vllm" / "mod.py").write_text("# dirty\n")
            argv.append("--force")
            work = [Work("untracked", "scratch.txt", "untracked\n"), Work("file", "vllm/mod.py", "# dirty\n")]
        sc = Scenario("property", REF1, TAG1, argv, lambda p: None, work=work, resolve=_skip_stops)
        ref_p = copy_project(base, root / "ref")
        drive(ref_p, sc, max_steps=12)
        ref = outcome(ref_p, TAG1)
        pre = outcome(copy_project(base, root / "pre"), TAG1)
        p = copy_project(base, root / "run")
        if in_git:
            wrap = root / "bin"
            wrap.mkdir()
            (wrap / "git").write_text(WRAPPER)
            (wrap / "git").chmod(0o755)
            calls = [e for e in count_events(copy_project(base, root / "count"), argv) if e.startswith("git-start")]
            env = {"PATH": f"{wrap}:/usr/bin:/bin", "REAL_GIT": shutil.which("git") or "/usr/bin/git",
                   "WRAP_COUNT": str(root / "count.txt"), "WRAP_AT": str(1 + int(frac * (len(calls) - 1))),
                   "WRAP_DELAY": delay}
        else:
            n = len(count_events(copy_project(base, root / "count"), argv))
            env = {"DSADAPT_FAULT": f"any:{1 + int(frac * (n - 1))}"}
        killed, rc = fork_run(p, argv, env)
        KILLS.append(killed)
        problems = check_after_kill(p, sc, pre, ref) if killed else []
        drive(p, sc, max_steps=12)
        got = outcome(p, TAG1)
        for w in work:
            from fault_harness import work_kept

            assert work_kept(p, TAG1, w), f"lost {w}"
        assert not problems, problems
        for k in ("tree", "head", "status", "work", "patches", "op", "untracked", "refs", "lock"):
            assert got[k] == ref[k], (k, killed, env, got[k], ref[k])


def test_the_property_runs_were_mostly_killed():
    """(runs after the property test) the kills happened: a property over unkilled runs proves little."""
    if not KILLS:
        import pytest

        pytest.skip("the property test did not run in this session")
    assert sum(KILLS) >= 0.7 * len(KILLS), f"{sum(KILLS)} of {len(KILLS)} runs were killed"

"""apply / continue / skip / abort on fixture upstream repositories (git source)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time

from conftest import MOD_V1, P1_MOD, REF1, TAG1, commit_msg, conflicting_stack, edit, git, make_patches, refs_snapshot


def _am_tree(project, texts, tmp, base=TAG1) -> str:
    """Tree id of plain `git am -3` of the same patch files on the same base."""
    clone = tmp / "am-ref"
    git(tmp, "clone", "-q", project.upstream.url, str(clone))
    git(clone, "checkout", "-q", "--detach", base)
    files = sorted(project.stack_dir().glob("*.patch"))
    assert len(files) == len(texts)
    git(clone, "am", "-3", *map(str, files))
    return git(clone, "rev-parse", "HEAD^{tree}")


def test_apply_git_source_one_line_per_patch_and_same_tree_as_git_am(project, clean_stack, tmp_path):
    r = project.run("apply", REF1)
    assert r.rc == 0, r
    lines = [l for l in r.out.splitlines() if l.strip().startswith(("1 ", "2 ", "3 "))]
    assert len(lines) == 3 and all("clean" in l for l in lines), r.err
    names = sorted(p.name for p in project.stack_dir().glob("*.patch"))
    for name, line in zip(names, lines):
        assert name in line
    co = project.checkout()
    # base is the locked commit; branch holds base + one commit per patch
    assert git(co, "rev-parse", "refs/dsadapt/base") == project.upstream.commits[TAG1]
    assert git(co, "symbolic-ref", "--short", "HEAD") == f"dsadapt/{TAG1}"
    assert git(co, "rev-list", "--count", "refs/dsadapt/base..HEAD") == "3"
    subjects = git(co, "log", "--format=%s", "refs/dsadapt/base..HEAD").splitlines()
    assert subjects == ["add a new helper module", "mod and util: deeper default, bigger step",
                        "mod: default scoring to sigmoid"]
    assert git(co, "log", "-1", "--format=%an <%ae>", "HEAD~2") == "Ada Dev <ada@example.org>"
    assert (co / "vllm" / "newmod.py").read_text() == "VALUE = 1\n"
    assert git(co, "status", "--porcelain") == ""
    assert git(co, "rev-parse", "HEAD^{tree}") == _am_tree(project, clean_stack, tmp_path)
    st = json.loads((co / ".git" / "dsadapt" / "state.json").read_text())
    assert st["source"]["kind"] == "git" and st["source"]["verified"] == "commit id matches the lock"
    assert st["op"] is None and st["applied"]["head"] == git(co, "rev-parse", "HEAD")


def test_apply_says_which_source_it_used_and_why_earlier_ones_were_passed_over(project, clean_stack):
    """The text output says it, not only --json (docs/user-guide.md, "Apply the stack")."""
    project.env["DSADAPT_SOURCES"] = "mirror,git"  # no mirror configured: passed over, then git
    r = project.run("apply", REF1)
    assert r.rc == 0, r
    assert "(source: git " in r.out and "  passed over mirror: " in r.out, r.out
    assert "  verified: " in r.out
    doc = json.loads(project.run("apply", REF1, "--json").out)
    assert doc["source"]["passed_over"] and doc["source"]["passed_over"][0].startswith("mirror: ")
    assert f"  passed over {doc['source']['passed_over'][0]}" in r.out


def test_apply_twice_is_a_noop_that_says_so(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    before = refs_snapshot(co)
    r = project.run("apply", REF1)
    assert r.rc == 0 and "already applied" in r.out and "nothing to do" in r.out, r
    assert refs_snapshot(co) == before
    rj = project.run("apply", REF1, "--json")
    assert rj.json()["status"] == "noop" and rj.json()["noop"] is True


def test_same_inputs_give_same_commit_ids(project, clean_stack, tmp_path):
    """dsadapt commits with fixed dates: two fresh applies give identical heads."""
    assert project.run("apply", REF1).rc == 0
    head1 = git(project.checkout(), "rev-parse", "HEAD")
    dates = git(project.checkout(), "log", "--format=%ad %cd", "--date=raw", "refs/dsadapt/base..HEAD")
    assert dates.splitlines() == ["1700000000 +0000 1700000000 +0000"] * 3
    r = project.run("apply", REF1, env={"DSADAPT_WORKDIR": str(tmp_path / "work2")})
    assert r.rc == 0, r
    assert git(tmp_path / "work2" / "checkouts" / "vllm" / TAG1, "rev-parse", "HEAD") == head1


def test_conflict_stops_names_patch_and_files_status_says_stopped(project):
    conflicting_stack(project)
    r = project.run("apply", REF1)
    assert r.rc == 4, r
    err = r.err.splitlines()
    assert err[-2].startswith("error: ") and err[-1].startswith("hint: ")
    assert "patch 2/3" in r.err and "0002-mod-default-scoring-to-tanh.patch" in r.err and "vllm/mod.py" in r.err
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "stopped" and "1/3 patches done" in st["detail"]
    assert "stopped on a conflict in 0002-mod-default-scoring-to-tanh.patch" in st["detail"], st
    assert st["next"] == f"dsadapt continue {REF1}" and st["op"]["phase"] == "stopped"
    # the table names it too, in its `next` column
    table = project.run("status", env={"COLUMNS": "250"}).out.splitlines()
    assert table[1].split()[-1] == "next" and table[3].endswith(f"dsadapt continue {REF1}"), table
    # apply again refuses while stopped
    again = project.run("apply", REF1)
    assert again.rc == 4 and "in progress" in again.err


def test_continue_after_resolving_gives_changed(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    resolved = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                    'scoring = getattr(config, "scoring_func", None) or "tanh"')
    (co / "vllm" / "mod.py").write_text(resolved)
    # continue without `git add` stays stopped
    r0 = project.run("continue", REF1)
    assert r0.rc == 4, r0
    git(co, "add", "vllm/mod.py")
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    outcomes = [o["outcome"] for o in r.json()["outcomes"]]
    assert outcomes == ["clean", "changed", "clean"]
    assert (co / "vllm" / "mod.py").read_text() == resolved
    assert git(co, "rev-list", "--count", "refs/dsadapt/base..HEAD") == "3"
    assert git(co, "status", "--porcelain") == ""


def test_a_resolution_must_be_refreshed_before_apply_runs_again(project):
    """After `continue` (changed) the branch no longer equals the stack: status says so, apply
    refuses to redo the conflict, and refresh exports the resolution."""
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    (co / "vllm" / "mod.py").write_text(edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                                             'scoring = "tanh"'))
    git(co, "add", "vllm/mod.py")
    assert project.run("continue", REF1).rc == 0
    st = {s["ref"]: s for s in project.run("status", "--json").json()["checkouts"]}[REF1]
    assert st["state"] == "diverged" and "refresh" in st["detail"]
    head = git(co, "rev-parse", "HEAD")
    r = project.run("apply", REF1)
    assert r.rc == 4 and "not exported" in r.err and "refresh" in r.err, r  # WorkspaceError
    assert git(co, "rev-parse", "HEAD") == head
    assert project.run("refresh", REF1).rc == 0
    st = {s["ref"]: s for s in project.run("status", "--json").json()["checkouts"]}[REF1]
    assert st["state"] == "stack applied"
    assert "already applied" in project.run("apply", REF1).out


def test_skip_drops_the_patch(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    r = project.run("skip", "--json")  # no ref: the one apply in progress
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["clean", "skipped", "clean"]
    co = project.checkout()
    assert (co / "vllm" / "mod.py").read_text() == P1_MOD
    assert git(co, "log", "--format=%s", "refs/dsadapt/base..HEAD").splitlines() == [
        "util: bigger step", "mod: default scoring to sigmoid"]


def test_abort_restores_exactly_the_state_before_apply(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    before = refs_snapshot(co)
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    assert refs_snapshot(co) != before
    r = project.run("abort", REF1)
    assert r.rc == 0, r
    assert refs_snapshot(co) == before
    assert not (co / ".git" / "rebase-apply").exists()
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "stack outdated"


def test_abort_leaves_no_branch_that_did_not_exist(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    git(co, "checkout", "-q", "-b", "mywork", "refs/dsadapt/base")
    git(co, "branch", "-q", "-D", f"dsadapt/{TAG1}")
    before = refs_snapshot(co)
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    assert project.run("abort").rc == 0
    assert refs_snapshot(co) == before
    assert git(co, "rev-parse", "--verify", "--quiet", f"refs/heads/dsadapt/{TAG1}", check=False) == ""
    assert git(co, "symbolic-ref", "--short", "HEAD") == "mywork"


def test_dirty_checkout_refused_then_force_keeps_work_in_backup(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    (co / "vllm" / "util.py").write_text("# my uncommitted work\n")
    (co / "scratch.txt").write_text("untracked notes\n")
    head = git(co, "rev-parse", "HEAD")
    r = project.run("apply", REF1)
    assert r.rc == 4 and "uncommitted changes" in r.err and "vllm/util.py" in r.err, r
    assert (co / "vllm" / "util.py").read_text() == "# my uncommitted work\n"
    assert git(co, "rev-parse", "HEAD") == head
    r = project.run("apply", REF1, "--force")
    assert r.rc == 0, r
    assert git(co, "status", "--porcelain") == ""
    backups = git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/").splitlines()
    assert backups, "the dirty work must be kept in a backup ref"
    found = False
    for b in backups:
        tracked = git(co, "show", f"{b}:vllm/util.py", check=False)
        untracked = git(co, "show", f"{b}^3:scratch.txt", check=False)
        if tracked == "# my uncommitted work" and untracked == "untracked notes":
            found = True
    assert found, backups


def test_abort_after_force_over_dirty_work_gives_the_work_back(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    (co / "vllm" / "util.py").write_text("# my uncommitted work\n")
    (co / "scratch.txt").write_text("untracked notes\n")
    before = refs_snapshot(co)
    conflicting_stack(project)
    assert project.run("apply", REF1, "--force").rc == 4
    assert project.run("abort", REF1).rc == 0
    assert refs_snapshot(co) == before
    assert (co / "vllm" / "util.py").read_text() == "# my uncommitted work\n"
    assert (co / "scratch.txt").read_text() == "untracked notes\n"


def test_force_works_without_any_git_identity(project, clean_stack, tmp_path):
    """The checkout carries no identity of its own (the user's commits must carry theirs); dsadapt's
    own backup commits still work where the user has configured none."""
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    assert git(co, "config", "--local", "user.name", check=False) == ""
    (co / "vllm" / "util.py").write_text("# wip\n")
    empty = tmp_path / "empty.gitconfig"
    empty.write_text("")
    r = project.run("apply", REF1, "--force", env={"GIT_CONFIG_GLOBAL": str(empty)})
    assert r.rc == 0, r
    backups = git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/").splitlines()
    assert [b for b in backups if git(co, "show", f"{b}:vllm/util.py") == "# wip"]


def test_unexported_commits_refused_without_force(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    (co / "vllm" / "util.py").write_text("# local commit\n")
    git(co, "commit", "-q", "-am", "local work")
    mine = git(co, "rev-parse", "HEAD")
    r = project.run("apply", REF1)
    assert r.rc == 4 and "1 commit(s) not exported" in r.err, r
    assert git(co, "rev-parse", "HEAD") == mine
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "diverged"
    r = project.run("apply", REF1, "--force", "--json")
    assert r.rc == 0, r
    assert r.json()["backup_ref"]
    assert git(co, "rev-parse", r.json()["backup_ref"]) == mine
    assert git(co, "rev-parse", "HEAD") != mine


# ---------------------------------------------------------------- killed runs

HOOK = """#!/bin/sh
# fixture hook: on the 2nd patch, say so and hang until killed
if grep -q "bigger step" "$1"; then
  touch "{marker}"
  sleep 60
fi
exit 0
"""


def git_with_hooks(tmp_path, hooks_dir) -> dict[str, str]:
    """PATH for a subprocess whose `git` runs the hooks in hooks_dir (a `-c` beats dsadapt's hooksPath)."""
    import shutil

    bin_dir = tmp_path / "git-with-hooks"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "git"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("git")} -c core.hooksPath={hooks_dir} "$@"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _kill_mid_apply(project, tmp_path, hook_name="applypatch-msg"):
    """Apply in a subprocess and SIGKILL it while `git am` runs a hook for the 2nd patch
    (applypatch-msg: before it is applied; post-applypatch: committed, but am has not counted it)."""
    assert project.run("apply", REF1).rc == 0  # creates the checkout (the hook lives in it)
    co = project.checkout()
    before = refs_snapshot(co)
    # a new stack version so apply has work to do; the 2nd patch hangs in the hook
    texts = make_patches(project.upstream, tmp_path / "mk2", TAG1, [
        (commit_msg("mod: default scoring to sigmoid v2"), {"vllm/mod.py": P1_MOD}),
        (commit_msg("util: bigger step"), {"vllm/util.py": "def helper(x):\n    return x + 5\n"}),
        (commit_msg("add another module"), {"vllm/other.py": "OTHER = 2\n"}),
    ])
    project.write_stack(texts)
    marker = tmp_path / "hook-reached"
    hook = co / ".git" / "hooks" / hook_name
    hook.write_text(HOOK.replace("{marker}", str(marker)).replace('"$1"', '"$1" .git/rebase-apply/final-commit'))
    hook.chmod(0o755)
    # dsadapt runs git with hooks off (trees are data); this test's git turns them back on
    proc = project.spawn("apply", REF1, "--force", env=git_with_hooks(tmp_path, co / ".git" / "hooks"))
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "hook never reached"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    hook.unlink()
    return co, before


def test_killed_apply_explained_by_status_then_continue_finishes(project, clean_stack, tmp_path):
    co, _ = _kill_mid_apply(project, tmp_path)
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "interrupted", st
    assert "interrupted while applying 0002-" in st["detail"] and st["next"] == f"dsadapt continue {REF1}", st
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    assert len(r.json()["outcomes"]) == 3
    assert git(co, "log", "--format=%s", "refs/dsadapt/base..HEAD").splitlines() == [
        "add another module", "util: bigger step", "mod: default scoring to sigmoid v2"]
    assert (co / "vllm" / "util.py").read_text() == "def helper(x):\n    return x + 5\n"
    assert git(co, "status", "--porcelain") == ""
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"


def test_killed_apply_undone_by_abort(project, clean_stack, tmp_path):
    co, before = _kill_mid_apply(project, tmp_path)
    r = project.run("abort", REF1)
    assert r.rc == 0, r
    assert refs_snapshot(co) == before
    assert not (co / ".git" / "rebase-apply").exists()


def test_killed_between_commit_and_am_bookkeeping_is_not_applied_twice(project, clean_stack, tmp_path):
    """Killed after git committed patch 2 but before am counted it: continue keeps that commit once."""
    co, _ = _kill_mid_apply(project, tmp_path, "post-applypatch")
    assert git(co, "log", "-1", "--format=%s") == "util: bigger step"
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt continue {REF1}", st
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    assert [o["name"][:4] for o in r.json()["outcomes"]] == ["0001", "0002", "0003"]
    assert git(co, "log", "--format=%s", "refs/dsadapt/base..HEAD").splitlines() == [
        "add another module", "util: bigger step", "mod: default scoring to sigmoid v2"]
    assert git(co, "status", "--porcelain") == ""


# ---------------------------------------------------------------- work-dir lock


def test_concurrent_runs_are_serialized_by_the_workdir_lock(project, clean_stack):
    project.workdir.mkdir(parents=True, exist_ok=True)
    with open(project.workdir / "lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("424242")
        f.flush()
        t0 = time.monotonic()
        r = project.run("apply", REF1, env={"DSADAPT_LOCK_TIMEOUT": "0.5"})
        assert r.rc == 4 and "another dsadapt run holds" in r.err and "424242" in r.err, r
        assert time.monotonic() - t0 >= 0.45
        assert not project.checkout().exists()
        # a run with a longer timeout waits for the holder, then proceeds
        threading.Timer(0.6, lambda: fcntl.flock(f, fcntl.LOCK_UN)).start()
        t0 = time.monotonic()
        r = project.run("apply", REF1, env={"DSADAPT_LOCK_TIMEOUT": "20"})
        assert r.rc == 0, r
        assert time.monotonic() - t0 >= 0.5


def test_lock_held_by_another_process(project, clean_stack):
    import subprocess
    import sys

    project.workdir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl,sys,time\n"
        f"f=open({str(project.workdir / 'lock')!r},'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = project.run("apply", REF1, env={"DSADAPT_LOCK_TIMEOUT": "0.3"})
        assert r.rc == 4 and "another dsadapt run holds" in r.err, r
    finally:
        holder.kill()
        holder.wait()
    assert project.run("apply", REF1).rc == 0


def test_abort_of_the_very_first_apply_leaves_the_clean_base(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    assert project.run("abort", REF1).rc == 0
    co = project.checkout()
    base = git(co, "rev-parse", "refs/dsadapt/base")
    assert git(co, "rev-parse", "HEAD") == base == git(co, "rev-parse", f"refs/heads/dsadapt/{TAG1}")
    # the base, the copy of the state record, the branch: no backup, no stack snapshot left behind
    assert git(co, "for-each-ref", "--format=%(refname)").splitlines() == ["refs/dsadapt/base", "refs/dsadapt/state",
                                                                          f"refs/heads/dsadapt/{TAG1}"]
    assert git(co, "status", "--porcelain") == ""
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "clean base"


def test_patch_made_on_another_tree_stops_naming_its_files(project):
    """A patch whose pre-image blob is not in the checkout cannot 3-way merge: the stop still names
    the files it touches, and skip goes on."""
    from conftest import TAG2, UTIL_V1

    newer = UTIL_V1 + "\n\ndef third(x):\n    return x - 1\n"
    (stale,) = make_patches(project.upstream, project.tmp / "mk-newer", TAG2, [
        (commit_msg("util: third subtracts two"), {"vllm/util.py": edit(newer, "return x - 1", "return x - 2")})])
    (ok,) = make_patches(project.upstream, project.tmp / "mk-ok", TAG1, [
        (commit_msg("add a new helper module"), {"vllm/newmod.py": "VALUE = 1\n"})])
    project.write_stack([stale, ok])
    r = project.run("apply", REF1)
    assert r.rc == 4, r
    assert "patch 1/2 0001-util-third-subtracts-two.patch" in r.err and "vllm/util.py" in r.err
    r = project.run("skip", REF1, "--json")
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["skipped", "clean"]
    assert (project.checkout() / "vllm" / "util.py").read_text() == UTIL_V1


def test_existing_foreign_directory_is_not_overwritten(project, clean_stack):
    co = project.checkout()
    co.mkdir(parents=True)
    (co / "precious.txt").write_text("mine\n")
    r = project.run("apply", REF1)
    assert r.rc == 4 and "is not a dsadapt checkout" in r.err, r
    assert sorted(p.name for p in co.iterdir()) == ["precious.txt"]

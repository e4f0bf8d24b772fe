"""The transaction's promises one by one: truthful status, stale git locks, refresh that cannot
clobber, binary round trips, leftovers and gc, work made during a stop, lazy start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import (
    MOD_V1,
    P1_MOD,
    REF1,
    REPO_ROOT,
    TAG1,
    TAG2,
    commit_msg,
    conflicting_stack,
    edit,
    files_snapshot,
    git,
    make_patches,
    refs_snapshot,
)


def _applied(project):
    r = project.run("apply", REF1)
    assert r.rc == 0, r
    return project.checkout()


def _status(project, ref=REF1):
    return {c["ref"]: c for c in project.run("status", "--json").json()["checkouts"]}[ref]


# ---------------------------------------------------------------- status


def test_one_broken_stack_never_breaks_status_for_the_others(project, clean_stack):
    _applied(project)
    d = project.stack_dir(TAG2)
    d.mkdir(parents=True)
    (d / "series").write_text("0001-gone.patch\n")
    r = project.run("status", "--json")
    assert r.rc == 0, r
    sts = {c["ref"]: c for c in r.json()["checkouts"]}
    assert sts[REF1]["state"] == "stack applied"
    assert sts[f"vllm@{TAG2}"]["state"] == "broken" and "0001-gone.patch" in sts[f"vllm@{TAG2}"]["detail"]
    assert project.run("status").rc == 0


def test_status_tells_stopped_from_interrupted_from_done_and_names_the_next_command(project, clean_stack):
    _applied(project)
    st = _status(project)
    assert st["state"] == "stack applied" and st["next"] is None and "3 patches on" in st["detail"]
    conflicting_stack(project)
    st = _status(project)
    assert st["state"] == "stack outdated" and st["next"] == f"dsadapt apply {REF1}"
    assert project.run("apply", REF1).rc == 4
    st = _status(project)
    assert st["state"] == "stopped" and st["next"] == f"dsadapt continue {REF1}" and st["op"]["kind"] == "apply"
    # an interrupted `skip` (recorded, not yet run) is interrupted, not stopped
    state_path = project.checkout() / ".git" / "dsadapt" / "state.json"
    state = json.loads(state_path.read_text())
    state["op"]["phase"] = "skip"
    state_path.write_text(json.dumps(state))
    st = _status(project)
    assert st["state"] == "interrupted" and "during `dsadapt skip`" in st["detail"], st
    r = project.run("continue", REF1, "--json")  # finishes what was interrupted: the skip
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["clean", "skipped", "clean"]
    assert _status(project)["state"] == "diverged"


def test_a_stale_index_lock_is_named_by_status_and_removed_by_the_next_command(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    (co / ".git" / "index.lock").write_text("")  # what a git killed while writing the index leaves
    st = _status(project)
    assert st["locks"] == [".git/index.lock"] and "the next dsadapt command removes it" in st["detail"], st
    r = project.run("skip", REF1)
    assert r.rc == 0, r
    assert not (co / ".git" / "index.lock").exists()
    assert "removed stale .git/index.lock" in r.err


def test_an_index_lock_held_by_a_running_git_is_left_alone(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    (co / ".git" / "index.lock").write_text("")
    holder = subprocess.Popen(["git", "cat-file", "--batch"], cwd=co, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        st = _status(project)
        assert f"held by running git (pid {holder.pid})" in st["detail"], st
        t0 = time.monotonic()
        r = project.run("skip", REF1, env={"DSADAPT_GIT_WAIT": "0.5"})
        assert r.rc == 4 and f"git is still running in {co} (pid {holder.pid}" in r.err, r
        assert time.monotonic() - t0 >= 0.5
        assert (co / ".git" / "index.lock").exists()
    finally:
        holder.kill()
        holder.wait()
    assert project.run("skip", REF1).rc == 0


# ---------------------------------------------------------------- work made during a stop


def test_abort_at_a_stop_keeps_commits_and_files_made_there(project, clean_stack):
    _applied(project)
    co = project.checkout()
    before = refs_snapshot(co)
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    (co / "notes.txt").write_text("my notes while resolving\n")
    (co / "vllm" / "mod.py").write_text("half resolved\n")
    r = project.run("abort", REF1, "--json")
    assert r.rc == 0, r
    notes = r.json()["notes"]
    assert any("kept in refs/dsadapt/backup/" in n for n in notes), notes
    kept = [n.split("kept in ")[1].split()[0] for n in notes if "kept in refs/dsadapt/backup/" in n][0]
    assert git(co, "show", f"{kept}^3:notes.txt") == "my notes while resolving"
    assert git(co, "show", f"{kept}:vllm/mod.py") == "half resolved"
    after = refs_snapshot(co)
    assert after["HEAD"] == before["HEAD"] and after["status"] == before["status"] == ""
    assert not (co / "notes.txt").exists()


def test_a_resolution_committed_by_hand_at_a_stop_is_the_changed_patch(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    resolved = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")', 'scoring = "both"')
    (co / "vllm" / "mod.py").write_text(resolved)
    git(co, "add", "vllm/mod.py")
    git(co, "commit", "-qm", "my resolution")
    mine = git(co, "rev-parse", "HEAD")
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    outs = r.json()["outcomes"]
    assert [o["outcome"] for o in outs] == ["clean", "changed", "clean"] and outs[1]["commit"] == mine
    assert (co / "vllm" / "mod.py").read_text() == resolved


# ---------------------------------------------------------------- refresh cannot clobber


def test_refresh_refuses_to_overwrite_a_hand_edited_patch_and_force_keeps_a_backup(project, clean_stack):
    co = _applied(project)
    f = sorted(project.stack_dir().glob("0001-*.patch"))[0]
    hand = f.read_text().replace("Covered-By:", "Reported-by: Zoë <zoe@example.org>\nCovered-By:", 1)
    f.write_text(hand)
    (co / "vllm" / "mod.py").write_text((co / "vllm" / "mod.py").read_text().replace('"upstream"', '"patched"'))
    git(co, "commit", "-qam", commit_msg("mod: untouched says patched"))
    before = files_snapshot(project.root)
    r = project.run("refresh", REF1)
    assert r.rc == 4, r
    lines = r.err.strip().split("\n")
    assert lines[0].startswith("error: ") and f.name in lines[0] and "changed (or removed) since it was applied" in lines[0]
    assert lines[-1].startswith("hint: ") and "--force" in r.err
    assert files_snapshot(project.root) == before  # nothing written
    r = project.run("refresh", REF1, "--force", "--json")
    assert r.rc == 0, r
    backup = r.json()["backup"]
    assert backup and git(co, "show", f"{backup}:{f.name}", strip=False) == hand
    assert "Reported-by" not in f.read_text() and (project.stack_dir() / "0004-mod-untouched-says-patched.patch").exists()


def test_a_trailer_added_by_hand_survives_through_apply_then_refresh(project, clean_stack):
    _applied(project)
    f = sorted(project.stack_dir().glob("0002-*.patch"))[0]
    f.write_text(f.read_text().replace("Covered-By:", "Acked-by: Hand <hand@example.org>\nCovered-By:", 1))
    assert _status(project)["state"] == "stack outdated"
    assert project.run("apply", REF1).rc == 0
    r = project.run("refresh", REF1, "--json")
    assert r.rc == 0 and r.json()["changed"] == [], r  # the branch holds the trailer now: nothing to write
    assert "Acked-by: Hand <hand@example.org>" in f.read_text()


def test_refresh_after_a_pull_changed_patches_refuses(project, clean_stack):
    _applied(project)
    newer = make_patches(project.upstream, project.tmp / "mk-pull", TAG1, [
        (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD.replace("sigmoid", "sigmoid2")})])
    (project.stack_dir() / sorted(p.name for p in project.stack_dir().glob("0001-*"))[0]).write_text(newer[0])
    r = project.run("refresh", REF1)
    assert r.rc == 4 and "does not hold that change" in r.err, r


def test_binary_patches_round_trip_byte_exact(project, upstream):
    texts = make_patches(upstream, project.tmp / "mk-bin", TAG1, [
        (commit_msg("add a binary blob"), {"vllm/blob.bin": "\x00\x01\x02binary\xff"}),
        (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD})])
    assert "GIT binary patch" in texts[0] and texts[0].endswith("\n\n"), texts[0][-80:]
    project.write_stack(texts)
    before = files_snapshot(project.stack_dir())
    co = _applied(project)
    assert (co / "vllm" / "blob.bin").read_bytes() == "\x00\x01\x02binary\xff".encode()
    r = project.run("refresh", REF1, "--json")
    assert r.rc == 0 and r.json()["changed"] == [], r
    assert files_snapshot(project.stack_dir()) == before
    assert project.run("verify", REF1).rc == 0


# ---------------------------------------------------------------- leftovers and gc


def test_leftovers_of_killed_runs_are_listed_by_status_and_removed_by_gc(project, clean_stack):
    co = _applied(project)
    dead = 4194300  # above any pid a test machine hands out
    (co.parent / f".{TAG2}.tmp-{dead}").mkdir()
    (co.parent / f".{TAG2}.tmp-{dead}" / "big").write_bytes(b"x" * 1000)
    arts = project.workdir / "cache" / "artifacts"
    arts.mkdir(parents=True, exist_ok=True)
    (arts / f".download-{dead}-abc").mkdir()
    (project.stack_dir() / f".0001-x.patch.tmp-{dead}-q1w2").write_text("half")
    (project.root / "dist").mkdir()
    (project.root / "dist" / f".vllm-1.0.0+ds.1-py3-none-any.whl.tmp-{dead}").write_text("half")
    live = project.stack_dir() / f".series.tmp-{os.getpid()}-live"
    live.write_text("a live run's")
    st = project.run("status", "--json").json()
    paths = sorted(lo["path"] for lo in st["leftovers"])
    assert len(paths) == 4 and str(live) not in paths, paths
    assert "dsadapt gc" in project.run("status").err
    dry = project.run("gc", "--dry-run", "--json")
    assert dry.rc == 0 and len(dry.json()["leftovers"]) == 4 and (arts / f".download-{dead}-abc").exists()
    r = project.run("gc", "--json")
    assert r.rc == 0 and r.json()["bytes"] >= 1000 and r.json()["failed"] == [], r
    assert not (arts / f".download-{dead}-abc").exists() and not (co.parent / f".{TAG2}.tmp-{dead}").exists()
    assert live.exists() and project.run("status", "--json").json()["leftovers"] == []
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"


def test_a_checkout_a_killed_run_was_making_is_cleaned_by_the_next_apply(project, clean_stack):
    tmp = project.workdir / "checkouts" / "vllm" / f".{TAG1}.tmp-4194301"
    tmp.mkdir(parents=True)
    (tmp / "junk").write_text("x")
    assert project.run("apply", REF1).rc == 0
    assert not tmp.exists()


# ---------------------------------------------------------------- state, dates


def test_rebased_commits_carry_the_fixed_date(tmp_path):
    import rebase_fixture as fx

    from patcher.formats.lock import load_lock
    from patcher.formats.pinref import PinRef
    from patcher.stack.rebase.carry import rebase_stack

    up = fx.make_upstream(tmp_path)
    proj = fx.make_project(tmp_path, up)
    cfg = fx.config(proj, tmp_path)
    res, _ = rebase_stack(cfg, load_lock(cfg.lock_path), PinRef("vllm", "v1.0.0"), "v1.0.0")
    dates = git(res.checkout and cfg.checkout_dir("vllm", "v1.0.0"), "log", "--format=%ad %cd", "--date=raw",
                "refs/dsadapt/base..HEAD").splitlines()
    assert dates and set(dates) == {"1700000000 +0000 1700000000 +0000"}


def test_a_state_file_of_the_previous_format_is_read_and_its_op_aborted(project, clean_stack):
    co = _applied(project)
    state_path = co / ".git" / "dsadapt" / "state.json"
    head = git(co, "rev-parse", "HEAD")
    old = {"ref": REF1, "source": json.loads(state_path.read_text())["source"], "base": git(co, "rev-parse", "refs/dsadapt/base"),
           "applied": {"stack_hash": "x" * 64, "head": head, "needs_refresh": []},
           "op": {"kind": "apply", "orig_branch": f"dsadapt/{TAG1}", "orig_head": head, "branch_head_before": head,
                  "outcomes": [], "patches": [], "backup_ref": None, "dirty_backup": None}}
    state_path.write_text(json.dumps(old))
    st = _status(project)
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt abort {REF1}", st
    assert project.run("apply", REF1).rc == 4
    assert project.run("abort", REF1).rc == 0
    assert project.run("apply", REF1).rc == 0
    assert _status(project)["state"] == "stack applied"


def test_a_schema_1_op_halfway_is_migrated_and_aborted_through_the_transaction(project, clean_stack):
    """A schema-1 apply stopped after its first patch, with the user's work stashed: migrated on
    read into the current record (phase legacy), refused by continue / skip / apply with the command
    that finishes it, and aborted by the one transaction: branch, HEAD and the work come back."""
    co = _applied(project)
    state_path = co / ".git" / "dsadapt" / "state.json"
    head = git(co, "rev-parse", "HEAD")
    (co / "vllm" / "util.py").write_text("# my work\n")
    (co / "notes.txt").write_text("mine\n")
    git(co, "stash", "push", "-q", "--include-untracked")
    stash = git(co, "rev-parse", "stash@{0}")
    git(co, "update-ref", "refs/dsadapt/backup/1", stash)
    git(co, "stash", "drop", "-q")
    base = git(co, "rev-parse", "refs/dsadapt/base")
    git(co, "checkout", "-q", "-f", "-B", f"dsadapt/{TAG1}", base)  # what a schema-1 apply did first
    git(co, "am", "-q", "-3", str(sorted(project.stack_dir().glob("0001-*.patch"))[0]))
    old = {"ref": REF1, "source": json.loads(state_path.read_text())["source"], "base": base,
           "applied": {"stack_hash": "x" * 64, "head": head},
           "op": {"kind": "apply", "stack_hash": "y" * 64, "orig_branch": f"dsadapt/{TAG1}", "orig_head": head,
                  "branch_head_before": head, "patches": [{"name": "0001-a.patch", "subject": "a"}],
                  "outcomes": [{"index": 1, "name": "0001-a.patch", "subject": "a", "outcome": "clean"}],
                  "backup_ref": None, "dirty_backup": "refs/dsadapt/backup/1"}}
    state_path.write_text(json.dumps(old))
    st = _status(project)
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt abort {REF1}" and "older dsadapt" in st["detail"], st
    for cmd in ("continue", "skip", "apply"):
        r = project.run(cmd, REF1)
        assert r.rc == 4 and f"dsadapt abort {REF1}" in r.err, (cmd, r)
    r = project.run("abort", REF1)
    assert r.rc == 0, r
    assert git(co, "rev-parse", "HEAD") == head and git(co, "symbolic-ref", "HEAD") == f"refs/heads/dsadapt/{TAG1}"
    assert (co / "vllm" / "util.py").read_text() == "# my work\n" and (co / "notes.txt").read_text() == "mine\n"
    assert json.loads(state_path.read_text())["schema"] == 2 and json.loads(state_path.read_text())["op"] is None
    assert "legacy_op" not in json.loads(state_path.read_text())


# ---------------------------------------------------------------- start-up


def test_help_imports_no_command_module_and_its_lines_are_the_commands_own():
    code = ("import sys; from patcher.cli.main import main; rc = main(['--help']); "
            "print(sorted(m for m in sys.modules if (m.startswith('patcher.cli.commands.') and m != 'patcher.cli.commands.common')"
            " or m in ('git', 'rich', 'patcher.stack.apply', 'patcher.stack.checkout', 'patcher.stack.transaction')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
    assert "gc" in r.stdout and "Remove what killed runs left behind" in r.stdout
    from patcher.cli.main import COMMANDS, cli

    for name, (_, _, text) in COMMANDS.items():
        cmd = cli.commands[name]
        own = cmd.short_help or " ".join((cmd.help or "").split("\n\n")[0].split())
        assert own == text, f"COMMANDS[{name!r}] help line differs from the command's own: update patcher/cli/main.py"


def test_status_imports_neither_gitpython_nor_rich_when_piped(project, clean_stack):
    code = ("import sys; from patcher.cli.main import main; rc = main(['status']); "
            "print('MODULES', sorted(m for m in ('git', 'rich') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                       env={**os.environ, **project.env, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr
    assert "MODULES []" in r.stdout, r.stdout


def test_abort_of_a_killed_refresh_puts_patches_back_byte_for_byte(project, clean_stack):
    from fault_harness import fork_run, tree_sha

    co = _applied(project)
    f = sorted(project.stack_dir().glob("0001-*.patch"))[0]
    f.write_text(f.read_text().replace("Covered-By:", "Acked-by: Hand <hand@example.org>\nCovered-By:", 1))
    (co / "vllm" / "mod.py").write_text((co / "vllm" / "mod.py").read_text().replace('"upstream"', '"patched"'))
    git(co, "commit", "-qam", commit_msg("mod: untouched says patched"))
    before = tree_sha(project.stack_dir())
    killed, _ = fork_run(project, ["refresh", REF1, "--force"], {"DSADAPT_FAULT": "written:2"})
    assert killed
    assert tree_sha(project.stack_dir()) != before  # half written
    st = _status(project)
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt refresh {REF1}" and "abort" in st["detail"], st
    r = project.run("abort", REF1)
    assert r.rc == 0, r
    assert tree_sha(project.stack_dir()) == before
    assert _status(project)["state"] == "diverged"  # the new commit is still there, not exported
    assert git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/") == ""


def test_durable_writes_keep_the_file_mode(tmp_path):
    from patcher.base.fsutil import atomic_write_text

    f = tmp_path / "upstream.lock"
    f.write_text("old\n")
    f.chmod(0o644)
    atomic_write_text(f, "new\n")
    assert f.read_text() == "new\n" and (f.stat().st_mode & 0o777) == 0o644
    g = tmp_path / "new.patch"
    atomic_write_text(g, "x\n")
    assert (g.stat().st_mode & 0o777) == (0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m

"""The stack commands' smaller promises: a killed rebase's rerun says what finishes it, leftovers
of killed runs are removed by the next run that works there, a disk too full is said before any
progress line, a file-size limit is named for what it is, status counts what a running git am has
done, and `verify` leaves the checkout's .git byte for byte as it was, remembering what compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import rebase_fixture as fx
from conftest import REF1, REPO_ROOT, TAG1, Project, Upstream, commit_msg, files_snapshot, make_patches
from fault_harness import copy_project, count_events, fork_run

DEAD = 4194300  # above any pid a test machine hands out


def _rebase_project(tmp_path) -> Project:
    up = fx.make_upstream(tmp_path)
    root = fx.make_project(tmp_path, up)
    env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "work"),
           "DSADAPT_CACHE": str(tmp_path / "work" / "cache"), "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "",
           "DSADAPT_LOCK_TIMEOUT": "5"}
    return Project(root, Upstream(up), env, tmp_path)


def test_a_rebase_run_again_at_its_stop_names_continue_not_the_new_stack(tmp_path):
    p = _rebase_project(tmp_path)
    r = p.run("rebase", "vllm@v1.0.0", "--onto", "v1.1.0")
    assert r.rc == 4 and "does not apply" in r.err, r  # the fixture's patch 5 conflicts
    again = p.run("rebase", "vllm@v1.0.0", "--onto", "v1.1.0")
    assert again.rc == 4 and "already has a stack" not in again.err, again
    assert "in progress" in again.err and "dsadapt continue vllm@v1.1.0" in again.err, again


def test_a_killed_rebase_run_again_goes_on_where_it_died(tmp_path):
    p = _rebase_project(tmp_path)
    p.workdir.mkdir()
    argv = ["rebase", "vllm@v1.0.0", "--onto", "v1.1.0"]
    events = count_events(copy_project(p, tmp_path / "count"), argv)
    # kill it late: after it pinned NEW and made NEW's checkout, before it stopped
    k = next(i for i, e in enumerate(events, 1) if e.startswith("git-start am"))
    killed, _ = fork_run(p, argv, {"DSADAPT_FAULT": f"any:{k}"})
    assert killed
    r = p.run(*argv)
    assert "already has a stack" not in r.err, r
    assert r.rc == 4 and "does not apply" in r.err, r  # it went on, to the same stop as an unkilled run
    st = {c["ref"]: c for c in p.run("status", "--json").json()["checkouts"]}["vllm@v1.1.0"]
    assert st["state"] == "stopped" and st["next"] == "dsadapt continue vllm@v1.1.0", st


# ---------------------------------------------------------------- leftovers


def test_the_next_run_removes_what_killed_runs_left_where_it_works(project, clean_stack):
    from conftest import artifact_toml, lock_text, make_wheel

    wheel, sha = make_wheel(project.upstream, project.tmp / "artifacts")
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, sha)))
    arts = project.workdir / "cache" / "artifacts"
    arts.mkdir(parents=True)
    (arts / f".download-{DEAD}-abc").mkdir()
    (arts / f".download-{DEAD}-abc" / "part.whl").write_bytes(b"half")
    live = arts / f".download-{os.getpid()}-live"
    live.mkdir()
    dist = project.root / "dist"
    dist.mkdir()
    (dist / f".vllm-1.0.0+ds.1-py3-none-any.whl.tmp-{DEAD}").write_text("half")
    scratch = project.workdir / "tmp" / f"verify-{DEAD}-1"
    (scratch / "objects").mkdir(parents=True)
    r = project.run("build", REF1, "--json")
    assert r.rc == 0, r
    assert not (arts / f".download-{DEAD}-abc").exists() and live.exists()
    assert not (dist / f".vllm-1.0.0+ds.1-py3-none-any.whl.tmp-{DEAD}").exists()
    assert project.run("status", "--json").json()["leftovers"] == [{"path": str(scratch), "kind": "scratch",
                                                                   "why": f"verify's scratch objects of a dead run "
                                                                          f"(pid {DEAD})", "bytes": None}]
    assert project.run("verify", REF1).rc == 0
    assert not scratch.exists() and project.run("status", "--json").json()["leftovers"] == []


def test_a_built_wheel_is_synced_before_its_name_appears(project, clean_stack, monkeypatch):
    from conftest import artifact_toml, lock_text, make_wheel

    wheel, sha = make_wheel(project.upstream, project.tmp / "artifacts")
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, sha)))
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync " + os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1])
        return real_fsync(fd)

    def replace(a, b):
        calls.append(f"replace {Path(a).name} {Path(b).name}")
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    r = project.run("build", REF1, "--json")
    assert r.rc == 0, r
    name = Path(r.json()["artifact"]).name
    at = calls.index(next(c for c in calls if c.startswith("replace ") and c.endswith(" " + name)))
    tmp_name = calls[at].split()[1]
    assert f"fsync {tmp_name}" in calls[:at], calls
    assert calls[at + 1] == "fsync dist", calls  # the directory entry, too


# ---------------------------------------------------------------- the machine's limits, in words


def test_a_file_size_limit_stopping_git_am_is_named_as_such(project, upstream):
    texts = make_patches(upstream, project.tmp / "mk-big", TAG1, [
        (commit_msg("add a big zero file"), {"vllm/zeros.bin": "\x00" * 400_000})])
    assert "GIT binary patch" in texts[0] and len(texts[0]) < 20_000
    project.write_stack([])
    assert project.run("apply", REF1).rc == 0  # the checkout, made without a limit
    project.write_stack(texts)
    env = {**os.environ, **project.env, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run(["bash", "-c", f"ulimit -f 200; exec {sys.executable} -m patcher.cli.main apply {REF1} --force"],
                       env=env, cwd=project.root, capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 4 and len(lines) == 2, r
    assert "SIGXFSZ" in lines[0] and "ulimit -f" in lines[0] and "above" not in r.stderr, r
    assert "dsadapt continue" in lines[1] and "ulimit -f unlimited" in lines[1], r
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt continue {REF1}", st
    r = project.run("continue", REF1)  # no limit now: it finishes
    assert r.rc == 0, r
    assert (project.checkout() / "vllm" / "zeros.bin").stat().st_size == 400_000


def test_a_disk_too_full_to_unpack_the_tree_is_said_before_any_progress_line(project, clean_stack, monkeypatch):
    import shutil

    from conftest import artifact_toml, lock_text, make_wheel

    wheel, sha = make_wheel(project.upstream, project.tmp / "artifacts")
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, sha)))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    r = project.run("apply", REF1, env={"DSADAPT_SOURCES": "pypi"})
    lines = r.err.strip().splitlines()
    assert r.rc == 7 and len(lines) == 2 and lines[0].startswith("error: no space left") and "MB are free" in lines[0], r
    assert not project.checkout().exists()


# ---------------------------------------------------------------- status while git am runs


def test_status_counts_the_patches_a_running_am_has_done(project, clean_stack):
    """The record is written when a run stops; am's own counter says how far it got meanwhile."""
    from conftest import MOD_V1, edit

    assert project.run("apply", REF1).rc == 0
    edits = [(commit_msg(f"add module {i}"), {f"vllm/m{i}.py": f"X = {i}\n"}) for i in range(4)]
    edits.insert(0, (commit_msg("mod: sigmoid"), {"vllm/mod.py": edit(MOD_V1, '"softmax")', '"sigmoid")')}))
    edits.insert(4, (commit_msg("mod: tanh"), {"vllm/mod.py": edit(MOD_V1, '"softmax")', '"tanh")')}))
    project.write_stack(make_patches(project.upstream, project.tmp / "mk-6", TAG1, edits, independent=True))
    # dsadapt dies right after its git am stopped on patch 5 (am's counter says 4 done), before it
    # could record anything: a wrapper git kills the whole group when am returns
    wrap = project.tmp / "bin"
    wrap.mkdir()
    (wrap / "git").write_text('#!/bin/sh\nif [ "$1" = am ]; then\n  "$REAL_GIT" "$@"\n  kill -9 -"$DSADAPT_TEST_PGID"\n'
                              '  sleep 5\nfi\nexec "$REAL_GIT" "$@"\n')
    (wrap / "git").chmod(0o755)
    real = subprocess.run(["which", "git"], capture_output=True, text=True).stdout.strip()
    killed, _ = fork_run(project, ["apply", REF1], {"PATH": f"{wrap}:/usr/bin:/bin", "REAL_GIT": real})
    assert killed
    assert (project.checkout() / ".git" / "rebase-apply" / "next").read_text().strip() == "5"
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "interrupted" and st["op"]["done"] == 4 and "(4/6 patches done)" in st["detail"], st
    assert project.run("continue", REF1).rc == 4  # and it goes on: to the stop on patch 5


# ---------------------------------------------------------------- verify in a place of its own


def _git_dir_bytes(co: Path) -> dict[str, str]:
    return files_snapshot(co / ".git")


def test_verify_leaves_the_checkouts_git_dir_byte_for_byte_whatever_the_outcome(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    before = _git_dir_bytes(co)
    assert project.run("verify", REF1).rc == 0
    assert _git_dir_bytes(co) == before
    # a stack that does not apply, and one whose python does not compile: the same
    texts = make_patches(project.upstream, project.tmp / "mk-bad", TAG1, [
        (commit_msg("broken python"), {"vllm/broken.py": "def f(:\n"})])
    project.write_stack(texts)
    assert project.run("verify", REF1).rc == 1
    assert _git_dir_bytes(co) == before
    stale = clean_stack[1].replace("return x + 1", "return x + 100")
    project.write_stack([stale])
    assert project.run("verify", REF1).rc == 1
    assert _git_dir_bytes(co) == before
    assert not list((project.workdir / "tmp").iterdir())  # its own place is gone too


def test_verify_compiles_each_blob_once_and_a_damaged_memory_costs_only_time(project, clean_stack):
    first = project.run("verify", REF1, "--json").json()["stacks"][0]
    assert first["ok"] and first["compiled"] == 3 and first["compiled_now"] == 3, first
    again = project.run("verify", REF1, "--json").json()["stacks"][0]
    assert again["ok"] and again["compiled"] == 3 and again["compiled_now"] == 0, again
    cache = next((project.workdir / "compiled").iterdir())
    cache.write_bytes(b"\x00garbage\n" + cache.read_bytes()[:17])  # damaged: a partial line, junk
    third = project.run("verify", REF1, "--json").json()["stacks"][0]
    assert third["ok"] and third["compiled"] == 3 and third["compiled_now"] == 3, third
    cache.unlink()
    assert project.run("verify", REF1, "--json").json()["stacks"][0]["compiled_now"] == 3
    # a broken file is never remembered as good
    texts = make_patches(project.upstream, project.tmp / "mk-bad", TAG1, [
        (commit_msg("broken python"), {"vllm/broken.py": "def f(:\n"})])
    project.write_stack(texts)
    for _ in range(2):
        r = project.run("verify", REF1, "--json")
        assert r.rc == 1 and any("does not compile" in p for p in r.json()["stacks"][0]["problems"]), r
    _ = json


def test_a_wrong_sha256_in_the_lock_is_said_before_the_download(project, clean_stack, monkeypatch):
    """PyPI's index lists each file's sha256: a lock that pins another is answered in one line,
    before pip downloads anything (and before any progress line)."""
    from conftest import artifact_toml, lock_text

    from patcher.upstream import sources

    name = "vllm-1.0.0-py3-none-any.whl"
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(name, "a" * 64)))
    monkeypatch.setattr(sources, "pypi_files", lambda dist, timeout=30: [
        {"filename": name, "hashes": {"sha256": "b" * 64}}])

    def no_download(*a, **k):
        raise AssertionError("pip download ran")

    monkeypatch.setattr(sources, "_pip_download", no_download)
    r = project.run("apply", REF1, env={"DSADAPT_SOURCES": "pypi"})
    lines = r.err.strip().splitlines()
    assert r.rc == 3 and len(lines) == 2 and "PyPI lists" in lines[0] and "the lock pins aaaaaaaa" in lines[0], r
    assert not project.checkout().exists()

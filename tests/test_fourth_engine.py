"""A fourth engine from a package dsadapt has never seen: the engine contract's proof.

The toy engine (tests/fixtures/toyengine: a DeepSeek-V2 decoder in plain PyTorch, and its
adapter registered through the ``dsadapt.engines`` entry point) is added to a copy of the
project by a lock entry and a stack only. `dsadapt apply`, `build`, `install` and `check` run
on it in subprocesses, and the gate gives real verdicts against HF transformers: the patched
engine passes, the release (RoPE pairs in the Llama layout) fails. Nothing outside the toy's
own lock entry, stack and build output changes in the project (reports go to the work dir).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, files_snapshot, git, make_wheel

pytestmark = pytest.mark.slow  # about a minute: two gate runs of a plain-PyTorch engine and the HF reference

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "toyengine"
TAG = "v0.1.0"
PIN = f"toy@{TAG}"
WHEEL = "toyds-0.1.0-py3-none-any.whl"
GIT_ENV = {"GIT_AUTHOR_NAME": "toyds", "GIT_AUTHOR_EMAIL": "toyds@example.org", "GIT_COMMITTER_NAME": "toyds",
           "GIT_COMMITTER_EMAIL": "toyds@example.org", "GIT_AUTHOR_DATE": "2026-11-30T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-11-30T00:00:00Z"}

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def make_upstream(tmp: Path) -> tuple[Path, str, str]:
    """toyds's upstream repository with its release tag; returns (path, commit, tree)."""
    repo = tmp / "toyds"
    shutil.copytree(FIXTURE / "upstream", repo, ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "toyds 0.1.0", env=GIT_ENV)
    git(repo, "tag", "-a", TAG, "-m", "toyds 0.1.0", env=GIT_ENV)
    return repo, git(repo, "rev-parse", f"{TAG}^{{commit}}"), git(repo, "rev-parse", f"{TAG}^{{tree}}")


def make_release_wheel(repo: Path, dest: Path) -> tuple[Path, str]:
    """The release wheel toyds would publish for the tag (pure Python, no dependencies)."""
    return make_wheel(repo, dest, TAG, under="toyds", dist="toyds", version="0.1.0", extra={})


def toy_lock_entries(repo: Path, commit: str, tree: str, sha256: str) -> str:
    return (f'\n[engines.toy]\ngit = "{repo}"\npypi = [\n    "toyds",\n]\n'
            f'\n[pins."{PIN}"]\nversion = "0.1.0"\ncommit = "{commit}"\ntree = "{tree}"\n'
            f'\n[[pins."{PIN}".artifacts]]\ndist = "toyds"\nvariant = "cpu"\nfile = "{WHEEL}"\n'
            f'sha256 = "{sha256}"\nsource = true\n')


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A copy of the project with the toy engine pinned and its stack, and how to run dsadapt there."""
    tmp = tmp_path_factory.mktemp("toy")
    repo, commit, tree = make_upstream(tmp)
    _, sha256 = make_release_wheel(repo, tmp / "artifacts")
    root = tmp / "project"
    root.mkdir()
    shutil.copy(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    with open(root / "upstream.lock", "a", encoding="utf-8") as f:  # the toy's lock entries ...
        f.write(toy_lock_entries(repo, commit, tree, sha256))
    shutil.copytree(FIXTURE / "stack", root / "patches" / "toy" / TAG)  # ... and its stack
    # The HF reference is a pure function of (model, prompts, settings, versions): share the
    # machine's cache of it with the other gate tests (tests/shared_envs.py), nothing else.
    from shared_envs import shared_config

    shared_reference = shared_config().cache / "reference"
    shared_reference.mkdir(parents=True, exist_ok=True)
    (tmp / "work" / "cache").mkdir(parents=True)
    (tmp / "work" / "cache" / "reference").symlink_to(shared_reference)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
    env.update({"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp / "work"),
                "DSADAPT_CACHE": str(tmp / "work" / "cache"), "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "",
                "DSADAPT_ARTIFACTS": str(tmp / "artifacts"),
                # the adapter package and its entry point (a *.dist-info on the path), then dsadapt
                "PYTHONPATH": os.pathsep.join([str(FIXTURE), str(REPO_ROOT)])})

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "patcher.cli.main", *args], cwd=root, env=env,
                              capture_output=True, text=True, timeout=900)

    return {"root": root, "work": tmp / "work", "run": run, "before": files_snapshot(root),
            "repo_before": _repo_snapshot()}


def _repo_snapshot() -> dict[str, str]:
    """The repository's project files and the fixture (what a run on the copy must not touch)."""
    snap = files_snapshot(REPO_ROOT / "patches", REPO_ROOT / "reports", FIXTURE, ignore=("__pycache__",))
    snap["upstream.lock"] = hashlib.sha256((REPO_ROOT / "upstream.lock").read_bytes()).hexdigest()
    return snap


def _json(r: subprocess.CompletedProcess) -> dict:
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout)


def test_fourth_engine_from_a_package_applies_builds_installs_and_checks(toy):
    run, root, work = toy["run"], toy["root"], toy["work"]

    listed = {p["pin"]: p for p in _json(run("list", "--json"))["pins"]}
    assert listed[PIN]["build_kind"] == "overlay" and listed[PIN]["patches"] == 1
    assert listed[PIN]["runs_here"] == {"cpu": True}

    r = run("apply", PIN)
    assert r.returncode == 0, r.stderr
    checkout = work / "checkouts" / "toy" / TAG
    assert "x1, x2 = x[..., 0::2], x[..., 1::2]" in (checkout / "toyds" / "model.py").read_text()

    built = _json(run("build", PIN, "--json"))
    assert built["kind"] == "overlay" and built["replaced"] == ["toyds/model.py"], built
    assert Path(built["artifact"]).parent == root / "dist"
    assert built["version"].startswith("0.1.0+ds.")

    installed = _json(run("install", PIN, "--json"))
    py = Path(installed["python"])
    assert installed["ref"] == PIN and py.is_file() and Path(installed["venv"]).parent == work / "venvs"
    probe = subprocess.run([str(py), "-c", "import toyds, torch; print(toyds.__file__)"], capture_output=True,
                           text=True, env={"PATH": os.environ["PATH"]})
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(installed["venv"])  # toyds from the build; torch from the host

    # the gate: the patched toy engine against HF transformers, a real verdict
    r = run("check", PIN, "--model", "v2-lite", "--config-style", "deepseek", "--json")
    res = _json(r)
    assert r.returncode == 0 and res["verdict"] == "pass", res.get("reasons") or r.stderr[-3000:]
    assert res["engine"] == "toy" and res["comparison"]["rule"] == "strict"
    assert res["comparison"]["summary"]["max_abs"] < 1e-4
    assert res["provenance"]["engine_path"].startswith(installed["venv"])
    assert res["provenance"]["installed"]["artifact"] == Path(built["artifact"]).name
    # a run's report goes to the work dir; committed reports/ change only with --publish
    assert Path(res["report_path"]) == work / "reports" / "toy" / TAG / "v2-lite-deepseek-float32.json"

    # the release itself (Llama-style RoPE pairs) fails the same gate: it is live for this engine
    r = run("check", PIN, "--model", "v2-lite", "--config-style", "deepseek", "--unpatched", "--json")
    res = _json(r)
    assert r.returncode == 1 and res["verdict"] == "fail", res
    assert res["comparison"]["summary"]["max_abs"] > 0.1
    assert any("tolerance" in reason for reason in res["reasons"]), res["reasons"]

    # the adapter's runner declares float32 only: anything else is a usage error, before any work
    r = run("check", PIN, "--model", "v2-lite", "--config-style", "deepseek", "--dtype", "bfloat16")
    assert r.returncode == 2 and "does not run in bfloat16" in r.stderr, r.stderr

    # nothing outside the toy's own entries changed: the repository, and in the project only
    # the build output is new (reports went to the work dir)
    assert _repo_snapshot() == toy["repo_before"]
    after = files_snapshot(root)
    changed = {p for p in set(after) | set(toy["before"]) if after.get(p) != toy["before"].get(p)}
    outside = sorted(p for p in changed if not p.startswith(str(root / "dist") + "/"))
    assert outside == [], outside

"""The toy engine (tests/fixtures/toyengine) added to a copy of the project: its upstream repository
and release wheel, its lock entries and stack, and the `toy` fixture that runs dsadapt there in a
subprocess (the adapter found through its entry point). Shared by the fourth-engine, offline and
device-rehearsal tests."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, files_snapshot, git, make_wheel

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "toyengine"
TAG = "v0.1.0"
PIN = f"toy@{TAG}"
WHEEL = "toyds-0.1.0-py3-none-any.whl"
GIT_ENV = {"GIT_AUTHOR_NAME": "toyds", "GIT_AUTHOR_EMAIL": "toyds@example.org", "GIT_COMMITTER_NAME": "toyds",
           "GIT_COMMITTER_EMAIL": "toyds@example.org", "GIT_AUTHOR_DATE": "2026-11-30T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-11-30T00:00:00Z"}

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
            "repo_before": repo_snapshot()}


def repo_snapshot() -> dict[str, str]:
    """The repository's project files and the fixture (what a run on the copy must not touch)."""
    snap = files_snapshot(REPO_ROOT / "patches", REPO_ROOT / "reports", FIXTURE, ignore=("__pycache__",))
    snap["upstream.lock"] = hashlib.sha256((REPO_ROOT / "upstream.lock").read_bytes()).hexdigest()
    return snap

"""The fake engine of `dsadapt power`'s fast tests (tests/fixtures/powerfake: HF transformers standing
in for an engine) pinned in a copy of the project, and how to run dsadapt there in a subprocess
(the adapter found through its entry point, as any engine package is)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "powerfake"
PIN = "hffake@v0.1.0"

LOCK = '''
[engines.hffake]
git = "{git}"

[pins."{PIN}"]
version = "0.1.0"
commit = "{commit}"
tree = "{tree}"
'''


@pytest.fixture(scope="module")
def fake_power(tmp_path_factory):
    """A copy of the project with the hffake engine pinned (an empty stack), and `run(*args, env=)`."""
    tmp = tmp_path_factory.mktemp("power")
    root = tmp / "project"
    root.mkdir()
    # the engine's upstream: a one-commit repository tagged at the pin (the check's plan asks that a
    # source can provide the pin's tree; the fake builds nothing from it)
    upstream = tmp / "hffake-upstream"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-C", str(upstream)]
    upstream.mkdir()
    subprocess.run([*git, "init", "-q"], check=True)
    (upstream / "README").write_text("hffake\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-qm", "hffake 0.1.0"], check=True)
    subprocess.run([*git, "tag", "v0.1.0"], check=True)
    commit, tree = (subprocess.run([*git, "rev-parse", f"HEAD{s}"], check=True, capture_output=True,
                                   text=True).stdout.strip() for s in ("", "^{tree}"))
    shutil.copy(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    with open(root / "upstream.lock", "a", encoding="utf-8") as f:
        f.write(LOCK.format(git=upstream, PIN=PIN, commit=commit, tree=tree))
    (root / "patches" / "hffake" / "v0.1.0").mkdir(parents=True)
    (root / "patches" / "hffake" / "v0.1.0" / "series").write_text("")
    # the HF reference is a pure function of its inputs: share the machine's cache of it
    from shared_envs import shared_config

    cache = tmp / "work" / "cache"
    cache.mkdir(parents=True)
    for kind in ("reference", "reference-capture"):
        shared = shared_config().cache / kind
        shared.mkdir(parents=True, exist_ok=True)
        (cache / kind).symlink_to(shared)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "HFFAKE_"))}
    env.update({"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp / "work"), "DSADAPT_CACHE": str(cache),
                "DSADAPT_SOURCES": "git", "PYTHONPATH": os.pathsep.join([str(FIXTURE), str(REPO_ROOT)])})

    def run(*args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "patcher.cli.main", *args], cwd=root,
                              env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=900)

    return {"root": root, "work": tmp / "work", "run": run}


def power_json(r: subprocess.CompletedProcess) -> dict:
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout)

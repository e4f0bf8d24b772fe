"""A fourth engine from a package dsadapt has never seen: the engine contract's proof.

The toy engine (tests/fixtures/toyengine: a DeepSeek-V2 decoder in plain PyTorch, and its
adapter registered through the ``dsadapt.engines`` entry point) is added to a copy of the
project by a lock entry and a stack only. `dsadapt apply`, `build`, `install` and `check` run
on it in subprocesses, and the gate gives real verdicts against HF transformers: the patched
engine passes, the release (RoPE pairs in the Llama layout) fails. Nothing outside the toy's
own lock entry, stack and build output changes in the project (reports go to the work dir).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import files_snapshot

pytestmark = pytest.mark.slow  # about a minute: two gate runs of a plain-PyTorch engine and the HF reference

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from toy_engine_support import FIXTURE, PIN, TAG, WHEEL, make_release_wheel, make_upstream, repo_snapshot, toy  # noqa: E402,F401


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
    assert repo_snapshot() == toy["repo_before"]
    after = files_snapshot(root)
    changed = {p for p in set(after) | set(toy["before"]) if after.get(p) != toy["before"].get(p)}
    outside = sorted(p for p in changed if not p.startswith(str(root / "dist") + "/"))
    assert outside == [], outside

"""The air-gapped path, end to end, with no network: bundle -> bootstrap -> install --offline -> check.

A rehearsal of what runs on the GPU machine (docs/user-guide.md "Air-gapped hosts"), on the toy
engine of tests/fixtures/toyengine (pure Python on the host's torch, registered by entry
point). The "host" is this test's Python environment: its `pip list --format=json` is the probe
(`--have`), so the bundle carries only what the host lacks (dsadapt's own wheel, the toy's
patched and unpatched builds). Then, in a separate folder standing for the offline machine:

- `python bootstrap.py --system-site-packages` makes dsadapt's environment from the bundle
  (a new venv that sees the host's torch through a .pth; pip --no-index);
- `dsadapt install --offline . --system-site-packages` verifies the bundle and makes the pin's
  environments from it;
- `dsadapt check` passes the patched toy and fails its release, from the bundle's builds: the
  sources are set to a mirror that does not exist and pip has no index, so a build or a
  download would fail the test (exit 6).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from toy_engine_support import FIXTURE, PIN, TAG, toy  # noqa: F401 - the toy project fixture

pytestmark = pytest.mark.slow  # about two minutes: a wheel build, two venvs, two gate runs


def _host_probe(path: Path, env: dict) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                       capture_output=True, text=True, env=env, check=True)
    path.write_text(r.stdout)
    return path


def test_bundle_then_offline_install_and_check(toy, tmp_path):  # noqa: F811
    run, root = toy["run"], toy["root"]
    offline_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "PIP_"))}
    offline_env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull,
                        "PYTHONPATH": str(FIXTURE)})  # the toy's adapter (a host package of the target)
    probe = _host_probe(tmp_path / "host.json", offline_env)

    # -- on the connected machine: the bundle (nothing fetched: the host has every dependency)
    out = tmp_path / "bundle"
    r = run("bundle", PIN, "--have", str(probe), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["path"] == str(out) and res["host_packages"] is True
    manifest = json.loads((out / "bundle.json").read_text())
    assert set(manifest["builds"]) == {"patched", "unpatched"}
    assert manifest["builds"]["unpatched"]["kind"] == "release"  # no leave-out: the release wheel itself
    carried = sorted(Path(w).name.split("-")[0] for w in manifest["parts"]["dsadapt"]["wheels"])
    assert carried == ["dsadapt"], carried  # torch, transformers, click ... come from the host
    assert "torch" in manifest["parts"]["dsadapt"]["host"] and "dsadapt-toy" in manifest["parts"]["dsadapt"]["host"]
    assert manifest["parts"]["engine"]["wheels"] == {}  # toyds has no dependencies
    assert (out / "upstream.lock").is_file() and (out / "patches" / "toy" / TAG / "series").is_file()

    # -- the offline machine: a copy of the bundle, no index, no source of the engine
    target = tmp_path / "target"
    shutil.copytree(out, target)
    env = {**offline_env, "DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": ""}
    from shared_envs import shared_config

    shared_reference = shared_config().cache / "reference"  # the HF reference is a pure function of its inputs
    shared_reference.mkdir(parents=True, exist_ok=True)
    (target / ".dsadapt" / "cache").mkdir(parents=True)
    (target / ".dsadapt" / "cache" / "reference").symlink_to(shared_reference)

    r = subprocess.run([sys.executable, "bootstrap.py", "--system-site-packages"], cwd=target, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    dsadapt = target / ".dsadapt" / "env" / "bin" / "dsadapt"
    assert dsadapt.is_file()

    def ds(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(dsadapt), *args], cwd=target, env=env, capture_output=True, text=True, timeout=900)

    where = ds("--version")
    assert where.returncode == 0, where.stderr
    probe_import = subprocess.run([str(dsadapt.parent / "python"), "-c", "import patcher; print(patcher.__file__)"],
                                  cwd=target, env=env, capture_output=True, text=True)
    assert probe_import.stdout.strip().startswith(str(target / ".dsadapt" / "env")), probe_import  # the wheel's dsadapt
    assert str(REPO_ROOT) not in probe_import.stdout

    installed = json.loads(ds("install", "--offline", ".", "--system-site-packages", "--json").stdout)
    assert set(installed["environments"]) == {"patched", "unpatched"}
    assert installed["environments"]["patched"]["reused"] is True  # bootstrap.py installed it already
    assert "torch" in installed["host_packages"]

    r = ds("check", PIN, "--model", "v2-lite", "--config-style", "deepseek", "--json")
    res = json.loads(r.stdout)
    assert r.returncode == 0 and res["verdict"] == "pass", (res.get("reasons"), r.stderr[-3000:])
    prov = res["provenance"]
    assert prov["installed"]["bundle"] == str(target)
    assert prov["installed"]["artifact"] == Path(manifest["builds"]["patched"]["file"]).name
    assert "torch" in prov["installed"]["host_packages_used"]
    assert prov["engine_path"].startswith(str(target / ".dsadapt" / "venvs"))
    assert prov["reference_device"] == "cpu" and prov["reference_versions"]["transformers"] == "5.24.0"

    r = ds("check", PIN, "--model", "v2-lite", "--config-style", "deepseek", "--unpatched", "--json")
    res = json.loads(r.stdout)
    assert r.returncode == 1 and res["verdict"] == "fail", res
    assert res["provenance"]["installed"]["artifact"] == Path(manifest["builds"]["unpatched"]["file"]).name

    # the bundle is checked before anything is installed: one changed byte is exit 3
    wheel = next((target / "engine").glob("*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"x")
    r = ds("install", "--offline", ".", "--system-site-packages")
    assert r.returncode == 3 and "does not match" not in r.stdout and "sha256" in r.stderr, r.stderr
    assert root.is_dir()

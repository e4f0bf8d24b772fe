"""The one test that really talks to PyPI: the pinned vllm 0.3.3 wheel through the pypi source."""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO_ROOT, Project, git


@pytest.mark.network
@pytest.mark.slow
def test_apply_vllm_033_from_pypi(tmp_path):
    root = tmp_path / "project"
    (root / "patches" / "vllm").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches" / "vllm" / "v0.3.3", root / "patches" / "vllm" / "v0.3.3")
    env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "work"),
           "DSADAPT_CACHE": str(tmp_path / "cache"), "DSADAPT_ARTIFACTS": "", "DSADAPT_MIRRORS": ""}
    proj = Project(root, None, env, tmp_path)
    r = proj.run("apply", "vllm@v0.3.3", "--json")
    assert r.rc == 0, r
    res = r.json()
    assert res["source"]["kind"] == "pypi"
    assert res["source"]["origin"] == "vllm-0.3.3-cp311-cp311-manylinux1_x86_64.whl"
    # git has no commit to verify against (not pinned here) and no mirror is configured
    assert [p.split(":")[0] for p in res["source"]["passed_over"]] == ["git", "mirror"]
    co = tmp_path / "work" / "checkouts" / "vllm" / "v0.3.3"
    assert (co / "vllm" / "__init__.py").is_file()
    assert not list(co.rglob("*.so")) and not list(co.glob("*.dist-info"))
    assert (tmp_path / "cache" / "artifacts" / res["source"]["origin"]).is_file()
    assert git(co, "status", "--porcelain") == ""

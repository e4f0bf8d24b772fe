"""The GPU machine's scripts, rehearsed here on the toy engine's bundle (slow: about two minutes).

tools/device/lmdeploy_h200.sh (bootstrap → install --offline → chains of checks, reports.tgz) and
tools/device/lmdeploy_tp.sh's `device` part (a second, planted bundle installed next to the main
one, checked at TP 1 and TP 2) run exactly as on the device, with PIN/VARIANT pointing at the toy
engine (tests/fixtures/toyengine) and the host's Python standing for the GPU machine's: what they
call (flags of a chain item: unpatched, tpN, mp; the EXTRA hook; the archive) cannot fail there on
a typo. The toy runs in one process only, so its TP 2 check is the exit 6 a one-GPU machine
gives LMDeploy's (`needs 2 CUDA GPUs`): what the rehearsal on the H200 shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO_ROOT
from test_fourth_engine import FIXTURE, PIN, toy  # noqa: F401 - the toy project fixture
from test_offline_e2e import _host_probe

pytestmark = pytest.mark.slow

H200 = REPO_ROOT / "tools" / "device" / "lmdeploy_h200.sh"
TP = REPO_ROOT / "tools" / "device" / "lmdeploy_tp.sh"


def test_device_scripts_on_the_toy_bundle(toy, tmp_path):  # noqa: F811
    run = toy["run"]
    offline_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "PIP_"))}
    offline_env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull,
                        "PYTHONPATH": str(FIXTURE)})
    probe = _host_probe(tmp_path / "host.json", offline_env)
    carry = tmp_path / "carry"
    for name in ("gpu", "tp-rehearsal"):  # the main bundle, and a second one as lmdeploy_tp.sh prepares it
        r = run("bundle", PIN, "--have", str(probe), "--out", str(carry / name), *(
            ("--no-unpatched",) if name != "gpu" else ()), "--json")
        assert r.returncode == 0, r.stderr[-3000:]
    from shared_envs import shared_config

    shared_reference = shared_config().cache / "reference"
    shared_reference.mkdir(parents=True, exist_ok=True)
    for name in ("gpu", "tp-rehearsal"):
        (carry / name / ".dsadapt" / "cache").mkdir(parents=True)
        (carry / name / ".dsadapt" / "cache" / "reference").symlink_to(shared_reference)
    out = tmp_path / "out"
    env = {**offline_env, "DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": "", "OUT": str(out), "PIN": PIN,
           "VARIANT": "cpu", "PYTHON": sys.executable, "CHECK_ARGS": "--config-style deepseek", "LIMIT": "3000",
           "CHECK_S": "1200", "TP_S": "1200", "MODEL": "v2-lite", "DTYPES": "float32", "TPS": "1 2",
           "CHAINS": "v2-lite:float32:tp1:mp; v2-lite:float32:tp2 v2-lite:float32:unpatched:tp2",
           "EXTRA": f"bash {TP} device rehearsal"}
    r = subprocess.run(["bash", str(H200), str(carry / "gpu")], env=env, capture_output=True, text=True,
                       timeout=5400)
    log = (out / "log.txt").read_text() if (out / "log.txt").is_file() else r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "install rc=0" in log
    chain1, chain2 = (out / "chain1.txt").read_text(), (out / "chain2.txt").read_text()
    assert "chain 1: v2-lite float32 tp1:mp rc=0" in chain1, chain1[-3000:]  # TP 1 through the chain flags
    assert "chain 2: v2-lite float32 tp2 rc=6" in chain2 and "runs the gate in one process only" in chain2
    assert "chain 2: v2-lite float32 unpatched:tp2 rc=6" in chain2  # flags combine (and exit 6 before running)
    extra = (out / "extra.txt").read_text()
    assert "tp-rehearsal install rc=0" in extra, extra
    assert "tp-rehearsal v2-lite tp1 float32 rc=0" in extra and "tp-rehearsal v2-lite tp2 float32 rc=6" in extra
    tp1 = json.loads((carry / "gpu" / "extra" / "tp-rehearsal-v2-lite-tp1-float32.json").read_text())
    assert tp1["verdict"] == "pass" and tp1["parallel"]["label"] == "tp1"
    tp2 = json.loads((carry / "gpu" / "extra" / "tp-rehearsal-v2-lite-tp2-float32.json").read_text())
    assert tp2["error"]["exit_code"] == 6
    with tarfile.open(out / "reports.tgz") as t:
        names = t.getnames()
    assert any(n.startswith("reports/toy/") and n.endswith("v2-lite-deepseek-float32.json") for n in names), names
    assert any("tp-rehearsal-v2-lite-tp1-float32.json" in n for n in names), names
    shutil.rmtree(carry)

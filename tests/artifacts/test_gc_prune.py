"""`dsadapt gc` prunes derived data no pin uses (engine environments, dist/ builds of other
stacks, runs/ of unpinned pins) and never what a pin uses; the unpatched environment shares the
patched one's site-packages by hard links instead of being a full copy."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

from conftest import REF1

from patcher.base.fsutil import link_tree


def _venv(root: Path, name: str, marker: dict | None, size: int = 1000) -> Path:
    v = root / name
    (v / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (v / "pyvenv.cfg").write_text("home = /usr\n")
    (v / "lib" / "python3.11" / "site-packages" / "big.bin").write_bytes(b"x" * size)
    if marker is not None:
        (v / "dsadapt-install.json").write_text(json.dumps(marker))
    return v


def _wheel(d: Path, name: str, prov: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    w = d / name
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("vllm-1.0.0+ds.x.dist-info/dsadapt.json", json.dumps(prov))
    return w


def test_gc_prunes_what_no_pin_uses_and_keeps_what_one_does(project, clean_stack):
    from patcher.rules.logits import REFERENCE_TRANSFORMERS

    cfg = project.config()
    from patcher.formats.stackfiles import load_stack

    stack_hash = load_stack(cfg.patches_root, project.lock().pin(REF1).ref).hash
    venvs = cfg.venvs_root
    venvs.mkdir(parents=True)
    keep = _venv(venvs, "vllm-v1.0.0-cpu", {"ref": REF1, "variant": "cpu", "artifact": str(cfg.dist_dir / "held.whl")})
    gone_pin = _venv(venvs, "vllm-v0.9.0-cpu", {"ref": "vllm@v0.9.0", "variant": "cpu"})
    old_ref = _venv(venvs, "reference-transformers-4.0.0", None)
    cur_ref = _venv(venvs, f"reference-transformers-{REFERENCE_TRANSFORMERS}", None)
    half = _venv(venvs, "vllm-v1.0.0-cuda-unpatched", None)
    os.utime(half, (0, 0))
    current = _wheel(cfg.dist_dir, "cur.whl", {"pin": REF1, "variant": "cpu", "stack_hash": stack_hash})
    older = _wheel(cfg.dist_dir, "old.whl", {"pin": REF1, "variant": "cpu", "stack_hash": "0" * 64})
    held = _wheel(cfg.dist_dir, "held.whl", {"pin": REF1, "variant": "cpu", "stack_hash": "1" * 64})
    unpinned = _wheel(cfg.dist_dir, "unpinned.whl", {"pin": "vllm@v0.9.0", "variant": "cpu", "stack_hash": "2" * 64})
    foreign = cfg.dist_dir / "someone-else-1.0-py3-none-any.whl"
    foreign.write_bytes(b"not ours")
    runs_keep = cfg.workdir / "runs" / "vllm" / "v1.0.0" / "v3-float32"
    runs_gone = cfg.workdir / "runs" / "vllm" / "v0.9.0" / "v3-float32"
    for d in (runs_keep, runs_gone):
        d.mkdir(parents=True)
        (d / "engine.json").write_text("{}")

    r = project.run("gc", "--dry-run", "--json")
    assert r.rc == 0 and r.json()["schema"] == "dsadapt.gc/1", r
    listed = {Path(lo["path"]).name: lo for lo in r.json()["leftovers"]}
    assert set(listed) >= {"vllm-v0.9.0-cpu", "reference-transformers-4.0.0", "vllm-v1.0.0-cuda-unpatched",
                           "old.whl", "unpinned.whl", "v0.9.0"}
    assert not set(listed) & {"vllm-v1.0.0-cpu", cur_ref.name, "cur.whl", "held.whl", foreign.name, "v1.0.0"}
    assert listed["vllm-v0.9.0-cpu"]["bytes"] >= 1000 and "no longer pinned" in listed["vllm-v0.9.0-cpu"]["why"]
    assert all(p.exists() for p in (gone_pin, old_ref, older, unpinned, runs_gone))  # a dry run removes nothing
    r = project.run("gc")
    assert r.rc == 0 and "removed" in r.out, r
    assert not any(p.exists() for p in (gone_pin, old_ref, half, older, unpinned, runs_gone.parent))
    assert all(p.exists() for p in (keep, cur_ref, current, held, foreign, runs_keep))
    # --runs: the work files of the pins' own past runs too; --leftovers-only: none of this
    assert project.run("gc", "--leftovers-only", "--json").json()["leftovers"] == []
    project.run("gc", "--runs")
    assert not runs_keep.exists() and keep.exists()


def test_link_tree_shares_site_packages_and_copies_what_may_be_rewritten(tmp_path):
    src = _venv(tmp_path, "a", {"ref": REF1}, size=4096)
    (src / "bin").mkdir()
    (src / "bin" / "pip").write_text(f"#!{src}/bin/python\n")
    dst = tmp_path / "b"
    linked, copied = link_tree(src, dst)
    big_a, big_b = (p / "lib" / "python3.11" / "site-packages" / "big.bin" for p in (src, dst))
    assert linked == 1 and os.stat(big_a).st_ino == os.stat(big_b).st_ino
    assert os.stat(src / "dsadapt-install.json").st_ino != os.stat(dst / "dsadapt-install.json").st_ino
    # the install record is written in place by dsadapt: the copy's never changes the original's
    (dst / "dsadapt-install.json").write_text("{}")
    assert json.loads((src / "dsadapt-install.json").read_text()) == {"ref": REF1}
    from patcher.artifacts.venvs import retarget_scripts

    assert retarget_scripts(dst, src) == 1 and (dst / "bin" / "pip").read_text() == f"#!{dst}/bin/python\n"
    assert (src / "bin" / "pip").read_text() == f"#!{src}/bin/python\n"
    from patcher.base.leftovers import disk_bytes

    assert disk_bytes(dst / "lib") == 0  # shared: removing it frees nothing

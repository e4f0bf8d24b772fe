"""Helpers for the LMDeploy tests: the pinned wheels' base trees and the stacks applied on
them -- both made by dsadapt itself (`dsadapt apply` from the pinned wheel: the product's
source-tree rule, series parsing and `git am`) -- and loading single upstream modules by file
path with the few imports they need stubbed.

The wheels come from DSADAPT_LMDEPLOY_WHEEL_DIR when set, else from dsadapt's shared artifact
cache (tests/shared_envs.py), which downloads the pinned wheels from PyPI once per machine
(sha256 checked against upstream.lock); without network the tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

from patcher.base.fsutil import sha256_file as sha256  # noqa: F401 (re-exported for the tests)
from patcher.formats.lock import load_lock
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import expected_preimages, load_stack

REPO_ROOT = Path(__file__).resolve().parents[1]
PATCHES = REPO_ROOT / "patches" / "lmdeploy"


def _pinned_wheels() -> dict[str, tuple[str, str]]:
    lock = load_lock(REPO_ROOT / "upstream.lock")
    out = {}
    for e in lock.pins_of("lmdeploy"):
        art = e.source_artifact()
        if art is not None:
            out[e.tag] = (art.file, art.sha256)
    return out


#: tag -> (wheel file name, sha256), from upstream.lock.
WHEELS = _pinned_wheels()
#: git tree ids of the base commits dsadapt makes from the wheels (measured 2026-11-29: the
#: wheel's files minus *.dist-info and binaries).
BASE_TREES = {"v0.4.0": "16ea260b61cc295f342def12465540bdde5a2d1b",
              "v0.18.0": "ff7fe48e286106b5d6b5478103f3245c028561dc"}


def wheel_path(tag: str) -> Path | None:
    """The pinned wheel: from DSADAPT_LMDEPLOY_WHEEL_DIR if it is there, else dsadapt's shared
    artifact cache (downloaded once from PyPI, sha256 checked against upstream.lock)."""
    name, _ = WHEELS[tag]
    local = os.environ.get("DSADAPT_LMDEPLOY_WHEEL_DIR")
    if local and (Path(local) / name).is_file():
        return Path(local) / name
    from shared_envs import pinned_wheel

    return pinned_wheel(f"lmdeploy@{tag}")


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True, text=True).stdout


@dataclass(frozen=True)
class Trees:
    base: Path                          # the pinned wheel's base tree (a worktree at refs/dsadapt/base)
    patched: Path                       # the checkout with the stack applied
    applied: list[tuple[str, str]]      # (path, post-image blob id) of every file the stack leaves


def trees(tag: str, root: Path) -> Trees:
    """`dsadapt apply lmdeploy@TAG` from the pinned wheel in a work dir under `root`; the base tree
    is the checkout's verified base commit, checked out next to it."""
    from shared_envs import real_lock, shared_config

    from patcher.stack.apply import apply_stack

    wheel = wheel_path(tag)
    assert wheel is not None
    ref = PinRef("lmdeploy", tag)
    cfg = replace(shared_config(), workdir=root / "work", sources=("pypi",),
                  artifact_dirs=(wheel.parent, *shared_config().artifact_dirs))
    apply_stack(cfg, real_lock(), ref)
    patched = cfg.checkout_dir("lmdeploy", tag)
    base = root / "base"
    git(patched, "worktree", "add", "-q", "--detach", str(base), "refs/dsadapt/base")
    _base, post, _problems = expected_preimages(load_stack(REPO_ROOT / "patches", ref).patches)
    return Trees(base, patched, [(p, b) for p, b in post.items() if b is not None])


def series(tag: str) -> list[Path]:
    stack = load_stack(REPO_ROOT / "patches", PinRef("lmdeploy", tag))
    return [stack.dir / e.name for e in stack.entries]


def blob_id(tree: Path, path: str) -> str:
    return git(tree, "hash-object", path).strip()


def _stub_lmdeploy_utils() -> dict[str, types.ModuleType]:
    import logging

    utils = types.ModuleType("lmdeploy.utils")
    utils.get_logger = lambda name: logging.getLogger(name)
    pkg = types.ModuleType("lmdeploy")
    pkg.__path__ = []
    pkg.utils = utils
    return {"lmdeploy": pkg, "lmdeploy.utils": utils}


class _Registry:
    """The part of mmengine.Registry that lmdeploy/model.py uses (insertion-ordered)."""

    def __init__(self, name: str, locations=None):
        self.name = name
        self.module_dict: dict[str, type] = {}

    def register_module(self, name=None, force=False, module=None):
        def deco(cls):
            for n in (name if isinstance(name, list) else [name or cls.__name__]):
                self.module_dict[n] = cls
            return cls
        return deco

    def get(self, name):
        return self.module_dict.get(name)


def load_module(path: Path, name: str, stub_mmengine: bool = False) -> types.ModuleType:
    """Import one upstream file by path, with `lmdeploy.utils` (and `mmengine`) stubbed."""
    stubs = _stub_lmdeploy_utils()
    if stub_mmengine:
        mm = types.ModuleType("mmengine")
        mm.Registry = _Registry
        stubs["mmengine"] = mm
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v

"""Helpers for the LMDeploy tests: the pinned wheels' base trees, the stacks applied on them,
and loading single upstream modules by file path with the few imports they need stubbed.

The wheels come from DSADAPT_LMDEPLOY_WHEEL_DIR (default /tmp/lmd); tests that need them
skip, with the reason, when a wheel is absent. Fetch them with
``pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 lmdeploy==0.4.0``
and ``... --python-version 3.12 --platform manylinux_2_28_x86_64 lmdeploy==0.18.0``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PATCHES = REPO_ROOT / "patches" / "lmdeploy"

#: tag -> (wheel file name, sha256), as downloaded from PyPI on 2026-11-29.
WHEELS = {
    "v0.4.0": ("lmdeploy-0.4.0-cp311-cp311-manylinux2014_x86_64.whl",
               "1a407f293d9b211a19cd8a1cf9383591df81397886c9cec60433948620bdd1f4"),
    "v0.18.0": ("lmdeploy-0.18.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                "fcef7cf0d210d766e02e2e6df025378d2f8ae36080400b2818eb9a34ef3392dc"),
}
#: git tree ids of the base commits (wheel files minus *.dist-info, .so and .a).
BASE_TREES = {"v0.4.0": "16ea260b61cc295f342def12465540bdde5a2d1b",
              "v0.18.0": "ff7fe48e286106b5d6b5478103f3245c028561dc"}

_INDEX_RE = re.compile(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})", re.M)
_GIT_ENV = {"GIT_AUTHOR_NAME": "dsadapt", "GIT_AUTHOR_EMAIL": "dsadapt@localhost",
            "GIT_COMMITTER_NAME": "dsadapt", "GIT_COMMITTER_EMAIL": "dsadapt@localhost",
            "GIT_AUTHOR_DATE": "2026-11-29T00:00:00Z", "GIT_COMMITTER_DATE": "2026-11-29T00:00:00Z"}


def wheel_path(tag: str) -> Path | None:
    name, _ = WHEELS[tag]
    path = Path(os.environ.get("DSADAPT_LMDEPLOY_WHEEL_DIR", "/tmp/lmd")) / name
    return path if path.is_file() else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _keep(name: str) -> bool:
    top = name.split("/", 1)[0]
    return not (name.endswith("/") or top.endswith(".dist-info") or name.endswith((".so", ".a"))
                or ".so." in name.rsplit("/", 1)[-1])


def git(tree: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    return subprocess.run(["git", *args], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout


def base_tree(tag: str, dest: Path) -> Path:
    """The wheel's files except *.dist-info and binaries, committed as one git commit."""
    wheel = wheel_path(tag)
    assert wheel is not None
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if _keep(info.filename):
                z.extract(info, dest)
                mode = (info.external_attr >> 16) & 0o777
                if mode:  # keep the wheel's file modes (executable scripts), as unzip does
                    os.chmod(dest / info.filename, mode)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"lmdeploy {tag} wheel base")
    return dest


def series(tag: str) -> list[Path]:
    d = PATCHES / tag
    names = [ln.split("#", 1)[0].strip() for ln in (d / "series").read_text().splitlines()]
    return [d / n for n in names if n]


def apply_stack(tree: Path, tag: str) -> list[tuple[str, str]]:
    """git apply each patch of the stack in series order; returns (path, post-image blob id)."""
    applied = []
    for patch in series(tag):
        git(tree, "apply", "--check", str(patch))
        git(tree, "apply", str(patch))
        text = patch.read_text(encoding="utf-8")
        paths = re.findall(r"^diff --git a/(\S+) b/", text, re.M)
        applied += [(p, new) for p, (_, new) in zip(paths, _INDEX_RE.findall(text))]
    return applied


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

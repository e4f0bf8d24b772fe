"""What an engine adapter declares: sources, build kind rules, install recipe, runner."""

from __future__ import annotations

import fnmatch
import platform
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable

from ..lock import LockEntry


@dataclass(frozen=True)
class VariantSpec:
    """A build variant: which pinned wheel it overlays and what it needs to run."""

    name: str
    dist: str                      # PyPI distribution of the base wheel
    device: str                    # cpu | cuda
    python: tuple[str, ...] = ()   # python versions it runs on ('' = any); empty = any
    description: str = ""
    toolchain: tuple[str, ...] = ()  # programs a full source build needs
    leave_out: tuple[str, ...] = ()  # wheel members (fnmatch) an overlay build drops
    wheel_variant: str | None = None  # overlay the wheel pinned for this other variant (default: own name)

    @property
    def artifact_variant(self) -> str:
        return self.wheel_variant or self.name


@dataclass(frozen=True)
class EngineAdapter:
    name: str
    git_url: str
    pypi: tuple[str, ...]
    packages: tuple[str, ...]                  # top-level import packages in its wheels
    variants: tuple[VariantSpec, ...]
    build_kind: str = "overlay"                # overlay | backend
    compiled_patterns: tuple[str, ...] = ()    # paths that force a full source build
    tag_prefix: str = "v"
    runner: str | None = None                  # runner script name under patcher/runners
    # pip arguments for `dsadapt install` besides the built artifact
    install_extra: Callable[[LockEntry, str], list[str]] = field(default=lambda e, v: [])
    # packages to uninstall after install (builds that break imports)
    install_remove: tuple[str, ...] = ()
    notes: str = ""
    # backend-kind engines: assemble the build (cfg, lock, entry, stack, out_dir, progress) -> BuildResult
    build_backend: Callable | None = None
    # engines checked through a server (Triton): a context manager
    # (cfg, lock, entry, spec, unpatched, progress, stream) -> (python, RunnerSpec, env, installed)
    check_session: Callable | None = None
    # the speed gate (dsadapt perf): (LockEntry, VariantSpec) -> a PerfRecipe (engines/perf_recipe.py) or None
    perf_recipe: Callable | None = None

    def variant(self, name: str | None) -> VariantSpec:
        from ..errors import UsageError

        if name is None:
            return self.variants[0]
        for v in self.variants:
            if v.name == name:
                return v
        raise UsageError(f"{self.name} has no variant '{name}'",
                         hint=f"variants: {', '.join(v.name for v in self.variants)}")

    def variant_for(self, entry: LockEntry, name: str | None) -> VariantSpec:
        """The named variant, or the first one the pin has a wheel for."""
        if name is not None or self.build_kind == "backend":
            return self.variant(name)
        for v in self.variants:
            if entry.artifact(v.artifact_variant, wheel=True):
                return v
        return self.variants[0]

    def tag_to_version(self, tag: str) -> str:
        return tag[len(self.tag_prefix):] if self.tag_prefix and tag.startswith(self.tag_prefix) else tag

    def version_to_tag(self, version: str) -> str:
        return f"{self.tag_prefix}{version}"

    def is_compiled(self, path: str) -> bool:
        return any(fnmatch.fnmatch(path, pat) for pat in self.compiled_patterns)

    def run_blocker(self, entry: LockEntry, variant: VariantSpec) -> str | None:
        """Why this pin/variant cannot run on this machine, or None if it can."""
        if self.build_kind == "backend" and not entry.serves:
            return entry.note or "serves no pinned engine"
        if variant.device == "cuda" and not has_cuda():
            return "needs a CUDA GPU (none on this machine)"
        if entry.python:
            here = f"{sys.version_info.major}.{sys.version_info.minor}"
            allowed = [p.strip() for p in entry.python.split(",")]
            if here not in allowed:
                return f"needs Python {entry.python} (this is {here})"
        if platform.machine() not in ("x86_64", "AMD64"):
            return f"wheels are x86_64 only (this is {platform.machine()})"
        return None


def has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


COMPILED_DEFAULT = ("csrc/*", "*.cu", "*.cuh", "*.cpp", "*.cc", "*.c", "*.h", "*.hpp", "CMakeLists.txt",
                    "cmake/*", "setup.py", "pyproject.toml", "*.pyx")

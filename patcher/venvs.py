"""Isolated per-pin environments: an engine is never installed into dsadapt's own environment."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .build import BuildResult, build_pin
from .config import Config
from .engines import adapter
from .errors import BuildError
from .lock import Lock
from .pinref import PinRef

MARKER = "dsadapt-install.json"


@dataclass
class InstallResult:
    ref: str
    variant: str
    venv: str
    python: str
    artifact: str
    sha256: str
    reused: bool
    seconds: float
    removed: list[str] = field(default_factory=list)

    @property
    def activate(self) -> str:
        return f"source {self.venv}/bin/activate"

    def to_json(self) -> dict:
        return {**asdict(self), "activate": self.activate}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _pip(py: Path, *args: str, stream: bool) -> None:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", *(["-q"] if args and args[0] == "install" else []), *args]
    r = subprocess.run(cmd, stdout=sys.stderr if stream else subprocess.PIPE,
                       stderr=sys.stderr if stream else subprocess.STDOUT, text=True)
    if r.returncode != 0:
        tail = (r.stdout or "").strip().splitlines()[-3:] if not stream else []
        raise BuildError(f"pip {' '.join(args[:2])} failed in {py.parent.parent}" + (f": {' | '.join(tail)}" if tail else ""),
                         hint="see pip's output; the environment is left as pip left it (delete it to start over)")


def installed_marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def install_pin(cfg: Config, lock: Lock, ref: PinRef, variant: str | None = None, progress=None,
                stream: bool = True, build: BuildResult | None = None) -> InstallResult:
    t0 = time.monotonic()
    ad = adapter(ref.engine)
    entry = lock.pin(ref)
    spec = ad.variant_for(entry, variant)
    build = build or build_pin(cfg, lock, ref, spec.name, progress=progress)
    venv = cfg.venv_dir(ref.engine, ref.tag, spec.name)
    py = venv_python(venv)
    marker = installed_marker(venv)
    if marker and marker.get("sha256") == build.sha256 and py.exists():
        return InstallResult(str(ref), spec.name, str(venv), str(py), build.artifact, build.sha256, True,
                             round(time.monotonic() - t0, 2))
    if not py.exists():
        if progress:
            progress(f"creating {venv}")
        r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"could not create {venv}: {r.stderr.strip()[-200:]}", hint="check python3-venv is installed")
    if progress:
        progress(f"installing {Path(build.artifact).name} and its dependencies into {venv} (pip; minutes on first run)")
    if marker:  # same environment, new build of the engine: swap the engine only
        _pip(py, "install", "--force-reinstall", "--no-deps", build.artifact, stream=stream)
    else:
        _pip(py, "install", build.artifact, *ad.install_extra(entry, spec.name), stream=stream)
    removed = []
    for name in ad.install_remove:
        r = subprocess.run([str(py), "-m", "pip", "show", "-q", name], capture_output=True)
        if r.returncode == 0:
            _pip(py, "uninstall", "-y", name, stream=False)
            removed.append(name)
    (venv / MARKER).write_text(json.dumps({"ref": str(ref), "variant": spec.name, "artifact": build.artifact,
                                           "sha256": build.sha256, "stack_hash": build.stack_hash}, indent=2) + "\n")
    return InstallResult(str(ref), spec.name, str(venv), str(py), build.artifact, build.sha256, False,
                         round(time.monotonic() - t0, 2), removed)

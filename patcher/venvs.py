"""Isolated per-pin environments: an engine is never installed into dsadapt's own environment."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .build import BuildResult, build_pin
from .config import Config
from .engines import engine
from .engines.base import EnvPlan
from .errors import BuildError, UsageError
from .lock import Lock
from .pinref import PinRef
from .sources import fetch_artifact

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
    try:  # stream to our stderr when it is a real file (not when a caller captured it in memory)
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        stream = False
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


def ensure_env(venv: Path, wheel: Path, sha256: str, *, extra: list[str] = (), remove: tuple[str, ...] = (),
               post: tuple[str, ...] = (), marker: dict | None = None, progress=None,
               stream: bool = True, host_packages: bool = False) -> tuple[bool, list[str]]:
    """Make `venv` hold exactly this engine wheel (by sha256) plus its dependencies.

    `post` requirements are installed in a second pip call (they may pin below what the
    engine asks for, e.g. numpy<2 for Triton's stub). Returns (reused, removed packages).
    A new build of the same engine is swapped in with --force-reinstall --no-deps.
    `host_packages`: the environment also sees the packages of the one dsadapt runs in
    (`host_site`), after its own, so a host's torch is reused instead of installed.
    """
    py = venv_python(venv)
    old = installed_marker(venv)
    if old and old.get("sha256") == sha256 and py.exists() and old.get("post", []) == list(post):
        return True, []
    if not py.exists() and not old:
        seed = _seed_for(venv, post)
        if seed is not None:
            # Same engine, same dependencies: a copy plus a swapped engine package takes
            # seconds where a fresh resolve and install of torch and friends takes minutes.
            if progress:
                progress(f"creating {venv} from {seed.name} (same engine dependencies)")
            shutil.copytree(seed, venv, symlinks=True)
            old = installed_marker(venv)
    if not py.exists():
        if progress:
            progress(f"creating {venv}")
        in_venv = sys.prefix != sys.base_prefix
        r = subprocess.run([sys.executable, "-m", "venv",
                            *(["--system-site-packages"] if host_packages and not in_venv else []), str(venv)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"could not create {venv}: {r.stderr.strip()[-200:]}", hint="check python3-venv is installed")
        if host_packages:
            host_site(venv)
    if progress:
        progress(f"installing {wheel.name}{' and its dependencies' if not old else ''} into {venv}"
                 f"{' (pip; minutes on first run)' if not old else ''}")
    if old:
        _pip(py, "install", "--force-reinstall", "--no-deps", str(wheel), stream=stream)
    else:
        _pip(py, "install", str(wheel), *extra, stream=stream)
    if post and (not old or old.get("post", []) != list(post)):
        if progress:
            progress(f"adding {' '.join(post)}")
        _pip(py, "install", *post, stream=stream)
    removed = []
    for name in remove:
        r = subprocess.run([str(py), "-m", "pip", "show", "-q", name], capture_output=True)
        if r.returncode == 0:
            _pip(py, "uninstall", "-y", name, stream=False)
            removed.append(name)
    (venv / MARKER).write_text(json.dumps({**(marker or {}), "artifact": str(wheel), "sha256": sha256,
                                           "post": list(post)}, indent=2, sort_keys=True) + "\n")
    return False, removed


def host_site(venv: Path) -> Path | None:
    """Let `venv` see the site-packages of the environment dsadapt runs in, after its own: a
    .pth file listing them (when dsadapt runs in a venv; `--system-site-packages` only reaches
    the base interpreter's, which is what a venv made from the base interpreter gets).
    Returns the .pth written, or None."""
    import site

    if sys.prefix == sys.base_prefix:
        return None
    purelib = subprocess.run([str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in dict.fromkeys(site.getsitepackages()) if Path(p).is_dir()]
    pth = Path(purelib) / "dsadapt-host-packages.pth"
    pth.write_text("".join(f"{p}\n" for p in ours))
    return pth


def _seed_for(venv: Path, post: tuple[str, ...]) -> Path | None:
    """A sibling environment of the same pin and variant (``<engine>-<tag>-<variant>...``) to copy.

    Prefers one with the same extra requirements (`post`); any installed sibling will do, its
    engine package is then swapped and the extras added.
    """
    name = venv.name
    base = name.split("-unpatched")[0].split("-triton")[0]
    siblings = [d for d in sorted(venv.parent.glob(base + "*")) if d != venv and d.name.split("-unpatched")[0]
                .split("-triton")[0] == base and venv_python(d).exists() and installed_marker(d)]
    same = [d for d in siblings if (installed_marker(d) or {}).get("post", []) == list(post)]
    return (same or siblings or [None])[0]


def install_plan(cfg: Config, lock: Lock, plan: EnvPlan, *, unpatched: bool = False, progress=None,
                 stream: bool = True, build: BuildResult | None = None, venv: Path | None = None) -> InstallResult:
    """Make (or reuse) the environment an engine's `plan` describes: the plan pin's build, or
    with `unpatched` its pristine release wheel, plus the plan's recipe.

    Environments are named ``<engine>-<tag>-<variant>[-unpatched][<suffix>]`` under the venvs
    root, so engines run differently (Triton's '-triton') never share site-packages.
    """
    t0 = time.monotonic()
    entry = lock.pin(plan.pin)
    spec = engine(entry.engine).variant(plan.variant)
    recipe = plan.recipe
    base = cfg.venv_dir(entry.engine, entry.tag, spec.name)
    if not unpatched:
        build = build or build_pin(cfg, lock, entry.ref, spec.name, progress=progress)
        venv = venv or base.with_name(base.name + plan.suffix)
        wheel, sha256 = Path(build.artifact), build.sha256
        marker: dict[str, object] = {"ref": str(entry.ref), "variant": spec.name, "stack_hash": build.stack_hash}
    else:
        art = entry.artifact(spec.artifact_variant, wheel=True)
        if art is None:
            raise UsageError(f"{entry} has no pinned wheel for variant {spec.name}", hint="pin one with `dsadapt pin`")
        wheel, sha256 = fetch_artifact(cfg, entry, art, progress), art.sha256
        venv = venv or base.with_name(base.name + "-unpatched" + plan.suffix)
        marker = {"ref": str(entry.ref), "unpatched": True}
    reused, removed = ensure_env(venv, wheel, sha256, extra=list(recipe.extra), remove=recipe.remove,
                                 post=recipe.post, progress=progress, stream=stream, marker=marker,
                                 host_packages=recipe.host_packages)
    return InstallResult(str(entry.ref), spec.name, str(venv), str(venv_python(venv)), str(wheel), sha256, reused,
                         round(time.monotonic() - t0, 2), removed)


def install_pin(cfg: Config, lock: Lock, ref: PinRef, variant: str | None = None, progress=None,
                stream: bool = True, build: BuildResult | None = None, venv: Path | None = None,
                post: tuple[str, ...] = ()) -> InstallResult:
    """Install `ref` where its engine runs it (`Engine.env_plan`): for most engines the pin's own
    environment; for a served one (Triton) the environment of the engine it serves."""
    from dataclasses import replace

    entry = lock.pin(ref)
    eng = engine(ref.engine)
    plan = eng.env_plan(entry, eng.variant_for(entry, variant), lock)
    if post:
        plan = replace(plan, recipe=replace(plan.recipe, post=plan.recipe.post + tuple(post)))
    return install_plan(cfg, lock, plan, progress=progress, stream=stream,
                        build=build if build is not None and plan.pin == ref else None, venv=venv)

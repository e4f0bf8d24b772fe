"""Isolated per-pin environments: an engine is never installed into dsadapt's own environment.

Which environment a pin runs in is the engine's `EnvPlan` (engines/base.py): the pin whose build
it holds, a recipe, and a name suffix. Each planned environment's dependencies come from its hash
lock (patcher/envlocks.py; the lock's name is derived from the plan, `plan_env_name`): `pip install
--require-hashes --no-deps -r <lock>`, then the engine's own wheel (built or fetched by dsadapt,
its sha256 checked against upstream.lock) with `--no-deps`. Nothing is resolved at install time.

The one exception is a recipe with `host_packages` (an engine that reuses the packages of the
environment dsadapt runs in, e.g. a host's CUDA torch, or the pure-Python test engine): its
dependencies are by definition the host's, not dsadapt's to lock, so it has no lock; only the
engine wheel (and the recipe's `extra`/`post`, if any) is installed there, by pip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .build import BuildResult, build_pin
from .config import Config
from .engines import engine
from .engines.base import EnvPlan
from .envlocks import file_digest, find_lock, locked_packages, plan_env_name
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


def _pip(py: Path, *args: str, stream: bool, progress=None) -> None:
    """pip in the environment; its output goes to <venv>/dsadapt-pip.log and, line by line, to the
    progress display (what the install is waiting on), never as a flood on the terminal."""
    quiet = ["--progress-bar", "off"] if args and args[0] == "install" else []
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "--no-input", *args[:1], *quiet, *args[1:]]
    venv = py.parent.parent
    log_path = venv / "dsadapt-pip.log"
    note = getattr(progress, "note", None)
    tail: deque[str] = deque(maxlen=3)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            line = line.rstrip()
            if line:
                tail.append(line)
                if note and not line.startswith("WARNING: "):  # pip's config warnings are not progress
                    note(f"pip: {line}")
        rc = proc.wait()
    if rc != 0:
        raise BuildError(f"pip {' '.join(args[:2])} failed in {venv}: {' | '.join(tail)}",
                         hint=f"see {log_path}; delete {venv} to start over")


def installed_marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def ensure_env(venv: Path, wheel: Path, sha256: str, *, extra: Sequence[str] = (), remove: tuple[str, ...] = (),
               post: tuple[str, ...] = (), marker: dict | None = None, progress=None,
               stream: bool = True, lock_name: str | None = None,
               host_packages: bool = False) -> tuple[bool, list[str]]:
    """Make `venv` hold exactly this engine wheel (by sha256) plus its dependencies.

    With `lock_name` (what dsadapt's own callers pass for every locked environment) the
    dependencies, `post` requirements included, come from that environment's hash lock; `extra`
    and `remove` are then moot (the lock leaves those packages out). Without it (a `host_packages`
    environment, or a library caller's own) the wheel is installed by pip with `extra`, `post`
    requirements in a second pip call, and `remove` uninstalled afterwards.
    Returns (reused, removed packages). A new build of the same engine is swapped in with
    --force-reinstall --no-deps; new locked dependencies rebuild the environment from scratch.
    `host_packages`: the environment also sees the packages of the one dsadapt runs in
    (`host_site`), after its own, so a host's torch is reused instead of installed.
    """
    lock_file = find_lock(lock_name) if lock_name else None  # no lock here: fails before anything is made
    deps = file_digest(lock_file) if lock_file else None
    py = venv_python(venv)
    old = installed_marker(venv)
    if old and old.get("deps_lock") != deps:
        if progress:
            progress(f"{venv.name}: its locked dependencies changed; rebuilding the environment")
        shutil.rmtree(venv)  # derived data, remade below from the lock
        old = None
    if old and old.get("sha256") == sha256 and py.exists() and old.get("post", []) == list(post):
        return True, []
    if not py.exists() and not old:
        seed = _seed_for(venv, post, deps)
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
    removed: list[str] = []
    if lock_file is not None:
        if not old:
            if progress:
                progress(f"installing the {len(locked_packages(lock_file.read_text()))} locked dependencies of "
                         f"{venv.name} ({lock_file.name}, --require-hashes; minutes on first run)")
            _pip(py, "install", "--require-hashes", "--no-deps", "-r", str(lock_file), stream=stream,
                 progress=progress)
        if progress:
            progress(f"installing {wheel.name} into {venv} (--no-deps; sha256 {sha256[:12]}… checked by dsadapt)")
        _pip(py, "install", "--force-reinstall", "--no-deps", str(wheel), stream=stream, progress=progress)
    else:
        if progress:
            progress(f"installing {wheel.name}{' and its dependencies' if not old else ''} into {venv}"
                     f"{' (pip; minutes on first run)' if not old else ''}")
        if old:
            _pip(py, "install", "--force-reinstall", "--no-deps", str(wheel), stream=stream, progress=progress)
        else:
            _pip(py, "install", str(wheel), *extra, stream=stream, progress=progress)
        if post and (not old or old.get("post", []) != list(post)):
            if progress:
                progress(f"adding {' '.join(post)}")
            _pip(py, "install", *post, stream=stream, progress=progress)
        for name in remove:
            shown = subprocess.run([str(py), "-m", "pip", "show", "-q", name], capture_output=True)
            if shown.returncode == 0:
                _pip(py, "uninstall", "-y", name, stream=False)
                removed.append(name)
    (venv / MARKER).write_text(json.dumps({**(marker or {}), "artifact": str(wheel), "sha256": sha256,
                                           "post": list(post), "deps_lock": deps,
                                           "deps_lock_file": lock_file.name if lock_file else None,
                                           "host_packages": host_packages},
                                          indent=2, sort_keys=True) + "\n")
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


def _seed_for(venv: Path, post: tuple[str, ...], deps: str | None = None) -> Path | None:
    """A sibling environment of the same pin and variant (``<engine>-<tag>-<variant>...``) to copy.

    Only one installed from the same dependency lock (`deps`) qualifies. Prefers one with the same
    extra requirements (`post`); any such sibling will do, its engine package is then swapped.
    """
    name = venv.name
    base = name.split("-unpatched")[0].split("-triton")[0]
    siblings = [d for d in sorted(venv.parent.glob(base + "*")) if d != venv and d.name.split("-unpatched")[0]
                .split("-triton")[0] == base and venv_python(d).exists() and installed_marker(d)
                and (installed_marker(d) or {}).get("deps_lock") == deps]
    same = [d for d in siblings if (installed_marker(d) or {}).get("post", []) == list(post)]
    found = same or siblings
    return found[0] if found else None


def plan_lock_name(plan: EnvPlan) -> str | None:
    """The hash lock an environment plan installs from; None for a `host_packages` recipe, whose
    dependencies are the host's (module docstring)."""
    return None if plan.recipe.host_packages else plan_env_name(plan)


def install_plan(cfg: Config, lock: Lock, plan: EnvPlan, *, unpatched: bool = False, progress=None,
                 stream: bool = True, build: BuildResult | None = None, venv: Path | None = None) -> InstallResult:
    """Make (or reuse) the environment an engine's `plan` describes: the plan pin's build, or
    with `unpatched` its pristine release wheel, plus the plan's recipe, its dependencies from the
    plan's hash lock (`plan_lock_name`).

    Environments are named ``<engine>-<tag>-<variant>[-unpatched][<suffix>]`` under the venvs
    root, so engines run differently (Triton's '-triton') never share site-packages; the patched
    and the unpatched environment of a plan install from the same lock.
    """
    t0 = time.monotonic()
    entry = lock.pin(plan.pin)
    spec = engine(entry.engine).variant(plan.variant)
    recipe = plan.recipe
    lock_name = plan_lock_name(plan)
    if lock_name:
        find_lock(lock_name)  # before building: an environment without a lock cannot be made here (exit 6)
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
                                 lock_name=lock_name, host_packages=recipe.host_packages)
    return InstallResult(str(entry.ref), spec.name, str(venv), str(venv_python(venv)), str(wheel), sha256, reused,
                         round(time.monotonic() - t0, 2), removed)


def install_pin(cfg: Config, lock: Lock, ref: PinRef, variant: str | None = None, progress=None,
                stream: bool = True, build: BuildResult | None = None, venv: Path | None = None) -> InstallResult:
    """Install `ref` where its engine runs it (`Engine.env_plan`): for most engines the pin's own
    environment; for a served one (Triton) the environment of the engine it serves."""
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    plan = eng.env_plan(entry, eng.variant_for(entry, variant), lock)
    return install_plan(cfg, lock, plan, progress=progress, stream=stream,
                        build=build if build is not None and plan.pin == ref else None, venv=venv)

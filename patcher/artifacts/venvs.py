"""Isolated per-pin environments: an engine is never installed into dsadapt's own environment.

Which environment a pin runs in is the engine's `EnvPlan` (engines/base.py): the pin whose build
it holds, a recipe, and a name suffix. Each planned environment's dependencies come from its hash
lock (patcher/artifacts/envlocks.py; the lock's name is derived from the plan, `plan_env_name`): `pip install
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from patcher.artifacts.builder import BuildResult, build_pin, unpatched_build
from patcher.artifacts.envlocks import file_digest, find_lock, locked_hashes, locked_packages, plan_env_name
from patcher.base.config import Config
from patcher.base.errors import BuildError, EngineUnavailable, VerificationError
from patcher.base.fsutil import link_tree
from patcher.base.procs import OutputTail, run_logged
from patcher.engines.base import EnvPlan
from patcher.engines.registry import engine
from patcher.formats.bundle import OfflineRecord, find_record
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import load_stack

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
    details: dict = field(default_factory=dict)

    @property
    def activate(self) -> str:
        return f"source {self.venv}/bin/activate"

    def to_json(self) -> dict:
        return {**asdict(self), "activate": self.activate}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip_command(py: Path) -> list[str]:
    """How to run pip for the environment of interpreter `py`: its own pip, or, in an environment
    made without one (a host whose Python lacks ensurepip), this interpreter's pip aimed at it
    (`pip --python`, pip >= 22.3)."""
    venv = py.parent.parent
    if any(venv.glob("lib/python*/site-packages/pip/__init__.py")) or not (venv / "pyvenv.cfg").is_file():
        return [str(py), "-m", "pip"]
    return [sys.executable, "-m", "pip", "--python", str(py)]


#: pip's own configuration warnings: kept in the log, not shown as what an install waits on
PIP_QUIET = ("WARNING: ",)


def _pip(py: Path, *args: str, stream: bool, progress=None, log_path: Path | None = None) -> None:
    """pip in the environment; its output goes to <venv>/dsadapt-pip.log and, line by line, to the
    progress display (what the install is waiting on), never as a flood on the terminal. A failure
    is one line quoting pip's cause (`pip_cause`), the log named in the hint."""
    quiet = ["--progress-bar", "off"] if args and args[0] in ("install", "download") else []
    cmd = [*pip_command(py), "--disable-pip-version-check", "--no-input", *args[:1], *quiet, *args[1:]]
    venv = py.parent.parent
    log_path = log_path or venv / "dsadapt-pip.log"
    tail = OutputTail(progress, "pip: ", quiet=PIP_QUIET)
    with open(log_path, "a", encoding="utf-8") as log:
        rc = run_logged(cmd, log, None, on_line=tail).returncode
    lines = tail.lines
    if rc != 0:
        cause, fix = pip_cause(lines)
        raise BuildError(f"pip {' '.join(args[:2])} failed in {venv}: {cause}",
                         hint=(f"{fix}; " if fix else "") + f"the whole output is in {log_path}; delete {venv} to start over")


#: pip's lines that say why an install failed, most telling first (a regular expression each, and
#: what to do about it)
_PIP_CAUSES: tuple[tuple[str, str], ...] = (
    (r"No matching distribution found for (\S+)",
     "the package index this machine reaches does not serve it (for the CPU torch build: set "
     "DSADAPT_TORCH_INDEX=https://download.pytorch.org/whl/cpu, docs/environments.md)"),
    (r"THESE PACKAGES DO NOT MATCH THE HASHES", "a downloaded file is not the one the lock names: a proxy or mirror "
                                                "serves other bytes; fix that source, never the lock"),
    (r"ResolutionImpossible|Cannot install .* because these package versions have conflicting dependencies|"
     r"conflict is caused by|requested \(constraint\)", "a pip constraint or requirement of this machine "
                                                         "(PIP_CONSTRAINT, pip.conf) conflicts with the locked versions"),
    (r"No space left on device", "free disk space (`dsadapt gc`, old environments under .dsadapt/venvs)"),
    (r"Could not install packages due to an OSError", "fix the file-system problem it names"),
    (r"Failed to establish a new connection|Max retries exceeded|Network is unreachable|Temporary failure in name "
     r"resolution|Could not fetch URL|ReadTimeoutError|ConnectTimeoutError|SSLError",
     "check the network or the proxy (pip's own configuration applies: pip config list)"),
    (r"Failed building wheel for (\S+)|subprocess-exited-with-error", "a package had to be built from source here"),
    (r"Hashes are required in --require-hashes mode", "a requirement without a hash reached pip: regenerate the lock"),
    (r"requires a different Python", "this Python is not one the package supports"),
)


def pip_cause(lines: list[str]) -> tuple[str, str | None]:
    """Pure: (why pip failed, in its own words, one line; what to do) from pip's output. pip's most
    telling line is often not its first ERROR line ("Ignored the following versions that require
    a different python version" comes before "No matching distribution found for torch==…")."""
    import re

    for pattern, fix in _PIP_CAUSES:
        for line in lines:
            if re.search(pattern, line):
                text = line.strip().removeprefix("ERROR: ").strip()
                if "DO NOT MATCH THE HASHES" in line:
                    pkg = next((x.strip() for x in lines[lines.index(line) + 1:]
                                if re.match(r"\s*\S+==\S+ from ", x)), None)
                    text = "hash mismatch" + (f": {pkg.split(' from ')[0]}" if pkg else "")
                return text[:300], fix
    errors = [x.strip().removeprefix("ERROR: ") for x in lines if x.startswith("ERROR:")]
    if errors:
        return errors[-1][:300], None
    return (lines[-1].strip()[:300] if lines else "no output"), None


def make_venv(venv: Path, *, host_packages: bool = False) -> None:
    """`python -m venv` with this interpreter (with `host_packages`, seeing the packages of the
    environment dsadapt runs in). A Python without ensurepip (Debian without python3-venv, some
    images) gets an environment without pip, which `pip_command` then serves."""
    in_venv = sys.prefix != sys.base_prefix
    args = [sys.executable, "-m", "venv", *(["--system-site-packages"] if host_packages and not in_venv else [])]
    if host_packages:
        # nothing of its own but what dsadapt installs: the pip and setuptools ensurepip would put
        # there would shadow the host's (Python 3.11 venvs get setuptools 65, torch asks for >= 77);
        # dsadapt's pip serves it (`pip_command`)
        args.append("--without-pip")
    r = subprocess.run([*args, str(venv)], capture_output=True, text=True)
    if r.returncode != 0 and "ensurepip" in (r.stderr + r.stdout) and "--without-pip" not in args:
        shutil.rmtree(venv, ignore_errors=True)
        r = subprocess.run([*args, "--without-pip", str(venv)], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"could not create {venv}: {r.stderr.strip()[-200:]}", hint="check python3-venv is installed")
    if host_packages:
        host_site(venv)


def installed_marker(venv: Path) -> dict | None:
    try:
        return json.loads((venv / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class EnvContents:
    """What an engine environment is made to hold: the engine wheel (by sha256) and where its
    dependencies come from.

    With `lock_name` (what dsadapt's own callers pass for every locked environment) the
    dependencies, `post` requirements included, come from that environment's hash lock; `extra`
    and `remove` are then moot (the lock leaves those packages out). Without it (a `host_packages`
    environment, or a library caller's own) the wheel is installed by pip with `extra`, `post`
    requirements in a second pip call, and `remove` uninstalled afterwards.
    `host_packages`: the environment also sees the packages of the one dsadapt runs in
    (`host_site`), after its own, so a host's torch is reused instead of installed.
    `lock_file` names the hash lock directly (an offline bundle's), `pip_args` go to every pip
    install (`--no-index --find-links BUNDLE/wheels`); `marker` and `details` go into the install
    marker. `siblings`: environments of the same pin and variant a new one may be copied from
    (`_seed_for`)."""

    wheel: Path
    sha256: str
    extra: Sequence[str] = ()
    remove: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    lock_name: str | None = None
    lock_file: Path | None = None
    host_packages: bool = False
    pip_args: Sequence[str] = ()
    marker: dict | None = None
    details: dict | None = None
    siblings: Sequence[Path] = ()


def ensure_env(venv: Path, contents: EnvContents, *, progress=None, stream: bool = True) -> tuple[bool, list[str]]:
    """Make `venv` hold exactly `contents` (the engine wheel, by sha256, plus its dependencies).

    Returns (reused, removed packages). A new build of the same engine is swapped in with
    --force-reinstall --no-deps; new locked dependencies rebuild the environment from scratch.
    """
    c = contents
    lock_file = c.lock_file if c.lock_file is not None or not c.lock_name else find_lock(c.lock_name)
    deps = file_digest(lock_file) if lock_file else None  # no lock here: failed above, before anything is made
    py = venv_python(venv)
    old = installed_marker(venv)
    if old and old.get("deps_lock") != deps:
        if progress:
            progress(f"{venv.name}: its locked dependencies changed; rebuilding the environment")
        shutil.rmtree(venv)  # derived data, remade below from the lock
        old = None
    if old and old.get("sha256") == c.sha256 and py.exists() and old.get("post", []) == list(c.post):
        return True, []
    old = _make_venv(venv, c, deps, old, progress)
    removed: list[str] = []
    if lock_file is not None:
        torch_build = _install_locked(py, venv, c, lock_file, old, stream, progress)
    else:
        torch_build = None
        removed = _install_unlocked(py, venv, c, old, stream, progress)
    if progress is not None and hasattr(progress, "end"):
        progress.end()
    (venv / MARKER).write_text(json.dumps({**(c.marker or {}), **(c.details or {}), "artifact": str(c.wheel),
                                           "sha256": c.sha256, "post": list(c.post), "deps_lock": deps,
                                           "deps_lock_file": lock_file.name if lock_file else None,
                                           "torch_build": torch_build, "host_packages": c.host_packages},
                                          indent=2, sort_keys=True) + "\n")
    return False, removed


def _make_venv(venv: Path, c: EnvContents, deps: str | None, old: dict | None, progress) -> dict | None:
    """The environment's interpreter, made where there is none: copied from a sibling with the same
    dependencies where one exists, else a fresh venv. Returns the install marker it now has."""
    py = venv_python(venv)
    if not py.exists() and not old:
        seed = _seed_for(venv, c.siblings, c.post, deps)
        if seed is not None:
            # Same engine, same dependencies: a copy plus a swapped engine package takes
            # seconds where a fresh resolve and install of torch and friends takes minutes.
            if progress:
                progress(f"creating {venv} from {seed.name} (same engine dependencies, site-packages hard-linked)")
            link_tree(seed, venv)
            retarget_scripts(venv, seed)
            old = installed_marker(venv)
    if not py.exists():
        if progress:
            progress(f"creating {venv}")
        make_venv(venv, host_packages=c.host_packages)
    return old


def _install_locked(py: Path, venv: Path, c: EnvContents, lock_file: Path, old: dict | None, stream: bool,
                    progress) -> str | None:
    """The dependencies from the hash lock (a new environment only), then the engine wheel by itself.
    Returns the torch build the lock installed (or the one it had)."""
    torch_build = None
    if not old and locked_packages(lock_file.read_text()):
        torch_build = install_lock(py, venv, lock_file, c.pip_args, stream=stream, progress=progress)
    elif old:
        torch_build = old.get("torch_build")
    if progress:
        progress(f"installing {c.wheel.name} into {venv} (--no-deps; sha256 {c.sha256[:12]}… checked by dsadapt)")
    _pip(py, "install", *c.pip_args, "--force-reinstall", "--no-deps", str(c.wheel), stream=stream, progress=progress)
    return torch_build


def _install_unlocked(py: Path, venv: Path, c: EnvContents, old: dict | None, stream: bool, progress) -> list[str]:
    """The engine wheel with pip resolving its dependencies (and `extra`), `post` in a second call,
    then `remove` uninstalled. Returns what was removed."""
    if progress:
        progress(f"installing {c.wheel.name}{' and its dependencies' if not old else ''} into {venv}"
                 f"{' (pip; minutes on first run)' if not old else ''}")
    if old:
        _pip(py, "install", "--force-reinstall", "--no-deps", str(c.wheel), stream=stream, progress=progress)
    else:
        _pip(py, "install", str(c.wheel), *c.extra, stream=stream, progress=progress)
    if c.post and (not old or old.get("post", []) != list(c.post)):
        if progress:
            progress(f"adding {' '.join(c.post)}")
        _pip(py, "install", *c.post, stream=stream, progress=progress)
    removed = []
    for name in c.remove:
        shown = subprocess.run([str(py), "-m", "pip", "show", "-q", name], capture_output=True)
        if shown.returncode == 0:
            _pip(py, "uninstall", "-y", name, stream=False)
            removed.append(name)
    return removed


def index_args(pip_args: Sequence[str] = ()) -> list[str]:
    """`--extra-index-url $DSADAPT_TORCH_INDEX` (PyPI does not serve PyTorch's CPU build) unless pip
    is kept off every index (an offline bundle's `--no-index`)."""
    import os

    from patcher.artifacts.envlocks import TORCH_INDEX_VAR

    url = os.environ.get(TORCH_INDEX_VAR, "").strip()
    return ["--extra-index-url", url] if url and "--no-index" not in pip_args else []


def install_lock(py: Path, venv: Path, lock_file: Path, pip_args: Sequence[str] = (), *, stream: bool = True,
                 progress=None) -> str | None:
    """Install a hash lock (`--require-hashes --no-deps`). A CPU environment's lock accepts two
    builds of torch (envlocks: PyPI's, a CUDA build, and the CPU build, which pip takes where an
    index or wheel folder it is configured with serves it): its last section, the CUDA libraries
    PyPI's build loads, is installed only when pip took PyPI's build. Returns which build of torch
    was installed ('cpu', 'pypi'; None for a lock without that choice)."""
    from patcher.artifacts.envlocks import CUDA_TORCH_SECTION, split_sections

    text = lock_file.read_text(encoding="utf-8")
    main, cuda = split_sections(text)
    n_locked = len(locked_packages(main))
    extra = index_args(pip_args) if cuda.strip() else []  # only a lock that takes either torch build
    if progress:
        progress(f"installing the {n_locked} locked dependencies of {venv.name} ({lock_file.name}, --require-hashes"
                 f"{', ' + ' '.join(extra) if extra else ''}; minutes on first run)")
    if not cuda.strip():
        _pip(py, "install", *pip_args, *extra, "--require-hashes", "--no-deps", "-r", str(lock_file), stream=stream,
             progress=progress)
        return None
    cpu_build = cpu_torch_build(text)
    if cpu_build:
        # the CPU build first, where an index or wheel folder pip is configured with serves it: asked
        # for by its own version, since pip otherwise prefers a build whose hash its index states
        # (PyPI's) over an unhashed file of a wheel folder
        hashes = locked_hashes(main).get("torch", ("", ()))[1]
        part = venv / f"dsadapt-{lock_file.stem}-torch.txt"
        part.write_text(f"torch=={cpu_build} " + " ".join(f"--hash=sha256:{h}" for h in hashes) + "\n",
                        encoding="utf-8")
        if progress:
            progress(f"installing torch=={cpu_build} (the CPU build), where pip finds it")
        try:
            _pip(py, "install", *pip_args, *extra, "--require-hashes", "--no-deps", "-r", str(part), stream=stream,
                 progress=progress)
        except BuildError as e:
            if "No matching distribution" not in e.message:
                raise
            if progress:
                progress(f"torch=={cpu_build} is not served here (PyPI has no CPU build): taking PyPI's build")
    part = venv / f"dsadapt-{lock_file.stem}-common.txt"
    part.write_text(main, encoding="utf-8")
    _pip(py, "install", *pip_args, *extra, "--require-hashes", "--no-deps", "-r", str(part), stream=stream,
         progress=progress)
    version = installed_version(py, "torch")
    if version is not None and "+" in version and version.split("+", 1)[1].startswith("cpu"):
        return "cpu"
    part = venv / f"dsadapt-{lock_file.stem}-cuda.txt"
    part.write_text(CUDA_TORCH_SECTION + "\n" + cuda, encoding="utf-8")
    if progress:
        progress(f"installing the {len(locked_packages(cuda))} CUDA libraries PyPI's torch {version} loads "
                 f"(the CPU build needs none: DSADAPT_TORCH_INDEX, docs/environments.md)")
    _pip(py, "install", *pip_args, *extra, "--require-hashes", "--no-deps", "-r", str(part), stream=stream,
         progress=progress)
    return "pypi"


def cpu_torch_build(lock_text: str) -> str | None:
    """Pure: the CPU build of torch a lock accepts besides PyPI's (`2.13.0+cpu`), as its header
    says, or None."""
    import re

    m = re.search(r"^# torch==\S+: .*the CPU build torch==(\S+)", lock_text, re.M)
    return m.group(1) if m else None


def installed_version(py: Path, dist: str) -> str | None:
    """The version of `dist` installed in the environment of `py` (read from its metadata)."""
    r = subprocess.run([str(py), "-c", "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))", dist],
                       capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def retarget_scripts(venv: Path, seed: Path) -> int:
    """Point the scripts of an environment copied from `seed` (their #! lines, activate's
    VIRTUAL_ENV) at the copy; each rewritten file is replaced, never edited in place."""
    import os

    n = 0
    old, new = str(seed).encode(), str(venv).encode()
    for f in sorted((venv / "bin").iterdir()) if (venv / "bin").is_dir() else []:
        if f.is_symlink() or not f.is_file() or f.stat().st_size > 1 << 20:
            continue
        data = f.read_bytes()
        if old in data and b"\0" not in data[:4096]:
            tmp = f.with_name(f".{f.name}.tmp-{os.getpid()}")
            tmp.write_bytes(data.replace(old, new))
            shutil.copymode(f, tmp)
            os.replace(tmp, f)
            n += 1
    return n


HOST_PTH = "dsadapt-host-packages.pth"


def host_pth_text(dirs: list[str]) -> str:
    """A .pth file that lends `dirs` to an environment after its own site-packages, each through
    `site.addsitedir` (so the .pth files in them take effect too, as with --system-site-packages)."""
    return ("# written by dsadapt: the host's site-packages, seen after this environment's own\n"
            + "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))


def read_host_pth(path: Path) -> list[str]:
    """The folders a HOST_PTH file lends (its own format, or plain folder lines)."""
    import ast
    import re

    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.fullmatch(r"import site; site\.addsitedir\((.+)\)", line.strip())
        if m:
            out.append(str(ast.literal_eval(m.group(1))))
        elif line.strip() and not line.startswith(("#", "import")):
            out.append(line.strip())
    return out


def host_dirs() -> list[str]:
    """The site-packages an engine environment with `host_packages` sees besides its own: the
    host environment's. When dsadapt runs in an environment that itself lends a host's packages
    (the bundle's bootstrap.py writes HOST_PTH into it), those lent folders, and not dsadapt's
    own (its reference transformers, GitPython...: none of the engine's business); otherwise
    the site-packages of the environment dsadapt runs in."""
    import site

    own = list(dict.fromkeys(site.getsitepackages()))
    for d in own:
        pth = Path(d) / HOST_PTH
        if pth.is_file():
            return [p for p in read_host_pth(pth) if Path(p).is_dir()]
    return [p for p in own if Path(p).is_dir()]


def host_site(venv: Path) -> Path | None:
    """Let `venv` see the host's site-packages (`host_dirs`), after its own: a .pth file listing
    them (when dsadapt runs in a venv; `--system-site-packages` only reaches the base
    interpreter's, which is what a venv made from the base interpreter gets).
    Returns the .pth written, or None."""
    if sys.prefix == sys.base_prefix:
        return None
    purelib = subprocess.run([str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    pth = Path(purelib) / HOST_PTH
    pth.write_text(host_pth_text(host_dirs()))
    return pth


def _seed_for(venv: Path, siblings: Sequence[Path], post: tuple[str, ...], deps: str | None = None) -> Path | None:
    """One of `siblings` (environments of the same pin and variant) to copy.

    Only one installed from the same dependency lock (`deps`) qualifies. Prefers one with the same
    extra requirements (`post`); any such sibling will do, its engine package is then swapped.
    """
    found = [d for d in siblings if d != venv and venv_python(d).exists() and installed_marker(d)
             and (installed_marker(d) or {}).get("deps_lock") == deps]
    same = [d for d in found if (installed_marker(d) or {}).get("post", []) == list(post)]
    found = same or found
    return found[0] if found else None


def plan_lock_name(plan: EnvPlan) -> str | None:
    """The hash lock an environment plan installs from; None for a `host_packages` recipe, whose
    dependencies are the host's (module docstring)."""
    return None if plan.recipe.host_packages else plan_env_name(plan)


def install_plan(cfg: Config, lock: Lock, plan: EnvPlan, *, unpatched: bool = False, progress=None,
                 stream: bool = True, build: BuildResult | None = None, venv: Path | None = None) -> InstallResult:
    """Make (or reuse) the environment an engine's `plan` describes: the plan pin's build, or
    with `unpatched` its unpatched build (the release wheel; for a variant that leaves members
    out, the release wheel with that leave-out: `build.unpatched_build`), plus the plan's recipe,
    its dependencies from the plan's hash lock (`plan_lock_name`).

    Environments are named ``<engine>-<tag>-<variant>[-unpatched][<suffix>]`` under the venvs
    root, so an engine run differently (a plan's suffix) never shares site-packages; the patched
    and the unpatched environment of a plan install from the same lock.

    After `dsadapt install --offline BUNDLE` (a record next to the environments, `bundlefile`), the builds
    and the hash lock come from that bundle and pip never leaves it (`--no-index`): nothing is
    built or fetched, so this works on a machine without network.
    """
    t0 = time.monotonic()
    entry = lock.pin(plan.pin)
    spec = engine(entry.engine).variant(plan.variant)
    recipe = plan.recipe
    base = cfg.venv_dir(entry.engine, entry.tag, spec.name)
    venv = venv or base.with_name(base.name + ("-unpatched" if unpatched else "") + plan.suffix)
    offline = find_record(cfg, entry.ref, spec.name) if not plan.suffix and build is None else None
    if offline is not None:
        contents = _offline_install(cfg, entry, spec.name, offline, unpatched)
    else:
        lock_name = plan_lock_name(plan)
        if lock_name:
            find_lock(lock_name)  # before building: an environment without a lock cannot be made here (exit 6)
        marker: dict
        if not unpatched:
            build = build or build_pin(cfg, lock, entry.ref, spec.name, progress=progress)
            marker = {"ref": str(entry.ref), "variant": spec.name, "stack_hash": build.stack_hash}
        else:
            build = unpatched_build(cfg, entry, spec, cfg.dist_dir, progress)
            marker = {"ref": str(entry.ref), "variant": spec.name, "unpatched": True, "unpatched_build": build.kind}
        contents = EnvContents(Path(build.artifact), build.sha256, marker=marker, lock_name=lock_name,
                               host_packages=recipe.host_packages)
    siblings = [base.with_name(base.name + side + suffix) for suffix in dict.fromkeys(("", plan.suffix))
                for side in ("", "-unpatched")]
    contents = replace(contents, extra=list(recipe.extra), remove=recipe.remove, post=recipe.post, siblings=siblings)
    reused, removed = ensure_env(venv, contents, progress=progress, stream=stream)
    wheel, sha256 = contents.wheel, contents.sha256
    return InstallResult(str(entry.ref), spec.name, str(venv), str(venv_python(venv)), str(wheel), sha256, reused,
                         round(time.monotonic() - t0, 2), removed, details=_env_details(venv))


def _offline_install(cfg: Config, entry, variant: str, rec: OfflineRecord, unpatched: bool) -> EnvContents:
    """What an environment installed from a bundle holds (its build, the bundle's lock and wheels)."""
    side = "unpatched" if unpatched else "patched"
    if not unpatched:
        stack = load_stack(cfg.patches_root, entry.ref)
        if stack.hash != rec.stack_hash:
            raise VerificationError(
                f"{entry}: the stack changed since the bundle installed here was made (bundle {rec.stack_hash[:10]}, "
                f"stack {stack.short_hash})",
                hint=f"make a new bundle on a machine with network (`dsadapt bundle {entry.ref} --variant {variant}`) "
                     f"and install it with `dsadapt install --offline`")
    build = rec.builds.get(side)
    if build is None:
        raise EngineUnavailable(f"{entry} ({variant}): the installed bundle {rec.bundle} has no {side} build",
                                hint=f"make the bundle without --no-unpatched to check the {side} engine here")
    wheel = Path(build["wheel"])
    if not wheel.is_file():
        raise EngineUnavailable(f"{entry}: the bundle installed here is gone ({wheel} is missing)",
                                hint="install it again: `dsadapt install --offline BUNDLE`")
    marker = {"ref": str(entry.ref), "variant": variant, "stack_hash": rec.stack_hash if not unpatched else None,
              "unpatched": unpatched, "unpatched_build": build.get("kind") if unpatched else None}
    # the host's packages this environment relies on, at the versions found when it was installed
    # (bundle.json has the requirements that apply to each)
    details = {"bundle": rec.bundle, "host_packages_used": {n: h.get("here") for n, h in sorted(rec.host.items())}}
    return EnvContents(wheel, build["sha256"], marker=marker, lock_file=Path(rec.lock), host_packages=rec.host_packages,
                       pip_args=("--no-index", "--find-links", rec.wheels, "--ignore-installed"), details=details)


def _env_details(venv: Path) -> dict:
    """What an environment's install marker says beyond the engine wheel (for reports)."""
    m = installed_marker(venv) or {}
    keys = ("deps_lock", "deps_lock_file", "host_packages", "bundle", "host_packages_used", "unpatched_build")
    return {k: m[k] for k in keys if m.get(k) is not None}


def install_pin(cfg: Config, lock: Lock, ref: PinRef, variant: str | None = None, progress=None,
                stream: bool = True, build: BuildResult | None = None, venv: Path | None = None) -> InstallResult:
    """Install `ref` where its engine runs it (`Engine.env_plan`): for most engines the pin's own
    environment; for a served one (Triton) the environment of the engine it serves."""
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    plan = eng.env_plan(entry, eng.variant_for(entry, variant), lock)
    return install_plan(cfg, lock, plan, progress=progress, stream=stream,
                        build=build if build is not None and plan.pin == ref else None, venv=venv)

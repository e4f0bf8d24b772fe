"""dsadapt install --offline BUNDLE: a pin's environments from a bundle, with no network.

Checks first, changes nothing until they pass: every file of the bundle against its sha256
(bundle.json), this machine against the bundle (Python X.Y, platform), the project against the
bundle (the pin's stack hash), and this environment against the packages the bundle relies on
(each present, at a version every requirement recorded for it accepts). Then it records the
bundle next to the environments (`bundlefile.OfflineRecord`) and makes the pin's environments, patched
and unpatched, through the same `venvs.install_plan` that `check` uses, which then finds the
bundle's builds and lock instead of building: pip runs with ``--no-index --find-links
BUNDLE/wheels --require-hashes --no-deps``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.artifacts.venvs import InstallResult, host_dirs, install_plan, pip_command, venv_python
from patcher.base.config import Config
from patcher.base.errors import EngineUnavailable, UsageError, VerificationError, show
from patcher.engines.registry import engine
from patcher.formats.bundle import (
    Manifest,
    OfflineRecord,
    find_record,
    read_manifest,
    unpack_tar,
    verify_bundle,
    write_record,
)
from patcher.formats.lock import Lock
from patcher.formats.stackfiles import load_stack


@dataclass
class OfflineResult:
    pin: str
    variant: str
    bundle: str
    environments: dict[str, dict]
    host_packages: dict[str, str | None]
    warnings: list[str] = field(default_factory=list)
    record: str = ""
    #: the bundle's extra stacks, each installed in its own project (`bundle --stack`)
    stacks: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def precheck_bundle(path: Path) -> None:
    """What --offline BUNDLE can be told before the work-dir lock and any unpacking: it exists, a
    file is a tar archive, a folder holds a bundle's manifest (bad input changes nothing)."""
    import tarfile

    from patcher.formats.bundle import read_manifest

    if not path.exists():
        raise UsageError(f"--offline {show(path, 120)}: no such file or folder",
                         hint="pass the folder (or .tar) `dsadapt bundle` wrote")
    if path.is_file() and not tarfile.is_tarfile(path):
        raise UsageError(f"{show(path, 120)}: not a readable tar", hint="pass the .tar `dsadapt bundle --tar` wrote")
    if path.is_dir():
        read_manifest(path)


def open_bundle(cfg: Config, path: Path, progress=None) -> Path:
    """The bundle directory for `path` (a folder, or a .tar unpacked into the work dir)."""
    precheck_bundle(path)
    if path.is_file():
        dest = cfg.workdir / "bundles" / path.name.removesuffix(".tar")
        if dest.exists():
            if not any(dest.rglob("bundle.json")) and any(dest.iterdir()):
                raise UsageError(f"{dest} exists and holds no bundle", hint="move it away and try again")
            shutil.rmtree(dest)  # an earlier unpacking of a bundle: derived data
        if progress:
            progress(f"unpacking {path.name} into {dest}")
        return unpack_tar(path, dest)
    return path


def check_machine(m: Manifest) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != m.python:
        raise EngineUnavailable(f"the bundle is for Python {m.python}; dsadapt runs on Python {here} here",
                                hint=f"run dsadapt with Python {m.python} (the bundle's bootstrap.py makes its "
                                     f"environment), or make the bundle with --python {here}")
    arch = platform.machine()
    want = "aarch64" if any(p.endswith("aarch64") for p in m.platforms) else "x86_64"
    if arch not in (want, "AMD64" if want == "x86_64" else want) or not sys.platform.startswith("linux"):
        raise EngineUnavailable(f"the bundle is for Linux {want}; this is {sys.platform} {arch}",
                                hint="make the bundle with the --platform of this machine")


def installed_versions(paths: list[str] | None = None) -> dict[str, str]:
    """{canonical name: version} of the distributions on `paths` (default: what dsadapt sees),
    first found wins, as for imports."""
    from importlib.metadata import distributions

    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for d in (distributions(path=paths) if paths is not None else distributions()):
        name = d.metadata["Name"] if d.metadata else None
        if name:
            out.setdefault(str(canonicalize_name(name)), d.version)
    return out


def check_host(m: Manifest, views: dict[str, dict[str, str]] | None = None) -> tuple[dict[str, str | None], list[str]]:
    """The packages the bundle relies on, as the target has them; a typed error when one is missing,
    or when one the bundle was made for at a stated version is at a version a recorded requirement
    does not accept (a name given without a version is the bundle maker's word: a violation is a
    warning, recorded with the environments). `views`: per part, {name: version} as that part's
    environment sees them (default: dsadapt's environment for "dsadapt", the host's site-packages
    that engine environments see for "engine": `venvs.host_dirs`)."""
    import re

    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if views is None:
        views = {"dsadapt": installed_versions(), "engine": installed_versions(host_dirs())}
    found: dict[str, str | None] = {}
    warnings = []
    for part_name, part in sorted(m.parts.items()):
        seen = views.get(part_name, {})
        for name, info in sorted(part.host.items()):
            got = seen.get(name)
            made_for = info.get("have")
            if got is None:
                raise EngineUnavailable(
                    f"the bundle relies on the target's {name}" + (f" {made_for}" if made_for else "")
                    + f" ({part_name} environment); this environment has no {name}",
                    hint="run dsadapt in the environment that has it (bootstrap.py with that Python, "
                         "--system-site-packages), or make the bundle without --have for it")
            for need in info.get("need", []):
                spec = re.sub(r"\s*\(.*\)\s*$", "", need).strip()
                if not spec or spec.startswith("(") or spec == "(any)":
                    continue
                try:
                    ok = SpecifierSet(spec).contains(got, prereleases=True)
                except InvalidSpecifier:
                    continue
                if not ok and not made_for:
                    warnings.append(f"{name} {got} here does not satisfy {need} (the bundle was told the target "
                                    f"has {name} without a version, so it did not carry one)")
                elif not ok:
                    raise EngineUnavailable(
                        f"the bundle relies on the target's {name} ({need}); this environment has {name} {got}",
                        hint="make the bundle with a probe of this host (`python3 -m pip list --format=json > "
                             "host.json`, then `dsadapt bundle ... --have host.json`)")
            if made_for and got != made_for:
                warnings.append(f"{name} is {got} here; the bundle was made for {made_for} (its requirements "
                                "accept both)")
            found[name] = got
    return found, warnings


def check_project(cfg: Config, lock: Lock, m: Manifest, bundle: Path) -> None:
    """The project dsadapt runs in must hold the bundle's pin with the same stack."""
    ref = m.ref
    try:
        entry = lock.pin(ref)
    except UsageError:
        raise UsageError(f"{ref} is not pinned in {cfg.lock_path}",
                         hint=f"run dsadapt in the bundle's folder (cd {bundle}): it is a project holding the pin") \
            from None
    stack = load_stack(cfg.patches_root, ref)
    if stack.hash != m.stack_hash:
        raise VerificationError(f"{ref}: the stack in {cfg.patches_root} ({stack.short_hash}) is not the one the bundle "
                                f"was built from ({m.stack_hash[:10]})",
                                hint=f"run dsadapt in the bundle's folder (cd {bundle}), or make a new bundle")
    bundled = read_lock_entry(bundle, ref)
    if bundled is not None and {a.sha256 for a in bundled.artifacts} != {a.sha256 for a in entry.artifacts}:
        raise VerificationError(f"{ref}: {cfg.lock_path} pins other release artifacts than the bundle",
                                hint=f"run dsadapt in the bundle's folder (cd {bundle})")


def read_lock_entry(bundle: Path, ref):
    from patcher.formats.lock import load_lock

    try:
        return load_lock(bundle / "upstream.lock").pin(ref)
    except UsageError:
        return None


def install_offline(cfg: Config, lock: Lock, path: Path, *, system_site_packages: bool = False, progress=None,
                    stream: bool = True) -> OfflineResult:
    bundle = open_bundle(cfg, path, progress).resolve()
    m = verify_bundle(bundle, progress)
    check_machine(m)
    if m.host_packages and not system_site_packages:
        need = sorted({n for p in m.parts.values() for n in p.host})
        raise UsageError(f"the bundle relies on packages of this host ({', '.join(need[:6])}"
                         f"{', …' if len(need) > 6 else ''}): its environments must see them",
                         hint="pass --system-site-packages (and run dsadapt in the environment that has them)")
    check_project(cfg, lock, m, bundle)
    host, warnings = check_host(m) if system_site_packages else ({}, [])
    entry = lock.pin(m.ref)
    eng = engine(m.engine)
    spec = eng.variant(m.variant)
    plan = eng.env_plan(entry, spec, lock)
    if plan.pin != m.ref or plan.suffix:
        raise UsageError(f"{m.ref} runs in the environment of {plan.pin}{plan.suffix}: not installable from a bundle",
                         hint=f"see {eng.docs_page}")
    builds = {side: {"wheel": str(bundle / b.file), "sha256": b.sha256, "version": b.version, "kind": b.kind}
              for side, b in m.builds.items()}
    record = OfflineRecord(pin=str(m.ref), variant=m.variant, bundle=str(bundle), stack_hash=m.stack_hash,
                           builds=builds, lock=str(bundle / m.parts["engine"].lock), wheels=str(bundle / "wheels"),
                           host_packages=system_site_packages,
                           host={n: {"here": v, **m.parts["engine"].host.get(n, m.parts["dsadapt"].host.get(n, {}))}
                                 for n, v in host.items()},
                           created=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    previous = find_record(cfg, m.ref, m.variant)
    rec_path = write_record(cfg, record)
    if previous is not None and previous.bundle != record.bundle and progress:
        progress(f"{m.ref} ({m.variant}) was installed from {previous.bundle}; now from {record.bundle}")
    envs: dict[str, dict] = {}
    for side in m.builds:
        res: InstallResult = install_plan(cfg, lock, plan, unpatched=side == "unpatched", progress=progress,
                                          stream=stream)
        problems, expected = split_expected(pip_check(Path(res.python)), m)
        envs[side] = {"venv": res.venv, "python": res.python, "artifact": Path(res.artifact).name,
                      "sha256": res.sha256, "reused": res.reused, "seconds": res.seconds, "pip_check": problems,
                      "pip_check_left_out": expected}
        warnings += [f"{side} environment: pip check: {p}" for p in problems[:5]]
    stacks = {name: _install_stack(bundle, m, name, info, record, plan, lock, envs.get("patched"), progress, stream)
              for name, info in sorted(m.stacks.items())}
    return OfflineResult(str(m.ref), m.variant, str(bundle), envs, host, warnings, str(rec_path), stacks)


def _install_stack(bundle: Path, m: Manifest, name: str, info: dict, main: OfflineRecord, plan, lock: Lock,
                   main_env: dict | None, progress, stream: bool) -> dict:
    """One extra stack of the bundle (`bundle --stack`): its project is stacks/NAME/ (the pin and
    that stack), its environment stacks/NAME/.dsadapt/venvs/<env>, seeded by copying the main
    patched environment (same locked dependencies) and swapping in the stack's overlay build, so it
    costs seconds. `dsadapt --project BUNDLE/stacks/NAME check ...` then runs that stack."""
    from patcher.base.config import load_config
    from patcher.formats.lock import load_lock

    project = bundle / info["project"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
    cfg = load_config(project=project, env=env)
    build = info["build"]
    rec = OfflineRecord(pin=main.pin, variant=main.variant, bundle=str(bundle), stack_hash=info["stack_hash"],
                        builds={"patched": {"wheel": str(bundle / build["file"]), "sha256": build["sha256"],
                                            "version": build["version"], "kind": build["kind"]}},
                        lock=main.lock, wheels=main.wheels, host_packages=main.host_packages, host=main.host,
                        created=main.created)
    write_record(cfg, rec)
    entry = lock.pin(m.ref)
    venv = cfg.venv_dir(entry.engine, entry.tag, m.variant)
    if main_env and not venv.exists():
        if progress:
            progress(f"stack {name}: seeding {venv} from {main_env['venv']}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(main_env["venv"], venv, symlinks=True)
    res = install_plan(cfg, load_lock(cfg.lock_path), plan, progress=progress, stream=stream)
    return {"project": str(project), "venvs": str(cfg.venvs_root), "venv": res.venv, "python": res.python,
            "artifact": Path(res.artifact).name, "sha256": res.sha256, "stack_hash": info["stack_hash"],
            "seconds": res.seconds}


def split_expected(problems: list[str], m: Manifest) -> tuple[list[str], list[str]]:
    """pip check's lines, split into real problems and the expected ones: a requirement the bundle
    left out on purpose (`unused_deps`, --exclude) is "not installed"."""
    import re

    from packaging.utils import canonicalize_name

    left = {n for p in m.parts.values() for n in p.left_out}
    real, expected = [], []
    for line in problems:
        hit = re.search(r"requires ([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if hit and "not installed" in line and str(canonicalize_name(hit.group(1))) in left:
            expected.append(line)
        else:
            real.append(line)
    return real, expected


def pip_check(py: Path) -> list[str]:
    """`pip check` in an environment: dependency conflicts among what it sees (recorded, not fatal:
    a host's unrelated packages may conflict among themselves)."""
    try:
        r = subprocess.run([*pip_command(py), "check", "--disable-pip-version-check"], capture_output=True,
                           text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"could not run pip check: {e}"]
    if r.returncode == 0:
        return []
    return [line.strip() for line in (r.stdout or r.stderr).splitlines() if line.strip()][:50]


__all__ = ["OfflineResult", "install_offline", "open_bundle", "read_manifest", "venv_python"]

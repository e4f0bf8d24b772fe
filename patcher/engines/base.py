"""The engine contract: what an engine adapter declares and does, and what dsadapt lends it.

An engine is one package (``patcher/engines/<name>/`` for the built-in ones, or any other
distribution) holding ONE adapter class that implements `Engine`, registered under the
entry-point group ``dsadapt.engines`` (see `patcher.engines`). Everything dsadapt does that
differs between engines goes through this protocol; nothing outside the engines branches on
an engine's name or on the kind of its build.

The adapter never imports dsadapt's orchestration (check, build, workspace, venvs, ...):
what it needs from it comes in as a *services* object (`BuildServices`, `RunServices`),
implemented by the orchestration. An import contract (pyproject ``[tool.importlinter]``,
checked by ``make lint`` and tests/project/test_architecture.py) holds that boundary.

Most engines ship a release wheel and are patched by overlaying the stack's files onto it:
they derive from `WheelEngine` and declare data (variants, recipe, runner). Engines built
differently (Triton's vLLM backend: a directory served by tritonserver) derive from
`EngineBase` and implement `build` and `gate_session` themselves.
"""

from __future__ import annotations

import fnmatch
import platform
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from patcher.base.config import Config
from patcher.base.errors import EngineUnavailable, UsageError
from patcher.formats.lock import Artifact, Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.sourcetree import TreeRules
from patcher.formats.stackfiles import Stack
from patcher.runners.launch import RunnerSpec

if TYPE_CHECKING:
    from patcher.engines.serving import PerfRecipe

Progress = Callable[[str], None]


# ---------------------------------------------------------------- data the contract speaks


@dataclass(frozen=True)
class Parallel:
    """How an engine run is spread: tensor parallel size `tp` (one rank per device) and, with
    `ep`, the routed experts distributed over those ranks (expert parallelism) instead of each
    rank holding a slice of every expert. The single-process run is ``Parallel()``."""

    tp: int = 1
    ep: bool = False

    @property
    def single(self) -> bool:
        return self.tp == 1 and not self.ep

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def label(self) -> str:
        """The configuration as reports name it: ``tp1``, ``tp2``, ``tp2-ep``."""
        return f"tp{self.tp}" + ("-ep" if self.ep else "")

    def describe(self) -> str:
        if self.single:
            return "one process (TP 1)"
        return f"TP {self.tp}" + (" with expert parallelism" if self.ep else "")

    def args(self) -> tuple[str, ...]:
        """The runner protocol's options for this configuration (none for TP 1)."""
        if self.single:
            return ()
        return ("--tensor-parallel-size", str(self.tp)) + (("--expert-parallel",) if self.ep else ())

    def to_json(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "world_size": self.world_size, "label": self.label}


SINGLE = Parallel()


@dataclass(frozen=True)
class ParallelSupport:
    """Which parallel configurations a variant's gate runner offers, and what each rank needs.

    `tp`: tensor parallelism (any size up to the machine's `unit`s); `ep`: expert parallelism
    (with TP > 1); `unit`: what one rank occupies ("CPU core", "CUDA GPU"), counted on the
    machine by `units_here`. The default offers TP 1 only."""

    tp: bool = False
    ep: bool = False
    unit: str = ""
    note: str = ""                  # how the engine spreads (docs, `dsadapt list`)

    def describe(self) -> str:
        if not self.tp:
            return "TP 1 only"
        return f"TP N (one {self.unit} a rank)" + (", expert parallel" if self.ep else "")


def version_at_least(version: str, floor: str) -> bool:
    """`version` >= `floor` (PEP 440); False for a version that does not parse."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(floor)
    except InvalidVersion:
        return False


def units_here(unit: str) -> int:
    """How many of `unit` this machine lends dsadapt ("CPU core": this process's affinity;
    "CUDA GPU": the GPUs it sees)."""
    from patcher.base.machine import cpu_cores_here, cuda_devices_here

    if unit == "CPU core":
        return cpu_cores_here()
    if unit == "CUDA GPU":
        return cuda_devices_here()
    return 0


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
    # dependencies of the wheel that this variant's gate run never imports (TurboMind's CUDA 12
    # libraries for a PyTorch-engine-only build, ...): an offline bundle leaves them (and what only
    # they need) out; `dsadapt bundle` lists them, docs/engines/<engine>.md says how it was verified
    unused_deps: tuple[str, ...] = ()
    # the parallel configurations its gate runner offers on its device (`Engine.parallel_blocker`)
    parallel: ParallelSupport = ParallelSupport()

    @property
    def artifact_variant(self) -> str:
        return self.wheel_variant or self.name


@dataclass(frozen=True)
class BuildKind:
    """How a stack is built: the engine's word for it (overlay | full | backend | ...), and why."""

    kind: str
    reasons: tuple[str, ...] = ()   # for full: "NNNN-x.patch touches csrc/foo.cu"

    def __str__(self) -> str:
        return self.kind


@dataclass
class BuildResult:
    ref: str
    variant: str
    kind: str
    artifact: str
    sha256: str
    size: int
    seconds: float
    stack_hash: str
    base_artifact: str | None = None
    base_sha256: str | None = None
    version: str | None = None
    replaced: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    not_shipped: list[str] = field(default_factory=list)
    how: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EnvRecipe:
    """What an engine's environment holds besides the built artifact (pip's words)."""

    extra: tuple[str, ...] = ()     # requirements installed together with the artifact
    remove: tuple[str, ...] = ()    # distributions uninstalled afterwards (PyPI builds that break imports)
    post: tuple[str, ...] = ()      # a second pip call (may pin below what the engine asks: numpy<2)
    host_packages: bool = False     # see the packages of the environment dsadapt runs in (reuse its
    #                                 torch instead of installing one; `python -m venv --system-site-packages`)


@dataclass(frozen=True)
class EnvPlan:
    """Which environment an engine runs in: the pin whose build it holds, and the recipe.

    Usually the pin itself; Triton's vLLM backend runs in the environment of the vLLM pin it
    serves, a separate one (`suffix` '-triton') with the server's requirements added.
    """

    pin: PinRef
    variant: str
    recipe: EnvRecipe = EnvRecipe()
    suffix: str = ""                # a separate environment next to the pin's own
    note: str = ""                  # one line for the user (what the environment is for)


@dataclass(frozen=True)
class EngineEnv:
    """An environment that holds an engine (made or reused by `RunServices.environment`)."""

    python: Path
    venv: Path
    artifact: str                   # file name of the installed engine artifact
    sha256: str
    reused: bool = False
    removed: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)  # the install marker: lock digest, bundle, host packages

    def provenance(self) -> dict:
        return {"artifact": self.artifact, "sha256": self.sha256, "venv": str(self.venv), **self.details}


@dataclass(frozen=True)
class Tree:
    """A checkout as an engine sees it: where it is and which commit holds the tree asked for."""

    ref: PinRef
    path: Path
    rev: str                        # the applied branch head, or the verified base (unpatched)
    patched: bool


@dataclass(frozen=True)
class GateRun:
    """One engine run of the gate: what to run and how."""

    entry: LockEntry
    variant: VariantSpec
    dtype: str
    model_dir: Path
    unpatched: bool = False         # the pristine upstream instead of the stack
    unpatched_engine: bool = False  # served engines: the served engine pristine, the stack applied
    tp: int = 1                     # tensor parallel size (ranks)
    ep: bool = False                # expert parallelism over those ranks

    @property
    def parallel(self) -> Parallel:
        return Parallel(self.tp, self.ep)


@dataclass(frozen=True)
class GateSession:
    """What `Engine.gate_session` yields: run `runner` with `python` (and `env`) for the engine's logits."""

    python: Path
    runner: RunnerSpec
    env: Mapping[str, str] = field(default_factory=dict)
    installed: dict = field(default_factory=dict)   # provenance: artifact, sha256, venv, server log...


@dataclass(frozen=True)
class Served:
    """A running server of a pin (what `Engine.serve` yields)."""

    url: str                        # http://127.0.0.1:PORT
    model: str                      # the model name requests name
    log_path: Path
    pid: int                        # process group of the server
    api: str                        # what speaks there: "triton-generate", "openai", ...
    python: Path | None = None      # the interpreter of the served environment (clients, bench tools)
    installed: dict = field(default_factory=dict)
    usage: tuple[str, ...] = ()     # lines telling a user how to query it


class NotSupported(UsageError):
    """The engine does not offer this (serving, benchmarking, a dtype...)."""


# ---------------------------------------------------------------- what the orchestration lends


class BuildServices(Protocol):
    """What an engine's build may ask of dsadapt."""

    cfg: Config
    progress: Progress | None

    def checkout(self, ref: PinRef, *, patched: bool = True) -> Tree:
        """The verified checkout of `ref`, with its stack applied (or just its base)."""
        ...

    def overlay_build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, out_dir: Path) -> BuildResult:
        """The pinned wheel of `spec` with the stack's files swapped in (byte-reproducible)."""
        ...

    def full_build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, kind: BuildKind,
                   out_dir: Path) -> BuildResult:
        """The upstream's own build (`pip wheel --no-deps`) of the applied checkout."""
        ...


class RunServices(Protocol):
    """What an engine's gate session (or server) may ask of dsadapt."""

    cfg: Config
    lock: Lock
    progress: Progress | None
    stream: bool

    def checkout(self, ref: PinRef, *, patched: bool = True) -> Tree:
        ...

    def environment(self, plan: EnvPlan, *, unpatched: bool = False) -> EngineEnv:
        """Build (if needed) and install `plan`'s pin into its environment; `unpatched`: the
        pristine release wheel instead of the build. Reused when already current."""
        ...


# ---------------------------------------------------------------- the protocol


@runtime_checkable
class Engine(Protocol):
    """One engine, as dsadapt sees it. Attributes are data; methods are the engine's behaviour."""

    # -- identity and sources
    name: str                        # the lock's [engines.<name>]; the entry point's name
    git_url: str
    pypi: tuple[str, ...]            # PyPI distributions of its releases
    packages: tuple[str, ...]        # top-level import packages its wheels ship
    variants: tuple[VariantSpec, ...]
    tag_prefix: str
    tree_rules: TreeRules            # artifact members that are not source (besides sourcetree's default)
    compiled_patterns: tuple[str, ...]  # paths whose change needs a compiling build
    docs_page: str                   # the engine's page: what is verified where
    notes: str
    # -- how it runs for the gate
    runner: RunnerSpec | None        # the engine's runner script (None: no gate)
    model_config_style: str          # config.json style of the built-in models it is checked on by default
    run_settings: tuple[str, ...]    # keys of its runner's `settings` that check reports keep as provenance
    # -- bench: what the alternative to dsadapt's build is (bench.py)
    full_build_doc: tuple[str, str] | None  # (what upstream documents for a compiling build, source URL)
    compile_note: str | None         # set when there is nothing to compile (bench says this instead)
    # -- bisect: the engine's capture table (its name mapping to HF transformers, per
    #    compared point: patcher.rules.modules.CaptureTable; None: the engine cannot be bisected), and
    #    module_map, the same as HF point -> engine module name
    bisect_table: Any
    module_map: Mapping[str, str]
    # -- serving: what a pin served by `serve` speaks; None: dsadapt cannot serve it
    serve_api: str | None
    # -- the environment variables of its own that tune it (prefixes): a server the speed gate starts
    #    gets what its recipe sets, never what dsadapt's own environment happens to hold
    env_prefixes: tuple[str, ...]

    def tag_to_version(self, tag: str) -> str: ...
    def version_to_tag(self, version: str) -> str: ...
    def is_compiled(self, path: str) -> bool: ...
    def variant(self, name: str | None) -> VariantSpec: ...
    def variant_for(self, entry: LockEntry, name: str | None) -> VariantSpec: ...
    def pinned_variants(self, entry: LockEntry) -> tuple[VariantSpec, ...]: ...
    def release_variants(self, dists: tuple[str, ...]) -> tuple[VariantSpec, ...]: ...

    # -- build
    def build_kind(self, stack: Stack) -> BuildKind: ...
    def build_blocker(self, entry: LockEntry, spec: VariantSpec, stack: Stack) -> str | None: ...
    def base_artifact(self, entry: LockEntry, spec: VariantSpec, stack: Stack) -> Artifact | None: ...
    def build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, out_dir: Path,
              svc: BuildServices) -> BuildResult: ...

    # -- environment
    def env_recipe(self, entry: LockEntry, spec: VariantSpec) -> EnvRecipe: ...
    def env_plan(self, entry: LockEntry, spec: VariantSpec, lock: Lock) -> EnvPlan: ...

    # -- the gate
    def gate_dtypes(self, spec: VariantSpec) -> tuple[str, ...]: ...
    def run_blocker(self, entry: LockEntry, spec: VariantSpec) -> str | None: ...
    def checkpoint_blocker(self, entry: LockEntry, spec: VariantSpec, config: Mapping[str, Any]) -> str | None: ...
    # -- parallel runs: what the pin's runner offers, and why a configuration cannot run here
    def parallel_support(self, entry: LockEntry, spec: VariantSpec) -> ParallelSupport: ...
    def parallel_blocker(self, entry: LockEntry, spec: VariantSpec, parallel: Parallel) -> str | None: ...
    def gate_session(self, run: GateRun, svc: RunServices) -> AbstractContextManager[GateSession]: ...
    def bisect_session(self, run: GateRun, svc: RunServices) -> AbstractContextManager[GateSession] | None: ...

    # -- offline hosts: `dsadapt bundle` (its environment plan, builds and `VariantSpec.unused_deps`)
    def bundle_blocker(self, entry: LockEntry, spec: VariantSpec) -> str | None: ...

    # -- serving and speed
    def serve(self, run: GateRun, svc: RunServices, port: int | None = None) -> AbstractContextManager[Served]: ...
    def benchmark(self, served: Served, workload: Mapping[str, Any], svc: RunServices) -> dict: ...
    def perf_recipe(self, entry: LockEntry, spec: VariantSpec) -> PerfRecipe | None: ...


#: The old name of the protocol.
EngineAdapter = Engine


class Deferred:
    """A class attribute of an adapter whose value lives in another module, imported the first time
    it is read: ``bisect_table = Deferred("patcher.engines.vllm.bisect_table:TABLE")``. Loading an
    adapter (``dsadapt list``, ``status``) then costs none of what only one command uses (the bisect
    table and the per-module rule it is built on). `then` turns the imported value into the
    attribute's (``Deferred("...:TABLE", lambda t: t.module_map())``)."""

    def __init__(self, target: str, then: Callable[[Any], Any] | None = None):
        self.target = target
        self.then = then
        self._value: Any = None
        self._done = False

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if not self._done:
            import importlib

            module, _, attr = self.target.partition(":")
            value = getattr(importlib.import_module(module), attr)
            self._value = self.then(value) if self.then else value
            self._done = True
        return self._value


def has_cuda() -> bool:
    from shutil import which  # not at import: `list` and `status` load this module

    return which("nvidia-smi") is not None


COMPILED_DEFAULT = ("csrc/*", "*.cu", "*.cuh", "*.cpp", "*.cc", "*.c", "*.h", "*.hpp", "CMakeLists.txt",
                    "cmake/*", "setup.py", "pyproject.toml", "*.pyx")


class EngineBase:
    """Shared behaviour of every adapter; subclasses set the data attributes.

    Leaves `build` and `gate_session` to subclasses (`WheelEngine` has the common ones);
    `serve` and `benchmark` say "not supported" unless an engine offers them.
    """

    name: ClassVar[str]
    git_url: ClassVar[str] = ""
    pypi: ClassVar[tuple[str, ...]] = ()
    packages: ClassVar[tuple[str, ...]] = ()
    variants: ClassVar[tuple[VariantSpec, ...]] = ()
    tag_prefix: ClassVar[str] = "v"
    tree_rules: ClassVar[TreeRules] = TreeRules()
    compiled_patterns: ClassVar[tuple[str, ...]] = ()
    docs_page: ClassVar[str] = ""
    notes: ClassVar[str] = ""
    runner: ClassVar[RunnerSpec | None] = None
    # what the built-in models' config.json looks like unless --config-style says otherwise:
    # "transformers" (what save_pretrained writes) or "deepseek" (DeepSeek's released keys)
    model_config_style: ClassVar[str] = "transformers"
    # the runner's settings every engine reports; an adapter adds its own keys
    run_settings: ClassVar[tuple[str, ...]] = ("device", "gpu", "backend", "parallel")
    full_build_doc: ClassVar[tuple[str, str] | None] = None
    compile_note: ClassVar[str | None] = None
    bisect_table: ClassVar[Any] = None
    module_map: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    serve_api: ClassVar[str | None] = None
    env_prefixes: ClassVar[tuple[str, ...]] = ()

    def __repr__(self) -> str:
        return f"<engine {self.name} ({type(self).__module__}.{type(self).__qualname__})>"

    # -- sources and variants

    def tag_to_version(self, tag: str) -> str:
        return tag[len(self.tag_prefix):] if self.tag_prefix and tag.startswith(self.tag_prefix) else tag

    def version_to_tag(self, version: str) -> str:
        return f"{self.tag_prefix}{version}"

    def is_compiled(self, path: str) -> bool:
        return any(fnmatch.fnmatch(path, pat) for pat in self.compiled_patterns)

    def variant(self, name: str | None) -> VariantSpec:
        if name is None:
            return self.variants[0]
        for v in self.variants:
            if v.name == name:
                return v
        raise UsageError(f"{self.name} has no variant '{name}'",
                         hint=f"variants: {', '.join(v.name for v in self.variants)}")

    def variant_for(self, entry: LockEntry, name: str | None) -> VariantSpec:
        return self.variant(name)

    def pinned_variants(self, entry: LockEntry) -> tuple[VariantSpec, ...]:
        return self.variants

    def release_variants(self, dists: tuple[str, ...]) -> tuple[VariantSpec, ...]:
        return self.variants

    # -- build

    def build_kind(self, stack: Stack) -> BuildKind:
        raise NotImplementedError

    def build_blocker(self, entry: LockEntry, spec: VariantSpec, stack: Stack) -> str | None:
        """Why this pin/variant cannot be built on this machine, or None."""
        return None

    def base_artifact(self, entry: LockEntry, spec: VariantSpec, stack: Stack) -> Artifact | None:
        """The pinned release artifact a build of `stack` starts from (None: the checkout alone)."""
        return None

    def build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, out_dir: Path,
              svc: BuildServices) -> BuildResult:
        raise NotSupported(f"{self.name} cannot be built by dsadapt", hint=f"see {self.docs_page}")

    # -- environment

    def env_recipe(self, entry: LockEntry, spec: VariantSpec) -> EnvRecipe:
        return EnvRecipe()

    def env_plan(self, entry: LockEntry, spec: VariantSpec, lock: Lock) -> EnvPlan:
        """The environment the gate runs this pin in (`lock`: to resolve pins it refers to)."""
        return EnvPlan(entry.ref, spec.name, self.env_recipe(entry, spec))

    # -- the gate

    def gate_dtypes(self, spec: VariantSpec) -> tuple[str, ...]:
        return tuple(self.runner.dtypes) if self.runner else ()

    def run_blocker(self, entry: LockEntry, spec: VariantSpec) -> str | None:
        """Why this pin/variant cannot run on this machine, or None if it can."""
        if spec.device == "cuda" and not has_cuda():
            return "needs a CUDA GPU (none on this machine)"
        if entry.python:
            here = f"{sys.version_info.major}.{sys.version_info.minor}"
            allowed = [p.strip() for p in entry.python.split(",")]
            if here not in allowed:
                return f"needs Python {entry.python} (this is {here})"
        if platform.machine() not in ("x86_64", "AMD64"):
            return f"wheels are x86_64 only (this is {platform.machine()})"
        return None

    def checkpoint_blocker(self, entry: LockEntry, spec: VariantSpec, config: Mapping[str, Any]) -> str | None:
        """Why this pin/variant cannot run the checkpoint `config` (its config.json) on this machine,
        or None. For what the engine knows it lacks here (an FP8 kernel that needs other hardware),
        never for what the gate must find out: an engine that fails to load a model it should
        load is a verdict (fail), not a blocker."""
        return None

    def parallel_support(self, entry: LockEntry, spec: VariantSpec) -> ParallelSupport:
        """The parallel configurations this pin/variant's gate runner offers (the variant's by default)."""
        return spec.parallel

    def parallel_blocker(self, entry: LockEntry, spec: VariantSpec, parallel: Parallel) -> str | None:
        """Why `parallel` cannot run for this pin/variant on this machine (what it would need), or
        None. TP 1 always can (as far as `run_blocker` says)."""
        if parallel.single:
            return None
        sup = self.parallel_support(entry, spec)
        if not sup.tp:
            return (f"{self.name} {entry.version} ({spec.name}) runs the gate in one process only "
                    f"(TP 1); {parallel.describe()} is not offered")
        if parallel.ep and not sup.ep:
            return f"{self.name} {entry.version} ({spec.name}) offers tensor parallelism without expert parallelism"
        if parallel.ep and parallel.tp < 2:
            return "expert parallelism spreads the experts over the tensor-parallel ranks: it needs --tp 2 or more"
        have = units_here(sup.unit)
        if have < parallel.tp:
            return (f"needs {parallel.tp} {sup.unit}s for {parallel.describe()}, one a rank "
                    f"(this machine has {have})")
        return None

    def gate_session(self, run: GateRun, svc: RunServices) -> AbstractContextManager[GateSession]:
        raise EngineUnavailable(f"{run.entry}: {self.name} has no runner for the gate", hint=f"see {self.docs_page}")

    def bisect_session(self, run: GateRun, svc: RunServices) -> AbstractContextManager[GateSession] | None:
        """Where `dsadapt bisect` captures: None (the default) = in the gate session's own engine run,
        whose runner takes the capture arguments (one engine start). Engines whose gate cannot see
        the model (a server) yield an in-process runner that can."""
        return None

    # -- offline hosts

    def bundle_blocker(self, entry: LockEntry, spec: VariantSpec) -> str | None:
        """Why `dsadapt bundle` cannot carry this pin to an offline host, or None. A bundle holds
        wheels: an engine whose build is something else says so here."""
        return f"{self.name} is not built as a wheel; dsadapt cannot bundle it for an offline host"

    # -- serving and speed (`dsadapt perf` plugs in here)

    def serve(self, run: GateRun, svc: RunServices, port: int | None = None) -> AbstractContextManager[Served]:
        """Start a server of the pin (patched, or `run.unpatched`) on 127.0.0.1; yield it; always stop it."""
        raise NotSupported(f"{self.name} has no serving recipe in dsadapt", hint=f"see {self.docs_page}")

    def benchmark(self, served: Served, workload: Mapping[str, Any], svc: RunServices) -> dict:
        """Load `served` with `workload` using the engine's own benchmark tool; return its numbers."""
        raise NotSupported(f"{self.name} has no benchmark recipe in dsadapt", hint=f"see {self.docs_page}")

    def perf_recipe(self, entry: LockEntry, spec: VariantSpec) -> PerfRecipe | None:
        """How `dsadapt perf` serves this pin/variant and loads it with the engine's own tool
        (patcher/engines/serving.py), or None: the speed gate cannot measure it."""
        return None


class WheelEngine(EngineBase):
    """An engine released as wheels: a stack is built by overlaying its files onto the pinned
    wheel (or by the upstream's own build when a patch touches compiled code), installed into
    the pin's own environment, and checked by running `runner` there (offline, in-process)."""

    def variant_for(self, entry: LockEntry, name: str | None) -> VariantSpec:
        """The named variant, or the first one the pin has a wheel for."""
        if name is not None:
            return self.variant(name)
        for v in self.variants:
            if entry.artifact(v.artifact_variant, wheel=True):
                return v
        return self.variants[0]

    def pinned_variants(self, entry: LockEntry) -> tuple[VariantSpec, ...]:
        return tuple(v for v in self.variants if entry.artifact(v.artifact_variant, wheel=True))

    def release_variants(self, dists: tuple[str, ...]) -> tuple[VariantSpec, ...]:
        """Variants a new upstream tag may have: those whose distribution released it (PyPI),
        or every variant when only git saw the tag."""
        return tuple(v for v in self.variants if v.dist in dists) if dists else self.variants

    def build_kind(self, stack: Stack) -> BuildKind:
        reasons = tuple(f"{e.name} touches {p}" for e in stack.entries for p in e.patch.touched_paths
                        if self.is_compiled(p))
        return BuildKind("full", reasons) if reasons else BuildKind("overlay")

    def build_blocker(self, entry: LockEntry, spec: VariantSpec, stack: Stack) -> str | None:
        if self.build_kind(stack).kind == "full":
            from shutil import which

            missing = [t for t in spec.toolchain if which(t) is None]
            return f"full build needs {', '.join(missing)}" if missing else None
        if entry.artifact(spec.artifact_variant, wheel=True) is None:
            return f"no pinned wheel for variant {spec.name}"
        return None

    def base_artifact(self, entry: LockEntry, spec: VariantSpec, stack: Stack) -> Artifact | None:
        if self.build_kind(stack).kind == "full":
            return None
        return entry.artifact(spec.artifact_variant, wheel=True)

    def bundle_blocker(self, entry: LockEntry, spec: VariantSpec) -> str | None:
        if self.runner is None:
            return f"{self.name} has no runner for the gate"
        return None

    def build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, out_dir: Path,
              svc: BuildServices) -> BuildResult:
        kind = self.build_kind(stack)
        if kind.kind == "full":
            return svc.full_build(entry, spec, stack, kind, out_dir)
        return svc.overlay_build(entry, spec, stack, out_dir)

    @contextmanager
    def gate_session(self, run: GateRun, svc: RunServices) -> Iterator[GateSession]:
        if self.runner is None:
            raise EngineUnavailable(f"{run.entry}: no runner for {self.name} in the gate",
                                    hint=f"see {self.docs_page or 'docs/equivalence.md'}")
        env = svc.environment(self.env_plan(run.entry, run.variant, svc.lock), unpatched=run.unpatched)
        yield GateSession(env.python, parallel_runner(self.runner, run.parallel), {}, env.provenance())


def parallel_runner(runner: RunnerSpec, parallel: Parallel) -> RunnerSpec:
    """`runner` with the runner protocol's parallel options (``--tensor-parallel-size N``,
    ``--expert-parallel``) when `parallel` is not the single-process run."""
    if parallel.single:
        return runner
    from dataclasses import replace

    return replace(runner, extra_args=runner.extra_args + parallel.args())

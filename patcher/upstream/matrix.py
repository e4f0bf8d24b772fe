"""matrix: the CI matrix, one cell per (pin, variant) plus one per newer upstream tag not yet pinned.

`dsadapt matrix --json` prints ``{"include": [cell, ...]}``, which a GitHub Actions job feeds
to ``strategy.matrix`` with ``fromJSON``. Every cell says what it needs (device, python, the
runner labels) and which steps apply; a step that cannot apply is left out with the reason
in ``skip``, so the workflow can print it. ``checks`` lists the gate configurations the cell's
check step runs: every configuration the stack's patches name in their ``Covered-By``
(``dsadapt check --model v2 --dtype float16``; docs/patch-format.md), each with the patches that
ask for it; where they name none, the default one (the built-in v3 model in the first dtype the
variant serves).
``parallel`` lists the parallel configurations the cell's check also runs (``dsadapt check PIN
--tp 2 [--ep]``: what the engine's contract offers for the variant, each with the flags and what
it needs), empty with the reason in ``skip`` when the engine offers none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from patcher.base.config import Config
from patcher.engines.base import Engine, Parallel, VariantSpec
from patcher.engines.registry import engine
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.patchfile import GateConfig
from patcher.formats.stackfiles import Stack
from patcher.upstream.tags import TagsResult

DEFAULT_PYTHON = "3.11"
RUNNERS = {"cpu": ["ubuntu-latest"], "cuda": ["self-hosted", "gpu"]}
#: The tensor parallel size a cell's parallel check runs with (the smallest real split).
CI_TP = 2


@dataclass(frozen=True)
class Cell:
    name: str                  # job name shown by GitHub
    engine: str
    tag: str
    pin: str                   # ENGINE@TAG
    kind: str                  # pinned | new
    variant: str
    device: str                # cpu | cuda
    runs_on: list[str]
    python: str
    steps: list[str]           # subset of rebase, apply, build, check, perf, in order
    rebase_from: str = ""      # new cells: the pin whose stack is carried forward
    skip: list[str] = field(default_factory=list)  # steps left out, and why
    # parallel configurations the check step also runs: {"tp", "ep", "label", "args", "needs"}
    parallel: list[dict] = field(default_factory=list)
    # gate configurations the check step runs: GateConfig.to_json() + {"patches": [...]}
    checks: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _python(entry: LockEntry | None) -> str:
    if entry and entry.python:
        return entry.python.split(",")[0].strip()
    return DEFAULT_PYTHON


#: The Python a pin's cell (and its environment lock) uses.
cell_python = _python


def _variants_for(ad: Engine, entry: LockEntry | None, dists: tuple[str, ...]) -> list[VariantSpec]:
    """A pin's variants with what they build from; for a new tag, those its release may have."""
    return list(ad.pinned_variants(entry) if entry is not None else ad.release_variants(dists))


def _perf_step(ad: Engine, entry: LockEntry, v: VariantSpec, skip: list[str]) -> list[str]:
    """["perf"] when the engine has a speed-gate recipe for this version and variant, else the reason in `skip`."""
    if ad.perf_recipe(entry, v) is not None:
        return ["perf"]
    skip.append(f"perf: dsadapt perf has no recipe for {ad.name} {entry.version} ({v.name})")
    return []


def parallel_entries(ad: Engine, entry: LockEntry, v: VariantSpec, skip: list[str]) -> list[dict]:
    """The parallel configurations a cell checks besides one process: TP `CI_TP`, and with expert
    parallelism where the engine offers it; none (and the reason in `skip`) where it offers no
    tensor parallelism."""
    sup = ad.parallel_support(entry, v)
    if not sup.tp:
        skip.append(f"parallel: {ad.name} {entry.version} ({v.name}) runs the gate in one process only")
        return []
    configs = [Parallel(CI_TP)] + ([Parallel(CI_TP, ep=True)] if sup.ep else [])
    return [{**c.to_json(), "args": f"--tp {c.tp}" + (" --ep" if c.ep else ""),
             "needs": f"{c.tp} {sup.unit}s"} for c in configs]


def cell_checks(ad: Engine, entry: LockEntry, v: VariantSpec, stack: Stack | None, skip: list[str]) -> list[dict]:
    """The gate configurations a cell checks: each one the stack's patches name in Covered-By
    (`dsadapt check --model v2 --dtype float16`), once each with the patches that ask for it, in
    the stack's order; where they name none, the default one (model v3 in the first dtype the
    variant serves). One the variant cannot run (a dtype it does not serve, ranks it does not
    offer) is left out with the reason in `skip`."""
    served = ad.gate_dtypes(v)
    wanted: dict[GateConfig, list[str]] = {}
    for e in stack.entries if stack is not None else []:
        for g in e.patch.gate_configs:
            wanted.setdefault(g, []).append(e.name)
    if not wanted:
        wanted[GateConfig("v3", served[0] if served else None)] = []
    out = []
    for g, names in wanted.items():
        if g.dtype is not None and g.dtype not in served:
            skip.append(f"check {g.label}: {ad.name} ({v.name}) does not serve {g.dtype} "
                        f"(asked by {', '.join(names)})")
            continue
        if g.tp > 1 and not ad.parallel_support(entry, v).tp:
            skip.append(f"check {g.label}: {ad.name} ({v.name}) runs the gate in one process only "
                        f"(asked by {', '.join(names)})")
            continue
        out.append({**g.to_json(), "patches": names})
    return out


def pin_cells(ad: Engine, entry: LockEntry, has_stack: bool, stack: Stack | None = None,
              lock_missing=None) -> list[Cell]:
    """One cell per variant of a pin. `lock_missing(variant)`: why that variant's environment has no
    hash lock (then the cell makes it: step `lock`), or None."""
    variants = _variants_for(ad, entry, ())
    cells = []
    for v in variants or [ad.variants[0]]:
        steps, skip = [], []
        if has_stack:
            steps.append("apply")
        else:
            skip.append(f"apply: {entry.ref} has no stack")
        parallel: list[dict] = []
        checks: list[dict] = []
        if v in variants:
            if lock_missing is not None and lock_missing(v):
                steps.append("lock")
            steps += ["build", "check"]
            parallel = parallel_entries(ad, entry, v, skip)
            checks = cell_checks(ad, entry, v, stack, skip)
            if has_stack:
                steps += _perf_step(ad, entry, v, skip)
        else:
            skip.append(f"build, check: {entry.ref} pins no release artifact for variant {v.name}")
        cells.append(Cell(f"{entry.ref} {v.name}", entry.engine, entry.tag, str(entry.ref), "pinned", v.name,
                          v.device, RUNNERS[v.device], _python(entry), steps, "", skip, parallel, checks))
    return cells


def new_tag_cells(ad: Engine, tags: TagsResult, lock: Lock, stack: Stack | None = None) -> list[Cell]:
    """One cell per (unpinned tag newer than the baseline, variant its release may have): rebase the
    baseline's stack (`stack`) onto it, lock, build, check what the stack's patches ask for."""
    if not tags.baseline:
        return []
    base = lock.pin(f"{tags.engine}@{tags.baseline}")
    cells = []
    for t in tags.tags:
        if t.pinned:
            continue
        for v in _variants_for(ad, None, t.dists):
            pin = f"{tags.engine}@{t.tag}"
            skip: list[str] = []
            new_entry = LockEntry(tags.engine, t.tag, t.version)
            steps = ["rebase", "lock", "build", "check", *_perf_step(ad, new_entry, v, skip)]
            parallel = parallel_entries(ad, new_entry, v, skip)
            checks = cell_checks(ad, new_entry, v, stack, skip)
            cells.append(Cell(f"{pin} {v.name} (new)", tags.engine, t.tag, pin, "new", v.name, v.device,
                              RUNNERS[v.device], _python(base), steps, str(base.ref), skip, parallel, checks))
    return cells


def build_matrix(cfg: Config, lock: Lock, tags: dict[str, TagsResult], only: str | None = None,
                 lock_missing=None) -> list[Cell]:
    """Cells for every pin (only='pinned'), every new tag (only='new'), or both. `lock_missing(entry,
    variant)`: why the pin's environment has no hash lock (its cell then makes one), or None."""
    from patcher.base.errors import DsadaptError
    from patcher.formats.stackfiles import load_stack

    def stack_of(entry: LockEntry) -> Stack | None:
        try:
            st = load_stack(cfg.patches_root, entry.ref, must_exist=False)
        except DsadaptError:  # a broken stack: `dsadapt verify` names the problem
            return None
        return st if st.exists else None

    cells: list[Cell] = []
    for name in sorted(lock.engines):
        ad = engine(name)
        if only in (None, "pinned"):
            for entry in lock.pins_of(name):
                has_stack = (cfg.patches_root / entry.engine / entry.tag / "series").is_file()
                missing = None if lock_missing is None else (lambda v, entry=entry: lock_missing(entry, v))
                cells += pin_cells(ad, entry, has_stack, stack_of(entry), missing)
        if only in (None, "new") and name in tags:
            base = lock.pins.get(f"{name}@{tags[name].baseline}") if tags[name].baseline else None
            cells += new_tag_cells(ad, tags[name], lock, stack_of(base) if base else None)
    return cells


def blocker_here(cell: Cell, lock: Lock) -> str | None:
    """Why this machine could not run the cell's check (the adapter's run_blocker), or None.

    Machine-local, so it is shown by the human table only; CI asks the runner itself."""
    ad = engine(cell.engine)
    entry = lock.pins.get(cell.pin) or LockEntry(cell.engine, cell.tag, ad.tag_to_version(cell.tag))
    return ad.run_blocker(entry, ad.variant(cell.variant))


def github_matrix(cells: list[Cell]) -> dict:
    """What `strategy.matrix` takes: only an include list (any other key would become a dimension)."""
    return {"include": [c.to_json() for c in cells]}

"""matrix: the CI matrix, one cell per (pin, variant) plus one per newer upstream tag not yet pinned.

`dsadapt matrix --json` prints ``{"include": [cell, ...]}``, which a GitHub Actions job feeds
to ``strategy.matrix`` with ``fromJSON``. Every cell says what it needs (device, python, the
runner labels) and which steps apply; a step that cannot apply is left out with the reason
in ``skip``, so the workflow can print it. ``parallel`` lists the parallel configurations the
cell's check also runs (``dsadapt check PIN --tp 2 [--ep]``: what the engine's contract offers
for the variant, each with the flags and what it needs), empty with the reason in ``skip``
when the engine offers none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from patcher.base.config import Config
from patcher.engines.base import Engine, Parallel, VariantSpec
from patcher.engines.registry import engine
from patcher.formats.lock import Lock, LockEntry
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

    def to_json(self) -> dict:
        return asdict(self)


def _python(entry: LockEntry | None) -> str:
    if entry and entry.python:
        return entry.python.split(",")[0].strip()
    return DEFAULT_PYTHON


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


def pin_cells(ad: Engine, entry: LockEntry, has_stack: bool) -> list[Cell]:
    variants = _variants_for(ad, entry, ())
    cells = []
    for v in variants or [ad.variants[0]]:
        steps, skip = [], []
        if has_stack:
            steps.append("apply")
        else:
            skip.append(f"apply: {entry.ref} has no stack")
        parallel: list[dict] = []
        if v in variants:
            steps += ["build", "check"]
            parallel = parallel_entries(ad, entry, v, skip)
            if has_stack:
                steps += _perf_step(ad, entry, v, skip)
        else:
            skip.append(f"build, check: {entry.ref} pins no release artifact for variant {v.name}")
        cells.append(Cell(f"{entry.ref} {v.name}", entry.engine, entry.tag, str(entry.ref), "pinned", v.name,
                          v.device, RUNNERS[v.device], _python(entry), steps, "", skip, parallel))
    return cells


def new_tag_cells(ad: Engine, tags: TagsResult, lock: Lock) -> list[Cell]:
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
            steps = ["rebase", "build", "check", *_perf_step(ad, new_entry, v, skip)]
            parallel = parallel_entries(ad, new_entry, v, skip)
            cells.append(Cell(f"{pin} {v.name} (new)", tags.engine, t.tag, pin, "new", v.name, v.device,
                              RUNNERS[v.device], _python(base), steps, str(base.ref), skip, parallel))
    return cells


def build_matrix(cfg: Config, lock: Lock, tags: dict[str, TagsResult], only: str | None = None) -> list[Cell]:
    """Cells for every pin (only='pinned'), every new tag (only='new'), or both."""
    cells: list[Cell] = []
    for name in sorted(lock.engines):
        ad = engine(name)
        if only in (None, "pinned"):
            for entry in lock.pins_of(name):
                has_stack = (cfg.patches_root / entry.engine / entry.tag / "series").is_file()
                cells += pin_cells(ad, entry, has_stack)
        if only in (None, "new") and name in tags:
            cells += new_tag_cells(ad, tags[name], lock)
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

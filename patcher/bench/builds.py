"""The build benchmark: what a patched build costs here, next to the alternative.

For every buildable pin and variant: the first overlay build of the run (includes downloading
and unpacking the release wheel when the cache is cold) and the median of `repeat` warm
rebuilds, the artifact's size, and whether all rebuilds were byte-identical. Next to it, the
alternative measured in the same run where it can run here: `pip wheel --no-deps` of the
patched checkout's Python packages (a source rebuild with no compilation, so a lower bound
of the upstream build); where the upstream build needs a toolchain this machine lacks, what
upstream documents instead.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from patcher.artifacts.builder import build_pin, buildable_here
from patcher.base.config import Config
from patcher.base.errors import BuildError, DsadaptError
from patcher.base.fsutil import forget_digests
from patcher.engines.registry import engine
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.stackfiles import load_stack
from patcher.upstream.sources import fetch_artifact, find_local_artifact


@dataclass
class BuildBench:
    pin: str
    variant: str
    kind: str | None
    status: str                    # measured | skipped | not built
    reason: str | None = None
    cached: bool | None = None     # the release wheel was already in the cache
    fetch_s: float | None = None   # download + sha256 check (only the check when cached)
    first_s: float | None = None   # cold build: fresh work dir (unpack, verify, apply) + overlay
    build_s: float | None = None   # median of the warm rebuilds
    runs_s: list[float] = field(default_factory=list)
    artifact: str | None = None
    size: int | None = None
    files: int | None = None       # files replaced, added or removed
    reproducible: bool | None = None
    alternative: str = ""
    alternative_s: float | None = None
    alternative_size: int | None = None
    alternative_source: str | None = None



# ---------------------------------------------------------------- builds


def _variants(lock_entry: LockEntry) -> list[str]:
    eng = engine(lock_entry.engine)
    return [v.name for v in eng.pinned_variants(lock_entry)] or [eng.variants[0].name]


def bench_build(cfg: Config, lock: Lock, entry: LockEntry, variant: str, repeat: int, work: Path,
                progress=None) -> tuple[BuildBench, Config]:
    """Download (if not cached), a cold build in a fresh work dir, then `repeat` warm rebuilds there.

    Returns the row and the config of that work dir (whose checkout the alternative reuses).
    """
    row = BuildBench(str(entry.ref), variant, _kind(cfg, entry), "skipped")
    cold = dataclasses.replace(cfg, workdir=work / "work")
    reason = buildable_here(cfg, lock, entry, variant)
    if reason is not None:
        row.reason = reason
        return row, cold
    try:
        eng = engine(entry.engine)
        art = eng.base_artifact(entry, eng.variant(variant), load_stack(cfg.patches_root, entry.ref))
        if art is not None:
            row.cached = find_local_artifact(cfg, art) is not None
            t0 = time.monotonic()
            fetch_artifact(cfg, entry, art, progress)
            row.fetch_s = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        first = build_pin(cold, lock, entry.ref, variant, out_dir=work / "dist", progress=progress)
        row.first_s = round(time.monotonic() - t0, 2)
        shas = {first.sha256}
        for _ in range(repeat):
            forget_digests()  # each rebuild as a new `dsadapt build` run: nothing hashed yet
            t0 = time.monotonic()
            res = build_pin(cold, lock, entry.ref, variant, out_dir=work / "dist")
            row.runs_s.append(round(time.monotonic() - t0, 2))
            shas.add(res.sha256)
    except DsadaptError as e:
        row.status, row.reason = "not built", e.message
        return row, cold
    row.status, row.kind = "measured", first.kind
    row.build_s = round(statistics.median(row.runs_s), 2)
    row.artifact, row.size = Path(first.artifact).name, first.size
    row.files = len(first.replaced) + len(first.added) + len(first.removed)
    row.reproducible = len(shas) == 1
    return row, cold


def pure_python_rebuild(checkout: Path, packages: tuple[str, ...], name: str, version: str,
                        work: Path) -> tuple[float, int]:
    """Seconds and wheel size of `pip wheel --no-deps` of the checkout's Python packages (no compilation)."""
    src = work / "src"
    src.mkdir(parents=True)
    found = [p for p in packages if (checkout / p).is_dir()]
    if not found:
        raise BuildError(f"{checkout}: none of {', '.join(packages)} is in the checkout", hint="apply the pin first")
    for p in found:
        shutil.copytree(checkout / p, src / p, ignore=shutil.ignore_patterns("__pycache__"))
    includes = ", ".join(f'"{p}*"' for p in found)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n\n'
        f'[tool.setuptools.packages.find]\ninclude = [{includes}]\n\n'
        '[tool.setuptools.package-data]\n"*" = ["*"]\n')
    out = work / "out"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-q", "-w", str(out), str(src)], capture_output=True, text=True)
    seconds = round(time.monotonic() - t0, 2)
    if r.returncode != 0:
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise BuildError(f"pip wheel of {checkout.name} failed: {tail}",
                         hint="needs setuptools in dsadapt's environment")
    wheels = list(out.glob("*.whl"))
    return seconds, wheels[0].stat().st_size


def add_alternative(cold: Config, entry: LockEntry, row: BuildBench, measured: dict[str, tuple[float, int] | str],
                    work: Path, progress=None) -> None:
    """Fill in the alternative: the measured pure-Python rebuild (once per pin) and upstream's documented cost."""
    ad = engine(entry.engine)
    if ad.compile_note:
        row.alternative = ad.compile_note
        return
    if row.pin not in measured:
        checkout = cold.checkout_dir(entry.engine, entry.tag)
        if progress:
            progress(f"timing pip wheel --no-deps of {row.pin}'s patched Python packages")
        try:
            measured[row.pin] = pure_python_rebuild(checkout, ad.packages, ad.variant(row.variant).dist,
                                                    entry.version or "0", work / row.pin.replace("@", "-"))
        except DsadaptError as e:
            measured[row.pin] = e.message
    got = measured[row.pin]
    parts = []
    if isinstance(got, tuple):
        row.alternative_s, row.alternative_size = got
        parts.append("measured: `pip wheel --no-deps --no-build-isolation` of the patched checkout's Python "
                     "packages (no compilation: a lower bound)")
    else:
        parts.append(f"pure-Python rebuild not measured: {got}")
    doc = ad.full_build_doc
    if doc:
        parts.append(doc[0])
        row.alternative_source = doc[1]
    else:
        parts.append(f"upstream full build needs {', '.join(ad.variant(row.variant).toolchain) or 'its toolchain'}")
    row.alternative = "; ".join(parts)


def run_builds(cfg: Config, lock: Lock, repeat: int, alternatives: bool, progress) -> list[BuildBench]:
    builds: list[BuildBench] = []
    measured: dict[str, tuple[float, int] | str] = {}
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-", dir=cfg.workdir) as tmp:
        for entry in lock.sorted_pins():
            for v in _variants(entry):
                if progress:
                    progress(f"bench {entry.ref} ({v})")
                work = Path(tmp) / f"{entry.engine}-{entry.tag}-{v}"
                row, cold = bench_build(cfg, lock, entry, v, repeat, work, progress)
                if alternatives and row.status == "measured":
                    add_alternative(cold, entry, row, measured, work / "alt", progress)
                builds.append(row)
                shutil.rmtree(work, ignore_errors=True)
    return builds


def _kind(cfg: Config, entry: LockEntry) -> str | None:
    try:
        return engine(entry.engine).build_kind(load_stack(cfg.patches_root, entry.ref)).kind
    except DsadaptError:
        return None

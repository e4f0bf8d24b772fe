"""dsadapt bench: what a patched build costs here, next to the alternative, and where check spends its time.

For every buildable pin and variant: the first overlay build of the run (includes downloading
and unpacking the release wheel when the cache is cold) and the median of `repeat` warm
rebuilds, the artifact's size, and whether all rebuilds were byte-identical. Next to it, the
alternative measured in the same run where it can run here: `pip wheel --no-deps` of the
patched checkout's Python packages (a source rebuild with no compilation, so a lower bound
of the upstream build); where the upstream build needs a toolchain this machine lacks, what
upstream documents instead. Check wall-time splits come from the check reports on disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import BuildError, DsadaptError
from patcher.base.fsutil import forget_digests
from patcher.build.builder import build_pin, buildable_here
from patcher.engines import engine
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.stackfiles import load_stack
from patcher.upstream.sources import fetch_artifact, find_local_artifact

CHECK_TIMING_KEYS = ("install_s", "reference_s", "engine_import_s", "engine_engine_start_s", "engine_generate_s",
                     "engine_s", "compare_s", "total_s")


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


@dataclass
class CheckTimings:
    report: str
    pin: str
    variant: str | None
    model: str | None
    dtype: str | None
    verdict: str | None
    date: str | None
    device: str | None
    timings: dict


@dataclass
class BenchReport:
    date: str
    machine: dict
    repeat: int
    builds: list[BuildBench] | None   # None: not measured in this run (the old section is kept)
    checks: list[CheckTimings]
    stack_ops: list | None = None       # stackbench.OpRow rows; None: not measured in this run
    stack_facts: dict = field(default_factory=dict)
    startup: list | None = None         # startup.StartRow rows; None: not measured in this run

    def to_json(self) -> dict:
        d = asdict(self)
        if self.stack_ops is not None:
            d["stack_ops"] = [r.to_json() for r in self.stack_ops]
        if self.startup is not None:
            d["startup"] = [r.to_json() for r in self.startup]
        return d


# ---------------------------------------------------------------- machine


def machine_info() -> dict:
    from patcher.base.machine import cpu_model

    model = cpu_model()
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"cores": cores, "cpu": model, "memory_gib": mem_gib, "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}", "load_1min": load}


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


def read_check_timings(reports_root: Path) -> list[CheckTimings]:
    """Every check report on disk that has wall-time splits (unpatched control runs excluded)."""
    out = []
    for path in sorted(reports_root.rglob("*.json")) if reports_root.is_dir() else []:
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(d, dict) or not isinstance(d.get("timings"), dict) or d.get("unpatched"):
            continue
        if str(d.get("schema", "")).startswith("dsadapt.perf-report/"):  # speed-gate reports: their own section
            continue
        prov = d.get("provenance") or {}
        out.append(CheckTimings(str(path.relative_to(reports_root.parent)), d.get("pin", "?"), d.get("variant"),
                                d.get("model"), d.get("dtype"), d.get("verdict"), prov.get("date"),
                                prov.get("device"), d["timings"]))
    return out


def run_bench(cfg: Config, lock: Lock, repeat: int = 3, alternatives: bool = True, progress=None,
              builds_too: bool = True, stack_ops: dict | None = None, startup: dict | None = None) -> BenchReport:
    """Builds (unless builds_too is False) and, when `stack_ops` gives its arguments, the stack-operations
    benchmark (patcher/bench/stack_ops.py), and with `startup` the start-up one (patcher/bench/startup.py)."""
    report = BenchReport(datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), machine_info(), repeat,
                         None, read_check_timings(cfg.published_reports))  # the committed reports, as docs cite them
    if builds_too:
        report.builds = _run_builds(cfg, lock, repeat, alternatives, progress)
    if stack_ops is not None:
        from patcher.bench.stack_ops import run_stack_bench

        report.stack_ops, report.stack_facts = run_stack_bench(cfg, lock, progress=progress, **stack_ops)
    if startup is not None:
        from patcher.bench.startup import run_startup_bench

        report.startup = run_startup_bench(cfg, lock, progress=progress, **startup)
    return report


def _run_builds(cfg: Config, lock: Lock, repeat: int, alternatives: bool, progress) -> list[BuildBench]:
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


# ---------------------------------------------------------------- formatting (pure)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _fetch(b: BuildBench) -> str:
    if b.fetch_s is None:
        return "-"
    return f"cached ({b.fetch_s:.2f} s sha256)" if b.cached else f"downloaded in {b.fetch_s:.2f} s"


def _short(text: str | None, limit: int = 160) -> str:
    text = text or ""
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def build_table(report: BenchReport) -> list[list[str]]:
    rows = []
    for b in report.builds or []:
        if b.status == "measured":
            note = "byte-identical" if b.reproducible else "NOT reproducible"
        else:
            note = f"{b.status}: {_short(b.reason)}"
        rows.append([b.pin, b.variant, b.kind or "-", _fetch(b), _s(b.first_s), _s(b.build_s), _mb(b.size),
                     str(b.files) if b.files is not None else "-", note,
                     _s(b.alternative_s) + (f" ({_mb(b.alternative_size)})" if b.alternative_size else "")])
    return rows


BUILD_COLUMNS = ["pin", "variant", "kind", "release wheel", "cold build", "rebuild (median)", "artifact", "files",
                 "note", "pip wheel, no compile"]
CHECK_COLUMNS = ["report", "verdict", "install", "reference", "engine import", "engine start", "generate",
                 "engine total", "compare", "total"]


def check_table(report: BenchReport) -> list[list[str]]:
    return [[c.report, c.verdict or "-", *[_s(c.timings.get(k)) for k in CHECK_TIMING_KEYS]] for c in report.checks]


def _md_table(columns: list[str], rows: list[list[str]]) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _sections(text: str) -> dict[str, str]:
    """The "## " sections of a markdown file (heading -> text, heading included)."""
    out: dict[str, str] = {}
    cur = None
    for line in text.split("\n"):
        if line.startswith("## "):
            cur = line[3:].strip()
            out[cur] = line + "\n"
        elif cur is not None:
            out[cur] += line + "\n"
    return {k: v.rstrip("\n") + "\n" for k, v in out.items()}


def format_markdown(report: BenchReport, command: str = "dsadapt bench", old: str | None = None,
                    reports_root: Path | None = None) -> str:
    """docs/benchmarks.md. A section this run did not measure is kept from `old` (the file as it was);
    with `reports_root`, the speed gate's section from its reports (patcher.bench.gate_reports)."""
    m = report.machine
    kept = _sections(old or "")
    out = [
        "# Benchmarks",
        "",
        f"Measured {report.date} by `{command}` on {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
        f"Python {m['python']}, {m['os']}; 1-minute load average {m.get('load_1min')} when it started (other "
        "work on the machine shows up in the times). Regenerate with `make bench`."
        + (" Sections this run did not measure are kept from the previous run (their own dates)." if
           report.builds is None or report.stack_ops is None or report.startup is None else ""),
        "",
    ]
    out += _startup_markdown(report, kept)
    if report.builds is None and "Builds" in kept:
        out += [kept["Builds"].rstrip("\n"), ""]
    else:
        out += _builds_markdown(report)
    out += _stack_markdown(report, kept)
    out += ["## Check wall time", ""]
    if report.checks:
        out += ["From the `timings` of the check reports under `reports/` (seconds, as recorded by `dsadapt check` "
                "on the machine named in each report):", "",
                _md_table(CHECK_COLUMNS, check_table(report)), ""]
        out += [f"- {c.report}: {c.pin} {c.variant or ''} {c.model or ''} {c.dtype or ''}, {c.date or '?'}, "
                f"{c.device or '?'}" for c in report.checks]
        out.append("")
    else:
        out += ["No check report with timings under `reports/` yet (run `dsadapt check`).", ""]
    if reports_root is not None:
        from patcher.bench.gate_reports import perf_markdown, read_perf_reports

        out.append(perf_markdown(read_perf_reports(reports_root)))
    # sections this command never writes (measured by hand or by other tools: "Checkpoints") stay
    made = set(_sections("\n".join(out)))
    for heading, text in kept.items():
        if heading not in made:
            out += ["", text.rstrip("\n")]
    return "\n".join(out)


def _startup_markdown(report: BenchReport, kept: dict[str, str]) -> list[str]:
    from patcher.bench.startup import COLUMNS, startup_table

    title = "Start-up and warm build"
    if report.startup is None:
        return [kept[title].rstrip("\n"), ""] if title in kept else []
    load = report.machine.get("load_1min")
    return [
        f"## {title}",
        "",
        f"Measured {report.date} (1-minute load average {load} when the run started). Every command is a whole "
        "`dsadapt` run in a new process, each run right after one run of each anchor, measured in the same run: "
        "`python3 -c pass` (the python3 on PATH, the goal's anchor, which may be a launcher such as pyenv's) and dsadapt's own "
        "interpreter with `-c pass` (no launcher: the stricter one), so what the machine does meanwhile hits them "
        "all; medians of the wall times, and of the CPU time (user + system), which load distorts less. `--help`, `list`, `status` and `report` run in the "
        "project itself; `tags` against a local git remote (the network is not timed); the warm build in the "
        "project after one untimed build. Goals: start-up ≤ 0.12 s and ≤ 4× the anchor, the warm build ≤ 1 s. "
        "How: patcher/bench/startup.py.",
        "",
        _md_table(COLUMNS, startup_table(report.startup)),
        "",
    ]


def _builds_markdown(report: BenchReport) -> list[str]:
    out = [
        "## Builds",
        "",
        f"Measured {report.date}. "
        "How: for each pin and variant that can be built here, `release wheel` is fetching the pinned wheel "
        "(download from PyPI unless cached, plus its sha256 check); `cold build` is `dsadapt build` in a fresh "
        "work dir (the checkout is made from scratch: unpack, pre-image check, `git am` of the stack, then the "
        f"overlay); then {report.repeat} rebuilds in that work dir, `rebuild` being their median wall time. "
        "`note` says whether all builds were byte-identical (same sha256). "
        "`pip wheel, no compile` is measured in the same run: "
        "`pip wheel --no-deps --no-build-isolation` of the patched checkout's Python packages with a minimal "
        "setuptools pyproject, i.e. a source rebuild of the same files without any C++/CUDA compilation (a lower "
        "bound of the upstream build, which also compiles).",
        "",
        _md_table(BUILD_COLUMNS, build_table(report)),
        "",
    ]
    alts = {}
    for b in report.builds or []:
        if b.alternative and b.alternative not in alts:
            alts[b.alternative] = b.alternative_source
    if alts:
        out += ["What the alternative is:", ""]
        out += [f"- {a}" + (f" (source: {s})" if s else "") for a, s in alts.items()]
        out.append("")
    return out


def _stack_markdown(report: BenchReport, kept: dict[str, str]) -> list[str]:
    from patcher.bench.stack_ops import STACK_COLUMNS, stack_table

    if report.stack_ops is None:
        return [kept["Stack operations"].rstrip("\n"), ""] if "Stack operations" in kept else []
    f = report.stack_facts
    tree = (f"{f.get('pin')}'s tree ({f.get('files', '?')} files, from its {f.get('source', '?')} source)"
            if f.get("files") else f"{f.get('pin')}")
    return [
        "## Stack operations",
        "",
        f"Measured {report.date}, {report.repeat} runs each, medians. On {tree}: N small patches (one inserted "
        "line per Python file, made with `git fast-import` and exported by dsadapt), for each N. `dsadapt` is the "
        "whole command in a new process (Python start-up included). The raw-git anchor is measured in the same "
        "run on the same files and base: `git am -3` of the N patch files onto the base in a clone (reset "
        "outside the timing) for apply; one `git apply --cached` of the whole stack in a temporary index and "
        "object directory (with `read-tree` of the base and `write-tree`) for verify; `git format-patch` of "
        "the same N commits for refresh. `verify` runs again on the same blobs (the stacks alternate between "
        "two that differ in one commit message: what an unchanged or slightly changed stack costs, nothing "
        "to compile); `verify cold` first removes verify's memory of what compiled, and its note says how much "
        "of it the compiles are. `apply` re-applies over another stack (the checkout exists); `refresh` exports an unchanged branch "
        "(zero bytes written). Start-up runs in the project itself; `rebase` is warm (both checkouts made "
        "beforehand) with the real stack; `verify all` verifies every pinned stack of the project, warm. "
        "How: patcher/bench/stack_ops.py.",
        "",
        _md_table(STACK_COLUMNS, stack_table(report.stack_ops)),
        "",
    ]

"""docs/benchmarks.md from a `BenchReport` (pure): the tables, the method of each section, and the
sections a run did not measure kept from the page as it was."""

from __future__ import annotations

from pathlib import Path

from patcher.bench.builds import BuildBench
from patcher.bench.driver import CHECK_TIMING_KEYS, BenchReport

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
        "project after one untimed build. Goals: start-up ≤ 0.12 s and ≤ 4× both anchors (`met` judges the stricter one), the warm build ≤ 1 s. "
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
        "the same N commits for refresh. `verify` runs on a stack whose diffs it has seen (the stacks "
        "alternate between two that differ in one commit message: what an unchanged or reworded stack costs; "
        "its apply and compiles are remembered); `verify, diff changed` after the last patch's diff changed "
        "(git apply runs again, one file compiles); `verify cold` first removes every memory of earlier runs "
        "(what compiled, what git apply made, the parsed patch files), and its note says how much of it the "
        "compiles are. `apply` re-applies over another stack (the checkout exists); `refresh` exports an unchanged branch "
        "(zero bytes written). Start-up runs in the project itself; `rebase` is warm (both checkouts made "
        "beforehand) with the real stack; `verify all` verifies every pinned stack of the project, warm. "
        "How: patcher/bench/stack_ops.py.",
        "",
        _md_table(STACK_COLUMNS, stack_table(report.stack_ops)),
        "",
    ]

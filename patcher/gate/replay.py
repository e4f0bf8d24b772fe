"""replay: how a stack would have fared through every real upstream release, release by release.

`dsadapt replay ENGINE --from TAG [--to TAG]` carries the stack at FROM (or, with `--stack PIN`,
another pin's stack ported to FROM first) through every release tag after FROM up to TO, in
order, the way the upstream workflow would have: at each release a rebase (each patch
classified), the environment's hash lock, the build, and the equivalence gate in every
configuration the stack's patches name in their Covered-By (plus the default one). A release
this machine cannot run (no build for its device, no lock) is a row that says why, never a
pass; a rebase that stops on a conflict ends the replay there (the releases after it are
listed as not reached).

Everything happens in a scratch project under the work dir (`replay/ENGINE-FROM-to-TO/`: a copy
of upstream.lock, the stack and the project's env-locks/): the user's upstream.lock, patches/
and checkouts are never touched. Downloads (the cache) and engine environments (the venvs
folder) are shared with the project. What stays is the report, `reports/replay/ENGINE-FROM-to-TO
.{json,md}` (the work dir's reports/, or the committed ones with --publish), written once at the
end; the scratch project is removed unless asked to keep it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import ConflictStop, DsadaptError, ExitCode, UsageError
from patcher.base.fsutil import atomic_write_text
from patcher.formats.lock import Lock, format_lock
from patcher.formats.pinref import PinRef, check_tag

SCHEMA = "dsadapt.replay/1"


@dataclass
class CheckCell:
    """One gate configuration at one release."""

    config: str                  # its label: `v3 float32`, `v2 float16`
    args: list[str]              # the `dsadapt check` options
    verdict: str                 # pass | fail | cannot run | error | not reached
    reason: str = ""
    max_abs: float | None = None
    tolerance: float | None = None
    rule: str | None = None
    seconds: float | None = None
    unpatched: bool = False      # a control run of the pristine release


@dataclass
class ReleaseRow:
    """What happened to the stack at one release."""

    tag: str
    version: str
    step: str                              # start | rebase | port (the stack brought to FROM)
    outcome: str                           # carried | conflict | not reached
    patches: list[dict] = field(default_factory=list)   # {name, subject, outcome, detail}
    lock: dict | None = None               # {state, env, torch_builds} or {error}
    checks: list[CheckCell] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ReplayReport:
    engine: str
    start: str                     # FROM
    end: str                       # TO
    stack: str                     # the pin whose stack was carried
    stack_hash: str
    source: str                    # which source listed the releases
    variant: str | None            # the variant asked for (None: the first each release can run)
    configs: list[str]
    date: str
    device: str
    load_average: list[float] | None
    rows: list[ReleaseRow] = field(default_factory=list)
    stopped: str | None = None     # why the replay ended early (a conflict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}


# ---------------------------------------------------------------- the releases


def release_range(tags: list, start: str, end: str | None, engine: str) -> tuple[list, list]:
    """Pure: (the release tags after `start` up to `end` (default: the newest), oldest first, and
    every release tag known). UsageError (exit 2) for a tag that is no release, an end before the
    start, or a range without a release."""
    known = [t.tag for t in tags]
    for name, tag in (("--from", start), ("--to", end)):
        if tag is not None and tag not in known:
            near = ", ".join(known[-5:]) or "none"
            raise UsageError(f"{name} {tag}: {engine} has no release tag {tag}",
                             hint=f"its newest releases: {near} (`dsadapt tags {engine}` lists them)")
    first = known.index(start)
    last = known.index(end) if end is not None else len(known) - 1
    if last <= first:
        raise UsageError(f"no {engine} release after {start}" + (f" up to {end}" if end else ""),
                         hint=f"--to names a release newer than --from (newest: {known[-1]})" if end else
                         f"{start} is the newest release: pick an older --from")
    return tags[first + 1:last + 1], tags


# ---------------------------------------------------------------- the scratch project


def scratch_config(cfg: Config, root: Path) -> Config:
    """The scratch project's configuration: its own project and work dir (fresh checkouts: no
    leftover of the user's is reused), the project's cache and environments."""
    return replace(cfg, project=root / "project", workdir=root / "work", cache=cfg.cache, venvs=cfg.venvs_root,
                   reports=root / "reports")


def make_scratch(cfg: Config, lock: Lock, root: Path, stack_ref: PinRef) -> Config:
    """A project holding a copy of upstream.lock, `stack_ref`'s stack and the project's env-locks/."""
    from patcher.artifacts.envlocks import project_lock_dir

    if root.exists():
        shutil.rmtree(root)  # an earlier replay's scratch: derived data
    sc = scratch_config(cfg, root)
    (sc.project / "patches" / stack_ref.engine).mkdir(parents=True)
    atomic_write_text(sc.lock_path, format_lock(lock))
    shutil.copytree(cfg.patches_root / stack_ref.engine / stack_ref.tag, sc.project / "patches" / stack_ref.engine /
                    stack_ref.tag)
    if project_lock_dir(cfg.project).is_dir():
        shutil.copytree(project_lock_dir(cfg.project), project_lock_dir(sc.project))
    (cfg.workdir / "models").mkdir(parents=True, exist_ok=True)  # the built-in models: made once, shared
    sc.workdir.mkdir(parents=True, exist_ok=True)
    (sc.workdir / "models").symlink_to(cfg.workdir / "models", target_is_directory=True)
    return sc


# ---------------------------------------------------------------- one release


def _rebase(sc: Config, lock: Lock, old: PinRef, tag: str, progress) -> tuple[Lock, list[dict], str, str]:
    """Rebase in the scratch project; (its lock now, the patches' classes, outcome, note)."""
    from patcher.formats.lock import load_lock
    from patcher.stack.rebase.carry import load_report, rebase_stack

    try:
        _res, notes = rebase_stack(sc, lock, old, tag, progress=progress)
    except ConflictStop as e:
        return _scratch_lock(sc), [], "conflict", e.message
    rep = load_report(sc, old.engine, old.tag, tag)
    patches = [{"name": p["name"], "subject": p["subject"], "outcome": p["outcome"], "detail": p["detail"]}
               for p in rep["patches"]]
    note = "; ".join(n for n in notes if n.startswith("backward"))
    return load_lock(sc.lock_path), patches, "carried", note


def _scratch_lock(sc: Config) -> Lock:
    from patcher.formats.lock import load_lock

    return load_lock(sc.lock_path)


def _lock(sc: Config, lock: Lock, ref: PinRef, variant: str | None, progress) -> dict:
    """The hash lock of the environment the release is checked in (the variant it runs as here)."""
    from patcher.artifacts.envlocks import lock_pin
    from patcher.engines.registry import engine

    t0 = time.monotonic()
    try:
        name = engine(ref.engine).variant_for(lock.pin(ref), variant).name
        done = lock_pin(sc.project, lock, ref, name, progress=progress)
    except DsadaptError as e:
        return {"error": e.message, "exit_code": int(e.exit_code), "seconds": round(time.monotonic() - t0, 1)}
    return {"locks": [{"variant": d.variant, "env": d.env, "state": d.state, "origin": d.origin,
                       "torch_builds": list(d.torch_builds)} for d in done],
            "seconds": round(time.monotonic() - t0, 1)}


def _checks(sc: Config, lock: Lock, ref: PinRef, variant: str | None, configs: list, control: bool,
            progress, on_line) -> list[CheckCell]:
    """Every configuration's check at this release (one build and install for all of them): each
    planned as `check` plans it (exit 6, no lock, no GPU: `cannot run`), then run."""
    from patcher.engines.registry import engine
    from patcher.gate.equivalence import run_check
    from patcher.gate.hosts import RunHost
    from patcher.gate.plan import CheckRequest, plan_check

    entry = lock.pin(ref)
    eng = engine(ref.engine)
    try:
        spec = eng.variant_for(entry, variant)
    except DsadaptError as e:
        return [CheckCell(c.label, c.args(), "cannot run", e.message) for c in configs]
    host = RunHost(sc, lock, progress, False)
    out: list[CheckCell] = []
    runs = [(c, False) for c in configs] + ([(configs[0], True)] if control and configs else [])
    for cfg_, unpatched in runs:
        dtypes = (cfg_.dtype,) if cfg_.dtype else eng.gate_dtypes(spec)
        for dt in dtypes:
            label = f"{cfg_.model}{' ' + cfg_.config_style if cfg_.config_style else ''} {dt}" + (
                f" tp{cfg_.tp}" if cfg_.tp > 1 else "") + (" unpatched" if unpatched else "")
            args = [*cfg_.args(), *([] if cfg_.dtype else ["--dtype", dt]), *(["--unpatched"] if unpatched else [])]
            t0 = time.monotonic()
            try:
                plan = plan_check(sc, lock, CheckRequest(ref, model=cfg_.model, config_style=cfg_.config_style,
                                                         dtype=dt, variant=spec.name, unpatched=unpatched,
                                                         tp=cfg_.tp, ep=cfg_.ep))
                res = run_check(plan, dt, host=host, on_line=on_line)
            except DsadaptError as e:
                verdict = "cannot run" if e.exit_code == ExitCode.CANNOT_RUN else \
                    "fail" if e.exit_code == ExitCode.FAILED else "error"
                out.append(CheckCell(label, args, verdict, e.message, seconds=round(time.monotonic() - t0, 1),
                                     unpatched=unpatched))
                continue
            c = res.comparison
            summary = c.summary if c is not None else {}
            out.append(CheckCell(label, args, res.verdict, "; ".join(res.reasons[:2]) or (res.no_logits or ""),
                                 summary.get("max_abs"), c.tolerance if c is not None else None,
                                 c.rule if c is not None else None, round(time.monotonic() - t0, 1), unpatched))
    return out


# ---------------------------------------------------------------- the replay


@dataclass
class ReplayPlan:
    """What a replay will do, settled before anything is made (every bad input refused here)."""

    engine: str
    start: str
    end: str
    stack_ref: PinRef
    stack: object                  # the Stack carried
    source: str                    # which source listed the releases
    start_tag: object              # UpstreamTag of --from
    todo: list                     # UpstreamTag after it, up to --to
    configs: list                  # GateConfig, from the stack's Covered-By (or the default)
    variant: str | None = None


def plan_replay(cfg: Config, lock: Lock, engine_name: str, start: str, end: str | None = None, *,
                stack: PinRef | None = None, variant: str | None = None, pre: bool = False) -> ReplayPlan:
    """Check the input and settle the releases: the engine, the tags, the stack (at --from, or
    --stack), the release range (from the first source that lists the engine's releases). Exit 2
    for bad input, 6 when no source lists the releases; nothing is written."""
    from patcher.engines.registry import engine
    from patcher.formats.patchfile import GateConfig
    from patcher.formats.stackfiles import load_stack
    from patcher.upstream.matrix import cell_checks
    from patcher.upstream.tags import release_tags

    lock.engine(engine_name)
    check_tag(start, "--from")
    if end is not None:
        check_tag(end, "--to")
    eng = engine(engine_name)
    if variant is not None:
        eng.variant(variant)
    stack_ref = stack or PinRef(engine_name, start)
    if stack_ref.engine != engine_name:
        raise UsageError(f"--stack {stack_ref} is a stack of {stack_ref.engine}, not {engine_name}",
                         hint="a stack is replayed within one engine")
    if stack is not None and stack != PinRef(engine_name, start):
        lock.pin(stack)

    def the_stack():
        st = load_stack(cfg.patches_root, stack_ref, must_exist=False)
        if not st.exists:
            raise UsageError(f"{stack_ref} has no stack (patches/{stack_ref.engine}/{stack_ref.tag}/series)",
                             hint=f"name the stack to replay: --stack {engine_name}@TAG (it is ported to {start} "
                                  "first)")
        return st

    if stack is not None:
        the_stack()
    tags = release_tags(cfg, lock, engine_name, pre=pre)
    todo, _known = release_range(tags.tags, start, end, engine_name)
    st = the_stack()
    start_tag = next(t for t in tags.tags if t.tag == start)
    configs_json = cell_checks(eng, lock.pins.get(str(stack_ref)) or _entry(engine_name, start_tag),
                               eng.variant(variant) if variant else eng.variants[0], st, [])
    configs = [GateConfig(c["model"], c["dtype"], c["config_style"], c["tp"], c["ep"]) for c in configs_json]
    return ReplayPlan(engine_name, start, todo[-1].tag, stack_ref, st, tags.source, start_tag, todo, configs, variant)


def replay(cfg: Config, lock: Lock, plan: ReplayPlan, *, control: bool = False, keep: bool = False,
           progress: Callable[[str], None] | None = None, on_row: Callable[[ReleaseRow], None] | None = None,
           on_line=None) -> tuple[ReplayReport, Path, Path]:
    """Carry the plan's stack through its releases (`plan_replay`); returns the report and the
    paths of its JSON and Markdown, written once at the end."""
    from patcher.base.machine import device_description

    t_all = time.monotonic()
    engine_name, start, end, stack_ref, st = plan.engine, plan.start, plan.end, plan.stack_ref, plan.stack
    variant, configs, start_tag, todo = plan.variant, plan.configs, plan.start_tag, plan.todo
    assert hasattr(st, "hash") and hasattr(st, "entries")
    stem = f"{engine_name}-{start}-to-{end}"
    root = cfg.workdir / "replay" / stem
    sc = make_scratch(cfg, lock, root, stack_ref)
    cur_lock = _scratch_lock(sc)
    load = _loadavg()
    report = ReplayReport(engine_name, start, end, str(stack_ref), st.hash, plan.source, variant,
                          [c.label for c in configs], datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                          device_description(), load)
    prev = stack_ref
    steps = ([(start_tag, "port" if stack_ref.tag != start else "start")] + [(t, "rebase") for t in todo])
    try:
        for t, step in steps:
            t0 = time.monotonic()
            if report.stopped:
                report.rows.append(ReleaseRow(t.tag, t.version, step, "not reached"))
                continue
            if progress:
                progress(f"replay: {engine_name}@{t.tag} ({step})")
            ref = PinRef(engine_name, t.tag)
            patches: list[dict] = []
            note = ""
            if step in ("rebase", "port"):
                cur_lock, patches, outcome, note = _rebase(sc, cur_lock, prev, t.tag, progress)
                if outcome == "conflict":
                    row = ReleaseRow(t.tag, t.version, step, "conflict", note=note,
                                     seconds=round(time.monotonic() - t0, 1))
                    report.rows.append(row)
                    report.stopped = f"{engine_name}@{t.tag}: {note}"
                    if on_row:
                        on_row(row)
                    keep = True  # the stopped checkout is what the user looks at
                    continue
                if step == "port":  # the stack now lives at --from; the release it came from is replayed too
                    shutil.rmtree(sc.patches_root / engine_name / stack_ref.tag, ignore_errors=True)
            else:
                patches = [{"name": e.name, "subject": e.patch.subject, "outcome": "start", "detail": ""}
                           for e in st.entries]
                if str(ref) not in cur_lock.pins:
                    cur_lock = _pin(sc, cur_lock, ref, progress)
            lock_row = _lock(sc, cur_lock, ref, variant, progress)
            checks = _checks(sc, cur_lock, ref, variant, configs, control, progress, on_line)
            row = ReleaseRow(t.tag, t.version, step, "carried", patches, lock_row, checks,
                             round(time.monotonic() - t0, 1), note)
            report.rows.append(row)
            if on_row:
                on_row(row)
            prev = ref
    finally:
        report.seconds = round(time.monotonic() - t_all, 1)
    js, md = write_report(cfg, report)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return report, js, md


def _entry(engine_name: str, t):
    from patcher.formats.lock import LockEntry

    return LockEntry(engine_name, t.tag, t.version)


def _pin(sc: Config, lock: Lock, ref: PinRef, progress) -> Lock:
    """Pin `ref` in the scratch project (the starting release of a replay whose lock lacks it)."""
    from patcher.formats.lock import write_lock
    from patcher.upstream.resolve import resolve_pin

    entry, _ = resolve_pin(sc, lock, ref, progress=progress)
    new = lock.with_pin(entry)
    write_lock(new, sc.lock_path)
    return _scratch_lock(sc)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def report_from_json(doc: dict) -> ReplayReport:
    """Pure: a replay report as its JSON holds it (what `format_markdown` renders again)."""
    keys = {k: v for k, v in doc.items() if k in ReplayReport.__dataclass_fields__ and k != "rows"}
    rows = [ReleaseRow(**{**{k: v for k, v in r.items() if k != "checks"},
                          "checks": [CheckCell(**c) for c in r.get("checks", [])]}) for r in doc.get("rows", [])]
    return ReplayReport(**keys, rows=rows)


def report_paths(cfg: Config, engine_name: str, start: str, end: str) -> tuple[Path, Path]:
    d = cfg.reports_root / "replay"
    stem = f"{engine_name}-{start}-to-{end}"
    return d / f"{stem}.json", d / f"{stem}.md"


def write_report(cfg: Config, report: ReplayReport) -> tuple[Path, Path]:
    js, md = report_paths(cfg, report.engine, report.start, report.end)
    atomic_write_text(md, format_markdown(report))
    atomic_write_text(js, json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
    return js, md


# ---------------------------------------------------------------- formatting


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}" if x < 0.01 else f"{x:.3g}"


def check_words(c: CheckCell) -> str:
    """A check's cell in the table: `pass (1.4e-05)`, `FAIL (2.9)`, `cannot run here: why`."""
    if c.verdict == "pass":
        return f"pass ({_num(c.max_abs)})" if c.max_abs is not None else "pass"
    if c.verdict == "fail":
        if c.max_abs is not None:
            return f"FAIL ({_num(c.max_abs)})"
        import re

        err = re.search(r"\b\w+(?:Error|Exception): .*", c.reason)  # the engine's own error, where it names one
        return f"FAIL: {(err.group(0) if err else c.reason)[:100]}"
    if c.verdict == "cannot run":
        return f"cannot run here: {c.reason[:90]}"
    return f"{c.verdict}: {c.reason[:80]}" if c.reason else c.verdict


def table_rows(report: ReplayReport) -> tuple[list[str], list[list[str]]]:
    """Pure: the replay table's header and rows (release, each patch's class, each check, time)."""
    names: list[str] = []
    for r in report.rows:
        for p in r.patches:
            if p["name"][5:] not in [n[5:] for n in names]:
                names.append(p["name"])
    labels: list[str] = []
    for r in report.rows:
        for c in r.checks:
            if c.config not in labels:
                labels.append(c.config)
    header = ["release", "step", *[n.split("-", 1)[0] for n in names], *labels, "time"]
    rows = []
    for r in report.rows:
        by = {p["name"][5:]: p["outcome"] for p in r.patches}
        cells = [f"{r.tag}", r.step if r.outcome == "carried" else f"{r.step}: {r.outcome}"]
        cells += [by.get(n[5:], "-") for n in names]
        checks = {c.config: c for c in r.checks}
        cells += [check_words(checks[lb]) if lb in checks else "-" for lb in labels]
        cells.append(f"{r.seconds:.0f} s" if r.outcome != "not reached" else "-")
        rows.append(cells)
    return header, rows


def format_markdown(report: ReplayReport) -> str:
    header, rows = table_rows(report)
    names: list[tuple[str, str]] = []
    for r in report.rows:
        for p in r.patches:
            if all(p["name"][5:] != n[5:] for n, _ in names):
                names.append((p["name"], p["subject"]))

    def cell(x: str) -> str:
        return x.replace("|", "\\|").replace("\n", " ")

    load = " ".join(f"{x:g}" for x in report.load_average) if report.load_average else "unknown"
    out = [f"# Replay of {report.stack}'s stack through {report.engine} {report.start} → {report.end}", "",
           f"- releases from: {report.source}; configurations: {', '.join(report.configs)}"
           + (f"; variant {report.variant}" if report.variant else ""),
           f"- machine: {report.device}; 1-minute load average at the start: {load}; {report.date}",
           f"- stack {report.stack_hash[:10]}; {report.seconds:.0f} s in all"
           + (f"; stopped: {report.stopped}" if report.stopped else ""), "",
           "| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    out += ["", "Patches: " + "; ".join(f"{n.split('-', 1)[0]} {s}" for n, s in names) + "."]
    for r in report.rows:
        extra = [c for c in r.checks if c.verdict != "pass" and c.reason]
        lock_err = (r.lock or {}).get("error")
        if r.note or extra or lock_err:
            out.append("")
            out.append(f"- {r.tag}: " + "; ".join(
                [*([r.note] if r.note else []), *([f"lock: {lock_err}"] if lock_err else []),
                 *[f"{c.config}: {c.reason}" for c in extra]]))
    return "\n".join(out) + "\n"


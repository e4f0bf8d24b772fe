"""`dsadapt power`: how small a bug the gate sees, measured with perturbations planted in the engine.

The pure parts (targets, the search, the result, its Markdown) are `patcher.rules.mde`; this
module runs it. One engine start per dtype: the engine's runner is started in its power mode
(``--power-jobs``, `dsadapt_runner.add_power_args`) and fed one job per perturbation setting;
each job's logit report (and, in low precision, its capture) is judged by the gate's own rule
exactly as `dsadapt check` judges a run in that dtype (`judge`), while the runner already works
on the next job. The jobs of a round are queued together: first the run without hooks, the
control (every hook at eps 0) and each cell's first eps, then one bisection step per cell per
round (`patcher.rules.mde.next_eps`) until every cell is settled.

The low-precision rule compares each capture with the HF reference teacher-forced on exactly
that run's token sequences: a perturbation that changes a greedy token makes new sequences,
captured by one reference run per round for all of them (`ReferenceCaptures`; cached by
sequences like any bisect's reference capture).

`PowerRequest.grid` puts several eps of each cell in its first round; `PowerRequest.time_limit`
starts no round that would end past it (its cells are "cut short", their bracket kept).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import DsadaptError, EngineRunFailed, EngineUnavailable, UsageError
from patcher.base.machine import device_description
from patcher.checkpoints.fingerprint import fingerprint
from patcher.checkpoints.model_dir import Checkpoint, open_checkpoint, run_time_limit
from patcher.engines.base import GateRun, GateSession
from patcher.engines.registry import engine
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef
from patcher.gate import bisect
from patcher.gate.detection import PowerResult, markdown
from patcher.gate.equivalence import (
    ENGINE_TOP_K,
    MAX_TOKENS,
    check_engine_path,
    reference_python,
    report_paths,
    resolve_model,
    run_reference,
)
from patcher.gate.hosts import RunHost
from patcher.gate.plan import CheckPlan, CheckRequest, ModelChoice, choose_model, plan_check
from patcher.gate.result import verdict_reasons
from patcher.rules import mde as P
from patcher.rules.divergence import ModuleVerdict
from patcher.rules.logits import LOW_PRECISION_DTYPES, LogitReport, ReportError, compare
from patcher.rules.modules import CAPTURE_DECODE_STEPS, BisectError, CaptureTable
from patcher.rules.prompts import build_prompt_set, write_prompts_json
from patcher.rules.verdicts import Margins, check_margins

#: Seconds the runner may take for one setting (the gate's prompts and a capture pass) beyond its engine start.
JOB_TIMEOUT_S = 600.0


class PowerError(DsadaptError):
    """The power run could not be carried out (the runner died, a job failed)."""


@dataclass(frozen=True)
class PowerRequest:
    """One power run as the user asked for it."""

    pin: PinRef
    model: str = "v3"
    config_style: str | None = None
    dtype: str = "float32"
    variant: str | None = None
    unpatched: bool = False
    families: tuple[str, ...] = P.DEFAULT_TARGETS
    phases: tuple[str, ...] = P.DEFAULT_PHASES
    kind: str = "scale"
    search: P.Search = field(default_factory=P.Search)
    require: float | None = None
    prompt_seed: int = 0
    reference_on: str = "auto"
    command: str | None = None
    #: seconds the run may take: no round is started that would end past it (cells still searching
    #: are reported "cut short" with their bracket so far); None: no limit
    time_limit: float | None = None
    #: eps tried in each cell's first round (`patcher.rules.mde.first_eps`); later rounds bisect
    grid: int = 1


# ---------------------------------------------------------------- before anything runs


def plan_cells(req: PowerRequest, config: dict, table: CaptureTable | None, engine_name: str,
               model_label: str | None = None) -> list[P.Cell]:
    """The cells of a request (one per family and phase), or UsageError (exit 2) for a kind, phase,
    eps range, family that is not one, a family this model lacks, or one the engine's capture table
    cannot reach (`table` None: not asked here; `plan_power` says the engine has none). Pure: read
    from the request and the model's config.json alone."""
    P.check_kind(req.kind)
    req.search.check()
    if not 1 <= req.grid <= 20:
        raise UsageError(f"--grid {req.grid}: must be 1 to 20", hint="eps tried in each cell's first round, e.g. --grid 3")
    if req.time_limit is not None and not req.time_limit > 0:
        raise UsageError(f"--time-limit {req.time_limit:g}: must be positive", hint="seconds, e.g. --time-limit 600")
    if req.require is not None and not (0 < req.require < P.EPS_LIMIT):
        raise UsageError(f"--require {req.require:g}: eps must be in (0, {P.EPS_LIMIT:g})",
                         hint="the largest MDE every cell may have, e.g. --require 0.05")
    phases = list(dict.fromkeys(P.check_phase(p) for p in req.phases)) or list(P.DEFAULT_PHASES)
    targets = [P.target(f) for f in dict.fromkeys(req.families)]
    if not targets:
        raise UsageError("no --family to perturb", hint=f"e.g. --family {P.DEFAULT_TARGETS[0]}")
    sites = {s.point for s in (table.sites if table else ())}
    model = f"--model {model_label or req.model}"
    cells = []
    for t in targets:
        why = P.lacks(t, config, model)
        if why:
            raise UsageError(f"--family {t.name}: {why}",
                             hint="name a module family this model has (`dsadapt power --help` lists them)")
        if table is not None and t.point not in sites:
            raise UsageError(f"--family {t.name}: {engine_name}'s capture table has no {t.point}, so nothing can be "
                             "planted there", hint=f"families it can reach: {', '.join(n for n, x in P.FAMILIES.items() if x.point in sites)}")
        for ph in phases:
            cells.append(P.Cell(t.name, t.point, t.family, ph, P.layers_of(t, config)))
    return cells


@dataclass(frozen=True)
class PowerPlan:
    """A `PowerRequest` resolved before anything is made: the check plan its runs start from
    (`plan_check`: the model, the pin and its variant, whether it runs here, the stack, a source for
    the tree, where the reference runs), the dtypes it measures and the engine's capture table."""

    req: PowerRequest
    check: CheckPlan
    dtypes: tuple[str, ...]
    table: CaptureTable


def check_request(req: PowerRequest, dtype: str | None) -> CheckRequest:
    """The check a power run in `dtype` perturbs: the same pin, model, variant and prompts."""
    return CheckRequest(req.pin, model=req.model, config_style=req.config_style, dtype=dtype, variant=req.variant,
                        unpatched=req.unpatched, reference_on=req.reference_on,
                        command=req.command or default_command(req), prompt_seed=req.prompt_seed)


def plan_power(cfg: Config, lock: Lock, req: PowerRequest, dtypes: tuple[str, ...] = (),
               model: ModelChoice | None = None) -> PowerPlan:
    """Everything a power run can tell before it touches anything, in the order a user meets it:
    the model (exit 2), the cells (a kind, phase, eps or family that is not one, or that this
    model lacks: 2, whatever the machine), then for each dtype asked (none: every dtype `check`
    runs) what `plan_check` answers (6 for what this machine cannot run, 2 for a dtype the engine
    does not serve), and last whether the engine has a capture table to plant in (6)."""
    model = model or choose_model(req.model)
    eng = engine(req.pin.engine)
    table = bisect.table_for(eng)
    plan_cells(req, model.config, table, eng.name, model.name)
    asked = tuple(dict.fromkeys(dtypes))
    plans = [plan_check(cfg, lock, check_request(req, dt), model) for dt in asked or (None,)]
    if table is None:
        raise EngineUnavailable(f"{req.pin.engine} has no capture table: dsadapt cannot plant perturbations in it",
                                hint="see docs/equivalence.md (Power) for the engines that can")
    return PowerPlan(req, plans[0], asked or plans[0].dtypes, table)


# ---------------------------------------------------------------- the engine's runner, in its power mode


class PowerRunner:
    """The engine's runner serving perturbation jobs (one engine start); one job at a time on its
    side, any number queued on ours. Killed with its process group when dsadapt stops (the guard)."""

    def __init__(self, session: GateSession, argv: list[str], env: dict[str, str], work: Path, start_s: float):
        from patcher.base.procs import start_guarded

        self.work = work
        self.start_s = start_s
        self.log = work / "power-runner.log"
        self.proc = start_guarded(f"{session.runner.name} runner", argv, log_path=self.log, env=env, cwd=work,
                                  deadline_s=24 * 3600, grace_s=10, stdin_pipe=True)
        self.n = 0
        self.answered = 0

    def submit(self, job: dict) -> Path:
        """Queue a job on the runner's stdin; returns the path its answer will be written to."""
        self.n += 1
        done = self.work / "jobs" / f"{self.n:04d}.done.json"
        if not self.proc.send_job(job, done):
            raise self._died()
        return done

    def wait(self, done: Path, timeout_s: float = JOB_TIMEOUT_S) -> dict:
        """The job's answer ({"ok", "error", "seconds"}) once its done file is there."""
        from patcher.base.procs import log_tail

        limit = timeout_s + (self.start_s if self.answered == 0 else 0.0)
        came = self.proc.wait_for(done, limit)
        if came == "exited":
            raise self._died()
        if came == "late":
            raise PowerError(f"the {self.proc.name} took more than {limit:.0f} s for one perturbation setting",
                             hint=f"log: {self.log}")
        self.answered += 1
        answer = json.loads(done.read_text())
        if not answer.get("ok"):
            raise PowerError(f"the {self.proc.name} failed a perturbation setting: {answer.get('error')}",
                             hint=f"log: {self.log}\n{log_tail(self.log, 15)}")
        return answer

    def _died(self) -> DsadaptError:
        """Why the runner is gone: before its first answer the engine could not load or run the model
        (a verdict on the engine, exit 1, as `check` says it), later it broke down mid-run (exit 7)."""
        from patcher.base.procs import log_tail
        from patcher.runners.launch import root_cause

        tail = log_tail(self.log, 15)
        if self.answered == 0:
            try:
                cause = root_cause(self.log.read_text(errors="replace").splitlines())
            except OSError:
                cause = None
            return EngineRunFailed("the engine failed on this model before its first run"
                                   + (f" (root cause: {cause[:200]})" if cause else ""),
                                   hint=f"log: {self.log}\n{tail}")
        return PowerError(f"the {self.proc.name} exited after {self.answered} of {self.n} runs",
                          hint=f"log: {self.log}\n{tail}")

    def stop(self) -> None:
        """End the runner: at the end of its input once every job is answered (it leaves by itself),
        at once (its process group) while jobs are still queued (a run cut short)."""
        try:
            if self.proc.proc.stdin:
                self.proc.proc.stdin.close()
        except OSError:
            pass
        end = time.monotonic() + (30 if self.answered == self.n else 0)
        while self.proc.alive() and time.monotonic() < end:
            time.sleep(0.1)
        self.proc.stop(grace_s=5)


# ---------------------------------------------------------------- the reference's captures


class ReferenceCaptures:
    """The HF reference's captures (float32 and the engine's dtype) of every token sequence the
    engine runs made: captured in batches (`add`), gathered per run (`docs_for`). Each batch is kept
    on disk under `spill` and at most `KEEP` of them in memory (a capture of a real-shaped model is
    gigabytes; a run's sequences lie in one or two batches)."""

    KEEP = 2

    def __init__(self, capture: Callable[[dict[str, list[int]]], dict[str, dict]], spill: Path):
        self._capture = capture
        self.spill = spill
        self.paths: list[Path] = []
        self._loaded: dict[int, dict[str, dict]] = {}
        self.known: dict[tuple[int, ...], tuple[int, str]] = {}
        self.runs = 0

    def unknown(self, sequences: dict[str, list[int]]) -> list[tuple[int, ...]]:
        return [tuple(s) for s in sequences.values() if tuple(s) not in self.known]

    def add(self, sequences: list[tuple[int, ...]]) -> None:
        import torch

        new = list(dict.fromkeys(s for s in sequences if s not in self.known))
        if not new:
            return
        ids = {f"s{len(self.known) + k}": list(s) for k, s in enumerate(new)}
        docs = self._capture(ids)
        self.runs += 1
        chunk = len(self.paths)
        self.spill.mkdir(parents=True, exist_ok=True)
        self.paths.append(self.spill / f"chunk{chunk}.pt")
        torch.save(docs, self.paths[-1])
        self._keep(chunk, docs)
        for sid, seq in ids.items():
            self.known[tuple(seq)] = (chunk, sid)

    def _keep(self, chunk: int, docs: dict[str, dict]) -> dict[str, dict]:
        self._loaded.pop(chunk, None)
        self._loaded[chunk] = docs
        while len(self._loaded) > self.KEEP:
            self._loaded.pop(next(iter(self._loaded)))
        return docs

    def _chunk(self, chunk: int) -> dict[str, dict]:
        import torch

        docs = self._loaded.get(chunk)
        return self._keep(chunk, docs if docs is not None else torch.load(self.paths[chunk], weights_only=False))

    def docs_for(self, sequences: dict[str, list[int]]) -> dict[str, dict]:
        picks = {pid: self.known[tuple(seq)] for pid, seq in sequences.items()}
        loaded = {c: self._chunk(c) for c in sorted({c for c, _ in picks.values()})}
        dtypes = list(next(iter(loaded.values())))
        return {dt: P.assemble_capture([loaded[c][dt] if c in loaded else None for c in range(len(self.paths))], picks)
                for dt in dtypes}

    def close(self) -> None:
        self._loaded.clear()
        for p in self.paths:
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- judging one run


@dataclass
class Judged:
    flagged: bool
    reasons: list[str]
    by: list[str]
    named: dict | None
    margins: Margins
    comparison: dict = field(repr=False, default_factory=dict)
    bisect: ModuleVerdict | None = field(repr=False, default=None)


@dataclass
class Judge:
    """The gate's verdict on one engine run, as `run_check` reaches it in this dtype: the logit rule
    (low precision: against the reference's own run in the dtype, without the cones of routing
    flips) and, in low precision, the per-module comparison."""

    reference: LogitReport
    noise: LogitReport | None
    config: dict
    dtype: str
    engine_name: str
    table: CaptureTable
    refs: ReferenceCaptures

    @property
    def modules(self) -> bool:
        return self.dtype in LOW_PRECISION_DTYPES

    def capture_of(self, capture: Path | None) -> dict | None:
        """The engine's capture of a run (low precision), or None (float32: the verdict is the logits')."""
        if not self.modules:
            return None
        if capture is None or not capture.is_file():
            raise PowerError(f"the engine run wrote no capture at {capture}", hint="see the runner's log")
        return bisect.load_capture(capture)

    def __call__(self, report: LogitReport, engine_doc: dict | None) -> Judged:
        """The verdict; in low precision the reference must already hold `engine_doc`'s sequences
        (`ReferenceCaptures.add`)."""
        comparison = compare(self.reference, report, ENGINE_TOP_K, noise=self.noise)
        summary = None
        if self.modules:
            assert engine_doc is not None
            ref_docs = self.refs.docs_for(engine_doc["sequences"])
            try:
                result = bisect.compare(engine_doc, ref_docs, self.config, self.dtype, self.engine_name, self.table)
            except BisectError as e:
                raise PowerError(f"a perturbed run could not be compared per module: {e.message}", hint=e.hint) from e
            summary = bisect.summary(result, None, None)
            if summary.routing_flips and comparison.rule == "low-precision":
                comparison = compare(self.reference, report, ENGINE_TOP_K, noise=self.noise,
                                     routing_flips=summary.routing_flips)
        reasons = verdict_reasons(comparison.reasons, self.dtype, summary)
        by = (["logits"] if comparison.reasons else []) + (["modules"] if summary and summary.passed is False else [])
        first = summary.first if summary else None
        named = None if first is None else {"layer": first.layer, "point": first.point, "label": first.label,
                                            "family": first.family, "phase": first.phase, "ratio": first.ratio}
        comp = comparison.to_json()
        return Judged(bool(reasons), reasons, by, named, check_margins(comp, summary.margin if summary else None),
                      comp, summary)


# ---------------------------------------------------------------- the run


def _load_report(path: Path, prompt_ids: list[str], dtype: str) -> LogitReport:
    try:
        report = LogitReport.load(path)
    except ReportError as e:
        raise PowerError(f"the engine's report of a perturbation setting is unreadable: {e.message}",
                         hint=f"{path}") from e
    got = [p.id for p in report.prompts]
    if got != prompt_ids or report.dtype != dtype:
        raise PowerError(f"the engine reported prompts {got} in {report.dtype}; asked for {prompt_ids} in {dtype}",
                         hint=f"{path}")
    return report


def _stats(report: LogitReport) -> dict:
    return (report.settings or {}).get("perturbation") or {}


@dataclass
class _PowerRun:
    """What one power run (one dtype) resolved before its engine starts: the model (a built-in one
    made here, a folder as the plan opened it), its fingerprint, cells, report and work paths."""

    plan: PowerPlan
    req: PowerRequest          # the plan's request, in this run's dtype
    host: RunHost
    on_line: Callable[[str], None] | None
    checkpoint: Checkpoint
    label: str
    style: str | None
    fingerprint: str
    cells: list[P.Cell]
    out: Path
    work: Path
    t_start: float
    loadavg_start: list[float] | None
    timings: dict = field(default_factory=dict)

    @property
    def cfg(self) -> Config:
        return self.plan.check.cfg

    @property
    def model_dir(self) -> Path:
        return self.checkpoint.path.resolve()

    def say(self, message: str) -> None:
        if self.host.progress:
            self.host.progress(message)


def _prepare(plan: PowerPlan, dtype: str, host: RunHost, on_line) -> _PowerRun:
    t_start, loadavg_start = time.monotonic(), _loadavg()
    req, cfg, check = replace(plan.req, dtype=dtype), plan.check.cfg, plan.check
    if check.model.checkpoint is None:  # a built-in model: made here (once; later runs find it)
        model_dir, label, style = resolve_model(cfg, req.model, req.config_style, host.progress,
                                                default_style=check.eng.model_config_style)
        ckpt = open_checkpoint(model_dir)
    else:
        ckpt = check.model.checkpoint
        label, style = ckpt.path.name, req.config_style
    cells = plan_cells(req, ckpt.config, plan.table, check.eng.name, label)
    fp = fingerprint(ckpt, cfg.cache, host.progress).sha256
    out = report_paths(cfg, req.pin, label, style, dtype, req.unpatched, kind="power", prompt_seed=req.prompt_seed)
    work = cfg.workdir / "runs" / out.relative_to(cfg.reports_root).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    return _PowerRun(plan, req, host, on_line, ckpt, label, style, fp, cells, out, work, t_start, loadavg_start)


def _judge(r: _PowerRun, prompts_path: Path) -> Judge:
    """The gate's judge of this run's engine runs: the float32 reference and, in low precision, the
    reference's own run in the dtype, as a check runs them; the reference's captures on demand."""
    cfg, progress, device, dtype = r.cfg, r.host.progress, r.plan.check.reference_device, r.req.dtype
    prompts_doc = json.loads(prompts_path.read_text())
    t0 = time.monotonic()
    reference = run_reference(cfg, r.model_dir, r.fingerprint, prompts_path, prompts_doc, progress, r.on_line, device,
                              checkpoint=r.checkpoint)
    noise = None
    if dtype in LOW_PRECISION_DTYPES:
        noise = run_reference(cfg, r.model_dir, r.fingerprint, prompts_path, prompts_doc, progress, r.on_line, device,
                              dtype=dtype, checkpoint=r.checkpoint)
    r.timings["reference_s"] = round(time.monotonic() - t0, 2)
    r.timings["reference_capture_s"] = 0.0

    def capture_reference(sequences: dict[str, list[int]]) -> dict[str, dict]:
        t = time.monotonic()
        r.say(f"power: HF reference capture of {len(sequences)} new token sequence(s)")
        docs = bisect.reference_capture(cfg, r.checkpoint, r.fingerprint, {"sequences": sequences}, dtype,
                                        r.work / "reference", lambda: reference_python(cfg, progress), progress,
                                        r.on_line, device=device)
        r.timings["reference_capture_s"] = round(r.timings["reference_capture_s"] + time.monotonic() - t, 2)
        return docs

    refs = ReferenceCaptures(capture_reference, r.work / "reference" / "chunks")
    return Judge(reference, noise, r.checkpoint.config, dtype, r.plan.check.eng.name, r.plan.table, refs)


@dataclass(frozen=True)
class _Job:
    """One perturbation setting queued on the runner: its id, and where its answer, logit report and
    capture (low precision) will be."""

    sid: str
    done: Path
    report: Path
    capture: Path | None

    def cleanup(self) -> None:
        """A judged run's files go (a capture is tens of megabytes; the trial keeps what matters)."""
        for p in (self.done, self.report, self.capture):
            if p is not None:
                p.unlink(missing_ok=True)


@dataclass
class _Jobs:
    """The runner's jobs of one run: submitted with their paths, answered as logit reports."""

    runner: PowerRunner
    folder: Path
    prompt_ids: list[str]
    dtype: str
    modules: bool              # low precision: every perturbed run is captured and judged per module
    settings: int = 0

    def submit(self, sid: str, plan: list[dict], capture: bool | None = None) -> _Job:
        self.settings += 1
        cap = self.folder / f"{sid}.capture.pt" if (self.modules if capture is None else capture) else None
        report = self.folder / f"{sid}.json"
        # in low precision the logits are judged on the prompt's positions only (generation is
        # reported, never judged): one greedy token is enough there, the capture pass decodes
        done = self.runner.submit({"setting": {"id": sid, "perturb": plan}, "report": str(report),
                                   "capture": str(cap) if cap else None, "max_tokens": 1 if self.modules else None})
        return _Job(sid, done, report, cap)

    def finish(self, job: _Job) -> LogitReport:
        answer = self.runner.wait(job.done)
        report = _load_report(job.report, self.prompt_ids, self.dtype)
        report.timings["job_s"] = float(answer.get("seconds") or 0.0)
        return report


def _start_runner(r: _PowerRun, session: GateSession, prompts_path: Path) -> PowerRunner:
    """The engine's runner started in its power mode in the run's gate session (one engine start)."""
    from patcher.runners.launch import kit_pythonpath

    req, table, config = r.req, r.plan.table, r.checkpoint.config
    if not session.runner.power:
        raise EngineUnavailable(f"{req.pin} ({r.plan.check.spec.name}): its {session.runner.name} runner cannot "
                                "plant perturbations", hint="see docs/equivalence.md (Power) for the engines that can")
    spec_path = bisect.write_spec(table, config, req.dtype, r.work / f"{table.name}-capture-spec.json")
    argv = session.runner.argv(session.python, r.model_dir, prompts_path, req.dtype, ENGINE_TOP_K, MAX_TOKENS,
                               r.work / "power-engine.json", r.fingerprint) + \
        ["--power-jobs", "--capture-spec", str(spec_path), "--capture-decode-steps", str(CAPTURE_DECODE_STEPS)]
    env = {**os.environ, **session.runner.env, **session.env}
    env["PYTHONPATH"] = kit_pythonpath(env)
    r.say(f"power: {req.pin} ({r.plan.check.spec.name}) {req.dtype} via {session.runner.name} runner: "
          f"{len(r.cells)} cells, one engine start")
    return PowerRunner(session, argv, env, r.work, run_time_limit(r.checkpoint))


@dataclass
class _Outcome:
    """What the engine runs of a power run found besides its cells."""

    control: dict = field(default_factory=dict)
    hooks: dict = field(default_factory=dict)
    installed: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    runner: str = ""
    settings: int = 0


def _first_round(r: _PowerRun, jobs: _Jobs, judge: Judge, out: _Outcome, t_engine: float) -> list:
    """Round 0, queued together: the run without hooks, the control (every hook at eps 0) and every
    cell's first eps. Returns the cells' runs still to judge (none when the control fails: power is
    not measured against an engine that fails without a perturbation)."""
    req = r.req
    baseline_job = jobs.submit("baseline", [], capture=False)
    control_job = jobs.submit("control", P.control_plan(r.cells, req.kind))
    queued = [(cell, first, jobs.submit(f"c{i}-{first:g}", [P.plan_item(cell, req.kind, first)]))
              for i, cell in enumerate(r.cells) for first in P.first_eps(req.search, req.grid)]
    baseline = jobs.finish(baseline_job)
    check_engine_path(req.pin, baseline.engine_path, out.installed)
    out.engine = {"engine_version": baseline.engine_version, "engine_path": baseline.engine_path,
                  "engine_start_s": baseline.timings.get("engine_start_s", baseline.timings.get("load_s")),
                  # the first job's wait: the runner's start (imports, engine, first forward)
                  "first_job_s": round(time.monotonic() - t_engine, 2)}
    control_report = jobs.finish(control_job)
    diff = P.logit_difference(baseline.to_json(), control_report.to_json())
    out.hooks = {"max_abs": diff, "identical": diff == 0.0, "words": P.hooks_words(diff)}
    control_doc = judge.capture_of(control_job.capture)
    if control_doc is not None:
        judge.refs.add(judge.refs.unknown(control_doc["sequences"]))
    c = judge(control_report, control_doc)
    del control_doc
    control_job.cleanup()
    out.control = {"passed": not c.flagged, "reasons": c.reasons, "margins": c.margins.to_json(), "by": c.by,
                   "setting_s": control_report.timings.get("setting_s"),
                   "capture_s": control_report.timings.get("capture_s")}
    r.say(f"power: control (every hook at eps 0) {'passes' if not c.flagged else 'FAILS'} the gate"
          + (f" ({c.margins.words})" if c.margins.words else "") + f"; hooks: {out.hooks['words']}")
    return [] if c.flagged else queued


def _search(r: _PowerRun, jobs: _Jobs, judge: Judge, queued: list) -> None:
    """Later rounds: one bisection step per cell still searching, until every cell is settled or
    the next round would end past --time-limit (its cells are cut short, their bracket kept)."""
    req = r.req
    while queued:
        t_round = time.monotonic()
        _round(queued, jobs.finish, judge, r.say)
        per_run = (time.monotonic() - t_round) / len(queued)
        steps = [(i, cell, eps) for i, cell in enumerate(r.cells) if (eps := P.next_eps(cell, req.search)) is not None]
        if req.time_limit is not None and steps and \
                time.monotonic() - r.t_start + per_run * len(steps) > req.time_limit:
            r.say(f"power: {len(steps)} cell(s) cut short: another round of about {per_run * len(steps):.0f} s "
                  f"would end past --time-limit {req.time_limit:g} s")
            for _i, cell, _eps in steps:
                cell.status = "cut short"
            steps = []
        queued = [(cell, eps, jobs.submit(f"c{i}-{eps:g}", [P.plan_item(cell, req.kind, eps)]))
                  for i, cell, eps in steps]


def _run_engine(r: _PowerRun, judge: Judge, prompts_path: Path, prompt_ids: list[str]) -> _Outcome:
    """The engine's part: its gate session (built and installed once per command), the runner in its
    power mode, the first round and the search, every job on one engine start."""
    check, out = r.plan.check, _Outcome()
    gate = GateRun(check.entry, check.spec, r.req.dtype, r.model_dir, unpatched=r.req.unpatched)
    folder = r.work / "settings"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    with ExitStack() as stack:
        stack.callback(judge.refs.close)
        t0 = time.monotonic()
        session = stack.enter_context(check.eng.bisect_session(gate, r.host) or check.eng.gate_session(gate, r.host))
        out.installed, out.runner = dict(session.installed), session.runner.name
        r.timings["install_s"] = round(time.monotonic() - t0, 2)
        runner = _start_runner(r, session, prompts_path)
        stack.callback(runner.stop)
        t_engine = time.monotonic()
        jobs = _Jobs(runner, folder, prompt_ids, r.req.dtype, judge.modules)
        try:
            _search(r, jobs, judge, _first_round(r, jobs, judge, out, t_engine))
        finally:
            out.settings = jobs.settings
        r.timings["engine_s"] = round(time.monotonic() - t_engine, 2)
    return out


def run_power(plan: PowerPlan, dtype: str, *, host: RunHost | None = None,
              on_line: Callable[[str], None] | None = None) -> PowerResult:
    """The power run of one planned pin and model in one of the plan's dtypes (see the module doc).
    `host`: one `RunHost` shared by the runs of one command (several dtypes), so the engine is built
    and installed once; it carries the progress."""
    r = _prepare(plan, dtype, host or RunHost(plan.check.cfg, plan.check.lock), on_line)
    prompts = build_prompt_set(r.model_dir, MAX_TOKENS, seed=r.req.prompt_seed)
    prompts_path = write_prompts_json(prompts, r.work / "prompts.json")
    judge = _judge(r, prompts_path)
    found = _run_engine(r, judge, prompts_path, [p.id for p in prompts])
    result = _result(r, judge, found)
    write_report(result, r.out)
    return result


def _result(r: _PowerRun, judge: Judge, found: _Outcome) -> PowerResult:
    req, control = r.req, found.control
    if not control.get("passed"):
        for cell in r.cells:
            cell.status = "not measured"
    r.timings["reference_captures"] = judge.refs.runs
    r.timings.update({k: v for k, v in found.engine.items() if k.endswith("_s")})
    reasons = P.verdict(r.cells, control.get("passed", False), control.get("reasons") or [], req.require)
    r.timings["total_s"] = round(time.monotonic() - r.t_start, 2)
    return PowerResult(
        pin=str(req.pin), engine=req.pin.engine, variant=r.plan.check.spec.name, model=r.label, config_style=r.style,
        dtype=req.dtype, unpatched=req.unpatched, kind=req.kind,
        search={**asdict(req.search), "grid": req.grid, "time_limit": req.time_limit}, cells=r.cells,
        control=control, hooks=found.hooks, passed=not reasons, reasons=reasons, require=req.require,
        runner=found.runner, settings=found.settings, timings=r.timings, provenance=_provenance(r, judge, found),
        report_path=str(r.out))


def _provenance(r: _PowerRun, judge: Judge, found: _Outcome) -> dict:
    req = r.req
    return {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device_description(),
            "loadavg": r.loadavg_start, "loadavg_end": _loadavg(), "command": req.command or default_command(req),
            "installed": found.installed, "engine_version": found.engine.get("engine_version"),
            "engine_path": found.engine.get("engine_path"), "model_fingerprint": r.fingerprint,
            "model_dir": str(r.model_dir), "prompt_seed": req.prompt_seed,
            "reference_versions": judge.reference.versions, "reference_device": r.plan.check.reference_device,
            "patches": [] if req.unpatched else [e.name for e in r.plan.check.stack.entries]}


def _round(queued: list, finish, judge: Judge, say) -> None:
    """Judge one round's runs as they come back, in the order queued; in low precision a run whose
    token sequences the reference has not captured yet waits for the end of the round, when one
    reference run captures them all."""
    waiting = []
    for cell, eps, job in queued:
        report = finish(job)
        rows, change, why = _planted(cell, report)
        if rows == 0:
            _add(cell, P.Trial(eps, None, reason=why, setting=job.sid, seconds=report.timings.get("job_s")), say)
            job.cleanup()
            continue
        doc = judge.capture_of(job.capture)
        if doc is not None and judge.refs.unknown(doc["sequences"]):
            waiting.append((cell, eps, job, report, rows, change, doc["sequences"]))
            continue
        _add(cell, _judged(judge, cell, eps, report, doc, rows, change, job.sid), say)
        del doc
        job.cleanup()
    if waiting:
        judge.refs.add([s for *_, seqs in waiting for s in judge.refs.unknown(seqs)])
    for cell, eps, job, report, rows, change, _seqs in waiting:
        _add(cell, _judged(judge, cell, eps, report, judge.capture_of(job.capture), rows, change, job.sid), say)
        job.cleanup()


def _planted(cell: P.Cell, report: LogitReport) -> tuple[int, float | None, str]:
    """Rows of the cell's phase its perturbation changed over the run's passes (report and capture),
    the relative change they took, and, for none, why."""
    st = _stats(report)
    rows, change = P.applied(st.get("report_pass"), cell.point, cell.phase)
    if st.get("capture_pass") is not None:
        r2, c2 = P.applied(st.get("capture_pass"), cell.point, cell.phase)
        if c2 is not None and change is not None:
            change = ((rows * change ** 2 + r2 * c2 ** 2) / max(rows + r2, 1)) ** 0.5
        elif change is None:
            change = c2
        rows += r2
    why = "" if rows else (f"no {cell.phase} row the engine computes passes through {cell.point}"
                           + (f" in layers {cell.layers}" if cell.layers is not None else ""))
    return rows, change, why


def _judged(judge: Judge, cell: P.Cell, eps: float, report: LogitReport, doc: dict | None, rows: int,
            change: float | None, sid: str) -> P.Trial:
    j = judge(report, doc)
    return P.Trial(eps, j.flagged, j.by, j.reasons[0] if j.reasons else "", j.named, rows, change, sid,
                   report.timings.get("job_s"))


def _add(cell: P.Cell, trial: P.Trial, say) -> None:
    cell.trials.append(trial)
    say(f"power: {cell.target} {cell.phase} eps {trial.eps:g}: "
        + ("not planted" if trial.flagged is None else
           ("flagged" + (f" by {', '.join(trial.by)}" if trial.by else "")) if trial.flagged else "not flagged"))


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_report(result: PowerResult, out: Path) -> None:
    """The power report: JSON (schema dsadapt.power-report/1), its Markdown twin and its plot, each whole."""
    from patcher.base.fsutil import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    try:
        from patcher.rules.plots import plot_power

        plot_power(result, png)
        result.plot_path = str(png)
    except ImportError:  # matplotlib is optional
        png.unlink(missing_ok=True)
        result.plot_path = None
    atomic_write_text(out, json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    atomic_write_text(out.with_suffix(".md"), markdown(result))


def default_command(req: PowerRequest) -> str:
    """The power command line of a request (for provenance when the caller gives none)."""
    parts = ["dsadapt", "power", str(req.pin), "--model", req.model, "--dtype", req.dtype]
    for f in req.families:
        parts += ["--family", f]
    for ph in req.phases:
        parts += ["--phase", ph]
    return " ".join(shlex.quote(p) for p in parts)

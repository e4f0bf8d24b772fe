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
from patcher.checkpoints.model_dir import open_checkpoint, run_time_limit
from patcher.engines.base import GateRun, GateSession
from patcher.engines.registry import engine
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef
from patcher.gate import bisect
from patcher.gate.equivalence import (
    ENGINE_TOP_K,
    MAX_TOKENS,
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
        done.parent.mkdir(parents=True, exist_ok=True)
        done.unlink(missing_ok=True)
        try:
            assert self.proc.proc.stdin is not None
            self.proc.proc.stdin.write((json.dumps({**job, "done": str(done)}) + "\n").encode())
            self.proc.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        return done

    def wait(self, done: Path, timeout_s: float = JOB_TIMEOUT_S) -> dict:
        """The job's answer ({"ok", "error", "seconds"}) once its done file is there."""
        from patcher.base.procs import log_tail

        limit = timeout_s + (self.start_s if self.answered == 0 else 0.0)
        end = time.monotonic() + limit
        while not done.exists():
            if not self.proc.alive():
                raise self._died()
            if time.monotonic() > end:
                raise PowerError(f"the {self.proc.name} took more than {limit:.0f} s for one perturbation setting",
                                 hint=f"log: {self.log}")
            time.sleep(0.05)
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


def run_power(plan: PowerPlan, dtype: str, *, host: RunHost | None = None,
              on_line: Callable[[str], None] | None = None) -> P.PowerResult:
    """The power run of one planned pin and model in one of the plan's dtypes (see the module doc).
    `host`: one `RunHost` shared by the runs of one command (several dtypes), so the engine is built
    and installed once; it carries the progress."""
    t_start = time.monotonic()
    cfg, lock = plan.check.cfg, plan.check.lock
    host = host or RunHost(cfg, lock)
    progress = host.progress
    say = progress or (lambda _m: None)
    req = replace(plan.req, dtype=dtype)
    command = req.command or default_command(req)
    loadavg_start = _loadavg()
    entry, spec, eng, table = plan.check.entry, plan.check.spec, plan.check.eng, plan.table
    if plan.check.model.checkpoint is None:  # a built-in model: made here (once; later runs find it)
        model_dir, label, style = resolve_model(cfg, req.model, req.config_style, progress,
                                                default_style=eng.model_config_style)
        ckpt = open_checkpoint(model_dir)
    else:  # a folder as the plan opened it
        ckpt = plan.check.model.checkpoint
        model_dir, label, style = ckpt.path.resolve(), ckpt.path.name, req.config_style
    config = ckpt.config
    cells = plan_cells(req, config, table, eng.name, label)
    fp = fingerprint(ckpt, cfg.cache, progress).sha256
    out = report_paths(cfg, req.pin, label, style, req.dtype, req.unpatched, kind="power",
                       prompt_seed=req.prompt_seed)
    work = cfg.workdir / "runs" / out.relative_to(cfg.reports_root).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    timings: dict = {}
    prompts = build_prompt_set(model_dir, MAX_TOKENS, seed=req.prompt_seed)
    prompts_path = write_prompts_json(prompts, work / "prompts.json")
    prompts_doc = json.loads(prompts_path.read_text())
    prompt_ids = [p.id for p in prompts]
    device = plan.check.reference_device
    t0 = time.monotonic()
    reference = run_reference(cfg, model_dir, fp, prompts_path, prompts_doc, progress, on_line, device, checkpoint=ckpt)
    noise = None
    if req.dtype in LOW_PRECISION_DTYPES:
        noise = run_reference(cfg, model_dir, fp, prompts_path, prompts_doc, progress, on_line, device,
                              dtype=req.dtype, checkpoint=ckpt)
    timings["reference_s"] = round(time.monotonic() - t0, 2)
    ref_capture_s = [0.0]

    def capture_reference(sequences: dict[str, list[int]]) -> dict[str, dict]:
        t = time.monotonic()
        say(f"power: HF reference capture of {len(sequences)} new token sequence(s)")
        docs = bisect.reference_capture(cfg, model_dir, fp, {"sequences": sequences}, req.dtype, work / "reference",
                                        lambda: reference_python(cfg, progress), progress, on_line, device=device)
        ref_capture_s[0] += time.monotonic() - t
        return docs

    refs = ReferenceCaptures(capture_reference, work / "reference" / "chunks")
    judge = Judge(reference, noise, config, req.dtype, eng.name, table, refs)
    gate = GateRun(entry, spec, req.dtype, model_dir, unpatched=req.unpatched)
    jobs_dir = work / "settings"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    for old in jobs_dir.iterdir():
        old.unlink()
    n_settings = 0
    control: dict = {}
    hooks: dict = {}
    installed: dict = {}
    engine_info: dict = {}
    with ExitStack() as stack:
        stack.callback(refs.close)
        t0 = time.monotonic()
        session = stack.enter_context(eng.bisect_session(gate, host) or eng.gate_session(gate, host))
        installed = dict(session.installed)
        timings["install_s"] = round(time.monotonic() - t0, 2)
        if not session.runner.power:
            raise EngineUnavailable(f"{req.pin} ({spec.name}): its {session.runner.name} runner cannot plant "
                                    "perturbations", hint="see docs/equivalence.md (Power) for the engines that can")
        spec_path = bisect.write_spec(table, config, req.dtype, work / f"{table.name}-capture-spec.json")
        from patcher.runners.launch import kit_pythonpath

        argv = session.runner.argv(session.python, model_dir, prompts_path, req.dtype, ENGINE_TOP_K, MAX_TOKENS,
                                   work / "power-engine.json", fp) + \
            ["--power-jobs", "--capture-spec", str(spec_path), "--capture-decode-steps", str(CAPTURE_DECODE_STEPS)]
        env = {**os.environ, **session.runner.env, **session.env}
        env["PYTHONPATH"] = kit_pythonpath(env)
        say(f"power: {req.pin} ({spec.name}) {req.dtype} via {session.runner.name} runner: {len(cells)} cells, "
            f"one engine start")
        runner = PowerRunner(session, argv, env, work, run_time_limit(ckpt))
        stack.callback(runner.stop)
        t_engine = time.monotonic()

        def submit(sid: str, plan: list[dict], capture: bool) -> tuple[str, Path, Path, Path | None]:
            nonlocal n_settings
            n_settings += 1
            report_path = jobs_dir / f"{sid}.json"
            cap = jobs_dir / f"{sid}.capture.pt" if capture else None
            # in low precision the logits are judged on the prompt's positions only (generation is
            # reported, never judged): one greedy token is enough there, the capture pass decodes
            done = runner.submit({"setting": {"id": sid, "perturb": plan}, "report": str(report_path),
                                  "capture": str(cap) if cap else None, "max_tokens": 1 if judge.modules else None})
            return sid, done, report_path, cap

        def finish(job) -> LogitReport:
            sid, done, report_path, _cap = job
            answer = runner.wait(done)
            report = _load_report(report_path, prompt_ids, req.dtype)
            report.timings["job_s"] = float(answer.get("seconds") or 0.0)
            return report

        # round 0: no hooks, the control, and every cell's first eps, queued together
        baseline_job = submit("baseline", [], capture=False)
        control_job = submit("control", P.control_plan(cells, req.kind), capture=judge.modules)
        queued = []
        for i, cell in enumerate(cells):
            for first in P.first_eps(req.search, req.grid):
                queued.append((cell, first, submit(f"c{i}-{first:g}", [P.plan_item(cell, req.kind, first)],
                                                   judge.modules)))
        baseline = finish(baseline_job)
        venv = installed.get("venv")
        if venv and (baseline.engine_path or "").startswith("/") and \
                not str(Path(baseline.engine_path or "").resolve()).startswith(str(Path(venv).resolve())):
            raise DsadaptError(f"{req.pin}: the engine imported {baseline.engine_path}, not the package in {venv}",
                               hint="something on PYTHONPATH shadows the pin's environment; unset it")
        engine_info = {"engine_version": baseline.engine_version, "engine_path": baseline.engine_path,
                       "engine_start_s": baseline.timings.get("engine_start_s", baseline.timings.get("load_s")),
                       # the first job's wait: the runner's start (imports, engine, first forward)
                       "first_job_s": round(time.monotonic() - t_engine, 2)}
        control_report = finish(control_job)
        diff = P.logit_difference(baseline.to_json(), control_report.to_json())
        hooks = {"max_abs": diff, "identical": diff == 0.0, "words": P.hooks_words(diff)}
        control_doc = judge.capture_of(control_job[3])
        if control_doc is not None:
            judge.refs.add(judge.refs.unknown(control_doc["sequences"]))
        c = judge(control_report, control_doc)
        del control_doc
        _cleanup(control_job)
        control = {"passed": not c.flagged, "reasons": c.reasons, "margins": c.margins.to_json(), "by": c.by,
                   "setting_s": control_report.timings.get("setting_s"),
                   "capture_s": control_report.timings.get("capture_s")}
        say(f"power: control (every hook at eps 0) {'passes' if not c.flagged else 'FAILS'} the gate"
            + (f" ({c.margins.words})" if c.margins.words else "")
            + f"; hooks: {hooks['words']}")
        if c.flagged:
            queued = []  # power is not measured against an engine that fails without a perturbation
        while queued:
            t_round = time.monotonic()
            _round(queued, finish, judge, say)
            per_run = (time.monotonic() - t_round) / len(queued)
            steps: list[tuple[int, P.Cell, float]] = []
            for i, cell in enumerate(cells):
                eps = P.next_eps(cell, req.search)
                if eps is not None:
                    steps.append((i, cell, eps))
            if req.time_limit is not None and steps and \
                    time.monotonic() - t_start + per_run * len(steps) > req.time_limit:
                say(f"power: {len(steps)} cell(s) cut short: another round of about {per_run * len(steps):.0f} s "
                    f"would end past --time-limit {req.time_limit:g} s")
                for _i, cell, _eps in steps:
                    cell.status = "cut short"
                steps = []
            queued = [(cell, eps, submit(f"c{i}-{eps:g}", [P.plan_item(cell, req.kind, eps)], judge.modules))
                      for i, cell, eps in steps]
        timings["engine_s"] = round(time.monotonic() - t_engine, 2)
    if not control.get("passed"):
        for cell in cells:
            cell.status = "not measured"
    timings["reference_capture_s"] = round(ref_capture_s[0], 2)
    timings["reference_captures"] = judge.refs.runs
    timings.update({k: v for k, v in engine_info.items() if k.endswith("_s")})
    reasons = P.verdict(cells, control.get("passed", False), control.get("reasons") or [], req.require)
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    result = P.PowerResult(
        pin=str(req.pin), engine=req.pin.engine, variant=spec.name, model=label, config_style=style, dtype=req.dtype,
        unpatched=req.unpatched, kind=req.kind,
        search={**asdict(req.search), "grid": req.grid, "time_limit": req.time_limit}, cells=cells, control=control, hooks=hooks,
        passed=not reasons, reasons=reasons, require=req.require, runner=getattr(session.runner, "name", ""),
        settings=n_settings, timings=timings,
        provenance={"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device_description(),
                    "loadavg": loadavg_start, "loadavg_end": _loadavg(), "command": command, "installed": installed,
                    "engine_version": engine_info.get("engine_version"), "engine_path": engine_info.get("engine_path"),
                    "model_fingerprint": fp, "model_dir": str(model_dir), "prompt_seed": req.prompt_seed,
                    "reference_versions": reference.versions, "reference_device": device,
                    "patches": [] if req.unpatched else [e.name for e in plan.check.stack.entries]},
        report_path=str(out))
    write_report(result, out)
    return result


def _round(queued: list, finish, judge: Judge, say) -> None:
    """Judge one round's runs as they come back, in the order queued; in low precision a run whose
    token sequences the reference has not captured yet waits for the end of the round, when one
    reference run captures them all."""
    waiting = []
    for cell, eps, job in queued:
        report = finish(job)
        rows, change, why = _planted(cell, report)
        if rows == 0:
            _add(cell, P.Trial(eps, None, reason=why, setting=job[0], seconds=report.timings.get("job_s")), say)
            _cleanup(job)
            continue
        doc = judge.capture_of(job[3])
        if doc is not None and judge.refs.unknown(doc["sequences"]):
            waiting.append((cell, eps, job, report, rows, change, doc["sequences"]))
            continue
        _add(cell, _judged(judge, cell, eps, report, doc, rows, change, job[0]), say)
        del doc
        _cleanup(job)
    if waiting:
        judge.refs.add([s for *_, seqs in waiting for s in judge.refs.unknown(seqs)])
    for cell, eps, job, report, rows, change, _seqs in waiting:
        _add(cell, _judged(judge, cell, eps, report, judge.capture_of(job[3]), rows, change, job[0]), say)
        _cleanup(job)


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


def _cleanup(job) -> None:
    """A judged run's files go (a capture is tens of megabytes; the trial keeps what matters)."""
    _sid, done, report_path, cap = job
    for p in (done, report_path, cap):
        if p is not None:
            Path(p).unlink(missing_ok=True)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_report(result: P.PowerResult, out: Path) -> None:
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
    atomic_write_text(out.with_suffix(".md"), P.markdown(result))


def default_command(req: PowerRequest) -> str:
    """The power command line of a request (for provenance when the caller gives none)."""
    parts = ["dsadapt", "power", str(req.pin), "--model", req.model, "--dtype", req.dtype]
    for f in req.families:
        parts += ["--family", f]
    for ph in req.phases:
        parts += ["--phase", ph]
    return " ".join(shlex.quote(p) for p in parts)

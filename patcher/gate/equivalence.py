"""dsadapt check: orchestration of the logit-equivalence gate.

reference (HF transformers, float32, its own pinned environment) and engine (the patched pin,
in its own venv, or the pristine release with --unpatched) run the same prompt set as
token ids; `equivalence.compare` applies the rule; the report (JSON) and a plot (PNG) are
written under reports/<engine>/<tag>/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import BuildError, DsadaptError, EngineRunFailed, EngineUnavailable, UsageError
from patcher.base.machine import device_description, gpu_info
from patcher.checkpoints.fingerprint import fingerprint
from patcher.checkpoints.model_dir import Checkpoint, open_checkpoint, reference_slot, run_time_limit
from patcher.engines.base import SINGLE, Engine, GateRun, Parallel, VariantSpec
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack
from patcher.gate import bisect
from patcher.gate.hosts import RunHost
from patcher.gate.plan import CheckPlan, CheckRequest
from patcher.gate.report import (  # noqa: F401 - current_rule and rule_drift: this module's public names too
    current_rule,
    inputs_path,
    load_inputs,
    rejudge,
    rule_drift,
    save_inputs,
)
from patcher.gate.result import REPORT_SCHEMA, CheckResult, verdict_reasons, write_report
from patcher.rules.divergence import ModuleVerdict
from patcher.rules.logits import (
    LOW_PRECISION_DTYPES,
    REFERENCE_TRANSFORMERS,
    Comparison,
    LogitReport,
    compare,
    explain,
)
from patcher.rules.modules import CaptureTable
from patcher.rules.prompts import build_prompt_set, rope_original_max, write_prompts_json
from patcher.rules.verdicts import check_margins
from patcher.runners.launch import REFERENCE_RUNNER, REFERENCE_TOP_K, RunnerJob, run_runner

ENGINE_TOP_K = 5
MAX_TOKENS = 16
CONFIG_STYLES = ("transformers", "deepseek")


# ---------------------------------------------------------------- inputs


def resolve_model(cfg: Config, model: str, config_style: str | None, progress=None,
                  default_style: str = "transformers") -> tuple[Path, str, str | None]:
    """(model dir, label, config style) for a built-in variant name (made in `config_style`, else
    `default_style`: the engine's) or a directory (whose style is whatever the caller states)."""
    from patcher.checkpoints import tiny

    if model in tiny.VARIANTS:
        style = config_style or default_style
        if style not in tiny.CONFIG_STYLES:
            raise UsageError(f"unknown config style {style!r}", hint=f"one of {', '.join(tiny.CONFIG_STYLES)}")
        out = cfg.workdir / "models" / f"{model}-{style}-seed0"
        if not tiny.is_current(out):  # absent, or made by other code (an earlier dsadapt): made now
            if progress:
                progress(f"making the built-in {model} model ({style} config) in {out}")
            tiny.make_model(out, variant=model, config_style=style, seed=0)
        return out, model, style
    d = Path(model)
    if not (d / "config.json").is_file():
        raise UsageError(f"--model {model}: neither a built-in model (v3, v2-lite, v2) nor a directory with config.json",
                         hint="use --model v3, --model v2-lite, --model v2, or a local HF model directory")
    open_checkpoint(d)  # a checkpoint as released, its tensors matching its config (exit 2 otherwise)
    return d.resolve(), d.name, config_style


def model_fingerprint(d: Path, cache: Path | None = None, progress=None) -> str:
    """sha256 of the checkpoint's files (`patcher.checkpoints.fingerprint`: a sharded checkpoint by
    its config, index and shards, each file's digest cached by size and mtime under `cache`)."""
    return fingerprint(open_checkpoint(d, check_layout=False), cache, progress).sha256


# ---------------------------------------------------------------- environments


def reference_python(cfg: Config, progress=None) -> Path:
    """An interpreter with exactly REFERENCE_TRANSFORMERS: dsadapt's own when it matches, else a venv."""
    try:
        if importlib.metadata.version("transformers") == REFERENCE_TRANSFORMERS:
            return Path(sys.executable)
    except importlib.metadata.PackageNotFoundError:
        pass
    from patcher.artifacts.envlocks import file_digest, find_lock, reference_spec
    from patcher.artifacts.venvs import install_lock

    lock_file = find_lock(reference_spec().name)
    digest = file_digest(lock_file)
    venv = cfg.venvs_root / f"reference-transformers-{REFERENCE_TRANSFORMERS}"
    py = venv / "bin" / "python"
    ok = venv / "dsadapt-reference.ok"
    if not ok.exists() or ok.read_text().strip() != digest:
        if venv.exists():
            shutil.rmtree(venv)  # made from an older lock (or half made): derived data, remade below
        if progress:
            progress(f"creating the reference environment {venv} (transformers=={REFERENCE_TRANSFORMERS}, "
                     f"{lock_file.name}, --require-hashes)")
        r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"could not create {venv}: {r.stderr.strip()[-200:]}",
                             hint="check python3-venv is installed")
        install_lock(py, venv, lock_file, stream=False, progress=progress)
        ok.write_text(digest + "\n")
    return py


# ---------------------------------------------------------------- provenance


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- the check


def run_reference(cfg: Config, model_dir: Path, fingerprint: str, prompts_path: Path, prompts_doc: dict,
                  progress=None, on_line=None, device: str = "cpu", dtype: str = "float32",
                  checkpoint: Checkpoint | None = None) -> LogitReport:
    """The HF reference, cached by (model, prompts, settings, transformers, runner script, device,
    dtype): float32 (the truth, with greedy generation), or in a low-precision dtype the noise
    yardstick of an engine in that dtype (teacher-forced prompt positions only; for fp8, HF's own
    FP8 arithmetic on the dequantized weights). Before it runs: whether it fits the memory of
    `device` (exit 6 with the numbers, never an OOM kill)."""
    spec = dataclasses.replace(REFERENCE_RUNNER, extra_args=("--device", device))
    max_tokens = MAX_TOKENS if dtype == "float32" else 0
    key = _hash_json({"model": fingerprint, "prompts": prompts_doc, "top_k": REFERENCE_TOP_K, "max_tokens": max_tokens,
                      "transformers": REFERENCE_TRANSFORMERS, "runner": hashlib.sha256(spec.script.read_bytes()).hexdigest(),
                      "device": device, **({"dtype": dtype} if dtype != "float32" else {})})
    cached = cfg.cache / "reference" / f"{key}.json"
    if cached.is_file():
        if progress:
            progress(f"reference: reusing cached HF transformers {dtype} report")
        return LogitReport.load(cached)
    ckpt = checkpoint or open_checkpoint(model_dir, check_layout=False)
    with reference_slot(ckpt, device, cfg.cache / "locks", progress):  # the memory check comes first
        if cached.is_file():  # made meanwhile by the check this one waited for
            return LogitReport.load(cached)
        py = reference_python(cfg, progress)
        if progress:
            progress(f"reference: HF transformers {REFERENCE_TRANSFORMERS} {dtype} on {device.upper()}"
                     + ("" if dtype == "float32" else " (the engine's noise yardstick)")
                     + (" (block-FP8 weights dequantized)" if (checkpoint and checkpoint.fp8) else ""))
        return run_runner(spec, py, RunnerJob(model_dir, prompts_path, dtype, REFERENCE_TOP_K, max_tokens, cached,
                                              fingerprint), on_line=on_line,
                          timeout=run_time_limit(checkpoint) if checkpoint else 900.0)


def report_paths(cfg: Config, ref: PinRef, label: str, style: str | None, dtype: str, unpatched: bool,
                 unpatched_engine: bool = False, kind: str | None = None, parallel: Parallel = SINGLE,
                 prompt_seed: int = 0) -> Path:
    """Where a gate's report goes:
    reports/<engine>/<tag>/[<kind>-]<model>-<style>-<dtype>[-tp<N>[-ep]][-seed<N>][-unpatched].json.

    `kind` names another gate's report (``perf``, ``perf-aa``) next to the check reports; a
    parallel configuration other than one process names its own (``-tp2``, ``-tp2-ep``), so a TP 2
    report never replaces the TP 1 one; a seeded prompt set likewise (``-seed3``)."""
    name = "-".join(x for x in (kind, label, style, dtype, None if parallel.single else parallel.label,
                                f"seed{prompt_seed}" if prompt_seed else None,
                                "unpatched" if unpatched else None,
                                "unpatched-engine" if unpatched_engine else None) if x)
    return cfg.reports_root / ref.engine / ref.tag / f"{name}.json"


@dataclass
class _Run:
    """What one run of a plan (one dtype) has resolved before the engine runs (shared by the
    verdict, the bisect and the failure report)."""

    plan: CheckPlan
    req: CheckRequest          # the plan's request, in this run's dtype
    dtype: str
    model_dir: Path
    label: str
    style: str | None
    fingerprint: str
    checkpoint: Checkpoint
    model_files: dict
    out: Path
    work: Path
    gate: GateRun
    host: RunHost
    on_line: Callable[[str], None] | None
    t_start: float
    timings: dict = field(default_factory=dict)
    cfg: Config = field(init=False)
    spec: VariantSpec = field(init=False)
    eng: Engine = field(init=False)
    stack: Stack = field(init=False)
    config: dict = field(init=False)
    progress: Callable[[str], None] | None = field(init=False)

    def __post_init__(self) -> None:
        # what the plan resolved, named as the steps of a run read it
        self.cfg, self.spec, self.eng, self.stack = self.plan.cfg, self.plan.spec, self.plan.eng, self.plan.stack
        self.config, self.progress = self.checkpoint.config, self.host.progress

    def job(self, prompts: Path, report: str) -> RunnerJob:
        """The engine runner's job in this run: its report `report` in the run's work dir."""
        return RunnerJob(self.model_dir, prompts, self.dtype, ENGINE_TOP_K, MAX_TOKENS, self.work / report,
                         self.fingerprint)

    @property
    def title(self) -> str:
        """The plots' title: the pin and its configuration, one space apart (`plots.title_of`)."""
        from patcher.rules.plots import title_of

        return title_of(str(self.req.pin), {
            "variant": self.spec.name, "model": self.label, "config_style": self.style, "dtype": self.dtype,
            "parallel": self.req.parallel.to_json(), "unpatched": self.req.unpatched,
            "provenance": {"unpatched_engine": self.req.unpatched_engine, "prompt_seed": self.req.prompt_seed}})

    def provenance(self, installed: dict) -> dict:
        """What every check report records about where and how it ran."""
        return {
            "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": device_description(),
            "command": self.req.command or self.req.default_command(self.style),
            "stack_hash": None if self.req.unpatched else self.stack.hash,
            "unpatched_engine": self.req.unpatched_engine,
            "patches": [] if self.req.unpatched else [e.name for e in self.stack.entries],
            "installed": installed,
            "gpu": gpu_info(),
            "model_fingerprint": self.fingerprint, "model_dir": str(self.model_dir),
            "checkpoint": self.checkpoint.summary(), "model_files": self.model_files,
            "parallel": self.req.parallel.to_json(),
            "prompt_seed": self.req.prompt_seed,
            "dsadapt": _dsadapt_version(),
        }

    def result(self, verdict: str, reasons: list[str], explanation: list[str], provenance: dict,
               comparison: Comparison | None, bisected: ModuleVerdict | None = None,
               no_logits: str | None = None) -> CheckResult:
        self.timings["total_s"] = round(time.monotonic() - self.t_start, 2)
        return CheckResult(
            pin=str(self.req.pin), engine=self.req.pin.engine, variant=self.spec.name, model=self.label,
            config_style=self.style, dtype=self.dtype, unpatched=self.req.unpatched, verdict=verdict,
            reasons=reasons, explanation=explanation, report_path=str(self.out), plot_path=None,
            provenance=provenance, timings=self.timings, comparison=comparison, bisect=bisected, no_logits=no_logits,
            parallel=self.req.parallel.to_json())


def _prepare(plan: CheckPlan, dtype: str, host: RunHost, on_line) -> _Run:
    """The run's model (a built-in one made here; a folder as the plan opened it), its fingerprint,
    report and work paths: nothing the plan checked is asked again."""
    t_start = time.monotonic()
    req, cfg, progress = plan.request(dtype), plan.cfg, host.progress
    if plan.model.checkpoint is None:
        model_dir, label, style = resolve_model(cfg, req.model, req.config_style, progress,
                                                default_style=plan.eng.model_config_style)
        ckpt = open_checkpoint(model_dir)
    else:
        ckpt = plan.model.checkpoint
        model_dir, label, style = ckpt.path.resolve(), ckpt.path.name, req.config_style
    fp = fingerprint(ckpt, cfg.cache, progress)
    out = report_paths(cfg, req.pin, label, style, dtype, req.unpatched, req.unpatched_engine,
                       parallel=req.parallel, prompt_seed=req.prompt_seed)
    work = cfg.workdir / "runs" / out.relative_to(cfg.reports_root).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    gate = GateRun(plan.entry, plan.spec, dtype, model_dir, unpatched=req.unpatched,
                   unpatched_engine=req.unpatched_engine, tp=req.tp, ep=req.ep)
    return _Run(plan=plan, req=req, dtype=dtype, model_dir=model_dir, label=label, style=style, fingerprint=fp.sha256,
                checkpoint=ckpt, model_files=fp.files, out=out, work=work, gate=gate, host=host, on_line=on_line,
                t_start=t_start)


def run_check(plan: CheckPlan, dtype: str, *, host: RunHost | None = None,
              on_line: Callable[[str], None] | None = None) -> CheckResult:
    """The gate for one planned pin in one of the plan's dtypes. `req.bisect` ("on-fail" or
    "always", see `patcher.gate.bisect`) adds the per-module comparison; low-precision checks
    always run it (part of their verdict). `host`: one `RunHost` shared by the runs of one command
    (several dtypes), so the engine is built and installed once; it carries the progress."""
    r = _prepare(plan, dtype, host or RunHost(plan.cfg, plan.lock), on_line)
    prompts = write_prompts_json(build_prompt_set(r.model_dir, MAX_TOKENS, seed=r.req.prompt_seed),
                                 r.work / "prompts.json")
    reference, noise = _references(r, prompts)
    mode = bisect.wanted(dtype, r.req.bisect)
    table = bisect.table_for(r.eng) if mode else None
    # capture in the gate's own engine run (one engine start) unless the engine says where else
    inline_capture = table is not None and r.eng.bisect_session(r.gate, r.host) is None
    report, installed, failed = _run_engine(r, prompts, table if inline_capture else None)
    if failed is not None:  # the engine could not load or run the model: that is a verdict, not an accident
        return _engine_failed(r, failed, installed)
    assert report is not None
    _check_engine(r.req, report, installed)
    t0 = time.monotonic()
    comparison = compare(reference, report, ENGINE_TOP_K, noise=noise)
    r.timings["compare_s"] = round(time.monotonic() - t0, 3)
    bisected = None
    if mode == "always" or (mode == "on-fail" and not comparison.passed):
        t0 = time.monotonic()
        bisected = _bisect(r, table, inline_capture, engine_path=report.engine_path)
        r.timings["bisect_s"] = round(time.monotonic() - t0, 2)
        if bisected.routing_flips and comparison.rule == "low-precision":
            # the logits judged without the predictions that follow a routing flip (judge_logits)
            comparison = compare(reference, report, ENGINE_TOP_K, noise=noise, routing_flips=bisected.routing_flips)
    reasons = verdict_reasons(comparison.reasons, dtype, bisected)
    result = r.result("pass" if not reasons else "fail", reasons,
                      explain(comparison, r.config, bisected) if r.req.explain else [],
                      {**r.provenance(installed), **_run_provenance(r.eng, reference, report),
                       # YaRN's original context: the plot marks it, `check --rescore` draws it again from here
                       "original_max_position_embeddings": rope_original_max(r.config)}, comparison, bisected)
    result.margins = check_margins(comparison.to_json(), bisected.margin if bisected else None)
    r.out.parent.mkdir(parents=True, exist_ok=True)
    result.plot_path = _plot(r, comparison)
    save_inputs(r.out, reference, report, ENGINE_TOP_K, noise=noise)
    result.provenance["inputs"] = inputs_path(r.out).name
    write_report(result, r.out)
    return result


def _references(r: _Run, prompts: Path) -> tuple[LogitReport, LogitReport | None]:
    """The float32 reference and, for a low-precision engine, the reference's own run in its dtype
    (the yardstick of its rounding)."""
    t0 = time.monotonic()
    doc = json.loads(prompts.read_text())
    cfg, progress, device = r.cfg, r.progress, r.plan.reference_device
    reference = run_reference(cfg, r.model_dir, r.fingerprint, prompts, doc, progress, r.on_line, device,
                              checkpoint=r.checkpoint)
    noise = None
    if r.dtype in LOW_PRECISION_DTYPES:
        noise = run_reference(cfg, r.model_dir, r.fingerprint, prompts, doc, progress, r.on_line, device,
                              dtype=r.dtype, checkpoint=r.checkpoint)
    r.timings["reference_s"] = round(time.monotonic() - t0, 2)
    return reference, noise


def _run_engine(r: _Run, prompts: Path, capture: CaptureTable | None
                ) -> tuple[LogitReport | None, dict, EngineRunFailed | None]:
    """The engine's run in its gate session (with the capture hooks when `capture` names the
    table): (its report, what was installed, None), or (None, installed, the failure)."""
    t0 = time.monotonic()
    installed: dict = {}
    try:
        with r.eng.gate_session(r.gate, r.host) as session:
            installed = session.installed
            r.timings["install_s"] = round(time.monotonic() - t0, 2)
            runner = session.runner
            if capture is not None:
                runner = replace(runner, extra_args=runner.extra_args + bisect.capture_args(r.work, capture,
                                                                                                r.config, r.dtype))
            if r.progress:
                r.progress(f"engine: {r.req.pin} ({r.spec.name}{', unpatched' if r.req.unpatched else ''}) {r.dtype} "
                           f"via {runner.name} runner" + (" (with bisect capture)" if capture is not None else ""))
            t0 = time.monotonic()
            report = run_runner(runner, session.python, r.job(prompts, "engine.json"), env=session.env,
                                on_line=r.on_line, timeout=run_time_limit(r.checkpoint))
            r.timings["engine_s"] = round(time.monotonic() - t0, 2)
        if r.progress is not None and hasattr(r.progress, "end"):
            r.progress.end()  # its time is said before the verdict, not after it
    except EngineRunFailed as e:
        r.timings["engine_s"] = round(time.monotonic() - t0, 2)
        return None, installed, e
    for k, v in report.timings.items():
        r.timings[f"engine_{k}"] = v
    return report, installed, None


def _check_engine(req: CheckRequest, report: LogitReport, installed: dict) -> None:
    """The engine that ran is the pin's (its package from the pin's environment), in the parallel
    configuration asked for."""
    _check_parallel(req, report.settings)
    check_engine_path(req.pin, report.engine_path, installed)


def check_engine_path(pin: PinRef, engine_path: str | None, installed: dict) -> None:
    """The engine package a runner imported is the one in the pin's environment (`installed`)."""
    venv = installed.get("venv")
    engine_path = engine_path or ""
    if venv and engine_path.startswith("/") and \
            not str(Path(engine_path).resolve()).startswith(str(Path(venv).resolve())):
        raise DsadaptError(f"{pin}: the engine imported {engine_path}, not the package in {venv}",
                           hint="something on PYTHONPATH shadows the pin's environment; unset it")


def _run_provenance(eng: Engine, reference: LogitReport, report: LogitReport) -> dict:
    """What a check report records of the engine and the reference that ran."""
    ref_settings = reference.settings or {}
    return {
        "engine_version": report.engine_version, "engine_versions": report.versions,
        "engine_path": report.engine_path,
        "engine_settings": {k: v for k, v in (report.settings or {}).items() if k in eng.run_settings},
        "reference_versions": reference.versions,
        # HF transformers in float32 (hf_reference.py), on this machine's CPU or GPU (`reference_device`)
        "reference_device": ref_settings.get("device", "cpu"),
        "reference_settings": {k: v for k, v in ref_settings.items()
                               if k in ("device", "gpu", "cuda", "tf32", "threads", "attn", "experts")},
    }


def _plot(r: _Run, comparison: Comparison) -> str | None:
    """The per-position plot next to the report (None without matplotlib)."""
    png = r.out.with_suffix(".png")
    try:
        from patcher.rules.plots import plot_deltas

        plot_deltas(comparison, png, title=r.title, original_max=rope_original_max(r.config))
    except ImportError:  # matplotlib is optional
        return None
    return str(png)


def _check_parallel(req: CheckRequest, settings: dict | None) -> None:
    """The engine ran with the parallel configuration asked for, as its runner reports it
    (``settings.parallel``); a runner that says nothing ran in one process."""
    ran = (settings or {}).get("parallel") or {}
    got = Parallel(int(ran.get("tp") or 1), bool(ran.get("ep")))
    if got != req.parallel:
        raise DsadaptError(f"{req.pin}: asked for {req.parallel.describe()}, the engine's runner ran "
                           f"{got.describe()}", hint="the engine's runner ignores the parallel options: see its "
                                                     "page in docs/engines/")


# ---------------------------------------------------------------- rescoring


def rescore_check(path: Path) -> CheckResult:
    """Apply the current rule to a stored check report (`rejudge`): a new verdict, reasons, margins
    and plot, written back into the report (`provenance.rescored` says when, and what it was before)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--rescore {path}: not a readable JSON report ({e})", hint="name a check report (.json)") from None
    if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA:
        raise UsageError(f"--rescore {path}: not a check report (schema {doc.get('schema') if isinstance(doc, dict) else None!r})",
                         hint="name a report `dsadapt check` wrote (reports/<engine>/<tag>/<model>-<style>-<dtype>.json); "
                              "speed-gate reports: `dsadapt perf --rescore`")
    prov = doc.get("provenance") or {}
    cmd = prov.get("command") or "dsadapt check"
    if not (doc.get("comparison") or {}).get("rule"):
        raise UsageError(f"--rescore {path}: the engine produced no logits in that run: there is nothing to rescore",
                         hint=f"rerun `{cmd}`")
    if load_inputs(Path(path)) is None and (doc.get("comparison") or {}).get("rule") == "strict":
        raise UsageError(f"--rescore {path}: the report has no recorded inputs ({inputs_path(Path(path)).name}; it "
                         "predates them), so the float32 rule cannot be applied to it again",
                         hint=f"rerun `{cmd}` to score it under the current rule")
    now = rejudge(doc, Path(path))
    if now.verdict is None:
        raise UsageError(f"--rescore {path}: today's rule needs {', '.join(now.missing)}, which the report does not keep",
                         hint=f"rerun `{cmd}` to score it under the current rule")
    result = CheckResult.from_json(doc)
    result.provenance = {**prov, "rescored": {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                              "dsadapt": _dsadapt_version(), "previous_verdict": doc.get("verdict"),
                                              "previous_reasons": doc.get("reasons")}}
    if now.logits is not None:
        result.comparison = now.logits
    elif now.judged_comparison is not None:  # no recorded inputs: the stored rows judged again
        result.comparison = Comparison.from_json(now.judged_comparison)
    if now.bisect is not None:
        result.bisect = ModuleVerdict.from_json(now.bisect)
    result.reasons, result.verdict = now.reasons, now.verdict
    result.margins = check_margins(result.comparison.to_json() if result.comparison else {},
                                   result.bisect.margin if result.bisect else None)
    result.report_path = str(path)
    from patcher.checkpoints import tiny

    model_dir = prov.get("model_dir")
    config = None
    if model_dir and (Path(model_dir) / "config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            config = json.loads((Path(model_dir) / "config.json").read_text())
    elif result.model in tiny.VARIANTS:  # a built-in model: its config is known without its folder
        config = tiny.deepseek_config(result.model)
    if now.logits is not None and config is not None:
        result.explanation = explain(now.logits, config, result.bisect) if not result.passed else []
    if result.comparison is not None:
        try:
            from patcher.rules.plots import plot_deltas, title_of

            png = Path(path).with_suffix(".png")
            original = prov.get("original_max_position_embeddings", rope_original_max(config) if config else None)
            plot_deltas(result.comparison, png, title=title_of(result.pin, result.to_json(), rescored=True),
                        original_max=original)
            result.plot_path = str(png)
        except ImportError:  # matplotlib is optional
            pass
    write_report(result, Path(path))
    return result


def _bisect(r: _Run, table, inline_capture: bool, engine_path: str | None = None) -> ModuleVerdict:
    """The per-module comparison of this check: the engine's capture (taken in the gate's own
    engine run, or where the engine's `bisect_session` says), the reference's, the report next
    to the check report. Returns what the check keeps of it (the failure in `reasons` when it cannot run)."""
    from patcher.rules.modules import BisectError

    dtype, progress, on_line = r.dtype, r.progress, r.on_line

    def failed(why: str, passed: bool | None = False) -> ModuleVerdict:
        return ModuleVerdict.could_not_run(dtype, why, passed)

    if table is None:  # nothing to compare with: the gate's verdict stands alone
        return failed(f"{r.eng.name} has no capture table: it cannot be bisected", passed=None)
    try:
        import torch  # noqa: F401  (the comparison runs here, on the captures' tensors)
    except ImportError:
        return failed("bisect could not run: torch is not installed in dsadapt's environment "
                      "(pip install 'dsadapt[models]')")
    capture = r.work / bisect.ENGINE_CAPTURE
    try:
        if not inline_capture:
            elsewhere = r.eng.bisect_session(r.gate, r.host)
            assert elsewhere is not None  # inline_capture is False only when the engine names a session
            with elsewhere as session:
                runner = replace(session.runner, extra_args=session.runner.extra_args
                                 + bisect.capture_args(r.work, table, r.config, dtype))
                if progress:
                    progress(f"bisect: {r.req.pin} {dtype} via {runner.name} runner with capture")
                run_runner(runner, session.python, r.job(r.work / "prompts.json", "bisect-engine.json"),
                           env=session.env, on_line=on_line, timeout=run_time_limit(r.checkpoint))
        if not capture.is_file():
            report = r.work / ("engine.json" if inline_capture else "bisect-engine.json")
            why = (json.loads(report.read_text()).get("settings") or {}).get("capture_error") if report.is_file() else None
            raise BisectError(f"the engine run wrote no capture{': ' + why if why else ''}",
                              hint=f"see the runner's log next to {report}")
        engine_doc = bisect.load_capture(capture)
        ref_docs = bisect.reference_capture(r.cfg, r.checkpoint, r.fingerprint, engine_doc, dtype, r.work,
                                                lambda: reference_python(r.cfg, progress), progress, on_line,
                                                device=r.plan.reference_device)
        result = bisect.compare(engine_doc, ref_docs, r.config, dtype, r.req.pin.engine, table)
    except (BisectError, EngineRunFailed, EngineUnavailable) as e:
        return failed(f"bisect could not run: {e.message}")
    meta = {"pin": str(r.req.pin), "model": r.label, "config_style": r.style, "unpatched": r.req.unpatched,
            "engine_path": engine_path, "model_fingerprint": r.fingerprint,
            "reference_versions": ref_docs["float32"].get("meta", {}),
            "engine_capture": {k: engine_doc.get(k) for k in ("calls", "stray_calls", "missing", "dropped", "meta")},
            "parallel": r.req.parallel.to_json()}
    if engine_doc.get("ranks"):
        meta["engine_capture"]["ranks"] = [d.get("meta", {}).get("rank") for d in engine_doc["ranks"]]
    return bisect.write_report(result, r.out, meta, f"{r.title}: per-module error vs HF")


def _engine_failed(r: _Run, err: EngineRunFailed, installed: dict) -> CheckResult:
    log = str(getattr(err, "log_path", None) or "") or None
    provenance = {
        **r.provenance(installed),
        "engine_log": log,
        "engine_log_tail": getattr(err, "log_tail", None) or _tail_of(log),
        # the tail often holds only wrapper tracebacks; the first real error line of the whole log:
        "engine_root_cause": _root_cause(log),
    }
    result = r.result(
        "fail", [_failure_reason(err, log)],
        ["the engine did not produce logits: see the log tail in the report (a load failure "
         "usually means a config key or weight the engine does not understand)"],
        provenance, None, no_logits=err.message)
    r.out.parent.mkdir(parents=True, exist_ok=True)
    r.out.with_suffix(".png").unlink(missing_ok=True)
    inputs_path(r.out).unlink(missing_ok=True)  # an earlier run's inputs are not this run's
    write_report(result, r.out)
    return result


def _root_cause(log_path: str | None) -> str | None:
    from patcher.runners.launch import root_cause

    try:
        return root_cause(Path(log_path).read_text(errors="replace").splitlines()) if log_path else None
    except OSError:
        return None


def _failure_reason(err: DsadaptError, log_path: str | None) -> str:
    """One line: what failed, and the root cause from the engine's log where one is found."""
    first = err.message.splitlines()[0].rstrip(":; ").removesuffix("; log tail")
    cause = _root_cause(log_path)
    if cause and cause not in first:
        first += f" (root cause: {cause[:200]})"
    return f"the engine failed on this model: {first}"


def _tail_of(path, lines: int = 30) -> str | None:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) if path else None
    except OSError:
        return None


def _dsadapt_version() -> str:
    from patcher import __version__

    return __version__

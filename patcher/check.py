"""dsadapt check: orchestration of the logit-equivalence gate.

reference (HF transformers, float32, its own pinned environment) and engine (the patched pin,
in its own venv, or the pristine release with --unpatched) run the same prompt set as
token ids; `equivalence.compare` applies the rule; the report (JSON) and a plot (PNG) are
written under reports/<engine>/<tag>/.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import Config
from .engines import engine
from .engines.base import GateRun, VariantSpec
from .equivalence import REFERENCE_TRANSFORMERS, LogitReport, compare, explain
from .errors import BuildError, CheckFailed, DsadaptError, EngineRunFailed, EngineUnavailable, UsageError
from .hosts import RunHost
from .lock import Lock, LockEntry
from .machine import device_description
from .pinref import PinRef
from .prompts import build_prompt_set, write_prompts_json
from .runners import REFERENCE_RUNNER, REFERENCE_TOP_K, run_runner
from .stack import load_stack

ENGINE_TOP_K = 5
MAX_TOKENS = 16
CONFIG_STYLES = ("transformers", "deepseek")


@dataclass
class CheckResult:
    pin: str
    engine: str
    variant: str
    model: str
    config_style: str | None
    dtype: str
    unpatched: bool
    verdict: str
    reasons: list[str]
    explanation: list[str]
    report_path: str
    plot_path: str | None
    provenance: dict
    timings: dict
    comparison: dict = field(repr=False, default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- inputs


def resolve_model(cfg: Config, model: str, config_style: str | None, progress=None) -> tuple[Path, str, str | None]:
    """(model dir, label, config style) for a built-in variant name or a directory."""
    from . import tinymodel

    if model in tinymodel.VARIANTS:
        style = config_style or "transformers"
        if style not in tinymodel.CONFIG_STYLES:
            raise UsageError(f"unknown config style {style!r}", hint=f"one of {', '.join(tinymodel.CONFIG_STYLES)}")
        out = cfg.workdir / "models" / f"{model}-{style}-seed0"
        meta = out / "dsadapt.json"
        if not meta.is_file():
            if progress:
                progress(f"making the built-in {model} model ({style} config) in {out}")
            tinymodel.make_model(out, variant=model, config_style=style, seed=0)
        return out, model, style
    d = Path(model)
    if not (d / "config.json").is_file():
        raise UsageError(f"--model {model}: neither a built-in model (v3, v2-lite, v2) nor a directory with config.json",
                         hint="use --model v3, --model v2-lite, --model v2, or a local HF model directory")
    return d.resolve(), d.name, config_style


def model_fingerprint(d: Path) -> str:
    from .tinymodel import model_fingerprint as fp

    return fp(d)


# ---------------------------------------------------------------- environments


def reference_python(cfg: Config, progress=None) -> Path:
    """An interpreter with exactly REFERENCE_TRANSFORMERS: dsadapt's own when it matches, else a venv."""
    try:
        if importlib.metadata.version("transformers") == REFERENCE_TRANSFORMERS:
            return Path(sys.executable)
    except importlib.metadata.PackageNotFoundError:
        pass
    from .envlocks import file_digest, find_lock, reference_spec
    from .venvs import _pip

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
        _pip(py, "install", "--require-hashes", "--no-deps", "-r", str(lock_file), stream=False, progress=progress)
        ok.write_text(digest + "\n")
    return py


# ---------------------------------------------------------------- provenance


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- the check


def run_reference(cfg: Config, model_dir: Path, fingerprint: str, prompts_path: Path, prompts_doc: dict,
                  progress=None, on_line=None) -> LogitReport:
    """The HF float32 reference, cached by (model, prompts, settings, transformers, runner script)."""
    spec = REFERENCE_RUNNER
    key = _hash_json({"model": fingerprint, "prompts": prompts_doc, "top_k": REFERENCE_TOP_K, "max_tokens": MAX_TOKENS,
                      "transformers": REFERENCE_TRANSFORMERS, "runner": hashlib.sha256(spec.script.read_bytes()).hexdigest()})
    cached = cfg.cache / "reference" / f"{key}.json"
    if cached.is_file():
        if progress:
            progress("reference: reusing cached HF transformers report")
        return LogitReport.load(cached)
    py = reference_python(cfg, progress)
    if progress:
        progress(f"reference: HF transformers {REFERENCE_TRANSFORMERS} float32 on CPU")
    return run_runner(spec, py, model_dir, prompts_path, "float32", REFERENCE_TOP_K, MAX_TOKENS, cached,
                      fingerprint=fingerprint, on_line=on_line)


def report_paths(cfg: Config, ref: PinRef, label: str, style: str | None, dtype: str, unpatched: bool,
                 unpatched_engine: bool = False, kind: str | None = None) -> Path:
    """Where a gate's report goes: reports/<engine>/<tag>/[<kind>-]<model>-<style>-<dtype>[-unpatched].json.

    `kind` names another gate's report (``perf``, ``perf-aa``) next to the check reports."""
    name = "-".join(x for x in (kind, label, style, dtype, "unpatched" if unpatched else None,
                                "unpatched-engine" if unpatched_engine else None) if x)
    return cfg.reports_root / ref.engine / ref.tag / f"{name}.json"


def runnable(lock: Lock, ref: PinRef, variant: str | None, command: str) -> tuple[LockEntry, VariantSpec]:
    """The pin's entry and variant, or EngineUnavailable (exit 6) saying why it cannot run here
    and where `command` can (shared by check and perf)."""
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    spec = eng.variant_for(entry, variant)
    blocker = eng.run_blocker(entry, spec)
    if blocker:
        raise EngineUnavailable(f"{ref} ({spec.name}) cannot run on this machine: {blocker}",
                                hint=f"run `{command}` on a machine that has what it needs "
                                     f"({eng.docs_page or 'the engine docs'} says where it was verified)")
    return entry, spec


def preflight(lock: Lock, ref: PinRef, variant: str | None, command: str | None = None,
              dtype: str | None = None) -> tuple[LockEntry, VariantSpec]:
    """What `check` can tell before it touches anything: the pin, the variant, whether it can run
    here (exit 6), and whether its runner takes `dtype` (exit 2; checked after the machine, so a
    dtype a GPU-only engine supports is never reported as bad input on a machine without a GPU)."""
    entry, spec = runnable(lock, ref, variant, command or f"dsadapt check {ref}")
    eng = engine(ref.engine)
    if dtype is not None:
        dtypes = eng.gate_dtypes(spec)
        if dtype not in dtypes:
            raise UsageError(f"{ref} ({spec.name}) does not run in {dtype} for the gate",
                             hint=f"its runner supports {', '.join(dtypes)}: pass --dtype {dtypes[0]}"
                             if dtypes else f"see {eng.docs_page}")
    return entry, spec


def run_check(cfg: Config, lock: Lock, ref: PinRef, *, model: str = "v3", config_style: str | None = None,
              dtype: str = "float32", variant: str | None = None, unpatched: bool = False, want_explain: bool = True,
              progress: Callable[[str], None] | None = None, stream: bool = True, command: str | None = None,
              on_line=None, unpatched_engine: bool = False) -> CheckResult:
    t_start = time.monotonic()
    entry, spec = preflight(lock, ref, variant, command, dtype)
    eng = engine(ref.engine)
    stack = load_stack(cfg.patches_root, ref)
    model_dir, label, style = resolve_model(cfg, model, config_style, progress)
    fingerprint = model_fingerprint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    prompts = build_prompt_set(model_dir, MAX_TOKENS)
    out = report_paths(cfg, ref, label, style, dtype, unpatched, unpatched_engine)
    work = cfg.workdir / "runs" / out.relative_to(cfg.reports_root).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    prompts_path = write_prompts_json(prompts, work / "prompts.json")
    prompts_doc = json.loads(prompts_path.read_text())
    timings: dict = {}
    t0 = time.monotonic()
    reference = run_reference(cfg, model_dir, fingerprint, prompts_path, prompts_doc, progress, on_line)
    timings["reference_s"] = round(time.monotonic() - t0, 2)
    t0 = time.monotonic()
    installed: dict = {}
    run = GateRun(entry, spec, dtype, model_dir, unpatched=unpatched, unpatched_engine=unpatched_engine)
    try:
        with eng.gate_session(run, RunHost(cfg, lock, progress, stream)) as session:
            installed = session.installed
            timings["install_s"] = round(time.monotonic() - t0, 2)
            if progress:
                progress(f"engine: {ref} ({spec.name}{', unpatched' if unpatched else ''}) {dtype} via "
                         f"{session.runner.name} runner")
            t0 = time.monotonic()
            report = run_runner(session.runner, session.python, model_dir, prompts_path, dtype, ENGINE_TOP_K,
                                MAX_TOKENS, work / "engine.json", env=session.env, fingerprint=fingerprint,
                                on_line=on_line)
            timings["engine_s"] = round(time.monotonic() - t0, 2)
    except EngineRunFailed as e:
        # The engine could not load or run the model: that is a verdict, not an accident.
        timings["engine_s"] = round(time.monotonic() - t0, 2)
        return _engine_failed(cfg, ref, spec, label, style, dtype, unpatched, unpatched_engine, stack, out,
                              e, installed, fingerprint, model_dir, command, model, timings, t_start)
    venv = installed.get("venv")
    engine_path = report.engine_path or ""
    if venv and engine_path.startswith("/") and \
            not str(Path(engine_path).resolve()).startswith(str(Path(venv).resolve())):
        raise DsadaptError(f"{ref}: the engine imported {engine_path}, not the package in {venv}",
                           hint="something on PYTHONPATH shadows the pin's environment; unset it")
    for k, v in report.timings.items():
        timings[f"engine_{k}"] = v
    t0 = time.monotonic()
    comparison = compare(reference, report, ENGINE_TOP_K)
    explanation = explain(comparison, config) if want_explain else []
    timings["compare_s"] = round(time.monotonic() - t0, 3)
    verdict = "pass" if comparison.passed else "fail"
    provenance = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_description(),
        "command": command or f"dsadapt check {ref} --model {model}" + (f" --config-style {style}" if style else "")
                   + f" --dtype {dtype}" + (" --unpatched" if unpatched else ""),
        "stack_hash": None if unpatched else stack.hash,
        "unpatched_engine": unpatched_engine,
        "patches": [] if unpatched else [e.name for e in stack.entries],
        "installed": installed,
        "engine_version": report.engine_version, "engine_versions": report.versions,
        "engine_path": report.engine_path,
        "reference_versions": reference.versions,
        "model_fingerprint": fingerprint, "model_dir": str(model_dir),
        "dsadapt": _dsadapt_version(),
    }
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    result = CheckResult(
        pin=str(ref), engine=ref.engine, variant=spec.name, model=label, config_style=style, dtype=dtype,
        unpatched=unpatched, verdict=verdict, reasons=list(comparison.reasons), explanation=explanation,
        report_path=str(out), plot_path=None, provenance=provenance, timings=timings,
        comparison=comparison.to_json())
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from .plot import plot_deltas

        png = out.with_suffix(".png")
        from .prompts import rope_original_max

        plot_deltas(comparison, png, title=f"{ref} {label} {style or ''} {dtype}{' (unpatched)' if unpatched else ''}",
                    original_max=rope_original_max(config))
        result.plot_path = str(png)
    except ImportError:  # matplotlib is optional
        result.plot_path = None
    out.write_text(json.dumps({"schema": "dsadapt.check-report/1", **result.to_json()}, indent=2, sort_keys=True) + "\n")
    return result


def _engine_failed(cfg, ref, spec, label, style, dtype, unpatched, unpatched_engine, stack, out, err, installed,
                   fingerprint, model_dir, command, model, timings, t_start) -> CheckResult:
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    provenance = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_description(),
        "command": command or f"dsadapt check {ref} --model {model}",
        "stack_hash": None if unpatched else stack.hash, "unpatched_engine": unpatched_engine,
        "patches": [] if unpatched else [e.name for e in stack.entries], "installed": installed,
        "model_fingerprint": fingerprint, "model_dir": str(model_dir), "dsadapt": _dsadapt_version(),
        "engine_log": str(getattr(err, "log_path", None) or "") or None,
        "engine_log_tail": getattr(err, "log_tail", None) or _tail_of(getattr(err, "log_path", None)),
        # the tail often holds only wrapper tracebacks; the first real error line of the whole log:
        "engine_root_cause": _root_cause(str(getattr(err, "log_path", None) or "") or None),
    }
    result = CheckResult(
        pin=str(ref), engine=ref.engine, variant=spec.name, model=label, config_style=style, dtype=dtype,
        unpatched=unpatched, verdict="fail", reasons=[_failure_reason(err, provenance["engine_log"])],
        explanation=["the engine did not produce logits: see the log tail in the report (a load failure "
                     "usually means a config key or weight the engine does not understand)"],
        report_path=str(out), plot_path=None, provenance=provenance, timings=timings,
        comparison={"rule": None, "rows": [], "passed": False, "reasons": [err.message]})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".png").unlink(missing_ok=True)
    out.write_text(json.dumps({"schema": "dsadapt.check-report/1", **result.to_json()}, indent=2, sort_keys=True) + "\n")
    return result


def _root_cause(log_path: str | None) -> str | None:
    from .runners import root_cause

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
    from . import __version__

    return __version__


def check_or_raise(result: CheckResult) -> None:
    if not result.passed:
        raise CheckFailed(f"{result.pin} failed the equivalence gate: {'; '.join(result.reasons[:2])}",
                          hint=f"report: {result.report_path}" +
                               ("" if result.explanation and "--explain" in (result.provenance.get("command") or "")
                                else "; rerun with --explain for the likely layer family"))

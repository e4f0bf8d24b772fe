"""dsadapt check: orchestration of the logit-equivalence gate.

reference (HF transformers, float32, its own pinned environment) and engine (the patched pin,
in its own venv, or the pristine release with --unpatched) run the same prompt set as
token ids; `equivalence.compare` applies the rule; the report (JSON) and a plot (PNG) are
written under reports/<engine>/<tag>/.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import BuildError, CheckFailed, DsadaptError, EngineRunFailed, EngineUnavailable, UsageError
from patcher.base.machine import device_description, gpu_info
from patcher.engines import engine
from patcher.engines.base import GateRun, VariantSpec
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import load_stack
from patcher.gate import bisect as bisect_run
from patcher.gate.hosts import RunHost
from patcher.rules.logits import LOW_PRECISION_DTYPES, REFERENCE_TRANSFORMERS, LogitReport, compare, explain
from patcher.rules.prompts import build_prompt_set, write_prompts_json
from patcher.runners import REFERENCE_RUNNER, REFERENCE_TOP_K, run_runner

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
    #: the per-module comparison (`patcher.gate.bisect.summary`) when this check ran one
    bisect: dict | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- inputs


def resolve_model(cfg: Config, model: str, config_style: str | None, progress=None,
                  default_style: str = "transformers") -> tuple[Path, str, str | None]:
    """(model dir, label, config style) for a built-in variant name (made in `config_style`, else
    `default_style`: the engine's) or a directory (whose style is whatever the caller states)."""
    from patcher.checkpoints import tiny as tinymodel

    if model in tinymodel.VARIANTS:
        style = config_style or default_style
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
    from patcher.checkpoints.tiny import model_fingerprint as fp

    return fp(d)


# ---------------------------------------------------------------- environments


def reference_python(cfg: Config, progress=None) -> Path:
    """An interpreter with exactly REFERENCE_TRANSFORMERS: dsadapt's own when it matches, else a venv."""
    try:
        if importlib.metadata.version("transformers") == REFERENCE_TRANSFORMERS:
            return Path(sys.executable)
    except importlib.metadata.PackageNotFoundError:
        pass
    from patcher.build.envlocks import file_digest, find_lock, reference_spec
    from patcher.build.venvs import install_lock

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


REFERENCE_DEVICES = ("auto", "cpu", "cuda")


def reference_device(asked: str, spec: VariantSpec) -> str:
    """Where the float32 reference runs: `asked`, or for "auto" the GPU when the engine itself runs
    on CUDA and this machine has one (a big machine's CPU, shared with the engine, can be far
    slower than its GPU for the reference's many small forwards), else the CPU."""
    from patcher.engines.base import has_cuda

    if asked not in REFERENCE_DEVICES:
        raise UsageError(f"--reference-device {asked!r}", hint=f"one of {', '.join(REFERENCE_DEVICES)}")
    if asked == "cuda" and not has_cuda():
        raise EngineUnavailable("--reference-device cuda: no CUDA GPU on this machine",
                                hint="use --reference-device cpu (the default where there is no GPU)")
    if asked == "auto":
        return "cuda" if spec.device == "cuda" and has_cuda() else "cpu"
    return asked


def run_reference(cfg: Config, model_dir: Path, fingerprint: str, prompts_path: Path, prompts_doc: dict,
                  progress=None, on_line=None, device: str = "cpu") -> LogitReport:
    """The HF float32 reference, cached by (model, prompts, settings, transformers, runner script, device)."""
    spec = dataclasses.replace(REFERENCE_RUNNER, extra_args=("--device", device))
    key = _hash_json({"model": fingerprint, "prompts": prompts_doc, "top_k": REFERENCE_TOP_K, "max_tokens": MAX_TOKENS,
                      "transformers": REFERENCE_TRANSFORMERS, "runner": hashlib.sha256(spec.script.read_bytes()).hexdigest(),
                      "device": device})
    cached = cfg.cache / "reference" / f"{key}.json"
    if cached.is_file():
        if progress:
            progress("reference: reusing cached HF transformers report")
        return LogitReport.load(cached)
    py = reference_python(cfg, progress)
    if progress:
        progress(f"reference: HF transformers {REFERENCE_TRANSFORMERS} float32 on {device.upper()}")
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


def check_dtypes(lock: Lock, ref: PinRef, variant: str | None = None) -> tuple[str, ...]:
    """Every dtype the engine's gate runner serves for this pin (float32 first where it has it,
    then bfloat16, float16): what `check` runs without --dtype."""
    entry = lock.pin(ref)
    eng = engine(entry.engine)
    served = eng.gate_dtypes(eng.variant_for(entry, variant))
    return tuple(d for d in ("float32", "bfloat16", "float16") if d in served) or tuple(served[:1])


def run_check(cfg: Config, lock: Lock, ref: PinRef, *, model: str = "v3", config_style: str | None = None,
              dtype: str = "float32", variant: str | None = None, unpatched: bool = False, want_explain: bool = True,
              progress: Callable[[str], None] | None = None, stream: bool = True, command: str | None = None,
              on_line=None, unpatched_engine: bool = False, reference_on: str = "auto",
              bisect: str | None = None, host: RunHost | None = None) -> CheckResult:
    """The gate for one pin and dtype. `bisect` ("on-fail" or "always", see `patcher.gate.bisect`)
    adds the per-module comparison; low-precision checks always run it (part of their verdict).
    `host`: one `RunHost` shared by the runs of one command (several dtypes), so the engine is
    built and installed once."""
    t_start = time.monotonic()
    entry, spec = preflight(lock, ref, variant, command, dtype)
    ref_device = reference_device(reference_on, spec)
    eng = engine(ref.engine)
    stack = load_stack(cfg.patches_root, ref)
    model_dir, label, style = resolve_model(cfg, model, config_style, progress, default_style=eng.model_config_style)
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
    reference = run_reference(cfg, model_dir, fingerprint, prompts_path, prompts_doc, progress, on_line, ref_device)
    timings["reference_s"] = round(time.monotonic() - t0, 2)
    t0 = time.monotonic()
    installed: dict = {}
    run = GateRun(entry, spec, dtype, model_dir, unpatched=unpatched, unpatched_engine=unpatched_engine)
    host = host or RunHost(cfg, lock, progress, stream)
    bisect_mode = bisect_run.wanted(dtype, bisect)
    table = bisect_run.table_for(eng) if bisect_mode else None
    # capture in the gate's own engine run (one engine start) unless the engine says where else
    inline_capture = table is not None and eng.bisect_session(run, host) is None
    try:
        with eng.gate_session(run, host) as session:
            installed = session.installed
            timings["install_s"] = round(time.monotonic() - t0, 2)
            runner = session.runner
            if inline_capture and table is not None:
                runner = replace(runner, extra_args=runner.extra_args + bisect_run.capture_args(work, table, config, dtype))
            if progress:
                progress(f"engine: {ref} ({spec.name}{', unpatched' if unpatched else ''}) {dtype} via "
                         f"{runner.name} runner" + (" (with bisect capture)" if inline_capture else ""))
            t0 = time.monotonic()
            report = run_runner(runner, session.python, model_dir, prompts_path, dtype, ENGINE_TOP_K,
                                MAX_TOKENS, work / "engine.json", env=session.env, fingerprint=fingerprint,
                                on_line=on_line)
            timings["engine_s"] = round(time.monotonic() - t0, 2)
        if progress is not None and hasattr(progress, "end"):
            progress.end()  # its time is said before the verdict, not after it
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
    timings["compare_s"] = round(time.monotonic() - t0, 3)
    bisected = None
    if bisect_mode == "always" or (bisect_mode == "on-fail" and not comparison.passed):
        t0 = time.monotonic()
        bisected = _bisect(cfg, host, run, eng, table, model_dir, label, style, fingerprint, config, dtype, work,
                           out, ref, inline_capture, progress, on_line, engine_path=report.engine_path)
        timings["bisect_s"] = round(time.monotonic() - t0, 2)
    explanation = explain(comparison, config, bisected) if want_explain else []
    reasons = verdict_reasons(comparison.reasons, dtype, bisected)
    verdict = "pass" if not reasons else "fail"
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
        "engine_path": report.engine_path, "engine_settings": _settings_summary(report.settings),
        "gpu": gpu_info(),
        "reference_versions": reference.versions,
        # HF transformers in float32 (hf_reference.py), on this machine's CPU or GPU (`reference_device`)
        "reference_device": (reference.settings or {}).get("device", "cpu"),
        "reference_settings": {k: v for k, v in (reference.settings or {}).items()
                               if k in ("device", "gpu", "cuda", "tf32", "threads", "attn", "experts")},
        "model_fingerprint": fingerprint, "model_dir": str(model_dir),
        "dsadapt": _dsadapt_version(),
    }
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    result = CheckResult(
        pin=str(ref), engine=ref.engine, variant=spec.name, model=label, config_style=style, dtype=dtype,
        unpatched=unpatched, verdict=verdict, reasons=reasons, explanation=explanation,
        report_path=str(out), plot_path=None, provenance=provenance, timings=timings,
        comparison=comparison.to_json(), bisect=bisected)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from patcher.rules.plots import plot_deltas

        png = out.with_suffix(".png")
        from patcher.rules.prompts import rope_original_max

        plot_deltas(comparison, png, title=f"{ref} {label} {style or ''} {dtype}{' (unpatched)' if unpatched else ''}",
                    original_max=rope_original_max(config))
        result.plot_path = str(png)
    except ImportError:  # matplotlib is optional
        result.plot_path = None
    save_inputs(out, reference, report, ENGINE_TOP_K)
    result.provenance["inputs"] = inputs_path(out).name
    write_report(result, out)
    return result


def check_markdown(result: CheckResult) -> str:
    """Pure: the human-readable check report written next to the JSON (<report>.md): the verdict,
    why, one row per prompt, and where it ran."""
    c = result.comparison or {}
    prov = result.provenance or {}

    def f(x, spec: str = ".2g") -> str:
        return "-" if x is None else format(x, spec)

    title = (f"# {result.pin} ({result.variant}{', unpatched' if result.unpatched else ''}) vs HF transformers: "
             f"{result.verdict.upper()}")
    lines = [title, "",
             f"Model {result.model}" + (f" ({result.config_style} config)" if result.config_style else "")
             + f", {result.dtype}, {c.get('rule') or 'no'} rule" + (f", tolerance {c['tolerance']:g}" if c.get("tolerance") else "")
             + (f", thresholds {c['thresholds']}" if c.get("thresholds") else "") + ".", ""]
    if result.reasons:
        lines += ["**Why it fails**", "", *(f"- {r}" for r in result.reasons[:20]), ""]
    rows = c.get("rows") or []
    if rows:
        lines += ["| prompt | positions | max \\|Δ\\| | mean \\|Δ\\| | top-1 agree | greedy | 1st divergence | verdict |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            greedy = {True: "yes", False: "NO", None: "-"}.get(r.get("greedy_match"))
            first = "-" if r.get("first_divergence") is None else str(r["first_divergence"])
            lines.append(f"| {r['id']} | {r.get('positions', '')} | {f(r.get('max_abs'))} | {f(r.get('mean_abs'))} | "
                         f"{f(r.get('top1_agreement'), '.3f')} | {greedy} | {first} | "
                         f"{'pass' if r.get('passed') else 'FAIL'} |")
        lines.append("")
    if result.bisect and result.bisect.get("report_path"):
        lines += [f"Per-module comparison: `{Path(result.bisect['report_path']).name}`"
                  + (f", heat map `{Path(result.bisect['plot_path']).name}`" if result.bisect.get("plot_path") else ""), ""]
    if result.explanation and not result.passed:
        lines += ["**Where it points**", "", *(f"- {e}" for e in result.explanation), ""]
    if result.plot_path:
        lines += [f"![per-position |Δ logprob|]({Path(result.plot_path).name})", ""]
    lines += ["| provenance | |", "| --- | --- |",
              f"| date | {prov.get('date', '-')} |", f"| device | {prov.get('device', '-')} |",
              f"| stack | {(prov.get('stack_hash') or '-')[:12]} ({len(prov.get('patches') or [])} patches) |",
              f"| engine | {prov.get('engine_version') or '-'} ({(prov.get('installed') or {}).get('artifact', '-')}) |",
              f"| reference | transformers {(prov.get('reference_versions') or {}).get('transformers', '-')} on "
              f"{prov.get('reference_device', '-')} |",
              f"| command | `{prov.get('command', '-')}` |"]
    if prov.get("rescored"):
        lines.append(f"| rescored | {prov['rescored'].get('date')} (was {prov['rescored'].get('previous_verdict')}) |")
    return "\n".join(lines) + "\n"


def write_report(result: CheckResult, out: Path) -> None:
    """The check report: JSON (schema dsadapt.check-report/1) and its Markdown twin, each written whole."""
    from patcher.base.fsutil import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"schema": REPORT_SCHEMA, **result.to_json()}, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out.with_suffix(".md"), check_markdown(result))


def verdict_reasons(logit_reasons: list[str], dtype: str, bisected: dict | None) -> list[str]:
    """Why a check fails (empty: it passes): the logit rule's reasons and, in low precision, a module
    beyond its calibrated noise (docs/equivalence.md)."""
    reasons = list(logit_reasons)
    if bisected is not None and dtype in LOW_PRECISION_DTYPES and bisected.get("passed") is False:
        reasons += [f"per-module comparison ({dtype}): {r}" for r in (bisected.get("reasons") or [])[:1]]
    return reasons


# ---------------------------------------------------------------- rescoring


REPORT_SCHEMA = "dsadapt.check-report/1"
INPUTS_SCHEMA = "dsadapt.check-inputs/1"


def inputs_path(report: Path) -> Path:
    """Where a check report's inputs are kept: the two logit reports the rule compared
    (<report>.inputs.json.gz), so that `check --rescore` can apply a later rule to them."""
    return report.with_name(report.stem + ".inputs.json.gz")


def save_inputs(report: Path, reference: LogitReport, engine_report: LogitReport, top_k: int) -> Path:
    import gzip

    path = inputs_path(report)
    doc = {"schema": INPUTS_SCHEMA, "top_k": top_k, "reference": reference.to_json(), "engine": engine_report.to_json()}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    tmp.replace(path)
    return path


def load_inputs(report: Path) -> tuple[LogitReport, LogitReport, int] | None:
    """The recorded inputs of a check report, or None when it has none (made before they were kept)."""
    import gzip

    path = inputs_path(report)
    if not path.is_file():
        return None
    try:
        doc = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, EOFError, ValueError) as e:
        raise UsageError(f"{path}: not readable ({e})", hint="rerun the check to record them again") from None
    if not isinstance(doc, dict) or doc.get("schema") != INPUTS_SCHEMA:
        raise UsageError(f"{path}: not a {INPUTS_SCHEMA} document", hint="rerun the check to record them again")
    return LogitReport.from_json(doc["reference"]), LogitReport.from_json(doc["engine"]), int(doc["top_k"])


def current_rule(dtype: str) -> dict:
    """The rule the gate applies today to an engine in `dtype`, as the rule itself states it:
    {"rule", "tolerance", "thresholds"} of `compare` on a one-position pair (so a change of the rule's
    parameters in patcher/rules is seen here without a copy of them)."""
    from patcher.rules.logits import PositionLogprobs, PromptResult

    def side(d: str) -> LogitReport:
        top = {t: -1.0 - t for t in range(REFERENCE_TOP_K)}
        pos = PositionLogprobs(0, -1.0, top)
        return LogitReport("probe", "probe", "0", d, REFERENCE_TOP_K, 1,
                           [PromptResult("p", None, [0, 0], [None, pos], [0], [pos])])

    c = compare(side("float32"), side(dtype), ENGINE_TOP_K)
    return {"rule": c.rule, "tolerance": c.tolerance, "thresholds": c.thresholds}


def rule_drift(doc: dict, path: Path | None) -> str | None:
    """Pure but for reading the report's inputs: why a check report's verdict may not be what the
    current rule gives, or None. With recorded inputs the current rule is applied to them (the
    verdict it gives, when it differs); without, the parameters the report was scored with
    (rule, tolerance, thresholds) are compared with the current rule's."""
    comp = doc.get("comparison") or {}
    dtype = doc.get("dtype")
    if not comp.get("rule") or dtype not in (*LOW_PRECISION_DTYPES, "float32", "float64"):
        return None  # the engine produced no logits: no rule was applied
    module = module_rule_drift(doc, path)
    if module:
        return module
    inputs = None
    if path is not None:
        try:
            inputs = load_inputs(path)
        except DsadaptError as e:
            return f"its recorded inputs are unreadable ({e.message})"
    if inputs is not None:
        ref, eng, k = inputs
        now = compare(ref, eng, k)
        verdict = "pass" if not verdict_reasons(now.reasons, dtype, doc.get("bisect")) else "fail"
        if verdict != doc.get("verdict"):
            return f"the current rule says {verdict}: `dsadapt check --rescore {path}`"
        return None
    rule = current_rule(dtype)
    then = {"rule": comp.get("rule"), "tolerance": comp.get("tolerance"), "thresholds": comp.get("thresholds")}
    if then != rule:
        changed = [k for k in rule if then.get(k) != rule[k]]
        return (f"scored by an older rule ({', '.join(changed)} differ) and has no recorded inputs to rescore: "
                f"rerun `{(doc.get('provenance') or {}).get('command') or 'dsadapt check'}`")
    return None


def current_module_rule(dtype: str) -> dict:
    """The per-module rule's parameters for `dtype` as patcher.rules.modules states them today
    (what a bisect report records as `thresholds`)."""
    from patcher.rules import modules

    if dtype in modules.STRICT_DTYPES:
        return dataclasses.asdict(modules.STRICT_RULE)
    rules = modules.LOW_PRECISION_POINT_RULES
    return dataclasses.asdict(rules.get(dtype) or rules["bfloat16"])


def module_rule_drift(doc: dict, path: Path | None) -> str | None:
    """Why the per-module part of a low-precision verdict may not be today's: its bisect report
    (next to the check report) was judged with other per-module thresholds. Its captures are not
    kept, so this part is flagged, never rescored."""
    b = doc.get("bisect") or {}
    dtype = doc.get("dtype")
    if not b or dtype not in LOW_PRECISION_DTYPES or path is None:
        return None
    report = bisect_run.report_paths(Path(path))[0]
    try:
        then = json.loads(report.read_text(encoding="utf-8")).get("thresholds")
    except (OSError, ValueError):
        return None  # no per-module report to compare: the check's verdict stands as recorded
    if then is not None and then != current_module_rule(dtype):
        cmd = (doc.get("provenance") or {}).get("command") or "dsadapt check"
        return (f"its per-module part was judged with other thresholds than today's per-module rule "
                f"({report.name}); the captures are not kept: rerun `{cmd}`")
    return None


def rescore_check(path: Path) -> CheckResult:
    """Apply the current rule to a check report's recorded inputs: a new verdict, reasons and plot,
    written back into the report (`provenance.rescored` says when, and what it was before).
    The per-module part of a low-precision verdict is kept as recorded (its captures are not)."""
    from patcher.rules.plots import plot_deltas

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--rescore {path}: not a readable JSON report ({e})", hint="name a check report (.json)") from None
    if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA:
        raise UsageError(f"--rescore {path}: not a check report (schema {doc.get('schema') if isinstance(doc, dict) else None!r})",
                         hint="name a report `dsadapt check` wrote (reports/<engine>/<tag>/<model>-<style>-<dtype>.json); "
                              "speed-gate reports: `dsadapt perf --rescore`")
    prov = doc.get("provenance") or {}
    if not (doc.get("comparison") or {}).get("rule"):
        raise UsageError(f"--rescore {path}: the engine produced no logits in that run: there is nothing to rescore",
                         hint=f"rerun `{prov.get('command') or 'dsadapt check'}`")
    inputs = load_inputs(Path(path))
    if inputs is None:
        raise UsageError(f"--rescore {path}: the report has no recorded inputs ({inputs_path(Path(path)).name}; it "
                         "predates them), so no rule can be applied to it again",
                         hint=f"rerun `{prov.get('command') or 'dsadapt check'}` to score it under the current rule")
    ref, eng, k = inputs
    comparison = compare(ref, eng, k)
    dtype = doc["dtype"]
    reasons = verdict_reasons(comparison.reasons, dtype, doc.get("bisect"))
    config = None
    model_dir = prov.get("model_dir")
    if model_dir and (Path(model_dir) / "config.json").is_file():
        config = json.loads((Path(model_dir) / "config.json").read_text())
    fields = {f.name for f in dataclasses.fields(CheckResult)}
    result = CheckResult(**{k2: v for k2, v in doc.items() if k2 in fields})
    module = module_rule_drift(doc, Path(path))
    result.provenance = {**prov, "rescored": {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                              "dsadapt": _dsadapt_version(), "previous_verdict": doc.get("verdict"),
                                              "previous_reasons": doc.get("reasons"),
                                              "per_module": ("as recorded" + (f"; {module}" if module else ""))
                                              if doc.get("bisect") else None}}
    result.comparison, result.reasons = comparison.to_json(), reasons
    result.verdict = "pass" if not reasons else "fail"
    result.report_path = str(path)
    if config is not None:
        result.explanation = explain(comparison, config, doc.get("bisect"))
    try:
        png = Path(path).with_suffix(".png")
        plot_deltas(comparison, png, title=f"{result.pin} {result.model} {result.config_style or ''} {dtype} (rescored)")
        result.plot_path = str(png)
    except ImportError:
        pass
    write_report(result, Path(path))
    return result


def _bisect(cfg, host, run, eng, table, model_dir, label, style, fingerprint, config, dtype, work, out, ref,
            inline_capture, progress, on_line, engine_path=None) -> dict:
    """The per-module comparison of this check: the engine's capture (taken in the gate's own
    engine run, or where the engine's `bisect_session` says), the reference's, the report next
    to the check report. Returns `bisect_run.summary` (the failure in `reasons` when it cannot run)."""
    from patcher.rules.modules import BisectError

    def failed(why: str, passed: bool | None = False) -> dict:
        return {"passed": passed, "rule": None, "dtype": dtype, "first": None, "above": [], "compared": 0,
                "reasons": [why], "explanation": [], "report_path": None, "plot_path": None}

    if table is None:  # nothing to compare with: the gate's verdict stands alone
        return failed(f"{eng.name} has no capture table: it cannot be bisected", passed=None)
    try:
        import torch  # noqa: F401  (the comparison runs here, on the captures' tensors)
    except ImportError:
        return failed("bisect could not run: torch is not installed in dsadapt's environment "
                      "(pip install 'dsadapt[models]')")
    capture = work / bisect_run.ENGINE_CAPTURE
    try:
        if not inline_capture:
            with eng.bisect_session(run, host) as session:
                runner = replace(session.runner,
                                 extra_args=session.runner.extra_args + bisect_run.capture_args(work, table, config, dtype))
                if progress:
                    progress(f"bisect: {ref} {dtype} via {runner.name} runner with capture")
                run_runner(runner, session.python, model_dir, work / "prompts.json", dtype, ENGINE_TOP_K, MAX_TOKENS,
                           work / "bisect-engine.json", env=session.env, fingerprint=fingerprint, on_line=on_line)
        if not capture.is_file():
            report = work / ("engine.json" if inline_capture else "bisect-engine.json")
            why = (json.loads(report.read_text()).get("settings") or {}).get("capture_error") if report.is_file() else None
            raise BisectError(f"the engine run wrote no capture{': ' + why if why else ''}",
                              hint=f"see the runner's log next to {report}")
        engine_doc = bisect_run.load_capture(capture)
        ref_docs = bisect_run.reference_capture(cfg, model_dir, fingerprint, engine_doc, dtype, work,
                                                lambda: reference_python(cfg, progress), progress, on_line)
        result = bisect_run.compare(engine_doc, ref_docs, config, dtype, ref.engine, table)
    except (BisectError, EngineRunFailed) as e:
        return failed(f"bisect could not run: {e.message}")
    meta = {"pin": str(ref), "model": label, "config_style": style, "unpatched": run.unpatched,
            "engine_path": engine_path, "model_fingerprint": fingerprint,
            "reference_versions": ref_docs["float32"].get("meta", {}),
            "engine_capture": {k: engine_doc.get(k) for k in ("calls", "stray_calls", "missing", "dropped", "meta")}}
    title = f"{ref} {label} {style or ''} {dtype}{' (unpatched)' if run.unpatched else ''}: per-module error vs HF"
    return bisect_run.write_report(result, out, meta, title)


def _engine_failed(cfg, ref, spec, label, style, dtype, unpatched, unpatched_engine, stack, out, err, installed,
                   fingerprint, model_dir, command, model, timings, t_start) -> CheckResult:
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    provenance = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_description(),
        "command": command or f"dsadapt check {ref} --model {model}",
        "stack_hash": None if unpatched else stack.hash, "unpatched_engine": unpatched_engine,
        "patches": [] if unpatched else [e.name for e in stack.entries], "installed": installed,
        "gpu": gpu_info(),
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
    inputs_path(out).unlink(missing_ok=True)  # an earlier run's inputs are not this run's
    write_report(result, out)
    return result


def _settings_summary(settings: dict | None) -> dict:
    """The engine's run settings worth keeping in provenance (device, backend, dtype handling...)."""
    keep = ("device", "gpu", "backend", "eager_mode", "session_len", "logprobs_mode", "enforce_eager",
            "max_model_len", "cache_max_entry_count", "generation_requests")
    return {k: v for k, v in (settings or {}).items() if k in keep}


def _root_cause(log_path: str | None) -> str | None:
    from patcher.runners import root_cause

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


def bisect_command(result: CheckResult) -> str:
    """The `dsadapt bisect` command that localizes this check's failure (in its own dtype)."""
    from patcher.checkpoints.tiny import VARIANTS

    model = result.model if result.model in VARIANTS else (result.provenance.get("model_dir") or result.model)
    return bisect_run.command(result.pin, model, result.config_style, result.dtype, result.unpatched)


def check_or_raise(result: CheckResult) -> None:
    if not result.passed:
        hint = f"report: {result.report_path}"
        if result.bisect and result.bisect.get("report_path"):
            hint += f"; bisect report: {result.bisect['report_path']}"
        else:
            hint += f"; localize the layer and module with `{bisect_command(result)}`"
        if not (result.explanation and "--explain" in (result.provenance.get("command") or "")):
            hint += "; rerun with --explain for the likely layer family"
        raise CheckFailed(f"{result.pin} failed the equivalence gate: {'; '.join(result.reasons[:2])}", hint=hint)

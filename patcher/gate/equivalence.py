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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import (
    BuildError,
    CheckFailed,
    DsadaptError,
    EngineRunFailed,
    EngineUnavailable,
    UsageError,
    number,
    plural,
)
from patcher.base.machine import device_description, gpu_info
from patcher.checkpoints.fingerprint import fingerprint
from patcher.checkpoints.model_dir import Checkpoint, open_checkpoint, reference_slot, run_time_limit
from patcher.engines.base import SINGLE, Engine, GateRun, Parallel, VariantSpec
from patcher.engines.registry import engine
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, load_stack
from patcher.gate import bisect
from patcher.gate.hosts import RunHost
from patcher.gate.report import (  # noqa: F401 - current_rule and rule_drift: this module's public names too
    current_rule,
    inputs_path,
    load_inputs,
    rejudge,
    rule_drift,
    save_inputs,
)
from patcher.rules.logits import (
    LOW_PRECISION_DTYPES,
    REFERENCE_TRANSFORMERS,
    LogitReport,
    compare,
    explain,
)
from patcher.rules.prompts import build_prompt_set, rope_original_max, write_prompts_json
from patcher.rules.verdicts import check_margins
from patcher.runners.launch import REFERENCE_RUNNER, REFERENCE_TOP_K, run_runner

#: The gate's dtype for block-FP8 checkpoints: the engine's FP8 path (activations bfloat16).
FP8 = "fp8"
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
    #: how far the worst judged quantity is from its limit (`patcher.rules.verdicts.check_margins`)
    margins: dict | None = None
    #: how the engine was spread: {"tp", "ep", "world_size", "label"} (`Parallel.to_json`);
    #: reports of different parallel configurations have different names and never replace each other
    parallel: dict = field(default_factory=SINGLE.to_json)

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
    from patcher.checkpoints import tiny

    if model in tiny.VARIANTS:
        style = config_style or default_style
        if style not in tiny.CONFIG_STYLES:
            raise UsageError(f"unknown config style {style!r}", hint=f"one of {', '.join(tiny.CONFIG_STYLES)}")
        out = cfg.workdir / "models" / f"{model}-{style}-seed0"
        meta = out / "dsadapt.json"
        if not meta.is_file():
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


def model_preflight(entry: LockEntry, spec: VariantSpec, config: dict, dtype: str | None) -> None:
    """What a checkpoint's config.json says before anything runs: a block-FP8 checkpoint is checked in
    fp8 only (the engine's FP8 path against HF on the dequantized weights), fp8 needs one, and the
    engine may know it cannot run this checkpoint here (exit 6)."""
    from patcher.checkpoints.layout import LayoutError, fp8_scheme

    eng = engine(entry.engine)
    try:
        fp8 = fp8_scheme(config) is not None
    except LayoutError as e:
        raise UsageError(f"--model: config.json: {e}", hint="the gate checks DeepSeek checkpoints as released") from None
    if fp8 and dtype is not None and dtype != FP8:
        raise UsageError(f"the model is a block-FP8 checkpoint: the gate checks it in {FP8} (the engine's FP8 path "
                         f"against HF transformers on the dequantized weights), not {dtype}",
                         hint=f"pass --dtype {FP8} or leave --dtype out")
    if not fp8 and dtype == FP8:
        raise UsageError(f"--dtype {FP8} is for block-FP8 checkpoints (quantization_config quant_method fp8); "
                         "this model has none", hint="pass --dtype float32, bfloat16 or float16, or an FP8 checkpoint "
                                                     "(`dsadapt model make --like deepseek-v3`)")
    blocker = eng.checkpoint_blocker(entry, spec, config)
    if fp8 and blocker is None and FP8 not in eng.gate_dtypes(spec):
        blocker = f"its gate runner has no FP8 path (it serves {', '.join(eng.gate_dtypes(spec))})"
    if blocker:
        what = "this block-FP8 checkpoint" if fp8 else "this checkpoint"
        raise EngineUnavailable(f"{entry.ref} ({spec.name}) cannot run {what} here: {blocker}",
                                hint=f"run it on a machine that has what it needs ({eng.docs_page or 'the engine docs'})")


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


REFERENCE_DEVICES = ("auto", "cpu", "cuda")


def where_reference_runs(asked: str, spec: VariantSpec) -> str:
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
        return run_runner(spec, py, model_dir, prompts_path, dtype, REFERENCE_TOP_K, max_tokens, cached,
                          fingerprint=fingerprint, on_line=on_line,
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


def runnable(lock: Lock, ref: PinRef, variant: str | None, command: str,
             parallel: Parallel = SINGLE) -> tuple[LockEntry, VariantSpec]:
    """The pin's entry and variant, or EngineUnavailable (exit 6) saying why it cannot run here
    (in `parallel`: what that configuration needs) and where `command` can (shared by check,
    bisect and perf)."""
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    spec = eng.variant_for(entry, variant)
    blocker = eng.run_blocker(entry, spec)
    if blocker:
        raise EngineUnavailable(f"{ref} ({spec.name}) cannot run on this machine: {blocker}",
                                hint=f"run `{command}` on a machine that has what it needs "
                                     f"({eng.docs_page or 'the engine docs'} says where it was verified)")
    blocker = eng.parallel_blocker(entry, spec, parallel)
    if blocker:
        elsewhere = [v.name for v in eng.pinned_variants(entry)
                     if v.name != spec.name and eng.parallel_support(entry, v).tp
                     and (eng.parallel_support(entry, v).ep or not parallel.ep)]
        offered = eng.parallel_support(entry, spec).tp and (eng.parallel_support(entry, spec).ep or not parallel.ep)
        where = (f"run `{command}` where it can (variant {', '.join(elsewhere)} offers it)" if elsewhere
                 else f"run `{command}` on a machine that has what it needs" if offered
                 else f"no variant of {ref} offers {parallel.describe()}: check it in one process (without --tp)")
        raise EngineUnavailable(f"{ref} ({spec.name}) cannot run {parallel.describe()} here: {blocker}",
                                hint=f"{where}; {eng.docs_page or 'the engine docs'} says what each variant offers")
    return entry, spec


def parallel_fits(config: dict, parallel: Parallel) -> str | None:
    """Why a model of this config.json cannot be split over `parallel`'s ranks (what is not
    divisible), or None. Each rank must hold a whole share of the attention heads and of the
    MoE's experts (expert parallelism) or of each expert's intermediate size (tensor parallelism),
    and of the router's expert groups."""
    if parallel.single:
        return None
    n = parallel.tp
    checks = [("num_attention_heads", "attention heads")]
    if config.get("n_routed_experts"):
        checks += [("n_routed_experts", "routed experts")] if parallel.ep else \
            [("moe_intermediate_size", "expert intermediate size")]
        if parallel.ep and int(config.get("n_group") or 1) > 1:
            checks += [("n_group", "expert groups")]
    if config.get("intermediate_size"):
        checks += [("intermediate_size", "dense MLP intermediate size")]
    for key, what in checks:
        value = config.get(key)
        if isinstance(value, int) and value % n:
            return f"its {what} ({key} = {value}) do not split over {n} ranks"
    return None


def check_split(model: str, parallel: Parallel) -> None:
    """UsageError (exit 2) when `model` (a built-in name or a directory) cannot be split over
    `parallel`'s ranks; read from its config alone, before anything is made."""
    if parallel.single:
        return
    from patcher.checkpoints.tiny import VARIANTS, deepseek_config

    if model in VARIANTS:
        config = deepseek_config(model)  # both config styles have the same shapes
    else:
        try:
            config = json.loads((Path(model) / "config.json").read_text())
        except (OSError, ValueError):
            return  # resolve_model says what is wrong with it
    unfit = parallel_fits(config if isinstance(config, dict) else {}, parallel)
    if unfit:
        raise UsageError(f"--model {model} cannot run {parallel.describe()}: {unfit}",
                         hint="choose a tensor parallel size that divides the model's heads and expert sizes")


def preflight(lock: Lock, ref: PinRef, variant: str | None, command: str | None = None,
              dtype: str | None = None, unpatched_engine: bool = False,
              parallel: Parallel = SINGLE, config: dict | None = None) -> tuple[LockEntry, VariantSpec]:
    """What `check` can tell before it touches anything: the pin, the variant, whether it can run
    here (exit 6; in `parallel`: whether the engine offers it and the machine has the devices),
    and whether its runner takes `dtype` (exit 2; checked after the machine, so a dtype a GPU-only
    engine supports is never reported as bad input on a machine without a GPU).
    `unpatched_engine` only means something for a pin that serves another pinned engine."""
    if unpatched_engine:
        served_engine_of(lock, ref)
    entry, spec = runnable(lock, ref, variant, command or f"dsadapt check {ref}", parallel)
    eng = engine(ref.engine)
    if config is not None:
        model_preflight(entry, spec, config, dtype)
    if dtype is not None:
        dtypes = eng.gate_dtypes(spec)
        if dtype not in dtypes:
            raise UsageError(f"{ref} ({spec.name}) does not run in {dtype} for the gate",
                             hint=f"its runner supports {', '.join(dtypes)}: pass --dtype {dtypes[0]}"
                             if dtypes else f"see {eng.docs_page}")
    return entry, spec


def served_engine_of(lock: Lock, ref: PinRef) -> str:
    """The pinned engine `ref` serves (`serves` in upstream.lock): what --unpatched-engine leaves
    unpatched. A pin that serves none is bad input for that option."""
    entry = lock.pin(ref)
    if not entry.serves:
        raise UsageError(f"{ref} serves no other engine: --unpatched-engine has nothing to leave unpatched",
                         hint="it is for pins that serve another pinned engine (`serves` in upstream.lock); "
                              "use --unpatched for the pristine release of this one")
    return entry.serves


def check_dtypes(lock: Lock, ref: PinRef, variant: str | None = None, config: dict | None = None) -> tuple[str, ...]:
    """Every dtype the engine's gate runner serves for this pin (float32 first where it has it,
    then bfloat16, float16): what `check` runs without --dtype. A block-FP8 checkpoint (`config`)
    runs in fp8 only."""
    from patcher.checkpoints.layout import LayoutError, fp8_scheme

    entry = lock.pin(ref)
    eng = engine(entry.engine)
    served = eng.gate_dtypes(eng.variant_for(entry, variant))
    try:
        if config is not None and fp8_scheme(config) is not None:
            return (FP8,)
    except LayoutError:
        pass
    plain = [d for d in served if d != FP8]
    return tuple(d for d in ("float32", "bfloat16", "float16") if d in plain) or tuple(plain[:1])


@dataclass(frozen=True)
class CheckRequest:
    """One gate run as the user asked for it, carried unchanged from the command line to the engine
    (`gate_run` makes the engine's part of it, `engines.base.GateRun`)."""

    pin: PinRef
    model: str = "v3"                 # a built-in model name or a model directory
    config_style: str | None = None   # the built-in model's config.json style (None: the engine's)
    dtype: str = "float32"
    variant: str | None = None
    unpatched: bool = False           # the pristine upstream release instead of the stack
    unpatched_engine: bool = False    # served engines: the served engine pristine, the stack applied
    reference_on: str = "auto"        # where the float32 reference runs (`reference_device`)
    bisect: str | None = None         # None, "on-fail" or "always" (`patcher.gate.bisect.wanted`)
    explain: bool = True
    command: str | None = None        # the command line, for provenance
    tp: int = 1                       # the engine's tensor parallel size (the reference stays one process)
    ep: bool = False                  # expert parallelism over those ranks
    prompt_seed: int = 0              # 0: the fixed prompt set; N: another set of the same shape (`prompt_texts`)

    @property
    def parallel(self) -> Parallel:
        return Parallel(self.tp, self.ep)

    def with_dtype(self, dtype: str) -> CheckRequest:
        return replace(self, dtype=dtype)

    def default_command(self, style: str | None) -> str:
        return (f"dsadapt check {self.pin} --model {self.model}" + (f" --config-style {style}" if style else "")
                + f" --dtype {self.dtype}" + parallel_flags(self.parallel) + (" --unpatched" if self.unpatched else "")
                + (f" --prompt-seed {self.prompt_seed}" if self.prompt_seed else ""))


def parallel_flags(parallel: Parallel) -> str:
    """The command-line flags of a parallel configuration (empty for one process)."""
    return "" if parallel.single else f" --tp {parallel.tp}" + (" --ep" if parallel.ep else "")


@dataclass
class _Run:
    """What one check has resolved before the engine runs (shared by the verdict, the bisect and
    the failure report)."""

    req: CheckRequest
    cfg: Config
    entry: LockEntry
    spec: VariantSpec
    eng: Engine
    stack: Stack
    model_dir: Path
    label: str
    style: str | None
    fingerprint: str
    config: dict
    checkpoint: Checkpoint
    model_files: dict
    out: Path
    work: Path
    gate: GateRun
    host: RunHost
    progress: Callable[[str], None] | None
    on_line: Callable[[str], None] | None
    t_start: float
    timings: dict = field(default_factory=dict)

    @property
    def title(self) -> str:
        """The plots' title: the pin and its configuration, one space apart (`plots.title_of`)."""
        from patcher.rules.plots import title_of

        return title_of(str(self.req.pin), {
            "variant": self.spec.name, "model": self.label, "config_style": self.style, "dtype": self.req.dtype,
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
               comparison: dict, bisected: dict | None = None) -> CheckResult:
        self.timings["total_s"] = round(time.monotonic() - self.t_start, 2)
        return CheckResult(
            pin=str(self.req.pin), engine=self.req.pin.engine, variant=self.spec.name, model=self.label,
            config_style=self.style, dtype=self.req.dtype, unpatched=self.req.unpatched, verdict=verdict,
            reasons=reasons, explanation=explanation, report_path=str(self.out), plot_path=None,
            provenance=provenance, timings=self.timings, comparison=comparison, bisect=bisected,
            parallel=self.req.parallel.to_json())


def _prepare(cfg: Config, lock: Lock, req: CheckRequest, progress, stream: bool, on_line,
             host: RunHost | None = None) -> _Run:
    t_start = time.monotonic()
    entry, spec = preflight(lock, req.pin, req.variant, req.command, req.dtype, req.unpatched_engine,
                            req.parallel)
    eng = engine(req.pin.engine)
    stack = load_stack(cfg.patches_root, req.pin)
    check_split(req.model, req.parallel)
    model_dir, label, style = resolve_model(cfg, req.model, req.config_style, progress,
                                            default_style=eng.model_config_style)
    ckpt = open_checkpoint(model_dir)
    model_preflight(entry, spec, ckpt.config, req.dtype)
    fp = fingerprint(ckpt, cfg.cache, progress)
    out = report_paths(cfg, req.pin, label, style, req.dtype, req.unpatched, req.unpatched_engine,
                       parallel=req.parallel, prompt_seed=req.prompt_seed)
    work = cfg.workdir / "runs" / out.relative_to(cfg.reports_root).with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    gate = GateRun(entry, spec, req.dtype, model_dir, unpatched=req.unpatched, unpatched_engine=req.unpatched_engine,
                   tp=req.tp, ep=req.ep)
    return _Run(req=req, cfg=cfg, entry=entry, spec=spec, eng=eng, stack=stack, model_dir=model_dir, label=label,
                style=style, fingerprint=fp.sha256, config=ckpt.config, checkpoint=ckpt, model_files=fp.files,
                out=out, work=work, gate=gate,
                host=host or RunHost(cfg, lock, progress, stream), progress=progress, on_line=on_line,
                t_start=t_start)


def run_check(cfg: Config, lock: Lock, req: CheckRequest, *, progress: Callable[[str], None] | None = None,
              stream: bool = True, on_line: Callable[[str], None] | None = None,
              host: RunHost | None = None) -> CheckResult:
    """The gate for one pin and dtype. `req.bisect` ("on-fail" or "always", see `patcher.gate.bisect`)
    adds the per-module comparison; low-precision checks always run it (part of their verdict).
    `host`: one `RunHost` shared by the runs of one command (several dtypes), so the engine is
    built and installed once."""
    r = _prepare(cfg, lock, req, progress, stream, on_line, host)
    ref_device = where_reference_runs(req.reference_on, r.spec)
    dtype = req.dtype
    prompts = build_prompt_set(r.model_dir, MAX_TOKENS, seed=req.prompt_seed)
    prompts_path = write_prompts_json(prompts, r.work / "prompts.json")
    prompts_doc = json.loads(prompts_path.read_text())
    timings = r.timings
    t0 = time.monotonic()
    reference = run_reference(cfg, r.model_dir, r.fingerprint, prompts_path, prompts_doc, progress, on_line, ref_device,
                              checkpoint=r.checkpoint)
    noise = None
    if dtype in LOW_PRECISION_DTYPES:  # the reference's own rounding in this dtype: the yardstick
        noise = run_reference(cfg, r.model_dir, r.fingerprint, prompts_path, prompts_doc, progress, on_line,
                              ref_device, dtype=dtype, checkpoint=r.checkpoint)
    timings["reference_s"] = round(time.monotonic() - t0, 2)
    t0 = time.monotonic()
    installed: dict = {}
    bisect_mode = bisect.wanted(dtype, req.bisect)
    table = bisect.table_for(r.eng) if bisect_mode else None
    # capture in the gate's own engine run (one engine start) unless the engine says where else
    inline_capture = table is not None and r.eng.bisect_session(r.gate, r.host) is None
    try:
        with r.eng.gate_session(r.gate, r.host) as session:
            installed = session.installed
            timings["install_s"] = round(time.monotonic() - t0, 2)
            runner = session.runner
            if inline_capture and table is not None:
                runner = replace(runner, extra_args=runner.extra_args + bisect.capture_args(r.work, table,
                                                                                                r.config, dtype))
            if progress:
                progress(f"engine: {req.pin} ({r.spec.name}{', unpatched' if req.unpatched else ''}) {dtype} via "
                         f"{runner.name} runner" + (" (with bisect capture)" if inline_capture else ""))
            t0 = time.monotonic()
            report = run_runner(runner, session.python, r.model_dir, prompts_path, dtype, ENGINE_TOP_K,
                                MAX_TOKENS, r.work / "engine.json", env=session.env, fingerprint=r.fingerprint,
                                on_line=on_line, timeout=run_time_limit(r.checkpoint))
            timings["engine_s"] = round(time.monotonic() - t0, 2)
        if progress is not None and hasattr(progress, "end"):
            progress.end()  # its time is said before the verdict, not after it
    except EngineRunFailed as e:
        # The engine could not load or run the model: that is a verdict, not an accident.
        timings["engine_s"] = round(time.monotonic() - t0, 2)
        return _engine_failed(r, e, installed)
    _check_parallel(req, report.settings)
    venv = installed.get("venv")
    engine_path = report.engine_path or ""
    if venv and engine_path.startswith("/") and \
            not str(Path(engine_path).resolve()).startswith(str(Path(venv).resolve())):
        raise DsadaptError(f"{req.pin}: the engine imported {engine_path}, not the package in {venv}",
                           hint="something on PYTHONPATH shadows the pin's environment; unset it")
    for k, v in report.timings.items():
        timings[f"engine_{k}"] = v
    t0 = time.monotonic()
    comparison = compare(reference, report, ENGINE_TOP_K, noise=noise)
    timings["compare_s"] = round(time.monotonic() - t0, 3)
    bisected = None
    if bisect_mode == "always" or (bisect_mode == "on-fail" and not comparison.passed):
        t0 = time.monotonic()
        bisected = _bisect(r, table, inline_capture, engine_path=report.engine_path)
        timings["bisect_s"] = round(time.monotonic() - t0, 2)
        if bisected.get("routing_flips") and comparison.rule == "low-precision":
            # the logits judged without the predictions that follow a routing flip (judge_logits)
            comparison = compare(reference, report, ENGINE_TOP_K, noise=noise, routing_flips=bisected["routing_flips"])
    explanation = explain(comparison, r.config, bisected) if req.explain else []
    reasons = verdict_reasons(comparison.reasons, dtype, bisected)
    provenance = {
        **r.provenance(installed),
        "engine_version": report.engine_version, "engine_versions": report.versions,
        "engine_path": report.engine_path,
        "engine_settings": {k: v for k, v in (report.settings or {}).items() if k in r.eng.run_settings},
        "reference_versions": reference.versions,
        # HF transformers in float32 (hf_reference.py), on this machine's CPU or GPU (`reference_device`)
        "reference_device": (reference.settings or {}).get("device", "cpu"),
        # YaRN's original context (the plot marks it; `check --rescore` draws it again from here)
        "original_max_position_embeddings": rope_original_max(r.config),
        "reference_settings": {k: v for k, v in (reference.settings or {}).items()
                               if k in ("device", "gpu", "cuda", "tf32", "threads", "attn", "experts")},
    }
    result = r.result("pass" if not reasons else "fail", reasons, explanation, provenance, comparison.to_json(),
                      bisected)
    result.margins = check_margins(result.comparison, bisected)
    r.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        from patcher.rules.plots import plot_deltas

        png = r.out.with_suffix(".png")
        plot_deltas(comparison, png, title=r.title, original_max=rope_original_max(r.config))
        result.plot_path = str(png)
    except ImportError:  # matplotlib is optional
        result.plot_path = None
    save_inputs(r.out, reference, report, ENGINE_TOP_K, noise=noise)
    result.provenance["inputs"] = inputs_path(r.out).name
    write_report(result, r.out)
    return result


def _check_parallel(req: CheckRequest, settings: dict | None) -> None:
    """The engine ran with the parallel configuration asked for, as its runner reports it
    (``settings.parallel``); a runner that says nothing ran in one process."""
    ran = (settings or {}).get("parallel") or {}
    got = Parallel(int(ran.get("tp") or 1), bool(ran.get("ep")))
    if got != req.parallel:
        raise DsadaptError(f"{req.pin}: asked for {req.parallel.describe()}, the engine's runner ran "
                           f"{got.describe()}", hint="the engine's runner ignores the parallel options: see its "
                                                     "page in docs/engines/")


def check_markdown(result: CheckResult) -> str:
    """Pure: the human-readable check report written next to the JSON (<report>.md): the verdict,
    why, its margin, one row per prompt, and where it ran."""
    c = result.comparison or {}
    prov = result.provenance or {}

    def f(x, spec: str = ".2g") -> str:
        return "-" if x is None else format(x, spec)

    par = result.parallel or {}
    title = (f"# {result.pin} ({result.variant}{', unpatched' if result.unpatched else ''}"
             f"{', ' + str(par.get('label')) if int(par.get('tp') or 1) > 1 else ''}) vs HF transformers: "
             f"{result.verdict.upper()}")
    lines = [title, "",
             f"Model {result.model}" + (f" ({result.config_style} config)" if result.config_style else "")
             + f", {result.dtype}, {c.get('rule') or 'no'} rule" + (f", tolerance {number(c['tolerance'])}" if c.get("tolerance") else "")
             + ".", ""]
    if result.reasons:
        lines += ["**Why it fails**", "", *(f"- {r}" for r in result.reasons[:20]), ""]
    if result.margins and result.margins.get("words"):
        lines += [f"**Margin**: {result.margins['words']}", ""]
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
              f"| stack | {(prov.get('stack_hash') or '-')[:12]} ({plural(len(prov.get('patches') or []), 'patch')}) |",
              f"| engine | {prov.get('engine_version') or '-'} ({(prov.get('installed') or {}).get('artifact', '-')}) |",
              f"| reference | transformers {(prov.get('reference_versions') or {}).get('transformers', '-')} on "
              f"{prov.get('reference_device', '-')} |",
              f"| command | `{prov.get('command', '-')}` |"]
    if prov.get("rescored"):
        lines.append(f"| rescored | {prov['rescored'].get('date')} (was {prov['rescored'].get('previous_verdict')}) |")
    return "\n".join(lines) + "\n"


REPORT_SCHEMA = "dsadapt.check-report/1"
INPUTS_SCHEMA = "dsadapt.check-inputs/1"


def write_report(result: CheckResult, out: Path) -> None:
    """The check report: JSON (schema dsadapt.check-report/1) and its Markdown twin, each written whole."""
    from patcher.base.fsutil import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"schema": REPORT_SCHEMA, **result.to_json()}, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out.with_suffix(".md"), check_markdown(result))


def verdict_reasons(logit_reasons: list[str], dtype: str, bisected: dict | None) -> list[str]:
    """Why a check fails (empty: it passes): the logit rule's reasons and, in low precision, a module
    beyond its limit (docs/equivalence.md)."""
    reasons = list(logit_reasons)
    if bisected is not None and dtype in LOW_PRECISION_DTYPES and bisected.get("passed") is False:
        reasons += [f"per-module comparison ({dtype}): {r}" for r in (bisected.get("reasons") or [])[:1]]
    return reasons


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
    fields = {f.name for f in dataclasses.fields(CheckResult)}
    result = CheckResult(**{k: v for k, v in doc.items() if k in fields})
    result.provenance = {**prov, "rescored": {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                              "dsadapt": _dsadapt_version(), "previous_verdict": doc.get("verdict"),
                                              "previous_reasons": doc.get("reasons")}}
    if now.logits is not None:
        result.comparison = now.logits.to_json()
    elif now.judged_comparison is not None:  # no recorded inputs: the stored rows judged again
        result.comparison = now.judged_comparison
    if now.bisect is not None:
        result.bisect = now.bisect
    result.reasons, result.verdict = now.reasons, now.verdict
    result.margins = check_margins(result.comparison, result.bisect)
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
    if now.logits is not None or now.judged_comparison is not None:
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


def _bisect(r: _Run, table, inline_capture: bool, engine_path: str | None = None) -> dict:
    """The per-module comparison of this check: the engine's capture (taken in the gate's own
    engine run, or where the engine's `bisect_session` says), the reference's, the report next
    to the check report. Returns `bisect.summary` (the failure in `reasons` when it cannot run)."""
    from patcher.rules.modules import BisectError

    dtype, progress, on_line = r.req.dtype, r.progress, r.on_line

    def failed(why: str, passed: bool | None = False) -> dict:
        return {"passed": passed, "rule": None, "dtype": dtype, "first": None, "above": [], "compared": 0,
                "reasons": [why], "explanation": [], "report_path": None, "plot_path": None}

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
                run_runner(runner, session.python, r.model_dir, r.work / "prompts.json", dtype, ENGINE_TOP_K,
                           MAX_TOKENS, r.work / "bisect-engine.json", env=session.env, fingerprint=r.fingerprint,
                           on_line=on_line, timeout=run_time_limit(r.checkpoint))
        if not capture.is_file():
            report = r.work / ("engine.json" if inline_capture else "bisect-engine.json")
            why = (json.loads(report.read_text()).get("settings") or {}).get("capture_error") if report.is_file() else None
            raise BisectError(f"the engine run wrote no capture{': ' + why if why else ''}",
                              hint=f"see the runner's log next to {report}")
        engine_doc = bisect.load_capture(capture)
        ref_docs = bisect.reference_capture(r.cfg, r.model_dir, r.fingerprint, engine_doc, dtype, r.work,
                                                lambda: reference_python(r.cfg, progress), progress, on_line,
                                                device=where_reference_runs(r.req.reference_on, r.spec))
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
        provenance, {"rule": None, "rows": [], "passed": False, "reasons": [err.message]})
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


def bisect_command(result: CheckResult) -> str:
    """The `dsadapt bisect` command that localizes this check's failure (in its own dtype)."""
    from patcher.checkpoints.tiny import VARIANTS

    model = result.model if result.model in VARIANTS else (result.provenance.get("model_dir") or result.model)
    par = result.parallel or {}
    seed = int((result.provenance or {}).get("prompt_seed") or 0)
    return bisect.command(result.pin, model, result.config_style, result.dtype, result.unpatched) + \
        parallel_flags(Parallel(int(par.get("tp") or 1), bool(par.get("ep")))) + \
        (f" --prompt-seed {seed}" if seed else "")


def check_or_raise(result: CheckResult) -> None:
    if not result.passed:
        hint = f"report: {result.report_path}"
        if result.bisect and result.bisect.get("report_path"):
            hint += f"; bisect report: {result.bisect['report_path']}"
        else:
            hint += f"; localize the layer and module with `{bisect_command(result)}`"
        if not (result.explanation and "--explain" in (result.provenance.get("command") or "")):
            hint += "; rerun with --explain for the likely layer family"
        raise CheckFailed(f"{result.pin} failed the equivalence gate{failure_where(result)}: {'; '.join(result.reasons[:2])}",
                          hint=hint)


def failure_where(result: CheckResult) -> str:
    """Where the per-module comparison says the engine leaves the reference, in the failure's first
    words (layer, module, its family, and the rank of a parallel run), when one ran."""
    first = (result.bisect or {}).get("first") or {}
    if not first:
        return ""
    where = f"layer {first['layer']} {first['label']}" if first.get("layer") is not None else first["label"]
    if first.get("layout") == "partial":
        where += ", the ranks' partial sums added"
    elif first.get("layout") and first.get("rank") is not None:
        where += f" on rank {first['rank']}"
    par = result.parallel or {}
    at = f" at {par['label']}" if int(par.get("tp") or 1) > 1 else ""
    return f"{at} (first divergence: {where}, {first.get('family')})"

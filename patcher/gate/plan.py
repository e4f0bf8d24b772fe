"""What a check (and a bisect, a perf run) can tell before anything is made: its inputs, checked once.

`plan_check` turns a `CheckRequest` (what the user asked) into a `CheckPlan` (what it resolved
to): the model and its config.json, read once; the pin's lock entry, variant and engine, looked
up once; whether this machine can run it (exit 6), in this parallel configuration and with this
checkpoint; whether the engine's runner takes the dtype (exit 2); where the reference runs;
the stack; whether a source can provide the pin's tree here. Every one of these answers comes
before the first model is made, environment built or reference run, and `run_check`
(`patcher.gate.equivalence`) takes the plan as it is, asking none of them again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from patcher.base.config import Config
from patcher.base.errors import EngineUnavailable, SourceError, UsageError, show
from patcher.checkpoints.model_dir import Checkpoint
from patcher.engines.base import SINGLE, Engine, Parallel, VariantSpec
from patcher.engines.registry import engine
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, load_stack

#: The gate's dtype for block-FP8 checkpoints: the engine's FP8 path (activations bfloat16).
FP8 = "fp8"
#: The built-in tiny models (`patcher.checkpoints.tiny.VARIANTS`), named without importing it.
BUILTIN_MODELS = ("v3", "v2-lite", "v2")
REFERENCE_DEVICES = ("auto", "cpu", "cuda")


# ---------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelChoice:
    """--model as checked: a built-in model's name, or a checkpoint folder opened (its config.json
    read and its weights checked against it, from the safetensors headers alone) exactly once."""

    name: str                              # as the user gave it
    config: dict[str, Any]                 # its config.json (a built-in model: its architecture)
    checkpoint: Checkpoint | None = None   # the opened folder; None for a built-in model (made later)
    split: Parallel = SINGLE               # the parallel configuration it was checked to split over

    @property
    def builtin(self) -> bool:
        return self.checkpoint is None


def choose_model(model: str, parallel: Parallel = SINGLE) -> ModelChoice:
    """--model: a built-in name or a checkpoint folder whose config.json and weights agree, and that
    splits over `parallel`'s ranks; else a one-line UsageError (exit 2) before anything runs."""
    if not model.strip():  # Path("") would be the current directory
        raise UsageError("--model is empty", hint="use --model v3, --model v2-lite, --model v2, or a local HF model directory")
    if model in BUILTIN_MODELS:
        from patcher.checkpoints.tiny import deepseek_config

        choice = ModelChoice(model, deepseek_config(model))  # the architecture; no built-in model is quantized
    elif not (Path(model) / "config.json").is_file():
        raise UsageError(f"--model {show(model, 80)}: neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a "
                         "directory with config.json",
                         hint="use --model v3, --model v2-lite, --model v2, or a local HF model directory")
    else:
        from patcher.checkpoints.model_dir import open_checkpoint

        ckpt = open_checkpoint(Path(model))
        choice = ModelChoice(model, ckpt.config, ckpt)
    check_split(choice, parallel)
    return replace(choice, split=parallel)


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


def check_split(model: ModelChoice, parallel: Parallel) -> None:
    """UsageError (exit 2) when `model` cannot be split over `parallel`'s ranks (from its config)."""
    unfit = parallel_fits(model.config, parallel)
    if unfit:
        raise UsageError(f"--model {model.name} cannot run {parallel.describe()}: {unfit}",
                         hint="choose a tensor parallel size that divides the model's heads and expert sizes")


def is_fp8(config: dict) -> bool:
    """Whether config.json describes a block-FP8 checkpoint (UsageError when its scheme is malformed)."""
    from patcher.checkpoints.layout import LayoutError, fp8_scheme

    try:
        return fp8_scheme(config) is not None
    except LayoutError as e:
        raise UsageError(f"--model: config.json: {e}", hint="the gate checks DeepSeek checkpoints as released") from None


def model_preflight(entry: LockEntry, spec: VariantSpec, eng: Engine, config: dict, dtype: str | None) -> None:
    """What a checkpoint's config.json says before anything runs: a block-FP8 checkpoint is checked in
    fp8 only (the engine's FP8 path against HF on the dequantized weights), fp8 needs one, and the
    engine may know it cannot run this checkpoint here (exit 6)."""
    fp8 = is_fp8(config)
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


def dtypes_served(eng: Engine, spec: VariantSpec, config: dict | None = None) -> tuple[str, ...]:
    """Every dtype the engine's gate runner serves for this variant (float32 first where it has
    it, then bfloat16, float16): what `check` runs without --dtype. A block-FP8 checkpoint
    (`config`) runs in fp8 only."""
    from patcher.checkpoints.layout import LayoutError, fp8_scheme

    try:
        if config is not None and fp8_scheme(config) is not None:
            return (FP8,)
    except LayoutError:
        pass
    plain = [d for d in eng.gate_dtypes(spec) if d != FP8]
    return tuple(d for d in ("float32", "bfloat16", "float16") if d in plain) or tuple(plain[:1])


def check_dtypes(lock: Lock, ref: PinRef, variant: str | None = None, config: dict | None = None) -> tuple[str, ...]:
    """`dtypes_served` for a pin of the lock."""
    entry = lock.pin(ref)
    eng = engine(entry.engine)
    return dtypes_served(eng, eng.variant_for(entry, variant), config)


def dtype_blocker(eng: Engine, spec: VariantSpec, dtype: str | None) -> str | None:
    """Why the engine's gate runner does not take `dtype` (None: it does, or no dtype was asked)."""
    served = eng.gate_dtypes(spec)
    if dtype is None or dtype in served:
        return None
    return f"runs in {', '.join(served) or 'no dtype'} only, not {dtype}"


# ---------------------------------------------------------------- the machine


def run_blocker(entry: LockEntry, spec: VariantSpec, eng: Engine, parallel: Parallel = SINGLE) -> str | None:
    """Why this pin cannot run here in `parallel` (the engine's words), or None."""
    return eng.run_blocker(entry, spec) or eng.parallel_blocker(entry, spec, parallel)


def runnable(lock: Lock, ref: PinRef, variant: str | None, command: str,
             parallel: Parallel = SINGLE) -> tuple[LockEntry, VariantSpec]:
    """The pin's entry and variant, or EngineUnavailable (exit 6) saying why it cannot run here
    (in `parallel`: what that configuration needs) and where `command` can (shared by check,
    bisect and perf)."""
    entry, spec, _ = runnable_engine(lock, ref, variant, command, parallel)
    return entry, spec


def runnable_engine(lock: Lock, ref: PinRef, variant: str | None, command: str,
                    parallel: Parallel = SINGLE) -> tuple[LockEntry, VariantSpec, Engine]:
    """`runnable`, with the engine it looked up."""
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
        raise EngineUnavailable(f"{ref} ({spec.name}) cannot run {parallel.describe()} here: {blocker}",
                                hint=f"{_parallel_elsewhere(eng, entry, spec, parallel, command)}; "
                                     f"{eng.docs_page or 'the engine docs'} says what each variant offers")
    return entry, spec, eng


def _parallel_elsewhere(eng: Engine, entry: LockEntry, spec: VariantSpec, parallel: Parallel, command: str) -> str:
    """Where a parallel configuration this variant cannot run here can run (another variant, another
    machine), or that no variant offers it."""
    def offers(v: VariantSpec) -> bool:
        support = eng.parallel_support(entry, v)
        return bool(support.tp and (support.ep or not parallel.ep))

    elsewhere = [v.name for v in eng.pinned_variants(entry) if v.name != spec.name and offers(v)]
    if elsewhere:
        return f"run `{command}` where it can (variant {', '.join(elsewhere)} offers it)"
    if offers(spec):
        return f"run `{command}` on a machine that has what it needs"
    return f"no variant of {entry.ref} offers {parallel.describe()}: check it in one process (without --tp)"


def served_engine_of(lock: Lock, ref: PinRef) -> str:
    """The pinned engine `ref` serves (`serves` in upstream.lock): what --unpatched-engine leaves
    unpatched. A pin that serves none is bad input for that option."""
    entry = lock.pin(ref)
    if not entry.serves:
        raise UsageError(f"{ref} serves no other engine: --unpatched-engine has nothing to leave unpatched",
                         hint="it is for pins that serve another pinned engine (`serves` in upstream.lock); "
                              "use --unpatched for the pristine release of this one")
    return entry.serves


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


def tree_blocker(cfg: Config, lock: Lock, entry: LockEntry, spec: VariantSpec, unpatched: bool) -> str | None:
    """Why the run needs the pin's source tree and no configured source can provide it here
    (`upstream.sources.source_blocker`), or None. A run needs the tree to apply the stack, and
    unpatched where no release wheel stands for the pristine build; a bundle installed here
    (`dsadapt install --offline`) needs neither. Answered before any work (a model made, a
    reference run), as `dsadapt list` answers it."""
    from patcher.formats.bundle import find_record

    if find_record(cfg, entry.ref, spec.name) is not None:
        return None
    if unpatched and entry.artifact(spec.artifact_variant, wheel=True) is not None:
        return None  # the pristine build is the pinned release wheel: no tree
    if "pypi" in cfg.sources and entry.source_artifact() is not None:
        return None  # the release artifact provides the tree (the probe below could only agree)
    from patcher.upstream.sources import source_blocker

    return source_blocker(cfg, lock.engine(entry.engine), entry)


# ---------------------------------------------------------------- the request and its plan


@dataclass(frozen=True)
class CheckRequest:
    """One gate run as the user asked for it, carried unchanged from the command line to the engine
    (`run_check` makes the engine's part of it, `engines.base.GateRun`). `dtype` None: every
    dtype the engine serves (`dtypes_served`)."""

    pin: PinRef
    model: str = "v3"                 # a built-in model name or a model directory
    config_style: str | None = None   # the built-in model's config.json style (None: the engine's)
    dtype: str | None = None
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
                + (f" --dtype {self.dtype}" if self.dtype else "") + parallel_flags(self.parallel)
                + (" --unpatched" if self.unpatched else "")
                + (f" --prompt-seed {self.prompt_seed}" if self.prompt_seed else ""))


def parallel_flags(parallel: Parallel) -> str:
    """The command-line flags of a parallel configuration (empty for one process)."""
    return "" if parallel.single else f" --tp {parallel.tp}" + (" --ep" if parallel.ep else "")


@dataclass(frozen=True)
class CheckPlan:
    """A `CheckRequest` resolved once, before anything is made: what every run of the command
    (one per dtype) starts from."""

    cfg: Config
    lock: Lock
    req: CheckRequest
    entry: LockEntry
    spec: VariantSpec
    eng: Engine
    model: ModelChoice
    stack: Stack
    dtypes: tuple[str, ...]        # the dtypes to check: --dtype, or every one the engine serves here
    reference_device: str          # where the float32 reference runs (`where_reference_runs`)

    def request(self, dtype: str) -> CheckRequest:
        """The request of one run of this plan (one dtype)."""
        return replace(self.req, dtype=dtype)


def plan_check(cfg: Config, lock: Lock, req: CheckRequest, model: ModelChoice | None = None,
               capture: bool = False) -> CheckPlan:
    """Everything a check can tell before it touches anything, in the order a user meets it: the
    model (exit 2) and whether it splits over the ranks (2); the served engine --unpatched-engine
    names (2); the pin, the variant and whether it can run here in this parallel configuration (6);
    the checkpoint (2 or 6); the dtype (2: checked after the machine, so a dtype a GPU-only engine
    serves is never called bad input on a machine without a GPU); where the reference runs; the
    stack; whether a source can provide the tree (6). `model`: the --model already chosen (for this parallel configuration);
    `capture`: the run must compare modules (`dsadapt bisect`), so the engine needs a capture
    table (6), and it runs in one dtype (--dtype, or the first the engine serves)."""
    model = model if model is not None and model.split == req.parallel else choose_model(req.model, req.parallel)
    if req.unpatched_engine:
        served_engine_of(lock, req.pin)
    command = req.command or f"dsadapt check {req.pin}"
    entry, spec, eng = runnable_engine(lock, req.pin, req.variant, command, req.parallel)
    model_preflight(entry, spec, eng, model.config, req.dtype)
    if dtype_blocker(eng, spec, req.dtype):
        served = eng.gate_dtypes(spec)
        raise UsageError(f"{req.pin} ({spec.name}) does not run in {req.dtype} for the gate",
                         hint=f"its runner supports {', '.join(served)}: pass --dtype {served[0]}"
                         if served else f"see {eng.docs_page}")
    if capture and getattr(eng, "bisect_table", None) is None:
        raise EngineUnavailable(f"{req.pin.engine} has no capture table: it cannot be bisected",
                                hint="see docs/equivalence.md (Bisect) for the engines that can")
    device = where_reference_runs(req.reference_on, spec)
    stack = load_stack(cfg.patches_root, req.pin)
    no_tree = tree_blocker(cfg, lock, entry, spec, req.unpatched)
    if no_tree:
        raise SourceError(f"{req.pin} cannot be checked here: {no_tree}",
                          hint="configure a mirror (DSADAPT_MIRRORS), allow PyPI, or check the network; "
                               "`dsadapt list` says which pins can run here")
    from patcher.artifacts.envlocks import require_lock

    require_lock(cfg.project, lock, entry, spec)  # no environment lock: one line, before any work (exit 6)
    dtypes = (req.dtype,) if req.dtype else dtypes_served(eng, spec, model.config)
    if capture:
        dtypes = dtypes[:1]
    return CheckPlan(cfg, lock, req, entry, spec, eng, model, stack, dtypes, device)


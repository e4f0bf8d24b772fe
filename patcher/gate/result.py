"""What a check found: `CheckResult` (typed: the comparison, the per-module verdict, the margins),
its report files (JSON and Markdown), and its failure as the command's one error.

A check report (`dsadapt.check-report/1`) is `CheckResult.to_json`; `CheckResult.from_json`
reads one back (rescoring). The wording of where a failing check leaves the reference is
`FirstDivergence.words` (patcher/rules/divergence.py), here as everywhere.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from patcher.base.errors import CheckFailed, number, plural
from patcher.engines.base import SINGLE, Parallel
from patcher.gate.plan import parallel_flags
from patcher.rules.divergence import ModuleVerdict
from patcher.rules.logits import LOW_PRECISION_DTYPES, Comparison
from patcher.rules.verdicts import Margins

REPORT_SCHEMA = "dsadapt.check-report/1"
#: what a check report's `comparison` is when the engine produced no logits (no rule was applied)
_NO_LOGITS: dict = {"rule": None, "rows": [], "passed": False}


@dataclass
class GateRun:
    """What a gate run (a check, a perf run) ran: the pin, its engine and variant, the model (with
    the config style it was given in) and the dtype. Its results carry these first."""

    pin: str
    engine: str
    variant: str
    model: str
    config_style: str | None
    dtype: str


@dataclass
class CheckResult(GateRun):
    unpatched: bool
    verdict: str
    reasons: list[str]
    explanation: list[str]
    report_path: str
    plot_path: str | None
    provenance: dict
    timings: dict
    #: the logit rule's comparison; None when the engine produced no logits (`no_logits` says why)
    comparison: Comparison | None = field(repr=False, default=None)
    #: the per-module comparison, when this check ran one
    bisect: ModuleVerdict | None = None
    #: how far the worst judged quantity is from its limit (`patcher.rules.verdicts.check_margins`)
    margins: Margins | None = None
    #: how the engine was spread: {"tp", "ep", "world_size", "label"} (`Parallel.to_json`);
    #: reports of different parallel configurations have different names and never replace each other
    parallel: dict = field(default_factory=SINGLE.to_json)
    #: why the engine produced no logits (its run failed), when it did not
    no_logits: str | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def configuration(self) -> Parallel:
        """The parallel configuration it ran in."""
        return Parallel(int(self.parallel.get("tp") or 1), bool(self.parallel.get("ep")))

    @property
    def max_abs(self) -> float | None:
        """The comparison's largest |Δ logprob| (None without logits or when it is not finite)."""
        v = (self.comparison.summary or {}).get("max_abs") if self.comparison is not None else None
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _TYPED}
        d["comparison"] = self.comparison.to_json() if self.comparison is not None else \
            {**_NO_LOGITS, "reasons": [self.no_logits] if self.no_logits else []}
        d["bisect"] = self.bisect.to_json() if self.bisect is not None else None
        d["margins"] = self.margins.to_json() if self.margins is not None else None
        return copy.deepcopy(d)  # the report never shares the result's lists

    @classmethod
    def from_json(cls, doc: dict) -> CheckResult:
        """A check report as written (`to_json`; its `schema` and unknown keys ignored)."""
        kw = {f.name: doc[f.name] for f in fields(cls) if f.name in doc and f.name not in _TYPED}
        c = doc.get("comparison") or {}
        if c.get("rule") is None:
            kw["comparison"], kw["no_logits"] = None, next(iter(c.get("reasons") or []), None)
        else:
            kw["comparison"] = Comparison.from_json(c)
        kw["bisect"] = ModuleVerdict.from_json(doc["bisect"]) if doc.get("bisect") else None
        kw["margins"] = Margins.from_json(doc["margins"]) if doc.get("margins") else None
        return cls(**kw)


_TYPED = ("comparison", "bisect", "margins", "no_logits")


def verdict_reasons(logit_reasons: list[str], dtype: str, bisected: ModuleVerdict | None) -> list[str]:
    """Why a check fails (empty: it passes): the logit rule's reasons and, in low precision, a module
    beyond its limit (docs/equivalence.md)."""
    reasons = list(logit_reasons)
    if bisected is not None and dtype in LOW_PRECISION_DTYPES and bisected.passed is False:
        reasons += [f"per-module comparison ({dtype}): {r}" for r in bisected.reasons[:1]]
    return reasons


# ---------------------------------------------------------------- the report files


def num(x, spec: str = ".2g") -> str:
    """A number of a report's tables: "-" for none (and for what is not finite: stored as null)."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def check_markdown(result: CheckResult) -> str:
    """Pure: the human-readable check report written next to the JSON (<report>.md): the verdict,
    why, its margin, one row per prompt, and where it ran."""
    c = result.comparison
    lines = [f"# {heading(result)}: {result.verdict.upper()}", "", f"Model {model_words(result)}.", ""]
    if result.reasons:
        lines += ["**Why it fails**", "", *(f"- {r}" for r in result.reasons[:20]), ""]
    if result.margins and result.margins.words:
        lines += [f"**Margin**: {result.margins.words}", ""]
    if c is not None and c.rows:
        lines += ["| prompt | positions | max \\|Δ\\| | mean \\|Δ\\| | top-1 agree | greedy | 1st divergence | verdict |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in c.rows:
            greedy = {True: "yes", False: "NO", None: "-"}.get(r.greedy_match)
            first = "-" if r.first_divergence is None else str(r.first_divergence)
            lines.append(f"| {r.id} | {r.positions} | {num(r.max_abs)} | {num(r.mean_abs)} | "
                         f"{num(r.top1_agreement, '.3f')} | {greedy} | {first} | "
                         f"{'pass' if c.row_passed(r) else 'FAIL'} |")
        lines.append("")
    b = result.bisect
    if b is not None and b.report_path:
        lines += [f"Per-module comparison: `{Path(b.report_path).name}`"
                  + (f", heat map `{Path(b.plot_path).name}`" if b.plot_path else ""), ""]
    if result.explanation and not result.passed:
        lines += ["**Where it points**", "", *(f"- {e}" for e in result.explanation), ""]
    if result.plot_path:
        lines += [f"![per-position |Δ logprob|]({Path(result.plot_path).name})", ""]
    return "\n".join(lines + _provenance_table(result.provenance or {})) + "\n"


def heading(result: CheckResult) -> str:
    """``PIN (variant[, unpatched][, tp2]) vs HF transformers``: a check's title in reports and tables."""
    par = result.configuration
    return (f"{result.pin} ({result.variant}{', unpatched' if result.unpatched else ''}"
            f"{', ' + par.label if not par.single else ''}) vs HF transformers")


def model_words(result: CheckResult) -> str:
    """``v3 (transformers config), float32, strict rule, tolerance 0.0008``."""
    c = result.comparison
    return (f"{result.model}" + (f" ({result.config_style} config)" if result.config_style else "")
            + f", {result.dtype}, {(c.rule if c else None) or 'no'} rule"
            + (f", tolerance {number(c.tolerance)}" if c is not None and c.tolerance else ""))


def _provenance_table(prov: dict) -> list[str]:
    lines = ["| provenance | |", "| --- | --- |",
             f"| date | {prov.get('date', '-')} |", f"| device | {prov.get('device', '-')} |",
             f"| stack | {(prov.get('stack_hash') or '-')[:12]} ({plural(len(prov.get('patches') or []), 'patch')}) |",
             f"| engine | {prov.get('engine_version') or '-'} ({(prov.get('installed') or {}).get('artifact', '-')}) |",
             f"| reference | transformers {(prov.get('reference_versions') or {}).get('transformers', '-')} on "
             f"{prov.get('reference_device', '-')} |",
             f"| command | `{prov.get('command', '-')}` |"]
    if prov.get("rescored"):
        lines.append(f"| rescored | {prov['rescored'].get('date')} (was {prov['rescored'].get('previous_verdict')}) |")
    return lines


def write_report(result: CheckResult, out: Path) -> None:
    """The check report: JSON (schema dsadapt.check-report/1) and its Markdown twin, each written whole."""
    from patcher.base.fsutil import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"schema": REPORT_SCHEMA, **result.to_json()}, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out.with_suffix(".md"), check_markdown(result))


# ---------------------------------------------------------------- a failure as the command's error


def bisect_command(result: CheckResult) -> str:
    """The `dsadapt bisect` command that localizes this check's failure (in its own dtype)."""
    from patcher.checkpoints.tiny import VARIANTS
    from patcher.gate.bisect import command

    model = result.model if result.model in VARIANTS else (result.provenance.get("model_dir") or result.model)
    seed = int((result.provenance or {}).get("prompt_seed") or 0)
    return command(result.pin, model, result.config_style, result.dtype, result.unpatched) + \
        parallel_flags(result.configuration) + (f" --prompt-seed {seed}" if seed else "")


def check_or_raise(result: CheckResult) -> None:
    """CheckFailed (exit 1) for a failing check: where it leaves the reference and why, with the
    report and the command that localizes it."""
    if result.passed:
        return
    hint = f"report: {result.report_path}"
    if result.bisect is not None and result.bisect.report_path:
        hint += f"; bisect report: {result.bisect.report_path}"
    else:
        hint += f"; localize the layer and module with `{bisect_command(result)}`"
    if not (result.explanation and "--explain" in (result.provenance.get("command") or "")):
        hint += "; rerun with --explain for the likely layer family"
    raise CheckFailed(f"{result.pin} failed the equivalence gate{failure_where(result)}: {'; '.join(result.reasons[:2])}",
                      hint=hint)


def failure_where(result: CheckResult) -> str:
    """Where the per-module comparison says the engine leaves the reference, in the failure's first
    words (the configuration, the first divergence, its layer family), when one ran."""
    first = result.bisect.first if result.bisect is not None else None
    if first is None:
        return ""
    par = result.configuration
    return f"{'' if par.single else ' at ' + par.label} ({first.words()}; {first.family})"

"""A check over several dtypes or every pin: one verdict each, and one overall.

`check_pin` runs a `CheckPlan` in each of its dtypes (one build and install for all of them);
`pin_or_raise` turns its runs into the command's one error; `check_all` plans and runs every
pin of the lock, and says of each pin that cannot run here why (never counted as a pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from patcher.base.config import Config
from patcher.base.errors import CheckFailed, DsadaptError, ExitCode
from patcher.engines.registry import engine
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import load_stack
from patcher.gate.equivalence import run_check
from patcher.gate.hosts import RunHost
from patcher.gate.plan import CheckPlan, CheckRequest, ModelChoice, dtype_blocker, plan_check, run_blocker
from patcher.gate.result import CheckResult, check_or_raise, failure_where

OnResult = Callable[[CheckResult], None]


def check_pin(plan: CheckPlan, host: RunHost, on_line: Callable[[str], None] | None = None,
              on_result: OnResult | None = None) -> list[CheckResult]:
    """Every dtype of the plan, one run each, on one host (the engine built and installed once);
    `on_result` hears each result as it comes."""
    done = []
    for dtype in plan.dtypes:
        res = run_check(plan, dtype, host=host, on_line=on_line)
        done.append(res)
        if on_result is not None:
            on_result(res)
    return done


def overall_json(pin: str, results: Sequence[CheckResult]) -> dict:
    """`check PIN --json` over several dtypes: one verdict per dtype and one overall."""
    return {"schema": "dsadapt.check-dtypes/1", "pin": pin, "parallel": results[0].parallel,
            "verdict": "pass" if all(r.passed for r in results) else "fail",
            "dtypes": {r.dtype: r.verdict for r in results}, "results": [r.to_json() for r in results]}


def pin_or_raise(pin: str, results: Sequence[CheckResult]) -> None:
    """CheckFailed (exit 1) when a run failed: over several dtypes one line naming every dtype that
    failed and why the first did; with the first failure's hint."""
    failed = [r for r in results if not r.passed]
    if failed and len(results) > 1:
        first = failed[0]
        try:
            check_or_raise(first)
        except CheckFailed as e:
            raise CheckFailed(f"{pin} failed the equivalence gate in {', '.join(r.dtype for r in failed)}: "
                              f"{first.dtype}{failure_where(first)}: {'; '.join(first.reasons[:2])}",
                              hint=e.hint) from None
    for r in failed:
        check_or_raise(r)


@dataclass
class PinOutcome:
    """One pin of `check --all`: its verdict (pass, fail, not run, error), why, and its runs."""

    pin: str
    verdict: str
    reason: str | None = None
    runs: list[CheckResult] = field(default_factory=list)
    parallel: dict | None = None   # the configuration asked for (None: a pin that failed to run)
    exit_code: int | None = None   # an error's

    @property
    def ran(self) -> bool:
        return self.verdict in ("pass", "fail")

    def to_json(self) -> dict:
        if not self.ran:
            doc: dict = {"pin": self.pin, "verdict": self.verdict, "reason": self.reason}
            if self.parallel is not None:
                doc["parallel"] = self.parallel
            if self.exit_code is not None:
                doc["exit_code"] = self.exit_code
            return doc
        runs, bad = self.runs, [r for r in self.runs if not r.passed]
        return {"pin": self.pin, "verdict": self.verdict, "parallel": self.parallel,
                "dtypes": {r.dtype: r.verdict for r in runs},
                "report": runs[0].report_path if len(runs) == 1 else [r.report_path for r in runs],
                "reasons": [f"{r.dtype}: {x}" if len(runs) > 1 else x for r in bad for x in r.reasons]}


def _blocker(cfg: Config, entry: LockEntry, req: CheckRequest) -> str | None:
    """Why `check --all` passes a pin over without trying it: the machine, the dtype, no stack."""
    eng = engine(entry.engine)
    spec = eng.variant_for(entry, None)
    blocker = run_blocker(entry, spec, eng, req.parallel) or dtype_blocker(eng, spec, req.dtype)
    if not load_stack(cfg.patches_root, entry.ref, must_exist=False).exists:
        blocker = "no stack"
    return blocker


def check_all(cfg: Config, lock: Lock, request: Callable[[PinRef], CheckRequest], model: ModelChoice,
              host_for: Callable[[], RunHost], on_line: Callable[[str], None] | None = None) -> list[PinOutcome]:
    """Every pin of the lock, in order, checked as `request(pin)` asks: a pin that cannot run here
    is "not run" with the reason, one whose run broke is an "error"; neither stops the others.
    `host_for` makes each pin's host."""
    outcomes = []
    for entry in lock.sorted_pins():
        pin, req = str(entry.ref), request(entry.ref)
        parallel = req.parallel.to_json()
        blocker = _blocker(cfg, entry, req)
        if blocker:
            outcomes.append(PinOutcome(pin, "not run", blocker, parallel=parallel))
            continue
        try:
            plan = plan_check(cfg, lock, req, model)
            runs = check_pin(plan, host_for(), on_line)
        except DsadaptError as e:
            if e.exit_code == ExitCode.CANNOT_RUN:  # not runnable here (no GPU, no source): never a pass
                outcomes.append(PinOutcome(pin, "not run", e.message))
            else:
                outcomes.append(PinOutcome(pin, "error", e.message, exit_code=int(e.exit_code)))
            continue
        outcomes.append(PinOutcome(pin, "pass" if all(r.passed for r in runs) else "fail", runs=runs,
                                   parallel=parallel))
    return outcomes

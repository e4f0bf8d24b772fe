"""check: the logit-equivalence gate, from the command line."""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import click

from patcher.base.errors import DsadaptError, ExitCode, UsageError, number, plural
from patcher.base.workdir import workdir_lock
from patcher.cli.commands import common
from patcher.formats.pinref import PinRef
from patcher.gate.plan import CheckRequest, ModelChoice, choose_model
from patcher.gate.result import CheckResult, bisect_command, check_or_raise, heading, num
from patcher.rules.divergence import ModuleVerdict
from patcher.rules.logits import Comparison, PromptRow


def command_line(click_ctx: click.Context) -> str:
    """The check command as the user gave it (their flags only, in a canonical order)."""
    parts = ["dsadapt", "check"]
    for param in click_ctx.command.params:
        name = param.name
        if name in ("as_json",) or name is None:
            continue
        source = click_ctx.get_parameter_source(name)
        if source is None or source.name not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value = click_ctx.params.get(name)
        if isinstance(param, click.Argument):
            parts.append(shlex.quote(str(value)))
        elif getattr(param, "is_flag", False):
            if value:
                parts.append(param.opts[0])
        elif value is not None:
            parts += [param.opts[0], shlex.quote(str(value))]
    return " ".join(parts)


def _row_verdict(c: Comparison, r: PromptRow) -> str:
    if c.rule != "low-precision":
        return "pass" if c.row_passed(r) else "FAIL"
    # the low-precision rule is pooled over all prompts: a row only fails by itself on token ids
    if r.failures:
        return "FAIL"
    return "pooled: pass" if c.passed else "pooled: FAIL"


def render(res: CheckResult) -> None:
    c = res.comparison
    if c is None or not c.rows:
        common.out(f"{res.pin}: the engine produced no logits")
    else:
        rows = [[r.id, str(r.positions), num(r.max_abs), num(r.mean_abs), num(r.top1_agreement, ".3f"),
                 {True: "yes", False: "NO", None: "-"}.get(r.greedy_match),
                 "-" if r.first_divergence is None else str(r.first_divergence), _row_verdict(c, r)]
                for r in c.rows]
        title = (f"{heading(res)} — model {res.model}{' (' + res.config_style + ' config)' if res.config_style else ''}, "
                 f"{res.dtype}, {c.rule} rule" + (f", tolerance {number(c.tolerance)}" if c.tolerance else ""))
        common.table(title, ["prompt", "positions", "max |Δ|", "mean |Δ|", "top-1 agree", "greedy", "1st div",
                             "verdict"], rows)
    if res.bisect:
        render_bisect_summary(res.bisect)
    common.out(f"verdict: {res.verdict.upper()}" + ("" if res.passed else f" — {'; '.join(res.reasons[:3])}"),
               verdict=res.verdict.upper())
    if res.margins and res.margins.words:
        common.out(f"margins: {res.margins.words}")
    for line in res.explanation if not res.passed else []:
        common.out(f"  explain: {line}")
    common.out(f"report: {res.report_path}" + (f"  plot: {res.plot_path}" if res.plot_path else ""))
    if not res.passed and not (res.bisect and res.bisect.report_path):
        common.out(f"localize it: {bisect_command(res)}")


def render_bisect_summary(b: ModuleVerdict) -> None:
    """The per-module comparison in a check's output: where it leaves the reference, or that it does not."""
    f = b.first
    if f is not None:
        phase = f", {f.phase} rows" if f.phase else ""
        ratio = f", {f.ratio:.2f}x the reference's own error" if f.ratio is not None else ""
        common.out(f"per-module ({b.dtype}, {b.rule} rule): {f.words()}{phase}{ratio}; "
                   f"{len(b.above)} point(s) above their limits of {b.compared}")
    elif b.passed:
        common.out(f"per-module ({b.dtype}, {b.rule} rule): {plural(b.compared or 0, 'point')} within their limits")
    else:
        for r in b.reasons:
            common.out(f"per-module: {r}")
    if b.report_path:
        common.out(f"bisect report: {b.report_path}" + (f"  heat map: {b.plot_path}" if b.plot_path else ""))


@click.command("check")
@click.argument("pin", metavar="[ENGINE@TAG]", required=False, type=common.PinRefParam())
@common.model_options
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "fp8"]), default=None,
              help="Check one dtype (default: every dtype the engine serves here — float32 where it has it, "
                   "bfloat16, float16 — one verdict each and one overall; fp8, and only fp8, for a block-FP8 checkpoint).")
@common.build_options("Check")
@click.option("--all", "all_pins", is_flag=True, help="Every pin that can run here; the others are listed with the reason.")
@click.option("--explain", is_flag=True, help="Print where the first divergence is and which layer family it points to.")
@click.option("--reference-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the float32 HF reference runs (auto: the GPU for a CUDA engine on a GPU machine, else the CPU).")
@click.option("--bisect", "bisect", is_flag=True,
              help="When the gate fails, compare every layer's modules with HF (`dsadapt bisect`) from the same "
                   "engine run and name the first that diverges. Low-precision checks always do.")
@common.parallel_options
@common.prompt_seed_option
@click.option("--rescore", "rescore_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Apply the current rule to a saved check report's recorded inputs instead of running anything; "
                   "rewrites the report and its plot (a report made before inputs were kept cannot be rescored: "
                   "it says which command reruns it).")
@common.junit_option
@common.publish_option
@common.json_option
@common.pass_ctx
def check_cmd(ctx: common.Context, pin, model, config_style, dtype, variant, unpatched, unpatched_engine, all_pins,
              explain, reference_device, bisect, tp, ep, prompt_seed, rescore_path, junit, as_json) -> None:
    """Run the engine and HF transformers on the same prompts and compare logits. Exit 0 only on pass.

    With --tp N [--ep] the engine runs on N ranks and the same comparison runs against the
    one-process reference: the logits, and per module every rank's view (docs/equivalence.md,
    "Parallel runs"); its report is named for the configuration (…-tp2.json)."""
    if rescore_path is not None:
        if pin or all_pins:
            raise UsageError("pass --rescore REPORT or a pin (or --all), not both",
                             hint="the report names its pin; e.g. dsadapt check --rescore reports/vllm/v0.32.0/"
                                  "v3-transformers-float32.json")
        _rescore(rescore_path, junit, as_json)
        return
    if bool(pin) == all_pins:
        raise UsageError("name one ENGINE@TAG or pass --all", hint="e.g. dsadapt check vllm@v0.32.0 --model v3")
    if all_pins and unpatched_engine:
        raise UsageError("--unpatched-engine names one pin's served engine: it does not go with --all",
                         hint="dsadapt check ENGINE@TAG --unpatched-engine")
    parallel = common.to_parallel(tp, ep)
    choice = choose_model(model, parallel)
    request = partial(CheckRequest, model=model, config_style=config_style, dtype=dtype, reference_on=reference_device,
                      bisect="on-fail" if bisect else None, command=command_line(click.get_current_context()),
                      tp=parallel.tp, ep=parallel.ep, prompt_seed=prompt_seed)
    if all_pins:
        what = dtype or "every dtype each engine serves"
        _check_all(ctx, request, choice, f"dsadapt check --all (model {model}, {what}"
                   f"{'' if parallel.single else ', ' + parallel.describe()})", junit, as_json)
        return
    from patcher.formats.bundle import default_variant

    ref = common.to_ref(pin)
    assert ref is not None
    _check_one(ctx, request(ref, variant=default_variant(ctx.cfg, ref, variant), unpatched=unpatched,
                            unpatched_engine=unpatched_engine), choice, explain, junit, as_json)


def _rescore(path: Path, junit, as_json: bool) -> None:
    from patcher.gate.equivalence import rescore_check

    res = rescore_check(path)
    if as_json:
        common.emit_json({"schema": "dsadapt.check-report/1", **res.to_json()})
    else:
        render(res)
    report_ci([res], junit)
    check_or_raise(res)


def _check_one(ctx: common.Context, req: CheckRequest, choice: ModelChoice, explain: bool, junit,
               as_json: bool) -> None:
    """One pin, every dtype asked: planned first (bad input, cannot run here: before anything is
    made), then run on one host (one build and install)."""
    from patcher.gate.hosts import RunHost
    from patcher.gate.overall import check_pin, overall_json, pin_or_raise
    from patcher.gate.plan import plan_check

    name = f"{req.pin}{' ' + req.variant if req.variant else ''}"
    with skipped_case_on_cannot_run(junit, name):  # cannot run here (no lock, no GPU): a skipped JUnit case
        plan = plan_check(ctx.cfg, ctx.lock, req, choice)
    progress = common.progress_printer()

    def shown(res: CheckResult) -> None:
        render(res)
        if explain and res.passed:
            common.out(f"  explain: {res.explanation[0] if res.explanation else 'equivalent'}")

    with skipped_case_on_cannot_run(junit, f"{req.pin} {plan.spec.name}"), workdir_lock(ctx.cfg):
        done = check_pin(plan, RunHost(ctx.cfg, ctx.lock, progress, not as_json),
                         progress.note if progress is not None else None, None if as_json else shown)
    if as_json:
        common.emit_json(done[0].to_json() if len(done) == 1 else overall_json(str(req.pin), done),
                         schema="dsadapt.check-report/1")
    elif len(done) > 1:
        word = "PASS" if all(r.passed for r in done) else "FAIL"
        common.out(f"overall: {word} (" + ", ".join(f"{r.dtype} {r.verdict}" for r in done) + ")", verdict=word)
    report_ci(done, junit)
    pin_or_raise(str(req.pin), done)


def _check_all(ctx: common.Context, request: Callable[[PinRef], CheckRequest], choice: ModelChoice, title: str, junit,
               as_json: bool) -> None:
    from patcher.gate.hosts import RunHost
    from patcher.gate.overall import check_all

    progress = common.progress_printer()
    with workdir_lock(ctx.cfg):
        outcomes = check_all(ctx.cfg, ctx.lock, request, choice,
                             lambda: RunHost(ctx.cfg, ctx.lock, progress, not as_json),
                             progress.note if progress is not None else None)
    report_ci([r for o in outcomes for r in o.runs], junit,
              [(o.pin, o.reason or "", o.verdict == "error") for o in outcomes if not o.ran])
    failed = any(o.verdict in ("fail", "error") for o in outcomes)
    if as_json:
        common.emit_json({"results": [o.to_json() for o in outcomes], "ok": any(o.ran for o in outcomes) and not failed},
                         schema="dsadapt.check-all/1")
    else:
        common.table(title, ["pin", "verdict", "detail"], [_all_row(o) for o in outcomes])
        common.out(f"{sum(o.verdict == 'pass' for o in outcomes)} passed, "
                   f"{sum(o.verdict in ('fail', 'error') for o in outcomes)} failed, "
                   f"{sum(o.verdict == 'not run' for o in outcomes)} not run here (never counted as passes)")
    if failed:
        sys.exit(ExitCode.FAILED)
    if not any(o.ran for o in outcomes):
        sys.exit(ExitCode.CANNOT_RUN)


def _all_row(o) -> list[str]:
    """A row of `check --all`'s table: the pin (with each dtype's verdict), the verdict, the detail."""
    if not o.ran:
        return [o.pin, o.verdict, o.reason or ""]
    runs, bad = o.runs, [r for r in o.runs if not r.passed]
    name = o.pin + ("" if len(runs) == 1 else " (" + ", ".join(f"{r.dtype} {r.verdict}" for r in runs) + ")")
    detail = (runs[0].report_path if o.verdict == "pass" and len(runs) == 1 else
              "; ".join(f"{r.dtype}: {'; '.join(r.reasons[:1])}" for r in bad) if bad else "every dtype passed")
    return [name, o.verdict, detail]


@contextlib.contextmanager
def skipped_case_on_cannot_run(junit, name: str):
    """A check that cannot run here (exit 6: no GPU, no environment lock, no source) still leaves
    its JUnit case, skipped with the reason: never a pass, never missing from CI's test report."""
    try:
        yield
    except DsadaptError as e:
        if e.exit_code == ExitCode.CANNOT_RUN:
            report_ci([], junit, [(name, e.message, False)])
        raise


def report_ci(results: list[CheckResult], junit, not_run: Sequence[tuple[str, str, bool]] = ()) -> None:
    """The verdicts for CI: JUnit XML (--junit FILE) and, on GitHub Actions, a table in the job's
    summary (failures become `::error` annotations at the error edge)."""
    from patcher.cli.ci import Case, md_table, step_summary, write_junit
    from patcher.rules.verdicts import configuration

    def label(r: CheckResult) -> str:  # tp2, unpatched, seedN included: no two runs share a name
        return configuration(r.to_json())

    cases = [Case(f"{r.pin} {label(r)}", f"dsadapt.check.{r.engine}", float(r.timings.get("total_s") or 0),
                  failure=None if r.passed else ("\n".join(r.reasons) or "fail"),
                  output=f"report: {r.report_path}", properties={"stack": r.provenance.get("stack_hash") or "",
                                                                 "device": r.provenance.get("device") or ""})
             for r in results]
    cases += [Case(pin, "dsadapt.check", failure=why if error else None, skipped=None if error else why)
              for pin, why, error in not_run]
    write_junit(junit, "dsadapt check", cases)
    rows = [[r.pin, label(r), r.verdict.upper(), num(r.max_abs),
             "; ".join(r.reasons[:2]) or "-", Path(r.report_path).name] for r in results]
    rows += [[pin, "-", "ERROR" if error else "not run", "-", why, "-"] for pin, why, error in not_run]
    step_summary("### dsadapt check\n\n" + md_table(["pin", "configuration", "verdict", "max |Δ|", "why", "report"],
                                                       rows))


COMMANDS = [check_cmd]

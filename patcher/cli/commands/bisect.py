"""bisect: name the layer and module where an engine leaves the HF reference."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from patcher.base.errors import CheckFailed, DsadaptError
from patcher.base.workdir import workdir_lock
from patcher.cli.commands import common
from patcher.gate.equivalence import run_check
from patcher.gate.hosts import RunHost
from patcher.gate.plan import CheckRequest, choose_model, plan_check
from patcher.gate.result import CheckResult, heading, num
from patcher.rules.divergence import FirstDivergence, ModuleVerdict
from patcher.rules.modules import PointResult


def _point_row(p: PointResult, first: FirstDivergence | None, parallel: bool) -> list[str]:
    """A row of the per-module table: layer, point, (rank,) error, limit, the reference's noise, rows, status."""
    agreement = p.metric == "agreement"
    err = f"{p.value:.1%} agree" if agreement and p.value is not None else num(p.error, ".3g")
    limit = f">= {1 - p.limit:.1%}" if agreement and p.limit is not None else num(p.limit, ".3g")
    status = {"above": "ABOVE", "ok": "ok", "not compared": "-"}.get(p.status, p.status)
    if first is not None and (p.layer, p.point) == (first.layer, first.point):
        status = "FIRST"
    row = ["-" if p.layer is None else str(p.layer), p.label, err, limit, num(p.noise, ".3g"), str(p.rows or "-"),
           status]
    if parallel:
        row.insert(2, "sum" if p.layout == "partial" else "-" if p.rank is None else str(p.rank))
    return row


def render(res: CheckResult, b: ModuleVerdict, points: list[PointResult] | None) -> None:
    parallel = not res.configuration.single
    if points is not None:
        columns = ["layer", "point", "error", "limit", "ref noise", "rows", "status"]
        if parallel:
            columns.insert(2, "rank")
        common.table(f"{heading(res)}, per module — model {res.model}"
                     f"{' (' + res.config_style + ' config)' if res.config_style else ''}, {res.dtype}, {b.rule} rule",
                     columns, [_point_row(p, b.first, parallel) for p in points])
    for line in b.explanation or b.reasons:
        common.out(f"  {line}")
    common.out(f"logit gate: {res.verdict.upper()}" + ("" if res.passed else f" — {'; '.join(res.reasons[:2])}"))
    if b.report_path:
        common.out(f"bisect report: {b.report_path}" + (f"  heat map: {b.plot_path}" if b.plot_path else ""))
    common.out(f"check report: {res.report_path}")


@click.command("bisect", short_help="Name the first (layer, module) where the engine diverges from HF transformers on the gate's prompts.")
@click.argument("pin", metavar="ENGINE@TAG", type=common.PinRefParam())
@common.model_options
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "fp8"]), default=None,
              help="The engine's dtype (default: float32 where the engine has it, else its first; fp8 for a "
                   "block-FP8 checkpoint).")
@common.build_options("Bisect")
@common.parallel_options
@common.prompt_seed_option
@common.json_option
@common.pass_ctx
def bisect_cmd(ctx: common.Context, pin, model, config_style, dtype, variant, unpatched, unpatched_engine, tp, ep,
               prompt_seed, as_json) -> None:
    """Compare every decoder layer's modules with HF transformers on the gate's prompts and name the first
    (layer, module) that diverges. One engine start, one reference run. Exit 0 when every point is within
    its limit, 1 when one is not (the report says where)."""
    ref = common.to_ref(pin)
    assert ref is not None  # PIN is a required argument
    parallel = common.to_parallel(tp, ep)
    choice = choose_model(model, parallel)
    command = "dsadapt " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    req = CheckRequest(ref, model=model, config_style=config_style, dtype=dtype, variant=variant, unpatched=unpatched,
                       unpatched_engine=unpatched_engine, bisect="always", command=command, tp=parallel.tp,
                       ep=parallel.ep, prompt_seed=prompt_seed)
    # bad variant/dtype, cannot run here (this checkpoint, this parallel configuration, no capture table):
    # before anything is made
    plan = plan_check(ctx.cfg, ctx.lock, req, choice, capture=True)
    dtype = plan.dtypes[0]
    progress = common.progress_printer()
    with workdir_lock(ctx.cfg):
        res = run_check(plan, dtype, host=RunHost(ctx.cfg, ctx.lock, progress, not as_json),
                        on_line=progress.note if progress is not None else None)
    b = res.bisect
    if b is None:  # the engine produced nothing to compare (it failed to load or run the model)
        if as_json:
            common.emit_json({"schema": "dsadapt.bisect-report/1", "pin": str(ref), "dtype": dtype, "passed": False,
                              "first": None, "reasons": res.reasons, "check": res.to_json()})
        raise CheckFailed(f"{ref}: nothing to bisect — {'; '.join(res.reasons[:1])}",
                          hint=f"check report: {res.report_path}")
    report = json.loads(Path(b.report_path).read_text()) if b.report_path and Path(b.report_path).is_file() else None
    if as_json:
        common.emit_json(report or {"schema": "dsadapt.bisect-report/1", "pin": str(ref), **b.to_json()},
                         schema="dsadapt.bisect-report/1")
    else:
        render(res, b, [PointResult.from_json(p) for p in report["points"]] if report else None)
    if b.passed is False:
        if b.first is not None:
            raise CheckFailed(f"{ref} in {dtype}" + ("" if parallel.single else f" at {parallel.describe()}")
                              + f": {b.first.words()}", hint=f"bisect report: {b.report_path}")
        raise DsadaptError(f"{ref}: {'; '.join(b.reasons or ['bisect failed'])}",
                           hint=f"check report: {res.report_path}")


COMMANDS = [bisect_cmd]

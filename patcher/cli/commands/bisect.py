"""bisect: name the layer and module where an engine leaves the HF reference."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from patcher.base.errors import CheckFailed, DsadaptError, EngineUnavailable
from patcher.base.workdir import workdir_lock
from patcher.cli.commands.check import _check_model
from patcher.cli.commands.common import (
    Context,
    PinRefParam,
    emit_json,
    json_option,
    model_option,
    out,
    parallel_options,
    pass_ctx,
    progress_printer,
    prompt_seed_option,
    table,
    to_parallel,
    to_ref,
)
from patcher.engines.registry import engine
from patcher.gate.equivalence import CheckRequest, CheckResult, check_dtypes, check_split, preflight, run_check


def _num(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def render(res: CheckResult, report: dict | None) -> None:
    b = res.bisect or {}
    par = res.parallel or {}
    parallel = int(par.get("tp") or 1) > 1
    if report:
        rows = []
        for p in report["points"]:
            where = "-" if p["layer"] is None else str(p["layer"])
            err = (f"{p['value']:.1%} agree" if p["metric"] == "agreement" and p.get("value") is not None
                   else _num(p.get("error")))
            limit = (f">= {1 - p['limit']:.1%}" if p["metric"] == "agreement" and p.get("limit") is not None
                     else _num(p.get("limit")))
            status = {"above": "ABOVE", "ok": "ok", "not compared": "-"}.get(p["status"], p["status"])
            if report.get("first") and p["layer"] == report["first"]["layer"] and p["point"] == report["first"]["point"]:
                status = "FIRST"
            row = [where, p["label"], err, limit, _num(p.get("noise")), str(p.get("rows") or "-"), status]
            if parallel:
                row.insert(2, "sum" if p.get("layout") == "partial" else str(p.get("rank", "-")))
            rows.append(row)
        columns = ["layer", "point", "error", "limit", "ref noise", "rows", "status"]
        if parallel:
            columns.insert(2, "rank")
        table(f"{res.pin} ({res.variant}{', unpatched' if res.unpatched else ''}"
              f"{', ' + par['label'] if parallel else ''}) vs HF transformers, per module — "
              f"model {res.model}{' (' + res.config_style + ' config)' if res.config_style else ''}, {res.dtype}, "
              f"{b.get('rule')} rule", columns, rows)
    for line in b.get("explanation") or b.get("reasons") or []:
        out(f"  {line}")
    out(f"logit gate: {res.verdict.upper()}" + ("" if res.passed else f" — {'; '.join(res.reasons[:2])}"))
    if b.get("report_path"):
        out(f"bisect report: {b['report_path']}" + (f"  heat map: {b['plot_path']}" if b.get("plot_path") else ""))
    out(f"check report: {res.report_path}")


@click.command("bisect", short_help="Name the first (layer, module) where the engine diverges from HF transformers on the gate's prompts.")
@click.argument("pin", metavar="ENGINE@TAG", type=PinRefParam())
@model_option
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None,
              help="config.json style of a built-in model: transformers (what save_pretrained writes) or deepseek (DeepSeek's released keys). Default: the engine's own (its page in docs/engines/ says which).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "fp8"]), default=None,
              help="The engine's dtype (default: float32 where the engine has it, else its first; fp8 for a "
                   "block-FP8 checkpoint).")
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@click.option("--unpatched", is_flag=True, help="Bisect the pristine upstream release instead of the stack.")
@click.option("--unpatched-engine", is_flag=True, help="For a pin that serves another pinned engine (`serves` in upstream.lock): that engine unpatched, this stack applied.")
@parallel_options
@prompt_seed_option
@json_option
@pass_ctx
def bisect_cmd(ctx: Context, pin, model, config_style, dtype, variant, unpatched, unpatched_engine, tp, ep,
               prompt_seed, as_json) -> None:
    """Compare every decoder layer's modules with HF transformers on the gate's prompts and name the first
    (layer, module) that diverges. One engine start, one reference run. Exit 0 when every point is within
    its limit, 1 when one is not (the report says where)."""
    ref = to_ref(pin)
    assert ref is not None  # PIN is a required argument
    model_config = _check_model(model)
    parallel = to_parallel(tp, ep)
    check_split(model, parallel)
    command = "dsadapt " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    # bad variant/dtype, cannot run here (this checkpoint, this parallel configuration): before anything is made
    preflight(ctx.lock, ref, variant, command, dtype, unpatched_engine, parallel, config=model_config)
    if getattr(engine(ref.engine), "bisect_table", None) is None:
        raise EngineUnavailable(f"{ref.engine} has no capture table: it cannot be bisected",
                                hint="see docs/equivalence.md (Bisect) for the engines that can")
    dtype = dtype or check_dtypes(ctx.lock, ref, variant, config=model_config)[0]
    progress = progress_printer()
    on_line = progress.note if progress is not None else None
    with workdir_lock(ctx.cfg):
        req = CheckRequest(ref, model=model, config_style=config_style, dtype=dtype, variant=variant,
                           unpatched=unpatched, unpatched_engine=unpatched_engine, bisect="always", command=command,
                           tp=parallel.tp, ep=parallel.ep, prompt_seed=prompt_seed)
        res = run_check(ctx.cfg, ctx.lock, req, progress=progress, stream=not as_json, on_line=on_line)
    b = res.bisect
    if b is None:  # the engine produced nothing to compare (it failed to load or run the model)
        if as_json:
            emit_json({"schema": "dsadapt.bisect-report/1", "pin": str(ref), "dtype": dtype, "passed": False,
                       "first": None, "reasons": res.reasons, "check": res.to_json()})
        raise CheckFailed(f"{ref}: nothing to bisect — {'; '.join(res.reasons[:1])}",
                          hint=f"check report: {res.report_path}")
    report = None
    if b.get("report_path") and Path(b["report_path"]).is_file():
        report = json.loads(Path(b["report_path"]).read_text())
    if as_json:
        emit_json(report if report else {"schema": "dsadapt.bisect-report/1", "pin": str(ref), "dtype": dtype, **b}, schema="dsadapt.bisect-report/1")
    else:
        render(res, report)
    if b.get("passed") is False:
        if b.get("first"):
            f = b["first"]
            where = f"layer {f['layer']} {f['label']}" if f.get("layer") is not None else f["label"]
            if f.get("layout") == "partial":
                where += " (the ranks' partial sums added)"
            elif f.get("rank") is not None and f.get("layout"):
                where += f" on rank {f['rank']}"
            raise CheckFailed(f"{ref} leaves the reference at {where} ({f['module']}) in {dtype}"
                              + ("" if parallel.single else f" at {parallel.describe()}"),
                              hint=f"bisect report: {b.get('report_path')}")
        raise DsadaptError(f"{ref}: {'; '.join(b.get('reasons') or ['bisect failed'])}",
                           hint=f"check report: {res.report_path}")


COMMANDS = [bisect_cmd]

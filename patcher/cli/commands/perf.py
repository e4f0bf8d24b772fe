"""perf: the speed gate, from the command line."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from patcher.base.errors import UsageError
from patcher.base.workdir import workdir_lock
from patcher.cli.commands.common import (
    Context,
    PinRefParam,
    emit_json,
    json_option,
    junit_option,
    model_option,
    out,
    parallel_options,
    pass_ctx,
    progress_printer,
    publish_option,
    table,
    to_parallel,
    to_ref,
)
from patcher.rules.speed import DEFAULT_ROUNDS, DEFAULT_THRESHOLD, METRICS, parse_int_list


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _mib(x) -> str:
    return "-" if not x else f"{x / 2**20:.0f} MiB"


def render(res) -> None:
    a, b = res.sides
    for p in res.points:
        rows = []
        for m in METRICS:
            r = p["ratios"][m.name]
            ci = "-" if r["estimate"] is None else f"{r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"
            flag = ""
            if m.gated:
                flag = "gated" if r["hi"] is None or r["hi"] >= res.threshold else "SLOWER"
            spec = ".1f" if m.unit in ("tok/s", "ms") else ".2f"
            rows.append([m.label, f"{_f(p['sides'][a][m.name], spec)} {m.unit}",
                         f"{_f(p['sides'][b][m.name], spec)} {m.unit}", ci, flag])
        rows.append(["peak RSS (server group)", _mib(p["sides"][a]["peak_rss"]), _mib(p["sides"][b]["peak_rss"]), "", ""])
        if p["sides"][a].get("peak_gpu") is not None:
            rows.append(["peak GPU memory", _mib(p["sides"][a]["peak_gpu"]), _mib(p["sides"][b]["peak_gpu"]), "", ""])
        par = res.parallel or {}
        label = f", {par['label']}" if int(par.get("tp") or 1) > 1 else ""
        table(f"{res.pin} ({res.variant}{label}) {res.model} {res.config_style or ''} {res.dtype}: concurrency "
              f"{p['concurrency']}, {p['sides'][a]['rounds']} rounds",
              ["metric", a, b, f"{a}/{b} (95% CI; <1 = {a} slower)", ""], rows)
    out(f"verdict: {res.verdict.upper()}" + ("" if res.passed else f" — {'; '.join(res.reasons[:3])}"),
        verdict=res.verdict.upper())
    if res.band:
        out(f"  gated ratios: estimates {res.band['estimate_min']:.3f}-{res.band['estimate_max']:.3f}, lowest CI "
            f"upper end {res.band['ci_hi_min']:.3f} (threshold {res.threshold:g})")
    out(f"report: {res.report_path}" + (f"  plot: {res.plot_path}" if res.plot_path else ""))


@click.command("perf")
@click.argument("pin", metavar="ENGINE@TAG", required=False, type=PinRefParam())
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@model_option
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default="deepseek", show_default=True,
              help="config.json style of a built-in model; deepseek loads in both builds (the unpatched vLLM 0.32 "
                   "cannot load the transformers style).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Serving dtype (default: the engine's first: float32 for vLLM, bfloat16 for LMDeploy).")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Concurrency levels, a comma list.")
@click.option("--input-len", default=None, help="Prompt lengths, a comma list (one mix each; default: 3 built-in "
                                                 "mixes, one past YaRN's original context).")
@click.option("--output-len", default=None, help="Output lengths, a comma list matching --input-len.")
@click.option("--requests", default=None, metavar="N[,N...]",
              help="Requests per run (default at each level: 4 per concurrent stream, at least 16); a comma "
                   "list gives one per concurrency level (e.g. 16,64 with --concurrency 1,16).")
@click.option("--rounds", type=int, default=DEFAULT_ROUNDS, show_default=True, help="Measured rounds per side and level.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Warm-up rounds (not measured).")
@click.option("--max-model-len", type=int, default=256, show_default=True, help="Context length both servers get.")
@click.option("--threshold", type=float, default=DEFAULT_THRESHOLD, show_default=True,
              help="Fail when a gated ratio's upper CI end is below this (docs/speed.md: the calibrated band).")
@click.option("--aa", is_flag=True, help="A/A calibration: the patched build against itself (the noise band).")
@click.option("--cpus", default=None, help="CPU ids for servers and load generator (default: all this process may use).")
@click.option("--time-limit", type=float, default=3600.0, show_default=True,
              help="Seconds for the whole measurement; past it the run stops with no verdict.")
@click.option("--rescore", "rescore_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Recompute a saved report's ratios and verdict from its recorded runs (current rule, "
                   "--threshold if given) instead of measuring; rewrites the report and its plot.")
@parallel_options(served=True)
@junit_option
@publish_option
@json_option
@pass_ctx
def perf_cmd(ctx: Context, pin, variant, model, config_style, dtype, concurrency, input_len, output_len, requests,
             rounds, warmup, max_model_len, threshold, aa, cpus, time_limit, rescore_path, tp, ep, junit,
             as_json) -> None:
    """Speed gate: the patched and the unpatched build side by side under the same load. Exit 0 only on pass.

    Both builds are served on 127.0.0.1 at once and loaded in alternating rounds by the
    engine's own benchmark tool; per concurrency level it reports TTFT, TPOT, output tokens/s,
    latency percentiles and peak memory per side, and patched/unpatched ratios with bootstrap
    confidence intervals. It fails when a gated ratio (tokens/s, TTFT, TPOT) is below the
    threshold with its whole interval.
    """
    from patcher.gate.perf import perf_or_raise, rescore, run_perf

    if rescore_path is not None:
        given = click.get_current_context().get_parameter_source("threshold") != click.core.ParameterSource.DEFAULT
        res = rescore(rescore_path, threshold if given else None, pin=str(to_ref(pin)) if pin else None)
    else:
        req = perf_request(ctx, pin, variant=variant, model=model, config_style=config_style, dtype=dtype,
                           concurrency=concurrency, input_len=input_len, output_len=output_len, requests=requests,
                           rounds=rounds, warmup=warmup, max_model_len=max_model_len, threshold=threshold, aa=aa,
                           cpus=cpus, time_limit=time_limit, tp=tp, ep=ep)
        with workdir_lock(ctx.cfg):
            res = run_perf(ctx.cfg, ctx.lock, req, progress=progress_printer(), stream=not as_json)
    if as_json:
        emit_json({k: v for k, v in res.to_json().items() if k != "runs"}, schema="dsadapt.perf-report/1")
    else:
        render(res)
    report_ci(res, junit)
    perf_or_raise(res)


def perf_request(ctx: Context, pin, *, variant, model, config_style, dtype, concurrency, input_len, output_len,
                 requests, rounds, warmup, max_model_len, threshold, aa, cpus, time_limit, tp, ep):
    """The command line as a PerfRequest, every check that needs no engine made first (bad input
    exits 2, a pin that cannot run here 6, before anything is created)."""
    from patcher.gate.perf import PerfRequest, check_threshold, parse_cpus, preflight
    from patcher.gate.plan import check_split, choose_model

    if not pin:
        raise UsageError("name one ENGINE@TAG (or --rescore REPORT)", hint="e.g. dsadapt perf vllm@v0.32.0")
    ref = to_ref(pin)
    assert ref is not None
    choice = choose_model(model)
    check_threshold(threshold)
    if not time_limit > 0:  # nan too
        raise UsageError(f"--time-limit {time_limit:g} must be positive", hint="seconds, e.g. --time-limit 1800")
    reqs = parse_int_list(requests, "--requests", zero=True)  # 0: the workload says why not
    req = PerfRequest(ref, model=model, config_style=config_style, dtype=dtype, variant=variant,
                      concurrency=parse_int_list(concurrency, "--concurrency"),
                      input_lens=parse_int_list(input_len, "--input-len"),
                      output_lens=parse_int_list(output_len, "--output-len"), rounds=rounds,
                      requests=reqs[0] if reqs and len(reqs) == 1 else reqs, warmup_rounds=warmup,
                      max_model_len=max_model_len, threshold=threshold, aa=aa, cpus=parse_cpus(cpus),
                      time_limit_s=time_limit, parallel=to_parallel(tp, ep),
                      command="dsadapt " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None)
    check_split(choice, req.parallel)
    req.workload(None)  # the workload's own checks (lengths, rounds, requests), before anything is made
    # unknown pin/variant, cannot run here (in this parallel configuration), no recipe: before anything is made
    preflight(ctx.lock, ref, variant, dtype, parallel=req.parallel, cpus=req.cpus)
    return req


def report_ci(res, junit) -> None:
    """The verdict for CI: JUnit XML (--junit FILE) and, on GitHub Actions, the gated ratios in the
    job's summary."""
    from patcher.cli.ci import Case, md_table, step_summary, write_junit
    from patcher.rules.verdicts import configuration

    name = f"{res.pin} {configuration(res.to_json())}" + (" aa" if res.mode == "aa" else "")
    write_junit(junit, "dsadapt perf", [Case(name, f"dsadapt.perf.{res.engine}", float(res.timings.get("total_s") or 0),
                                             failure=None if res.passed else ("\n".join(res.reasons) or "fail"),
                                             output=f"report: {res.report_path}")])
    a, b = res.sides
    rows = []
    for p in res.points:
        for m in METRICS:
            r = p["ratios"][m.name]
            if m.gated:
                rows.append([p["concurrency"], m.label, "-" if r["estimate"] is None else f"{r['estimate']:.3f}",
                             "-" if r["lo"] is None else f"[{r['lo']:.3f}, {r['hi']:.3f}]",
                             "SLOWER" if r["hi"] is not None and r["hi"] < res.threshold else "ok"])
    step_summary(f"### dsadapt perf {name}: {res.verdict.upper()}\n\n{a}/{b} ratios (< 1: {a} slower; fails when "
                 f"a whole interval is below {res.threshold:g})\n\n"
                 + md_table(["concurrency", "metric", "ratio", "95% CI", ""], rows)
                 + ("".join(f"\n- {r}" for r in res.reasons) if res.reasons else ""))


COMMANDS = [perf_cmd]

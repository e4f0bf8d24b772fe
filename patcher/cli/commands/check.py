"""check: the logit-equivalence gate, from the command line."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from patcher.base.errors import CheckFailed, DsadaptError, ExitCode, UsageError, number, plural, show
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
    prompt_seed_option,
    publish_option,
    table,
    to_parallel,
    to_ref,
)
from patcher.engines.registry import engine
from patcher.formats.stackfiles import load_stack
from patcher.gate.equivalence import (
    CheckRequest,
    CheckResult,
    bisect_command,
    check_dtypes,
    check_or_raise,
    check_split,
    failure_where,
    preflight,
    run_check,
)

BUILTIN_MODELS = ("v3", "v2-lite", "v2")


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


def _check_model(model: str) -> dict | None:
    """--model is a built-in name or a checkpoint folder whose config.json and weights agree (checked
    before anything runs, from the safetensors headers alone); returns the folder's config."""
    if model in BUILTIN_MODELS:
        from patcher.checkpoints.tiny import deepseek_config

        return deepseek_config(model)  # the architecture; no built-in model is quantized
    config = Path(model) / "config.json"
    if not config.is_file():
        raise UsageError(f"--model {show(model, 80)}: neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a "
                         "directory with config.json",
                         hint="use --model v3, --model v2-lite, --model v2, or a local HF model directory")
    from patcher.checkpoints.model_dir import open_checkpoint  # reads config.json once, and checks the weights

    return open_checkpoint(Path(model)).config


def _fmt(x, spec=".2g"):
    return "-" if x is None else format(x, spec)


def _row_verdict(c: dict, r: dict) -> str:
    if c.get("rule") != "low-precision":
        return "pass" if r.get("passed") else "FAIL"
    # the low-precision rule is pooled over all prompts: a row only fails by itself on token ids
    if r.get("failures"):
        return "FAIL"
    return "pooled: pass" if c.get("passed") else "pooled: FAIL"


def render(res: CheckResult) -> None:
    c = res.comparison
    rows = []
    for r in c["rows"]:
        rows.append([r["id"], str(r.get("positions", "")), _fmt(r.get("max_abs")), _fmt(r.get("mean_abs")),
                     _fmt(r.get("top1_agreement"), ".3f"),
                     {True: "yes", False: "NO", None: "-"}.get(r.get("greedy_match")),
                     "-" if r.get("first_divergence") is None else str(r["first_divergence"]),
                     _row_verdict(c, r)])
    par = res.parallel or {}
    title = (f"{res.pin} ({res.variant}{', unpatched' if res.unpatched else ''}"
             f"{', ' + par['label'] if int(par.get('tp') or 1) > 1 else ''}) vs HF transformers — "
             f"model {res.model}{' (' + res.config_style + ' config)' if res.config_style else ''}, {res.dtype}, "
             f"{c['rule']} rule" + (f", tolerance {number(c['tolerance'])}" if c.get("tolerance") else ""))
    if not rows:
        out(f"{res.pin}: the engine produced no logits")
    else:
        table(title, ["prompt", "positions", "max |Δ|", "mean |Δ|", "top-1 agree", "greedy", "1st div",
                      "verdict"], rows)
    if res.bisect:
        render_bisect_summary(res.bisect)
    out(f"verdict: {res.verdict.upper()}" + ("" if res.passed else f" — {'; '.join(res.reasons[:3])}"),
        verdict=res.verdict.upper())
    if res.margins and res.margins.get("words"):
        out(f"margins: {res.margins['words']}")
    for line in res.explanation if not res.passed else []:
        out(f"  explain: {line}")
    out(f"report: {res.report_path}" + (f"  plot: {res.plot_path}" if res.plot_path else ""))
    if not res.passed and not (res.bisect and res.bisect.get("report_path")):
        out(f"localize it: {bisect_command(res)}")


def render_bisect_summary(b: dict) -> None:
    """The per-module comparison in a check's output: where it leaves the reference, or that it does not."""
    if b.get("first"):
        f = b["first"]
        where = f"layer {f['layer']} {f['label']}" if f.get("layer") is not None else f["label"]
        if f.get("layout") == "partial":
            where += " (every rank's partial sums added)"
        elif f.get("rank") is not None and f.get("layout"):
            where += f" on rank {f['rank']}"
        phase = f", {f['phase']} rows" if f.get("phase") else ""
        ratio = f", {f['ratio']:.2f}x the reference's own error" if f.get("ratio") is not None else ""
        out(f"per-module ({b.get('dtype')}, {b.get('rule')} rule): first divergence at {where} ({f['module']}"
            f"{phase}{ratio}); {len(b.get('above') or [])} point(s) above their limits of {b.get('compared')}")
    elif b.get("passed"):
        out(f"per-module ({b.get('dtype')}, {b.get('rule')} rule): {plural(b.get('compared') or 0, 'point')} within their "
            "limits")
    else:
        for r in b.get("reasons") or []:
            out(f"per-module: {r}")
    if b.get("report_path"):
        out(f"bisect report: {b['report_path']}" + (f"  heat map: {b['plot_path']}" if b.get("plot_path") else ""))


@click.command("check")
@click.argument("pin", metavar="[ENGINE@TAG]", required=False, type=PinRefParam())
@model_option
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None,
              help="config.json style of a built-in model: transformers (what save_pretrained writes) or deepseek "
                   "(DeepSeek's released keys). Default: the engine's own, which `dsadapt list` shows (config_style "
                   "with --json) and its page in docs/engines/ states under \"Default config style\".")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "fp8"]), default=None,
              help="Check one dtype (default: every dtype the engine serves here — float32 where it has it, "
                   "bfloat16, float16 — one verdict each and one overall; fp8, and only fp8, for a block-FP8 checkpoint).")
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@click.option("--unpatched", is_flag=True, help="Check the pristine upstream release instead of the stack.")
@click.option("--unpatched-engine", is_flag=True, help="For a pin that serves another pinned engine (`serves` in upstream.lock): that engine unpatched, this stack applied.")
@click.option("--all", "all_pins", is_flag=True, help="Every pin that can run here; the others are listed with the reason.")
@click.option("--explain", is_flag=True, help="Print where the first divergence is and which layer family it points to.")
@click.option("--reference-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the float32 HF reference runs (auto: the GPU for a CUDA engine on a GPU machine, else the CPU).")
@click.option("--bisect", "bisect", is_flag=True,
              help="When the gate fails, compare every layer's modules with HF (`dsadapt bisect`) from the same "
                   "engine run and name the first that diverges. Low-precision checks always do.")
@parallel_options
@prompt_seed_option
@click.option("--rescore", "rescore_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Apply the current rule to a saved check report's recorded inputs instead of running anything; "
                   "rewrites the report and its plot (a report made before inputs were kept cannot be rescored: "
                   "it says which command reruns it).")
@junit_option
@publish_option
@json_option
@pass_ctx
def check_cmd(ctx: Context, pin, model, config_style, dtype, variant, unpatched, unpatched_engine, all_pins, explain,
              reference_device, bisect, tp, ep, prompt_seed, rescore_path, junit, as_json) -> None:
    """Run the engine and HF transformers on the same prompts and compare logits. Exit 0 only on pass.

    With --tp N [--ep] the engine runs on N ranks and the same comparison runs against the
    one-process reference: the logits, and per module every rank's view (docs/equivalence.md,
    "Parallel runs"); its report is named for the configuration (…-tp2.json)."""
    if rescore_path is not None:
        if pin or all_pins:
            raise UsageError("pass --rescore REPORT or a pin (or --all), not both",
                             hint="the report names its pin; e.g. dsadapt check --rescore reports/vllm/v0.32.0/"
                                  "v3-transformers-float32.json")
        from patcher.gate.equivalence import rescore_check

        res = rescore_check(rescore_path)
        if as_json:
            emit_json({"schema": "dsadapt.check-report/1", **res.to_json()})
        else:
            render(res)
        report_ci([res], junit)
        check_or_raise(res)
        return
    if bool(pin) == all_pins:
        raise UsageError("name one ENGINE@TAG or pass --all", hint="e.g. dsadapt check vllm@v0.32.0 --model v3")
    if all_pins and unpatched_engine:
        raise UsageError("--unpatched-engine names one pin's served engine: it does not go with --all",
                         hint="dsadapt check ENGINE@TAG --unpatched-engine")
    model_config = _check_model(model)
    parallel = to_parallel(tp, ep)
    check_split(model, parallel)
    command = command_line(click.get_current_context())
    progress = progress_printer()
    on_line = progress.note if progress is not None else None
    mode = "on-fail" if bisect else None
    if not all_pins:
        ref = to_ref(pin)
        assert ref is not None
        from patcher.cli.commands.build import default_variant

        variant = default_variant(ctx, ref, variant)
        # bad variant/dtype, cannot run here (this checkpoint, this parallel configuration): before anything is made
        _, spec = preflight(ctx.lock, ref, variant, command, dtype, unpatched_engine, parallel,
                            config=model_config)
        from patcher.gate.equivalence import where_reference_runs

        where_reference_runs(reference_device, spec)
        dtypes = (dtype,) if dtype else check_dtypes(ctx.lock, ref, variant, config=model_config)
        done: list[CheckResult] = []
        from patcher.gate.hosts import RunHost

        req = CheckRequest(ref, model=model, config_style=config_style, variant=variant, unpatched=unpatched,
                           unpatched_engine=unpatched_engine, reference_on=reference_device, bisect=mode,
                           command=command, tp=parallel.tp, ep=parallel.ep, prompt_seed=prompt_seed)
        host = RunHost(ctx.cfg, ctx.lock, progress, not as_json)  # one build and install for every dtype
        with workdir_lock(ctx.cfg):
            for dt in dtypes:
                res = run_check(ctx.cfg, ctx.lock, req.with_dtype(dt), progress=progress, stream=not as_json,
                                on_line=on_line, host=host)
                done.append(res)
                if not as_json:
                    render(res)
                    if explain and res.passed:
                        out(f"  explain: {res.explanation[0] if res.explanation else 'equivalent'}")
        if as_json:
            emit_json(done[0].to_json() if len(done) == 1 else overall_json(str(ref), done),
                      schema="dsadapt.check-report/1")
        elif len(done) > 1:
            word = "PASS" if all(r.passed for r in done) else "FAIL"
            out(f"overall: {word} (" + ", ".join(f"{r.dtype} {r.verdict}" for r in done) + ")", verdict=word)
        report_ci(done, junit)
        failed_runs = [r for r in done if not r.passed]
        if failed_runs and len(done) > 1:
            first = failed_runs[0]
            try:
                check_or_raise(first)
            except CheckFailed as e:
                raise CheckFailed(f"{ref} failed the equivalence gate in {', '.join(r.dtype for r in failed_runs)}: "
                                  f"{first.dtype}{failure_where(first)}: {'; '.join(first.reasons[:2])}",
                                  hint=e.hint) from None
        for r in failed_runs:
            check_or_raise(r)
        return
    results: list[dict[str, object]] = []
    rows: list[list[str]] = []
    all_runs: list[CheckResult] = []
    failed = False
    from patcher.gate.hosts import RunHost
    with workdir_lock(ctx.cfg):
        for entry in ctx.lock.sorted_pins():
            eng = engine(entry.engine)
            spec = eng.variant_for(entry, None)
            blocker = eng.run_blocker(entry, spec) or eng.parallel_blocker(entry, spec, parallel)
            if blocker is None and dtype is not None and dtype not in eng.gate_dtypes(spec):
                blocker = f"runs in {', '.join(eng.gate_dtypes(spec)) or 'no dtype'} only, not {dtype}"
            if not load_stack(ctx.cfg.patches_root, entry.ref, must_exist=False).exists:
                blocker = "no stack"
            if blocker:
                results.append({"pin": str(entry.ref), "verdict": "not run", "reason": blocker,
                                "parallel": parallel.to_json()})
                rows.append([str(entry.ref), "not run", blocker])
                continue
            try:
                req = CheckRequest(entry.ref, model=model, config_style=config_style, reference_on=reference_device,
                                   bisect=mode, command=command, tp=parallel.tp, ep=parallel.ep,
                                   prompt_seed=prompt_seed)
                host = RunHost(ctx.cfg, ctx.lock, progress, not as_json)
                runs = [run_check(ctx.cfg, ctx.lock, req.with_dtype(dt), progress=progress, stream=not as_json,
                                  on_line=on_line, host=host)
                        for dt in ((dtype,) if dtype else check_dtypes(ctx.lock, entry.ref, config=model_config))]
                all_runs += runs
                ok = all(r.passed for r in runs)
                bad = [r for r in runs if not r.passed]
                results.append({"pin": str(entry.ref), "verdict": "pass" if ok else "fail",
                                "parallel": parallel.to_json(), "dtypes": {r.dtype: r.verdict for r in runs},
                                "report": runs[0].report_path if len(runs) == 1 else [r.report_path for r in runs],
                                "reasons": [f"{r.dtype}: {x}" if len(runs) > 1 else x for r in bad for x in r.reasons]})
                rows.append([str(entry.ref) + ("" if len(runs) == 1 else " (" + ", ".join(
                    f"{r.dtype} {r.verdict}" for r in runs) + ")"), "pass" if ok else "fail",
                    runs[0].report_path if ok and len(runs) == 1 else
                    ("; ".join(f"{r.dtype}: {'; '.join(r.reasons[:1])}" for r in bad) if bad else "every dtype passed")])
                failed |= not ok
            except DsadaptError as e:
                if e.exit_code == ExitCode.CANNOT_RUN:  # not runnable here (no GPU, no source): never a pass
                    results.append({"pin": str(entry.ref), "verdict": "not run", "reason": e.message})
                    rows.append([str(entry.ref), "not run", e.message])
                    continue
                results.append({"pin": str(entry.ref), "verdict": "error", "reason": e.message,
                                "exit_code": int(e.exit_code)})
                rows.append([str(entry.ref), "error", e.message])
                failed = True
    ran = [r for r in results if r["verdict"] in ("pass", "fail")]
    report_ci(all_runs, junit, [(str(r["pin"]), str(r["reason"]), r["verdict"] == "error") for r in results
                                if r["verdict"] in ("not run", "error")])
    if as_json:
        emit_json({"results": results, "ok": bool(ran) and not failed}, schema="dsadapt.check-all/1")
    else:
        table(f"dsadapt check --all (model {model}, {dtype or 'every dtype each engine serves'}"
              f"{'' if parallel.single else ', ' + parallel.describe()})",
              ["pin", "verdict", "detail"], rows)
        out(f"{sum(r['verdict'] == 'pass' for r in results)} passed, {sum(r['verdict'] in ('fail', 'error') for r in results)} "
            f"failed, {sum(r['verdict'] == 'not run' for r in results)} not run here (never counted as passes)")
    if failed:
        sys.exit(ExitCode.FAILED)
    if not ran:
        sys.exit(ExitCode.CANNOT_RUN)


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
    rows = [[r.pin, label(r), r.verdict.upper(), _fmt((r.comparison.get("summary") or {}).get("max_abs")),
             "; ".join(r.reasons[:2]) or "-", Path(r.report_path).name] for r in results]
    rows += [[pin, "-", "ERROR" if error else "not run", "-", why, "-"] for pin, why, error in not_run]
    step_summary("### dsadapt check\n\n" + md_table(["pin", "configuration", "verdict", "max |Δ|", "why", "report"],
                                                       rows))


def overall_json(pin: str, results: list[CheckResult]) -> dict:
    """`check PIN --json` over several dtypes: one verdict per dtype and one overall."""
    return {"schema": "dsadapt.check-dtypes/1", "pin": pin, "parallel": results[0].parallel,
            "verdict": "pass" if all(r.passed for r in results) else "fail",
            "dtypes": {r.dtype: r.verdict for r in results}, "results": [r.to_json() for r in results]}


COMMANDS = [check_cmd]

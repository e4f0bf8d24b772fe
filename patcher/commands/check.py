"""check: the logit-equivalence gate, from the command line."""

from __future__ import annotations

import shlex
import sys

import click

from ..check import CheckResult, bisect_command, check_or_raise, engine_dtypes, run_check
from ..engines import adapter
from ..errors import CheckFailed, DsadaptError, EngineUnavailable, UsageError
from ..stack import load_stack
from ..workspace import workdir_lock
from .common import Context, emit_json, json_option, pass_ctx, progress_printer, say, table, to_ref


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
    title = (f"{res.pin} ({res.variant}{', unpatched' if res.unpatched else ''}) vs HF transformers — "
             f"model {res.model}{' (' + res.config_style + ' config)' if res.config_style else ''}, {res.dtype}, "
             f"{c['rule']} rule" + (f", tol {c['tolerance']:g}" if c.get("tolerance") else ""))
    if not rows:
        say(f"{res.pin}: the engine produced no logits")
    else:
        table(title, ["prompt", "positions", "max |Δ|", "mean |Δ|", "top-1 agree", "greedy", "1st div",
                      "verdict"], rows)
    if res.bisect:
        render_bisect_summary(res.bisect)
    say(f"verdict: {res.verdict.upper()}" + ("" if res.passed else f" — {'; '.join(res.reasons[:3])}"))
    for line in res.explanation if not res.passed else []:
        say(f"  explain: {line}")
    say(f"report: {res.report_path}" + (f"  plot: {res.plot_path}" if res.plot_path else ""))
    if not res.passed and not (res.bisect and res.bisect.get("report_path")):
        say(f"localize it: {bisect_command(res)}")


def render_bisect_summary(b: dict) -> None:
    """The per-module comparison in a check's output: where it leaves the reference, or that it does not."""
    if b.get("first"):
        f = b["first"]
        where = f"layer {f['layer']} {f['label']}" if f.get("layer") is not None else f["label"]
        say(f"per-module ({b.get('dtype')}, {b.get('rule')} rule): first divergence at {where} ({f['module']}); "
            f"{len(b.get('above') or [])} point(s) above their limits of {b.get('compared')}")
    elif b.get("passed"):
        say(f"per-module ({b.get('dtype')}, {b.get('rule')} rule): {b.get('compared')} points within their limits")
    else:
        for r in b.get("reasons") or []:
            say(f"per-module: {r}")
    if b.get("report_path"):
        say(f"bisect report: {b['report_path']}" + (f"  heat map: {b['plot_path']}" if b.get("plot_path") else ""))


@click.command("check")
@click.argument("pin", metavar="ENGINE@TAG", required=False)
@click.option("--model", default="v3", show_default=True, help="Built-in tiny model (v3, v2-lite, v2) or a model directory.")
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None,
              help="config.json style of a built-in model (default: transformers, what save_pretrained writes).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Check one dtype (default: every dtype the engine serves here — float32 where it has it, "
                   "bfloat16, float16 — one verdict each and one overall).")
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@click.option("--unpatched", is_flag=True, help="Check the pristine upstream release instead of the stack.")
@click.option("--unpatched-engine", is_flag=True, help="Triton: serve the unpatched engine behind the patched backend.")
@click.option("--all", "all_pins", is_flag=True, help="Every pin that can run here; the others are listed with the reason.")
@click.option("--explain", is_flag=True, help="Print where the first divergence is and which layer family it points to.")
@click.option("--bisect", "bisect", is_flag=True,
              help="When the gate fails, compare every layer's modules with HF (`dsadapt bisect`) from the same "
                   "engine run and name the first that diverges. Low-precision checks always do.")
@json_option
@pass_ctx
def check_cmd(ctx: Context, pin, model, config_style, dtype, variant, unpatched, unpatched_engine, all_pins, explain,
              bisect, as_json) -> None:
    """Run the engine and HF transformers on the same prompts and compare logits. Exit 0 only on pass."""
    if bool(pin) == all_pins:
        raise UsageError("name one ENGINE@TAG or pass --all", hint="e.g. dsadapt check vllm@v0.32.0 --model v3")
    command = "dsadapt " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    progress = progress_printer(not as_json)
    mode = "on-fail" if bisect else None
    if not all_pins:
        ref = to_ref(pin)
        ctx.lock.pin(ref)
        dtypes = (dtype,) if dtype else engine_dtypes(adapter(ref.engine))
        results: list[CheckResult] = []
        with workdir_lock(ctx.cfg):
            for dt in dtypes:
                res = run_check(ctx.cfg, ctx.lock, ref, model=model, config_style=config_style, dtype=dt,
                                variant=variant, unpatched=unpatched, progress=progress, stream=not as_json,
                                command=command, unpatched_engine=unpatched_engine, bisect=mode)
                results.append(res)
                if not as_json:
                    render(res)
                    if explain and res.passed:
                        say(f"  explain: {res.explanation[0] if res.explanation else 'equivalent'}")
        if as_json:
            emit_json(results[0].to_json() if dtype else overall_json(str(ref), results))
        elif len(results) > 1:
            say(f"overall: {'PASS' if all(r.passed for r in results) else 'FAIL'} ("
                + ", ".join(f"{r.dtype} {r.verdict}" for r in results) + ")")
        failed = [r for r in results if not r.passed]
        if failed and len(results) > 1:
            first = failed[0]
            try:
                check_or_raise(first)
            except CheckFailed as e:
                raise CheckFailed(f"{ref} failed the equivalence gate in {', '.join(r.dtype for r in failed)}: "
                                  f"{first.dtype}: {'; '.join(first.reasons[:2])}", hint=e.hint) from None
        for r in failed:
            check_or_raise(r)
        return
    results, rows, failed = [], [], False
    with workdir_lock(ctx.cfg):
        for entry in sorted(ctx.lock.pins.values(), key=lambda e: (e.engine, str(e.ref))):
            ad = adapter(entry.engine)
            spec = ad.variant_for(entry, None)
            blocker = ad.run_blocker(entry, spec)
            if not load_stack(ctx.cfg.patches_root, entry.ref, must_exist=False).exists:
                blocker = "no stack"
            if blocker:
                results.append({"pin": str(entry.ref), "verdict": "not run", "reason": blocker})
                rows.append([str(entry.ref), "not run", blocker])
                continue
            try:
                runs = [run_check(ctx.cfg, ctx.lock, entry.ref, model=model, config_style=config_style, dtype=dt,
                                  progress=progress, stream=not as_json, command=command, bisect=mode)
                        for dt in ((dtype,) if dtype else engine_dtypes(ad))]
                ok = all(r.passed for r in runs)
                bad = [r for r in runs if not r.passed]
                results.append({"pin": str(entry.ref), "verdict": "pass" if ok else "fail",
                                "dtypes": {r.dtype: r.verdict for r in runs},
                                "report": runs[0].report_path if len(runs) == 1 else [r.report_path for r in runs],
                                "reasons": [f"{r.dtype}: {x}" if len(runs) > 1 else x for r in bad for x in r.reasons]})
                rows.append([str(entry.ref) + ("" if len(runs) == 1 else " (" + ", ".join(
                    f"{r.dtype} {r.verdict}" for r in runs) + ")"), "pass" if ok else "fail",
                    runs[0].report_path if ok and len(runs) == 1 else
                    ("; ".join(f"{r.dtype}: {'; '.join(r.reasons[:1])}" for r in bad) if bad else "every dtype passed")])
                failed |= not ok
            except EngineUnavailable as e:
                results.append({"pin": str(entry.ref), "verdict": "not run", "reason": e.message})
                rows.append([str(entry.ref), "not run", e.message])
            except DsadaptError as e:
                results.append({"pin": str(entry.ref), "verdict": "error", "reason": e.message})
                rows.append([str(entry.ref), "error", e.message])
                failed = True
    ran = [r for r in results if r["verdict"] in ("pass", "fail")]
    if as_json:
        emit_json({"results": results, "ok": bool(ran) and not failed})
    else:
        table(f"dsadapt check --all (model {model}, {dtype or 'every dtype each engine serves'})",
              ["pin", "verdict", "detail"], rows)
        say(f"{sum(r['verdict'] == 'pass' for r in results)} passed, {sum(r['verdict'] in ('fail', 'error') for r in results)} "
            f"failed, {sum(r['verdict'] == 'not run' for r in results)} not run here (never counted as passes)")
    if failed:
        sys.exit(1)
    if not ran:
        sys.exit(EngineUnavailable.exit_code)


def overall_json(pin: str, results: list[CheckResult]) -> dict:
    """`check PIN --json` over several dtypes: one verdict per dtype and one overall."""
    return {"schema": "dsadapt.check-dtypes/1", "pin": pin,
            "verdict": "pass" if all(r.passed for r in results) else "fail",
            "dtypes": {r.dtype: r.verdict for r in results}, "results": [r.to_json() for r in results]}


COMMANDS = [check_cmd]

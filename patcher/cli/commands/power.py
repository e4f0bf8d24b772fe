"""power: the smallest bug the gate sees, measured with perturbations planted in the engine."""

from __future__ import annotations

import shlex
import sys

import click

from patcher.base.errors import CheckFailed
from patcher.base.workdir import workdir_lock
from patcher.cli.commands.common import (
    Context,
    PinRefParam,
    emit_json,
    json_option,
    out,
    pass_ctx,
    progress_printer,
    prompt_seed_option,
    publish_option,
    table,
    to_ref,
)
from patcher.gate.detection import SCHEMA, PowerResult
from patcher.gate.hosts import RunHost
from patcher.gate.power import PowerRequest, plan_power, run_power
from patcher.rules import mde as P


def render(res: PowerResult) -> None:
    rows = []
    for c in res.cells:
        at = next((t for t in c.judged() if t.flagged and t.eps == c.flagged_at), None)
        named = "-"
        if at is not None and at.named:
            n = at.named
            named = (f"L{n['layer']} " if n.get("layer") is not None else "") + str(n.get("label")) + \
                (f" ({n['phase']})" if n.get("phase") else "")
        rows.append([c.target, c.point, c.phase, P.mde_text(c, res.search) + ("" if c.monotone else " (not monotone)"),
                     ", ".join(at.by) if at else "-", named, str(len(c.trials))])
    table(f"{res.pin} ({res.variant}{', unpatched' if res.unpatched else ''}) — the gate's power, model {res.model}"
          f"{' (' + res.config_style + ' config)' if res.config_style else ''}, {res.dtype}, {res.kind} perturbations "
          f"(MDE: the smallest eps the gate flags)",
          ["family", "point", "phase", "MDE (eps)", "flagged by", "named first", "runs"], rows)
    ctl = res.control or {}
    out(f"control (every hook at eps 0): {'pass' if ctl.get('passed') else 'FAIL'}"
        + (f" — {ctl['margins']['words']}" if (ctl.get("margins") or {}).get("words") else "")
        + f"; hooks at eps 0: {res.hooks.get('words', '-')}")
    out(f"power: {'PASS' if res.passed else 'FAIL'}" + ("" if res.passed else f" — {'; '.join(res.reasons[:2])}"),
        verdict="PASS" if res.passed else "FAIL")
    out(f"{res.settings} engine runs, one engine start, {res.timings.get('total_s')} s")
    out(f"report: {res.report_path}" + (f"  plot: {res.plot_path}" if res.plot_path else ""))


_FAMILY_HELP = ("Module family to perturb (repeat for several): " + ", ".join(P.FAMILIES)
                + ", or a comparison point (attn.kv_a_norm, shared, router.weights, ...: docs/equivalence.md). "
                  f"Default: {', '.join(P.DEFAULT_TARGETS)}.")


@click.command("power", short_help="Measure the smallest bug the gate flags: perturbations of known size planted in the engine, per module family, phase and dtype.")
@click.argument("pin", metavar="ENGINE@TAG", type=PinRefParam())
@click.option("--model", default="v3", show_default=True, help="Built-in tiny model (v3, v2-lite, v2) or a model directory.")
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None,
              help="config.json style of a built-in model (default: the engine's own).")
@click.option("--dtype", "dtypes", type=click.Choice(["float32", "bfloat16", "float16", "fp8"]), multiple=True,
              help="The engine's dtype (repeat for several; default: every dtype `check` runs). One engine start each.")
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@click.option("--unpatched", is_flag=True, help="Measure the pristine upstream release instead of the stack.")
@click.option("--family", "families", multiple=True, metavar="NAME", help=_FAMILY_HELP)
@click.option("--phase", "phases", multiple=True, metavar="PHASE",
              help="prefill (the prompt's positions), decode (the generated steps) or both; repeat for several "
                   "(default: prefill and decode).")
@click.option("--kind", default="scale", show_default=True, metavar="KIND",
              help="scale: the module's output times 1 + eps; noise: relative random error eps (seeded).")
@click.option("--eps-min", type=float, default=P.DEFAULT_EPS_MIN, show_default=True,
              help=f"Smallest eps tried (in (0, {P.EPS_LIMIT:g})).")
@click.option("--eps-max", type=float, default=P.DEFAULT_EPS_MAX, show_default=True,
              help=f"Largest eps tried (in (0, {P.EPS_LIMIT:g})); a cell not flagged there is reported as not flagged.")
@click.option("--resolution", type=float, default=P.DEFAULT_RESOLUTION, show_default=True,
              help="Stop a cell's bisection once its smallest flagged eps is within this factor of the largest not flagged.")
@click.option("--require", type=float, default=None, metavar="EPS",
              help="Fail (exit 1) when a cell's MDE is above EPS or beyond the search (for CI).")
@click.option("--grid", type=int, default=1, show_default=True, metavar="N",
              help="Eps tried in each cell's first round, spread evenly in log eps over the range (1: its middle, "
                   "where the bisection starts); more cost more runs at once and save rounds.")
@click.option("--time-limit", type=float, default=None, metavar="S",
              help="Start no round of the search that would end past S seconds; the cells it cuts short are "
                   "reported with their bracket so far (default: no limit).")
@click.option("--reference-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the HF reference runs (auto: the GPU for a CUDA engine on a GPU machine, else the CPU).")
@prompt_seed_option
@publish_option
@json_option
@pass_ctx
def power_cmd(ctx: Context, pin, model, config_style, dtypes, variant, unpatched, families, phases, kind, eps_min,
              eps_max, resolution, grid, require, time_limit, reference_device, prompt_seed, as_json) -> None:
    """Plant perturbations of known size inside the engine run (a module family's output scaled by 1 + eps
    or given relative noise eps, in the prefill or the decode phase), judge each run with the gate's own
    rule, and bisect eps per family and phase down to the smallest the gate flags: the minimum detectable
    effect (MDE) for this model, dtype and engine. One engine start per dtype; a report (JSON, Markdown,
    plot) per dtype under reports/<engine>/<tag>/power-*. Exit 0 when the unperturbed control passes the
    gate (and, with --require, every MDE is at most EPS), 1 otherwise."""
    ref = to_ref(pin)
    assert ref is not None  # PIN is a required argument
    command = "dsadapt " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    req = PowerRequest(ref, model=model, config_style=config_style, variant=variant, unpatched=unpatched,
                       families=tuple(families) or P.DEFAULT_TARGETS, phases=tuple(phases) or P.DEFAULT_PHASES,
                       kind=kind, search=P.Search(eps_min, eps_max, resolution), require=require,
                       prompt_seed=prompt_seed, reference_on=reference_device, command=command,
                       time_limit=time_limit, grid=grid)
    # bad model, kind, phase, eps, family (or one the model lacks), dtype; cannot run here: before
    # anything is made
    plan = plan_power(ctx.cfg, ctx.lock, req, tuple(dtypes))
    progress = progress_printer()
    on_line = progress.note if progress is not None else None
    host = RunHost(ctx.cfg, ctx.lock, progress, not as_json)  # one build and install for every dtype
    done: list[PowerResult] = []
    with workdir_lock(ctx.cfg):
        for dt in plan.dtypes:
            res = run_power(plan, dt, host=host, on_line=on_line)
            done.append(res)
            if not as_json:
                render(res)
    if as_json:
        if len(done) == 1:
            emit_json(done[0].to_json(), schema=SCHEMA)
        else:
            emit_json({"pin": str(ref), "passed": all(r.passed for r in done), "dtypes": {r.dtype: r.passed for r in done},
                       "results": [r.to_json() for r in done]}, schema="dsadapt.power-dtypes/1")
    failed = [r for r in done if not r.passed]
    if failed:
        r = failed[0]
        raise CheckFailed(f"{ref} power run in {', '.join(x.dtype for x in failed)}: {'; '.join(r.reasons[:2])}",
                          hint=f"report: {r.report_path}")


COMMANDS = [power_cmd]

"""replay: carry a stack through every real upstream release in a range and tabulate how it fared."""

from __future__ import annotations

import click

from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    out,
    pass_ctx,
    progress_printer,
    publish_option,
    rel_path,
    table,
    to_ref,
)


@click.command("replay")
@click.argument("engine")
@click.option("--from", "start", required=True, metavar="TAG", help="The release the stack starts on.")
@click.option("--to", "end", default=None, metavar="TAG", help="The last release to carry it onto (default: the newest).")
@click.option("--stack", "stack", default=None, metavar="ENGINE@TAG",
              help="Replay this pin's stack, ported to --from first (default: the stack at --from).")
@click.option("--variant", default=None, help="The variant to build and check (default: the first each release can run).")
@click.option("--control", is_flag=True,
              help="Also check each release unpatched in the first configuration (shows what the stack fixes).")
@click.option("--keep", is_flag=True, help="Keep the scratch project (checkouts, builds, check reports) afterwards.")
@click.option("--pre", is_flag=True, help="Include pre-releases.")
@publish_option
@json_option
@pass_ctx
def replay_cmd(ctx: Context, engine: str, start: str, end: str | None, stack: str | None, variant: str | None,
               control: bool, keep: bool, pre: bool, as_json: bool) -> None:
    """Carry a stack through every upstream release from --from to --to, in order: rebase, lock,
    build and check at each; one table (release, each patch's class, verdict per configuration,
    time) and its JSON in reports/replay/.

    The configurations are the default one and every `dsadapt check …` entry of the patches'
    Covered-By. A release this machine cannot run says why (never a pass); a conflict ends the
    replay there. The project's upstream.lock, patches/ and checkouts are not touched: it runs
    in a scratch project under the work dir."""
    from patcher.base.workdir import workdir_lock
    from patcher.gate.replay import check_words, plan_replay, replay

    ref = to_ref(stack)
    plan = plan_replay(ctx.cfg, ctx.lock, engine, start, end, stack=ref, variant=variant, pre=pre)  # (writes nothing)
    progress = progress_printer()

    def on_row(row) -> None:
        if as_json:
            return
        classes = ", ".join(f"{p['name'].split('-', 1)[0]} {p['outcome']}" for p in row.patches) or "-"
        checks = "; ".join(f"{c.config}: {check_words(c)}" for c in row.checks) or row.note or "-"
        out(f"  {row.tag} ({row.step}: {row.outcome}): {classes} | {checks} ({row.seconds:.0f} s)")

    with workdir_lock(ctx.cfg):
        report, js, md = replay(ctx.cfg, ctx.lock, plan, control=control, keep=keep, progress=progress, on_row=on_row,
                                on_line=progress.note if progress else None)
    if as_json:
        emit_json({**report.to_json(), "report": str(js), "markdown": str(md)}, schema="dsadapt.replay/1")
        return
    from patcher.gate.replay import table_rows

    header, rows = table_rows(report)
    table(f"replay of {report.stack}'s stack: {engine} {report.start} → {report.end}", header, rows)
    if report.stopped:
        out(f"stopped: {report.stopped}")
    out(f"report: {rel_path(md, ctx.cfg.project)} (+ .json)")


COMMANDS = [replay_cmd]

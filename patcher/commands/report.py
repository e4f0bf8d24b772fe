"""report: one table over all pins (stack, Upstream-Status, last check, drop candidates)."""

from __future__ import annotations

import click

from ..report import build_report
from .common import Context, emit_json, json_option, pass_ctx, table


@click.command("report")
@json_option
@pass_ctx
def report_cmd(ctx: Context, as_json: bool) -> None:
    """Every pin: stack size, patches by Upstream-Status, last check verdict, patches to drop."""
    rows = build_report(ctx.cfg, ctx.lock)
    if as_json:
        emit_json({"pins": [r.to_json() for r in rows]})
        return
    table("dsadapt report", ["pin", "patches", "upstream status", "last check", "drop candidates"],
          [[r.pin,
            str(r.patches) if r.stack_exists else "no stack",
            ", ".join(f"{k} {n}" for k, n in r.upstream_status.items()) or "-",
            r.error or r.check,
            "; ".join(f"{d.patch} ({d.spec}, {d.satisfied_by})" for d in r.drop_candidates) or "-"]
           for r in rows])


COMMANDS = [report_cmd]

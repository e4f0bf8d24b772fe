"""bench: build cost per pin next to the alternative, and check's wall-time split; writes docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import click

from ..bench import BUILD_COLUMNS, CHECK_COLUMNS, build_table, check_table, format_markdown, run_bench
from ..workspace import workdir_lock
from .common import Context, emit_json, json_option, pass_ctx, progress_printer, say, table


@click.command("bench")
@click.option("--repeat", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Warm rebuilds per pin/variant (the table shows their median).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Markdown file to write (default: docs/benchmarks.md in the project).")
@click.option("--no-alternative", is_flag=True, help="Skip timing the pure-Python pip wheel rebuild.")
@json_option
@pass_ctx
def bench_cmd(ctx: Context, repeat: int, out: Path | None, no_alternative: bool, as_json: bool) -> None:
    """Time overlay builds of every buildable pin next to the alternative, and write docs/benchmarks.md."""
    with workdir_lock(ctx.cfg):
        report = run_bench(ctx.cfg, ctx.lock, repeat, not no_alternative, progress=progress_printer(not as_json))
    path = out or ctx.cfg.project / "docs" / "benchmarks.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "dsadapt bench" + (f" --repeat {repeat}" if repeat != 3 else "") + \
        (" --no-alternative" if no_alternative else "")
    path.write_text(format_markdown(report, command, ctx.cfg.reports_root) + "\n")
    if as_json:
        emit_json({**report.to_json(), "written": str(path)})
        return
    m = report.machine
    table(f"builds ({m['cores']} cores, {m['cpu']}; {report.date})", BUILD_COLUMNS, build_table(report))
    if report.checks:
        table("check wall time", CHECK_COLUMNS, check_table(report))
    say(f"wrote {path}")


COMMANDS = [bench_cmd]

"""bench: build cost per pin next to the alternative, and check's wall-time split; writes docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import click

from patcher.cli.commands import common
from patcher.cli.commands.common import Context, emit_json, json_option, pass_ctx, progress_printer, table


@click.command("bench")
@click.option("--repeat", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Warm rebuilds per pin/variant (the table shows their median).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Markdown file to write (default: docs/benchmarks.md in the project).")
@click.option("--no-alternative", is_flag=True, help="Skip timing the pure-Python pip wheel rebuild.")
@click.option("--only", type=click.Choice(["builds", "stack-ops", "start-up", "reports"]), default=None,
              metavar="SECTION",
              help="Measure one section only: builds, stack-ops, or start-up (with the warm build); the "
                   "other sections of the file are kept. reports: measure nothing, only rewrite the "
                   "sections made from the committed reports.")
@click.option("--sizes", default="1,10,100,500,1000", show_default=True, metavar="N,N,...",
              help="Stack sizes for the stack-operations table.")
@click.option("--stack-pin", default=None, metavar="ENGINE@TAG",
              help="The pin whose tree the stack operations run on (default: of the pins with a release artifact "
                   "and a newer pin to rebase onto, the one with the largest tree).")
@click.option("--rebase-to", default=None, metavar="TAG",
              help="The tag the warm rebase of the stack pin's real stack goes to (default: the next newer pin of "
                   "that engine; '' to skip it).")
@json_option
@pass_ctx
def bench_cmd(ctx: Context, repeat: int, out: Path | None, no_alternative: bool, only: str | None, sizes: str,
              stack_pin: str | None, rebase_to: str | None, as_json: bool) -> None:
    """Time builds next to the alternative and stack operations next to raw git; write docs/benchmarks.md."""
    from patcher.base.workdir import workdir_lock
    from patcher.bench.driver import run_bench
    from patcher.bench.page import BUILD_COLUMNS, CHECK_COLUMNS, build_table, check_table, format_markdown

    ns, pin, rebase_to = _stack_ops_args(ctx, sizes, stack_pin, rebase_to)
    stack_ops = None if only in ("builds", "start-up", "reports") else {"pin": pin, "sizes": ns,
                                                                       "repeat": repeat,
                                                                       "rebase_to": rebase_to or None}
    startup = None if only in ("builds", "stack-ops", "reports") else {"repeat": max(5, 3 * repeat),
                                                                      "build_pin": pin}
    with workdir_lock(ctx.cfg):
        report = run_bench(ctx.cfg, ctx.lock, repeat, not no_alternative, progress=progress_printer(),
                           builds_too=only is None or only == "builds", stack_ops=stack_ops, startup=startup)
    path = out or ctx.cfg.project / "docs" / "benchmarks.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "dsadapt bench" + (f" --repeat {repeat}" if repeat != 3 else "") + \
        (" --no-alternative" if no_alternative else "") + (f" --only {only}" if only else "") + \
        (f" --sizes {sizes}" if sizes != "1,10,100,500,1000" else "")
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    path.write_text(format_markdown(report, command, old, ctx.cfg.published_reports) + "\n")
    if as_json:
        emit_json({**report.to_json(), "written": str(path)}, schema="dsadapt.bench/1")
        return
    m = report.machine
    if report.builds is not None:
        table(f"builds ({m['cores']} cores, {m['cpu']}; {report.date})", BUILD_COLUMNS, build_table(report))
    if report.startup is not None:
        from patcher.bench.startup import COLUMNS, startup_table

        table("start-up and warm build", COLUMNS, startup_table(report.startup))
    if report.stack_ops is not None:
        from patcher.bench.stack_ops import STACK_COLUMNS, stack_table

        table(f"stack operations ({report.stack_facts.get('pin')})", STACK_COLUMNS, stack_table(report.stack_ops))
    if report.checks:
        table("check wall time", CHECK_COLUMNS, check_table(report))
    common.out(f"wrote {path}")


def _stack_ops_args(ctx: Context, sizes: str, stack_pin: str | None, rebase_to: str | None
                    ) -> tuple[tuple[int, ...], str, str | None]:
    """--sizes, --stack-pin and --rebase-to checked before anything is measured (a bad one would
    otherwise be found only after the builds were timed): the sizes, the pin, the tag."""
    from patcher.base.errors import UsageError
    from patcher.formats.pinref import parse_pinref
    from patcher.rules.speed import parse_int_list

    ns = tuple(sorted(set(parse_int_list(sizes, "--sizes") or ())))
    if max(ns) > 5000:
        raise UsageError(f"--sizes {sizes!r}: sizes go from 1 to 5000", hint="e.g. --sizes 1,10,100")
    if stack_pin is None:
        from patcher.bench.stack_ops import default_stack_pin

        stack_pin, default_to = default_stack_pin(ctx.lock)
        rebase_to = default_to if rebase_to is None else rebase_to
    else:
        ctx.lock.pin(parse_pinref(stack_pin))
    if rebase_to:
        parse_pinref(f"{stack_pin.partition('@')[0]}@{rebase_to}")  # a tag name (pinned or not: the rebase pins it)
    return ns, stack_pin, rebase_to


COMMANDS = [bench_cmd]

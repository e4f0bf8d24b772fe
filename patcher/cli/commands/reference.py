"""The command reference (docs/commands.md), generated from the click commands themselves."""

from __future__ import annotations

import click

HEADER = ("# Command reference\n\nGenerated from the commands' own help (`make docs`; a test keeps it current).\n"
          "Every reporting command takes `--json`. Exit codes: see the [user guide](user-guide.md#errors-and-exit-codes).\n")


#: What `dsadapt CMD --help` uses on any terminal at least 100 columns wide (click: min(cols, 100) - 2).
WIDTH = 98


def _walk(cmd: click.Command, ctx: click.Context):
    """(context, command) for every command under `cmd`, each context a child of its group's, as
    when the CLI runs: the usage line reads `dsadapt model make`, and the group's
    context_settings (help option names "-h, --help") hold for every command."""
    yield ctx, cmd
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            sub = cmd.commands[name]
            yield from _walk(sub, click.Context(sub, info_name=name, parent=ctx, terminal_width=WIDTH,
                                                max_content_width=100))


def command_reference(root: click.Group) -> str:
    out = [HEADER]
    settings = {**root.context_settings, "terminal_width": WIDTH, "max_content_width": 100}
    root_ctx = click.Context(root, info_name="dsadapt", **settings)
    for ctx, cmd in _walk(root, root_ctx):
        out.append(f"\n## `{ctx.command_path}`\n\n```\n{cmd.get_help(ctx).rstrip()}\n```\n")
    return "".join(out)

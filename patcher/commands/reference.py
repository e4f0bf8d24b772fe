"""The command reference (docs/commands.md), generated from the click commands themselves."""

from __future__ import annotations

import click

HEADER = ("# Command reference\n\nGenerated from the commands' own help (`make docs`; a test keeps it current).\n"
          "Every reporting command takes `--json`. Exit codes: see the [user guide](user-guide.md#errors-and-exit-codes).\n")


def _walk(cmd: click.Command, path: list[str]):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            yield from _walk(cmd.commands[name], path + [name])


def command_reference(root: click.Group) -> str:
    out = [HEADER]
    # Each command's context descends from the group's, as when the CLI runs: the group's
    # context_settings (help option names "-h, --help") hold for every command, whatever
    # context first asked a command for its help option.
    settings = {**root.context_settings, "terminal_width": 100, "max_content_width": 100}
    root_ctx = click.Context(root, info_name="dsadapt", **settings)
    for path, cmd in _walk(root, ["dsadapt"]):
        if cmd is root:
            continue
        ctx = click.Context(cmd, info_name=" ".join(path), parent=root_ctx, terminal_width=100, max_content_width=100)
        out.append(f"\n## `{' '.join(path)}`\n\n```\n{cmd.get_help(ctx).rstrip()}\n```\n")
    return "".join(out)

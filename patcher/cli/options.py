"""The output options every command takes, and the state they set: -q/--quiet, -v/--verbose,
--color. Imports nothing but click, so that `dsadapt --help` stays fast."""

from __future__ import annotations

import os
import sys
from typing import TextIO

import click

#: -1 quiet (-q), 0 normal, 1+ verbose (-v)
_verbosity = 0
#: "auto" (a terminal without NO_COLOR), "never", "always" (--color)
_color = "auto"


def reset() -> None:
    global _verbosity, _color
    _verbosity, _color = 0, "auto"


def set_verbosity(level: int) -> None:
    global _verbosity
    _verbosity = level


def verbosity() -> int:
    return _verbosity


def set_color(mode: str) -> None:
    global _color
    _color = mode


def color() -> str:
    return _color


def color_enabled(stream: TextIO | None = None) -> bool:
    """Whether to colour text for `stream` (stdout): --color always/never, else a terminal
    without NO_COLOR (https://no-color.org) or TERM=dumb."""
    if _color == "always":
        return True
    if _color == "never" or os.environ.get("NO_COLOR", "") != "" or os.environ.get("TERM") == "dumb":
        return False
    s = stream or sys.stdout
    try:
        return s.isatty()
    except (AttributeError, ValueError):
        return False


def _quiet(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        if _verbosity > 0:
            raise click.UsageError("pass -q or -v, not both", ctx=ctx)
        set_verbosity(-1)
    return value


def _verbose(ctx: click.Context, _param: click.Parameter, value: int) -> int:
    if value:
        if _verbosity < 0:
            raise click.UsageError("pass -q or -v, not both", ctx=ctx)
        set_verbosity(max(_verbosity, value))
    return value


def _color_cb(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        set_color(value)
    return value


def output_options() -> list[click.Option]:
    """-q, -v and --color: taken by the group (`dsadapt -q check ...`) and by every command
    (`dsadapt check ... -q`), as git and pip take theirs."""
    return [
        click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_quiet,
                     help="No progress or notes on stderr (results, warnings and errors still print)."),
        click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_verbose,
                     help="Also print each line the current step's tool prints (pip, the engine), as it comes."),
        click.Option(["--color"], type=click.Choice(["auto", "never", "always"]), default=None, expose_value=False,
                     callback=_color_cb,
                     help="Colour verdicts and tables: auto (a terminal, unless NO_COLOR is set), never, always."),
    ]


class NonEmptyPath(click.Path):
    """click.Path that refuses an empty value: `--out ''` is a mistake (an unset variable in a
    script), never "the current directory", which click would make of it."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path (pass a path, or leave the option out)", param, ctx)
        return super().convert(value, param, ctx)


def refuse_empty_paths(cmd: click.Command) -> None:
    """Every path option and argument of `cmd` refuses an empty value (NonEmptyPath)."""
    for p in cmd.params:
        if type(p.type) is click.Path:
            p.type.__class__ = NonEmptyPath


def add_output_options(cmd: click.Command) -> click.Command:
    """Give `cmd` (and, for a group, its commands) the options of `output_options` it lacks, and
    make its path parameters refuse an empty value."""
    refuse_empty_paths(cmd)
    have = {o for p in cmd.params for o in getattr(p, "opts", [])}
    for opt in output_options():
        if not set(opt.opts) & have:
            cmd.params.append(opt)
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            add_output_options(sub)
    return cmd

"""What every command shares: the project context, output helpers, --json."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ..config import Config
    from ..lock import Lock
    from ..pinref import PinRef

_consoles: dict = {}


def __getattr__(name: str):
    """err_console / out_console: rich consoles, made (and rich imported) on first use only."""
    if name in ("err_console", "out_console"):
        if name not in _consoles:
            from rich.console import Console

            # Piped output (CI logs, `| less`) gets wide tables instead of rich's 80-column default.
            stream = sys.stderr if name == "err_console" else sys.stdout
            _consoles[name] = Console(stderr=name == "err_console", highlight=False, soft_wrap=True,
                                      width=None if stream.isatty() else 160)
        return _consoles[name]
    raise AttributeError(name)


@dataclass
class Context:
    project: Path | None
    _cfg: Config | None = None
    _lock: Lock | None = None

    @property
    def cfg(self) -> Config:
        if self._cfg is None:
            from ..config import load_config

            self._cfg = load_config(self.project)
        return self._cfg

    @property
    def lock(self) -> Lock:
        if self._lock is None:
            from ..lock import load_lock

            self._lock = load_lock(self.cfg.lock_path)
        return self._lock

    def reload_lock(self) -> Lock:
        self._lock = None
        return self.lock


pass_ctx = click.make_pass_decorator(Context)

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")


def pinref_arg(required: bool = True):
    return click.argument("pin", metavar="ENGINE@TAG", required=required)


def to_ref(text: str | None) -> PinRef | None:
    from ..pinref import parse_pinref

    return parse_pinref(text) if text else None


def emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def say(msg: str) -> None:
    """Human progress/status lines go to stderr so stdout stays clean for --json and pipes (plain text)."""
    click.echo(msg, err=True)


def table(title: str | None, columns: list[str], rows: list[list[str]]) -> None:
    """A table on stdout: rich's box drawing on a terminal, plain aligned columns in pipes and logs
    (without importing rich, which is most of a short command's start-up time)."""
    if not sys.stdout.isatty():
        click.echo(plain_table(title, columns, rows))
        return
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title) if title else None, show_lines=False)
    for c in columns:
        t.add_column(escape(c), overflow="fold")
    for r in rows:  # cells are data (paths, error texts with [brackets]), never markup
        t.add_row(*[escape(str(x)) for x in r])
    __getattr__("out_console").print(t)


def plain_table(title: str | None, columns: list[str], rows: list[list[str]]) -> str:
    cells = [[str(c) for c in columns]] + [[str(x).replace("\n", " ") for x in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [title] if title else []
    out += [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    out += [fmt(r) for r in cells[1:]]
    return "\n".join(out)


def progress_printer(enabled: bool = True):
    if not enabled:
        return None
    return lambda msg: click.echo(f"… {msg}", err=True)


def isatty() -> bool:
    return sys.stderr.isatty()

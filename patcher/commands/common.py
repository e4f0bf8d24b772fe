"""What every command shares: the project context, output helpers, --json."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..config import Config, load_config
from ..lock import Lock, load_lock
from ..pinref import PinRef, parse_pinref

# Piped output (CI logs, `| less`) gets wide tables instead of rich's 80-column default.
err_console = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 160)
out_console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


@dataclass
class Context:
    project: Path | None
    _cfg: Config | None = None
    _lock: Lock | None = None

    @property
    def cfg(self) -> Config:
        if self._cfg is None:
            self._cfg = load_config(self.project)
        return self._cfg

    @property
    def lock(self) -> Lock:
        if self._lock is None:
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
    return parse_pinref(text) if text else None


def emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def say(msg: str) -> None:
    """Human progress/status lines go to stderr so stdout stays clean for --json and pipes."""
    err_console.print(msg, markup=False)


def table(title: str | None, columns: list[str], rows: list[list[str]]) -> None:
    from rich.markup import escape

    t = Table(title=escape(title) if title else None, show_lines=False)
    for c in columns:
        t.add_column(escape(c), overflow="fold")
    for r in rows:  # cells are data (paths, error texts with [brackets]), never markup
        t.add_row(*[escape(str(x)) for x in r])
    out_console.print(t)


def progress_printer(enabled: bool = True):
    if not enabled:
        return None
    return lambda msg: err_console.print(f"[dim]… {msg}[/dim]", highlight=False)


def isatty() -> bool:
    return sys.stderr.isatty()

"""The `dsadapt` command line: a thin click layer over the core library.

Errors are rendered exactly once, here: `error: <message>` and `hint: <fix>` on stderr,
with the error's exit code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__
from .commands import apply as apply_cmds
from .commands import pin as pin_cmds
from .commands import refresh as refresh_cmds
from .commands import status as status_cmds
from .commands import verify as verify_cmds
from .commands.common import Context, err_console
from .errors import DsadaptError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsadapt")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Project root (default: nearest directory upward with upstream.lock).")
@click.pass_context
def cli(click_ctx: click.Context, project: Path | None) -> None:
    """Keep DeepSeek adaptation patch stacks alive on vLLM, LMDeploy and Triton."""
    click_ctx.obj = Context(project)


for module in (status_cmds, apply_cmds, refresh_cmds, verify_cmds, pin_cmds):
    for command in module.COMMANDS:
        cli.add_command(command)


def _register_optional() -> None:
    """Command families whose modules import heavier dependencies lazily."""
    import importlib

    for name in ("build", "bench", "check", "model", "perf", "rebase", "report", "serve"):
        try:
            module = importlib.import_module(f"patcher.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"patcher.commands.{name}":
                continue
            raise
        for command in module.COMMANDS:
            cli.add_command(command)


_register_optional()


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="dsadapt", standalone_mode=False)
    except DsadaptError as e:
        err_console.print(f"[bold red]error:[/bold red] {e.message}", highlight=False)
        if e.hint:
            err_console.print(f"[yellow]hint:[/yellow] {e.hint}", highlight=False)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Abort:
        err_console.print("aborted")
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

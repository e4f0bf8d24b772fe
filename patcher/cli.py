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
from .commands.common import Context
from .errors import UsageError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsadapt")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Project root (default: nearest directory upward with upstream.lock).")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output for any command: one JSON document on stdout, errors included.")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write reports there (default: the work dir's reports/, DSADAPT_REPORTS).")
@click.option("--publish", is_flag=True,
              help="Write reports into the project's committed reports/ (same as --report-dir PROJECT/reports).")
@click.pass_context
def cli(click_ctx: click.Context, project: Path | None, as_json: bool, report_dir: Path | None, publish: bool) -> None:
    """Keep DeepSeek adaptation patch stacks alive on vLLM, LMDeploy and Triton.

    Exit codes (one meaning each, for every command): 0 ok, 1 failed (a verdict), 2 bad input,
    3 does not match the lock, 4 stopped/refused (state on disk), 5 toolchain missing,
    6 cannot run here, 7 machine/tool failure, 8 internal error, 130 interrupted, 141 stdout
    closed. DSADAPT_DEBUG=1 adds tracebacks. Details: docs/user-guide.md#errors-and-exit-codes."""
    if publish and report_dir is not None:
        raise UsageError("pass --publish or --report-dir, not both", hint="--publish means --report-dir PROJECT/reports")
    click_ctx.obj = Context(project, json=as_json, report_dir=report_dir, publish=publish)


for module in (status_cmds, apply_cmds, refresh_cmds, verify_cmds, pin_cmds):
    for command in module.COMMANDS:
        cli.add_command(command)


def _register_optional() -> None:
    """Command families whose modules import heavier dependencies lazily."""
    import importlib

    for name in ("build", "bench", "bisect", "check", "model", "rebase", "report", "serve"):
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
    """The CLI edge: run the command; render any error once, as plain text (and JSON with --json)."""
    from .commands.common import close_progress, reset_output
    from .render import render_error, to_error, wants_json

    args = list(sys.argv[1:] if argv is None else argv)
    as_json = wants_json(args)
    reset_output()
    _scrub_git_environment()
    try:
        # make_context + invoke rather than cli.main: click.main would print its own newline on
        # Ctrl-C and turn a broken pipe into exit 1; here every outcome is rendered once, below
        with cli.make_context("dsadapt", list(args)) as ctx:  # click consumes the list it parses
            rv = cli.invoke(ctx)
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except SystemExit as e:  # a command's own verdict (sys.exit(1) after printing its result)
        if e.code is None:
            return 0
        return e.code if isinstance(e.code, int) else 1
    except BrokenPipeError:  # the reader of stdout went away (| head): quietly, like SIGPIPE
        _silence_stdout()
        return 141
    except BaseException as e:  # noqa: BLE001 - the one place every error is turned into one line
        err = to_error(e, args)
        close_progress()
        render_error(err, e, as_json=as_json)
        return int(err.exit_code)
    finally:
        close_progress()


# Variables a calling git (a hook, an alias) exports that would point dsadapt's own git
# commands at another repository or inject configuration into them.
_GIT_LEAKS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES",
              "GIT_COMMON_DIR", "GIT_NAMESPACE", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT", "GIT_PREFIX",
              "GIT_EXTERNAL_DIFF", "GIT_DIFF_OPTS", "GIT_EDITOR", "GIT_SEQUENCE_EDITOR", "GIT_TEMPLATE_DIR",
              "GIT_QUARANTINE_PATH", "GIT_REPLACE_REF_BASE", "GIT_SHALLOW_FILE",
              "GIT_GRAFT_FILE", "GIT_ATTR_SOURCE")


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _scrub_git_environment() -> None:
    import os

    for name in _GIT_LEAKS:
        os.environ.pop(name, None)
    for name in [k for k in os.environ if k.startswith(("GIT_CONFIG_KEY_", "GIT_CONFIG_VALUE_"))]:
        os.environ.pop(name, None)


if __name__ == "__main__":
    sys.exit(main())

"""The `dsadapt` command line: a thin click layer over the core library.

Commands are registered lazily: `COMMANDS` names each command's module and its one-line help,
so `dsadapt --help` imports no command module and `dsadapt status` imports only its own (a test
keeps the help lines equal to the commands' own). Errors are rendered exactly once, here:
`error: <message>` and `hint: <fix>` on stderr, with the error's exit code.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import MutableMapping
from pathlib import Path

import click

from . import __version__
from .errors import DsadaptError

# name -> (module under patcher.commands, attribute, short help shown by `dsadapt --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "abort": ("apply", "abort_cmd",
            'Undo the whole apply (or rebase, or refresh): branches, HEAD, work tree and patches/ as they were.'),
    "apply": ("apply", "apply_cmd",
            'Materialize + verify the pinned checkout, then apply the stack as commits.'),
    "bench": ("bench", "bench_cmd",
            'Time builds next to the alternative and stack operations next to raw git; write docs/benchmarks.md.'),
    "build": ("build", "build_cmd",
            'Build the patched engine into dist/ and print the artifact, its sha256 and how it was built.'),
    "build-all": ("build", "build_all_cmd",
            'Build every pin (and variant) that can be built on this machine; a table of the rest says why not.'),
    "check": ("check", "check_cmd",
            'Run the engine and HF transformers on the same prompts and compare logits. Exit 0 only on pass.'),
    "continue": ("apply", "continue_cmd",
            'Commit the resolved patch and apply the rest of the stack (also finishes an interrupted run).'),
    "gc": ("status", "gc_cmd",
            'Remove what killed runs left behind: half-made checkouts, partial downloads, temporary files in patches/, reports/ and dist/, stale temporary worktrees. Never your work or backups.'),
    "install": ("build", "install_cmd",
            "Create (or reuse) the pin's own virtual environment and install the patched engine there."),
    "list": ("status", "list_cmd",
            'Engines, pins, patch counts, build kind, and whether each pin can run here.'),
    "matrix": ("rebase", "matrix_cmd",
            'The CI matrix: one cell per (pin, variant) and per newer upstream tag not yet pinned.'),
    "model": ("model", "model",
            'Built-in tiny DeepSeek test models for the equivalence gate.'),
    "pin": ("pin", "pin_cmd",
            'Resolve the tag (git where reachable) and hash its release artifacts (PyPI) into upstream.lock.'),
    "rebase": ("rebase", "rebase_cmd",
            "Carry ENGINE@OLD's stack onto --onto NEW: pin and fetch NEW, replay patch by patch (3-way), classify each patch, write patches/ENGINE/NEW and reports/rebase/ENGINE-OLD-to-NEW.{md,json}."),
    "refresh": ("refresh", "refresh_cmd",
            "Write the branch's commits to patches/ENGINE/TAG in normalized form and rewrite series."),
    "report": ("report", "report_cmd",
            'Every pin: stack size, patches by Upstream-Status, last check verdict, patches to drop.'),
    "serve": ("serve", "serve_cmd",
            'Assemble the backend and a model repository, start tritonserver, print how to query it.'),
    "skip": ("apply", "skip_cmd",
            'Drop the patch that stopped the apply and go on with the rest.'),
    "status": ("status", "status_cmd",
            'Where each checkout stands (not fetched, clean base, stack applied, stack outdated, dirty, diverged; stopped on a conflict, interrupted, running) and the command that moves it on.'),
    "tags": ("rebase", "tags_cmd",
            "Upstream release tags newer than ENGINE's newest stack, each marked pinned / unpinned."),
    "verify": ("verify", "verify_cmd",
            'Lint one stack (or every pinned stack) and apply it in a temporary index.'),
}


def _load(name: str) -> click.Command | None:
    module, attr, _ = COMMANDS[name]
    try:
        mod = importlib.import_module(f"patcher.commands.{module}")
    except ModuleNotFoundError as e:  # a command family not in this checkout
        if e.name == f"patcher.commands.{module}":
            return None
        raise
    cmd = getattr(mod, attr, None)
    if cmd is None:  # the attribute was renamed: find the command by name
        cmd = next((c for c in getattr(mod, "COMMANDS", []) if c.name == name), None)
    return cmd


class LazyCommands(MutableMapping):
    """The group's commands: names known up front, each module imported when its command is used."""

    def __init__(self) -> None:
        self._loaded: dict[str, click.Command] = {}
        self._extra: dict[str, click.Command] = {}

    def _names(self) -> list[str]:
        return sorted(set(COMMANDS) | set(self._extra))

    def __getitem__(self, name: str) -> click.Command:
        if name in self._extra:
            return self._extra[name]
        if name not in COMMANDS:
            raise KeyError(name)
        if name not in self._loaded:
            cmd = _load(name)
            if cmd is None:
                raise KeyError(name)
            self._loaded[name] = cmd
        return self._loaded[name]

    def __setitem__(self, name: str, cmd: click.Command) -> None:
        self._extra[name] = cmd

    def __delitem__(self, name: str) -> None:
        self._extra.pop(name, None)

    def __iter__(self):
        for n in self._names():
            if n in self._extra or n in self._loaded:
                yield n
            else:
                try:
                    self[n]
                except KeyError:
                    continue
                yield n

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except KeyError:
            return False
        return True


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands._extra))  # type: ignore[attr-defined]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from COMMANDS' help lines: no command module is imported for --help."""
        limit = formatter.width - 6 - max(len(n) for n in COMMANDS)
        rows = []
        for name in self.list_commands(ctx):
            text = COMMANDS[name][2] if name in COMMANDS and COMMANDS[name][2] else None
            if text is None:
                cmd = self.get_command(ctx, name)
                if cmd is None or cmd.hidden:
                    continue
                rows.append((name, cmd.get_short_help_str(limit)))
            else:
                rows.append((name, click.Command(name, help=text).get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsadapt")
@click.option("--project", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Project root (default: nearest directory upward with upstream.lock).")
@click.pass_context
def cli(click_ctx: click.Context, project: Path | None) -> None:
    """Keep DeepSeek adaptation patch stacks alive on vLLM, LMDeploy and Triton."""
    from .commands.common import Context

    click_ctx.obj = Context(project)


cli.commands = LazyCommands()  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="dsadapt", standalone_mode=False)
    except DsadaptError as e:
        from .commands.common import err_console

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
        from .commands.common import err_console

        err_console.print("aborted")
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

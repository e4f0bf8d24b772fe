"""The `dsadapt` command line: a thin click layer over the core library.

Commands are registered lazily: `COMMANDS` names each command's module and its one-line help,
so `dsadapt --help` imports no command module and `dsadapt status` imports only its own (a test
keeps the help lines equal to the commands' own). Errors are rendered exactly once, here:
`error: <message>` and `hint: <fix>` on stderr, with the error's exit code.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import MutableMapping
from pathlib import Path

import click

from patcher.base.errors import UsageError
from patcher.cli.options import add_output_options, output_options, refuse_empty_paths

#: click's completion protocol: `_DSADAPT_COMPLETE=bash_source dsadapt` prints the bash script
#: (zsh_source, fish_source likewise); docs/user-guide.md#shell-completion
COMPLETE_VAR = "_DSADAPT_COMPLETE"

# name -> (module under patcher.cli.commands, attribute, short help shown by `dsadapt --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "abort": ("apply", "abort_cmd",
            'Undo the whole apply (or rebase, or refresh): branches, HEAD, work tree and patches/ as they were.'),
    "apply": ("apply", "apply_cmd",
            'Materialize + verify the pinned checkout, then apply the stack as commits.'),
    "bench": ("bench", "bench_cmd",
            'Time builds next to the alternative and stack operations next to raw git; write docs/benchmarks.md.'),
    "bisect": ("bisect", "bisect_cmd",
            "Name the first (layer, module) where the engine diverges from HF transformers on the gate's prompts."),
    "build": ("build", "build_cmd",
            'Build the patched engine into dist/ and print the artifact, its sha256 and how it was built.'),
    "build-all": ("build", "build_all_cmd",
            'Build every pin (and variant) that can be built on this machine; a table of the rest says why not.'),
    "bundle": ("bundle", "bundle_cmd",
            'One folder (or .tar) with everything an offline machine needs to run `dsadapt check PIN` there.'),
    "check": ("check", "check_cmd",
            'Run the engine and HF transformers on the same prompts and compare logits. Exit 0 only on pass.'),
    "continue": ("apply", "continue_cmd",
            'Commit the resolved patch and apply the rest of the stack (also finishes an interrupted run).'),
    "gc": ("status", "gc_cmd",
            'Remove what killed runs left behind (half-made checkouts, partial downloads, temporary files, stale temporary worktrees) and derived data no pin uses (engine environments, dist/ wheels of other stacks, runs/ of unpinned pins). Never your work, reports or backups.'),
    "install": ("build", "install_cmd",
            'Create (or reuse) the environment the pin runs in and install the patched engine there.'),
    "list": ("status", "list_cmd",
            'Engines, pins, patch counts, build kind, and whether each pin can run here.'),
    "lock": ("lock", "lock_cmd",
            "Make the hash lock of the pin's environment (uv, wheels only, PyPI alone is enough) in env-locks/."),
    "matrix": ("rebase", "matrix_cmd",
            'The CI matrix: one cell per (pin, variant) and per newer upstream tag not yet pinned.'),
    "model": ("model", "model",
            'Checkpoints for the equivalence gate: built-in tiny models, DeepSeek\'s released layouts, slices.'),
    "perf": ("perf", "perf_cmd",
            'Speed gate: the patched and the unpatched build side by side under the same load. Exit 0 only on pass.'),
    "pin": ("pin", "pin_cmd",
            'Resolve the tag (git where reachable) and hash its release artifacts (PyPI) into upstream.lock.'),
    "power": ("power", "power_cmd",
            'Measure the smallest bug the gate flags: perturbations of known size planted in the engine, per module family, phase and dtype.'),
    "rebase": ("rebase", "rebase_cmd",
            "Carry ENGINE@OLD's stack onto --onto NEW: pin and fetch NEW, replay patch by patch (3-way), classify each patch, write patches/ENGINE/NEW and reports/rebase/ENGINE-OLD-to-NEW.{md,json}."),
    "refresh": ("refresh", "refresh_cmd",
            "Write the branch's commits to patches/ENGINE/TAG in normalized form and rewrite series."),
    "replay": ("replay", "replay_cmd",
            'Carry a stack through every upstream release from --from to --to, in order: rebase, lock, build and check at each; one table (release, each patch\'s class, verdict per configuration, time) and its JSON in reports/replay/.'),
    "report": ("report", "report_cmd",
            'Every pin: stack size, patches by Upstream-Status, last check and speed-gate verdicts, patches to drop.'),
    "serve": ("serve", "serve_cmd",
            'Build and install the pin, start its server with the model, print how to query it; Ctrl-C stops it.'),
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
        mod = importlib.import_module(f"patcher.cli.commands.{module}")
    except ModuleNotFoundError as e:  # a command family not in this checkout
        if e.name == f"patcher.cli.commands.{module}":
            return None
        raise
    cmd = getattr(mod, attr, None)
    if cmd is None:  # the attribute was renamed: find the command by name
        cmd = next((c for c in getattr(mod, "COMMANDS", []) if c.name == name), None)
    if cmd is not None:
        add_output_options(cmd)
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
        self._extra[name] = add_output_options(cmd)

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



def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`dsadapt --version`: dsadapt's version and where it runs (the environment, its Python, the
    source it was imported from, the versions of the packages the gate relies on); with --json
    (before or after) one document, schema dsadapt.version/1."""
    if not value or ctx.resilient_parsing:
        return
    from patcher.cli.commands.common import emit_json, out, version_info

    info = version_info()
    if _JSON_ASKED[0]:
        emit_json(info)
    else:
        pk = ", ".join(f"{n} {v}" for n, v in info["packages"].items() if v)
        out(f"dsadapt {info['dsadapt']} (Python {info['python']} {info['implementation']}, environment "
            f"{info['environment']}{' (a venv)' if info['venv'] else ''}; source {info['source']})")
        if pk:
            out(f"  {pk}")
    ctx.exit(0)


#: whether the command line asks for --json anywhere (read by eager options such as --version)
_JSON_ASKED = [False]


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show dsadapt's version and the environment it runs in (--json: as a document), and exit.")
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
    from patcher.cli.commands.common import Context

    click_ctx.obj = Context(project, json=as_json, report_dir=report_dir, publish=publish)


cli.commands = LazyCommands()
cli.params += output_options()
refuse_empty_paths(cli)


def main(argv: list[str] | None = None) -> int:
    """The CLI edge: run the command; render any error once, as plain text (and JSON with --json)."""
    from patcher.cli.commands.common import close_progress, reset_output
    from patcher.cli.render import render_error, to_error, wants_json

    args = list(sys.argv[1:] if argv is None else argv)
    as_json = wants_json(args)
    reset_output()
    _JSON_ASKED[0] = as_json
    import os

    if os.environ.get(COMPLETE_VAR):  # shell completion: `eval "$(_DSADAPT_COMPLETE=bash_source dsadapt)"`
        from click.shell_completion import shell_complete

        return shell_complete(cli, {}, "dsadapt", COMPLETE_VAR, os.environ[COMPLETE_VAR])
    _scrub_git_environment()
    previous = _terminate_like_interrupt()
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
        _annotate(err, args, as_json)
        return int(err.exit_code)
    finally:
        close_progress()
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)


# Variables a calling git (a hook, an alias) exports that would point dsadapt's own git
# commands at another repository or inject configuration into them.
_GIT_LEAKS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES",
              "GIT_COMMON_DIR", "GIT_NAMESPACE", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT", "GIT_PREFIX",
              "GIT_EXTERNAL_DIFF", "GIT_DIFF_OPTS", "GIT_EDITOR", "GIT_SEQUENCE_EDITOR", "GIT_TEMPLATE_DIR",
              "GIT_QUARANTINE_PATH", "GIT_REPLACE_REF_BASE", "GIT_SHALLOW_FILE",
              "GIT_GRAFT_FILE", "GIT_ATTR_SOURCE")


def _annotate(err, args: list[str], as_json: bool) -> None:
    """On GitHub Actions, the error once more as an `::error` annotation (the run's page lists it)."""
    from patcher.base.errors import ExitCode, one_line
    from patcher.cli.ci import annotate

    if err.exit_code in (ExitCode.INTERRUPTED, ExitCode.BROKEN_PIPE):
        return
    words = [a for a in args if not a.startswith("-")][:2]
    title = "dsadapt " + " ".join(words) if words else "dsadapt"
    with contextlib.suppress(OSError, ValueError):
        annotate("error", title, one_line(err.message) + (f" (hint: {one_line(err.hint)})" if err.hint else ""),
                 json_out=as_json)


def _terminate_like_interrupt():
    """SIGTERM (`timeout`, a CI runner cancelling a job, `kill`) ends dsadapt the way Ctrl-C does:
    cleanup runs (an engine or a reference runner dsadapt started in its own process group is
    stopped, a transaction rolls back), then exit 130. Without this, Python dies on the spot and
    those children run on, orphaned."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)  # the previous handler, restored when main() returns
    except (ValueError, OSError):  # not allowed here (embedded): keep the default
        return None


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

"""The CLI edge's error rendering: any exception becomes one typed error, printed once.

Human form (stderr, plain text, never markup)::

    error: <one line>
    hint: <one line>

With --json (a command's or the global one), stdout also gets one JSON document unless the
command already printed its own::

    {"schema": "dsadapt.error/1", "ok": false,
     "error": {"code": "usage", "exit_code": 2, "type": "LockError", "message": "...", "hint": "..."}}

DSADAPT_DEBUG=1 prints the traceback above the error (stderr); without it no traceback is ever
shown, also not for a bug (exit 8), which says how to get one.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import click

from patcher.base.errors import (
    DsadaptError,
    ExitCode,
    InternalError,
    Interrupted,
    MachineError,
    MissingDependency,
    UsageError,
    one_line,
    show,
)

#: What to do when an error carries no hint of its own, by exit code.
DEFAULT_HINTS = {
    ExitCode.FAILED: "see the report above",
    ExitCode.USAGE: "fix the input named above; `dsadapt COMMAND --help` shows the usage",
    ExitCode.VERIFICATION: "investigate before trusting it; the lock is the reference",
    ExitCode.STOPPED: "`dsadapt status` says where each checkout stands and what to run next",
    ExitCode.MISSING: "install what is named above",
    ExitCode.CANNOT_RUN: "run it on a machine that has what it needs (docs/user-guide.md)",
    ExitCode.ENVIRONMENT: "fix the machine problem named above and rerun",
    ExitCode.INTERNAL: "this is a bug in dsadapt: rerun with DSADAPT_DEBUG=1 for the traceback and report it",
    ExitCode.INTERRUPTED: "rerun the command; `dsadapt status` shows where each checkout stands",
}


def debug_enabled() -> bool:
    return os.environ.get("DSADAPT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def wants_json(args: list[str]) -> bool:
    """--json anywhere among the options (before a `--`)."""
    opts = args[:args.index("--")] if "--" in args else args
    return "--json" in opts


def _path_of(e: OSError) -> str:
    names = [str(os.fsdecode(x)) for x in (e.filename, e.filename2) if x is not None]
    return " -> ".join(show(n, 160) for n in names)


def os_error(e: OSError) -> DsadaptError:
    """An OSError as one typed line with a hint (exit 7), naming the path."""
    path = _path_of(e)
    at = f": {path}" if path else ""
    code = e.errno
    workdir_hint = ("point DSADAPT_WORKDIR (and DSADAPT_CACHE, DSADAPT_VENVS) at a writable place with room, "
                    "or fix this one")
    if code == errno.EROFS:
        return MachineError(f"read-only file system{at}", hint=f"make it writable, or {workdir_hint}")
    if code in (errno.EACCES, errno.EPERM):
        return MachineError(f"permission denied{at}",
                            hint="check the owner and mode (ls -ld; chattr -i if immutable), or " + workdir_hint)
    if code == errno.ENOSPC:
        return MachineError(f"no space left on the device{at}",
                            hint="free space (old venvs and the cache under .dsadapt/ can go), or " + workdir_hint)
    if code == errno.EDQUOT:
        return MachineError(f"disk quota exceeded{at}", hint="free space within your quota, or " + workdir_hint)
    if code == errno.EFBIG:
        return MachineError(f"file too large for this process or file system{at}",
                            hint="raise the file-size limit (`ulimit -f unlimited`) or use another file system")
    if code == errno.ELOOP:  # a path of the user's that loops: bad input, not the machine
        return UsageError(f"a symbolic link loop{at}", hint="point the link at a real file or folder, or remove it")
    if code in (errno.EMFILE, errno.ENFILE):
        return MachineError("too many open files", hint="raise the limit (`ulimit -n 4096`) and rerun")
    if code == errno.ENOMEM:
        return MachineError("out of memory", hint="free memory or run on a larger machine")
    if code == errno.EIO:
        return MachineError(f"input/output error{at}", hint="the disk or file system is failing; check `dmesg`")
    if isinstance(e, FileNotFoundError) and e.filename is not None and os.sep not in str(e.filename):
        # a program that is not installed (subprocess of 'git', 'pip', ...)
        return MissingDependency(f"{show(e.filename, 60)} not found on PATH", hint="install it and rerun")
    what = e.strerror or e.__class__.__name__
    return MachineError(f"{what.lower() if what[:1].isupper() and what[1:2].islower() else what}{at}",
                        hint="fix the file-system problem named above and rerun")


def _input_loop(e: BaseException) -> UsageError | None:
    """Inputs that loop or nest without end, read where no caller named the file: a symbolic link
    loop (pathlib's RuntimeError) or JSON nested deeper than the parser goes. Bad input (exit 2),
    never a bug."""
    text = str(e)
    if isinstance(e, RuntimeError) and not isinstance(e, RecursionError) and text.startswith("Symlink loop from"):
        where = text.removeprefix("Symlink loop from").strip().strip("'")
        return UsageError(f"a symbolic link loop: {show(where, 160)}",
                          hint="point the link at a real file or folder, or remove it")
    if isinstance(e, RecursionError) and "JSON" in text:
        return UsageError("an input is not valid JSON (nested too deeply to read)",
                          hint="pass the file dsadapt or the tool named in the option's help wrote")
    return None


def to_error(e: BaseException, args: list[str] | None = None) -> DsadaptError:
    """Any exception as a typed dsadapt error (each with its exit code)."""
    if isinstance(e, DsadaptError):
        return e
    if isinstance(e, (KeyboardInterrupt, click.exceptions.Abort)):
        return Interrupted("interrupted", hint=DEFAULT_HINTS[ExitCode.INTERRUPTED])
    if isinstance(e, click.ClickException):
        return _click_error(e)
    if isinstance(e, UnicodeEncodeError):
        return MachineError(f"the output encoding ({e.encoding}) cannot print {e.object[e.start:e.end]!r}",
                            hint="use a UTF-8 locale or set PYTHONIOENCODING=utf-8")
    if isinstance(e, UnicodeDecodeError):
        return UsageError(f"an input is not UTF-8 text (byte 0x{e.object[e.start:e.start + 1].hex()} at offset "
                          f"{e.start})", hint="save the file as UTF-8")
    if isinstance(e, OSError):
        return os_error(e)
    loop = _input_loop(e)
    if loop is not None:
        return loop
    sp = sys.modules.get("subprocess")  # (not imported here: a timeout can only come from code that did)
    if sp is not None and isinstance(e, sp.TimeoutExpired):
        cmd = e.cmd if isinstance(e.cmd, str) else " ".join(str(x) for x in (e.cmd or [])[:3])
        return MachineError(f"{show(cmd, 60)} did not finish within {e.timeout:g} s",
                            hint="check the network or raise DSADAPT_GIT_TIMEOUT, then rerun")
    if isinstance(e, MemoryError):
        return MachineError("out of memory", hint="free memory or run on a larger machine")
    name = type(e).__name__
    if name == "GitCommandNotFound":  # GitPython: no git executable
        return MissingDependency("git not found on PATH", hint="install git (apt-get install git) and rerun")
    text = str(e).strip().splitlines()
    return InternalError(f"internal error: {name}" + (f": {text[0]}" if text else ""),
                         hint=DEFAULT_HINTS[ExitCode.INTERNAL])


def _click_error(e: click.ClickException) -> UsageError:
    ctx = getattr(e, "ctx", None)
    if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:  # `dsadapt` alone: the help, then the error
        click.echo(ctx.get_help())
        return UsageError(f"no command given to {ctx.command_path}", hint=f"see `{ctx.command_path} --help`")
    msg = e.format_message().strip().rstrip(".")
    msg = msg[:1].lower() + msg[1:] if msg[:1].isupper() and msg[1:2].islower() else msg
    if ctx is not None:
        hint = f"usage: {ctx.command_path} {' '.join(ctx.command.collect_usage_pieces(ctx))}".rstrip() \
               + f"; see `{ctx.command_path} --help`"
    else:
        hint = "see `dsadapt --help`"
    return UsageError(" ".join(msg.split()), hint=hint)


def render_error(err: DsadaptError, cause: BaseException | None = None, *, as_json: bool = False) -> None:
    """Print the error once: traceback (DSADAPT_DEBUG=1 only), `error:` and `hint:` on stderr, and
    with --json a JSON error object on stdout (unless the command already printed its document)."""
    from patcher.cli.commands.common import json_emitted

    code = ExitCode(err.exit_code) if err.exit_code in ExitCode._value2member_map_ else None
    hint = err.hint or DEFAULT_HINTS.get(code, "") if code is not None else err.hint
    message = one_line(err.message)
    hint_line = one_line(hint) if hint else None
    try:
        if debug_enabled() and cause is not None:
            import traceback

            traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
        sys.stderr.write(f"error: {message}\n")
        if hint_line:
            sys.stderr.write(f"hint: {hint_line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if as_json and not json_emitted():
        doc = {"schema": "dsadapt.error/1", "ok": False, "error": {"code": code.label if code is not None else "error",
                                      "exit_code": int(err.exit_code), "type": type(err).__name__,
                                      "message": message, "hint": hint_line}}
        try:
            sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):
            pass

"""Typed errors. Each carries a one-line message and a hint saying how to fix it.

They are raised by the core library and rendered exactly once, at the CLI edge
(`patcher.cli.main.main`), as plain text: ``error: <message>`` then ``hint: <hint>`` on stderr
(and, with ``--json``, one JSON error object on stdout).

Every exit code has one meaning, for every command (the table in docs/user-guide.md, kept
true by tests/project/test_exit_codes.py):

====  ============  ==================================================================
code  name          meaning
====  ============  ==================================================================
0     ok            success (for `check`: the gate passed)
1     failed        a verdict: the command ran to its end and found a failure (the gate
                    failed, `verify` found problems, `build-all` / `check --all` had a failure)
2     usage         bad input: arguments, upstream.lock, dsadapt.toml, DSADAPT_* variables,
                    a stack's series or patch files, an unsafe patch or artifact
3     verification  something does not match the lock (moved tag, sha256, tree or blob id)
4     stopped       stopped or refused because of the state on disk: a conflict stop, a dirty
                    checkout, unexported commits, an operation (not) in progress, another run
                    holding the work dir, a different file where dsadapt would write
5     missing       a toolchain or dependency this machine lacks (install it)
6     cannot-run    cannot run here: no GPU, wrong Python, no reachable source (never a pass)
7     environment   the machine failed the operation: file system (read-only, permission,
                    disk full, quota), or a tool (git, pip, a server) failing unexpectedly
8     internal      a bug in dsadapt (rerun with DSADAPT_DEBUG=1 for the traceback)
130   interrupted   interrupted (Ctrl-C / SIGINT)
141   broken-pipe   the reader of stdout went away (`dsadapt list | head -1`): output cut short,
                    nothing printed about it (as a program killed by SIGPIPE)
====  ============  ==================================================================
"""

from __future__ import annotations

import enum
import re


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    VERIFICATION = 3
    STOPPED = 4
    MISSING = 5
    CANNOT_RUN = 6
    ENVIRONMENT = 7
    INTERNAL = 8
    INTERRUPTED = 130
    BROKEN_PIPE = 141

    @property
    def label(self) -> str:
        """The short name used in JSON error objects (`"code": "usage"`)."""
        return _LABELS[self]


_LABELS = {
    ExitCode.OK: "ok", ExitCode.FAILED: "failed", ExitCode.USAGE: "usage", ExitCode.VERIFICATION: "verification",
    ExitCode.STOPPED: "stopped", ExitCode.MISSING: "missing", ExitCode.CANNOT_RUN: "cannot-run",
    ExitCode.ENVIRONMENT: "environment", ExitCode.INTERNAL: "internal", ExitCode.INTERRUPTED: "interrupted",
    ExitCode.BROKEN_PIPE: "broken-pipe",
}


class DsadaptError(Exception):
    """Base class. `exit_code` is what the CLI exits with; subclasses say which one (a class keyword).

    A bare DsadaptError means "the operation failed for a reason outside the input" (7).
    """

    exit_code: int = ExitCode.ENVIRONMENT

    def __init_subclass__(cls, exit_code: int | None = None, **kw) -> None:
        """`class X(DsadaptError, exit_code=ExitCode.USAGE)`: the code X and its subclasses exit with."""
        super().__init_subclass__(**kw)
        if exit_code is not None:
            cls.exit_code = exit_code

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


class UsageError(DsadaptError, exit_code=ExitCode.USAGE):
    """Bad input: arguments, environment variables, unknown engine, malformed ENGINE@TAG, ..."""


class ConfigError(UsageError):
    """dsadapt.toml or a DSADAPT_* environment variable is malformed."""


class LockError(UsageError):
    """upstream.lock is malformed or lacks what was asked for."""


class StackError(UsageError):
    """A patch stack (series + patch files) is malformed."""


class PatchFormatError(StackError):
    """A patch file cannot be parsed, is not normalized, or touches what a patch may not touch."""


class UnsafeArtifact(UsageError):
    """A pinned artifact would write outside the tree or into git's own files: refused, as data."""


class SourceError(DsadaptError, exit_code=ExitCode.CANNOT_RUN):
    """No source could materialize a pinned tree here (no network, no mirror, no artifact)."""


class VerificationError(DsadaptError, exit_code=ExitCode.VERIFICATION):
    """Something does not match the lock (moved tag, sha256, tree or blob id)."""


class WorkspaceError(DsadaptError, exit_code=ExitCode.STOPPED):
    """The state on disk forbids the operation (dirty, mid-apply, nothing in progress, busy...)."""


class ConflictStop(DsadaptError, exit_code=ExitCode.STOPPED):
    """A patch did not apply; the checkout is stopped mid-apply for the user to resolve."""


class RefusedToClobber(WorkspaceError):
    """dsadapt would overwrite something it did not write (a different file of the same name)."""


class BuildError(DsadaptError):
    """A build could not be made (a tool failed)."""


class ToolchainMissing(BuildError, exit_code=ExitCode.MISSING):
    """A full source build (or a command) needs a toolchain or dependency this machine lacks."""


class MissingDependency(ToolchainMissing):
    """An optional Python dependency (an extra of dsadapt) is not installed."""


class EngineRunFailed(DsadaptError, exit_code=ExitCode.FAILED):
    """The engine could not load or run the model (a runner exit, a server that died at load).

    For the gate that is a verdict (fail), not an accident: `check` reports it as such.
    Subclasses may carry `log_path` / `log_tail`.
    """


class CheckFailed(DsadaptError, exit_code=ExitCode.FAILED):
    """The equivalence gate found a divergence."""


class EngineUnavailable(DsadaptError, exit_code=ExitCode.CANNOT_RUN):
    """The engine cannot run on this machine (no GPU, wrong Python...). Never a pass."""


class MachineError(DsadaptError, exit_code=ExitCode.ENVIRONMENT):
    """The machine failed the operation: file system (read-only, permission, disk full) or a tool."""


class InternalError(DsadaptError, exit_code=ExitCode.INTERNAL):
    """A bug in dsadapt: an exception nobody expected."""


class Interrupted(DsadaptError, exit_code=ExitCode.INTERRUPTED):
    """Ctrl-C (SIGINT) stopped the command."""


# ---------------------------------------------------------------- one-line text

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\x85]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_line(text: str) -> str:
    """Text made one line: newlines, tabs and other control characters escaped (\\n, \\x1b)."""
    return _CONTROL.sub(lambda m: _ESCAPES.get(m.group(), f"\\x{ord(m.group()):02x}"
                                               if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}"), text)


def show(value: object, limit: int = 80) -> str:
    """A user-supplied value as it may be echoed in a message: one line, at most `limit` characters
    (longer values are cut in the middle with an ellipsis and their length)."""
    text = escape_line(str(value))
    if len(text) <= limit:
        return text
    keep = max(limit - 24, 8)
    head, tail = text[: keep * 2 // 3], text[-(keep // 3):]
    return f"{head}…{tail} ({len(str(value))} chars)"


def plural(n: int, one: str, many: str | None = None) -> str:
    """'1 patch', '2 patches', '0 patches'."""
    return f"{n} {one if n == 1 else (many or one + ('es' if one.endswith(('ch', 'sh', 's', 'x')) else 's'))}"


def number(x: float | None, digits: int = 2) -> str:
    """A measured number for people: `digits` significant digits, scientific below 0.01 and from
    10,000 on with a one-digit exponent ('8.0e-4', not 0.000799984 or 8e-04), '0', '-' for None,
    'inf'/'nan' as Python spells them."""
    import math

    if x is None:
        return "-"
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    if 0.01 <= abs(x) < 10_000:
        text = f"{x:.{digits}g}"
        return text if "e" not in text else f"{x:.0f}"
    mantissa, exp = f"{x:.{max(digits - 1, 0)}e}".split("e")
    return f"{mantissa}e{int(exp)}"


def size_words(n: float | None) -> str:
    """A size in bytes for people, three significant digits in the unit that fits: '0.93 GiB' (from
    0.1 GiB on), '87.5 MiB', '12 KiB', '900 B'; '-' for None."""
    if n is None:
        return "-"
    for unit, size, start in (("GiB", 2**30, 0.1), ("MiB", 2**20, 0.1), ("KiB", 2**10, 1)):
        v = n / size
        if abs(v) >= start:
            return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


def one_line(text: str, limit: int = 2000, token_limit: int = 240) -> str:
    """What the CLI edge prints for a message or hint: one line, no run of non-blank characters
    longer than `token_limit`, at most `limit` characters."""
    text = escape_line(text)
    text = re.sub(r"\S{" + str(token_limit + 1) + ",}", lambda m: show(m.group(), token_limit), text)
    return text if len(text) <= limit else show(text, limit)

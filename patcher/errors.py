"""Typed errors. Each carries a one-line message and a hint saying how to fix it.

They are raised by the core library and rendered exactly once, at the CLI edge
(`patcher.cli`), as ``error: <message>`` followed by ``hint: <hint>``.
"""

from __future__ import annotations


class DsadaptError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


class UsageError(DsadaptError):
    """Bad arguments: unknown engine, malformed ENGINE@TAG, ..."""

    exit_code = 2


class LockError(DsadaptError):
    """upstream.lock is malformed or lacks what was asked for."""

    exit_code = 2


class StackError(DsadaptError):
    """A patch stack (series + patch files) is malformed."""

    exit_code = 2


class PatchFormatError(StackError):
    """A patch file cannot be parsed or is not normalized."""


class SourceError(DsadaptError):
    """No source could materialize a pinned tree."""


class VerificationError(DsadaptError):
    """Something does not match the lock (moved tag, sha256, tree or blob id)."""

    exit_code = 3


class WorkspaceError(DsadaptError):
    """The checkout is in a state that forbids the operation (dirty, mid-apply...)."""


class ConflictStop(DsadaptError):
    """A patch did not apply; the checkout is stopped mid-apply for the user to resolve."""

    exit_code = 4


class Refused(DsadaptError):
    """dsadapt refused to overwrite something newer than what it would write (e.g. `refresh` over
    patches/ files changed since apply); `--force` overwrites and keeps a backup."""

    exit_code = 4


class BuildError(DsadaptError):
    """A build could not be made."""


class ToolchainMissing(BuildError):
    """A full source build needs a toolchain this machine lacks."""

    exit_code = 5


class EngineRunFailed(DsadaptError):
    """The engine could not load or run the model (a runner exit, a server that died at load).

    For the gate that is a verdict (fail), not an accident: `check` reports it as such.
    Subclasses may carry `log_path` / `log_tail`.
    """


class CheckFailed(DsadaptError):
    """The equivalence gate found a divergence."""

    exit_code = 1


class EngineUnavailable(DsadaptError):
    """The engine cannot run on this machine (no GPU, wrong Python...). Never a pass."""

    exit_code = 6

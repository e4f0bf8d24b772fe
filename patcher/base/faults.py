"""A testing hook: kill dsadapt at a chosen point, the way a power cut or `kill -9` would.

Off unless the environment sets it; read once per process:

- ``DSADAPT_FAULT=<event>:<n>`` sends SIGKILL to dsadapt's own process group (the git
  process it is running dies with it) at the n-th occurrence (1-based) of <event>:

  - ``git-start``  just before a git subprocess is started;
  - ``git-end``    just after a git subprocess exited, before dsadapt looked at its result;
  - ``write``      inside a durable write, after the new bytes are on disk under a temporary
                   name and before the rename that makes them visible;
  - ``written``    after that rename (the directory not yet fsynced);
  - ``unlink``     just before a file or directory is removed;
  - ``any``        the n-th of all of the above.

- ``DSADAPT_FAULT_LOG=<file>`` appends one line per event (``<event> <detail>``), so a test can
  count the points an uninterrupted run passes and then kill at each of them.

The fault-injection tests (tests/stack/test_transaction_faults.py, tests/stack/test_transaction_property.py) drive it.
It has no other use; nothing in dsadapt behaves differently when it is unset.
"""

from __future__ import annotations

import os
import signal

EVENTS = ("git-start", "git-end", "write", "written", "unlink")

_spec: tuple[str, int] | None = None
_log: str | None = None
_counts: dict[str, int] = {}
_loaded = False


def _load() -> None:
    global _spec, _log, _loaded
    _loaded = True
    raw = os.environ.get("DSADAPT_FAULT", "")
    if raw:
        event, _, n = raw.rpartition(":")
        if event in (*EVENTS, "any") and n.isdigit() and int(n) > 0:
            _spec = (event, int(n))
    _log = os.environ.get("DSADAPT_FAULT_LOG") or None


def reset() -> None:
    """Read the environment again (for in-process tests that change it)."""
    global _spec, _log
    _spec, _log = None, None
    _counts.clear()
    _load()


def point(event: str, detail: str = "") -> None:
    """A place where the process may be killed (no-op unless DSADAPT_FAULT says so)."""
    if not _loaded:
        _load()
    if _spec is None and _log is None:
        return
    if _log is not None:
        with open(_log, "a", encoding="utf-8") as f:
            f.write(f"{event} {detail}\n")
    if _spec is None:
        return
    _counts[event] = _counts.get(event, 0) + 1
    _counts["any"] = _counts.get("any", 0) + 1
    want, n = _spec
    if _counts.get(want, 0) == n:
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:  # not a group leader's group we may signal: kill at least ourselves
            os.kill(os.getpid(), signal.SIGKILL)

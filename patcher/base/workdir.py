"""The work-dir lock: one dsadapt run at a time per work dir (flock; it dies with the process)."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from patcher.base.errors import WorkspaceError


@contextmanager
def workdir_lock(cfg, timeout: float | None = None) -> Iterator[None]:
    """Serialize dsadapt runs on one work dir. flock dies with the process: no stale locks."""
    if timeout is None:  # DSADAPT_LOCK_TIMEOUT, validated by load_config
        timeout = getattr(cfg, "lock_timeout", None)
        timeout = float(os.environ.get("DSADAPT_LOCK_TIMEOUT", "600")) if timeout is None else timeout
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    path = cfg.workdir / "lock"
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise WorkspaceError(f"another dsadapt run holds {path} (pid {holder})",
                                         hint="wait for it to finish, or set DSADAPT_LOCK_TIMEOUT") from None
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


def lock_holder(cfg) -> int | None:
    """The pid of the dsadapt run holding the work-dir lock now (-1 if unknown), None if nobody does."""
    path = cfg.workdir / "lock"
    if not path.exists():
        return None
    try:
        with open(path, "r+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = f.read().strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return None
    return None

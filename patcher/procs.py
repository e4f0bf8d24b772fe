"""Process groups dsadapt starts (engine runners, servers): the one way they are ended.

Everything dsadapt runs that may spawn helpers (vLLM's engine core and resource tracker,
tritonserver's backend stubs) is started in its own session (``start_new_session=True``), so
its process group id is its pid and the whole group can be ended without touching anything
else on the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid` (a /proc scan; field 5 of /proc/PID/stat)."""
    pids: list[int] = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return pids
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to the process group; a group that is gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(proc: subprocess.Popen, grace_s: float = 0.0, settle_s: float = 10.0) -> None:
    """End the process group `proc` leads: SIGTERM and up to `grace_s` for it to leave
    (skipped when 0), then SIGKILL whatever is left; reap `proc` and wait up to `settle_s`
    for the group to be gone."""
    pgid = proc.pid
    if grace_s > 0:
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_members(pgid):
                return
            time.sleep(0.2)
    signal_group(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + settle_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)

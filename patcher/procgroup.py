"""Processes dsadapt starts and must always stop: servers and load generators of `dsadapt perf`.

Each command runs under `procguard.py` (started as the leader of a new session), so the
command and everything it spawns share one process group whose id is the guard's pid. The
guard ends that group when this process is gone (even after SIGKILL), when the deadline
passes, or when asked; `Guarded.stop` asks, then makes sure. `group_rss` and `gpu_memory`
read what the group holds, for the peak-memory columns.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping, Sequence

GUARD = Path(__file__).resolve().with_name("procguard.py")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid` (a /proc scan; zombies excluded)."""
    pids: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def group_rss(pgid: int) -> int:
    """Resident bytes of every process in the group now (sum of their RSS)."""
    total = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def gpu_memory(pids: Sequence[int]) -> int | None:
    """Bytes of GPU memory the given pids hold (nvidia-smi), or None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return None
    wanted, total = set(pids), 0
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in wanted:
            try:
                total += int(float(parts[1])) * 1024 * 1024
            except ValueError:
                continue
    return total


@dataclass
class Guarded:
    """A command running under procguard in its own process group."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def members(self) -> list[int]:
        return group_members(self.pgid)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, give it `grace_s`, then SIGKILL; return once no member is left."""
        try:
            os.killpg(self.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=grace_s + 12)  # the guard itself escalates after its grace
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 15
        while True:
            left = self.members()
            if not left:
                break
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def start_guarded(name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None, deadline_s: float = 3600.0, cpus: Sequence[int] = (),
                  grace_s: float = 10.0, stdin_pipe: bool = False) -> Guarded:
    """Start `argv` under procguard, its output in a fresh `log_path`; stdin a pipe if asked."""
    guard = [sys.executable, str(GUARD), "--parent", str(os.getpid()), "--deadline", f"{deadline_s:.0f}",
             "--grace", f"{grace_s:g}"]
    if cpus:
        guard += ["--cpus", ",".join(str(c) for c in cpus)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[bytes]
    with open(log_path, "wb") as log:  # a fresh log: an earlier run's errors must not read as this one's
        log.write(("$ " + " ".join(str(a) for a in argv) + "\n").encode())
        log.flush()
        proc = subprocess.Popen([*guard, "--", *[str(a) for a in argv]], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
    return Guarded(name, proc, log_path, [str(a) for a in argv])


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def repin(pgid: int, cpus: Sequence[int], keep: Sequence[int] = ()) -> int:
    """Move every thread of the group onto `cpus`, except threads already pinned inside `keep`
    (an engine's compute threads, which the engine bound itself). Returns threads moved."""
    target, keep_set, moved = set(cpus), set(keep), 0
    if not target:
        return 0
    for pid in group_members(pgid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                current = os.sched_getaffinity(tid)
                if keep_set and current <= keep_set:
                    continue
                if current != target:
                    os.sched_setaffinity(tid, target)
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return moved

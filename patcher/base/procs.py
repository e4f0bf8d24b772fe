"""Process groups dsadapt starts (engine runners, servers, load generators): the one way they are ended.

Everything dsadapt runs that may spawn helpers (vLLM's engine core and resource tracker,
tritonserver's backend stubs) is started in its own session (``start_new_session=True``), so
its process group id is its pid and the whole group can be ended without touching anything
else on the machine.

Processes that must stop even when dsadapt itself is killed outright (the servers and load
generators of `dsadapt perf`) run under a *guard*: this file run as a script,

    python -I procs.py --guard --parent PID --deadline SECONDS [--cpus 0,1] [--grace S] -- ARGV...

(stdlib only, so any interpreter runs it, never importing ``patcher``). The guard leads a new
session and starts ARGV in its own process group, then ends that group -- SIGTERM first,
SIGKILL after ``--grace`` seconds -- when the process that started it is gone (its parent pid
changes: dsadapt was killed, even with SIGKILL), when ``--deadline`` passes (a run always stops
by itself), when it gets SIGTERM/SIGINT/SIGHUP (dsadapt's normal stop), or when ARGV exits.
It exits with ARGV's status when ARGV exited first, else 124 (deadline) or 143.
`start_guarded` starts one; `Guarded.stop` asks it to stop, then makes sure (`stop_group`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
POLL_S = 0.2


def group_members(pgid: int, exclude: Sequence[int] = ()) -> list[int]:
    """Live pids whose process group is `pgid` (a /proc scan; field 5 of /proc/PID/stat; zombies
    and `exclude` left out)."""
    pids: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
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


# ---------------------------------------------------------------- servers: ports and readiness


@dataclass
class LoggedRun:
    """How a `run_logged` child ended: its status (124 when it ran past its timeout and was killed)
    and the wall time it took."""

    returncode: int
    timed_out: bool
    wall_s: float


def run_logged(argv: Sequence[str], log: IO[str], timeout: float | None, *, env: Mapping[str, str] | None = None,
               on_line=None) -> LoggedRun:
    """Run argv in its own session with stdout+stderr written line by line to `log` (after a
    ``$ argv`` line) and handed to `on_line`; past `timeout` seconds (None: no limit) its whole
    process group is killed. When it is done, or the caller is interrupted, its process group is
    ended too: helpers it spawned (multiprocessing resource trackers, engine workers) may live on
    holding the output pipe."""
    import threading

    log.write("$ " + " ".join(argv) + "\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace", start_new_session=True)
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        signal_group(proc.pid, signal.SIGKILL)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if on_line:
                on_line(line.rstrip("\n"))

    timer = threading.Timer(timeout, expire) if timeout is not None else None
    if timer is not None:
        timer.start()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        stop_group(proc)
        reader.join(timeout=30)
    return LoggedRun(124 if timed_out.is_set() else rc, timed_out.is_set(), time.monotonic() - t0)


class OutputTail:
    """A child's output as `run_logged` hands it over (its `on_line`): each non-empty line to the
    progress display as what the step waits on (`prefix` first; lines starting with one of `quiet`
    are kept but not shown), the last `keep` lines kept for the error that quotes them."""

    def __init__(self, progress=None, prefix: str = "", keep: int = 400, quiet: tuple[str, ...] = ()):
        self.note = getattr(progress, "note", None)
        self.prefix, self.keep, self.quiet = prefix, keep, quiet
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        line = line.rstrip()
        if not line:
            return
        self.lines.append(line)
        del self.lines[:-self.keep]
        if self.note and not line.startswith(self.quiet):
            self.note(self.prefix + line)

    @property
    def last(self) -> str | None:
        """The last line shown (not one of the `quiet` ones)."""
        return next((ln for ln in reversed(self.lines) if not ln.startswith(self.quiet)), None)


def free_port(host: str = "127.0.0.1", avoid: Sequence[int] = ()) -> int:
    """A port nothing listens on now (the kernel's pick), not one of `avoid`."""
    import socket

    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """GET `url` answers 200 (anything else, or no answer: False)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


# ---------------------------------------------------------------- what a group holds


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
            with contextlib.suppress(ValueError):
                total += int(float(parts[1])) * 1024 * 1024
    return total


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


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- guarded processes


@dataclass
class Guarded:
    """A command running under the guard, in its own process group (the guard's pid)."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)
    grace_s: float = 10.0

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def members(self) -> list[int]:
        return group_members(self.pgid)

    def send_job(self, doc: dict, done: Path) -> bool:
        """One job of the done-file protocol of dsadapt's long-lived runners (JSON lines on stdin,
        each answered by writing its ``done`` file): `doc` sent with `done` (made ready: its folder
        made, an old one removed). False when the process's stdin is gone."""
        done.parent.mkdir(parents=True, exist_ok=True)
        done.unlink(missing_ok=True)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({**doc, "done": str(done)}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        return True

    def wait_for(self, path: Path, timeout_s: float) -> str:
        """Wait for `path` to appear: "done", or "exited" (the process ended first), or "late"."""
        end = time.monotonic() + timeout_s
        while not path.exists():
            if not self.alive():
                return "exited"
            if time.monotonic() > end:
                return "late"
            time.sleep(0.05)
        return "done"

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the group (the guard escalates to SIGKILL after its grace), then make sure:
        SIGKILL whatever is left; return once no member is left."""
        grace = self.grace_s if grace_s is None else grace_s
        stop_group(self.proc, grace_s=grace + 5, settle_s=15)
        if self.proc.stdin:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def start_guarded(name: str, argv: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None, deadline_s: float = 3600.0, cpus: Sequence[int] = (),
                  grace_s: float = 10.0, stdin_pipe: bool = False) -> Guarded:
    """Start `argv` under the guard, its output in a fresh `log_path`; stdin a pipe if asked."""
    guard = [sys.executable, "-I", str(Path(__file__).resolve()), "--guard", "--parent", str(os.getpid()),
             "--deadline", f"{deadline_s:.0f}", "--grace", f"{grace_s:g}"]
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
    return Guarded(name, proc, log_path, [str(a) for a in argv], grace_s)


def _guard_members(pgid: int) -> list[int]:
    """The group's live pids other than the guard, reaping the guard's finished children."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    return group_members(pgid, exclude=(os.getpid(),))


def _guard_end_group(grace: float) -> None:
    """SIGTERM the group (the guard ignores it), wait, then SIGKILL whatever is left of it."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal_group(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and _guard_members(pgid):
        time.sleep(POLL_S)
    end = time.monotonic() + 10
    while (left := _guard_members(pgid)) and time.monotonic() < end:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def guard_main(argv: list[str]) -> int:
    """The guard (see the module's doc)."""
    import argparse

    if "--" not in argv:
        raise SystemExit("guard: usage: procs.py --guard --parent PID --deadline S [--cpus LIST] -- ARGV...")
    i = argv.index("--")
    p = argparse.ArgumentParser(prog="procs.py --guard")
    p.add_argument("--guard", action="store_true")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--deadline", type=float, required=True, help="seconds from now")
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--cpus", default="")
    args = p.parse_args(argv[:i])
    command = argv[i + 1:]
    if not command:
        raise SystemExit("guard: nothing to run after --")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",") if c.strip()})
    stop: dict[str, int | None] = {"why": None}

    def on_signal(signum, _frame):
        stop["why"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    deadline = time.monotonic() + args.deadline
    child = subprocess.Popen(command)  # stdin is the guard's: a pipe for a load generator, else /dev/null
    while True:
        code = child.poll()
        if code is not None:
            if _guard_members(os.getpgrp()):
                _guard_end_group(args.grace)
            return code
        if stop["why"] is not None or os.getppid() != args.parent or time.monotonic() >= deadline:
            timed_out = stop["why"] is None and os.getppid() == args.parent
            if timed_out:
                print(f"guard: {command[0]} ran past its {args.deadline:.0f} s limit; stopping it", flush=True)
            _guard_end_group(args.grace)
            return 124 if timed_out else 143
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(guard_main(sys.argv[1:]))

"""Run a command so that it always stops: the guard of a server started by dsadapt.

    python procguard.py --parent PID --deadline SECONDS [--cpus 0,1] [--grace S] -- ARGV...

Standalone (stdlib only; run with any interpreter, never imports `patcher`). The caller
starts the guard as the leader of a new session (``start_new_session=True``); the guard
starts ARGV in that same process group, so the whole tree a server spawns (vLLM's API
server, engine core, workers) shares one group id, the guard's pid. The guard then ends
that group, SIGTERM first and SIGKILL after ``--grace`` seconds, when

- the process that started it is gone (its parent pid changes: the orchestrator was
  killed, even with SIGKILL, so nothing is left behind),
- ``--deadline`` seconds have passed (a run always stops by itself),
- it receives SIGTERM or SIGINT (the orchestrator's normal stop),
- ARGV exits (whatever ARGV left running in the group goes with it).

``--cpus`` pins the guard, and so ARGV and everything it starts, to those CPU ids.
The guard exits with ARGV's status when ARGV exited first, else 124 (deadline) or 143,
after the rest of its group is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("procguard: usage: procguard.py --parent PID --deadline S [--cpus LIST] -- ARGV...")
    i = argv.index("--")
    p = argparse.ArgumentParser(prog="procguard")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--deadline", type=float, required=True, help="seconds from now")
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--cpus", default="")
    args = p.parse_args(argv[:i])
    command = argv[i + 1:]
    if not command:
        raise SystemExit("procguard: nothing to run after --")
    return args, command


def _end_group(grace: float) -> None:
    """SIGTERM the group (the guard ignores it), wait, then SIGKILL whatever is left of it."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while time.monotonic() < end and _members(pgid):
        time.sleep(POLL_S)
    end = time.monotonic() + 10
    while (left := _members(pgid)) and time.monotonic() < end:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _members(pgid: int) -> list[int]:
    """Live pids of the group other than the guard (reaping the guard's finished children)."""
    me = os.getpid()
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
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


def main(argv: list[str]) -> int:
    args, command = _parse(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",") if c.strip()})
    stop = {"why": None}

    def on_signal(signum, _frame):
        stop["why"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    deadline = time.monotonic() + args.deadline
    child = subprocess.Popen(command)  # stdin is the guard's: a pipe for a load generator, else /dev/null
    while True:
        code = child.poll()
        if code is not None:
            if _members(os.getpgrp()):
                _end_group(args.grace)
            return code
        if stop["why"] is not None or os.getppid() != args.parent or time.monotonic() >= deadline:
            timed_out = stop["why"] is None and os.getppid() == args.parent
            if timed_out:
                print(f"procguard: {command[0]} ran past its {args.deadline:.0f} s limit; stopping it", flush=True)
            _end_group(args.grace)
            return 124 if timed_out else 143
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

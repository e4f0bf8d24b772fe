"""SIGTERM ends dsadapt like Ctrl-C: cleanup runs, and no runner it started is left behind.

`timeout`, a CI job being cancelled, or `kill` send SIGTERM; Python's default is to die on the
spot, which left an engine's or the reference's runner (own process group) running on (seen on
the GPU machine: orphaned reference runners starved the next checks of CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO_ROOT

PARENT = """
import sys
from pathlib import Path
from patcher.cli import main as cli
from patcher.runners.launch import RunnerSpec, RunnerJob, run_runner

cli._terminate_like_interrupt()
try:
    run_runner(RunnerSpec("sleeper", Path(sys.argv[1])), Path(sys.executable),
               RunnerJob(Path("."), [], "float32", 1, 1, Path(sys.argv[2])))
except KeyboardInterrupt:
    sys.exit(130)
"""

SLEEPER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[sys.argv.index("--out") + 1] + ".pid").write_text(str(os.getpid()))
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_runner_group_and_exits_130(tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(SLEEPER)
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(sleeper), str(out)], env=env)
    pid_file = Path(str(out) + ".pid")
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    assert _alive(child)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 130
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the runner outlived dsadapt"

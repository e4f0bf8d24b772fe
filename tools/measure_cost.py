"""Run a command and measure its wall time and peak memory, split by who holds it (stdlib only).

    python3 tools/measure_cost.py [--out cost.json] -- COMMAND [ARGS...]

Every 0.5 s it walks the command's process tree (/proc) and sums the resident memory of each
group of processes: ``reference`` (the HF reference runner, hf_reference.py, and its children),
``engine`` (an engine's runner or server and its children: vLLM's engine core, LMDeploy's
workers), ``other`` (dsadapt itself, fabrication workers, ...); on a machine with nvidia-smi
also the GPU memory of each group's processes. Prints (and writes with --out) one JSON object:
the command's exit status, wall seconds, and per group the peak RSS and GPU memory in MiB, the
seconds the group was alive and its CPU seconds. The command's own output goes through unchanged. Used for the
cost table of docs/benchmarks.md and by tools/device/fp8_h200.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

GROUPS = ("reference", "engine", "other")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(p.name))
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def _group(cmd: str) -> str | None:
    if "hf_reference.py" in cmd:
        return "reference"
    if cmd.startswith("VLLM::"):  # vLLM renames its processes (engine core, workers, and the runner's)
        return "engine"
    if ("/engines/" in cmd and "runner.py" in cmd) or any(w in cmd for w in ("api_server", "vllm serve", "tritonserver")):
        return "engine"
    return None


def _gpu() -> dict[int, int]:
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return {int(a): int(b) * (1 << 20) for a, b in (ln.split(",") for ln in r.stdout.strip().splitlines() if ln)}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}


_SEEN: dict[int, str] = {}  # a process keeps the group it had when first seen (titles change)
CPU: dict[int, float] = {}   # the CPU seconds each process had used when last seen


def sample(root: int) -> tuple[dict[str, int], dict[str, int]]:
    """RSS and GPU memory (bytes) per group over `root`'s process tree."""
    kids = _children()
    rss = dict.fromkeys(GROUPS, 0)
    gpu_by_pid = _gpu()
    gpu = dict.fromkeys(GROUPS, 0)
    stack = [(root, "other")]
    while stack:
        pid, inherited = stack.pop()
        g = _SEEN.setdefault(pid, _group(_cmdline(pid)) or inherited)
        rss[g] += _rss(pid)
        CPU[pid] = max(CPU.get(pid, 0.0), _cpu(pid))
        gpu[g] += gpu_by_pid.get(pid, 0)
        stack.extend((c, g) for c in kids.get(pid, []))
    return rss, gpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    peak_rss = dict.fromkeys(GROUPS, 0)
    peak_gpu = dict.fromkeys(GROUPS, 0)
    alive = dict.fromkeys(GROUPS, 0.0)
    while proc.poll() is None:
        rss, gpu = sample(proc.pid)
        for g in GROUPS:
            peak_rss[g] = max(peak_rss[g], rss[g])
            peak_gpu[g] = max(peak_gpu[g], gpu[g])
            if g != "other" and rss[g]:
                alive[g] += args.interval
        time.sleep(args.interval)
    doc = {"command": cmd, "rc": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
           "peak_rss_mib": {g: round(v / 2**20) for g, v in peak_rss.items()},
           "peak_gpu_mib": {g: round(v / 2**20) for g, v in peak_gpu.items()} if shutil.which("nvidia-smi") else None,
           "seconds_alive": {g: round(v, 1) for g, v in alive.items() if g != "other"},
           # CPU time of each group (user + system, as last sampled): wall time on a shared machine
           # says more about the other load than about the work
           "cpu_s": {g: round(sum(c for pid, c in CPU.items() if _SEEN.get(pid) == g), 1) for g in GROUPS}}
    text = json.dumps(doc, indent=1)
    print(text, file=sys.stderr)
    if args.out:
        args.out.write_text(text + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

"""What machine this is, in words, for reports and benchmarks."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def device_description() -> str:
    gpu = gpu_name()
    return f"GPU {gpu}" if gpu else f"CPU {cpu_model()} ({os.cpu_count()} cores)"

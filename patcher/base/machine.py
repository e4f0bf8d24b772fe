"""What machine this is, in words, for reports and benchmarks."""

from __future__ import annotations

import os
import platform
import re
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


def cpu_cores_here() -> int:
    """The CPU cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cuda_devices_here() -> int:
    """CUDA GPUs this process sees: nvidia-smi's list, limited by CUDA_VISIBLE_DEVICES."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]))
    return n


def gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def device_description() -> str:
    gpu = gpu_name()
    return f"GPU {gpu}" if gpu else f"CPU {cpu_model()} ({os.cpu_count()} cores)"


def gpu_info() -> dict | None:
    """The GPUs as nvidia-smi reports them (name, driver, memory), for a report's provenance; None
    without nvidia-smi or when it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in r.stdout.strip().splitlines() if line.strip()]
    if r.returncode != 0 or not rows or len(rows[0]) < 3:
        return None
    name, driver, mem = rows[0][:3]
    info: dict = {"name": name, "driver": driver, "count": len(rows)}
    try:
        info["memory_mib"] = int(float(mem))
    except ValueError:
        info["memory"] = mem
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", _smi_header())
    if cuda:
        info["driver_cuda"] = cuda.group(1)
    return info


def _smi_header() -> str:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout[:2000]
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_memory(device: str = "cpu") -> tuple[int | None, str]:
    """(bytes a new process can still allocate, where that number comes from) on the CPU (RAM:
    MemAvailable, capped by the cgroup's memory.max) or on GPU 0 (nvidia-smi's free memory);
    None when it cannot be told."""
    if device == "cuda":
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
                               capture_output=True, text=True, timeout=30)
            return int(float(r.stdout.strip().splitlines()[0])) * (1 << 20), "GPU 0 free memory (nvidia-smi)"
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            return None, "GPU memory unknown"
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    where = "RAM available (/proc/meminfo MemAvailable)"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and (avail is None or int(limit) - used < avail):
            avail, where = int(limit) - used, "memory left under this cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return avail, where


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' (the kernel's CPU list format) -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return tuple(sorted(out))


def gpu_local_cpus(index: int | None = None) -> tuple[int, ...]:
    """The CPUs attached to the same NUMA node as GPU `index` (default: the first visible one), from
    the PCI device's ``local_cpulist`` in sysfs; () when unknown (no GPU, no sysfs, a container
    that hides them). A process on a CPU of another socket reaches the GPU over the socket link:
    slower kernel launches for one server of a pair than for the other."""
    if not shutil.which("nvidia-smi"):
        return ()
    if index is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        index = int(visible) if visible.isdigit() else 0
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    for line in r.stdout.splitlines():
        idx, _, bus = (c.strip() for c in line.partition(","))
        if idx == str(index) and bus:
            # nvidia-smi: 00000000:3B:00.0; sysfs: 0000:3b:00.0
            dom, _, rest = bus.lower().partition(":")
            path = Path("/sys/bus/pci/devices") / f"{dom[-4:]}:{rest}" / "local_cpulist"
            try:
                return parse_cpu_list(path.read_text())
            except (OSError, ValueError):
                return ()
    return ()

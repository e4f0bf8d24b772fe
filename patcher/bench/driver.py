"""`dsadapt bench`: one run of the chosen benchmarks (builds, stack operations, start-up) and the
check wall times the committed reports record, as one `BenchReport`; `patcher.bench.page` writes
it as docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from patcher.base.config import Config
from patcher.bench.builds import BuildBench, run_builds
from patcher.formats.lock import Lock

CHECK_TIMING_KEYS = ("install_s", "reference_s", "engine_import_s", "engine_engine_start_s", "engine_generate_s",
                     "engine_s", "compare_s", "total_s")


@dataclass
class CheckTimings:
    report: str
    pin: str
    variant: str | None
    model: str | None
    dtype: str | None
    verdict: str | None
    date: str | None
    device: str | None
    timings: dict


@dataclass
class BenchReport:
    date: str
    machine: dict
    repeat: int
    builds: list[BuildBench] | None   # None: not measured in this run (the old section is kept)
    checks: list[CheckTimings]
    stack_ops: list | None = None       # stackbench.OpRow rows; None: not measured in this run
    stack_facts: dict = field(default_factory=dict)
    startup: list | None = None         # startup.StartRow rows; None: not measured in this run

    def to_json(self) -> dict:
        d = asdict(self)
        if self.stack_ops is not None:
            d["stack_ops"] = [r.to_json() for r in self.stack_ops]
        if self.startup is not None:
            d["startup"] = [r.to_json() for r in self.startup]
        return d


# ---------------------------------------------------------------- machine


def machine_info() -> dict:
    from patcher.base.machine import cpu_model

    model = cpu_model()
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return {"cores": cores, "cpu": model, "memory_gib": mem_gib, "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}", "load_1min": load}


def read_check_timings(reports_root: Path) -> list[CheckTimings]:
    """Every check report on disk that has wall-time splits (unpatched control runs excluded)."""
    out = []
    for path in sorted(reports_root.rglob("*.json")) if reports_root.is_dir() else []:
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(d, dict) or not isinstance(d.get("timings"), dict) or d.get("unpatched"):
            continue
        if str(d.get("schema", "")).startswith(("dsadapt.perf-report/", "dsadapt.power-report/")):
            continue  # speed-gate and power reports: their own sections
        prov = d.get("provenance") or {}
        out.append(CheckTimings(str(path.relative_to(reports_root.parent)), d.get("pin", "?"), d.get("variant"),
                                d.get("model"), d.get("dtype"), d.get("verdict"), prov.get("date"),
                                prov.get("device"), d["timings"]))
    return out


def run_bench(cfg: Config, lock: Lock, repeat: int = 3, alternatives: bool = True, progress=None,
              builds_too: bool = True, stack_ops: dict | None = None, startup: dict | None = None) -> BenchReport:
    """Builds (unless builds_too is False) and, when `stack_ops` gives its arguments, the stack-operations
    benchmark (patcher/bench/stack_ops.py), and with `startup` the start-up one (patcher/bench/startup.py)."""
    report = BenchReport(datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), machine_info(), repeat,
                         None, read_check_timings(cfg.published_reports))  # the committed reports, as docs cite them
    if builds_too:
        report.builds = run_builds(cfg, lock, repeat, alternatives, progress)
    if stack_ops is not None:
        from patcher.bench.stack_ops import run_stack_bench

        report.stack_ops, report.stack_facts = run_stack_bench(cfg, lock, progress=progress, **stack_ops)
    if startup is not None:
        from patcher.bench.startup import run_startup_bench

        report.startup = run_startup_bench(cfg, lock, progress=progress, **startup)
    return report

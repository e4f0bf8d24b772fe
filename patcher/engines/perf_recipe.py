"""What an engine tells `dsadapt perf`: how to serve it and how to load it with its own tool.

A recipe is the engine-specific part of the speed gate, nothing more: the server's command
line, the load generator's command line and job format, and how to read the load
generator's result into per-request records. Everything else (ports, process groups, the
A/B schedule, memory sampling, statistics, the verdict, the report) is
`patcher.perfrun`/`patcher.perf` and the same for every engine.

The load generator is long-lived: `driver_command` starts it once per session with its
stdin a pipe; for each run dsadapt writes one JSON line, ``job(...)`` plus ``"done": PATH``,
and waits until the driver writes ``{"ok": bool, "error": str}`` to PATH; the result itself
is at ``LoadJob.out_path``, read back by ``parse``. Recipes live next to their engine
(``patcher/engines/<engine>_perf.py``) and are handed out by the adapter's ``perf_recipe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

from ..perf import RequestRecord, RequestSpec

SERVED_NAME = "dsadapt-perf"


@dataclass(frozen=True)
class ServeSettings:
    """How both sides are served (identical for A and B)."""

    model_dir: Path
    dtype: str
    max_model_len: int
    max_num_seqs: int                    # the highest concurrency of the run
    device: str                          # cpu | cuda
    compute_cpus: tuple[int, ...] = ()   # cores for the engine's compute threads (CPU builds)
    served_name: str = SERVED_NAME
    seed: int = 0


@dataclass(frozen=True)
class ProcessCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)   # added to the environment


@dataclass(frozen=True)
class ServerCommand(ProcessCommand):
    #: GET http://127.0.0.1:PORT<ready_path> answers 200 once the model is served
    ready_path: str = "/health"


@dataclass(frozen=True)
class LoadJob:
    """One measured (or warm-up) run: the workload once, at one concurrency, against one server."""

    side: str
    round: int
    concurrency: int
    base_url: str                       # http://127.0.0.1:PORT
    workload_path: Path                 # what write_workload wrote
    num_requests: int
    out_path: Path                      # where the load tool saves its result
    settings: ServeSettings


@dataclass(frozen=True)
class ParsedRun:
    duration_s: float
    requests: list[RequestRecord]
    tool: dict = field(default_factory=dict)   # the tool's own summary numbers


class PerfRecipe(Protocol):
    #: the load tool, in words (goes into the report), e.g. "vllm bench serve (vLLM 0.32.0)"
    tool: str
    #: dtypes the engine serves, first = default
    dtypes: tuple[str, ...]

    def server_command(self, python: Path, port: int, settings: ServeSettings) -> ServerCommand: ...

    def driver_command(self, python: Path) -> ProcessCommand: ...

    def write_workload(self, requests: Sequence[RequestSpec], settings: ServeSettings, dest_dir: Path) -> Path: ...

    def job(self, job: LoadJob) -> dict: ...

    def parse(self, job: LoadJob, requests: Sequence[RequestSpec]) -> ParsedRun: ...

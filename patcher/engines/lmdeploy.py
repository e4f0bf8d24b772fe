"""LMDeploy: overlay builds on the pinned wheel; its engines run on CUDA only."""

from __future__ import annotations

from .base import COMPILED_DEFAULT, EngineAdapter, VariantSpec


def _perf_recipe(entry, spec: VariantSpec):
    from .lmdeploy_perf import recipe

    return recipe(entry.version, spec.device)


ADAPTER = EngineAdapter(
    name="lmdeploy",
    git_url="https://github.com/InternLM/lmdeploy.git",
    pypi=("lmdeploy",),
    packages=("lmdeploy",),
    variants=(
        VariantSpec("cuda", "lmdeploy", "cuda", description="full wheel (TurboMind + PyTorch engine)",
                    toolchain=("nvcc", "cmake", "g++")),
        VariantSpec("pytorch", "lmdeploy", "cuda",
                    description="PyTorch engine only: TurboMind's 364 MB extension left out",
                    toolchain=("nvcc", "cmake", "g++"),
                    wheel_variant="cuda",
                    # v0.18: turbomind/_turbomind*.so (364 MB) + lib64/libxgrammar.a; v0.4: lib/_turbomind*.so
                    # and TurboMind's GEMM tuner bin/llama_gemm. The turbomind/*.py files stay: backend
                    # selection imports them. AWQ models in the PyTorch engine need the full variant.
                    leave_out=("lmdeploy/lib/_turbomind*.so", "lmdeploy/turbomind/_turbomind*.so",
                               "lmdeploy/turbomind/lib64/libxgrammar.a", "lmdeploy/bin/llama_gemm")),
    ),
    compiled_patterns=COMPILED_DEFAULT + ("src/turbomind/*", "lmdeploy/lib/*"),
    runner="lmdeploy_runner.py",
    perf_recipe=_perf_recipe,
)

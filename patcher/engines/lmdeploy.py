"""LMDeploy: overlay builds on the pinned wheel; its engines run on CUDA only."""

from __future__ import annotations

from .base import COMPILED_DEFAULT, EngineAdapter, VariantSpec

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
                    leave_out=("lmdeploy/lib/_turbomind*.so", "lmdeploy/turbomind/_turbomind*.so",
                               "lmdeploy/turbomind/lib64/libxgrammar.a")),
    ),
    compiled_patterns=COMPILED_DEFAULT + ("src/turbomind/*", "lmdeploy/lib/*"),
    runner="lmdeploy_runner.py",
)

"""Triton's vLLM backend: no compiled code; the build assembles a backend directory."""

from __future__ import annotations

from .base import EngineAdapter, VariantSpec

ADAPTER = EngineAdapter(
    name="triton",
    git_url="https://github.com/triton-inference-server/vllm_backend.git",
    pypi=(),
    packages=(),
    variants=(VariantSpec("cpu", "", "cpu", description="served by tritonserver from nvidia-pytriton"),),
    build_kind="backend",
    tag_prefix="",
    runner="triton_runner.py",
)

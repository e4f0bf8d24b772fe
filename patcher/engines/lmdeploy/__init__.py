"""LMDeploy: overlay builds on the pinned wheel; its engines run on CUDA only.

- adapter.py  `LmdeployEngine`: variants (full wheel, PyTorch engine only), runner (docs/engines/lmdeploy.md)
- runner.py   the gate's runner script (PyTorch engine; runs in the pin's environment, never imports patcher)
"""

"""Engine adapters: one module per engine, registered here by name.

Adding an engine (e.g. SGLang) is one module defining an `EngineAdapter` plus its
entries in upstream.lock.
"""

from __future__ import annotations

from ..errors import UsageError
from .base import EngineAdapter
from .lmdeploy import ADAPTER as _LMDEPLOY
from .triton import ADAPTER as _TRITON
from .vllm import ADAPTER as _VLLM

ADAPTERS: dict[str, EngineAdapter] = {a.name: a for a in (_VLLM, _LMDEPLOY, _TRITON)}


def adapter(name: str) -> EngineAdapter:
    try:
        return ADAPTERS[name]
    except KeyError:
        raise UsageError(f"no adapter for engine '{name}'",
                         hint=f"known engines: {', '.join(sorted(ADAPTERS))}") from None

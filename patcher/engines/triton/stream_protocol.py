"""Triton's generate-stream protocol, for the speed gate's stdlib load generator
(patcher/runners/stream_load.py loads this file by path, in the engine's environment; stdlib only).

``POST /v2/models/NAME/generate_stream`` with ``text_input`` and vLLM sampling parameters
(``max_tokens`` = ``min_tokens``, ``ignore_eos``, temperature 0); one event per generated token.
"""

from __future__ import annotations

import json


def request(model: str, r: dict) -> tuple[str, dict]:
    """(path, JSON body) of one request of the workload row `r`."""
    n = int(r["output_len"])
    params = {"max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0}
    return f"/v2/models/{model}/generate_stream", {"text_input": r["text"], "stream": True,
                                                  "exclude_input_in_output": True, "parameters": params,
                                                  "sampling_parameters": json.dumps(params)}


def tokens(ev: dict, so_far: int, rec: dict) -> tuple[int, int]:
    """(tokens this event brought, tokens streamed so far) for one server-sent event."""
    new = 1 if ev.get("text_output") is not None else 0
    return new, so_far + new

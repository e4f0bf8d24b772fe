"""LMDeploy api_server's streaming protocol, for the speed gate's stdlib load generator
(patcher/runners/stream_load.py loads this file by path, in the engine's environment; stdlib only).

``POST /generate`` with token ids (``input_ids``, ``max_tokens``, ``ignore_eos``, greedy ``top_k`` 1,
``stream``); server-sent events carry ``output_ids`` and ``meta_info.completion_tokens``. Where
LMDeploy is importable, its own metric code (``lmdeploy.profiler.Profiler``) summarises the same
timings into the result's ``tool`` section.
"""

from __future__ import annotations


def request(model: str, r: dict) -> tuple[str, dict]:
    """(path, JSON body) of one request of the workload row `r`."""
    return "/generate", {"input_ids": r["input_ids"], "max_tokens": int(r["output_len"]), "ignore_eos": True,
                         "top_k": 1, "stream": True}


def tokens(ev: dict, so_far: int, rec: dict) -> tuple[int, int]:
    """(tokens this event brought, tokens streamed so far) for one server-sent event."""
    new = len(ev.get("output_ids") or [])
    meta = ev.get("meta_info") or {}
    total = meta.get("completion_tokens")
    if meta.get("prompt_tokens"):
        rec["input_len"] = int(meta["prompt_tokens"])
    return new, int(total) if total is not None else so_far + new


def summary(records: list[dict], elapsed: float) -> dict:
    """LMDeploy's own metric code over the same timings, when LMDeploy is importable."""
    try:
        from lmdeploy.profiler import Profiler, Session
    except Exception:  # noqa: BLE001 - not an LMDeploy environment
        return {}
    prof = Profiler(stream_output=True, percentages=[50, 90, 99])
    for r in records:
        s = prof.new_session(r["input_len"], r["output_len"])
        s.ts, s.ns = [0.0] + [t for t, _ in r["ticks"]], [0] + [n for _, n in r["ticks"]]
        s.finish(Session.SUCCESS if r["ok"] and len(s.ts) > 1 else Session.FAIL)
    prof.elapsed_time = elapsed
    try:
        prof.compute_metrics()
    except Exception as e:  # noqa: BLE001
        return {"lmdeploy_profiler_error": str(e)}
    return {"lmdeploy_profiler": {"output_throughput": float(prof.output_throughput),
                                  "ttft_mean_s": float(prof.ttft_mean), "tpot_mean_s": float(prof.tpot_mean),
                                  "e2e_mean_s": float(prof.e2e_mean), "success": int(prof.success)}}

"""A streaming HTTP load generator for `dsadapt perf`, for engines whose wheels ship no serving
benchmark client (stdlib + the runner protocol ``dsadapt_runner``; run with the engine environment's interpreter,
never imports patcher).

    PYTHON stream_load.py

LMDeploy's serving benchmark (benchmark/profile_restful_api.py) lives in its repository, not in
its wheel, and Triton's perf_analyzer is a separate C++ binary; this is the thin client that
stands in for them. It speaks the recipe protocol of patcher/engines/serving.py: one JSON job
per stdin line, ``{"protocol", "url", "model", "workload", "concurrency", "out", "done", "wakeup"?}``, where
``workload`` is a JSON file ``[{"mix", "input_len", "output_len", "input_ids"?, "text"?}, ...]``.
First ``wakeup`` copies of the first request are sent, untimed (the server is awake when it is
measured); then the requests are offered all at once and run ``concurrency`` at a time (a thread
each, as the seeds' concurrency tester does); per request it records when the response started streaming
tokens (TTFT), when it ended (latency) and how many tokens came back. Protocols:

- ``lmdeploy-generate``: LMDeploy api_server's ``POST /generate`` with token ids
  (``input_ids``, ``max_tokens``, ``ignore_eos``, greedy ``top_k`` 1, ``stream``); server-sent
  events carry ``output_ids`` and ``meta_info.completion_tokens``.
- ``triton-generate``: Triton's ``POST /v2/models/NAME/generate_stream`` with ``text_input`` and
  vLLM sampling parameters (``max_tokens`` = ``min_tokens``, ``ignore_eos``, temperature 0); one
  event per generated token.

Where LMDeploy is importable, its own metric code (``lmdeploy.profiler.Profiler``) summarises
the same timings into the result's ``tool`` section, next to dsadapt's per-request records.
The driver exits at end of input and when its parent process is gone.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import dsadapt_runner as kit


def _body(protocol: str, model: str, r: dict) -> tuple[str, dict]:
    n = int(r["output_len"])
    if protocol == "lmdeploy-generate":
        return "/generate", {"input_ids": r["input_ids"], "max_tokens": n, "ignore_eos": True, "top_k": 1,
                             "stream": True}
    if protocol == "triton-generate":
        params = {"max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0}
        return f"/v2/models/{model}/generate_stream", {"text_input": r["text"], "stream": True,
                                                      "exclude_input_in_output": True, "parameters": params,
                                                      "sampling_parameters": json.dumps(params)}
    raise ValueError(f"unknown protocol {protocol!r}")


def one(url: str, protocol: str, model: str, r: dict, timeout: float) -> dict:
    """Send one request; (mix, input_len, output_len, ttft_s, latency_s, ok, error, ticks)."""
    u = urllib.parse.urlparse(url)
    path, body = _body(protocol, model, r)
    rec = {"mix": r["mix"], "input_len": int(r["input_len"]), "output_len": 0, "ttft_s": 0.0, "latency_s": 0.0,
           "ok": False, "error": "", "ticks": []}
    t0 = time.perf_counter()
    try:
        c = HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return rec
        tokens = 0
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                rec["error"] = str(ev["error"])[:300]
                return rec
            if protocol == "lmdeploy-generate":
                new = len(ev.get("output_ids") or [])
                total = (ev.get("meta_info") or {}).get("completion_tokens")
                tokens = int(total) if total is not None else tokens + new
                if ev.get("meta_info", {}).get("prompt_tokens"):
                    rec["input_len"] = int(ev["meta_info"]["prompt_tokens"])
            else:
                new = 1 if ev.get("text_output") is not None else 0
                tokens += new
            if new or tokens:
                now = time.perf_counter() - t0
                if rec["ttft_s"] == 0.0:
                    rec["ttft_s"] = now
                rec["ticks"].append([round(now, 6), tokens])
        rec["latency_s"] = time.perf_counter() - t0
        rec["output_len"] = tokens
        rec["ok"] = tokens == int(r["output_len"])
        if not rec["ok"]:
            rec["error"] = f"{tokens} tokens streamed, {r['output_len']} asked for"
    except (OSError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    return rec


def _lmdeploy_summary(records: list[dict], elapsed: float) -> dict:
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


def run_job(job: dict) -> None:
    with open(job["workload"]) as f:
        reqs = json.load(f)
    timeout = float(job.get("timeout_s", 600))
    wakeup = int(job.get("wakeup") or 0)
    if wakeup and reqs:  # untimed: the first request, `wakeup` times, at the run's concurrency
        with ThreadPoolExecutor(min(wakeup, int(job["concurrency"]))) as pool:
            list(pool.map(lambda r: one(job["url"], job["protocol"], job.get("model", ""), r, timeout),
                          [reqs[0]] * wakeup))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(int(job["concurrency"])) as pool:
        records = list(pool.map(lambda r: one(job["url"], job["protocol"], job.get("model", ""), r, timeout), reqs))
    elapsed = time.perf_counter() - t0
    tool = {"tool": "dsadapt stream_load", "duration": elapsed, **_lmdeploy_summary(records, elapsed)}
    for r in records:
        r.pop("ticks", None)
    with open(job["out"], "w") as f:
        json.dump({"schema": "dsadapt.perf-run/1", "duration_s": elapsed, "requests": records, "tool": tool}, f)


def main() -> None:
    kit.serve_jobs("stream_load", run_job)


if __name__ == "__main__":
    main()

"""A streaming HTTP load generator for `dsadapt perf`, for engines whose wheels ship no serving
benchmark client (stdlib + the runner protocol ``dsadapt_runner``; run with the engine environment's interpreter,
never imports patcher).

    PYTHON stream_load.py

Engines whose wheels ship no serving benchmark client get this thin client instead (a serving
benchmark that lives in an engine's repository rather than its wheel, or a separate binary, is not
at hand where the engine is installed). It speaks the recipe protocol of patcher/engines/serving.py:
one JSON job per stdin line, ``{"protocol", "url", "model", "workload", "concurrency", "out", "done", "wakeup"?}``,
where ``workload`` is a JSON file ``[{"mix", "input_len", "output_len", "input_ids"?, "text"?}, ...]``
and ``protocol`` the path of the engine's protocol module (``patcher/engines/<engine>/
stream_protocol.py``, stdlib only): ``request(model, row) -> (path, body)``, ``tokens(event,
so_far, record) -> (new, total)`` for each server-sent event, and optionally ``summary(records,
elapsed) -> dict`` (the engine's own metric code over the same timings). First ``wakeup`` copies of the
first request are sent, untimed (the server is awake when it is measured); then ``concurrency``
workers (a thread each) send the requests in order, each its next one as soon as its last has
ended (a closed loop). The first ``concurrency`` requests leave together: every worker connects
and serializes its first request, then all wait at one barrier and send at once -- a server
sees the opening burst arrive within about a millisecond, not spread over the time it takes to
start the threads (a scheduler that admits waiting requests only between decode chunks would
otherwise batch them by how fast it happens to be). Per request it records when it was sent
(``sent_s``, from the run's start), when the response started streaming tokens (TTFT), when it
ended (latency) and how many tokens came back.
The driver exits at end of input and when its parent process is gone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import dsadapt_runner as kit


def load_protocol(path: str):
    """The engine's protocol module, loaded from its file (once per path)."""
    if path not in _PROTOCOLS:
        name = f"dsadapt_stream_protocol_{len(_PROTOCOLS)}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"no protocol module at {path!r}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _PROTOCOLS[path] = mod
    return _PROTOCOLS[path]


_PROTOCOLS: dict = {}


def one(url: str, protocol: str, model: str, r: dict, timeout: float, ready: threading.Barrier | None = None,
        t_run: float | None = None) -> dict:
    """Send one request; (mix, input_len, output_len, sent_s, ttft_s, latency_s, ok, error, ticks).
    With `ready`, the connection is made and the body serialized first, then the request waits at
    that barrier and is sent when every worker of the burst is ready; `t_run`: the run's start
    (perf_counter), from which `sent_s` counts."""
    u = urllib.parse.urlparse(url)
    proto = load_protocol(protocol)
    path, body = proto.request(model, r)
    payload = json.dumps(body)
    rec = {"mix": r["mix"], "input_len": int(r["input_len"]), "output_len": 0, "ttft_s": 0.0, "latency_s": 0.0,
           "ok": False, "error": "", "ticks": []}
    c = HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    try:
        c.connect()
    except OSError as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    if ready is not None:
        with contextlib.suppress(threading.BrokenBarrierError):  # a worker of the burst never got ready: send anyway
            ready.wait(timeout)
    if rec["error"]:
        return rec
    t0 = time.perf_counter()
    if t_run is not None:
        rec["sent_s"] = round(t0 - t_run, 6)
    try:
        c.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
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
            new, tokens = proto.tokens(ev, tokens, rec)
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
    finally:
        c.close()
    return rec


def closed_loop(reqs: list, concurrency: int, send) -> tuple[list, float]:
    """`send(r, ready, t_run) -> record` for every request, `concurrency` at a time: worker k sends
    request k, all of the first burst together (`ready`, a barrier), then each worker the next
    unsent request when its last one ended. (records in request order, seconds from the first
    send of the burst to the end of the last request)."""
    n = len(reqs)
    workers = max(1, min(int(concurrency), n))
    ready = threading.Barrier(workers)
    records: list = [None] * n
    nxt = [workers]
    lock = threading.Lock()
    t_run = time.perf_counter()

    def work(k: int) -> None:
        i = k
        barrier: threading.Barrier | None = ready
        while i < n:
            records[i] = send(reqs[i], barrier, t_run)
            barrier = None
            with lock:
                i, nxt[0] = nxt[0], nxt[0] + 1

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = [r["sent_s"] for r in records if r and "sent_s" in r]
    start = min(sent) if sent else 0.0  # the run starts when the burst leaves, not when threads start
    for r in records:
        if r and "sent_s" in r:
            r["sent_s"] = round(r["sent_s"] - start, 6)
    return records, time.perf_counter() - t_run - start


def run_job(job: dict) -> None:
    with open(job["workload"]) as f:
        reqs = json.load(f)
    if job.get("num_requests") is not None:  # the run's own share: the first of the workload's requests
        reqs = reqs[:int(job["num_requests"])]
    timeout = float(job.get("timeout_s", 600))
    wakeup = int(job.get("wakeup") or 0)
    if wakeup and reqs:  # untimed: the first request, `wakeup` times, at the run's concurrency
        with ThreadPoolExecutor(min(wakeup, int(job["concurrency"]))) as pool:
            list(pool.map(lambda r: one(job["url"], job["protocol"], job.get("model", ""), r, timeout),
                          [reqs[0]] * wakeup))
    records, elapsed = closed_loop(reqs, int(job["concurrency"]),
                                   lambda r, ready, t_run: one(job["url"], job["protocol"], job.get("model", ""), r,
                                                               timeout, ready, t_run))
    summary = getattr(load_protocol(job["protocol"]), "summary", None)
    tool = {"tool": "dsadapt stream_load", "duration": elapsed, **(summary(records, elapsed) if summary else {})}
    for r in records:
        r.pop("ticks", None)
    with open(job["out"], "w") as f:
        json.dump({"schema": "dsadapt.perf-run/1", "duration_s": elapsed, "requests": records, "tool": tool}, f)


def main() -> None:
    kit.serve_jobs("stream_load", run_job)


if __name__ == "__main__":
    main()

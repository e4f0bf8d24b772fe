"""A fake engine for the speed gate's process tests: a server, a load generator and a recipe.

    python perf_fake.py server --port P [--ttft-s S] [--token-s S] [--fail]
    python perf_fake.py driver
    python perf_fake.py orchestrate STATE_DIR [--stall]   (runs patcher.gate.perf.measure; needs PYTHONPATH)

The server is a stdlib HTTP server that, like a real engine, leaves a helper process running
in its process group; ``GET /gen?n=N`` answers after ``--ttft-s`` and then streams N lines,
one per ``--token-s``. The driver speaks the recipe protocol of patcher/engines/serving.py
(one JSON job per stdin line, a done file per job) and writes per-request records.
The recipe tells the sides apart by the "python" path `measure` hands it (a key into SPEEDS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- server


def serve(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-s", type=float, default=0.01)
    p.add_argument("--token-s", type=float, default=0.002)
    p.add_argument("--fail", action="store_true")
    args = p.parse_args(argv)
    # a helper in the same process group, as vLLM's engine core is
    subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    if args.fail:
        time.sleep(0.3)
        print("Traceback (most recent call last):\nValueError: fake engine cannot load this model", flush=True)
        sys.exit(1)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *a):
            pass

        def do_GET(self):
            u = urllib.parse.urlparse(self.path)
            if u.path == "/health":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")
                return
            n = int(urllib.parse.parse_qs(u.query).get("n", ["1"])[0])
            time.sleep(args.ttft_s)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"t\n")
            self.wfile.flush()
            for _ in range(n - 1):
                time.sleep(args.token_s)
                self.wfile.write(b"t\n")
                self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()


# ---------------------------------------------------------------- driver


def _one(base: str, r: dict) -> dict:
    host, port = urllib.parse.urlparse(base).netloc.split(":")
    t0 = time.perf_counter()
    try:
        c = HTTPConnection(host, int(port), timeout=30)
        c.request("GET", f"/gen?n={r['output_len']}")
        resp = c.getresponse()
        first = None
        n = 0
        while resp.readline():
            n += 1
            if first is None:
                first = time.perf_counter() - t0
        return {"mix": r["mix"], "input_len": r["input_len"], "output_len": n, "ttft_s": first or 0.0,
                "latency_s": time.perf_counter() - t0, "ok": n == r["output_len"], "error": ""}
    except OSError as e:
        return {"mix": r["mix"], "input_len": r["input_len"], "output_len": 0, "ttft_s": 0.0, "latency_s": 0.0,
                "ok": False, "error": str(e)}


def drive() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("stall"):
            time.sleep(3600)
        reqs = json.loads(Path(job["workload"]).read_text())[:int(job["num_requests"])]
        wakeup = int(job.get("wakeup") or 0)
        if wakeup:  # untimed, like the real tools: the first request, `wakeup` times
            with ThreadPoolExecutor(min(wakeup, job["concurrency"])) as pool:
                list(pool.map(_one, [job["url"]] * wakeup, [reqs[0]] * wakeup))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(job["concurrency"]) as pool:
            out = list(pool.map(_one, [job["url"]] * len(reqs), reqs))
        doc = {"duration_s": time.perf_counter() - t0, "requests": out, "wakeup": wakeup}
        Path(job["out"]).write_text(json.dumps(doc))
        tmp = job["done"] + ".tmp"
        Path(tmp).write_text(json.dumps({"ok": True, "error": ""}))
        os.replace(tmp, job["done"])


# ---------------------------------------------------------------- recipe (imported by the tests)


#: side key (the "python" path measure() passes) -> (ttft_s, token_s), or "fail"
SPEEDS: dict[str, tuple[float, float] | str] = {}


class FakeRecipe:
    tool = "fake load generator"
    dtypes = ("float32",)

    def __init__(self, speeds: dict[str, tuple[float, float] | str], stall: bool = False):
        self.speeds = speeds
        self.stall = stall

    def server_command(self, python, port, settings):
        from patcher.engines.serving import ServerCommand

        speed = self.speeds[str(python)]
        argv = [sys.executable, str(HERE), "server", "--port", str(port)]
        argv += ["--fail"] if speed == "fail" else ["--ttft-s", str(speed[0]), "--token-s", str(speed[1])]
        return ServerCommand(argv, {}, ready_path="/health")

    def driver_command(self, python):
        from patcher.engines.serving import ProcessCommand

        return ProcessCommand([sys.executable, str(HERE), "driver"], {})

    def write_workload(self, requests, settings, dest_dir):
        path = Path(dest_dir) / "workload.json"
        path.write_text(json.dumps([{"mix": r.mix, "input_len": r.input_len, "output_len": r.output_len}
                                    for r in requests]))
        return path

    def job(self, job):
        return {"url": job.base_url, "workload": str(job.workload_path), "concurrency": job.concurrency,
                "out": str(job.out_path), "stall": self.stall, "wakeup": job.wakeup, "num_requests": job.num_requests}

    def parse(self, job, requests):
        from patcher.engines.serving import ParsedRun
        from patcher.rules.speed import RequestRecord

        d = json.loads(Path(job.out_path).read_text())
        return ParsedRun(d["duration_s"], [RequestRecord(**r) for r in d["requests"]],
                         {"fake": True, "wakeup": d.get("wakeup", 0)})


def settings(tmp: Path, max_num_seqs: int = 4):
    from patcher.engines.serving import ServeSettings

    return ServeSettings(model_dir=tmp, dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs, device="cpu")


def small_workload(rounds: int = 2, concurrency=(1, 2), requests: int = 4):
    from patcher.rules.speed import Mix, Workload

    return Workload((Mix("a", 8, 6, requests // 2), Mix("b", 16, 4, requests - requests // 2)), tuple(concurrency),
                    rounds, 0)


def orchestrate(state: Path, stall: bool) -> None:
    """measure() with the fake engine; the servers' process groups go to STATE/groups.json."""
    from patcher.gate.perf import MeasureSetup, measure

    def on_servers(servers):
        (state / "groups.json").write_text(json.dumps({s: srv.proc.pgid for s, srv in servers.items()}))

    recipe = FakeRecipe({"A": (0.01, 0.002), "B": (0.01, 0.002)}, stall=stall)
    measure(recipe, {"patched": Path("A"), "unpatched": Path("B")}, settings(state), small_workload(rounds=50),
            state / "work", MeasureSetup(time_limit_s=600), on_servers=on_servers,
            progress=lambda m: (state / "progress.log").open("a").write(m + "\n"))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "server":
        serve(sys.argv[2:])
    elif mode == "driver":
        threading.current_thread().name = "driver"
        drive()
    elif mode == "orchestrate":
        orchestrate(Path(sys.argv[2]), "--stall" in sys.argv[3:])
    else:
        sys.exit(f"unknown mode {mode}")

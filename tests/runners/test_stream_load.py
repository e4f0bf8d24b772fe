"""The stdlib streaming load generator (patcher/runners/stream_load.py) and the LMDeploy recipe,
against fake servers that speak LMDeploy's ``/generate`` and Triton's ``generate_stream`` the
way those servers do (server-sent events). LMDeploy itself runs on CUDA only; its real run is
the GPU procedure in docs/speed.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.engines.lmdeploy.perf import LmdeployPerfRecipe, gpu_blocks
from patcher.engines.serving import LoadJob, ServeSettings
from patcher.rules.speed import Mix, Workload
from patcher.runners.launch import kit_pythonpath

STREAM_LOAD = REPO_ROOT / "patcher" / "runners" / "stream_load.py"
LMDEPLOY_PROTOCOL = REPO_ROOT / "patcher" / "engines" / "lmdeploy" / "stream_protocol.py"
TRITON_PROTOCOL = REPO_ROOT / "patcher" / "engines" / "triton" / "stream_protocol.py"


class Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    seen: list[dict] = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.seen.append({"path": self.path, **body})
        if body.get("max_tokens") == 13:  # the request a test wants refused
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"engine error")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"] if "max_tokens" in body else body["parameters"]["max_tokens"]
        time.sleep(0.02)
        for k in range(1, n + 1):
            if self.path == "/generate":
                ev = {"text": "x", "output_ids": [7], "meta_info": {"completion_tokens": k,
                                                                    "prompt_tokens": len(body["input_ids"])}}
            else:
                ev = {"model_name": "m", "text_output": "x"}
            self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        if self.path == "/generate":
            self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server():
    Fake.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def drive(tmp_path: Path, job: dict) -> dict:
    done = tmp_path / "done.json"
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(STREAM_LOAD)], input=json.dumps({**job, "out": str(out), "done": str(done)})
                       + "\n", capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": kit_pythonpath({})})  # the runner protocol, as perfrun does
    assert p.returncode == 0, p.stderr
    assert json.loads(done.read_text())["ok"], done.read_text()
    return json.loads(out.read_text())


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy2(REPO_ROOT / "patcher" / "data" / "tokenizer.json", d / "tokenizer.json")
    (d / "config.json").write_text(json.dumps({"vocab_size": 1600}))
    return d


def test_lmdeploy_recipe_writes_exact_length_token_prompts_and_loads_generate(tmp_path, server, model_dir):
    recipe = LmdeployPerfRecipe()
    s = ServeSettings(model_dir, "bfloat16", 256, 4, "cuda")
    w = Workload((Mix("short", 16, 8, 2), Mix("long", 112, 5, 2)), (2,), 2, 0)
    path = recipe.write_workload(w.requests(), s, tmp_path)
    rows = json.loads(path.read_text())
    assert [len(r["input_ids"]) for r in rows] == [16, 112, 16, 112]
    assert all(max(r["input_ids"]) < 1600 for r in rows)
    assert rows[0]["input_ids"] != rows[2]["input_ids"]  # no two requests share a prompt
    job = LoadJob("patched", 0, 2, server, path, 4, tmp_path / "out.json", s)
    doc = drive(tmp_path, recipe.job(job))
    assert [r["path"] for r in Fake.seen] == ["/generate"] * 4
    assert all(r["ignore_eos"] and r["stream"] and r["top_k"] == 1 for r in Fake.seen)
    assert sorted(r["max_tokens"] for r in Fake.seen) == [5, 5, 8, 8]
    parsed = recipe.parse(job, w.requests())
    assert [q.output_len for q in parsed.requests] == [8, 5, 8, 5]
    assert [q.input_len for q in parsed.requests] == [16, 112, 16, 112]
    assert all(q.ok and 0 < q.ttft_s <= q.latency_s for q in parsed.requests)
    assert parsed.duration_s > 0 and doc["tool"]["tool"] == "dsadapt stream_load"


def test_triton_generate_stream_protocol_counts_one_event_per_token(tmp_path, server):
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps([{"mix": "a", "input_len": 3, "output_len": 6, "text": "hello there you"}]))
    doc = drive(tmp_path, {"protocol": str(TRITON_PROTOCOL), "url": server, "model": "deepseek", "workload": str(wl),
                           "concurrency": 1})
    (rec,) = doc["requests"]
    assert rec["ok"] and rec["output_len"] == 6 and rec["ttft_s"] > 0
    (sent,) = Fake.seen
    assert sent["path"] == "/v2/models/deepseek/generate_stream" and sent["text_input"] == "hello there you"
    assert sent["parameters"]["min_tokens"] == sent["parameters"]["max_tokens"] == 6


def test_a_refused_request_is_recorded_as_failed(tmp_path, server):
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps([{"mix": "a", "input_len": 2, "output_len": 13, "input_ids": [5, 6]},
                              {"mix": "a", "input_len": 2, "output_len": 4, "input_ids": [5, 6]}]))
    doc = drive(tmp_path, {"protocol": str(LMDEPLOY_PROTOCOL), "url": server, "workload": str(wl), "concurrency": 2})
    bad, good = doc["requests"]
    assert not bad["ok"] and bad["error"].startswith("HTTP 500") and good["ok"]


def test_lmdeploy_server_command_fixes_the_kv_cache_and_binds_loopback(tmp_path):
    s = ServeSettings(tmp_path, "bfloat16", 256, 16, "cuda")
    cmd = LmdeployPerfRecipe().server_command(Path("/env/bin/python"), 4321, s)
    argv = cmd.argv
    assert argv[:5] == ["/env/bin/python", "-m", "lmdeploy", "serve", "api_server"]
    opts = dict(zip(argv[6::2], argv[7::2]))
    assert opts["--server-name"] == "127.0.0.1" and opts["--server-port"] == "4321"
    assert opts["--backend"] == "pytorch" and opts["--dtype"] == "bfloat16" and opts["--max-batch-size"] == "16"
    assert int(opts["--num-gpu-blocks"]) == gpu_blocks(s) >= 2 * 16 * 256 // 64
    assert cmd.ready_path == "/health"


def test_the_closed_loop_keeps_c_in_flight_and_sends_the_first_burst_together():
    """Every request is sent once, never more than `concurrency` at a time; the first burst waits at
    one barrier (its sends lie within a few ms although the workers start one after the other) and
    the send times count from the burst; the records come back in request order."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stream_load_under_test", STREAM_LOAD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lock = threading.Lock()
    state = {"now": 0, "most": 0}

    def send(r, ready, t_run):
        time.sleep(0.01 * (r["i"] % 4))  # workers get ready at different times
        if ready is not None:
            ready.wait(5)
        t0 = time.perf_counter()
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.005)
        with lock:
            state["now"] -= 1
        return {"i": r["i"], "sent_s": t0 - t_run}

    records, elapsed = mod.closed_loop([{"i": i} for i in range(20)], 4, send)
    assert [r["i"] for r in records] == list(range(20))
    assert state["most"] <= 4 and elapsed > 0
    burst = sorted(r["sent_s"] for r in records[:4])
    assert burst[0] == 0 and burst[-1] < 0.02, burst  # without the barrier: 30 ms apart
    assert all(r["sent_s"] >= 0 for r in records)

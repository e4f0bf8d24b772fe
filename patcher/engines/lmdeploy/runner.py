"""LMDeploy (PyTorch engine) runner for dsadapt's logit-equivalence gate.

Standalone: stdlib + torch + lmdeploy + the runner protocol (``dsadapt_runner``, on
PYTHONPATH); it runs with the pin's environment interpreter in a subprocess and never
imports `patcher`. Needs a CUDA device.

    python lmdeploy_runner.py --model DIR --prompts prompts.json --dtype bfloat16 \
        --top-k 20 --max-tokens 16 --out report.json [--fingerprint SHA] \
        [--tensor-parallel-size N] [--capture FILE --capture-spec SPEC.json]

What it records, per prompt (the ``dsadapt.logit-report/1`` schema of
``patcher/runners/dsadapt_runner.py``):

- prompt logprobs: one prefill over the prompt with ``output_logits="all"``
  (``AsyncEngine.async_get_logits``), a full float32 ``log_softmax`` per position,
  the top-K and the actual next token's logprob (position 0 has none);
- generation: ``--max-tokens`` greedy tokens (``do_sample=False``, ``top_k=1``,
  EOS ignored) through the engine's request path with ``logprobs=K`` and the
  engine's ``logprobs_mode="raw_logprobs"`` (log-softmax of the unprocessed
  logits, computed by LMDeploy in the model dtype). A request that stops short
  is continued by another over prompt + tokens so far;
  ``settings.generation_requests`` lists, per prompt, the tokens each request gave.

Batches: prompts without a batch are sent one at a time; the members of a named
batch are sent together (concurrent requests the engine schedules as one batch).

LMDeploy has no float32 mode: ``--dtype`` is bfloat16 or float16, or fp8 for a block-FP8 checkpoint
(LMDeploy reads its quantization_config and runs its blocked-FP8 linears; activations bfloat16).

Tensor parallelism (``--tensor-parallel-size N``, `dsadapt check --tp N`): ``PytorchEngineConfig(tp=N)``;
LMDeploy starts one worker process a GPU. The executor is LMDeploy's multiprocess one
(``distributed_executor_backend="mp"``; LMDeploy would pick ray on CUDA, which the offline
bundle leaves out), unless ``LMDEPLOY_EXECUTOR_BACKEND`` says otherwise. There the model lives
in the workers, not in this process: the capture (``--capture``) is driven through the
executor's ``collective_rpc`` with a worker method this script adds when LMDeploy's spawned
workers import it as their main module (``__mp_main__``: `install_worker_capture`); every
rank saves its own capture (capture.py). ``LMDEPLOY_EXECUTOR_BACKEND=mp`` at TP 1 takes the
same path with one worker (the single-GPU rehearsal of the TP path). No expert parallelism.

``--power-jobs`` (`dsadapt power`): one engine start, then one job per perturbation setting read
from stdin (``dsadapt_runner.add_power_args``): the setting's perturbation installed on the live
model of the single-process executor (capture.py's `Perturber`), the gate's prompts as below, the
capture pass when the job asks for one, the perturbation removed.

Exit status: 0 with the report written; 1 on any failure (traceback on stderr).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time

import dsadapt_runner as kit

#: fp8: a block-FP8 checkpoint (its quantization_config) through the blocked-FP8 linears, bfloat16 elsewhere
DTYPES = ("bfloat16", "float16", "fp8")
#: Context length the engine is started with (the gate's MAX_MODEL_LEN).
SESSION_LEN = 256


def parse_args(argv=None):
    ap = kit.parser(__doc__.split("\n")[0], DTYPES, top_k=20)
    ap.add_argument("--session-len", type=int, default=SESSION_LEN)
    ap.add_argument("--cache-max-entry-count", type=float, default=0.05,
                    help="fraction of free GPU memory for the KV cache")
    args = kit.parse_engine_args(ap, argv)
    if args.expert_parallel:
        ap.error("--expert-parallel: this runner runs LMDeploy's tensor parallelism only")
    return args


# ----------------------------------------------------------------------------- pure

#: One position from a full log-softmax row (a 1-D tensor).
position_entry = kit.position_from_row


def prompt_entries(logits, prompt: list[int], top_k: int) -> list[dict | None]:
    """Prompt logprobs from prefill logits ``[len(prompt), vocab]`` (row i predicts
    token i+1): ``[None, entry(1), ..., entry(n-1)]``."""
    import torch

    if logits.shape[0] < len(prompt):
        raise ValueError(f"engine returned {logits.shape[0]} logit rows for a {len(prompt)}-token prompt")
    rows = torch.log_softmax(logits[: len(prompt)].float(), dim=-1)
    return [None] + [position_entry(rows[i - 1], prompt[i], top_k) for i in range(1, len(prompt))]


def generated_entry(step: dict, token_id: int, top_k: int) -> dict:
    """One generated position from LMDeploy's per-step ``{token_id: logprob}`` dict
    (top-K plus the sampled token)."""
    pairs = sorted(((int(t), float(v)) for t, v in step.items()), key=lambda tv: -tv[1])
    table = dict(pairs)
    if token_id not in table:
        raise ValueError(f"engine logprobs for a step lack the sampled token {token_id}")
    return {"token": int(token_id), "logprob": table[token_id],
            "top": {str(t): v for t, v in pairs[:top_k]}}


def generated_entries(token_ids: list[int], steps: list[dict], top_k: int) -> list[dict]:
    if len(steps) != len(token_ids):
        raise ValueError(f"engine returned {len(steps)} logprob steps for {len(token_ids)} generated tokens")
    return [generated_entry(s, t, top_k) for t, s in zip(token_ids, steps)]


def prompt_result(doc: dict, logits, generated: list[int], steps: list[dict], top_k: int) -> dict:
    """A PromptResult document."""
    prompt = list(doc["token_ids"])
    return kit.prompt_result(doc, prompt_entries(logits, prompt, top_k), generated,
                             generated_entries(list(generated), steps, top_k))


#: Singles alone, each named batch as one group, in first-appearance order.
submission_groups = kit.submission_groups


# ----------------------------------------------------------------------------- engine


def executor_backend(tp: int, environ=None) -> str | None:
    """The executor LMDeploy is asked for: LMDEPLOY_EXECUTOR_BACKEND when set, "mp" for several
    ranks (LMDeploy's own choice on CUDA is ray), else LMDeploy's default (None: "uni" for one)."""
    environ = os.environ if environ is None else environ
    given = environ.get("LMDEPLOY_EXECUTOR_BACKEND")
    if given:
        return given
    return "mp" if tp > 1 else None


def make_pipeline(model: str, dtype: str, session_len: int, cache_max_entry_count: float, tp: int = 1):
    from lmdeploy import PytorchEngineConfig, pipeline

    config = PytorchEngineConfig(dtype="bfloat16" if dtype == "fp8" else dtype, session_len=session_len,
                                 eager_mode=True,
                                 cache_max_entry_count=cache_max_entry_count,
                                 logprobs_mode="raw_logprobs", tp=tp,
                                 distributed_executor_backend=executor_backend(tp))
    return pipeline(model, backend_config=config, log_level="ERROR"), config


async def _request(engine, ids: list[int], max_tokens: int, top_k: int):
    """One greedy request through the engine's request path (the pattern of
    ``AsyncEngine.async_get_logits``); returns (token ids, per-step logprob dicts)."""
    from lmdeploy import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              top_k=1, ignore_eos=True, logprobs=top_k)
    session = engine.session_mgr.get()
    tokens: list[int] = []
    steps: list[dict] = []
    try:
        async with session.request_handle() as handle, \
                engine.safe_run(handle, session=session, input_ids=list(ids), gen_config=config,
                                stream_output=False) as gen:
            async for out in gen:
                tokens.extend(out.token_ids or [])
                steps.extend(out.logprobs or [])
    finally:
        engine.session_mgr.remove(session)
    return tokens, steps


async def _generate(engine, ids: list[int], max_tokens: int, top_k: int):
    """Greedy generation of `max_tokens` tokens; returns (token ids, logprob steps, tokens per
    request).

    On the H200 (lmdeploy 0.18.0, torch 2.11) one request returned 2 tokens whatever
    max_new_tokens said; until that is understood, a short answer is continued by a new
    request over prompt + tokens so far (a prefix the engine re-prefills), and the number
    of requests is reported."""
    tokens: list[int] = []
    steps: list[dict] = []
    requests: list[int] = []
    while len(tokens) < max_tokens:
        got, got_steps = await _request(engine, list(ids) + tokens, max_tokens - len(tokens), top_k)
        requests.append(len(got))
        if not got:
            raise RuntimeError(f"engine returned no token (request {len(requests)}, {len(tokens)} so far)")
        if len(got_steps) != len(got):
            raise ValueError(f"engine returned {len(got_steps)} logprob steps for {len(got)} tokens")
        tokens += got
        steps += got_steps
    return tokens[:max_tokens], steps[:max_tokens], requests


async def _run_group(engine, group: list[dict], max_tokens: int, top_k: int):
    import asyncio

    logits = await engine.async_get_logits(input_ids=[list(p["token_ids"]) for p in group])
    gens = await asyncio.gather(*[_generate(engine, p["token_ids"], max_tokens, top_k) for p in group])
    return logits, gens


def run(pipe, prompt_docs: list[dict], top_k: int, max_tokens: int) -> tuple[list[dict], dict[str, list[int]]]:
    """All prompts; returns (prompt result documents in input order, tokens per request per prompt)."""
    out: dict[str, dict] = {}
    requests: dict[str, list[int]] = {}
    for group in submission_groups(prompt_docs):
        logits, gens = pipe._run(coro=_run_group(pipe.async_engine, group, max_tokens, top_k)).result()
        for doc, lg, (tokens, steps, n) in zip(group, logits, gens):
            out[doc["id"]] = prompt_result(doc, lg.squeeze(0) if lg.dim() == 3 else lg, tokens, steps, top_k)
            requests[doc["id"]] = n
    return [out[p["id"]] for p in prompt_docs], requests


def _unwrap(model):
    """The ``nn.Module`` of a model agent's ``patched_model`` (unwrapped from the graph runner)."""
    import torch

    return model if isinstance(model, torch.nn.Module) else model.get_model()


def engine_model(pipe):
    """The live ``nn.Module`` behind a ``pipeline`` (PyTorch engine, single-process ``uni``
    executor): ``async_engine.engine.executor.model_agent.patched_model``, unwrapped from the
    graph runner (lmdeploy 0.18.0)."""
    executor = _executor(pipe)
    agent = getattr(executor, "model_agent", None)
    model = getattr(agent, "patched_model", None)
    if model is None:
        raise RuntimeError("cannot reach the model through pipeline.async_engine.engine.executor.model_agent "
                           "(bisect needs the PyTorch engine with its single-process 'uni' executor)")
    return _unwrap(model)


def _executor(pipe):
    engine = getattr(getattr(pipe, "async_engine", None), "engine", None)
    return getattr(engine, "executor", None)


# ----------------------------------------------------------------------------- capture in workers

#: The worker method the capture calls through ``collective_rpc`` (`install_worker_capture`).
WORKER_METHOD = "dsadapt_capture"


def worker_capture(worker, op: str, *args):
    """What one worker does for the capture: `op` "install" (spec path), "prompt" (prompt id),
    "finish" (path, sequences, meta) or "abort", on its own model (capture.py's worker functions)."""
    import capture  # on PYTHONPATH with the kit: the workers inherit this process's environment

    model = _unwrap(worker.model_agent.patched_model) if op == "install" else None
    if op == "install":
        return capture.worker_install(args[0], model)
    if op == "prompt":
        return capture.worker_prompt(args[0], model)
    if op == "finish":
        return capture.worker_finish(args[0], args[1], args[2], model)
    return capture.worker_abort(model)


def install_worker_capture() -> bool:
    """Give LMDeploy's worker class the capture method (in a worker process it spawned; the
    multiprocess executor calls worker methods by name). False when LMDeploy is not importable."""
    try:
        from lmdeploy.pytorch.engine.executor.base_worker import WorkerWrapperBase
    except ImportError:
        return False

    def method(self, op, *args):
        return worker_capture(self, op, *args)

    setattr(WorkerWrapperBase, WORKER_METHOD, method)
    return True


def _rpc_capture(executor, prompt_docs: list[dict], args, run_prompt) -> tuple[dict, list[str]]:
    """The capture through the workers: install, one "prompt" before each prompt's request, then
    "finish"; every command goes out without waiting for replies (the engine's own loop reads the
    workers' replies), and the rank captures are awaited on disk. Returns (sequences, paths)."""
    world = len(getattr(executor, "procs", None) or [None])
    path = os.path.abspath(args.capture)
    paths = [path if r == 0 else f"{path}.rank{r}" for r in range(world)]
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)

    def rpc(*call):
        executor.collective_rpc(WORKER_METHOD, args=call, return_mask=0)

    rpc("install", os.path.abspath(args.capture_spec))
    sequences: dict[str, list[int]] = {}
    try:
        for p in prompt_docs:
            rpc("prompt", p["id"])
            sequences[p["id"]] = list(p["token_ids"]) + [int(t) for t in run_prompt(p)]
    except BaseException:
        rpc("abort")
        raise
    meta = {"engine": "lmdeploy", "dtype": args.dtype, "decode_steps": args.capture_decode_steps,
            "parallel": kit.parallel_settings(args, executor=type(executor).__name__)}
    rpc("finish", path, sequences, meta)
    deadline = time.time() + 300
    while not all(os.path.isfile(p) for p in paths):
        if time.time() > deadline:
            raise RuntimeError(f"the workers wrote {sum(os.path.isfile(p) for p in paths)} of {world} rank captures")
        time.sleep(0.2)
    return sequences, paths


def capture_pass(pipe, prompt_docs: list[dict], args, saved: list | None = None) -> float:
    """`dsadapt bisect`'s capture (capture.py): hooks on the live model, each prompt alone through
    the request path, prefill plus `--capture-decode-steps` greedy decode steps. A request that
    stops short is continued like the gate's (`_generate`); the continuation re-prefills the
    prefix, and the comparison keeps each position's first computation. With the single-process
    executor the hooks go on the model in this process; with LMDeploy's multiprocess executor
    (several ranks) on every worker's model, through the executor (`install_worker_capture`)."""
    import capture  # the runners' own helper, on PYTHONPATH with the kit

    t0 = time.time()
    steps = args.capture_decode_steps + 1

    def run_prompt(p):
        tokens, _, _ = pipe._run(coro=_generate(pipe.async_engine, list(p["token_ids"]), steps, 1)).result()
        return tokens

    executor = _executor(pipe)
    if getattr(executor, "model_agent", None) is None and hasattr(executor, "collective_rpc"):
        _, paths = _rpc_capture(executor, prompt_docs, args, run_prompt)
        if saved is not None:
            saved += paths
        return round(time.time() - t0, 3)
    rec = capture.Recorder(capture.load_spec(args.capture_spec))
    rec.install(engine_model(pipe))
    sequences: dict[str, list[int]] = {}
    try:
        for p in prompt_docs:
            rec.prompt = p["id"]
            sequences[p["id"]] = list(p["token_ids"]) + [int(t) for t in run_prompt(p)]
    finally:
        rec.active = False
        rec.remove()
    doc = rec.finish(sequences, meta={"engine": "lmdeploy", "dtype": args.dtype,
                                      "decode_steps": args.capture_decode_steps})
    capture.save(doc, args.capture)
    if saved is not None:
        saved.append(args.capture)
    return round(time.time() - t0, 3)


def serve_power(pipe, prompt_docs: list[dict], args, report_args: dict) -> None:
    """`dsadapt power`'s jobs (``--power-jobs``): per setting, its perturbation on the live model,
    the gate's prompts (a logit report; ``max_tokens`` greedy tokens when the job says, else
    ``--max-tokens``), the capture pass if asked, the perturbation removed."""
    import argparse

    import capture

    spec = capture.load_spec(args.capture_spec)
    model = engine_model(pipe)  # the single-process executor: the model lives in this process

    def run_setting(job: dict) -> None:
        setting = job["setting"]
        a = argparse.Namespace(**{**vars(args), "max_tokens": int(job.get("max_tokens") or args.max_tokens)})
        perturber = capture.Perturber(spec, list(setting.get("perturb") or []))
        perturber.install(model)
        try:
            t0 = time.time()
            results, requests = run(pipe, prompt_docs, args.top_k, a.max_tokens)
            report_pass = perturber.stats(reset=True)
            capture_stats, capture_s = None, None
            if job.get("capture"):
                capture_s = capture_pass(pipe, prompt_docs, argparse.Namespace(**{**vars(a), "capture": job["capture"]}))
                capture_stats = perturber.stats(reset=True)
        finally:
            perturber.remove()
        doc = {**report_args,
               "settings": {**report_args["settings"], "generation_requests": requests,
                            "perturbation": kit.perturbation_settings(setting, report_pass, capture_stats)},
               "timings": {**report_args["timings"], "setting_s": round(time.time() - t0, 3),
                           **({"capture_s": capture_s} if capture_s else {})}}
        kit.write_report(job["report"], kit.report(a, **doc, prompts=results))

    kit.serve_jobs("lmdeploy_runner", run_setting)


def report_header(args, config, pipe) -> dict:
    """What every report of this runner says about the engine (`kit.report`'s keywords)."""
    import lmdeploy
    import torch

    versions = {"torch": torch.__version__, "lmdeploy": lmdeploy.__version__,
                "python": platform.python_version(), "cuda": str(torch.version.cuda)}
    for name in ("transformers", "triton"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    return {"runner": "lmdeploy_runner", "engine": "lmdeploy", "engine_version": lmdeploy.__version__,
            "versions": versions, "engine_path": lmdeploy.__file__,
            "settings": {"backend": "pytorch", "device": "cuda", "gpu": torch.cuda.get_device_name(0),
                         **({"weights": "block-FP8 (quantization_config), activations bfloat16"}
                            if args.dtype == "fp8" else {}),
                         "session_len": args.session_len, "eager_mode": True,
                         "cache_max_entry_count": args.cache_max_entry_count, "logprobs_mode": config.logprobs_mode,
                         "prompt_logprobs": "prefill logits (async_get_logits), float32 log_softmax",
                         "generated_logprobs": "engine decode logprobs (raw_logprobs, model dtype)",
                         "parallel": kit.parallel_settings(args, executor=type(_executor(pipe)).__name__,
                                                           gpus=torch.cuda.device_count())},
            "timings": {}}


def main(argv=None):
    args = parse_args(argv)
    prompt_docs = kit.load_prompts(args.prompts)
    # the session holds the longest prompt and everything generated after it, capture included
    args.session_len = max(args.session_len, kit.context_needed(
        prompt_docs, args.max_tokens, args.capture_decode_steps + 1 if args.capture or args.power_jobs else 0))
    t0 = time.time()
    pipe, config = make_pipeline(args.model, args.dtype, args.session_len, args.cache_max_entry_count,
                                 args.tensor_parallel_size)
    t1 = time.time()
    header = report_header(args, config, pipe)
    header["timings"] = {"load_s": round(t1 - t0, 3)}
    if args.power_jobs:
        try:
            serve_power(pipe, prompt_docs, args, header)
        finally:
            pipe.close()
        return 0
    capture_s, capture_error = None, None
    saved: list = []
    try:
        results, requests = run(pipe, prompt_docs, args.top_k, args.max_tokens)
        if args.capture:
            capture_s, capture_error = kit.try_capture(lambda: capture_pass(pipe, prompt_docs, args, saved))
    finally:
        pipe.close()
    t2 = time.time()
    settings = header["settings"]
    settings["generation_requests"] = requests
    if args.capture:
        settings["parallel"]["captured_ranks"] = len(saved)
    if capture_error:
        settings["capture_error"] = capture_error
    header["timings"].update({"run_s": round(t2 - t1, 3), **({"capture_s": capture_s} if capture_s is not None else {})})
    kit.write_report(args.out, kit.report(args, **header, prompts=results))
    kit.say("lmdeploy_runner", f"{len(results)} prompts, load {t1 - t0:.1f}s, run {t2 - t1:.1f}s -> {args.out}")
    return 0


if __name__ == "__mp_main__":
    # a worker process LMDeploy's multiprocess executor spawned (spawn imports the parent's main
    # script under this name before the worker starts): give its worker class the capture method
    install_worker_capture()

if __name__ == "__main__":
    kit.run(main)

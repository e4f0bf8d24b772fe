"""The r24.08 stack's request path, run without vLLM 0.5 (CUDA only, cannot run here).

The patched r24.08 ``src/model.py`` (from a mirror) is imported with stand-ins for
``triton_python_backend_utils`` and the vLLM 0.5.0.post1 names it uses; its
``generate()`` coroutine then runs against a fake engine whose outputs have vLLM
0.5.0.post1's shapes (RequestOutput.prompt / prompt_token_ids / prompt_logprobs,
CompletionOutput.token_ids / logprobs, Logprob.logprob / rank / decoded_token,
``async get_tokenizer``), checked against that release's sources. What this proves:
the stack's Python is consistent (names, JSON shapes, first-response-only prompt
outputs, chat rendering); not that vLLM 0.5 itself behaves.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import triton_support as sup

mirror = sup.triton_mirror()
pytestmark = [
    pytest.mark.mirror,
    pytest.mark.skipif(mirror is None, reason="no triton mirror: set DSADAPT_MIRRORS='triton=PATH'"),
]

FINAL = 1


@dataclass
class Logprob:  # vllm 0.5.0.post1 vllm/sequence.py
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm 0.5.0.post1 vllm/outputs.py (fields used)
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool


class FakeTensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.asarray(array)

    def as_numpy(self):
        return self.array


class FakeResponse:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name: t.array for t in (output_tensors or [])}
        self.error = error


class FakeSender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


class FakeRequest:
    def __init__(self, inputs: dict, parameters: dict):
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}
        self._parameters = json.dumps(parameters)
        self.sender = FakeSender()

    def parameters(self):
        return self._parameters

    def get_response_sender(self):
        return self.sender


class FakeTokenizer:
    """apply_chat_template / encode with add_special_tokens, like an HF fast tokenizer."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "<bos>" + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False
        return [ord(c) for c in text]


@dataclass
class FakeEngine:
    """AsyncLLMEngine 0.5.0.post1: `await add_request(...)` returns an async stream;
    `get_tokenizer` is a coroutine."""

    steps: int = 3
    seen: list = field(default_factory=list)

    async def get_tokenizer(self):
        return FakeTokenizer()

    async def add_request(self, request_id, inputs, params, lora_request=None):
        self.seen.append((inputs, params))
        if isinstance(inputs, str):
            prompt, ids = inputs, [ord(c) for c in inputs]
        else:
            prompt, ids = inputs.get("prompt"), list(inputs["prompt_token_ids"])
        want = params.kwargs.get("prompt_logprobs")
        prompt_lps = None
        if want:
            prompt_lps = [None] + [
                {t: Logprob(-1.5, 7, "a"), 11: Logprob(-0.5, 1, "b")} for t in ids[1:]
            ]

        async def stream():
            for n in range(1, self.steps + 1):
                gen = [100 + i for i in range(n)]
                lps = [{100 + i: Logprob(-0.25, 1, "g"), 5: Logprob(-2.0, 2, "h")} for i in range(n)]
                yield RequestOutput(request_id, prompt, ids, prompt_lps,
                                    [CompletionOutput(0, "x" * n, gen, -0.25 * n, lps)],
                                    finished=n == self.steps)

        return stream()

    async def abort(self, request_id):
        raise AssertionError("not cancelled in these tests")


def _stub_modules(monkeypatch):
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.Tensor = FakeTensor
    pb.InferenceResponse = FakeResponse
    pb.TritonError = type("TritonError", (Exception,), {"CANCELLED": 1})
    pb.TritonModelException = type("TritonModelException", (Exception,), {})
    pb.Logger = types.SimpleNamespace(log_info=lambda *a: None, log_error=lambda *a: None,
                                      log_warn=lambda *a: None)
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    mod("torch")
    mod("vllm")
    mod("vllm.engine")
    mod("vllm.engine.arg_utils", AsyncEngineArgs=object)
    mod("vllm.engine.async_llm_engine", AsyncLLMEngine=object)
    mod("vllm.inputs", TokensPrompt=dict)  # a TypedDict in vLLM 0.5.0.post1
    mod("vllm.lora")
    mod("vllm.lora.request", LoRARequest=object)
    mod("vllm.sampling_params", SamplingParams=SamplingParams)
    mod("vllm.utils", random_uuid=lambda: "req-1")
    mod("utils")
    mod("utils.metrics", VllmStatLogger=object)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return sup.apply_stack(mirror, "r24.08", tmp_path_factory.mktemp("r2408") / "vllm_backend")


@pytest.fixture
def model(checkout, monkeypatch):
    _stub_modules(monkeypatch)
    spec = importlib.util.spec_from_file_location("r2408_model", checkout / "src" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    m = module.TritonPythonModel()
    m.logger = sys.modules["triton_python_backend_utils"].Logger
    m.output_dtype = np.object_
    m.llm_engine = FakeEngine()
    m.ongoing_request_count = 0
    m.supported_loras = []
    return m


def _run(model, inputs, parameters):
    request = FakeRequest(inputs, parameters)
    asyncio.run(model.generate(request))
    assert all(r.error is None for r, _ in request.sender.sent), request.sender.sent
    return request.sender.sent


def test_token_id_prompt_returns_every_gate_output(model):
    sent = _run(model, {
        "text_input": np.array([b"shown"], dtype=np.object_),
        "input_token_ids": np.array([json.dumps([0, 20, 21]).encode()], dtype=np.object_),
        "exclude_input_in_output": np.array([False]),
        "return_prompt_token_ids": np.array([True]),
        "return_prompt_logprobs": np.array([True]),
        "return_output_token_ids": np.array([True]),
        "return_logprobs": np.array([True]),
    }, {"temperature": 0, "max_tokens": 3, "logprobs": 2, "prompt_logprobs": 2})
    (response, flags), = sent  # not streaming: one final response
    assert flags == FINAL
    inputs, params = model.llm_engine.seen[0]
    assert inputs == {"prompt_token_ids": [0, 20, 21]}
    assert params.kwargs["prompt_logprobs"] == 2
    t = response.tensors
    assert t["text_output"][0] == b"shownxxx"  # token-id prompts echo text_input
    assert json.loads(t["prompt_token_ids"][0]) == [0, 20, 21]
    prompt_lps = json.loads(t["prompt_logprobs"][0])
    assert prompt_lps[0] is None and len(prompt_lps) == 3
    assert prompt_lps[1] == {"20": {"logprob": -1.5, "rank": 7, "decoded_token": "a"},
                             "11": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}
    assert json.loads(t["output_token_ids"][0]) == [100, 101, 102]
    gen_lps = json.loads(t["logprobs"][0])
    assert len(gen_lps) == 3 and gen_lps[2]["102"]["logprob"] == -0.25


def test_streaming_sends_prompt_outputs_once_and_token_id_deltas(model):
    model._response_queue = __import__("queue").Queue()
    request = FakeRequest({
        "text_input": np.array([b""], dtype=np.object_),
        "input_token_ids": np.array([b"[0, 20]"], dtype=np.object_),
        "stream": np.array([True]),
        "return_prompt_logprobs": np.array([True]),
        "return_output_token_ids": np.array([True]),
    }, {"max_tokens": 3, "prompt_logprobs": 1})
    asyncio.run(model.generate(request))
    queued = []
    while not model._response_queue.empty():
        queued.append(model._response_queue.get_nowait())
    responses = [r for _, r, _ in queued]
    assert [("prompt_logprobs" in r.tensors) for r in responses] == [True, False, False]
    assert [json.loads(r.tensors["output_token_ids"][0]) for r in responses] == [[100], [101], [102]]
    assert queued[-1][2] == FINAL


def test_chat_template_renders_once_with_the_engine_tokenizer(model):
    sent = _run(model, {
        "text_input": np.array([json.dumps([{"role": "user", "content": "hi"}]).encode()], dtype=np.object_),
        "apply_chat_template": np.array([True]),
        "exclude_input_in_output": np.array([False]),
        "return_prompt_token_ids": np.array([True]),
    }, {"max_tokens": 1})
    (response, _), = sent
    rendered = "<bos><user>hi<assistant>"
    inputs, _ = model.llm_engine.seen[0]
    assert inputs == {"prompt_token_ids": [ord(c) for c in rendered]}
    assert response.tensors["text_output"][0] == (rendered + "xxx").encode()  # fake engine: 3 steps


def test_chat_template_with_token_ids_is_an_error(model):
    request = FakeRequest({
        "text_input": np.array([b"hi"], dtype=np.object_),
        "input_token_ids": np.array([b"[1]"], dtype=np.object_),
        "apply_chat_template": np.array([True]),
    }, {"max_tokens": 1})
    with pytest.raises(ValueError, match="cannot be combined"):
        asyncio.run(model.generate(request))
    (response, flags), = request.sender.sent
    assert response.error is not None and flags == FINAL

"""patcher/engines/lmdeploy/runner.py: output handling, on synthetic engine outputs and on
the reports it wrote on an H200 (tests/fixtures/lmdeploy, see provenance.json there)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "lmdeploy"
SCHEMA = "dsadapt.logit-report/1"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("lmdeploy_runner", ROOT / "patcher/engines/lmdeploy/runner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prompt_entries_from_prefill_logits(runner):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    entries = runner.prompt_entries(logits, [9, 1, 0], top_k=2)
    rows = torch.log_softmax(logits, -1)
    assert entries[0] is None
    assert entries[1] == {"token": 1, "logprob": float(rows[0, 1]),
                          "top": {"3": float(rows[0, 3]), "2": float(rows[0, 2])}}
    assert entries[2]["token"] == 0 and list(entries[2]["top"]) == ["0", "1"]


def test_prompt_entries_reject_short_logits(runner):
    with pytest.raises(ValueError, match="3-token prompt"):
        runner.prompt_entries(torch.zeros(2, 4), [1, 2, 3], top_k=2)


def test_generated_entry_sorts_and_cuts(runner):
    step = {5: -2.0, 7: -0.1, 3: -1.0}  # top-2 plus the sampled token, in any order
    assert runner.generated_entry(step, 7, top_k=2) == {"token": 7, "logprob": -0.1,
                                                        "top": {"7": -0.1, "3": -1.0}}
    with pytest.raises(ValueError, match="sampled token 4"):
        runner.generated_entry(step, 4, top_k=2)
    with pytest.raises(ValueError, match="2 logprob steps for 1"):
        runner.generated_entries([7], [step, step], top_k=2)


def test_submission_groups(runner):
    docs = [{"id": "a"}, {"id": "m0", "batch": "mixed"}, {"id": "b", "batch": None},
            {"id": "m1", "batch": "mixed"}]
    assert [[d["id"] for d in g] for g in runner.submission_groups(docs)] == [["a"], ["m0", "m1"], ["b"]]


class _FakeEngine:
    """Just the surface lmdeploy_runner uses; generation streams in two chunks."""

    def __init__(self, vocab=6):
        self.vocab, self.live = vocab, 0
        self.session_mgr = types.SimpleNamespace(get=self._get, remove=self._remove)

    def _get(self):
        self.live += 1

        @contextlib.asynccontextmanager
        async def request_handle():
            yield object()
        return types.SimpleNamespace(request_handle=request_handle)

    def _remove(self, session):
        self.live -= 1

    async def async_get_logits(self, input_ids):
        return [torch.arange(len(ids) * self.vocab, dtype=torch.float32).view(1, len(ids), self.vocab) % 5
                for ids in input_ids]

    @contextlib.asynccontextmanager
    async def safe_run(self, handle, session, input_ids, gen_config, stream_output):
        n = gen_config.max_new_tokens

        async def gen():
            toks = [(input_ids[-1] + i) % self.vocab for i in range(n)]
            steps = [{t: -0.5, (t + 1) % self.vocab: -1.5} for t in toks]
            yield types.SimpleNamespace(token_ids=toks[:1], logprobs=steps[:1])
            yield types.SimpleNamespace(token_ids=toks[1:], logprobs=steps[1:])
        yield gen()


class _FakePipe:
    def __init__(self):
        self.async_engine = _FakeEngine()

    def _run(self, coro):
        result = asyncio.run(coro)
        return types.SimpleNamespace(result=lambda: result)


def test_run_on_a_fake_engine(runner, monkeypatch):
    fake = types.ModuleType("lmdeploy")
    fake.GenerationConfig = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    pipe = _FakePipe()
    docs = [{"id": "s", "token_ids": [1, 2, 3]}, {"id": "m0", "token_ids": [4, 5], "batch": "b"},
            {"id": "m1", "token_ids": [2, 2, 2, 2], "batch": "b"}]
    results, requests = runner.run(pipe, docs, top_k=2, max_tokens=3)
    assert [r["id"] for r in results] == ["s", "m0", "m1"]
    assert requests == {"s": [3], "m0": [3], "m1": [3]}
    for doc, r in zip(docs, results):
        assert r["prompt_token_ids"] == doc["token_ids"]
        assert len(r["prompt_logprobs"]) == len(doc["token_ids"]) and r["prompt_logprobs"][0] is None
        assert len(r["generated_token_ids"]) == 3 == len(r["generated_logprobs"])
        assert r["generated_logprobs"][0]["logprob"] == -0.5
    assert pipe.async_engine.live == 0


def test_short_answers_are_continued(runner, monkeypatch):
    """An engine that stops after 2 tokens per request (as seen on the H200) still yields
    max_tokens tokens, each continuation starting from prompt + tokens so far."""
    fake = types.ModuleType("lmdeploy")
    fake.GenerationConfig = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    pipe = _FakePipe()
    seen = []
    base = pipe.async_engine.safe_run

    def capped(handle, session, input_ids, gen_config, stream_output):
        seen.append(list(input_ids))
        gen_config.max_new_tokens = min(2, gen_config.max_new_tokens)
        return base(handle, session, input_ids, gen_config, stream_output)

    pipe.async_engine.safe_run = capped
    results, requests = runner.run(pipe, [{"id": "s", "token_ids": [1, 2, 3]}], top_k=2, max_tokens=5)
    assert requests == {"s": [2, 2, 1]}
    assert results[0]["generated_token_ids"] == [3, 4, 4, 5, 5]
    assert seen == [[1, 2, 3], [1, 2, 3, 3, 4], [1, 2, 3, 3, 4, 4, 5]]


# ----------------------------------------------------------------------------- fixtures


def _load(name):
    return json.loads((FIXTURES / name).read_text())


ENGINE_FIXTURES = ("lmdeploy_patched_v2_float16.json", "lmdeploy_unpatched_v2_float16.json")


@pytest.mark.parametrize("name", ENGINE_FIXTURES)
def test_recorded_report_has_the_schema(name):
    rep, ref = _load(name), _load("hf_v2_float32.json")
    assert rep["schema"] == SCHEMA and rep["runner"] == "lmdeploy_runner" and rep["engine"] == "lmdeploy"
    assert rep["engine_version"] == "0.18.0" and rep["settings"]["device"] == "cuda"
    assert [p["id"] for p in rep["prompts"]] == [p["id"] for p in ref["prompts"]]
    for p, r in zip(rep["prompts"], ref["prompts"]):
        assert p["prompt_token_ids"] == r["prompt_token_ids"] and p["batch"] == r["batch"]
        assert p["prompt_logprobs"][0] is None
        assert len(p["prompt_logprobs"]) == len(p["prompt_token_ids"])
        assert len(p["generated_token_ids"]) == rep["max_tokens"] == len(p["generated_logprobs"])
        assert sum(rep["settings"]["generation_requests"][p["id"]]) == rep["max_tokens"]
        for e in p["prompt_logprobs"][1:] + p["generated_logprobs"]:
            vals = list(e["top"].values())
            assert len(vals) == rep["top_k"] and vals == sorted(vals, reverse=True)
            assert e["logprob"] <= vals[0] + 1e-6


def test_recorded_provenance_matches_the_files():
    import hashlib

    prov = _load("provenance.json")
    for name, digest in prov["files_sha256"].items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name


def test_recorded_reports_through_the_gate():
    """Where the gate's comparison is present: the fix passes float16, the bug fails."""
    eq = pytest.importorskip("patcher.rules.logits")
    ref = eq.LogitReport.from_json(_load("hf_v2_float32.json"))
    verdict = {n: eq.compare(ref, eq.LogitReport.from_json(_load(n))).passed for n in ENGINE_FIXTURES}
    assert verdict == {"lmdeploy_patched_v2_float16.json": True, "lmdeploy_unpatched_v2_float16.json": False}


# ----------------------------------------------------------------------------- bisect capture (GPU-only path, faked)


class _LmdNorm(torch.nn.Module):
    def forward(self, x, residual=None):
        if residual is None:
            return x * 2
        s = x + residual
        return s * 2, s


class _LmdLayer(torch.nn.Module):
    """LMDeploy's shapes: hidden states [1, T, H], MLA internals [T, ...], rope out as halves."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = _LmdNorm()
        self.self_attn = torch.nn.Module()
        self.self_attn.apply_rotary_pos_emb = torch.nn.Identity()

    def forward(self, h, residual):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        t = h.shape[1]
        q = h[0].view(t, 2, 4)
        self.self_attn.apply_rotary_pos_emb(q.reshape(t, 2, 2, 2).transpose(-1, -2).reshape(t, 2, 4))
        return h, residual


class _LmdModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(10, 8)
        self.model.layers = torch.nn.ModuleList([_LmdLayer(), _LmdLayer()])

    def forward(self, input_ids, position_ids, past_key_values=None, attn_metadata=None, inputs_embeds=None):
        h, r = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            h, r = layer(h, r)
        return h + r


class _GraphRunner:
    """What LMDeploy's agent holds after build_graph_runner: not a module, get_model() is."""

    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


def test_bisect_capture_reaches_the_model_through_the_agent(runner, monkeypatch):
    """The LMDeploy capture path (GPU-only for real): the model found through
    pipeline.async_engine.engine.executor.model_agent, hooks on LMDeploy's module names, each prompt
    as a request whose prefill and decode steps call the model as LMDeploy does."""
    fake = types.ModuleType("lmdeploy")
    fake.GenerationConfig = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    monkeypatch.syspath_prepend(str(ROOT / "patcher" / "runners"))
    from patcher.engines.lmdeploy.bisect_table import TABLE

    model = _LmdModel()
    pipe = _FakePipe()
    pipe.async_engine.engine = types.SimpleNamespace(
        executor=types.SimpleNamespace(model_agent=types.SimpleNamespace(patched_model=_GraphRunner(model))))
    base = pipe.async_engine.safe_run

    def safe_run(handle, session, input_ids, gen_config, stream_output):
        n = gen_config.max_new_tokens
        toks = [(input_ids[-1] + i) % 6 for i in range(n)]
        with torch.no_grad():  # prefill, then one decode step per generated token but the last
            model(input_ids=torch.tensor([input_ids]), position_ids=torch.arange(len(input_ids))[None])
            for i, t in enumerate(toks[:-1]):
                model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[len(input_ids) + i]]))
        return base(handle, session, input_ids, gen_config, stream_output)

    pipe.async_engine.safe_run = safe_run
    assert runner.engine_model(pipe) is model
    config = {"num_hidden_layers": 2, "qk_rope_head_dim": 4, "n_routed_experts": None}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(TABLE.spec(config, "bfloat16")))
        args = types.SimpleNamespace(capture_spec=str(spec_path), capture=str(Path(tmp) / "cap.pt"),
                                     capture_decode_steps=2, dtype="bfloat16")
        docs = [{"id": "s", "token_ids": [1, 2, 3]}, {"id": "t", "token_ids": [4, 5]}]
        runner.capture_pass(pipe, docs, args)
        doc = torch.load(args.capture, weights_only=False)
    assert doc["sequences"] == {"s": [1, 2, 3, 3, 4, 5], "t": [4, 5, 5, 0, 1]}
    pts = {(p["layer"], p["point"]): p for p in doc["points"]}
    norm = pts[(1, "input_norm")]
    assert norm["pos"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3] and norm["phase"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert norm["value"].shape == (9, 8)  # [1, T, H] -> [T, H]
    q = pts[(0, "attn.q_rope")]["value"]
    with torch.no_grad():
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([1, 2, 3])))
    assert torch.equal(q[:3], h)  # halves converted back to DeepSeek's interleaved layout
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed
    assert "attn.kv_a_norm" in doc["missing"] and pipe.async_engine.live == 0

"""LMDeploy's runner in `dsadapt power`'s mode (``--power-jobs``), rehearsed without a GPU: the
runner's own `serve_power` on a stand-in pipeline whose logits come from a small torch module at
the place LMDeploy keeps its model (``async_engine.engine.executor.model_agent.patched_model``),
jobs read from stdin as dsadapt writes them. What must hold before the H200 call: each job's
report is written with the job's token budget and the perturbation's statistics, an eps of 0
leaves every logprob as it is, a perturbation changes them, the capture pass records the changed
values, and the hooks are gone after each job."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
V = 7  # vocabulary of the stand-in model


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("lmdeploy_runner_power", ROOT / "patcher/engines/lmdeploy/runner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, V)

    def forward(self, x):
        return self.proj(x)


class Model(torch.nn.Module):
    """LMDeploy's packing: ``[1, tokens]`` ids and positions, ``[1, tokens, hidden]`` states."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, 4)
        self.lm_head = Head()

    def forward(self, input_ids, position_ids):
        return self.lm_head(self.embed(input_ids) + position_ids[..., None].float() * 0.01)


class Engine:
    """The request surface the runner uses, computing with `model` (prefill, then one step at a time)."""

    def __init__(self, model):
        self.model = model
        self.engine = types.SimpleNamespace(executor=types.SimpleNamespace(
            model_agent=types.SimpleNamespace(patched_model=model)))
        self.session_mgr = types.SimpleNamespace(get=self._get, remove=lambda s: None)

    def _get(self):
        @contextlib.asynccontextmanager
        async def request_handle():
            yield object()
        return types.SimpleNamespace(request_handle=request_handle)

    def _logits(self, ids, start=0):
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None])[0]

    async def async_get_logits(self, input_ids):
        return [self._logits(ids)[None] for ids in input_ids]

    @contextlib.asynccontextmanager
    async def safe_run(self, handle, session, input_ids, gen_config, stream_output):
        ids = list(input_ids)

        async def gen():
            rows = self._logits(ids)
            for step in range(gen_config.max_new_tokens):
                lp = torch.log_softmax(rows[-1], -1)
                t = int(lp.argmax())
                yield types.SimpleNamespace(token_ids=[t], logprobs=[{int(i): float(lp[i]) for i in range(V)}])
                ids.append(t)
                if step + 1 < gen_config.max_new_tokens:
                    rows = self._logits([t], len(ids) - 1)
        yield gen()


class Pipe:
    def __init__(self, model):
        self.async_engine = Engine(model)

    def _run(self, coro):
        result = asyncio.run(coro)
        return types.SimpleNamespace(result=lambda: result)


def test_serve_power_runs_each_job_with_its_perturbation(runner, tmp_path, monkeypatch):
    fake = types.ModuleType("lmdeploy")
    fake.GenerationConfig = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "lmdeploy", fake)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"schema": "dsadapt.capture-spec/1", "layers": "", "table": "lmdeploy",
                                "rows": {"path": "", "ids": "input_ids", "positions": "position_ids"},
                                "points": [{"point": "logits", "path": "lm_head", "take": 0, "token_axis": 1,
                                            "rows": "all"}]}))
    args = argparse.Namespace(model="m", prompts="p", dtype="bfloat16", top_k=3, max_tokens=4, out="o",
                              fingerprint=None, capture=None, capture_spec=str(spec), capture_decode_steps=3,
                              tensor_parallel_size=1, expert_parallel=False, session_len=64,
                              cache_max_entry_count=0.05, power_jobs=True)
    docs = [{"id": "a", "token_ids": [1, 2, 3]}, {"id": "b", "token_ids": [4, 5]}]
    header = {"runner": "lmdeploy_runner", "engine": "lmdeploy", "engine_version": "0.18.0", "versions": {},
              "engine_path": "x", "settings": {"backend": "pytorch"}, "timings": {"load_s": 1.0}}
    jobs = []
    for sid, plan, cap in (("zero", [{"point": "logits", "layers": None, "phase": "both", "kind": "scale", "eps": 0.0}], False),
                           ("none", [], False),
                           ("decode", [{"point": "logits", "layers": None, "phase": "decode", "kind": "scale",
                                        "eps": 0.5}], True)):
        jobs.append({"setting": {"id": sid, "perturb": plan}, "report": str(tmp_path / f"{sid}.json"),
                     "capture": str(tmp_path / f"{sid}.pt") if cap else None, "max_tokens": 2 if sid == "none" else None,
                     "done": str(tmp_path / f"{sid}.done")})
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(j) + "\n" for j in jobs)))
    model = Model()
    runner.serve_power(Pipe(model), docs, args, header)
    for j in jobs:
        assert json.loads(Path(j["done"]).read_text())["ok"], j
    rep = {j["setting"]["id"]: json.loads(Path(j["report"]).read_text()) for j in jobs}
    assert rep["none"]["max_tokens"] == 2 and len(rep["none"]["prompts"][0]["generated_token_ids"]) == 2
    assert rep["zero"]["max_tokens"] == 4
    pert = rep["decode"]["settings"]["perturbation"]
    # 2 prompts x 3 decode steps (4 tokens, the first from the prefill), the capture pass the same (3 steps + 1)
    assert pert["id"] == "decode" and pert["report_pass"]["points"]["logits"]["rows"]["decode"] == 2 * 3
    assert pert["report_pass"]["points"]["logits"]["rows"]["prefill"] == 0
    assert pert["capture_pass"]["points"]["logits"]["rows"]["decode"] == 2 * 3
    # eps 0: every logprob as without hooks; a decode-only change: prefill logprobs equal, decode ones not
    for a, b in zip(rep["zero"]["prompts"], rep["none"]["prompts"]):
        assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["generated_logprobs"][:2] == b["generated_logprobs"]
    for a, b in zip(rep["decode"]["prompts"], rep["zero"]["prompts"]):
        assert a["prompt_logprobs"] == b["prompt_logprobs"] and a["generated_logprobs"][1:] != b["generated_logprobs"][1:]
    doc = torch.load(tmp_path / "decode.pt", weights_only=False)
    assert doc["schema"] == "dsadapt.capture/1" and sorted(doc["sequences"]) == ["a", "b"]
    # the hooks are gone: the model computes as before
    assert not model.lm_head._forward_hooks and not model._forward_pre_hooks

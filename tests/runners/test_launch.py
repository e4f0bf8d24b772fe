"""run_runner: argv, environment, log capture and typed failures, with fake runner scripts."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from equivalence_helpers import greedy_case, prompt_doc

from patcher.engines.registry import engine, engine_names
from patcher.rules.logits import SCHEMA
from patcher.rules.prompts import Prompt
from patcher.runners.launch import (
    REFERENCE_RUNNER,
    RunnerFailed,
    RunnerJob,
    RunnerOutputError,
    RunnerSpec,
    RunnerTimeout,
    RunnerUnavailable,
    root_cause,
    run_runner,
)

PROMPTS = [Prompt("a", "", (1, 2, 3, 4, 5, 6)), Prompt("b", "", (7, 8, 9, 10, 11, 12), "mixed")]

FAKE = """
import argparse, json, os, sys, time
ap = argparse.ArgumentParser()
for a in ("--model", "--prompts", "--dtype", "--top-k", "--max-tokens", "--out", "--fingerprint"):
    ap.add_argument(a)
ap.add_argument("--mode", default="ok")
args = ap.parse_args()
print("fake runner starting", os.environ.get("FAKE_ENV"), flush=True)
if args.mode == "crash":
    print("Traceback (most recent call last):\\nKeyError: 'layers.1.mlp.gate.e_score_correction_bias'",
          file=sys.stderr)
    sys.exit(1)
if args.mode == "hang":
    time.sleep(60)
if args.mode == "silent":
    sys.exit(0)
ids = [p["id"] for p in json.load(open(args.prompts))["prompts"]]
doc = json.loads(os.environ["FAKE_DOC"])
doc["dtype"] = args.dtype
doc["prompts"] = [dict(p, id=i) for p, i in zip(doc["prompts"], ids)]
if args.mode == "wrongids":
    doc["prompts"] = doc["prompts"][:1]
json.dump(doc, open(args.out, "w"))
"""


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_runner.py"
    script.write_text(textwrap.dedent(FAKE))
    ids, rows, gen = greedy_case(0)
    doc = {"schema": SCHEMA, "runner": "fake", "engine": "fake", "engine_version": "1", "dtype": "float32",
           "top_k": 5, "max_tokens": 4, "prompts": [prompt_doc("x", ids, rows, gen, 5)] * 2}
    env = {"FAKE_DOC": json.dumps(doc), "FAKE_ENV": "from-spec"}

    def spec(mode="ok"):
        return RunnerSpec("fake", script, env=env, extra_args=("--mode", mode))

    return spec


def test_argv_is_the_common_command_line():
    vllm = engine("vllm").runner
    argv = vllm.argv(Path("/v/bin/python"), Path("/m"), Path("/p.json"), "float32", 5, 16,
                                Path("/o.json"), fingerprint="abc")
    assert argv[0] == "/v/bin/python" and argv[1].endswith("patcher/engines/vllm/runner.py")
    assert argv[2:] == ["--model", "/m", "--prompts", "/p.json", "--dtype", "float32", "--top-k", "5",
                        "--max-tokens", "16", "--out", "/o.json", "--fingerprint", "abc"]
    assert vllm.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    runners = [REFERENCE_RUNNER] + [engine(n).runner for n in engine_names()]
    assert all(s.script.is_file() for s in runners if s is not None)


def test_success_returns_validated_report_and_log(fake, tmp_path):
    lines = []
    out = tmp_path / "r" / "report.json"
    rep = run_runner(fake(), Path(sys.executable), RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, out), on_line=lines.append)
    assert [p.id for p in rep.prompts] == ["a", "b"] and rep.timings["wall_s"] > 0
    assert "fake runner starting from-spec" in lines
    assert (tmp_path / "r" / "report.json.log").read_text().startswith("$ ")
    sent = json.loads((tmp_path / "r" / "report.json.prompts.json").read_text())
    assert sent["prompts"][1] == {"id": "b", "token_ids": [7, 8, 9, 10, 11, 12], "batch": "mixed"}


def test_caller_env_overrides_spec_env(fake, tmp_path):
    lines = []
    run_runner(fake(), Path(sys.executable), RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, tmp_path / "o.json"),
               env={"FAKE_ENV": "from-caller"}, on_line=lines.append)
    assert "fake runner starting from-caller" in lines


def test_crash_raises_runner_failed_with_log_tail(fake, tmp_path):
    with pytest.raises(RunnerFailed) as e:
        run_runner(fake("crash"), Path(sys.executable), RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, tmp_path / "o.json"))
    assert "e_score_correction_bias" in e.value.log_tail
    assert "status 1" in e.value.message and "e_score_correction_bias" in e.value.message


def test_timeout_kills_and_raises(fake, tmp_path):
    with pytest.raises(RunnerTimeout):
        run_runner(fake("hang"), Path(sys.executable), RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, tmp_path / "o.json"),
                   timeout=2)


def test_missing_or_inconsistent_output(fake, tmp_path):
    with pytest.raises(RunnerOutputError, match="wrote no report"):
        run_runner(fake("silent"), Path(sys.executable), RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, tmp_path / "o.json"))
    with pytest.raises(RunnerOutputError, match="asked for"):
        run_runner(fake("wrongids"), Path(sys.executable), RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, tmp_path / "o.json"))


def test_missing_interpreter_is_unavailable(fake, tmp_path):
    with pytest.raises(RunnerUnavailable):
        run_runner(fake(), tmp_path / "nope" / "python", RunnerJob(tmp_path, PROMPTS, "float32", 5, 4, tmp_path / "o.json"))


def test_root_cause_skips_vllm_wrapper_errors():
    log = ["(Worker pid=13204) ERROR 11-29 12:27:27 [multiproc_executor.py:953] "
           "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'",
           "    raise RuntimeError(",
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert root_cause(log) == "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'"
    assert root_cause(log[2:]).startswith("RuntimeError: Engine core")
    assert root_cause(["all fine"]) is None


def _script(name):
    import importlib.util

    path = engine(name).runner.script if name in engine_names() else REFERENCE_RUNNER.script
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vllm_position_entry_reads_logprob_mappings():
    """vLLM's per-position {token_id: Logprob(logprob, rank, decoded_token)} (also what a
    FlatLogprobs row is): top-k by rank, plus the actual token whatever its rank."""
    from collections import namedtuple

    vr = _script("vllm")  # importable without vllm: vllm is imported in main()
    Lp = namedtuple("Logprob", "logprob rank decoded_token")
    row = {9: Lp(-4.0, 7, None), 5: Lp(-0.1, 1, None), 7: Lp(-2.5, 2, None), 8: Lp(-3.0, 3, None)}
    assert vr.position_entry(row, 9, 2) == {"token": 9, "logprob": -4.0, "top": {"5": -0.1, "7": -2.5}}
    assert vr.position_entry({}, 3, 2) is None and vr.position_entry(None, 3, 2) is None
    docs = [{"id": "a", "batch": None}, {"id": "m0", "batch": "m"}, {"id": "b"}, {"id": "m1", "batch": "m"}]
    assert [[p["id"] for p in g] for g in vr.groups(docs)] == [["a"], ["m0", "m1"], ["b"]]

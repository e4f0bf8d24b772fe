"""Shared helpers for tests/test_equivalence_*.py: synthetic reports and tiny models."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest

from patcher.rules.logits import SCHEMA, LogitReport

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 60


def log_softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - z for x in logits]


def entry(row: list[float], token: int, k: int) -> dict:
    top = sorted(range(len(row)), key=lambda t: -row[t])[:k]
    return {"token": token, "logprob": row[token], "top": {str(t): row[t] for t in top}}


def rows_for(seed: int, n: int) -> list[list[float]]:
    """n random log-softmax rows with well-separated values (no accidental ties)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        logits = rng.sample(range(VOCAB * 10), VOCAB)
        rows.append(log_softmax([x / 60.0 for x in logits]))
    return rows


def prompt_doc(pid, ids, rows, gen, k, batch=None):
    """A prompt result document from rows (row i predicts token i+1 of ids + gen)."""
    full = list(ids) + list(gen)
    return {"id": pid, "batch": batch, "prompt_token_ids": list(ids),
            "prompt_logprobs": [None] + [entry(rows[i - 1], full[i], k) for i in range(1, len(ids))],
            "generated_token_ids": list(gen),
            "generated_logprobs": [entry(rows[i - 1], full[i], k) for i in range(len(ids), len(full))]}


def greedy_case(seed: int, n_prompt: int = 6, n_gen: int = 4):
    """(ids, rows, gen) where gen is the argmax continuation of rows."""
    rng = random.Random(seed + 1000)
    rows = rows_for(seed, n_prompt - 1 + n_gen)
    ids = [rng.randrange(VOCAB) for _ in range(n_prompt)]
    gen = [max(range(VOCAB), key=lambda t: rows[n_prompt - 1 + i][t]) for i in range(n_gen)]
    return ids, rows, gen


def report(prompts: list[dict], dtype="float32", k=20, runner="synthetic") -> LogitReport:
    return LogitReport.from_json({"schema": SCHEMA, "runner": runner, "engine": runner, "engine_version": "0",
                                  "dtype": dtype, "top_k": k, "max_tokens": 4, "prompts": prompts})


def load_hf_reference():
    """The standalone HF runner script, imported as a module (tests call its functions
    in-process to share one model load)."""
    spec = importlib.util.spec_from_file_location("hf_reference", ROOT / "patcher/runners/hf_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_tiny(out: Path, variant="v3", config_style="deepseek") -> Path:
    tiny = pytest.importorskip("patcher.checkpoints.tiny", reason="patcher.checkpoints.tiny (tiny model maker) not present")
    pytest.importorskip("transformers")
    tiny.make_model(out, variant=variant, config_style=config_style, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 (deepseek config style), built once per test session."""
    return make_tiny(tmp_path_factory.mktemp("tiny") / "v3")

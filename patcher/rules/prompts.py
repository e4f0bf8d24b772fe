"""The equivalence gate's fixed prompt set.

The texts ship in code; `build_prompt_set` turns them into token ids with the
model's own ``tokenizer.json`` (through ``tokenizers``, no transformers), then
cuts or repeats each to a fixed length so the set has the same shape whatever
the vocabulary. Runners receive token ids only (a JSON file written by
`write_prompts_json`), so no engine-side tokenization can hide a difference.

Lengths: ``short`` 8 tokens, ``medium`` 40, ``long`` past YaRN's
``original_max_position_embeddings`` (read from config.json) where the
context window allows, and a mixed-length batch ``mixed/0..3`` that runners
must submit as one batch (padded on the HF side, one ``generate()`` call on
vLLM's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from patcher.base.errors import UsageError

#: The context length every runner is started with (vLLM ``max_model_len``).
MAX_MODEL_LEN = 256
#: Greedy tokens generated per prompt unless the caller says otherwise.
DEFAULT_MAX_TOKENS = 16
#: How far past ``original_max_position_embeddings`` the long prompt reaches.
LONG_PAST_ORIGINAL = 48
#: Name of the one batch in the set.
MIXED_BATCH = "mixed"

_LONG_TEXT = (
    "Rotary position embeddings rotate each pair of query and key dimensions by an angle that grows "
    "with the position of the token. YaRN stretches the slow frequencies so that a model trained on a "
    "short window can read a longer one, keeps the fast frequencies as they were, and blends the two "
    "in between; it also scales the attention logits so that their entropy stays where training left "
    "it. DeepSeek models apply the rotation to a small slice of each head only, sixty-four dimensions "
    "laid out as interleaved pairs, and compress keys and values into a shared latent vector. An "
    "inference engine that gets any of these details wrong still produces fluent text at short "
    "lengths, which is why the gate compares log probabilities position by position, and why one of "
    "its prompts reaches beyond the original context window. "
)

#: (id, text, target length in tokens, batch name or None). Lengths of ``None``
#: mean "the long length" computed from the model's config.
PROMPT_TEXTS: tuple[tuple[str, str, int | None, str | None], ...] = (
    ("short", "The quick brown fox jumps over the lazy dog near the river bank.", 8, None),
    (
        "medium",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
        "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "print([fibonacci(i) for i in range(10)])\n",
        40,
        None,
    ),
    ("long", _LONG_TEXT, None, None),
    ("mixed/0", "Explicit is better than implicit.", 5, MIXED_BATCH),
    (
        "mixed/1",
        "A mixture-of-experts layer sends each token to a few experts chosen by a router, "
        "weights their outputs, and adds the shared experts that every token visits.",
        23,
        MIXED_BATCH,
    ),
    ("mixed/2", _LONG_TEXT[::-1].title(), 61, MIXED_BATCH),
    ("mixed/3", "Numbers: 3.14159, 2.71828, 1.41421, 1.61803, 0.57721 and 42.", 12, MIXED_BATCH),
)


class PromptError(UsageError):
    """The prompt set cannot be built for this model (a model folder the gate cannot use)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of the set, as token ids. `batch` names the batch it is submitted in
    (None: submitted alone)."""

    id: str
    text: str
    token_ids: tuple[int, ...]
    batch: str | None = None


def rope_original_max(config: dict) -> int | None:
    """YaRN's ``original_max_position_embeddings`` from a config.json dict, or None
    when the model has no YaRN scaling. Reads ``rope_scaling`` (DeepSeek and
    vLLM's key) and falls back to transformers 5's ``rope_parameters``."""
    for key in ("rope_scaling", "rope_parameters"):
        rs = config.get(key) or {}
        kind = rs.get("type") or rs.get("rope_type")
        if kind == "yarn" and rs.get("original_max_position_embeddings"):
            return int(rs["original_max_position_embeddings"])
    return None


def long_prompt_length(config: dict, max_tokens: int = DEFAULT_MAX_TOKENS,
                       max_model_len: int = MAX_MODEL_LEN) -> int:
    """Length of the long prompt: ``original_max_position_embeddings + 48`` capped so
    that prompt + generation fits ``max_model_len``; without YaRN, the cap itself."""
    cap = max_model_len - max_tokens
    orig = rope_original_max(config)
    if orig is None:
        return cap
    return min(orig + LONG_PAST_ORIGINAL, cap)


def fit_tokens(ids: list[int], length: int) -> tuple[int, ...]:
    """Repeat `ids` as often as needed, then cut to exactly `length` tokens."""
    if not ids:
        raise PromptError("a prompt text tokenized to no tokens",
                          hint="check the model's tokenizer.json")
    reps = -(-length // len(ids))
    return tuple((ids * reps)[:length])


#: Where seeded prompt sets draw their texts from (prose, code, numbers and chat turns).
CORPUS_PATH = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"


def prompt_texts(seed: int = 0) -> tuple[tuple[str, str, int | None, str | None], ...]:
    """The prompt set's texts: seed 0 the fixed ones; any other seed the same ids, lengths and
    batch, each text a passage drawn from the shipped corpus by (seed, prompt id): another,
    independent set of inputs of the same shape (repeated control runs of a deterministic
    engine need other inputs, not the same ones again)."""
    if seed < 0:
        raise PromptError(f"prompt seed {seed} is negative", hint="use 0 (the fixed prompts) or a positive seed")
    if seed == 0:
        return PROMPT_TEXTS
    import random

    corpus = " ".join(CORPUS_PATH.read_text(encoding="utf-8").split())
    out = []
    for pid, _text, length, batch in PROMPT_TEXTS:
        rng = random.Random(f"{seed}:{pid}")
        span = 4 * (length or MAX_MODEL_LEN) + 64  # characters: a few per token, then cut to length
        start = rng.randrange(0, max(1, len(corpus) - span))
        out.append((pid, corpus[start:start + span], length, batch))
    return tuple(out)


def build_prompt_set(model_dir: Path, max_tokens: int = DEFAULT_MAX_TOKENS,
                     max_model_len: int = MAX_MODEL_LEN, seed: int = 0) -> list[Prompt]:
    """Tokenize the prompt texts (`prompt_texts(seed)`) with ``model_dir/tokenizer.json`` into
    the prompt set."""
    from tokenizers import Tokenizer  # the models extra; imported here so the module stays light

    model_dir = Path(model_dir)
    tok_path, cfg_path = model_dir / "tokenizer.json", model_dir / "config.json"
    for p in (tok_path, cfg_path):
        if not p.is_file():
            raise PromptError(f"{p} is missing", hint="the model folder needs config.json and tokenizer.json")
    config = json.loads(cfg_path.read_text())
    tok = Tokenizer.from_file(str(tok_path))
    long_len = long_prompt_length(config, max_tokens, max_model_len)
    vocab = config.get("vocab_size")
    prompts = []
    for pid, text, length, batch in prompt_texts(seed):
        ids = fit_tokens(tok.encode(text).ids, long_len if length is None else length)
        if vocab is not None and max(ids) >= vocab:
            raise PromptError(f"prompt {pid!r} has token id {max(ids)} >= vocab_size {vocab}",
                              hint="the tokenizer is larger than the model's embedding")
        prompts.append(Prompt(pid, text, ids, batch))
    return prompts


def prompts_to_json(prompts: list[Prompt]) -> dict:
    """The runners' input document: ``{"prompts": [{"id", "token_ids", "batch"}]}``."""
    return {"prompts": [{"id": p.id, "token_ids": list(p.token_ids), "batch": p.batch} for p in prompts]}


def prompts_from_json(doc: dict) -> list[Prompt]:
    return [Prompt(d["id"], d.get("text", ""), tuple(d["token_ids"]), d.get("batch")) for d in doc["prompts"]]


def write_prompts_json(prompts: list[Prompt], path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(prompts_to_json(prompts)))
    return path


def describe(prompts: list[Prompt]) -> list[dict]:
    """Rows for display: id, batch, length."""
    return [{"id": p.id, "batch": p.batch, "length": len(p.token_ids)} for p in prompts]

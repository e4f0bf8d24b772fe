"""patcher/engines/triton/runner.py: request body and answer -> report (pure)."""

from __future__ import annotations

import json

import pytest

from patcher.engines.triton import runner as tr


def _pos(entries):
    """{"id": (logprob, rank)} -> vLLM's JSON logprobs position."""
    return {k: {"logprob": lp, "rank": rank, "decoded_token": "x"} for k, (lp, rank) in entries.items()}


def _answer(prompt_ids, generated, prompt_positions, gen_positions):
    return {
        "model_name": "m",
        "text_output": ["..."],
        "prompt_token_ids": json.dumps(prompt_ids),
        "prompt_logprobs": json.dumps([None] + prompt_positions),
        "output_token_ids": [json.dumps(generated)],
        "logprobs": [json.dumps(gen_positions)],
    }


PROMPT = {"id": "p", "token_ids": [0, 5, 6], "text": "hi", "batch": None}


def test_body_asks_for_every_gate_output_and_sends_token_ids():
    body = tr.generate_body(PROMPT, top_k=3, max_tokens=4)
    assert json.loads(body["input_token_ids"]) == [0, 5, 6]
    assert body["parameters"]["logprobs"] == 3 and body["parameters"]["prompt_logprobs"] == 3
    assert body["parameters"]["temperature"] == 0 and body["parameters"]["ignore_eos"] is True
    for flag in ("return_prompt_token_ids", "return_prompt_logprobs", "return_output_token_ids", "return_logprobs"):
        assert body[flag] is True


def test_answer_becomes_the_gate_shape_with_top_k_by_rank():
    answer = _answer(
        [0, 5, 6],
        [7, 8],
        # position 1: actual token 5 is outside the top-2 (rank 9): kept as logprob, not in top
        [_pos({"5": (-4.0, 9), "1": (-0.5, 1), "2": (-1.0, 2)}), _pos({"6": (-0.2, 1), "3": (-2.0, 2)})],
        [_pos({"7": (-0.1, 1), "4": (-3.0, 2)}), _pos({"8": (-0.3, 1), "9": (-1.5, 2)})],
    )
    result = tr.prompt_result(PROMPT, answer, top_k=2, max_tokens=2)
    assert result["prompt_token_ids"] == [0, 5, 6]
    assert result["prompt_logprobs"][0] is None
    assert result["prompt_logprobs"][1] == {"token": 5, "logprob": -4.0, "top": {"1": -0.5, "2": -1.0}}
    assert result["prompt_logprobs"][2] == {"token": 6, "logprob": -0.2, "top": {"6": -0.2, "3": -2.0}}
    assert result["generated_token_ids"] == [7, 8]
    assert result["generated_logprobs"][1] == {"token": 8, "logprob": -0.3, "top": {"8": -0.3, "9": -1.5}}


def test_answer_without_the_stack_outputs_is_refused():
    answer = {"text_output": ["x"], "logprobs": ["[]"]}
    with pytest.raises(tr.RunnerError, match="stack applied"):
        tr.prompt_result(PROMPT, answer, top_k=2, max_tokens=0)


def test_server_running_other_token_ids_is_refused():
    answer = _answer([0, 5], [], [_pos({"5": (-1.0, 1)})], [])
    with pytest.raises(tr.RunnerError, match="other token ids"):
        tr.prompt_result(PROMPT, answer, top_k=1, max_tokens=0)


def test_short_generation_is_refused():
    answer = _answer(
        [0, 5, 6],
        [7],
        [_pos({"5": (-1.0, 1)}), _pos({"6": (-1.0, 1)})],
        [_pos({"7": (-0.1, 1)})],
    )
    with pytest.raises(tr.RunnerError, match="1 tokens generated, 2 asked"):
        tr.prompt_result(PROMPT, answer, top_k=1, max_tokens=2)


def test_batches_are_grouped_and_singles_stay_alone():
    docs = [
        {"id": "a", "batch": None},
        {"id": "m0", "batch": "mixed"},
        {"id": "b", "batch": None},
        {"id": "m1", "batch": "mixed"},
    ]
    assert [[d["id"] for d in g] for g in tr.groups(docs)] == [["a"], ["m0", "m1"], ["b"]]

"""The engine's session (LMDeploy's session_len, vLLM's max_model_len) holds the longest run the
gate makes: the long prompt reaches the model length minus the generated tokens, and the capture
pass of the per-module comparison generates one token more than the gate's run."""

import sys

from patcher.rules.prompts import MAX_MODEL_LEN, long_prompt_length
from patcher.runners.launch import KIT_DIR

sys.path.insert(0, str(KIT_DIR))
import dsadapt_runner as kit  # noqa: E402 - the runners' own stdlib module


def test_the_capture_pass_of_a_long_yarn_prompt_needs_more_than_the_default_length():
    config = {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096, "factor": 40}}
    long = long_prompt_length(config, 16, MAX_MODEL_LEN)
    assert long == MAX_MODEL_LEN - 16  # a released V3: the cap, not original + 48
    prompts = [{"id": "short", "token_ids": [1] * 8}, {"id": "long", "token_ids": [1] * long}]
    assert kit.context_needed(prompts, 16) == MAX_MODEL_LEN  # the gate's own run fits exactly
    assert kit.context_needed(prompts, 16, capture_steps=17) == MAX_MODEL_LEN + 1  # the capture does not
    assert kit.context_needed([], 16) == 16

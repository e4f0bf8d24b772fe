"""The v0.4.0 stack's DeepSeek-V2 chat template renders DeepSeek-V2-Chat's format.

Expected strings follow the DeepSeek-V2-Chat model card's chat template examples; the
begin-of-sentence token is added by the tokenizer in LMDeploy (encode(add_bos=...)), so
the rendered text is the card's text without it.
"""

from __future__ import annotations

import pytest
from lmdeploy_support import WHEELS, load_module, trees, wheel_path

# the pinned LMDeploy 0.4.0 wheel comes from PyPI (once per machine: tests/shared_envs.py)
pytestmark = pytest.mark.network

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def model_py(tmp_path_factory):
    if wheel_path("v0.4.0") is None:
        pytest.skip(f"{WHEELS['v0.4.0'][0]} could not be found or fetched")
    root = tmp_path_factory.mktemp("lmd040")
    t = trees("v0.4.0", root)
    base, patched = t.base, t.patched
    return (load_module(patched / "lmdeploy/model.py", "lmd040_model_patched", stub_mmengine=True),
            load_module(base / "lmdeploy/model.py", "lmd040_model_base", stub_mmengine=True))


def card(*parts: str) -> str:
    """DeepSeek-V2-Chat's rendering, minus the BOS the tokenizer adds."""
    text = "".join(parts)
    assert text.startswith(BOS)
    return text[len(BOS):]


def test_single_user_turn(model_py):
    tpl = model_py[0].MODELS.get("deepseek-v2")()
    want = card(BOS, "User: Write quicksort in C++\n\nAssistant:")
    assert tpl.messages2prompt([{"role": "user", "content": "Write quicksort in C++"}]) == want
    assert tpl.get_prompt("Write quicksort in C++") == want


def test_multi_turn_with_system(model_py):
    tpl = model_py[0].MODELS.get("deepseek-v2")()
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "2+2?"}]
    want = card(BOS, "You are terse.\n\n", "User: Hi\n\n", "Assistant: Hello.", EOS, "User: 2+2?\n\n", "Assistant:")
    assert tpl.messages2prompt(messages) == want


def test_multi_turn_without_system_has_no_preamble(model_py):
    tpl = model_py[0].MODELS.get("deepseek-v2")()
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    assert tpl.messages2prompt(messages) == card(BOS, "User: a\n\nAssistant: b", EOS, "User: c\n\nAssistant:")


@pytest.mark.parametrize("path,name", [
    ("deepseek-ai/DeepSeek-V2-Chat", "deepseek-v2"),
    ("/models/DeepSeek-V2-Lite-Chat", "deepseek-v2"),
    ("deepseek-ai/deepseek-llm-67b-chat", "deepseek"),
    ("deepseek-ai/deepseek-coder-6.7b-instruct", "deepseek-coder"),
])
def test_best_match_model(model_py, path, name):
    assert model_py[0].best_match_model(path) == name


@pytest.mark.parametrize("path", ["deepseek-ai/DeepSeek-V2.5", "deepseek-ai/DeepSeek-V2-Chat-0628",
                                  "deepseek-ai/DeepSeek-V2"])
def test_other_v2_checkpoints_are_not_claimed(model_py, path):
    # (best_match_model would fall back to the hub for these: ask the matcher directly)
    assert model_py[0].MODELS.get("deepseek-v2").match(path) is None


def test_unpatched_release_renders_system_without_separator(model_py):
    """What the patch fixes: 0.4.0 matched V2-Chat to 'deepseek', whose system turn runs
    straight into 'User:'."""
    base = model_py[1]
    assert base.best_match_model("deepseek-ai/DeepSeek-V2-Chat") == "deepseek"
    tpl = base.MODELS.get("deepseek")()
    got = tpl.messages2prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert got == "SUser: U\n\nAssistant:"

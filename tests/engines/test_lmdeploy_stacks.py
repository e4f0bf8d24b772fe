"""The LMDeploy stacks apply on the pinned wheels' base trees, and v0.4.0's refusal works.

Needs the pinned wheels (shared artifact cache, fetched from PyPI once); skips without network.
"""

from __future__ import annotations

import json

import pytest
from lmdeploy_support import (
    BASE_TREES,
    WHEELS,
    blob_id,
    git,
    load_module,
    series,
    sha256,
    wheel_path,
)
from lmdeploy_support import (
    trees as make_trees,
)

# the pinned LMDeploy wheels come from PyPI (once per machine: tests/shared_envs.py)
pytestmark = pytest.mark.network

TAGS = ("v0.4.0", "v0.18.0")


def _need(tag: str):
    if wheel_path(tag) is None:
        pytest.skip(f"{WHEELS[tag][0]} could not be found or fetched")


@pytest.fixture(scope="session")
def trees(tmp_path_factory):
    """tag -> (base tree, patched tree), built once per session on demand."""
    cache: dict[str, tuple] = {}

    def get(tag: str):
        _need(tag)
        if tag not in cache:
            t = make_trees(tag, tmp_path_factory.mktemp(f"lmdeploy-{tag}"))
            cache[tag] = (t.base, t.patched, t.applied)
        return cache[tag]
    return get


@pytest.mark.parametrize("tag", TAGS)
def test_wheel_is_the_pinned_artifact(tag):
    _need(tag)
    assert sha256(wheel_path(tag)) == WHEELS[tag][1]


@pytest.mark.parametrize("tag", TAGS)
def test_base_tree_id(trees, tag):
    base, _, _ = trees(tag)
    assert git(base, "rev-parse", "HEAD^{tree}").strip() == BASE_TREES[tag]


@pytest.mark.parametrize("tag", TAGS)
def test_stack_applies_with_its_post_images(trees, tag):
    _, patched, applied = trees(tag)
    assert applied, f"{tag}: the stack changed nothing"
    for path, post in applied:
        assert blob_id(patched, path) == post, path
    assert len(series(tag)) >= 1


def _config(tmp_path, arch: str, model_type: str):
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type}))
    return str(d)


def test_v040_refuses_deepseek_v2(trees, tmp_path):
    base, patched, _ = trees("v0.4.0")
    rel = "lmdeploy/pytorch/supported_models.py"
    new = load_module(patched / rel, "lmd040_supported_patched")
    old = load_module(base / rel, "lmd040_supported_base")
    v2 = _config(tmp_path, "DeepseekV2ForCausalLM", "deepseek_v2")
    llama = _config(tmp_path, "LlamaForCausalLM", "llama")

    with pytest.raises(RuntimeError, match="DeepSeek-V2 .*not supported by LMDeploy 0.4.0"):
        new.check_refused("DeepseekV2ForCausalLM", v2)
    with pytest.raises(RuntimeError, match="DeepseekV2ForCausalLM"):
        new.is_supported(v2)
    new.check_refused("LlamaForCausalLM")
    assert new.is_supported(llama) is True
    # unpatched 0.4.0 only says "not supported", and autoget_backend then falls back
    # to the PyTorch engine anyway
    assert old.is_supported(v2) is False


def test_v040_model_config_refuses_deepseek_v2(trees):
    _, patched, _ = trees("v0.4.0")
    text = (patched / "lmdeploy/pytorch/config.py").read_text()
    # ModelConfig.from_hf_config runs the check before building any config
    start = text.index("def from_hf_config")
    body = text[start:text.index("def __build_falcon", start)]
    assert "check_refused(arch, model_path)" in body

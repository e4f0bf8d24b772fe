"""The Triton stacks (patches/triton/<tag>/): well-formed everywhere; applying on
the pinned vllm_backend commits where a mirror is configured (DSADAPT_MIRRORS)."""

from __future__ import annotations

import ast
import re

import pytest

import triton_support as sup

TAGS = sorted(sup.PINS)
GATE_NAMES = ("input_token_ids", "apply_chat_template", "return_prompt_logprobs",
              "prompt_token_ids", "prompt_logprobs", "output_token_ids", "return_logprobs")


@pytest.mark.parametrize("tag", TAGS)
def test_series_patches_carry_trailers_and_covering_tests(tag):
    patches = sup.series(tag)
    assert patches, f"{tag}: empty stack"
    tests_dir = sup.STACKS_DIR.parent.parent / "tests"
    for patch in patches:
        text = patch.read_text()
        assert text.startswith("From: "), patch.name
        message = text.split("\n---\n", 1)[0]
        assert re.search(r"^Upstream-Status: (Pending|Backport \S+)$", message, re.M), patch.name
        covered = re.findall(r"^Covered-By: (.+)$", message, re.M)
        assert covered, f"{patch.name}: no Covered-By"
        for test_id in covered:
            path, _, name = test_id.strip().partition("::")
            source = (tests_dir.parent / path).read_text()
            assert f"def {name}(" in source, f"{patch.name}: {test_id} does not exist"


mirror = sup.triton_mirror()
needs_mirror = pytest.mark.skipif(
    mirror is None, reason="no triton mirror: set DSADAPT_MIRRORS='triton=/path/to/vllm_backend.git'"
)


@pytest.mark.mirror
@needs_mirror
@pytest.mark.parametrize("tag", TAGS)
def test_stack_applies_on_pinned_commit(tag, tmp_path):
    checkout = sup.apply_stack(mirror, tag, tmp_path / tag)
    assert sup._git(checkout, "rev-list", "--count", f"{sup.PINS[tag][0]}..HEAD") == str(len(sup.series(tag)))
    sources = {p: (checkout / p).read_text() for p in ("src/model.py",)}
    if (checkout / "src/utils/request.py").exists():
        sources["src/utils/request.py"] = (checkout / "src/utils/request.py").read_text()
    for path, text in sources.items():
        ast.parse(text, filename=path)
    everything = "\n".join(sources.values())
    for name in GATE_NAMES:
        assert f'"{name}"' in everything, f"{tag}: {name} not in the patched backend"

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


@pytest.mark.mirror
@needs_mirror
@pytest.mark.parametrize("tag", TAGS)
def test_dsadapt_apply_verify_and_build_through_the_mirror(tag, tmp_path):
    """The real tool on the real lock: the mirror source (commit checked against the lock), the
    stack applied as commits, verify clean, and a backend build that is byte-reproducible."""
    from dataclasses import replace

    from shared_envs import real_lock, shared_config

    from patcher.artifacts.builder import build_pin
    from patcher.formats.pinref import PinRef
    from patcher.stack.apply import apply_stack
    from patcher.stack.verify import verify_stack

    ref = PinRef("triton", tag)
    cfg = replace(shared_config(), workdir=tmp_path / "work", sources=("mirror",),
                  mirrors={"triton": (mirror,)})
    res = apply_stack(cfg, real_lock(), ref)
    assert res.source["kind"] == "mirror" and res.source["commit"] == real_lock().pin(ref).commit
    assert [o.outcome for o in res.outcomes] == ["clean"] * len(sup.series(tag))
    v = verify_stack(cfg, real_lock(), ref)
    assert v.ok, v.problems
    first = build_pin(cfg, real_lock(), ref, out_dir=tmp_path / "dist1")
    again = build_pin(cfg, real_lock(), ref, out_dir=tmp_path / "dist2")
    assert first.kind == "backend" and first.sha256 == again.sha256
    import tarfile

    with tarfile.open(first.artifact) as tar:
        names = tar.getnames()
    assert any(n.endswith("backends/vllm/model.py") for n in names)
    assert any(n.endswith("model_repository/deepseek/config.pbtxt") for n in names)

"""A release-shaped wheel of the fixture upstream pinned in a test project, with a stack of edits
that exercises every branch of the overlay writer; and a vllm adapter with changed variants. Shared by
the overlay-build and bench tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conftest import P1_MOD, TAG1, artifact_toml, commit_msg, lock_text, make_patches, make_wheel, swap_engine

from patcher.engines.base import VariantSpec
from patcher.engines.registry import engine

WHEEL_NAME = "vllm-1.0.0-py3-none-any.whl"
DIST_INFO = "vllm-1.0.0.dist-info"
SO = "vllm/_C.abi3.so"
TEMPLATE = "{# fixture chat template #}\n{% for m in messages %}{{ m.content }}\n{% endfor %}\n"
NEWMOD = "def added():\n    return 'ds'\n"

OVERLAY_EDITS = [
    (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD}),
    (commit_msg("add a module and a chat template"),
     {"vllm/newmod.py": NEWMOD, "vllm/templates/chat.jinja": TEMPLATE}),
    (commit_msg("drop the util module"), {"vllm/util.py": None}),
    (commit_msg("readme: say it is patched"), {"README.md": "fixture upstream, patched\n"}),
]


# ---------------------------------------------------------------- fixtures


DATA_SCRIPT = "vllm-1.0.0.data/scripts/vllm-tool"


def release_wheel(project, dest: Path, *, overrides: dict[str, str] | None = None) -> tuple[Path, str]:
    """A release-shaped wheel of v1.0.0's vllm/: WHEEL, METADATA, a .so, a .data script, a RECORD of real hashes."""
    return make_wheel(project.upstream, dest, TAG1, overrides=overrides, summary="fixture",
                      extra={SO: b"\x7fELF not really a shared object", DATA_SCRIPT: b"#!python\nprint('tool')\n"})


def pin_wheel(project, edits=OVERLAY_EDITS, *, overrides=None, sha: str | None = None) -> tuple[Path, str]:
    """Write the stack made of `edits` and a lock pinning a release wheel (sha256 from the file unless given)."""
    project.write_stack(make_patches(project.upstream, project.tmp / "mk", TAG1, edits))
    wheel, real_sha = release_wheel(project, project.tmp / "artifacts", overrides=overrides)
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(WHEEL_NAME, sha or real_sha)))
    return wheel, real_sha


def with_variants(monkeypatch, *extra: VariantSpec, **cpu_changes) -> None:
    """Swap the vllm adapter for one whose cpu variant has `cpu_changes`, plus `extra` variants."""
    ad = engine("vllm")
    cpu = dataclasses.replace(ad.variants[0], **cpu_changes)
    swap_engine(monkeypatch, "vllm", variants=(cpu, *ad.variants[1:], *extra))


COMPILED_EDITS = [
    (commit_msg("mod: default scoring to sigmoid"), {"vllm/mod.py": P1_MOD}),
    (commit_msg("kernel: fused routing"), {"csrc/x.cu": "// fused DeepSeek routing\n"}),
]

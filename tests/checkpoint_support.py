"""Small checkpoints in DeepSeek's released layouts, made by the product's own fabricator.

`mini_config(like)` is the released config.json of `like` with every size shrunk (and vLLM's CPU
MLA constraints kept: kv_lora_rank 512, qk_rope_head_dim 64) so that the layout code, the
slicer and the FP8 path run in seconds; the row counts are chosen so that FP8 block grids have
partial blocks (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 5 blocks of 128, the last partial).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from patcher.checkpoints.fabricate import MadeModel, write_checkpoint
from patcher.checkpoints.released import released_config

SHRINK = dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=4, intermediate_size=704,
              moe_intermediate_size=160, n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1,
              vocab_size=1600, max_position_embeddings=256)


def mini_config(like: str = "deepseek-v3", layers: int = 2, mtp: int | None = None, **extra: Any) -> dict[str, Any]:
    c = released_config(like, None, mtp)
    c.update(SHRINK)
    c["num_hidden_layers"] = layers
    if c.get("q_lora_rank"):
        c["q_lora_rank"] = 192
    if c.get("n_group", 1) > 1:
        c.update(n_group=4, topk_group=2)
    c["rope_scaling"] = dict(c["rope_scaling"], factor=4, original_max_position_embeddings=64)
    c.update(extra)
    return dict(sorted(c.items()))


def make_mini(out: Path, like: str = "deepseek-v3", layers: int = 2, mtp: int | None = None, seed: int = 0,
              shard_bytes: int = 4_000_000, workers: int = 1, **extra: Any) -> MadeModel:
    """A mini checkpoint in the released layout (sharded with an index), written by the product."""
    return write_checkpoint(out, mini_config(like, layers, mtp, **extra), seed=seed, mtp=mtp, shard_bytes=shard_bytes,
                            workers=workers, like=like, chat_variant="v3" if like == "deepseek-v3" else "v2-lite")


@cache
def _tiny(variant: str, style: str) -> Path:
    from patcher.checkpoints.tiny import make_model

    d = Path(tempfile.mkdtemp(prefix=f"dsadapt-tiny-{variant}-")) / "model"
    make_model(d, variant=variant, config_style=style)
    return d


def _linked_copy(src: Path, dest: Path) -> Path:
    """`src`'s files at a new `dest`: hard links (a copy across file systems)."""
    dest.mkdir(parents=True)
    for p in src.iterdir():
        try:
            os.link(p, dest / p.name)
        except OSError:
            shutil.copy2(p, dest / p.name)
    return dest


def tiny_model(dest: Path, variant: str = "v3", style: str = "deepseek") -> Path:
    """A real built-in tiny checkpoint at `dest` (hard links to one made per test session): what a
    test needs where `--model DIR` must be a checkpoint but nothing runs it."""
    src = _tiny(variant, style)
    return _linked_copy(src, dest)


@cache
def _mini_template(like: str, layers: int) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"dsadapt-mini-{like}-")) / "model"
    make_mini(d, like, layers=layers, mtp=0)
    return d


def mini_copy(dest: Path, like: str = "deepseek-v2-lite", layers: int = 2) -> Path:
    """A private copy (its files may be damaged) of a mini checkpoint made once per test session."""
    shutil.copytree(_mini_template(like, layers), dest)
    return dest


def small_v3_config(hidden: int = 1024, layers: int = 4) -> dict[str, Any]:
    """DeepSeek-V3's released config.json at a CPU size: its layer pattern (three dense layers, then
    MoE), block-FP8 quantization, grouped routing (8 groups, 4 kept, 8 of 32 experts), MLA with
    kv_lora_rank 512 / rope 64; hidden 1024 (eight 128-column activation groups, two of 512)."""
    c = released_config("deepseek-v3", None, 0)
    c.update(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=8, intermediate_size=2 * hidden,
             moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4,
             first_k_dense_replace=3, vocab_size=1600, max_position_embeddings=256, q_lora_rank=384,
             num_hidden_layers=layers)
    c["rope_scaling"] = dict(c["rope_scaling"], factor=4, original_max_position_embeddings=64)
    return dict(sorted(c.items()))


@cache
def _small_v3_template() -> Path:
    d = Path(tempfile.mkdtemp(prefix="dsadapt-small-v3-")) / "model"
    write_checkpoint(d, small_v3_config(), seed=0, mtp=0, like="deepseek-v3", workers=1)
    return d


def small_v3(dest: Path) -> Path:
    """A hard-linked copy of the small V3-shaped block-FP8 checkpoint, made once per test session."""
    src = _small_v3_template()
    return _linked_copy(src, dest)

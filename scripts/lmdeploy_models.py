"""Tiny DeepSeek V2/V3 checkpoints for the LMDeploy GPU check (the shape of NOTES.md's probe).

Standalone (stdlib + torch + transformers): it runs on the H200 device machine and here.
`v2` is DeepSeek-V2-shaped with group-limited greedy softmax routing, routed_scaling_factor 16
and norm_topk_prob false; `v3` is DeepSeek-V3-shaped (sigmoid + bias, noaux_tc). The init is
scaled so that routing and logits are far from uniform (NOTES: bugs hide in near-uniform noise).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

VOCAB = 2048


def build_config(which: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                original_max_position_embeddings=1024, beta_fast=32, beta_slow=1)
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1, moe_layer_freq=1,
                  max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False,
                  rope_parameters=dict(rope), bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if which == "v3":
        return DeepseekV3Config(**common, q_lora_rank=128, n_shared_experts=1, n_group=4, topk_group=2,
                                norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                                num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid")
    if which == "v2":
        return DeepseekV2Config(**common, q_lora_rank=None, n_shared_experts=2, n_group=4, topk_group=2,
                                norm_topk_prob=False, routed_scaling_factor=16.0,
                                topk_method="group_limited_greedy", scoring_func="softmax")
    raise ValueError(f"unknown model {which!r}")


def build_model(which: str):
    """The model in float32 with the scaled, seeded init (seed 0 for weights, 42 for the V3 bias)."""
    import torch
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    cls = DeepseekV3ForCausalLM if which == "v3" else DeepseekV2ForCausalLM
    torch.manual_seed(0)
    model = cls(build_config(which)).eval()
    gen = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa")):
                p.mul_(2.0)
            if ".mlp.experts." in name or ".shared_experts." in name:
                p.mul_(2.0)
            if name == "lm_head.weight":
                p.mul_(10.0)
        for layer in model.model.layers:
            if which == "v3" and hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)
    return model


def save(model, out: str, tokenizer_dir: str | None = None) -> str:
    """Save with a DeepSeek-style config.json (rope_scaling + rope_theta, as released checkpoints
    and LMDeploy expect) and the tokenizer files; returns the fingerprint."""
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rp = dict(cfg["rope_parameters"])
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp.pop("rope_type")
    cfg["rope_scaling"] = dict(type="yarn", **rp)
    for k in ("head_dim", "qk_head_dim"):
        cfg.pop(k, None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), out)
    return fingerprint(out)


def fingerprint(model_dir: str) -> str:
    """sha256 over config.json and model.safetensors, each as name, size and bytes (the
    algorithm of patcher/tinymodel.py's model_fingerprint)."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = os.path.join(model_dir, name)
        h.update(name.encode() + b"\0" + str(os.path.getsize(path)).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def prompt_ids(n: int = 4, length: int = 48, seed: int = 1) -> list[list[int]]:
    import torch

    return torch.randint(2, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


def build_tokenizer(corpus_path: str, out: str, vocab_size: int = VOCAB) -> None:
    """A deterministic byte-level BPE (ids 0/1 = DeepSeek's BOS/EOS) trained on `corpus_path`;
    writes tokenizer.json + tokenizer_config.json into `out`. Engines only need it to start:
    the runners feed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(corpus_path, encoding="utf-8") as f:
        tok.train_from_iterator([f.read()], trainer=trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "add_bos_token": False, "model_max_length": 4096}, f, indent=2, ensure_ascii=False)

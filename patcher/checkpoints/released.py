"""DeepSeek's released config.json files, as data (what `dsadapt model make --like` writes).

Values are the released files' own (docs/models.md, "Released checkpoints", says where each was
read and checked; a bookkeeping key that could not be checked, V2's ``transformers_version``, is
left out). Only ``num_hidden_layers`` (and ``num_nextn_predict_layers`` with ``--mtp``) change
when a model is made with fewer layers.
"""

from __future__ import annotations

import copy
from typing import Any

from patcher.base.errors import UsageError

_AUTO_MAP_V2 = {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                "AutoModel": "modeling_deepseek.DeepseekV2Model",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"}
_AUTO_MAP_V3 = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                "AutoModel": "modeling_deepseek.DeepseekV3Model",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}

# deepseek-ai/DeepSeek-V2-Lite (15.7 B parameters, 27 layers, bf16)
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": _AUTO_MAP_V2,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

# deepseek-ai/DeepSeek-V2 (236 B parameters, 60 layers, bf16): group-limited routing
DEEPSEEK_V2: dict[str, Any] = {
    **DEEPSEEK_V2_LITE,
    "ep_size": 1,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_group": 8,
    "n_routed_experts": 160,
    "num_attention_heads": 128,
    "num_hidden_layers": 60,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 16.0,
    "topk_group": 3,
    "topk_method": "group_limited_greedy",
}

# deepseek-ai/DeepSeek-V3 (671 B + 14 B MTP, 61 layers + 1 MTP module, block-FP8 e4m3)
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": _AUTO_MAP_V3,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

RELEASED = {"deepseek-v2-lite": DEEPSEEK_V2_LITE, "deepseek-v2": DEEPSEEK_V2, "deepseek-v3": DEEPSEEK_V3}
#: The Hugging Face repository each config.json was released in.
REPOS = {"deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite", "deepseek-v2": "deepseek-ai/DeepSeek-V2",
         "deepseek-v3": "deepseek-ai/DeepSeek-V3"}


def released_config(like: str, layers: int | None = None, mtp: int | None = None) -> dict[str, Any]:
    """The released config.json of `like` (a copy), with `layers` decoder layers and `mtp` MTP
    modules (default: as released) when given."""
    if like not in RELEASED:
        raise UsageError(f"unknown model {like!r}", hint=f"one of: {', '.join(RELEASED)}")
    config = copy.deepcopy(RELEASED[like])
    full = config["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full:
            raise UsageError(f"--layers {layers}: {REPOS[like]} has {full} decoder layers",
                             hint=f"pass --layers between 1 and {full}")
        config["num_hidden_layers"] = layers
    if mtp is not None:
        if mtp < 0:
            raise UsageError(f"--mtp {mtp}: must be 0 or more", hint="pass --mtp 0 to leave the MTP module out")
        if mtp and "num_nextn_predict_layers" not in config:
            raise UsageError(f"--mtp {mtp}: {REPOS[like]} has no multi-token-prediction module",
                             hint="MTP modules are DeepSeek-V3's (num_nextn_predict_layers)")
        if "num_nextn_predict_layers" in config:
            config["num_nextn_predict_layers"] = mtp
    return dict(sorted(config.items()))

"""Planted bugs in the vLLM 0.32.0 stack: one-line changes that a correct gate must catch.

Shared by the slow gate tests (tests/gate/test_gate_vllm.py plants each through the product: apply,
commit in the checkout, refresh, check) and the calibration tool
(tools/calibrate_low_precision.py), so the bugs the rule is calibrated on are the ones tested.
Each entry: (model, file in the vLLM tree, old text, new text, text it comes after, logit family).
"""

from __future__ import annotations

from pathlib import Path

TARGET = "vllm/model_executor/models/deepseek_v2.py"
YARN = "vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py"
MLA = "vllm/model_executor/layers/attention/mla_attention.py"
CPU_MLA = "vllm/v1/attention/backends/mla/cpu_mla.py"


def replace_once(path: Path, old: str, new: str, after: str | None = None) -> None:
    """Replace the first `old` (after the first `after`, if given) in a checkout file."""
    text = Path(path).read_text()
    start = text.index(after) if after else 0
    i = text.index(old, start)
    Path(path).write_text(text[:i] + new + text[i + len(old):])


BUGS = {
    # (a) MoE output not scaled by routed_scaling_factor (V3 has 2.5)
    "routed_scaling_factor": ("v3", TARGET,
                              'self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)',
                              "self.routed_scaling_factor = 1.0", "class DeepseekV2MoE", "routing"),
    # (b) plain YaRN: cos/sin scaled by mscale alone, mscale_all_dim ignored (V3: 1.0 vs 0.8)
    "yarn_mscale": ("v3", YARN, "/ yarn_get_mscale(self.scaling_factor, float(mscale_all_dim))", "/ 1.0",
                    None, "attention"),
    # (c) RoPE on halves (GPT-NeoX) where DeepSeek rotates interleaved pairs (GPT-J), in MLA
    "neox_rope": ("v3", TARGET, "is_neox_style=False,", "is_neox_style=True,", "class DeepseekV2MLAAttention",
                  "attention"),
    # (d) top-k weights renormalised although V2-Lite's config says norm_topk_prob false
    "renormalize_topk": ("v2-lite", TARGET, "renormalize=config.norm_topk_prob,", "renormalize=True,",
                         "class DeepseekV2MoE", "routing"),
    # Where (a)-(d) do not reach (for bisect):
    # (e) a norm's eps: MLA's kv_a_layernorm with eps 1e-2 instead of rms_norm_eps
    "kv_a_layernorm_eps": ("v3", TARGET, "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)",
                           "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-2)",
                           "class DeepseekV2MLAAttention", "routing"),
    # (f) the kv path of MLA: the prefill's kv_b_proj expansion split into (v, k_nope) instead of
    # (k_nope, v) — silent here because qk_nope_head_dim == v_head_dim
    "mla_kv_split": ("v3", MLA, "k_nope, v = kv_nope.split(", "v, k_nope = kv_nope.split(", "    def forward_mha(",
                     "routing"),
    # (g) the shared experts: their checkpoint gate_proj/up_proj loaded crosswise (a weight-mapping bug)
    "shared_experts_mapping": ("v3", TARGET, '            if "rotary_emb.inv_freq" in name:\n',
                               '            name = name.replace("shared_experts.gate_proj", "shared_experts.@")'
                               '.replace("shared_experts.up_proj", "shared_experts.gate_proj")'
                               '.replace("shared_experts.@", "shared_experts.up_proj")\n'
                               '            if "rotary_emb.inv_freq" in name:\n', "def load_weights(", "routing"),
}

#: Where `check --bisect` must say each bug acts: (layer, comparison points accepted as first).
#: (a): vLLM applies routed_scaling_factor when it combines routed and shared experts, so the
#: experts and their weights match and the MoE output does not.
BISECT = {
    "routed_scaling_factor": (1, {"mlp"}),
    "yarn_mscale": (0, {"attn.q_rope", "attn.k_rope"}),
    "neox_rope": (0, {"attn.q_rope", "attn.k_rope"}),
    "renormalize_topk": (1, {"router.weights"}),
    "kv_a_layernorm_eps": (0, {"attn.kv_a_norm"}),
    "mla_kv_split": (0, {"attn.core"}),
    "shared_experts_mapping": (1, {"shared"}),
}



#: Bugs that only low precision, or only one phase, can show: the low-precision rule's own cases.
#: Same layout as BUGS; (layer, points) as in BISECT, and the phase where each acts.
LOW_PRECISION_BUGS = {
    # the softmax scale x1.02 in the paged decode kernel only (the CPU MLA backend's decode call):
    # prefill runs another path (SDPA) and is untouched
    "decode_softmax_scale": ("v3", CPU_MLA, "            self.scale,\n            block_table,",
                             "            self.scale * 1.02,\n            block_table,",
                             "ops.mla_decode_kvcache_cpu(", "attention"),
    # float16 only: the overflow scaling of the residual stream applied at layer 1 instead of 0
    "fp16_residual_scale_layer": ("v3", TARGET, "            if self.layer_idx == 0:\n                # The residual",
                                  "            if self.layer_idx == 1:\n                # The residual",
                                  "# Fix FP16 overflow", "routing"),
}
LOW_PRECISION_BISECT = {
    "decode_softmax_scale": (0, {"attn.core"}, "decode"),
    "fp16_residual_scale_layer": (0, {"post_norm", "mlp", "out"}, None),
}
#: The dtypes each low-precision bug is in (float32 and bfloat16 never run the float16-only code).
LOW_PRECISION_BUG_DTYPES = {"decode_softmax_scale": ("bfloat16", "float16"),
                            "fp16_residual_scale_layer": ("float16",)}


def plant(checkout: Path, bug: str) -> None:
    """Make the one-line change of `bug` in a vLLM checkout's working tree."""
    model, rel, old, new, after, _family = {**BUGS, **LOW_PRECISION_BUGS}[bug]
    replace_once(checkout / rel, old, new, after)

"""The tensors a DeepSeek-V2/V3 checkpoint holds, derived from its config.json (pure).

Names follow DeepSeek's released checkpoints (one tensor per expert, ``gate.e_score_correction_bias``
for ``noaux_tc`` routing, MTP modules appended as layers ``num_hidden_layers ...``). A layer is
an MoE layer when the model has routed experts, its index is at least ``first_k_dense_replace``
and divisible by ``moe_layer_freq`` (DeepSeek's own modeling code). With a block-FP8
``quantization_config`` every projection weight is stored as ``float8_e4m3fn`` with a float32
``weight_scale_inv`` of one value per ``weight_block_size`` block (the grid rounds up: a
576-row weight has 5 row blocks, the last one partial; DeepSeek-V3's README_WEIGHTS.md), while
embeddings, norms, the router's weight and ``lm_head`` keep the checkpoint's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
REQUIRED_KEYS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "intermediate_size")
#: Linear projections (by their module's last name) that a block-FP8 checkpoint quantizes.
QUANTIZED_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                     "gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LayoutError(ValueError):
    """config.json does not describe a DeepSeek-V2/V3 model dsadapt can lay out."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str              # safetensors dtype
    layer: int | None       # decoder layer index (MTP modules included), None for the rest


@dataclass(frozen=True)
class Fp8Scheme:
    """A block-FP8 quantization_config: ``weight x weight_scale_inv`` per block."""

    block: tuple[int, int]
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape
        return -(-rows // self.block[0]), -(-cols // self.block[1])


def fp8_scheme(config: dict[str, Any]) -> Fp8Scheme | None:
    """The block-FP8 scheme of a config, None when it has no quantization_config; LayoutError for a
    quantization dsadapt does not know."""
    q = config.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise LayoutError("quantization_config is not an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise LayoutError(f"quantization_config.quant_method {method!r}: the gate knows block-FP8 checkpoints "
                          "(quant_method fp8) and unquantized ones")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise LayoutError(f"quantization_config.weight_block_size {block!r}: block-FP8 needs two positive integers "
                          "(DeepSeek-V3: [128, 128]); per-tensor FP8 is not supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise LayoutError(f"quantization_config.fmt {fmt!r}: only e4m3 (float8_e4m3fn) is supported")
    return Fp8Scheme((block[0], block[1]), fmt, str(q.get("activation_scheme", "dynamic")))


def check_config(config: dict[str, Any]) -> None:
    """LayoutError unless `config` is a DeepSeek-V2/V3 config with the keys the layout needs."""
    mt = config.get("model_type")
    if mt not in DEEPSEEK_MODEL_TYPES:
        raise LayoutError(f"model_type {mt!r}: the gate checks DeepSeek-V2/V3 checkpoints "
                          f"(model_type {' or '.join(DEEPSEEK_MODEL_TYPES)})")
    missing = [k for k in REQUIRED_KEYS if not isinstance(config.get(k), int) or config[k] <= 0]
    if missing:
        raise LayoutError(f"config.json lacks a positive integer {missing[0]!r}")
    if config.get("n_routed_experts"):
        for k in ("moe_intermediate_size", "num_experts_per_tok"):
            if not isinstance(config.get(k), int) or config[k] <= 0:
                raise LayoutError(f"config.json has routed experts but no positive integer {k!r}")
    q = config.get("q_lora_rank")
    if q is not None and (not isinstance(q, int) or q <= 0):
        raise LayoutError(f"q_lora_rank {q!r}: a positive integer or null")
    fp8_scheme(config)


def is_moe_layer(config: dict[str, Any], i: int) -> bool:
    return bool(config.get("n_routed_experts")) and i >= int(config.get("first_k_dense_replace") or 0) \
        and i % int(config.get("moe_layer_freq") or 1) == 0


def uses_correction_bias(config: dict[str, Any]) -> bool:
    """noaux_tc routing (a learned per-expert bias): stated, or DeepSeek-V3 with no topk_method
    (what transformers' save_pretrained writes; its V3 always routes so)."""
    method = config.get("topk_method")
    return method == "noaux_tc" or (method is None and config.get("model_type") == "deepseek_v3")


def mtp_layers(config: dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _released_dtype(config: dict[str, Any]) -> str:
    dt = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(dt), "BF16")


def expected_tensors(config: dict[str, Any], mtp: int | None = None) -> list[TensorSpec]:
    """Every tensor of the checkpoint `config` describes, in the order DeepSeek's checkpoints list
    them (embeddings, each layer, final norm, lm_head, then MTP modules). `mtp`: how many MTP
    modules (default: the config's ``num_nextn_predict_layers``)."""
    check_config(config)
    h, v = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    nope, rope, vdim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_lora, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
    n_layers = config["num_hidden_layers"]
    dtype = _released_dtype(config)
    fp8 = fp8_scheme(config)
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], layer: int | None, kind: str = "plain") -> None:
        if kind == "linear" and fp8 is not None:
            out.append(TensorSpec(name, shape, "F8_E4M3", layer))
            out.append(TensorSpec(name + "_scale_inv", fp8.grid(shape), "F32", layer))
        elif kind == "bias":
            out.append(TensorSpec(name, shape, "F32", layer))
        else:
            out.append(TensorSpec(name, shape, dtype, layer))

    def mlp(prefix: str, inner: int, layer: int) -> None:
        add(f"{prefix}.gate_proj.weight", (inner, h), layer, "linear")
        add(f"{prefix}.up_proj.weight", (inner, h), layer, "linear")
        add(f"{prefix}.down_proj.weight", (h, inner), layer, "linear")

    def decoder(i: int) -> None:
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_lora:
            add(f"{a}.q_a_proj.weight", (q_lora, h), i, "linear")
            add(f"{a}.q_a_layernorm.weight", (q_lora,), i)
            add(f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora), i, "linear")
        else:
            add(f"{a}.q_proj.weight", (heads * (nope + rope), h), i, "linear")
        add(f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), i, "linear")
        add(f"{a}.kv_a_layernorm.weight", (kv_lora,), i)
        add(f"{a}.kv_b_proj.weight", (heads * (nope + vdim), kv_lora), i, "linear")
        add(f"{a}.o_proj.weight", (h, heads * vdim), i, "linear")
        if is_moe_layer(config, i):
            n_exp = config["n_routed_experts"]
            moe_i = config["moe_intermediate_size"]
            add(f"{p}.mlp.gate.weight", (n_exp, h), i)
            if uses_correction_bias(config):
                add(f"{p}.mlp.gate.e_score_correction_bias", (n_exp,), i, "bias")
            for e in range(n_exp):
                mlp(f"{p}.mlp.experts.{e}", moe_i, i)
            if config.get("n_shared_experts"):
                mlp(f"{p}.mlp.shared_experts", moe_i * config["n_shared_experts"], i)
        else:
            mlp(f"{p}.mlp", config["intermediate_size"], i)
        add(f"{p}.input_layernorm.weight", (h,), i)
        add(f"{p}.post_attention_layernorm.weight", (h,), i)

    add("model.embed_tokens.weight", (v, h), None)
    for i in range(n_layers):
        decoder(i)
    add("model.norm.weight", (h,), None)
    add("lm_head.weight", (v, h), None)
    for j in range(mtp_layers(config) if mtp is None else mtp):
        i = n_layers + j
        p = f"model.layers.{i}"
        # DeepSeek-V3's MTP module: embedding and head stored again, two norms, the projection of
        # [norm(embedding); norm(hidden)] back to the hidden size, and one decoder layer
        add(f"{p}.embed_tokens.weight", (v, h), i)
        add(f"{p}.enorm.weight", (h,), i)
        add(f"{p}.hnorm.weight", (h,), i)
        add(f"{p}.eh_proj.weight", (h, 2 * h), i)
        decoder(i)
        add(f"{p}.shared_head.norm.weight", (h,), i)
        add(f"{p}.shared_head.head.weight", (v, h), i)
    return out


def float32_bytes(tensors: dict[str, tuple[int, ...]] | list[TensorSpec]) -> int:
    """What a float32 copy of these tensors takes, scales left out (they are folded into their weights)."""
    import math

    items = [(t.name, t.shape) for t in tensors] if isinstance(tensors, list) else list(tensors.items())
    return sum(4 * math.prod(shape) for name, shape in items if not name.endswith("_scale_inv"))

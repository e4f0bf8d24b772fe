"""The vllm@v0.3.3 DeepSeek-V2 stack, checked on CPU against HF transformers.

The fixture builds the patched tree (wheel .py files + `git am` of the series).
The stack's pure-PyTorch parts are loaded by file path (v0.3.3's package
__init__ pulls in vllm._C, xformers and ray) and compared with
transformers.models.deepseek_v2 on the same inputs; the whole model runs with
its CUDA-only pieces emulated in torch (section 5). The kernels themselves are
left to a GPU host: `dsadapt check vllm@v0.3.3 --model v2-lite`; see
docs/engines/vllm-v0.3.3.md.
"""

from __future__ import annotations

import ast
import codecs
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dsv2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")

import torch.nn.functional as F  # noqa: E402
from packaging.version import Version  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import DeepseekV2Config as HFDeepseekV2Config  # noqa: E402

# the pinned vLLM 0.3.3 wheel comes from PyPI (once per machine: tests/shared_envs.py)
pytestmark = pytest.mark.network

if Version(transformers.__version__) < Version("5.15"):
    # Older DeepseekV2Attention ignores YaRN's mscale_all_dim in the softmax scale (PR #47435),
    # so it is not DeepSeek's reference there.
    pytest.skip("the HF reference needs transformers >= 5.15", allow_module_level=True)

STACK_DIR = Path(__file__).resolve().parents[2] / "patches" / "vllm" / "v0.3.3"

ROPE = "vllm/model_executor/layers/deepseek_rope.py"
MLA = "vllm/model_executor/layers/deepseek_mla.py"
ROUTING = "vllm/model_executor/layers/fused_moe/deepseek_routing.py"
LAYOUT = "vllm/model_executor/models/deepseek_v2_layout.py"
MODEL = "vllm/model_executor/models/deepseek_v2.py"
STOCK_ROPE = "vllm/model_executor/layers/rotary_embedding.py"
TEMPLATES = "vllm/entrypoints/openai/bundled_templates.py"

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "dsadapt", "GIT_AUTHOR_EMAIL": "dsadapt@localhost",
    "GIT_COMMITTER_NAME": "dsadapt", "GIT_COMMITTER_EMAIL": "dsadapt@localhost",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}

# rope_scaling of DeepSeek-V2-Lite / V2 (factor 40, mscale == mscale_all_dim) and two
# made-up ones where mscale != mscale_all_dim, so the cos/sin ratio is not 1.
ROPE_CASES = {
    "v2-lite": {"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
    "tiny": {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
             "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
    "odd": {"type": "yarn", "factor": 8.0, "mscale": 0.9, "mscale_all_dim": 0.6,
            "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2},
}

# config.json of DeepSeek-V2-Lite(-Chat), as published (vocab and sizes included).
V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                 "AutoModel": "modeling_deepseek.DeepseekV2Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": ROPE_CASES["v2-lite"], "tie_word_embeddings": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------ the patched tree


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                   env={**os.environ, **_GIT_ENV})


def series_patches() -> list[Path]:
    lines = (STACK_DIR / "series").read_text().splitlines()
    return [STACK_DIR / ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def vllm033_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout `dsadapt apply vllm@v0.3.3` makes: the pinned wheel through the pypi source
    (sha256 and pre-image blob ids verified) with the stack applied as one commit per patch.

    The project (lock + stacks) is this repository's; the work dir is a fresh temporary one,
    the artifact cache the shared one (tests/shared_envs.py), so the wheel downloads once.
    """
    from dataclasses import replace

    from shared_envs import pinned_wheel, real_lock, shared_config

    from patcher.formats.pinref import PinRef
    from patcher.stack.apply import apply_stack

    pinned_wheel("vllm@v0.3.3")  # skips with the reason when it cannot be had
    work = tmp_path_factory.mktemp("vllm033")
    cfg = replace(shared_config(), workdir=work)
    res = apply_stack(cfg, real_lock(), PinRef("vllm", "v0.3.3"))
    assert res.source["kind"] == "pypi" and len(res.outcomes) == len(series_patches())
    root = Path(res.checkout)
    _git(root, "tag", "base", "refs/dsadapt/base")
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm033_tree(tmp_path_factory)


def load_file(tree: Path, rel: str) -> ModuleType:
    """Import one file of the tree by path, as a module of its own."""
    name = "_v033_" + rel.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, tree / rel)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def vllm_package(tree: Path) -> Iterator[None]:
    """Make `vllm` importable from the tree without running vllm/__init__.py.

    vllm._C is a stub (the compiled extension is CUDA-only); vllm.utils is replaced by
    the four names vllm/config.py takes from it, because the real module needs psutil.
    """
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    pkg = types.ModuleType("vllm")
    pkg.__path__ = [str(tree / "vllm")]
    ext = types.ModuleType("vllm._C")
    ext.ops = SimpleNamespace()
    utils = types.ModuleType("vllm.utils")
    utils.get_cpu_memory = lambda: 0
    utils.is_hip = lambda: False
    utils.is_neuron = lambda: False
    utils.get_nvcc_cuda_version = lambda: None
    sys.modules.update({"vllm": pkg, "vllm._C": ext, "vllm.utils": utils})
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def touched_files(suffix: str) -> set[str]:
    paths = set()
    for patch in series_patches():
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/") and line.endswith(suffix):
                paths.add(line[len("+++ b/"):])
    return paths


def hf_config(**overrides) -> HFDeepseekV2Config:
    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="greedy",
              rope_scaling=dict(ROPE_CASES["tiny"]), max_position_embeddings=256,
              tie_word_embeddings=False)
    kw.update(overrides)
    cfg = HFDeepseekV2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


# ------------------------------------------------------------------ (d) every patched file


def test_patched_files_compile(tree: Path) -> None:
    files = touched_files(".py")
    assert {ROPE, MLA, ROUTING, LAYOUT, MODEL, TEMPLATES} <= files
    for rel in sorted(files):
        path = tree / rel
        compile(path.read_text(), str(path), "exec")  # SyntaxError fails the test


def test_covered_by_ids_exist() -> None:
    """Every Covered-By trailer of the stack names a test of this module."""
    here = Path(__file__)
    tests = {n.name for n in ast.parse(here.read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    for patch in series_patches():
        ids = [ln.split(":", 1)[1].strip() for ln in patch.read_text().splitlines()
               if ln.startswith("Covered-By:")]
        assert ids, patch.name
        for test_id in ids:
            path, _, name = test_id.partition("::")
            assert path == here.relative_to(here.parents[2]).as_posix() and name in tests, f"{patch.name}: {test_id}"


def test_series_applies_onto_wheel_tree(tree: Path) -> None:
    log = subprocess.run(["git", "log", "--format=%s", "base..HEAD"], cwd=tree, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert len(log) == len(series_patches())


# ------------------------------------------------------------------ 1. config


def test_config_loads_without_remote_code(tree: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE_CONFIG))
    with vllm_package(tree):
        config_mod = importlib.import_module("vllm.transformers_utils.config")
        shipped = importlib.import_module("vllm.transformers_utils.configs.deepseek_v2")

        def no_remote_code(*args, **kwargs):  # what transformers < 4.54 does here
            raise ValueError("Loading this model requires you to execute the configuration "
                             "file in that repo on your local machine.")

        monkeypatch.setattr(config_mod.AutoConfig, "from_pretrained", no_remote_code)
        cfg = config_mod.get_config(str(tmp_path), trust_remote_code=False)
    assert type(cfg) is shipped.DeepseekV2Config
    assert config_mod._CONFIG_REGISTRY["deepseek_v2"] is shipped.DeepseekV2Config
    assert cfg.q_lora_rank is None and cfg.kv_lora_rank == 512
    assert cfg.rope_scaling["mscale_all_dim"] == 0.707
    assert (cfg.first_k_dense_replace, cfg.n_routed_experts, cfg.n_shared_experts) == (1, 64, 2)


def test_model_config_head_size(tree: Path) -> None:
    with vllm_package(tree):
        vconfig = importlib.import_module("vllm.config")
        shipped = importlib.import_module("vllm.transformers_utils.configs.deepseek_v2")
    cfg = shipped.DeepseekV2Config(**{k: v for k, v in V2_LITE_CONFIG.items()
                                      if k not in ("architectures", "auto_map", "model_type")})
    model_config = SimpleNamespace(hf_config=cfg)
    assert vconfig.ModelConfig.get_head_size(model_config) == 256
    assert vconfig.ModelConfig.get_total_num_kv_heads(model_config) == 16
    # Unpatched, v0.3.3 reports hidden_size // heads: too small for the 192-wide MLA heads.
    assert cfg.hidden_size // cfg.num_attention_heads == 128
    assert shipped.mla_padded_head_size(192, 128) == 256
    assert shipped.mla_padded_head_size(128, 128) == 128
    with pytest.raises(ValueError):
        shipped.mla_padded_head_size(576, 512)


# ------------------------------------------------------------------ 2. YaRN (a)


def _hf_cos_sin(rope_scaling: dict, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = hf_config(rope_scaling=dict(rope_scaling), max_position_embeddings=max_pos)
    rope = dsv2.DeepseekV2RotaryEmbedding(cfg)
    freqs_cis = rope(torch.zeros(1), torch.arange(max_pos)[None])[0]
    return freqs_cis.real, freqs_cis.imag


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_yarn_cache_matches_hf(tree: Path, case: str) -> None:
    rs = ROPE_CASES[case]
    max_pos = int(rs["original_max_position_embeddings"] * rs["factor"])
    ours = load_file(tree, ROPE).get_deepseek_rope(64, max_pos, 10000.0, dict(rs))
    cos, sin = ours.cos_sin_cache.chunk(2, dim=-1)
    hf_cos, hf_sin = _hf_cos_sin(rs, max_pos)
    assert cos.shape == hf_cos.shape
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0)


def test_stock_yarn_differs_from_hf(tree: Path) -> None:
    """v0.3.3's own YaRN on a V2-Lite config: wrong magnitude (why patch 2 exists)."""
    rs = ROPE_CASES["v2-lite"]
    with vllm_package(tree):
        stock = load_file(tree, STOCK_ROPE)
    emb = stock.YaRNScalingRotaryEmbedding(64, 64, rs["original_max_position_embeddings"], 10000,
                                           False, rs["factor"], beta_fast=32, beta_slow=1)
    max_pos = int(rs["original_max_position_embeddings"] * rs["factor"])
    cos, sin = emb.cos_sin_cache.float().chunk(2, dim=-1)
    hf_cos, _ = _hf_cos_sin(rs, max_pos)
    magnitude = (cos[1:] ** 2 + sin[1:] ** 2).sqrt()
    assert magnitude.mean().item() == pytest.approx(0.1 * math.log(40) + 1, rel=1e-4)  # 1.369
    assert (cos - hf_cos).abs().max().item() > 0.3


@pytest.mark.parametrize("case", [None, *sorted(ROPE_CASES)])
def test_softmax_scale_matches_hf(tree: Path, case: str | None) -> None:
    rs = dict(ROPE_CASES[case]) if case else None
    cfg = hf_config(rope_scaling=rs)
    hf_scale = dsv2.DeepseekV2Attention(cfg, 0).scaling
    ours = load_file(tree, ROPE).deepseek_softmax_scale(192, rs)
    assert ours == pytest.approx(hf_scale, rel=1e-12)
    if rs:
        assert ours != pytest.approx(192 ** -0.5)  # the mscale_all_dim^2 correction is there


# ------------------------------------------------------------------ 4. MLA (with 2.)


def _mla_ours(tree: Path, att, cfg, h, pos, *, neox: bool = False, padded: int = 256):
    rope_mod, mla = load_file(tree, ROPE), load_file(tree, MLA)
    heads, nope, rot, v_dim = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                               cfg.qk_rope_head_dim, cfg.v_head_dim)
    q = att.q_proj(h) if cfg.q_lora_rank is None else att.q_b_proj(att.q_a_layernorm(att.q_a_proj(h)))
    kv_a, k_pe = att.kv_a_proj_with_mqa(h).split([cfg.kv_lora_rank, rot], dim=-1)
    kv = att.kv_b_proj(att.kv_a_layernorm(kv_a))
    rs = cfg.rope_scaling
    rotary = rope_mod.get_deepseek_rope(rot, cfg.max_position_embeddings, 10000.0, rs,
                                        is_neox_style=neox)
    q, k, v = mla.mla_assemble_qkv(q, kv, k_pe, pos, rotary, heads, nope, rot, v_dim, padded)
    b, s = h.shape[:2]
    q, k, v = (t.view(b, s, heads, padded).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=rope_mod.deepseek_softmax_scale(nope + rot, rs))
    out = mla.mla_unpad_output(out.transpose(1, 2).reshape(b, s, -1), heads, padded, v_dim)
    return att.o_proj(out)


def _mla_case(q_lora_rank):
    torch.manual_seed(0)
    cfg = hf_config(q_lora_rank=q_lora_rank)
    att = dsv2.DeepseekV2Attention(cfg, 0).eval()
    for p in att.parameters():
        torch.nn.init.normal_(p, std=0.2)
    b, s = 2, 24
    h = torch.randn(b, s, cfg.hidden_size)
    pos = torch.arange(s)[None].expand(b, s) + torch.tensor([[0], [150]])
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = att(h, attention_mask=mask,
                     position_embeddings=dsv2.DeepseekV2RotaryEmbedding(cfg)(h, pos))
    return cfg, att, h, pos, ref


@pytest.mark.parametrize("q_lora_rank", [None, 48], ids=["v2-lite-no-q-lora", "v2-q-lora"])
def test_mla_attention_matches_hf(tree: Path, q_lora_rank) -> None:
    cfg, att, h, pos, ref = _mla_case(q_lora_rank)
    with torch.no_grad():
        ours = _mla_ours(tree, att, cfg, h, pos)
        neox = _mla_ours(tree, att, cfg, h, pos, neox=True)
    torch.testing.assert_close(ours, ref, atol=5e-5, rtol=1e-5)
    # Rotating halves (NeoX) instead of interleaved pairs is visibly wrong.
    assert (neox - ref).abs().max().item() > 1e-2


def test_mla_padding_is_exact(tree: Path) -> None:
    cfg, att, h, pos, _ = _mla_case(None)
    with torch.no_grad():
        padded = _mla_ours(tree, att, cfg, h, pos, padded=256)
        unpadded = _mla_ours(tree, att, cfg, h, pos, padded=192)
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        _mla_ours(tree, att, cfg, h, pos, padded=128)


# ------------------------------------------------------------------ 3. routing (b)


def _hf_route(method: str, rsf: float, seed: int):
    torch.manual_seed(seed)
    cfg = hf_config(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                    topk_method=method, routed_scaling_factor=rsf, hidden_size=64)
    gate = dsv2.DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(gate.weight, std=0.5)
    with torch.no_grad():
        logits, weights, ids = gate(torch.randn(256, 64))
    return cfg, logits, weights, ids


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = torch.sort(ids.long(), dim=-1)
    return torch.gather(weights, 1, order), ids


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("rsf", [1.0, 16.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_routing_matches_hf(tree: Path, method: str, rsf: float, seed: int) -> None:
    route = load_file(tree, ROUTING).deepseek_v2_route
    cfg, logits, hf_w, hf_ids = _hf_route(method, rsf, seed)
    w, ids = route(logits, 4, method, cfg.n_group, cfg.topk_group, False, rsf)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    w, ids = _by_expert(w, ids)
    hf_w, hf_ids = _by_expert(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=1e-6)
    if method == "group_limited_greedy":  # every token stays within topk_group groups
        assert all(len(set((row // 4).tolist())) <= 2 for row in ids)
        greedy_ids = _by_expert(*route(logits, 4, "greedy", None, None, False, rsf))[1]
        assert not torch.equal(greedy_ids, ids)  # the group limit changed some choices


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_routing_norm_topk_prob(tree: Path, method: str) -> None:
    """norm_topk_prob: DeepSeek-V2 renormalises and then does not apply routed_scaling_factor.

    HF's DeepseekV2TopkRouter ignores norm_topk_prob (always scales), so the experts must
    match and our weights must equal HF's renormalised ones.
    """
    route = load_file(tree, ROUTING).deepseek_v2_route
    cfg, logits, hf_w, hf_ids = _hf_route(method, 16.0, 3)
    w, ids = route(logits, 4, method, cfg.n_group, cfg.topk_group, True, 16.0)
    w, ids = _by_expert(w, ids)
    hf_w, hf_ids = _by_expert(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w / hf_w.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w.sum(-1), torch.ones(len(w)), atol=1e-6, rtol=0)


def test_routing_rejects_unknown_method(tree: Path) -> None:
    route = load_file(tree, ROUTING).deepseek_v2_route
    with pytest.raises(ValueError):
        route(torch.randn(3, 8), 2, "noaux_tc")
    with pytest.raises(ValueError):
        route(torch.randn(3, 8), 2, "group_limited_greedy", n_group=3, topk_group=1)


@pytest.mark.parametrize("first_k", [0, 1, 2])
def test_moe_layer_selection(tree: Path, first_k: int) -> None:
    is_moe = load_file(tree, LAYOUT).is_moe_layer
    cfg = hf_config(num_hidden_layers=4, first_k_dense_replace=first_k)
    hf_layers = dsv2.DeepseekV2Model(cfg).layers
    hf_moe = [isinstance(layer.mlp, dsv2.DeepseekV2Moe) for layer in hf_layers]
    assert [is_moe(i, 8, first_k, 1) for i in range(4)] == hf_moe
    # moe_layer_freq (HF ignores it; DeepSeek's rule: every freq-th layer after the dense ones)
    assert [is_moe(i, 8, 1, 2) for i in range(6)] == [False, False, True, False, True, False]
    assert not any(is_moe(i, None, 0, 1) for i in range(4))


# ------------------------------------------------------------------ 5. weights (c)


def _tiny_checkpoint(path: Path, **overrides) -> list[str]:
    torch.manual_seed(0)
    cfg = hf_config(**overrides)
    dsv2.DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    names = []
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names += list(f.keys())
    return names


@pytest.mark.parametrize("overrides", [
    {"q_lora_rank": None},
    {"q_lora_rank": 48, "first_k_dense_replace": 2, "num_hidden_layers": 4},
    {"q_lora_rank": None, "tie_word_embeddings": True},
], ids=["v2-lite-shape", "q-lora-two-dense", "tied-head"])
def test_weight_names_map_to_params(tree: Path, tmp_path: Path, overrides: dict) -> None:
    layout = load_file(tree, LAYOUT)
    names = _tiny_checkpoint(tmp_path, **overrides)
    shipped = load_file(tree, "vllm/transformers_utils/configs/deepseek_v2.py")
    cfg = shipped.DeepseekV2Config.from_pretrained(str(tmp_path))
    params = layout.param_names(cfg)
    tied = cfg.tie_word_embeddings
    hit: dict[str, set] = {}
    for name in names:
        target = layout.map_weight_name(name, tied)
        if target is None:
            assert name == "lm_head.weight" and tied
            continue
        assert target.param_name in params, f"{name} -> {target.param_name}"
        hit.setdefault(target.param_name, set()).add((target.shard_id, target.expert_id))
    assert set(hit) == params  # no parameter is left without a tensor
    n_exp = cfg.n_routed_experts
    for pname, keys in hit.items():
        if pname.endswith(".ws"):
            assert keys == {(s, e) for s in (0, 1) for e in range(n_exp)}
        elif pname.endswith(".w2s"):
            assert keys == {(None, e) for e in range(n_exp)}
        elif pname.endswith("gate_up_proj.weight"):
            assert keys == {(0, None), (1, None)}
        else:
            assert keys == {(None, None)}
    assert ("lm_head.weight" in params) is (not tied)
    assert layout.map_weight_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def _self_assignments(source: str) -> set[str]:
    attrs = set()
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                attrs.add(t.attr)
    return attrs


def test_model_uses_layout(tree: Path) -> None:
    """The model's modules carry the names param_names() lists, and load_weights uses it."""
    layout = load_file(tree, LAYOUT)
    source = (tree / MODEL).read_text()
    cfg = hf_config(q_lora_rank=48)
    segments = {seg for name in layout.param_names(cfg) for seg in name.split(".")[:-1]
                if not seg.isdigit()} | {"ws", "w2s"}
    missing = segments - _self_assignments(source)
    assert not missing, f"param_names() names modules the model never assigns: {missing}"
    loader = next(n for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    called = {n.func.id for n in ast.walk(loader)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"map_weight_name", "param_names", "hf_model_weights_iterator"} <= called


def test_model_registered(tree: Path) -> None:
    init = ast.parse((tree / "vllm/model_executor/models/__init__.py").read_text())
    models = next(n.value for n in init.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "_MODELS" for t in n.targets))
    registry = ast.literal_eval(models)
    assert registry["DeepseekV2ForCausalLM"] == ("deepseek_v2", "DeepseekV2ForCausalLM")
    classes = {n.name for n in ast.parse((tree / MODEL).read_text()).body
               if isinstance(n, ast.ClassDef)}
    assert "DeepseekV2ForCausalLM" in classes


# ------------------------------------------------------------------ 5. the whole model, emulated
#
# The real patched deepseek_v2.py, PagedAttention (prompt and decode paths), linear,
# RMSNorm and embedding classes run on CPU. Only what needs CUDA is replaced by torch
# code computing what the kernel computes: vllm._C's rms_norm / fused_add_rms_norm /
# silu_and_mul / reshape_and_cache / paged_attention_v1 / v2, xformers'
# memory_efficient_attention_forward (block-diagonal causal), the Triton fused_experts
# kernel, the weights iterator, and tensor-parallel state (one rank). The kernels
# themselves, CUDA graphs and TP > 1 are not covered here.


def _module(name: str, **attrs) -> ModuleType:
    module = ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _package(tree: Path, dotted: str) -> ModuleType:
    """A package whose __init__.py is not run, so only the submodules asked for load."""
    return _module(dotted, __path__=[str(tree / dotted.replace(".", "/"))])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rms_norm(out, x, weight, eps) -> None:
    out.copy_(_rms(x, weight, eps))


def _fused_add_rms_norm(x, residual, weight, eps) -> None:
    residual.add_(x)
    x.copy_(_rms(residual, weight, eps))


def _silu_and_mul(out, x) -> None:
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype) -> None:
    """key_cache [blocks, heads, head/x, block, x], value_cache [blocks, heads, head, block]."""
    block_size, x = key_cache.shape[3], key_cache.shape[4]
    for token, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[block, :, :, offset, :] = key[token].reshape(key.shape[1], -1, x)
        value_cache[block, :, :, offset] = value[token]


def _paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                        context_lens, block_size, max_context_len, alibi_slopes,
                        kv_cache_dtype) -> None:
    for seq, ctx in enumerate(context_lens.tolist()):
        slots = torch.arange(ctx)
        blocks = block_tables[seq, slots // block_size]
        offsets = slots % block_size
        keys = key_cache[blocks, :, :, offsets, :].flatten(-2)  # [ctx, heads, head]
        values = value_cache[blocks, :, :, offsets]  # [ctx, heads, head]
        weights = torch.einsum("hd,chd->hc", query[seq].float(), keys.float()) * scale
        out[seq] = torch.einsum("hc,chd->hd", weights.softmax(-1), values.float()).to(out.dtype)


def _paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
                        num_kv_heads, scale, block_tables, context_lens, block_size,
                        max_context_len, alibi_slopes, kv_cache_dtype) -> None:
    _paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                        context_lens, block_size, max_context_len, alibi_slopes, kv_cache_dtype)


def reference_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                            override_config=None) -> torch.Tensor:
    """What v0.3.3's Triton expert kernel computes: sum_k w_k * down(silu(gate) * up)."""
    out = torch.zeros_like(hidden_states)
    for k in range(topk_ids.shape[1]):
        for expert in topk_ids[:, k].unique().tolist():
            rows = (topk_ids[:, k] == expert).nonzero().flatten()
            gate_up = hidden_states[rows] @ w1[expert].T
            d = gate_up.shape[-1] // 2
            y = (F.silu(gate_up[:, :d]) * gate_up[:, d:]) @ w2[expert].T
            out[rows] += topk_weights[rows, k, None].to(y.dtype) * y
    if inplace:
        return hidden_states.copy_(out)
    return out


class _BlockDiagonalCausalMask:

    def __init__(self, seqlens: list[int]) -> None:
        self.seqlens = seqlens

    @classmethod
    def from_seqlens(cls, seqlens) -> _BlockDiagonalCausalMask:
        return cls(list(seqlens))


def _mea_forward(query, key, value, attn_bias, p=0.0, scale=None, op=None) -> torch.Tensor:
    """xformers' memory_efficient_attention_forward for a block-diagonal causal mask."""
    outs, start = [], 0
    for n in attn_bias.seqlens:
        q, k, v = (t[:, start:start + n].transpose(1, 2) for t in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    .transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1)


def _safetensors_iterator(path, cache_dir=None, load_format="auto", revision=None,
                          fall_back_to_pt=True):
    from safetensors.torch import load_file

    for shard in sorted(Path(path).glob("*.safetensors")):
        yield from load_file(str(shard)).items()


def _default_weight_loader(param, loaded_weight) -> None:
    assert param.size() == loaded_weight.size()
    param.data.copy_(loaded_weight)


@contextmanager
def emulated_vllm033(tree: Path) -> Iterator[None]:
    """Import the tree's model code with the CUDA-only pieces replaced (see above)."""
    ours = ("vllm", "xformers")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ours}
    for k in saved:
        del sys.modules[k]
    ops = SimpleNamespace(rms_norm=_rms_norm, fused_add_rms_norm=_fused_add_rms_norm,
                          silu_and_mul=_silu_and_mul, paged_attention_v1=_paged_attention_v1,
                          paged_attention_v2=_paged_attention_v2)
    xops = _module("xformers.ops", memory_efficient_attention_forward=_mea_forward,
                   fmha=SimpleNamespace(MemoryEfficientAttentionFlashAttentionOp=[None]))
    me = "vllm.model_executor"
    fused_moe = _package(tree, f"{me}.layers.fused_moe")
    fused_moe.fused_experts = reference_fused_experts
    stubs = [
        _package(tree, "vllm"),
        _module("vllm._C", ops=ops,
                cache_ops=SimpleNamespace(reshape_and_cache=_reshape_and_cache)),
        _module("vllm.utils", is_hip=lambda: False, is_neuron=lambda: False,
                get_cpu_memory=lambda: 0, get_nvcc_cuda_version=lambda: None),
        _package(tree, me), _package(tree, f"{me}.layers"), _package(tree, f"{me}.models"),
        _package(tree, f"{me}.parallel_utils"), fused_moe,
        _module(f"{me}.parallel_utils.parallel_state",
                get_tensor_model_parallel_rank=lambda: 0,
                get_tensor_model_parallel_world_size=lambda: 1),
        _module(f"{me}.parallel_utils.communication_op",
                tensor_model_parallel_all_reduce=lambda x: x,
                tensor_model_parallel_all_gather=lambda x, dim=-1: x),
        _module(f"{me}.layers.quantization", QuantizationConfig=object),
        _module(f"{me}.layers.triton_kernel.prefix_prefill", context_attention_fwd=None),
        _module(f"{me}.layers.sampler", Sampler=lambda vocab_size: None),
        _module(f"{me}.sampling_metadata", SamplingMetadata=object),
        _module(f"{me}.weight_utils", hf_model_weights_iterator=_safetensors_iterator,
                default_weight_loader=_default_weight_loader),
        _module("vllm.sequence", SamplerOutput=object),
        _module("xformers", ops=xops), xops, _module("xformers.ops.fmha"),
        _module("xformers.ops.fmha.attn_bias", BlockDiagonalCausalMask=_BlockDiagonalCausalMask,
                LowerTriangularMaskWithTensorBias=object),
    ]
    sys.modules.update({m.__name__: m for m in stubs})
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in ours]:
            del sys.modules[k]
        sys.modules.update(saved)


BLOCK_SIZE = 16


def _emulated_logits(tree: Path, ckpt: Path, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ids[:, :prompt_len] into a paged KV cache, then decode the rest one token at a
    time (teacher-forced), as v0.3.3's worker drives the model. Returns [batch, seq, vocab]."""
    with emulated_vllm033(tree):
        shipped = importlib.import_module("vllm.transformers_utils.configs.deepseek_v2")
        model_mod = importlib.import_module("vllm.model_executor.models.deepseek_v2")
        InputMetadata = importlib.import_module("vllm.model_executor.input_metadata").InputMetadata
        cfg = shipped.DeepseekV2Config.from_pretrained(str(ckpt))
        model = model_mod.DeepseekV2ForCausalLM(cfg).eval()
        model.load_weights(str(ckpt))
        head = model.model.embed_tokens if cfg.tie_word_embeddings else model.lm_head
        batch, seq = ids.shape
        heads = cfg.num_attention_heads
        head_size = shipped.deepseek_v2_head_size(cfg)
        x = 16 // torch.tensor([], dtype=torch.float32).element_size()
        blocks_per_seq = -(-seq // BLOCK_SIZE)
        kv_caches = [(torch.zeros(batch * blocks_per_seq, heads, head_size // x, BLOCK_SIZE, x),
                      torch.zeros(batch * blocks_per_seq, heads, head_size, BLOCK_SIZE))
                     for _ in range(cfg.num_hidden_layers)]
        block_tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)

        def slots(positions: torch.Tensor) -> torch.Tensor:
            return (block_tables.gather(1, positions // BLOCK_SIZE) * BLOCK_SIZE
                    + positions % BLOCK_SIZE)

        def step(is_prompt: bool, positions: torch.Tensor) -> torch.Tensor:
            meta = InputMetadata(
                is_prompt=is_prompt, slot_mapping=slots(positions),
                prompt_lens=None, max_seq_len=None, start_loc=None,
                max_context_len=int(positions.max()) + 1,
                context_lens=positions[:, -1] + 1,
                block_tables=torch.empty(0) if is_prompt else block_tables,
                use_cuda_graph=False, kv_cache_dtype="auto")
            tokens = ids.gather(1, positions)
            with torch.no_grad():
                return model(tokens, positions, kv_caches, meta) @ head.weight.T

        logits = [step(True, torch.arange(prompt_len)[None].expand(batch, prompt_len))]
        for pos in range(prompt_len, seq):
            logits.append(step(False, torch.full((batch, 1), pos)))
        return torch.cat(logits, dim=1)


@pytest.mark.parametrize("overrides", [
    {"q_lora_rank": None, "topk_method": "greedy"},
    {"q_lora_rank": 48, "topk_method": "group_limited_greedy", "routed_scaling_factor": 2.5},
    {"q_lora_rank": None, "topk_method": "group_limited_greedy", "norm_topk_prob": False,
     "first_k_dense_replace": 2, "num_hidden_layers": 4, "tie_word_embeddings": True},
], ids=["v2-lite-shape", "v2-shape-grouped", "two-dense-tied"])
def test_model_forward_matches_hf_emulated(tree: Path, tmp_path: Path, overrides: dict) -> None:
    torch.manual_seed(0)
    cfg = hf_config(vocab_size=128, num_experts_per_tok=3, n_shared_experts=2, **overrides)
    hf = dsv2.DeepseekV2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = _emulated_logits(tree, tmp_path, ids, prompt_len=17)  # decode crosses a block edge
    assert ref.std().item() > 0.5  # not a near-uniform toy: errors would show
    torch.testing.assert_close(ours[:, :17], ref[:, :17], atol=1e-4, rtol=1e-4)  # prefill
    torch.testing.assert_close(ours[:, 17:], ref[:, 17:], atol=1e-4, rtol=1e-4)  # decode


# ------------------------------------------------------------------ 6. chat template


BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, BOS: 1, EOS: 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   unk_token="[UNK]")


def test_chat_template_renders(tree: Path) -> None:
    path = load_file(tree, TEMPLATES).bundled_chat_template("deepseek_v2")
    tokenizer = _tiny_tokenizer()
    tokenizer.chat_template = path.read_text()
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == (f"{BOS}Be brief.\n\nUser: Hi\n\nAssistant: Hello.{EOS}"
                    "User: 2+2?\n\nAssistant:")
    text = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert text == f"{BOS}User: Hi\n\n"


def test_chat_template_bundled_name(tree: Path) -> None:
    """serving_chat's _load_chat_template resolves `--chat-template deepseek_v2`."""
    templates = load_file(tree, TEMPLATES)
    assert templates.bundled_chat_template("no_such_template") is None
    source = (tree / "vllm/entrypoints/openai/serving_chat.py").read_text()
    func = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == "_load_chat_template")
    namespace = {"bundled_chat_template": templates.bundled_chat_template, "codecs": codecs,
                 "logger": SimpleNamespace(info=lambda *a, **k: None)}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "serving_chat", "exec"), namespace)
    serving = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))
    namespace["_load_chat_template"](serving, "deepseek_v2")
    expected = (tree / "vllm/entrypoints/openai/templates/deepseek_v2.jinja").read_text()
    assert serving.tokenizer.chat_template == expected
    namespace["_load_chat_template"](serving, "{{ bos_token }}")  # inline templates still work
    assert serving.tokenizer.chat_template == "{{ bos_token }}"

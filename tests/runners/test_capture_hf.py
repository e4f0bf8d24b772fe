"""`dsadapt bisect`'s method against bugs planted in the HF model itself (tiny V3, in-process).

The reference's own capture table (patcher.rules.modules.REFERENCE_TABLE) runs on a clean float32
model and on a copy with one known bug playing the engine; the comparison must name the layer
and module where the bug acts. The low-precision cases are the issue's measurement: a wrong
kv_a_layernorm eps is invisible at the logits in bfloat16 but stands out at its module
against the reference's own bfloat16 rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from equivalence_helpers import load_hf_reference, tiny_v3  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
# the reference runner imports its capture helper from its own directory, as it does when run
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "patcher" / "runners"))

from patcher.rules.modules import REFERENCE_TABLE, compare_captures  # noqa: E402
from patcher.rules.prompts import build_prompt_set  # noqa: E402


def hf_capture(model, spec, sequences):
    """The reference runner's own capture (patcher/runners/hf_reference.py, imported in-process)."""
    return load_hf_reference().capture_run(model, spec, sequences)


@pytest.fixture(scope="module")
def env(tiny_v3):
    hfr = load_hf_reference()
    config = json.loads((tiny_v3 / "config.json").read_text())
    spec = REFERENCE_TABLE.spec(config, "float32")
    seqs = {p.id: list(p.token_ids) for p in build_prompt_set(tiny_v3, 2) if p.id in ("short", "medium", "long")}
    ref = hf_capture(hfr.load_model(tiny_v3), spec, seqs)
    return {"model": tiny_v3, "hfr": hfr, "config": config, "spec": spec, "seqs": seqs, "ref": ref, "lp": {}}


def bisect(env, dtype="float32", overrides=None, patch=None):
    m = env["hfr"].load_model(env["model"], dtype=dtype, config_overrides=overrides)
    if patch:
        patch(m)
    eng = hf_capture(m, env["spec"], env["seqs"])
    lp = None
    if dtype != "float32":
        if dtype not in env["lp"]:
            env["lp"][dtype] = hf_capture(env["hfr"].load_model(env["model"], dtype=dtype), env["spec"], env["seqs"])
        lp = env["lp"][dtype]
    return compare_captures(eng, env["ref"], env["config"], dtype, engine_name="planted", reference_lp=lp)


def first(res):
    assert res.first is not None, res.explanation
    return res.first.layer, res.first.point


def test_the_clean_model_matches_itself(env):
    res = bisect(env)
    assert res.passed and all(p.error == 0.0 for p in res.points if p.error is not None)
    names = {p.point for p in res.points}
    assert {"attn.q_rope", "attn.k_rope", "attn.kv_b", "attn.core", "router.experts", "routed", "shared"} <= names


def _each_layer(attr, fn):
    def patch(m):
        for layer in m.model.layers:
            obj = layer
            for part in attr.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if obj is not None:
                fn(obj)
    return patch


def test_kv_a_layernorm_eps(env):
    res = bisect(env, patch=_each_layer("self_attn.kv_a_layernorm", lambda n: setattr(n, "variance_epsilon", 1e-2)))
    assert first(res) == (0, "attn.kv_a_norm")
    assert any("kv_a_layernorm" in ln for ln in res.explanation)


def test_non_interleaved_rope_is_named_at_layer_0_rope(env):
    res = bisect(env, overrides={"rope_interleave": False})
    assert first(res) == (0, "attn.q_rope") and res.first.family == "attention"
    assert res.first.worst["position"] > 0  # RoPE is the identity at position 0


def test_softmax_scale_is_named_at_layer_0_attention_core(env):
    res = bisect(env, patch=_each_layer("self_attn", lambda a: setattr(a, "scaling", a.scaling * 1.2)))
    assert first(res) == (0, "attn.core")
    assert any("its inputs in this layer match" in ln and "q_rope" in ln for ln in res.explanation)


def test_routed_scaling_factor_is_named_at_the_first_moe_layers_expert_weights(env):
    res = bisect(env, patch=_each_layer("mlp.gate", lambda g: setattr(g, "routed_scaling_factor", 1.0)))
    assert first(res) == (1, "router.weights")


def test_softmax_scoring_is_named_at_the_first_moe_layers_expert_selection(env):
    def softmax_router(gate):
        orig = gate.forward

        def forward(hidden, _orig=orig):
            real = torch.Tensor.sigmoid
            torch.Tensor.sigmoid = lambda t: t.softmax(dim=-1)
            try:
                return _orig(hidden)
            finally:
                torch.Tensor.sigmoid = real
        gate.forward = forward

    res = bisect(env, patch=_each_layer("mlp.gate", softmax_router))
    assert first(res) == (1, "router.experts")
    assert res.first.value < 0.9


def test_shared_experts_weight_mapping_is_named_at_the_shared_experts(env):
    def swap(mlp):
        g, u = mlp.gate_proj.weight.data.clone(), mlp.up_proj.weight.data.clone()
        mlp.gate_proj.weight.data.copy_(u)
        mlp.up_proj.weight.data.copy_(g)

    res = bisect(env, patch=_each_layer("mlp.shared_experts", swap))
    assert first(res) == (1, "shared") and res.first.family == "moe"


def test_kv_a_layernorm_eps_in_bfloat16_is_above_the_references_own_noise(env):
    """The issue's case: at the logits this bug hides in bf16 noise; at its module it does not."""
    clean = bisect(env, "bfloat16")
    assert clean.passed, clean.reasons
    res = bisect(env, "bfloat16", patch=_each_layer("self_attn.kv_a_layernorm",
                                                    lambda n: setattr(n, "variance_epsilon", 1e-2)))
    assert first(res) == (0, "attn.kv_a_norm")
    assert res.first.error > 2.5 * res.first.noise
    print(f"bf16 kv_a_layernorm eps 1e-2: layer 0 error {res.first.error:.4g}, reference's own "
          f"{res.first.noise:.4g} ({res.first.error / res.first.noise:.2f}x)")

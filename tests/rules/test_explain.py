"""explain() against bugs planted in the HF model itself (tiny V3, HF only, in-process).

Each case loads the tiny model with one known bug, runs the reference code on it as
if it were an engine, compares with the clean reference and checks the layer family
explain() names. This is the empirical check of the position-0 principle.
"""

from __future__ import annotations

import json

import pytest
from equivalence_helpers import load_hf_reference, tiny_v3  # noqa: F401 (fixture)

from patcher.rules.logits import SCHEMA, LogitReport, compare, explain
from patcher.rules.prompts import build_prompt_set, prompts_to_json, rope_original_max

MAX_TOKENS = 2


@pytest.fixture(scope="module")
def env(tiny_v3):
    model = tiny_v3
    hfr = load_hf_reference()
    config = json.loads((model / "config.json").read_text())
    docs = prompts_to_json(build_prompt_set(model, max_tokens=MAX_TOKENS))["prompts"]
    docs = [d for d in docs if d["id"] in ("short", "long") or d["batch"]]

    def report(m, batch_mode="individual"):
        res, _ = hfr.run(m, docs, 20, MAX_TOKENS, batch_mode)
        return LogitReport.from_json({"schema": SCHEMA, "runner": "planted", "engine": "transformers",
                                      "engine_version": "x", "dtype": "float32", "top_k": 20,
                                      "max_tokens": MAX_TOKENS, "prompts": res})

    ref = report(hfr.load_model(model))
    return {"model": model, "hfr": hfr, "config": config, "report": report, "ref": ref}


def planted(env, overrides=None, patch=None, batch_mode="individual"):
    m = env["hfr"].load_model(env["model"], config_overrides=overrides)
    if patch:
        patch(m)
    c = compare(env["ref"], env["report"](m, batch_mode), top_k=5)
    return c, "\n".join(explain(c, env["config"]))


def test_softmax_instead_of_sigmoid_routing_points_to_position_wise_layers(env):
    import torch

    def softmax_router(m):
        for layer in m.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "e_score_correction_bias"):
                continue
            orig_forward = gate.forward

            def forward(hidden, _orig=orig_forward, _gate=gate):
                # the router's scores: softmax over experts where HF uses sigmoid
                real_sigmoid = torch.Tensor.sigmoid
                torch.Tensor.sigmoid = lambda t: t.softmax(dim=-1)
                try:
                    return _orig(hidden)
                finally:
                    torch.Tensor.sigmoid = real_sigmoid

            gate.forward = forward

    c, text = planted(env, patch=softmax_router)
    assert not c.passed
    assert all(r.first_divergence == 0 for r in c.rows)
    assert "query position 0" in text and "MoE routing" in text


def test_dropped_routed_scaling_factor_points_to_position_wise_layers(env):
    c, text = planted(env, overrides={"routed_scaling_factor": 1.0})
    assert not c.passed and "query position 0" in text and "MoE routing" in text


def test_non_interleaved_rope_points_to_attention(env):
    c, text = planted(env, overrides={"rope_interleave": False})
    assert not c.passed
    assert all(r.deltas[0] < c.tolerance for r in c.rows)  # exact at query position 0
    assert "exact at query position 0 but diverging later: attention" in text


def test_wrong_mscale_points_to_attention(env):
    rp = dict(env["hfr"].load_model(env["model"]).config.rope_parameters)
    c, text = planted(env, overrides={"rope_parameters": {**rp, "mscale_all_dim": 0.0}})
    assert not c.passed and "diverging later: attention" in text


def test_yarn_bug_beyond_original_context_points_to_yarn(env):
    import torch

    orig = rope_original_max(env["config"])

    def far_positions_unscaled(m):
        rot = m.model.rotary_emb
        base = rot.forward

        def forward(x, position_ids):
            cos, sin = base(x, position_ids)
            far = (position_ids >= orig)[..., None]
            return torch.where(far, cos * 1.05, cos), torch.where(far, sin * 1.05, sin)

        rot.forward = forward

    c, text = planted(env, patch=far_positions_unscaled)
    long_row = c.row("long")
    assert not long_row.passed and all(r.passed for r in c.rows if r.id != "long")
    assert long_row.first_divergence >= orig
    assert "YaRN scaling" in text


def test_padding_bug_points_to_batching(env):
    hfr = env["hfr"]

    def pads_attended(m):
        import torch

        def padded_rows(model, seqs, pad_id=0):  # left padding without an attention mask
            width = max(len(s) for s in seqs)
            ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs])
            pos = torch.tensor([[0] * (width - len(s)) + list(range(len(s))) for s in seqs])
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=pos).logits
            return [hfr._log_softmax(logits[b, width - len(s):]) for b, s in enumerate(seqs)]

        hfr.padded_rows = padded_rows

    real = hfr.padded_rows
    try:
        c, text = planted(env, patch=pads_attended, batch_mode="padded")
    finally:
        hfr.padded_rows = real
    assert not c.passed
    assert all(r.passed for r in c.rows if r.batch is None)
    assert "batching" in text


def test_correct_padded_batch_matches_individual(env):
    c, text = planted(env, batch_mode="padded")
    assert c.passed, c.reasons
    assert "equivalent" in text

"""The structure of fabricated weights (patcher.checkpoints.structure) and `dsadapt model inspect`.

The construction is checked where it is pure (chunking, the plan, which rows stay empty); what it
does to the activations is checked through the product: `dsadapt model inspect` on every built-in
model must meet every target it states (docs/models.md, "Structure"), in every dtype the gate
runs the model in.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from checkpoint_support import small_v3_config, tiny_model
from conftest import REPO_ROOT

from patcher.checkpoints import structure as st
from patcher.checkpoints import tiny

torch = pytest.importorskip("torch")


def _shapes(config):
    from patcher.checkpoints.layout import expected_tensors

    return {t.name: t.shape for t in expected_tensors(config) if not t.name.endswith("_scale_inv")}


@pytest.mark.parametrize("config", [tiny.deepseek_config("v3"), tiny.deepseek_config("v2-lite"), small_v3_config()],
                         ids=["tiny-v3", "tiny-v2-lite", "small-v3-fp8"])
def test_a_tensor_is_the_same_however_it_is_cut(config):
    """Workers write chunks of rows: every chunking gives the same values (rows drawn per 128-row block)."""
    plan = st.plan(config, 3)
    shapes = _shapes(config)
    names = [n for n in shapes if any(k in n for k in ("embed_tokens", "lm_head", "q_b_proj", "q_proj",
                                                       "kv_b_proj", "kv_a_proj", "layers.1.mlp.gate.weight",
                                                       "layers.0.mlp.down_proj", "o_proj", "norm"))][:14]
    for name in names:
        shape = shapes[name]
        whole = st.tensor_rows(plan, name, shape)
        cuts = [0, 1, 77, 128, 300, shape[0]]
        parts = [st.tensor_rows(plan, name, shape, a, b) for a, b in zip(cuts, cuts[1:]) if a < b <= shape[0]]
        if sum(p.shape[0] for p in parts) == shape[0]:
            assert torch.equal(torch.cat(parts), whole), name


def test_the_plan_is_a_pure_function_of_config_and_seed():
    c = tiny.deepseek_config("v3")
    assert st.plan(c, 0) == st.plan(c, 0)
    assert st.plan(c, 0).outliers != st.plan(c, 1).outliers or st.plan(c, 0).common != st.plan(c, 1).common


def test_expert_sets_fit_group_limited_routing():
    for config in (tiny.deepseek_config("v3"), tiny.deepseek_config("v2"), small_v3_config()):
        p = st.plan(config, 0)
        per_group = p.n_experts // p.n_group
        for layer, sets in p.expert_sets.items():
            for s in sets:
                assert len(set(s)) == p.top_k
                assert len({e // per_group for e in s}) == p.topk_group, (layer, s)


def test_structural_channels_are_written_by_nobody_but_their_writer():
    """No o_proj or down_proj writes the structural channels, except the first dense MLP's down
    projection, which writes the outlier channels from its super neurons only."""
    config = small_v3_config()
    p = st.plan(config, 0)
    shapes = _shapes(config)
    assert len({c // 512 for c in p.outliers}) == len(p.outliers)  # each outlier in its own 512-channel group
    for name, shape in shapes.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")) and ".layers.1" in name:
            w = st.tensor_rows(p, name, shape)
            assert float(w[list(p.reserved)].abs().max()) == 0.0, name
    down = st.tensor_rows(p, f"model.layers.{p.first_dense}.mlp.down_proj.weight",
                          shapes[f"model.layers.{p.first_dense}.mlp.down_proj.weight"])
    for o in p.outliers:
        assert set(down[o].nonzero().flatten().tolist()) <= set(p.super_neurons)
    others = [c for c in p.reserved if c not in p.outliers]
    assert float(down[others].abs().max()) == 0.0


def test_block_magnitudes_are_heavy_tailed_but_keep_the_rms():
    config = small_v3_config()
    p = st.plan(config, 0)
    f = torch.cat([st._block_factors(p, f"w{i}", b, 4096) for i in range(20) for b in range(8)])
    assert abs(float(f.square().mean()) - 1.0) < 0.15
    assert float(f.quantile(0.99) / f.median()) > 3.0


# ---------------------------------------------------------------- through the product


def _dsadapt(*args, env=None, cwd=None):
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "patcher.cli.main", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=1800)


@pytest.fixture(scope="module")
def inspected(module_tmp):
    """`dsadapt model inspect --json` of every built-in model (bfloat16 and float16, as the gate runs them)."""
    root = module_tmp("inspect")
    env = {"DSADAPT_WORKDIR": str(root / "work"), "DSADAPT_CACHE": str(root / "work" / "cache")}
    out = {}
    for variant in tiny.VARIANTS:
        model = tiny_model(root / variant, variant)
        r = _dsadapt("--project", str(REPO_ROOT), "model", "inspect", str(model), "--device", "cpu", "--json", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        out[variant] = json.loads(r.stdout)
    return out


@pytest.mark.parametrize("variant", tiny.VARIANTS)
def test_every_built_in_model_has_the_structure_it_states(inspected, variant):
    doc = inspected[variant]
    assert doc["schema"] == "dsadapt.model-structure/1" and doc["dtypes"] == ["bfloat16", "float16"]
    props = {p["property"]: p for p in doc["properties"]}
    assert set(props) == {t[0] for t in st.PROPERTY_TARGETS}
    failing = {k: (p["value"], p["target"]) for k, p in props.items() if not p["ok"]}
    assert not failing, failing
    # the expert choice of both low-precision runs, at every MoE layer
    assert set(doc["routing"]["agreement"]) == {"bfloat16", "float16"}
    assert all(len(per) == 3 for per in doc["routing"]["agreement"].values())
    # outlier channels: the same few channels stay the largest from the first layer on
    tops = [set(r["top_channels"][:2]) for r in doc["residual"]]
    assert all(t == tops[0] for t in tops)


def test_peaked_but_not_deterministic_logits(inspected):
    for variant, doc in inspected.items():
        lg = doc["logits"]
        assert 0.45 < lg["top1"] < 0.85, (variant, lg)
        assert lg["entropy"] < 0.55 * math.log(lg["vocab"]), (variant, lg)
        assert min(lg["agreement"].values()) > 0.95, (variant, lg)


def test_inspect_refuses_bad_input_and_writes_nothing(tmp_path):
    (tmp_path / "not-a-checkpoint").mkdir()
    env = {"DSADAPT_WORKDIR": str(tmp_path / "work")}
    r = _dsadapt("--project", str(REPO_ROOT), "model", "inspect", str(tmp_path / "not-a-checkpoint"), env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    model = tiny_model(tmp_path / "v3")
    r = _dsadapt("--project", str(REPO_ROOT), "model", "inspect", str(model), "--dtype", "fp8", env=env)
    assert r.returncode == 2 and "block-FP8" in r.stderr, r.stderr
    assert not (tmp_path / "work").exists()


def test_judge_structure_flags_what_is_below_its_target():
    doc = {"residual": [{"layer": 0, "channel_ratio": 1.5}, {"layer": 1, "channel_ratio": 1.7}],
           "sinks": [{"layer": 0, "mean": 0.05, "heads_over": 0.0}],
           "routing": {"agreement": {"bfloat16": {"1": 0.97}, "fp8": {"3": 0.03}}},
           "logits": {"top1": 0.11}, "weights": {"p99_over_median": 1.1},
           "gemm_inputs": [{"layer": 1, "input_norm": 12.0}]}
    props = {p["property"]: p for p in st.judge_structure(doc, fp8=True)}
    assert all(p["ok"] is False for p in props.values()), props
    assert props["confident routing"]["value"] == pytest.approx(0.03)

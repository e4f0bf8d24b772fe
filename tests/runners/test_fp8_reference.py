"""The HF reference on block-FP8 checkpoints: dequantized exactly, its FP8 yardstick, planted bugs.

The reference runner (patcher/runners/hf_reference.py, imported in-process) loads a DeepSeek-V3
checkpoint's FP8 weights into float32 and multiplies each by its weight_scale_inv block grid in
place. It must compute exactly what a float32 checkpoint of the dequantized weights computes;
its ``fp8`` mode (HF's own FP8 arithmetic: e4m3 activations per token x 128 channels at every
FP8 GEMM) is the yardstick an FP8 engine is judged by; block-scale bugs planted in its
dequantization must fail the per-module rule with a wide margin. On mini checkpoints in V3's
released layout (checkpoint_support), whose FP8 grids have partial blocks like V3's 576-row
kv_a_proj_with_mqa.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint_support import make_mini
from equivalence_helpers import load_hf_reference

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hfr():
    return load_hf_reference()


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8ref") / "v3"
    make_mini(out, "deepseek-v3", layers=2, mtp=1)   # with its MTP module: the reference skips it
    return out


@pytest.fixture(scope="module")
def dequantized(fp8, tmp_path_factory) -> Path:
    """The same checkpoint with every FP8 weight dequantized to float32 by blockfp8.dequantize and
    no quantization_config: a plain checkpoint transformers loads by itself."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from patcher.checkpoints import blockfp8

    out = tmp_path_factory.mktemp("deq") / "v3"
    out.mkdir()
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, shard in index.items():
        if name.endswith("_scale_inv"):
            continue
        with safe_open(str(fp8 / shard), "pt") as f:
            t = f.get_tensor(name)
            if t.dtype == torch.float8_e4m3fn:
                with safe_open(str(fp8 / index[name + "_scale_inv"]), "pt") as g:
                    t = blockfp8.dequantize(t, g.get_tensor(name + "_scale_inv"))
        tensors[name] = t.to(torch.float32).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((fp8 / f).read_bytes())
    return out


IDS = [0, 17, 250, 901, 33, 1450, 7, 88, 1201, 64, 5, 300]


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([IDS], device=model.device)).logits[0].float()


def test_fp8_reference_is_exactly_the_dequantized_checkpoint(hfr, fp8, dequantized):
    a = hfr.load_model(str(fp8))
    b = hfr.load_model(str(dequantized))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert torch.equal(_logits(a), _logits(b))
    assert a.dsadapt_fp8["dequantized_tensors"] == sum(
        1 for n in json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
        if n.endswith("_scale_inv") and not n.startswith("model.layers.2."))
    assert all(p.dtype == torch.float32 for p in a.parameters())


def test_transformers_cannot_dequantize_a_partial_block_grid():
    """Why the reference dequantizes by itself: transformers 5.24 derives the block from rows //
    grid rows (its FP8 path also needs a GPU or accelerate); DeepSeek-V3's kv_a_proj_with_mqa is
    576 rows in 5 row blocks."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q = torch.zeros(576, 7168, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        Fp8Dequantize(None)._dequantize_one(q, torch.ones(5, 56), torch.float32)


def test_fp8_yardstick_is_bfloat16_with_e4m3_activations(hfr, fp8):
    ref = _logits(hfr.load_model(str(fp8)))
    bf16 = hfr.load_model(str(fp8), dtype="bfloat16")
    yard = hfr.load_model(str(fp8), dtype="fp8")
    assert all(p.dtype == torch.bfloat16 for p in yard.parameters())
    e_bf16 = float((_logits(bf16) - ref).abs().mean())
    e_fp8 = float((_logits(yard) - ref).abs().mean())
    assert e_fp8 > 2 * e_bf16 > 0  # e4m3 activations: 3 mantissa bits against bfloat16's 8


def test_fp8_dtype_needs_an_fp8_checkpoint(hfr, dequantized):
    with pytest.raises(ValueError, match="needs a block-FP8 checkpoint"):
        hfr.load_model(str(dequantized), dtype="fp8")


def test_planted_block_scale_bugs_fail_with_a_wide_margin(hfr, fp8):
    """Each bug, run in FP8 arithmetic like an engine, leaves the reference at layer 0's attention
    by many times the yardstick's own error; the correct FP8 arithmetic is within its limits."""
    from patcher.rules.modules import LOW_PRECISION_POINT_RULES, REFERENCE_TABLE, compare_captures
    from patcher.rules.prompts import build_prompt_set

    config = json.loads((fp8 / "config.json").read_text())
    spec = REFERENCE_TABLE.spec(config, "float32")
    seqs = {p.id: list(p.token_ids) for p in build_prompt_set(fp8, 2)[:3]}
    ref = hfr.capture_run(hfr.load_model(str(fp8)), spec, seqs)
    yard = hfr.capture_run(hfr.load_model(str(fp8), dtype="fp8"), spec, seqs)
    clean = compare_captures(yard, ref, config, "fp8", reference_lp=yard)
    assert clean.passed and clean.first is None
    factor = LOW_PRECISION_POINT_RULES["fp8"].factor
    for bug in ("transposed", "inverse"):
        cap = hfr.capture_run(hfr.load_model(str(fp8), dtype="fp8", fp8_bug=bug), spec, seqs)
        res = compare_captures(cap, ref, config, "fp8", reference_lp=yard)
        f = res.first
        assert not res.passed and f is not None and f.layer == 0 and f.family == "attention", (bug, f)
        assert f.error > 4 * factor * f.noise, (bug, f.error, f.noise)  # a wide margin: 4x past the limit


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    from checkpoint_support import small_v3

    return small_v3(tmp_path_factory.mktemp("smallv3") / "v3")


@pytest.fixture(scope="module")
def small_runs(hfr, small):
    """The float32 reference and the FP8 yardstick captured on the small V3-shaped checkpoint."""
    from patcher.rules.modules import REFERENCE_TABLE
    from patcher.rules.prompts import build_prompt_set

    config = json.loads((small / "config.json").read_text())
    spec = REFERENCE_TABLE.spec(config, "float32")
    seqs = {p.id: list(p.token_ids) for p in build_prompt_set(small, 16)}
    ref = hfr.capture_run(hfr.load_model(str(small)), spec, seqs)
    yard = hfr.capture_run(hfr.load_model(str(small), dtype="fp8"), spec, seqs)
    return config, spec, seqs, ref, yard


def _planted(hfr, small, small_runs, bug):
    from patcher.rules.modules import compare_captures

    config, spec, seqs, ref, yard = small_runs
    cap = hfr.capture_run(hfr.load_model(str(small), dtype="fp8", fp8_bug=bug), spec, seqs)
    return compare_captures(cap, ref, config, "fp8", reference_lp=yard)


@pytest.mark.parametrize("bug, first", [
    # activations rounded through e5m2: the very first FP8 GEMM (layer 0's inputs carry no outliers)
    ("e5m2", {(0, "attn.q_a_norm")}),
    # one activation scale per 512 channels: layer 0's MLP, whose super neurons read the few common
    # channels (each the largest of its 128-channel group, so exact in e4m3 per 128 and not per 512)
    # and write the outlier channels; then the first GEMMs whose input carries those outliers (layer
    # 1's attention projections) at about 2x
    ("group512", {(0, "mlp"), (1, "attn.q_a_norm")}),
])
def test_bugs_that_double_the_fp8_error_fail_at_their_first_module_by_half_again_the_limit(hfr, small, small_runs,
                                                                                           bug, first):
    from patcher.rules.modules import LOW_PRECISION_POINT_RULES

    res = _planted(hfr, small, small_runs, bug)
    f = res.first
    assert not res.passed and f is not None and (f.layer, f.point) in first, (bug, f and f.where)
    limit = LOW_PRECISION_POINT_RULES["fp8"].factor
    assert f.phases[f.phase]["lower"] >= 1.5 * limit, (bug, f.phases[f.phase])
    assert any("block-FP8" in ln and "activation quantization" in ln for ln in res.explanation)


def test_a_moe_only_fp8_bug_fails_at_the_routed_experts(hfr, small, small_runs):
    """Activations rounded through e5m2 in the routed experts only: every other point matches, the
    MoE layer can be judged (its routing in FP8 agrees with float32) and names the routed experts."""
    res = _planted(hfr, small, small_runs, "moe-e5m2")
    f = res.first
    assert not res.passed and f is not None and (f.layer, f.point) == (3, "routed"), f and f.where
    assert all(not p.above for p in res.points if p.layer is not None and p.layer < 3)


def test_the_fp8_yardstick_routes_like_float32_on_the_small_v3(small_runs):
    from patcher.rules.modules import compare_captures

    config, _, _, ref, yard = small_runs
    clean = compare_captures(yard, ref, config, "fp8", reference_lp=yard)
    agree = [p.value for p in clean.points if p.metric == "agreement"]
    assert clean.passed and agree and min(agree) >= 0.9, agree

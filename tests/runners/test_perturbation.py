"""capture.py's perturbations (`dsadapt power`) on a module tree shaped like vLLM's DeepSeek model:
which rows a plan item changes (its phase, its layers), by how much, at which kind of site
(a module's output, a tuple element, the sum of a fused add-norm's pair, a projection's input, a
wrapped method), what it counts, and that a recorder installed after it records the changed
values. Fast (torch only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from patcher.runners import capture  # noqa: E402

nn = torch.nn
H = 8


class Norm(nn.Module):
    """vLLM's fused add-norm: with a residual it returns (normed, sum)."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * 2.0
        s = x + residual
        return s * 2.0, s


class Router:
    def select_experts(self, h):
        ids = h[:, :4].topk(2, dim=-1).indices
        return h[:, :4].gather(1, ids).softmax(-1), ids


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = Norm()
        self.o_proj = nn.Linear(H, H)
        self.router = Router()

    def forward(self, h, residual):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.o_proj(h)
        w, _ = self.router.select_experts(h)
        return h * w.sum(-1, keepdim=True), residual


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, H)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(H, 11)

    def forward(self, input_ids, positions):
        h, r = self.embed(input_ids), None
        for layer in self.layers:
            h, r = layer(h, r)
        return self.head(h + r)


SPEC = {
    "schema": capture.SPEC_SCHEMA, "layers": "layers", "rows": {"path": "", "ids": "input_ids", "positions": "positions"},
    "points": [
        {"point": "input_norm", "path": "layers.{i}.input_layernorm", "take": 0},
        {"point": "attn.core", "path": "layers.{i}.o_proj", "take": "input0"},
        {"point": "attn.out", "path": "layers.{i}.o_proj"},
        {"point": "router.weights", "path": "layers.{i}.router", "method": "select_experts", "take": 0},
        {"point": "out", "path": "layers.{i}", "take": "sum"},
        {"point": "logits", "path": "head", "rows": "last"},
    ]}
PROMPT = ([3, 4, 5, 6, 7], [0, 1, 2, 3, 4])
STEP = ([9], [5])


def _run(model, ids, pos):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), positions=torch.tensor(pos))


def _item(point, phase="both", eps=0.1, kind="scale", layers=None, seed=0):
    return {"point": point, "layers": layers, "phase": phase, "kind": kind, "eps": eps, "seed": seed}


def _with(plan, calls=(PROMPT, STEP)):
    model = Model()
    base = [_run(model, *c) for c in calls]
    p = capture.Perturber(SPEC, plan)
    p.install(model)
    got = [_run(model, *c) for c in calls]
    p.remove()
    after = [_run(model, *c) for c in calls]
    assert all(torch.equal(a, b) for a, b in zip(base, after))  # removed: the model is as it was
    return base, got, p


def test_row_phases_tell_a_prompt_from_decode_steps():
    assert capture.row_phases([0, 1, 2, 3]) == ([0, 0, 0, 0], [0])
    assert capture.row_phases([7]) == ([1], [1])
    assert capture.row_phases([12, 30, 5]) == ([1, 1, 1], [1, 1, 1])  # a batch of decode steps
    assert capture.row_phases([0, 1, 2, 9, 0, 1]) == ([0, 0, 0, 1, 0, 0], [0, 1, 0])  # prompts around a step
    assert capture.row_phases([4, 5, 6]) == ([0, 0, 0], [0])  # a prefix computed again (a chunk)
    assert capture.row_phases([0]) == ([0], [0])  # a one-token prompt


@pytest.mark.parametrize("point", ["attn.core", "attn.out", "input_norm", "router.weights", "out", "logits"])
def test_a_decode_item_changes_decode_rows_only_and_by_its_eps(point):
    base, got, p = _with([_item(point, "decode", 0.1)])
    assert torch.equal(base[0], got[0])  # the prompt's forward: untouched
    assert not torch.allclose(base[1], got[1])
    st = p.stats()["points"][point]
    assert st["rows"]["prefill"] == 0 and st["rows"]["decode"] == (1 if point in ("embed", "logits") else 2)
    assert st["change"]["decode"] == pytest.approx(0.1, rel=1e-5)


def test_a_prefill_item_leaves_decode_rows_computed_from_unchanged_inputs():
    base, got, p = _with([_item("logits", "prefill", 0.2)])
    assert torch.allclose(got[0], base[0] * 1.2) and torch.equal(got[1], base[1])
    assert p.stats()["points"]["logits"]["rows"] == {"prefill": 5, "decode": 0}


def _recorded(model, point: str, perturber=None) -> dict:
    """What a recorder installed after `perturber` (if any) records at `point` over the prompt."""
    rec_spec = {**SPEC, "points": [e for e in SPEC["points"] if e["point"] == point]}
    if perturber is not None:
        perturber.install(model)
    rec = capture.Recorder(rec_spec)
    rec.install(model)
    rec.prompt = "a"
    _run(model, *PROMPT)
    rec.remove()
    if perturber is not None:
        perturber.remove()
    return {(e["layer"], e["point"]): e["value"] for e in rec.finish({"a": PROMPT[0]})["points"]}


def test_the_sum_of_a_fused_pair_is_scaled_whole_and_the_recorder_sees_it():
    p = capture.Perturber(SPEC, [_item("out", "both", 0.5, layers=[0])])
    got = _recorded(Model(), "out", p)
    ref = _recorded(Model(), "out")
    assert torch.allclose(got[(0, "out")], ref[(0, "out")] * 1.5)  # layer 0's residual stream, x1.5
    assert p.stats()["points"]["out"]["rows"] == {"prefill": 5, "decode": 0}  # one value, counted once


def test_layers_limit_where_an_item_applies():
    _, _, p = _with([_item("attn.core", "both", 0.1, layers=[1])])
    assert p.stats()["points"]["attn.core"]["rows"] == {"prefill": 5, "decode": 1}


def test_eps_zero_is_bit_for_bit_the_unperturbed_model():
    base, got, p = _with([_item(e["point"], "both", 0.0) for e in SPEC["points"]])
    assert all(torch.equal(a, b) for a, b in zip(base, got))
    assert p.stats()["points"]["attn.core"]["change"]["prefill"] == 0.0


def test_noise_has_the_relative_size_asked_and_repeats_with_its_seed():
    _, got1, p = _with([_item("attn.out", "both", 0.05, kind="noise", seed=3)])
    _, got2, _ = _with([_item("attn.out", "both", 0.05, kind="noise", seed=3)])
    _, got3, _ = _with([_item("attn.out", "both", 0.05, kind="noise", seed=4)])
    assert torch.equal(got1[0], got2[0]) and not torch.equal(got1[0], got3[0])
    change = p.stats()["points"]["attn.out"]["change"]["prefill"]
    assert 0.03 < change < 0.07  # eps x RMS x N(0, 1): about eps over a few rows


def test_low_precision_rounding_is_counted_in_the_change_taken():
    model = Model().to(torch.bfloat16)
    p = capture.Perturber(SPEC, [_item("attn.out", "both", 1e-4)])
    p.install(model)
    _run(model, *PROMPT)
    p.remove()
    change = p.stats()["points"]["attn.out"]["change"]["prefill"]
    assert change < 1e-4 / 2  # bfloat16 cannot hold most of a 1e-4 change: the stats say so


def test_a_point_the_model_lacks_is_reported_missing_and_bad_plans_are_refused():
    p = capture.Perturber(SPEC, [_item("attn.kv_b")])
    p.install(Model())
    assert p.stats()["missing"] == ["attn.kv_b"]
    for bad in ([{"point": "x", "eps": 1.0}], [{"point": "x", "eps": 0.1, "phase": "later"}],
                [{"point": "x", "eps": 0.1, "kind": "shift"}], [{"eps": 0.1}], {"point": "x"}):
        with pytest.raises(capture.CaptureError):
            capture.Perturber(SPEC, bad)


def test_worker_functions_install_count_and_remove(tmp_path):
    import json

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    model = Model()
    base = _run(model, *PROMPT)
    capture.worker_perturb([_item("logits", "both", 0.1)], str(spec), model)
    got = _run(model, *PROMPT)
    first = capture.worker_perturb_stats(model)
    assert first["points"]["logits"]["rows"]["prefill"] == 5
    assert capture.worker_perturb_stats(model)["points"]["logits"]["rows"]["prefill"] == 0  # reset
    capture.worker_unperturb(model)
    assert torch.allclose(got, base * 1.1) and torch.equal(_run(model, *PROMPT), base)
    assert capture.worker_unperturb(model) == {}

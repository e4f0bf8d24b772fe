"""How large real adaptation bugs are in `dsadapt power`'s units: the relative change each makes at
the point a power target perturbs, so a measured MDE can be read as "this bug is / is not seen".

    python tools/bug_sizes.py MODEL_DIR [MODEL_DIR ...]      (a built-in model's folder, or any checkpoint)

HF transformers in float32 on CPU, teacher-forced on the gate's prompts, once as it is and once per
planted bug; at the bug's own point and at the targets' points (attn.core, routed, input_norm,
logits) the relative L2 change ||bugged - clean|| / ||clean|| pooled over every row: the eps a
`scale` perturbation of that size would have to reach, at the first layer holding the point (a
power target perturbs every layer; the first is where the bug's own size shows, undiluted). Bugs (each one line in the model, as in the
planted-bug tests): the softmax scale x1.02 (LMDeploy's and vLLM's decode-kernel bugs of the rule's
calibration), kv_a_layernorm eps 1e-2 instead of rms_norm_eps, the routed experts' weights x1.02
(routed_scaling_factor 2 % off), the router's score bias dropped, RMSNorm eps 1e-5 for 1e-6 everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "patcher" / "runners"))

POINTS = ("attn.kv_a_norm", "attn.core", "routed", "input_norm", "logits")


def _capture(model, spec, sequences):
    from patcher.runners.hf_reference import capture_run

    return {(p["layer"], p["point"]): p["value"] for p in capture_run(model, spec, sequences)["points"]}


def _change(a: dict, b: dict, point: str) -> float:
    """The relative change at the first layer holding `point` (before anything upstream of it in a
    later layer carries the bug's effect in: the bug's own size there)."""
    layers = sorted(layer for layer, p in a if p == point and (layer, p) in b and layer is not None)
    key = (layers[0] if layers else None, point)
    if key not in a or key not in b:
        return float("nan")
    num = float((b[key].double() - a[key].double()).square().sum())
    den = float(a[key].double().square().sum())
    return (num / den) ** 0.5 if den else float("nan")


def _bugs(model):
    """(name, apply(model) -> undo) for each planted bug."""
    layers = model.model.layers

    def scale_softmax(m):
        old = [layer.self_attn.scaling for layer in layers]
        for layer in layers:
            layer.self_attn.scaling *= 1.02
        return lambda: [setattr(layer.self_attn, "scaling", s) for layer, s in zip(layers, old)]

    def kv_a_eps(m):
        norms = [layer.self_attn.kv_a_layernorm for layer in layers]
        old = [n.variance_epsilon for n in norms]
        for n in norms:
            n.variance_epsilon = 1e-2
        return lambda: [setattr(n, "variance_epsilon", e) for n, e in zip(norms, old)]

    def routed_weights(m):
        gates = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]
        hooks = [g.register_forward_hook(lambda mod, a, out: (out[0], out[1] * 1.02, *out[2:])) for g in gates]
        return lambda: [h.remove() for h in hooks]

    def no_bias(m):
        gates = [layer.mlp.gate for layer in layers if getattr(getattr(layer.mlp, "gate", None),
                                                                "e_score_correction_bias", None) is not None]
        old = [g.e_score_correction_bias.detach().clone() for g in gates]
        for g in gates:
            g.e_score_correction_bias.data.zero_()
        return lambda: [g.e_score_correction_bias.data.copy_(o) for g, o in zip(gates, old)]

    def norm_eps(m):
        norms = [mod for mod in m.modules() if hasattr(mod, "variance_epsilon")]
        old = [n.variance_epsilon for n in norms]
        for n in norms:
            n.variance_epsilon = 1e-5
        return lambda: [setattr(n, "variance_epsilon", e) for n, e in zip(norms, old)]

    return [("softmax scale x1.02", scale_softmax), ("kv_a_layernorm eps 1e-2", kv_a_eps),
            ("routed expert weights x1.02", routed_weights), ("router score bias dropped", no_bias),
            ("every RMSNorm eps 1e-5 for 1e-6", norm_eps)]


def main(argv: list[str]) -> int:
    import torch

    from patcher.rules.modules import REFERENCE_TABLE
    from patcher.rules.prompts import build_prompt_set
    from patcher.runners.hf_reference import load_model

    torch.manual_seed(0)
    print("| model | bug | " + " | ".join(POINTS) + " |")
    print("|---|---|" + "---|" * len(POINTS))
    for model_dir in argv[1:]:
        model = load_model(model_dir, "float32")
        config = model.config.to_dict()
        spec = REFERENCE_TABLE.spec(config, "float32")
        sequences = {p.id: list(p.token_ids) for p in build_prompt_set(Path(model_dir), 16)}
        clean = _capture(model, spec, sequences)
        for name, plant in _bugs(model):
            undo = plant(model)
            try:
                bugged = _capture(model, spec, sequences)
            finally:
                undo()
            print(f"| {Path(model_dir).name} | {name} | " + " | ".join(f"{_change(clean, bugged, p):.3g}"
                                                                        for p in POINTS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

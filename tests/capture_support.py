"""Synthetic capture documents (the bisect capture's schema) for the per-module rule's tests: every
layer point over a few prompt rows, the router in layer 1, and edits that perturb one point or a
point and everything after it in forward order."""

from __future__ import annotations

import torch

CONFIG = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 6, "qk_rope_head_dim": 4,
          "rope_scaling": {"original_max_position_embeddings": 4}}
ROWS = [("a", p, 0) for p in range(6)] + [("a", 6, 1), ("b", 0, 0), ("b", 1, 0), ("b", 2, 1)]
SEQS = {"a": list(range(10, 17)), "b": [20, 21, 22]}
LAYER_TENSORS = ("input_norm", "attn.kv_a_norm", "attn.q_rope", "attn.core", "attn.out", "post_norm", "mlp", "out")


def synthetic(seed=0, ids=None, weights=None):
    """A capture document over ROWS: every layer point, the router in layer 1."""
    g = torch.Generator().manual_seed(seed)
    prompts = list(SEQS)
    n = len(ROWS)
    meta = {"prompt": torch.tensor([prompts.index(p) for p, _, _ in ROWS]),
            "pos": torch.tensor([q for _, q, _ in ROWS]), "phase": torch.tensor([f for _, _, f in ROWS])}
    pts = [{"layer": None, "point": "embed", "value": torch.randn(n, 8, generator=g), **meta}]
    for layer in range(2):
        for name in LAYER_TENSORS:
            pts.append({"layer": layer, "point": name, "value": torch.randn(n, 8, generator=g) + 3, **meta})
        if layer == 1:
            base_ids = torch.tensor([[0, 1]] * n) if ids is None else ids
            base_w = torch.full((n, 2), 0.5) if weights is None else weights
            pts += [{"layer": 1, "point": "router.experts", "value": base_ids, **meta},
                    {"layer": 1, "point": "router.weights", "value": base_w, **meta},
                    {"layer": 1, "point": "routed", "value": torch.randn(n, 8, generator=g) + 3, **meta}]
    pts.append({"layer": None, "point": "logits", "value": torch.randn(n, 5, generator=g) + 3, **meta})
    return {"schema": "dsadapt.capture/1", "prompts": prompts, "sequences": SEQS, "calls": 4, "points": pts,
            "missing": [], "dropped": {}, "meta": {}}


def edit(doc, layer, point, fn, rows=None):
    import copy

    doc = copy.deepcopy(doc)
    for p in doc["points"]:
        if p["layer"] == layer and p["point"] == point:
            v = p["value"].clone()
            sel = slice(None) if rows is None else rows
            v[sel] = fn(v[sel])
            p["value"] = v
    return doc


def downstream(doc, start_layer, start_point, fn):
    """Perturb one point and everything after it in forward order (what a real bug does)."""
    order = [(None, "embed")] + [(lay, n) for lay in range(2) for n in LAYER_TENSORS] + [(None, "logits")]
    k = order.index((start_layer, start_point))
    for layer, point in order[k:]:
        doc = edit(doc, layer, point, fn)
    return doc

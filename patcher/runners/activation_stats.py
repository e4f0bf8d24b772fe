"""What a checkpoint's activations look like: the measurements behind `dsadapt model inspect`.

Standalone (stdlib + torch; the model comes from hf_reference.load_model): imported by the reference
runner in its ``--inspect`` mode, never by dsadapt. One float32 forward per prompt, teacher-forced,
eager attention, with forward hooks; then the same prompts in each low-precision dtype asked for
(bfloat16 and float16 as the gate's yardstick routes them; fp8 for a block-FP8 checkpoint: HF's own
FP8 arithmetic). Everything measured is in the returned document (`dsadapt.model-structure/1`);
which values are enough is dsadapt's judgement (patcher/checkpoints/structure.py, `judge_structure`).

- ``residual``: per decoder layer, the residual stream after it: each channel's mean |h| over the
  rows; the largest channel over the median channel, and the three largest channels; per row,
  max |h| over the median |h| (Sun et al. 2024's view: a few activations far above the rest).
- ``gemm_inputs``: the outputs of input_layernorm and post_attention_layernorm (what the attention
  and MLP projections read): per row max |x| over median |x|, the median over rows.
- ``sinks``: per layer, the attention weight on the first token from queries at positions >= 8,
  averaged over heads and queries, and the share of heads whose average is at least 0.3.
- ``routing``: per MoE layer and low-precision dtype, the share of rows whose expert set equals
  the float32 run's; the float32 router's top-k margin (the k-th chosen score over the best one
  left out, median over rows).
- ``logits``: float32 mean entropy and top-1 probability; per dtype, top-1 agreement with float32.
- ``weights``: over every projection weight, the RMS of each 128 x 128 block over its tensor's median
  block: the 99th percentile and the largest, and the standard deviation of log2 of it.
"""

from __future__ import annotations

import math

SCHEMA = "dsadapt.model-structure/1"
SINK_FROM = 8
SINK_HEAD = 0.3
BLOCK = 128


def _forward(model, sequences, attentions):
    """Run every sequence; returns (captures, per-sequence log-softmax rows, attentions)."""
    import torch

    cap = {"residual": {}, "in": {}, "post": {}, "routes": {}, "margin": {}}
    hooks = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        def out_hook(_m, _a, o, i=i):
            h = o[0] if isinstance(o, tuple) else o
            cap["residual"].setdefault(i, []).append(h[0].float().abs().cpu())
        hooks.append(layer.register_forward_hook(out_hook))
        hooks.append(layer.input_layernorm.register_forward_hook(
            lambda _m, _a, o, i=i: cap["in"].setdefault(i, []).append(_row_ratio(o[0]))))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(
            lambda _m, _a, o, i=i: cap["post"].setdefault(i, []).append(_row_ratio(o[0]))))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            def route_hook(m, _a, o, i=i):
                cap["routes"].setdefault(i, []).append(o[2].sort(-1).values.cpu())
                logits = o[0].float()
                scores = logits.sigmoid() if type(m).__name__.startswith("DeepseekV3") else logits.softmax(-1)
                top = scores.topk(m.top_k + 1, dim=-1).values
                cap["margin"].setdefault(i, []).append((top[:, -2] / top[:, -1].clamp(min=1e-30)).cpu())
            hooks.append(gate.register_forward_hook(route_hook))
    rows, attn = [], []
    try:
        with torch.no_grad():
            for ids in sequences:
                out = model(torch.tensor([ids], device=model.device), output_attentions=attentions)
                rows.append(out.logits[0].float().log_softmax(-1).cpu())
                if attentions:
                    attn.append([a[0, :, SINK_FROM:, 0].float().mean(-1).cpu() if a is not None and a.shape[2] > SINK_FROM
                                 else None for a in out.attentions])
    finally:
        for h in hooks:
            h.remove()
    return cap, rows, attn


def _row_ratio(x):
    a = x[0].float().abs()
    return (a.amax(-1) / a.median(-1).values.clamp(min=1e-30)).cpu()


def _median(values):
    import torch

    return float(torch.cat([v.flatten() for v in values]).median()) if values else math.nan


def _weights(model):
    """Per-block RMS statistics over the 2-D projection weights."""
    import torch

    rms = []
    for name, p in model.named_parameters():
        if p.dim() != 2 or not name.endswith("proj.weight"):
            continue
        w = p.detach().float()
        r, c = w.shape
        gr, gc = -(-r // BLOCK), -(-c // BLOCK)
        pad = torch.zeros(gr * BLOCK, gc * BLOCK, device=w.device)
        pad[:r, :c] = w
        counts = torch.zeros(gr * BLOCK, gc * BLOCK, device=w.device)
        counts[:r, :c] = 1
        s2 = pad.square().view(gr, BLOCK, gc, BLOCK).sum((1, 3))
        n = counts.view(gr, BLOCK, gc, BLOCK).sum((1, 3))
        rms.append(_relative((s2 / n).sqrt().flatten().cpu()))
    for name, p in model.named_parameters():  # fused experts: one [experts, rows, cols] tensor each
        if p.dim() == 3 and "experts" in name:
            w = p.detach().float()
            e, r, c = w.shape
            if r % BLOCK == 0 and c % BLOCK == 0:
                rms.append(_relative(w.square().view(e, r // BLOCK, BLOCK, c // BLOCK, BLOCK).mean((2, 4)).sqrt()
                                     .flatten().cpu()))
    if not rms:
        return {}
    x = torch.cat(rms)
    x = x[x > 0]
    med = float(x.median())
    return {"blocks": int(x.numel()), "p99_over_median": float(x.quantile(0.99) / med) if x.numel() < 16_000_000
            else float(x[torch.randperm(x.numel())[:1_000_000]].quantile(0.99) / med),
            "max_over_median": float(x.max() / med), "log2_std": float(x.log2().std())}


def _relative(x):
    """Block RMS over its tensor's median block (tensors differ in scale by design)."""
    x = x[x > 0]
    return x / x.median() if x.numel() else x


def inspect(load, sequences, dtypes, fp8_from_float32=None):
    """The document: `load(dtype)` gives the model in that dtype (the float32 one first);
    `fp8_from_float32(model)` turns the float32 model into the FP8 yardstick (one load)."""
    import torch

    model = load("float32")
    cap, rows, attn = _forward(model, sequences, attentions=True)
    doc = {"schema": SCHEMA, "rows": sum(len(s) for s in sequences), "sequences": len(sequences),
           "dtypes": list(dtypes), "layers": len(model.model.layers)}
    res = []
    for i in sorted(cap["residual"]):
        h = torch.cat(cap["residual"][i])
        chan = h.mean(0)
        med = float(chan.median())
        res.append({"layer": i, "channel_ratio": float(chan.max() / med) if med > 0 else math.inf,
                    "top_channels": chan.topk(min(3, chan.numel())).indices.tolist(),
                    "row_ratio": float((h.amax(-1) / h.median(-1).values.clamp(min=1e-30)).median())})
    doc["residual"] = res
    doc["gemm_inputs"] = [{"layer": i, "input_norm": _median(cap["in"].get(i, [])),
                           "post_attention_norm": _median(cap["post"].get(i, []))} for i in sorted(cap["in"])]
    sinks = []
    for i in range(doc["layers"]):
        per = [a[i] for a in attn if a[i] is not None]
        if not per:
            continue
        heads = torch.stack(per).mean(0)  # per head, over the sequences
        sinks.append({"layer": i, "mean": float(heads.mean()), "heads_over": float((heads >= SINK_HEAD).float().mean())})
    doc["sinks"] = sinks
    lp = torch.cat(rows)
    p = lp.exp()
    doc["logits"] = {"entropy": float(-(p * lp).sum(-1).mean()), "top1": float(p.max(-1).values.mean()),
                     "vocab": int(lp.shape[-1]), "agreement": {}}
    doc["weights"] = _weights(model)
    ref_routes = {i: torch.cat(v) for i, v in cap["routes"].items()}
    doc["routing"] = {"layers": sorted(ref_routes), "margin": {str(i): float(torch.cat(cap["margin"][i]).median())
                                                               for i in sorted(cap["margin"])}, "agreement": {}}
    ref_top = lp.argmax(-1)
    for dtype in dtypes:
        if dtype == "fp8" and fp8_from_float32 is not None:
            model = fp8_from_float32(model)
        else:
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            model = load(dtype)
        c2, rows2, _ = _forward(model, sequences, attentions=False)
        doc["routing"]["agreement"][dtype] = {
            str(i): float((ref_routes[i] == torch.cat(c2["routes"][i])).all(-1).float().mean()) for i in ref_routes}
        doc["logits"]["agreement"][dtype] = float((torch.cat(rows2).argmax(-1) == ref_top).float().mean())
    return doc

"""CPU evidence for the LMDeploy 0.18.0 DeepSeek-V2 routing bug (no engine needed).

Runs dsadapt's built-in tiny V2 (`dsadapt model make --variant v2`: group_limited_greedy,
softmax scoring, routed_scaling_factor 16, norm_topk_prob false) in HF transformers (float32)
three times over the gate's prompt set: with HF's own router, with HF's router forward replaced
by LMDeploy 0.18.0's `MoEGate` group_limited_greedy arithmetic (restated below line by line),
and with the patched arithmetic. Prints JSON: top-1 agreement and |delta log-softmax| of each
against HF, plus how many tokens route to another expert set (docs/engines/lmdeploy.md).

    python tools/lmdeploy_gate_sim.py [--out sim.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from patcher.checkpoints.tiny import make_model  # noqa: E402
from patcher.rules.prompts import build_prompt_set  # noqa: E402

MODEL_DIR = Path(tempfile.mkdtemp(prefix="dsadapt-gate-sim-")) / "v2"


def build_model():
    """dsadapt's built-in tiny V2 (seed 0, transformers-style config), loaded by HF in float32."""
    from transformers import AutoModelForCausalLM

    if not (MODEL_DIR / "config.json").is_file():
        make_model(MODEL_DIR, variant="v2", config_style="transformers", seed=0)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def prompt_ids() -> list[list[int]]:
    """The gate's prompt set (patcher/rules/prompts.py) as token ids."""
    return [list(p.token_ids) for p in build_prompt_set(MODEL_DIR, 16)]


def _group_mask(scores, n_group, topk_group):
    grouped = scores.unflatten(-1, (n_group, -1))
    group_idx = torch.topk(grouped.max(-1).values, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool).scatter_(1, group_idx, True)
    return grouped, ~keep[..., None]


def lmdeploy_0180_route(logits, n_group, topk_group, top_k, scale):
    """LMDeploy 0.18.0: mask the raw logits of dropped groups with 0.0, then softmax + top-k."""
    grouped, drop = _group_mask(logits, n_group, topk_group)
    masked = grouped.masked_fill(drop, 0.0).flatten(1, 2)
    w, idx = torch.topk(torch.softmax(masked, dim=-1, dtype=torch.float32), top_k, dim=-1)
    return w * scale, idx


def patched_route(logits, n_group, topk_group, top_k, scale):
    """Patched: softmax over all experts, zero the dropped groups' scores, then top-k."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    grouped, drop = _group_mask(scores, n_group, topk_group)
    w, idx = torch.topk(grouped.masked_fill(drop, 0.0).flatten(1, 2), top_k, dim=-1, sorted=False)
    return w * scale, idx


def install(model, route, log):
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue

        def forward(hidden, gate=gate):
            h = hidden.view(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(h.float(), gate.weight.float())
            if route is None:
                _, w, idx = type(gate).forward(gate, hidden)
            else:
                w, idx = route(logits, gate.num_group, gate.topk_group, gate.top_k, gate.routed_scaling_factor)
            log.append(idx.sort(-1).values)
            return logits, w, idx

        gate.forward = forward


def run(route):
    model = build_model()
    log: list = []
    install(model, route, log)
    with torch.no_grad():
        rows = [model(torch.tensor([x])).logits[0].float().log_softmax(-1) for x in prompt_ids()]
    return rows, log


def compare(ref, ref_log, rows, log):
    d = torch.stack([(a - b).abs().max() for a, b in zip(ref, rows)]).max().item()
    mean = sum((a - b).abs().mean().item() for a, b in zip(ref, rows)) / len(ref)
    top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref, rows))
    n = sum(x.shape[0] for x in ref)
    moved = sum((a != b).any(-1).sum().item() for a, b in zip(ref_log, log))
    routed = sum(a.shape[0] for a in ref_log)
    return {"top1": f"{top1}/{n}", "max_abs": round(d, 6), "mean_abs": round(mean, 6),
            "tokens_routed_differently": f"{moved}/{routed}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ref, ref_log = run(None)
    result = {"model": "dsadapt built-in v2 (group_limited_greedy, softmax, routed_scaling_factor 16, "
                       "norm_topk_prob false), seed 0",
              "dtype": "float32", "device": "cpu", "torch": torch.__version__,
              "lmdeploy_0.18.0_gate_vs_hf": compare(ref, ref_log, *run(lmdeploy_0180_route)),
              "patched_gate_vs_hf": compare(ref, ref_log, *run(patched_route))}
    import transformers
    result["transformers"] = transformers.__version__
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

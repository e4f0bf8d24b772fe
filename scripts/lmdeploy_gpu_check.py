"""LMDeploy PyTorch engine vs HF transformers on tiny DeepSeek models, on the GPU machine.

Two modes, each run in its own process (LMDeploy's tree is chosen by PYTHONPATH):

    python lmdeploy_gpu_check.py ref --models v2,v3 --work /tmp/gc --tok TOKDIR
        builds the models (lmdeploy_models.py), runs HF transformers on the GPU in float32,
        bfloat16 and float16 over 4 x 48 seeded token ids, records the log-softmax rows
        and, per MoE layer, the router's input hidden states and top-k output.

    python lmdeploy_gpu_check.py lmd --label patched --models v2,v3 --dtypes bfloat16,float16 \
        --work /tmp/gc --out OUT
        starts LMDeploy's PyTorch engine per model and dtype, compares its prompt
        log-softmax with HF's, and bisects the MoE routing layer by layer: the engine's
        router inputs against HF's, and the engine's own gate modules called directly on
        HF's float32 router inputs (in the model dtype, and with the gate weight in float32,
        which isolates the routing arithmetic from rounding).

Writes <OUT>/ref.json and <OUT>/lmd_<label>.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from lmdeploy_models import build_model, prompt_ids, save  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def moe_gates(model) -> dict[int, torch.nn.Module]:
    return {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}


def stats(rows, ref_rows) -> dict:
    """Top-1 agreement and |delta| of log-softmax rows (lists of [T, V] tensors)."""
    diffs = [(a - b).abs() for a, b in zip(rows, ref_rows)]
    top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(rows, ref_rows))
    n = sum(r.shape[0] for r in ref_rows)
    return {"top1": f"{top1}/{n}", "top1_agree": top1, "positions": n,
            "max_abs": round(max(d.max().item() for d in diffs), 5),
            "mean_abs": round(sum(d.mean().item() for d in diffs) / len(diffs), 6),
            "per_position_max_abs": [[round(v, 4) for v in d.max(-1).values.tolist()] for d in diffs]}


def routing_diff(w, idx, ref_w, ref_idx, n_experts: int) -> dict:
    """Tokens routed to another expert set, and max |delta weight| on a dense [T, E] map."""
    moved = (idx.sort(-1).values != ref_idx.sort(-1).values).any(-1)
    dense = torch.zeros(idx.shape[0], n_experts, device=w.device).scatter_(1, idx.long(), w.float())
    ref = torch.zeros(ref_idx.shape[0], n_experts, device=ref_w.device).scatter_(1, ref_idx.long(), ref_w.float())
    return {"tokens_moved": int(moved.sum().item()), "tokens": int(idx.shape[0]),
            "max_abs_weight": round((dense - ref.to(dense.device)).abs().max().item(), 6)}


# ----------------------------------------------------------------------------- ref


def _route(moe, out):
    """(weights, expert ids) from an HF router's output."""
    if isinstance(out, tuple):
        return out[1], out[2]
    ids, weights = moe.route_tokens_to_experts(out)
    return weights, ids


def hf_pass(model_dir: str, dtype: str, ids, device: str = "cuda") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="eager")
    model = model.to(device).eval()
    gates = moe_gates(model)
    moes = {i: model.model.layers[i].mlp for i in gates}
    cap: dict[int, list] = {i: [] for i in gates}

    def hook(i):
        moe = moes[i]

        def fn(_m, args, out):
            # transformers returns (logits, weights, ids) from the router, or (older V3)
            # logits only, routed by the MoE block's route_tokens_to_experts.
            h = args[0].reshape(-1, args[0].shape[-1]).float().cpu()
            try:
                w, idx = _route(moe, out)
                cap[i].append((h, w.float().cpu(), idx.cpu()))
            except Exception:  # an HF version whose routing this script cannot read: inputs only
                cap[i].append((h, None, None))
        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in gates.items()]
    with torch.no_grad():
        rows = [model(torch.tensor([x], device=device)).logits[0].float().log_softmax(-1).cpu() for x in ids]
    for h in handles:
        h.remove()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "gates": cap}


def cmd_ref(args) -> int:
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ids = prompt_ids()
    summary = {"torch": torch.__version__, "transformers": transformers.__version__,
               "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device, "models": {}}
    for which in args.models.split(","):
        d = os.path.join(args.work, "models", which)
        t0 = time.time()
        fp = save(build_model(which), d, args.tok)
        ref = {dt: hf_pass(d, dt, ids, args.device) for dt in ("float32", "bfloat16", "float16")}
        torch.save({"ids": ids, "ref": ref}, os.path.join(args.work, f"ref_{which}.pt"))
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        summary["models"][which] = {
            "fingerprint": fp, "config": cfg, "build_and_ref_s": round(time.time() - t0, 1),
            "hf_bfloat16_vs_float32": {k: v for k, v in stats(ref["bfloat16"]["rows"], ref["float32"]["rows"]).items()
                                       if k != "per_position_max_abs"},
            "hf_float16_vs_float32": {k: v for k, v in stats(ref["float16"]["rows"], ref["float32"]["rows"]).items()
                                      if k != "per_position_max_abs"}}
        print(which, json.dumps(summary["models"][which]["hf_bfloat16_vs_float32"]), flush=True)
    with open(os.path.join(args.out, "ref.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


# ----------------------------------------------------------------------------- lmd


def find_causal_lm(root, depth: int = 7):
    """The engine's model module (class name ending in ForCausalLM), found by walking
    attributes from the pipeline (the uni executor keeps it in this process)."""
    seen, todo = set(), [(root, 0)]
    while todo:
        obj, d = todo.pop(0)
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module) and type(obj).__name__.endswith("ForCausalLM"):
            return obj
        if isinstance(obj, dict):
            kids = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            kids = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            kids = list(vars(obj).values())
        else:
            kids = []
        leaves = (str, bytes, int, float, bool, type(None), torch.Tensor)
        todo.extend((k, d + 1) for k in kids if not isinstance(k, leaves))
    return None


def _direct(gate, hidden, w_ref, i_ref, n_experts) -> dict:
    """The engine's gate module called on given router inputs, against HF's routing."""
    try:
        with torch.inference_mode():
            w, idx = gate(hidden)
        return routing_diff(w.cpu(), idx.cpu(), w_ref, i_ref, n_experts)
    except Exception as e:
        return {"error": repr(e)[:500]}


def _with_weight(gate, weight):
    """A shallow copy of the engine's gate module whose router weight is `weight` (the
    checkpoint's float32 tensor): the engine's own routing code with HF's exact weight."""
    import copy

    g = copy.copy(gate)
    g._parameters = dict(gate._parameters)
    with torch.inference_mode():
        g._parameters["weight"] = torch.nn.Parameter(weight.cuda(), requires_grad=False)
    return g


def engine_bisect(pipe, model, ref: dict, dtype: str, ids, model_dir: str) -> dict:
    """Per MoE layer: engine router inputs vs HF's, and the engine's gate on HF's inputs."""
    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    gates = moe_gates(model)
    n_experts = next(iter(gates.values())).weight.shape[0]
    cap: dict[int, list] = {i: [] for i in gates}
    active = {"on": False, "len": 0}

    def hook(i):
        def fn(_m, args, out):
            if active["on"] and args[0].shape[0] == active["len"]:
                w, idx = out
                cap[i].append((args[0].float().cpu(), w.float().cpu(), idx.cpu()))
        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in gates.items()]
    try:
        for x in ids:
            active.update(on=True, len=len(x))
            pipe._run(coro=pipe.async_engine.async_get_logits(input_ids=[x])).result()
            active["on"] = False
    finally:
        for h in handles:
            h.remove()
    out = {}
    ref32 = ref["float32"]["gates"]
    refdt = ref[dtype]["gates"]
    for i, gate in gates.items():
        r = {}
        if len(cap[i]) == len(ids):
            def rel(a, b):
                return ((a - b).norm() / b.norm()).item()
            r["router_input_rel_err_vs_hf_fp32"] = round(
                sum(rel(c[0], h[0]) for c, h in zip(cap[i], ref32[i])) / len(ids), 6)
            r["hf_same_dtype_router_input_rel_err_vs_hf_fp32"] = round(
                sum(rel(c[0], h[0]) for c, h in zip(refdt[i], ref32[i])) / len(ids), 6)
            if ref32[i][0][1] is not None:
                r["in_engine_routing_vs_hf_fp32"] = routing_diff(
                    torch.cat([c[1] for c in cap[i]]), torch.cat([c[2] for c in cap[i]]),
                    torch.cat([h[1] for h in ref32[i]]), torch.cat([h[2] for h in ref32[i]]), n_experts)
        else:
            r["capture_error"] = f"captured {len(cap[i])} router calls for {len(ids)} prompts"
        if ref32[i][0][1] is None:
            r["hf_routing"] = "not readable from this transformers version"
            out[f"layer{i}"] = r
            continue
        h32 = torch.cat([h[0] for h in ref32[i]]).cuda()
        w_ref = torch.cat([h[1] for h in ref32[i]])
        i_ref = torch.cat([h[2] for h in ref32[i]])
        r["direct_gate_model_dtype_vs_hf_fp32"] = _direct(gate, h32.to(gate.weight.dtype), w_ref, i_ref, n_experts)
        r["direct_gate_fp32_vs_hf_fp32"] = _direct(_with_weight(gate, ckpt[f"model.layers.{i}.mlp.gate.weight"]),
                                                   h32, w_ref, i_ref, n_experts)
        out[f"layer{i}"] = r
    return out


def cmd_lmd(args) -> int:
    import lmdeploy
    from lmdeploy import PytorchEngineConfig, pipeline

    src = os.path.join(os.path.dirname(lmdeploy.__file__), "pytorch", "models", "deepseek_v2.py")
    result = {"label": args.label, "lmdeploy": lmdeploy.__version__, "lmdeploy_path": lmdeploy.__file__,
              "deepseek_v2_py_sha256": hashlib.sha256(open(src, "rb").read()).hexdigest(),  # noqa: SIM115 - a script run once
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "runs": {}}
    path = os.path.join(args.out, f"lmd_{args.label}.json")
    for which in args.models.split(","):
        saved = torch.load(os.path.join(args.work, f"ref_{which}.pt"))
        ids, ref = saved["ids"], saved["ref"]
        d = os.path.join(args.work, "models", which)
        for dtype in args.dtypes.split(","):
            key = f"{which}/{dtype}"
            r: dict = {}
            try:
                t0 = time.time()
                pipe = pipeline(d, backend_config=PytorchEngineConfig(
                    dtype=dtype, cache_max_entry_count=0.05, session_len=512, eager_mode=True), log_level="ERROR")
                r["engine_start_s"] = round(time.time() - t0, 1)
                logits = pipe._run(coro=pipe.async_engine.async_get_logits(input_ids=ids)).result()
                rows = [x.squeeze(0).float().log_softmax(-1).cpu() for x in logits]
                r["vs_hf_float32"] = stats(rows, ref["float32"]["rows"])
                r[f"vs_hf_{dtype}"] = stats(rows, ref[dtype]["rows"])
                r[f"hf_{dtype}_vs_hf_float32"] = stats(ref[dtype]["rows"], ref["float32"]["rows"])
                model = find_causal_lm(pipe.async_engine)
                if model is None:
                    r["bisect_error"] = "engine model not found in this process"
                else:
                    r["bisect"] = engine_bisect(pipe, model, ref, dtype, ids, d)
                pipe.close()
                del pipe
            except Exception:
                r["error"] = traceback.format_exc()[-4000:]
            gc.collect()
            torch.cuda.empty_cache()
            result["runs"][key] = r
            brief = {k: {kk: vv for kk, vv in v.items() if kk != "per_position_max_abs"} if isinstance(v, dict) else v
                     for k, v in r.items() if k.startswith("vs_hf") or k == "error"}
            print(args.label, key, json.dumps(brief)[:3000], flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("ref", "lmd"))
    ap.add_argument("--models", default="v2,v3")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--label", default="lmdeploy")
    ap.add_argument("--work", default="/tmp/gc")
    ap.add_argument("--tok", default=None)
    ap.add_argument("--device", default="cuda", help="ref mode: where HF runs (cpu for a dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    os.makedirs(os.path.join(args.work, "models"), exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    return cmd_ref(args) if args.mode == "ref" else cmd_lmd(args)


if __name__ == "__main__":
    sys.exit(main())

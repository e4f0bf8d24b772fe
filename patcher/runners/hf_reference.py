"""HF transformers reference runner for dsadapt's logit-equivalence gate.

Standalone: stdlib + torch + transformers only; it runs with the reference
environment's interpreter in a subprocess and never imports `patcher`.

    python hf_reference.py --model DIR --prompts prompts.json --dtype float32 \
        --top-k 20 --max-tokens 16 --out report.json [--attn eager|sdpa] \
        [--experts eager|grouped_mm] [--batch-mode individual|padded] [--fingerprint SHA]

What it computes, on CPU (or, with ``--device cuda``, on the GPU, in true float32: TF32 off),
for each prompt:
- teacher-forced prompt logprobs: a full ``log_softmax`` over the vocabulary at
  every position, keeping the top-K values and the logprob of the actual next
  token (position 0 has none);
- greedy generation of ``--max-tokens`` tokens (EOS ignored) by full
  recomputation: no KV cache, each token is the argmax of a causal forward over
  everything before it. All reported logprobs (prompt and generated) come from
  one last full forward over prompt + generation; ``settings.greedy_flips``
  counts generated tokens that are not that forward's argmax (near-ties whose
  winner changed with the sequence length; expected 0).

Batches: ``--batch-mode individual`` (default; HF is the truth) computes the
members of a batch one by one. ``padded`` runs them as one left-padded batch
(attention mask, explicit position ids, full recomputation per generated
token); it exists to measure the reference's own batching noise.

Exit status: 0 with the report written; 1 on any failure (traceback on stderr).
"""

from __future__ import annotations

import json
import platform
import time

import dsadapt_runner as kit

DTYPES = ("float32", "float64", "bfloat16", "float16", "fp8")


def parse_args(argv=None):
    ap = kit.parser(__doc__.split("\n")[0], DTYPES, top_k=20, report_required=False)
    ap.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    ap.add_argument("--experts", default="eager",
                    help="transformers experts_implementation (eager: the plain per-expert loop; "
                         "grouped_mm has no float64 kernel)")
    ap.add_argument("--batch-mode", default="individual", choices=("individual", "padded"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the model runs (cuda: float32 matmuls without TF32)")
    ap.add_argument("--capture", default=None,
                    help="bisect mode: capture every comparison point into this file instead of a logit report")
    ap.add_argument("--capture-spec", default=None, help="the capture spec (JSON)")
    ap.add_argument("--capture-sequences", default=None,
                    help="JSON {prompt id: token ids}: the exact sequences the engine ran (teacher-forced here)")
    ap.add_argument("--capture-dtypes", default="float32",
                    help="comma-separated dtypes to capture in (the first is the reference, the others noise yardsticks)")
    ap.add_argument("--inspect", default=None,
                    help="model-inspect mode: measure the activations' structure (activation_stats.py) into this JSON file")
    ap.add_argument("--inspect-dtypes", default="",
                    help="comma-separated low-precision dtypes whose routing and top-1 are compared with float32")
    args = ap.parse_args(argv)
    if args.inspect is not None:
        if args.prompts is None:
            ap.error("--inspect needs --prompts")
        return args
    if args.capture is None and (args.prompts is None or args.out is None):
        ap.error("--prompts and --out are required (or --capture for bisect mode)")
    if args.capture is not None and (args.capture_spec is None or args.capture_sequences is None):
        ap.error("--capture needs --capture-spec and --capture-sequences")
    return args


def load_model(model_dir, dtype="float32", attn="eager", experts="eager", config_overrides=None, device="cpu",
               fp8_bug=None):
    """Load the model (on CPU unless `device`) in eval mode. `config_overrides` (a dict) edits
    the config before the weights load (tests use it to plant known bugs).

    A block-FP8 checkpoint (``quantization_config: {quant_method: fp8, weight_block_size}``) is
    built by transformers' own model class in float32, uninitialized, on `device`, and filled one
    checkpoint tensor at a time with every FP8 weight dequantized, ``weight x weight_scale_inv``
    per block (`load_fp8_checkpoint`): the checkpoint's exact meaning, on any device, with the
    model held once and nothing more than one tensor besides it (transformers' own loader stacks
    a whole layer's experts, then casts the stack: a second copy of the largest layer). `dtype`
    "fp8" is that model in bfloat16 with the engine's FP8 arithmetic emulated (activations
    quantized to e4m3 per token and 128 channels at every FP8 GEMM): the yardstick of an FP8
    engine's own rounding. `fp8_bug` plants an FP8 bug (tests and tools/measure_bisect_noise.py only):
    "transposed" / "inverse" in the dequantization (the scale grid read column-major; weight /
    weight_scale_inv), and in the FP8 arithmetic of an fp8 model (`FP8_ACTIVATION_BUGS`) "e5m2"
    (activations rounded through e5m2), "group512" (one activation scale per 512 channels instead
    of 128), and "moe-e5m2" / "moe-group512" (the same in the routed experts only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    block = fp8_block(config)
    if block is not None:
        # dequantized here, not by transformers: its FineGrainedFP8 integration needs a GPU (or
        # accelerate) and derives the block from rows // grid rows, which DeepSeek-V3's 576-row
        # kv_a_proj_with_mqa (5 row blocks, the last partial) does not divide
        del config.quantization_config
    elif dtype == "fp8":
        raise ValueError("--dtype fp8 needs a block-FP8 checkpoint (quantization_config quant_method fp8)")
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    if block is None:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=getattr(torch, dtype), attn_implementation=attn,
            experts_implementation=experts)
        model = model.eval().to(device)
        return route_in_dtype(model, dtype) if dtype != "float32" else model
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn,
                                                 experts_implementation=experts)
    model = model.eval()
    if fp8_bug in FP8_ACTIVATION_BUGS and dtype != "fp8":
        raise ValueError(f"fp8_bug {fp8_bug!r} is a bug of the FP8 arithmetic: it needs dtype fp8")
    placed = load_fp8_checkpoint(model, model_dir, block, int(config.num_hidden_layers),
                                 bug=None if fp8_bug in FP8_ACTIVATION_BUGS else fp8_bug)
    model.dsadapt_fp8 = {"weight_block_size": list(block), "dequantized_tensors": len(placed)}
    model.dsadapt_fp8_placed = placed
    if dtype == "fp8":
        model = as_fp8_yardstick(model, FP8_ACTIVATION_BUGS.get(fp8_bug or ""))
    elif dtype != "float32":
        model = route_in_dtype(model.to(getattr(torch, dtype)), dtype)
    return model


class _LinearIn:
    """torch.nn.functional with `linear` computed in one dtype: inputs, weight and output in it."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __getattr__(self, name):
        import torch.nn.functional as F

        return getattr(F, name)

    def linear(self, x, w, b=None):
        import torch.nn.functional as F

        return F.linear(x.to(self.dtype), w.to(self.dtype), None if b is None else b.to(self.dtype))


#: HF's DeepSeek router classes: they compute the gate's logits and scores in float32 whatever the
#: model's dtype (``F.linear(h.float(), w.float())``, a float32 weight even in a bfloat16 model).
ROUTER_CLASSES = ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter")


def route_in_dtype(model, dtype: str):
    """The low-precision yardstick routes as serving engines do: the router's logits and scores in
    the model's dtype (the gate's GEMM from `dtype` inputs and weight, its output left in `dtype`;
    softmax/sigmoid and the top-k then run on those rounded scores), where HF keeps them in float32.
    In bfloat16 that rounding makes near-tie expert choices flip about 2.5x as often (measured on
    the built-in v3: 118 rows of 3,132 against 47), and every engine measured flips at that rate:
    a yardstick without it charges the engine for its router's legitimate precision in every
    later layer. Expert selection itself is judged against this run's flips too."""
    import sys

    import torch

    low = torch.bfloat16 if dtype == "fp8" else getattr(torch, dtype)
    shim = _LinearIn(low)
    for mod in model.modules():
        if type(mod).__name__ not in ROUTER_CLASSES:
            continue
        module_globals = sys.modules[type(mod).__module__]

        def forward(hidden_states, _orig=mod.forward, _g=module_globals):
            saved = _g.F
            _g.F = shim
            try:
                return _orig(hidden_states)
            finally:
                _g.F = saved

        mod.forward = forward
    return model


#: FP8 bugs of the arithmetic (`load_model`'s fp8_bug): (activation format, channels per scale,
#: only in the routed experts).
FP8_ACTIVATION_BUGS = {"e5m2": ("e5m2", 128, False), "group512": ("e4m3", 512, False),
                       "moe-e5m2": ("e5m2", 128, True), "moe-group512": ("e4m3", 512, True)}


def as_fp8_yardstick(model, bug=None):
    """The dequantized float32 model made the FP8 yardstick in place: bfloat16, with the FP8 GEMMs'
    activation rounding emulated (`emulate_fp8_activations`); `bug` (an FP8_ACTIVATION_BUGS value)
    makes it an engine with that bug instead."""
    import torch

    model = route_in_dtype(model.to(torch.bfloat16), "fp8")
    if bug is None:
        emulate_fp8_activations(model, model.dsadapt_fp8_placed)
    else:
        fmt, group, moe_only = bug
        emulate_fp8_activations(model, model.dsadapt_fp8_placed, group=group, fmt=fmt, moe_only=moe_only)
    return model


# ----------------------------------------------------------------------------- block FP8


def float32_scale(model) -> float:
    """|w| |h| of the LM head: the RMS norm of its rows times that of the final (RMS-normed) hidden
    state, sqrt(hidden) x rms(final norm weight). Float32 rounding in the logits grows with it; the
    gate's strict tolerance scales by it (patcher/rules/logits.py, STRICT_SCALE)."""
    import math

    import torch

    head = model.get_output_embeddings().weight
    norm = model.model.norm.weight
    with torch.no_grad():
        sq = sum(float(head[i:i + 8192].float().pow(2).sum()) for i in range(0, head.shape[0], 8192))
        rms_row = math.sqrt(sq / head.shape[0])
        rms_norm = float(norm.float().pow(2).mean().sqrt())
    return rms_row * rms_norm * math.sqrt(head.shape[1])


def _blockfp8():
    """patcher/checkpoints/blockfp8.py (standalone: torch only), loaded by its path: this runner
    never imports dsadapt, but it always runs from dsadapt's own files."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "checkpoints" / "blockfp8.py"
    spec = importlib.util.spec_from_file_location("dsadapt_blockfp8", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fp8_block(config):
    """(rows, cols) of the config's block-FP8 quantization, or None."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method {q.get('quant_method')!r}: the reference dequantizes "
                         "block-FP8 checkpoints only")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size {block!r}: block-FP8 needs [rows, cols]")
    return int(block[0]), int(block[1])


def _headers(model_dir):
    """{tensor name: (file, dtype)} from the safetensors headers (stdlib only)."""
    import os
    import struct

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        with open(os.path.join(model_dir, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            for key, entry in json.loads(f.read(n)).items():
                if key != "__metadata__":
                    out[key] = (name, entry["dtype"])
    return out


_EXPERT = None


def _dest(state, name):
    """Where checkpoint tensor `name` goes in the model's state: the entry of the same name, or its
    expert's rows of transformers' fused ``experts.gate_up_proj`` (gate rows, then up rows) /
    ``experts.down_proj``; returns (state key, 2-D or 1-D view, part) or None."""
    import re

    global _EXPERT
    _EXPERT = _EXPERT or re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    if name in state:
        return name, state[name], None
    m = _EXPERT.match(name)
    if not m:
        return None
    prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
    key = f"{prefix}.down_proj" if which == "down" else f"{prefix}.gate_up_proj"
    if key not in state:
        return None
    fused = state[key][e]
    if which == "down":
        return key, fused, (e, which)
    half = fused.shape[0] // 2
    return key, (fused[:half] if which == "gate" else fused[half:]), (e, which)


def load_fp8_checkpoint(model, model_dir, block, n_layers, bug=None):
    """Fill `model` (float32, uninitialized) from a block-FP8 checkpoint, one tensor at a time: FP8
    weights widened to float32 on the model's device and multiplied by their block scales in
    place, the others cast; the MTP modules (layers >= `n_layers`) left out. Every parameter and
    persistent buffer must be filled. Returns the names of the FP8 weights dequantized."""
    import os
    import re

    import torch
    from safetensors import safe_open

    fp8 = _blockfp8()
    state = model.state_dict()
    layer_re = re.compile(r"^model\.layers\.(\d+)\.")
    headers = _headers(model_dir)
    by_file = {}
    for name, (fname, _) in headers.items():
        m = layer_re.match(name)
        if not name.endswith("_scale_inv") and not (m and int(m.group(1)) >= n_layers):
            by_file.setdefault(fname, []).append(name)
    filled, parts, placed = set(), {}, []
    with torch.no_grad():
        for fname, names in sorted(by_file.items()):
            with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
                for name in sorted(names):
                    dest = _dest(state, name)
                    if dest is None:
                        continue  # held by the checkpoint, not by this model (rotary tables, ...)
                    key, view, part = dest
                    t = f.get_tensor(name)
                    if headers[name][1].startswith("F8_"):
                        scale_file = headers[name + "_scale_inv"][0]
                        if scale_file == fname:
                            scale = f.get_tensor(name + "_scale_inv")
                        else:
                            with safe_open(os.path.join(model_dir, scale_file), framework="pt") as g:
                                scale = g.get_tensor(name + "_scale_inv")
                        if bug == "transposed":   # the grid read column-major: values land in the wrong blocks
                            scale = scale.flatten().reshape(scale.shape[1], scale.shape[0]).t()
                        elif bug == "inverse":    # scale applied as scale: weight / weight_scale_inv
                            scale = 1.0 / scale
                        t = t.to(view.device).to(torch.float32)
                        fp8.apply_scales_(t, scale.to(torch.float32), block)
                        placed.append(name)
                    if tuple(t.shape) != tuple(view.shape):
                        raise RuntimeError(f"{name} is {list(t.shape)} in the checkpoint, {list(view.shape)} in the model")
                    view.copy_(t)
                    del t
                    if part is None:
                        filled.add(key)
                    else:
                        parts.setdefault(key, set()).add(part)
    for key, got in parts.items():
        experts = state[key].shape[0]
        want = experts * (1 if key.endswith("down_proj") else 2)
        if len(got) == want:
            filled.add(key)
    missing = sorted(k for k in state if k not in filled)
    if missing:
        raise RuntimeError(f"the checkpoint does not fill {len(missing)} tensor(s) of the model: {missing[:3]}")
    return placed


def emulate_fp8_activations(model, placed, group=128, fmt="e4m3", moe_only=False):
    """What a block-FP8 engine does to the inputs of its FP8 GEMMs, in the (bfloat16) HF model:
    quantized to e4m3 per token and 128 channels, then scaled back. On every linear whose weight was
    FP8 (a forward pre-hook) and on the routed experts (both GEMMs of each expert). A planted bug
    (`FP8_ACTIVATION_BUGS`) rounds through `fmt` with one scale per `group` channels, everywhere or
    (`moe_only`) in the routed experts while the other GEMMs stay correct."""
    import types

    import torch

    fp8 = _blockfp8()
    linear = {n[: -len(".weight")] for n in placed if ".mlp.experts." not in n}
    experts = {n.split(".mlp.experts.")[0] + ".mlp.experts" for n in placed if ".mlp.experts." in n}
    lin_group, lin_fmt = (128, "e4m3") if moe_only else (group, fmt)

    def pre(module, args):
        return (fp8.quantize_activations(args[0], lin_group, lin_fmt),) + tuple(args[1:])

    def expert_forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        x = fp8.quantize_activations(hidden_states, group, fmt)
        for e in hit:
            e = int(e[0])
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            gate, up = torch.nn.functional.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = fp8.quantize_activations(self.act_fn(gate) * up, group, fmt)
            h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out

    for name, module in model.named_modules():
        if name in linear and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(pre)
        elif name in experts:
            module.forward = types.MethodType(expert_forward, module)


position_entry = kit.position_from_row


def _log_softmax(logits):
    import torch

    return torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), dim=-1)


def full_logprobs(model, ids):
    """log_softmax rows of one causal forward over `ids`: row i predicts token i+1 (on the CPU)."""
    import torch

    with torch.no_grad():
        return _log_softmax(model(torch.tensor([ids], device=model.device)).logits[0]).cpu()


def next_token(model, ids) -> int:
    """The argmax after `ids`: a full causal forward over all of them (no KV cache), the LM head on
    the last position only (the head is most of the cost at a 100k-token vocabulary)."""
    import torch

    with torch.no_grad():
        return int(model(torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1].argmax())


def exact_greedy(model, prompt, n):
    """Greedy continuation by full recomputation (no KV cache, EOS ignored): each token
    is the argmax of a full causal forward over everything before it. Returns the
    generated ids and the log-softmax rows of one last full forward over
    prompt + generated[:-1], from which all reported logprobs are taken; a final
    consistency check guards against argmax flips between forward lengths."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(model, seq))
    rows = full_logprobs(model, seq[:-1] if n else seq)
    flips = sum(int(rows[i - 1].argmax()) != seq[i] for i in range(len(prompt), len(seq)))
    return seq[len(prompt):], rows, flips


def result_from_rows(pid, batch, prompt, generated, rows, top_k):
    """A PromptResult document from the full-forward rows (row i predicts token i+1)."""
    full = list(prompt) + list(generated)
    prompt_lp = [None] + [position_entry(rows[i - 1], full[i], top_k) for i in range(1, len(prompt))]
    gen_lp = [position_entry(rows[i - 1], full[i], top_k) for i in range(len(prompt), len(full))]
    return kit.prompt_result({"id": pid, "batch": batch, "token_ids": prompt}, prompt_lp, generated, gen_lp)


def run_individual(model, prompt_docs, top_k, max_tokens):
    results, flips = [], 0
    for p in prompt_docs:
        generated, rows, f = exact_greedy(model, p["token_ids"], max_tokens)
        flips += f
        results.append(result_from_rows(p["id"], p.get("batch"), p["token_ids"], generated, rows, top_k))
    return results, flips


def padded_rows(model, seqs, pad_id=0):
    """Left-padded batch forward; returns per sequence its log-softmax rows (pads dropped)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], device=model.device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=model.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return [_log_softmax(logits[b, width - len(s):]).cpu() for b, s in enumerate(seqs)]


def run_padded(model, prompt_docs, top_k, max_tokens):
    """One left-padded batch, greedy by full recomputation of the whole batch per token."""
    seqs = [list(p["token_ids"]) for p in prompt_docs]
    for _ in range(max_tokens):
        rows = padded_rows(model, seqs)
        for s, r in zip(seqs, rows):
            s.append(int(r[-1].argmax()))
    rows = padded_rows(model, [s[:-1] if max_tokens else s for s in seqs])
    return [result_from_rows(p["id"], p.get("batch"), p["token_ids"], s[len(p["token_ids"]):], r, top_k)
            for p, s, r in zip(prompt_docs, seqs, rows)]


def run(model, prompt_docs, top_k, max_tokens, batch_mode="individual"):
    """All prompts: singles alone; each named batch individually or padded. Returns
    (prompt result documents in input order, greedy flip count)."""
    if batch_mode == "individual":
        return run_individual(model, prompt_docs, top_k, max_tokens)
    out = {}
    singles = [p for p in prompt_docs if not p.get("batch")]
    res, flips = run_individual(model, singles, top_k, max_tokens)
    out.update({r["id"]: r for r in res})
    for name in dict.fromkeys(p["batch"] for p in prompt_docs if p.get("batch")):
        members = [p for p in prompt_docs if p.get("batch") == name]
        out.update({r["id"]: r for r in run_padded(model, members, top_k, max_tokens)})
    return [out[p["id"]] for p in prompt_docs], flips


def capture_run(model, spec: dict, sequences: dict, meta: dict | None = None) -> dict:
    """One teacher-forced causal forward per sequence with the capture hooks installed
    (patcher/runners/capture.py); returns the capture document."""
    import torch
    from capture import Recorder

    rec = Recorder(spec)
    rec.install(model)
    try:
        with torch.no_grad():
            for pid, ids in sequences.items():
                rec.prompt = pid
                rec.begin_call(ids, list(range(len(ids))))
                model(torch.tensor([ids], device=model.device))
    finally:
        rec.remove()
    return rec.finish(sequences, meta=meta)


def capture_main(args) -> int:
    """Bisect mode: one teacher-forced forward per sequence per dtype with the capture hooks
    (patcher/runners/capture.py) installed; writes ``{dtype: capture document}``."""
    import torch
    import transformers
    from capture import load_spec

    spec = load_spec(args.capture_spec)
    with open(args.capture_sequences, encoding="utf-8") as f:
        sequences = {str(k): [int(t) for t in v] for k, v in json.load(f).items()}
    out, timings = {}, {}
    model = None
    for dtype in [d for d in args.capture_dtypes.split(",") if d]:
        t0 = time.time()
        if dtype == "fp8" and model is not None and getattr(model, "dsadapt_fp8_placed", None):
            model = as_fp8_yardstick(model)  # the float32 model just captured, cast: one load, not two
        else:
            model = None
            model = load_model(args.model, dtype, args.attn, args.experts, device=args.device)
        out[dtype] = capture_run(model, spec, sequences, meta={
            "engine": "transformers", "dtype": dtype, "transformers": transformers.__version__,
            "torch": torch.__version__, "device": args.device})
        timings[dtype] = round(time.time() - t0, 3)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    torch.save(out, args.capture)
    kit.say("hf_reference", f"captured {len(sequences)} sequences in "
                            f"{', '.join(f'{d} {s:.1f}s' for d, s in timings.items())} -> {args.capture}")
    return 0


def inspect_main(args) -> int:
    """Model-inspect mode: the structure of the checkpoint's activations (activation_stats.py) on the
    given prompts, float32 and each of --inspect-dtypes; writes one JSON document."""
    import torch
    import transformers
    from activation_stats import inspect

    sequences = [list(p["token_ids"]) for p in kit.load_prompts(args.prompts)]
    dtypes = [d for d in args.inspect_dtypes.split(",") if d]
    t0 = time.time()
    doc = inspect(lambda dt: load_model(args.model, dt, "eager", args.experts, device=args.device), sequences, dtypes,
                  fp8_from_float32=lambda m: as_fp8_yardstick(m) if getattr(m, "dsadapt_fp8_placed", None) else None)
    doc.update(transformers=transformers.__version__, torch=torch.__version__, device=args.device,
               seconds=round(time.time() - t0, 1))
    tmp = args.inspect + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    import os

    os.replace(tmp, args.inspect)
    kit.say("hf_reference", f"inspected {len(sequences)} sequences ({', '.join(['float32', *dtypes])}) in "
                            f"{doc['seconds']:.1f}s -> {args.inspect}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        # true float32: no TF32 anywhere (matmul's default is off; cuDNN's is on)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.capture:
        torch.manual_seed(0)
        return capture_main(args)
    if args.inspect:
        torch.manual_seed(0)
        return inspect_main(args)
    torch.manual_seed(0)
    device = {"device": "cpu", "threads": torch.get_num_threads()}
    if args.device == "cuda":
        device = {"device": "cuda", "gpu": torch.cuda.get_device_name(0), "cuda": str(torch.version.cuda),
                  "tf32": False}
    prompt_docs = kit.load_prompts(args.prompts)
    t0 = time.time()
    model = load_model(args.model, args.dtype, args.attn, args.experts, device=args.device)
    t1 = time.time()
    results, flips = run(model, prompt_docs, args.top_k, args.max_tokens, args.batch_mode)
    t2 = time.time()
    kit.write_report(args.out, kit.report(
        args, runner="hf_reference", engine="transformers", engine_version=transformers.__version__,
        versions={"torch": torch.__version__, "transformers": transformers.__version__,
                  "python": platform.python_version()},
        engine_path=transformers.__file__, prompts=results,
        settings={"attn": args.attn, "experts": args.experts, "batch_mode": args.batch_mode, **device,
                  "greedy_flips": flips, "float32_scale": round(float32_scale(model), 3),
                  **({"fp8": model.dsadapt_fp8} if hasattr(model, "dsadapt_fp8") else {})},
        timings={"load_s": round(t1 - t0, 3), "run_s": round(t2 - t1, 3)}))
    kit.say("hf_reference", f"{len(results)} prompts, load {t1 - t0:.1f}s, run {t2 - t1:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    kit.run(main)

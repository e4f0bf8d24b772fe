"""Calibrate `dsadapt bisect`'s per-module thresholds (docs/equivalence.md, "Bisect").

Two measurements, printed as tables for the doc:

  python tools/measure_bisect_noise.py summarize REPORT.json [REPORT.json ...]
      Bisect reports (`dsadapt bisect --json`, or the ``*-bisect.json`` written next to a check
      report) of CORRECT stacks: per dtype, the largest relative error per point family (float32)
      or the largest ratio engine error / reference's own error (bfloat16/float16), and the margin
      to the configured limit. Reports of PLANTED bugs (pass --bug NAME=REPORT) print the first
      point and its ratio: the other side of the margin.

  python tools/measure_bisect_noise.py hf-bugs MODEL_DIR [--dtype bfloat16] [--dtype float16]
      Bugs planted in HF transformers itself (in-process, CPU), compared against the clean float32
      reference with the reference's own low-precision run as the yardstick, exactly as an engine
      would be: the first point and its ratio per bug. Needs torch and transformers >= 5.15.

  python tools/measure_bisect_noise.py fp8-bugs FP8_MODEL_DIR [FP8_MODEL_DIR ...]
      The FP8 limits' CPU side, on block-FP8 checkpoints (`dsadapt model make --like deepseek-v3`,
      or a slice): HF's own FP8 arithmetic (the yardstick: e4m3 activations per token x 128
      channels at every FP8 GEMM, bfloat16 elsewhere) against HF float32 on the dequantized
      weights, at the logits (top-1, top-5 overlap, mean |Δ|: the fp8 logit rule) and per module;
      then block-scale bugs planted in the dequantization (the grid read column-major; the scale
      applied as `scale`, weight / weight_scale_inv) run the same way, as an engine would be judged.

The GPU calibration (LMDeploy, no float32 path) uses `summarize` on the reports that
tools/device/lmdeploy_h200.sh brings back from the H200 (docs/equivalence.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _load(path: str) -> dict:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") == "dsadapt.check-report/1":  # a check report: follow it to its bisect report
        b = doc.get("bisect") or {}
        if not b.get("report_path"):
            raise SystemExit(f"{path}: a check report without a bisect report")
        doc = json.loads(Path(b["report_path"]).read_text())
    if doc.get("schema") != "dsadapt.bisect-report/1":
        raise SystemExit(f"{path}: not a bisect report")
    return doc


def summarize(paths: list[str], bugs: list[str]) -> int:
    from patcher.rules.modules import LOW_PRECISION_POINT_RULES, STRICT_RULE

    by_dtype: dict[str, list[dict]] = defaultdict(list)
    for p in paths:
        by_dtype[_load(p)["dtype"]].append(_load(p))
    for dtype, docs in sorted(by_dtype.items()):
        strict = docs[0]["rule"] == "strict"
        worst: dict[str, tuple[float, str]] = {}
        for d in docs:
            for pt in d["points"]:
                if pt.get("error") is None or pt["metric"] != "rel_l2":
                    continue
                v = pt["error"] if strict else (pt["error"] / pt["noise"] if pt.get("noise") else None)
                if v is None:
                    continue
                where = f"{d.get('pin', '?')} {d.get('model', '?')} layer {pt['layer']}"
                if v > worst.get(pt["point"], (-1.0, ""))[0]:
                    worst[pt["point"]] = (v, where)
        unit = "relative error" if strict else "engine error / reference's own error"
        print(f"\n{dtype}: {len(docs)} correct-stack report(s), largest {unit} per point")
        print("| point | largest | where |\n|---|---|---|")
        for name, (v, where) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
            print(f"| {name} | {v:.3g} | {where} |")
        top = max(v for v, _ in worst.values()) if worst else float("nan")
        if strict:
            print(f"limit {STRICT_RULE.tolerance:g}: margin {STRICT_RULE.tolerance / top:.1f}x above the largest")
        else:
            rule = LOW_PRECISION_POINT_RULES[dtype]
            print(f"factor {rule.factor:g}: margin {rule.factor / top:.2f}x above the largest ratio {top:.3f}")
            # the verdict these reports get under the rule as it is now (per-point floors included),
            # recomputed from each point's error and the reference's own noise
            judged = [(rule.limit(pt["point"], pt.get("noise")) / pt["error"], d.get("model", "?"), pt["layer"], pt["point"])
                      for d in docs for pt in d["points"]
                      if pt.get("error") and pt["metric"] == "rel_l2"]
            above = [j for j in judged if j[0] < 1.0]
            m, model, layer, point = min(judged)
            print(f"under the current rule: {len(above)} point(s) above their limits; closest: {model} layer {layer} "
                  f"{point}, limit {m:.2f}x its error")
        agree = [(pt.get("value"), 1 - pt["noise"] if pt.get("noise") is not None else None)
                 for d in docs for pt in d["points"] if pt["metric"] == "agreement" and pt.get("value") is not None]
        if agree:
            gaps = [r - e for e, r in agree if r is not None]
            print(f"expert selection: engine agreement min {min(e for e, _ in agree):.3f}"
                  + (f"; reference's own minus engine's at most {max(gaps):.3f}" if gaps else ""))
    for spec in bugs:
        name, _, path = spec.partition("=")
        d = _load(path)
        f = d.get("first")
        if not f:
            print(f"\nbug {name} ({d['dtype']}): NOT FOUND — every point within its limit")
            continue
        ratio = f["error"] / f["noise"] if f.get("noise") else None
        print(f"\nbug {name} ({d['dtype']}): first divergence layer {f['layer']} {f['point']}: error "
              f"{f['error']:.4g}, limit {f['limit']:.4g}" + (f", {ratio:.2f}x the reference's own" if ratio else ""))
    return 0


def hf_bugs(model_dir: Path, dtypes: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "patcher" / "runners"))  # the runner imports its capture helper
    from equivalence_helpers import load_hf_reference  # the runner script, imported in-process

    from patcher.rules.modules import REFERENCE_TABLE, compare_captures
    from patcher.rules.prompts import build_prompt_set

    hfr = load_hf_reference()
    config = json.loads((model_dir / "config.json").read_text())
    spec = REFERENCE_TABLE.spec(config, "float32")
    seqs = {p.id: list(p.token_ids) for p in build_prompt_set(model_dir, 2)}

    def cap(model):
        return hfr.capture_run(model, spec, seqs)

    def each(attr, fn):
        def patch(m):
            for layer in m.model.layers:
                obj = layer
                for part in attr.split("."):
                    obj = getattr(obj, part, None)
                if obj is not None:
                    fn(obj)
        return patch

    bugs = {
        "kv_a_layernorm eps 1e-2": (None, each("self_attn.kv_a_layernorm", lambda n: setattr(n, "variance_epsilon", 1e-2))),
        "post_attention_layernorm eps 1e-2": (None, each("post_attention_layernorm",
                                                         lambda n: setattr(n, "variance_epsilon", 1e-2))),
        "softmax scale x1.05": (None, each("self_attn", lambda a: setattr(a, "scaling", a.scaling * 1.05))),
        "rope_interleave false": ({"rope_interleave": False}, None),
        "routed_scaling_factor 1": (None, each("mlp.gate", lambda g: setattr(g, "routed_scaling_factor", 1.0))),
    }
    ref = cap(hfr.load_model(model_dir))
    print("| dtype | bug | first point | error | reference's own | ratio |\n|---|---|---|---|---|---|")
    for dtype in dtypes:
        lp = cap(hfr.load_model(model_dir, dtype=dtype))
        clean = compare_captures(lp, ref, config, dtype, reference_lp=lp)
        print(f"| {dtype} | (none: the reference's own run) | {'-' if clean.passed else clean.first.where} | | | |")
        for name, (overrides, patch) in bugs.items():
            m = hfr.load_model(model_dir, dtype=dtype, config_overrides=overrides)
            if patch:
                patch(m)
            res = compare_captures(cap(m), ref, config, dtype, reference_lp=lp)
            f = res.first
            if f is None:
                print(f"| {dtype} | {name} | not found | | | |")
            elif f.metric == "agreement":
                print(f"| {dtype} | {name} | {f.where} | {f.value:.3f} agree | {1 - (f.noise or 0):.3f} | |")
            else:
                print(f"| {dtype} | {name} | {f.where} | {f.error:.4g} | {f.noise:.4g} | {f.error / f.noise:.2f} |")
    return 0


def fp8_bugs(model_dirs: list[Path]) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "patcher" / "runners"))
    from equivalence_helpers import load_hf_reference

    from patcher.rules.logits import LogitReport, compare
    from patcher.rules.modules import LOW_PRECISION_POINT_RULES, REFERENCE_TABLE, compare_captures
    from patcher.rules.prompts import build_prompt_set, prompts_to_json

    hfr = load_hf_reference()
    rule = LOW_PRECISION_POINT_RULES["fp8"]
    print("| model | run | logits: top-1 / top-5 overlap / mean abs | first point above its limit | error | yardstick | "
          "ratio | largest ratio of any point |\n|---|---|---|---|---|---|---|---|")
    for model_dir in model_dirs:
        config = json.loads((model_dir / "config.json").read_text())
        spec = REFERENCE_TABLE.spec(config, "float32")
        prompts = build_prompt_set(model_dir, 4)
        docs = prompts_to_json(prompts)["prompts"]
        seqs = {p.id: list(p.token_ids) for p in prompts}

        def logits(model, dtype, docs=docs):
            results, _ = hfr.run(model, docs, 20, 4)
            return LogitReport.from_json({"schema": "dsadapt.logit-report/1", "runner": "hf", "engine": "hf",
                                          "engine_version": "x", "dtype": dtype, "top_k": 20, "max_tokens": 4,
                                          "prompts": results})

        ref_model = hfr.load_model(model_dir)
        ref_logits, ref_cap = logits(ref_model, "float32"), hfr.capture_run(ref_model, spec, seqs)
        del ref_model
        yard = hfr.load_model(model_dir, dtype="fp8")
        yard_cap = hfr.capture_run(yard, spec, seqs)
        del yard
        runs = {"HF fp8 arithmetic (the yardstick)": None, "grid read column-major (transposed)": "transposed",
                "scale applied as scale (weight / weight_scale_inv)": "inverse"}
        for name, bug in runs.items():
            m = hfr.load_model(model_dir, dtype="fp8", fp8_bug=bug)
            c = compare(ref_logits, logits(m, "fp8"), 5)
            cap = yard_cap if bug is None else hfr.capture_run(m, spec, seqs)
            del m
            res = compare_captures(cap, ref_cap, config, "fp8", reference_lp=yard_cap)
            ratios = [p.error / max(p.noise, 1e-30) for p in res.points
                      if p.metric == "rel_l2" and p.error is not None and p.noise]
            s_ = c.summary
            head = f"| {model_dir.name} | {name} | {s_['top1']:.3f} / {s_['topk_overlap']:.3f} / {s_['mean_abs']:.4f} |"
            f = res.first
            if f is None:
                print(head + f" none | | | | {max(ratios, default=0):.2f} |")
            elif f.metric == "agreement":
                print(head + f" {f.where} | {f.value:.3f} agree | {1 - (f.noise or 0):.3f} | | |")
            else:
                print(head + f" {f.where} | {f.error:.4g} | {f.noise:.4g} | {f.error / f.noise:.1f} (limit "
                      f"{rule.factor}x, floor {rule.floor:g}) | {max(ratios, default=0):.1f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("reports", nargs="*")
    s.add_argument("--bug", action="append", default=[], help="NAME=REPORT of a planted bug")
    h = sub.add_parser("hf-bugs")
    h.add_argument("model", type=Path)
    h.add_argument("--dtype", action="append", default=None)
    f = sub.add_parser("fp8-bugs")
    f.add_argument("models", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "summarize":
        return summarize(args.reports, args.bug)
    if args.cmd == "fp8-bugs":
        return fp8_bugs(args.models)
    return hf_bugs(args.model, args.dtype or ["bfloat16", "float16"])


if __name__ == "__main__":
    sys.exit(main())

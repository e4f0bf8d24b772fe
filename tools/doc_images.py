"""The pictures of docs/user-guide.md ("Reading the plots"), drawn from committed reports with the
gate's own plotting (`patcher.rules.plots`), small: 80 dpi, 256-colour PNGs.

    python tools/doc_images.py [--reports DIR] [--out docs/img]

Run it again after `make reports` (and the H200's refresh) so the pictures show today's reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: picture -> (the committed report it is drawn from, what is drawn)
PICTURES = {
    "check-float32.png": ("vllm/v0.32.0/v3-transformers-float32.json", "deltas"),
    "check-bfloat16.png": ("vllm/v0.32.0/v3-transformers-bfloat16.json", "deltas"),
    "check-real-shape.png": ("lmdeploy/v0.18.0/fp8/2026-12-01-a/correct-deepseek-v3-slice4-fp8.json", "deltas"),
    "bisect-pass.png": ("vllm/v0.32.0/v3-transformers-bfloat16-bisect.json", "bisect"),
    "bisect-fail.png": ("lmdeploy/v0.18.0/fp8/2026-12-01-a/planted-transposed-deepseek-v3-slice4-fp8-bisect.json",
                        "bisect"),
    "perf.png": ("vllm/v0.32.0/perf-v3-deepseek-float32.json", "perf"),
}


def original_max(doc: dict) -> int | None:
    prov = doc.get("provenance") or {}
    if "original_max_position_embeddings" in prov:
        return prov["original_max_position_embeddings"]
    from patcher.checkpoints import tiny
    from patcher.rules.prompts import rope_original_max

    if doc.get("model") in tiny.VARIANTS:
        return rope_original_max(tiny.deepseek_config(doc["model"]))
    ckpt = prov.get("checkpoint") or {}
    if ckpt.get("model_type") == "deepseek_v3":  # DeepSeek-V3's released config: YaRN from 4096 positions
        return 4096
    return None


def draw(kind: str, path: Path):
    from patcher.rules import plots

    doc = json.loads(path.read_text(encoding="utf-8"))
    if kind == "perf":
        return plots.perf_figure(doc)
    if kind == "bisect":
        check = json.loads(path.with_name(path.name.replace("-bisect.json", ".json")).read_text(encoding="utf-8"))
        return plots.bisect_figure(doc, title=plots.title_of(check["pin"], check) + ": per-module error vs HF")
    return plots.deltas_figure(doc["comparison"], title=plots.title_of(doc["pin"], doc), original_max=original_max(doc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", type=Path, default=ROOT / "reports")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    a = ap.parse_args(argv)
    from patcher.rules.plots import save_png

    missing = 0
    for name, (rel, kind) in PICTURES.items():
        src = a.reports / rel
        if not src.is_file():
            print(f"missing: {src} (for {name})", file=sys.stderr)
            missing += 1
            continue
        out = save_png(draw(kind, src), a.out / name, dpi=80)
        print(f"{out}: {out.stat().st_size // 1024} KiB from {rel}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())

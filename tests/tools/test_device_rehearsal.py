"""The device call, rehearsed here: tools/device/lmdeploy_h200.sh on the toy engine, CPU, no network.

The GPU machine's time is short, so its one call must not fail on a typo. This runs the very
script the lead runs there, through the same product path (bundle with an extra planted stack ->
bootstrap.py -> install --offline, which seeds the planted stack's environment from the main one
-> chains of dsadapt commands in parallel -> summary.txt / summary.json / reports.tgz in $OUT),
with the toy engine of tests/fixtures/toyengine standing for LMDeploy, and then turns what comes
back into tables with the tool the docs' tables come from (tools/calibrate_low_precision.py).
The fast tests check the committed calibration plan itself: every chain line parses as the
dsadapt command it names, every stack it names is one the bundle script carries, and every
planted patch is a well-formed stack patch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO_ROOT, git
from toy_engine_support import FIXTURE, PIN, TAG, toy  # noqa: F401 - the toy project fixture

DEVICE = REPO_ROOT / "tools" / "device"


def _chain_lines(text: str) -> list[list[str]]:
    """The commands of a chains file, as the script reads it (comment lines and blank lines skipped)."""
    return [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _planted_names() -> set[str]:
    text = (DEVICE / "prepare_bundle.sh").read_text()
    block = text.split('PLANTED=${PLANTED-"', 1)[1].split('"}', 1)[0]
    return {item.split("=", 1)[0] for item in block.split()}


def _parse_as_dsadapt(cmd: str, args: list[str]) -> None:
    """Parse one chain command with dsadapt's own CLI, as the device script would run it (not run)."""
    import click

    from patcher.cli.main import cli

    full = [cmd, "lmdeploy@v0.18.0", "--variant", "pytorch", "--publish", *args, "--json"]
    ctx = cli.make_context("dsadapt", ["--project", str(REPO_ROOT), *full], resilient_parsing=False)
    sub = cli.get_command(ctx, cmd)
    assert sub is not None, cmd
    with click.Context(sub, parent=ctx, info_name=cmd) as sctx:
        sub.parse_args(sctx, full[1:])


def test_calibration_chains_parse_as_dsadapt_commands():
    """Every line of the committed plan is a command dsadapt accepts (parsed by its own CLI, not run),
    on a stack the bundle carries; the plan covers every built-in model in both dtypes three times."""
    lines = _chain_lines((DEVICE / "calibration.chains").read_text())
    stacks = _planted_names()
    seen: dict[tuple[str, str], int] = {}
    for chain, stack, cmd, *args in lines:
        assert stack == "main" or stack in stacks, (chain, stack)
        _parse_as_dsadapt(cmd, args)
        if stack == "main" and cmd == "check":
            key = (args[args.index("--model") + 1], args[args.index("--dtype") + 1])
            seen[key] = seen.get(key, 0) + 1
    assert {k: v for k, v in seen.items() if v >= 3} == {(m, d): 3 for m in ("v3", "v2-lite", "v2")
                                                          for d in ("bfloat16", "float16")}
    planted = {(s, a[a.index("--dtype") + 1]) for _, s, _, *a in lines if s != "main"}
    assert planted == {(s, d) for s in stacks for d in ("bfloat16", "float16")}  # every bug in each dtype


def test_every_chains_file_parses_as_dsadapt_commands_on_carried_stacks():
    """Every committed plan (calibration, seeded control runs, the engine-like-router remeasurement,
    the H200 round): each line a command dsadapt's own CLI accepts, on the main stack or one the
    bundle carries."""
    stacks = _planted_names() | {"tp-absorbed", "tp-group-limit", "fp8-scale"}
    files = sorted(DEVICE.glob("*.chains"))
    assert {"calibration.chains", "seeds.chains", "yardstick.chains"} <= {f.name for f in files}
    for f in files:
        for chain, stack, *rest in _chain_lines(f.read_text()):
            while rest and "=" in rest[0] and rest[0].split("=", 1)[0].isupper():
                rest = rest[1:]  # a command's own environment (NAME=VALUE)
            cmd, *args = rest
            assert stack == "main" or stack in stacks, (f.name, chain, stack)
            _parse_as_dsadapt(cmd, args)


def test_planted_stacks_are_the_committed_patches():
    """Each planted LMDeploy patch the bundle carries is a normalized stack patch (Upstream-Status
    Inappropriate, Covered-By), touching the engine tree only, one small change."""
    from patcher.formats.patchfile import parse_patch

    text = (DEVICE / "prepare_bundle.sh").read_text()
    block = text.split('PLANTED=${PLANTED-"', 1)[1].split('"}', 1)[0]
    for item in block.split():
        name, rel = item.split("=", 1)
        patch = parse_patch((REPO_ROOT / rel).read_text(), rel)
        assert (patch.upstream_status or "").startswith("Inappropriate"), name
        assert patch.trailer_values("Covered-By"), name
        changed = [ln for ln in (REPO_ROOT / rel).read_text().splitlines()
                   if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
        assert 2 <= len(changed) <= 8, (name, changed)
        assert all("lmdeploy/" in ln for ln in (REPO_ROOT / rel).read_text().splitlines() if ln.startswith("+++ "))


def _host_probe(path: Path, env: dict) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                       capture_output=True, text=True, env=env, check=True)
    path.write_text(r.stdout)
    return path


def _planted_stack(toy, tmp_path: Path) -> Path:  # noqa: F811
    """The toy stack plus a planted bug (softmax scale x1.05), made through the product: apply,
    commit in the checkout, refresh; the project's own stack is put back afterwards."""
    run, root, work = toy["run"], toy["root"], toy["work"]
    assert run("apply", PIN).returncode == 0
    co = work / "checkouts" / "toy" / TAG
    model = co / "toyds" / "model.py"
    model.write_text(model.read_text().replace("self.scale = qk_head_dim ** -0.5",
                                               "self.scale = qk_head_dim ** -0.5 * 1.05", 1))
    git(co, "commit", "-q", "-am", "Plant a bug: softmax scale x1.05\n\nUpstream-Status: Inappropriate [test]\n"
                                   "Covered-By: tests/tools/test_device_rehearsal.py")
    r = run("refresh", PIN)
    assert r.returncode == 0, r.stderr
    stack = root / "patches" / "toy" / TAG
    planted = tmp_path / "planted"
    shutil.copytree(stack, planted)
    shutil.rmtree(stack)
    shutil.copytree(FIXTURE / "stack", stack)
    r = run("apply", PIN, "--force")  # the checkout back on the project's stack (the planted branch kept in a backup ref)
    assert r.returncode == 0, r.stderr
    assert len([ln for ln in (planted / "series").read_text().splitlines() if ln.endswith(".patch")]) == 2
    return planted


@pytest.mark.slow  # a few minutes: a wheel build, bootstrap, three environments, four gate runs
def test_the_device_script_runs_the_chains_through_the_product(toy, tmp_path):  # noqa: F811
    run = toy["run"]
    offline_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSADAPT_", "PIP_"))}
    offline_env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull,
                        "PYTHONPATH": str(FIXTURE)})
    probe = _host_probe(tmp_path / "host.json", offline_env)
    planted = _planted_stack(toy, tmp_path)

    bundle = tmp_path / "carry" / "gpu"
    r = run("bundle", PIN, "--have", str(probe), "--out", str(bundle), "--stack", f"scale={planted}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert set(res["stacks"]) == {"scale"}
    manifest = json.loads((bundle / "bundle.json").read_text())
    extra = manifest["stacks"]["scale"]
    assert extra["stack_hash"] != manifest["stack_hash"] and (bundle / extra["build"]["file"]).is_file()
    assert (bundle / "stacks" / "scale" / "patches" / "toy" / TAG / "series").is_file()
    # the overlay carries the planted stack's files, not the pin's (each stack is built in its own checkout)
    import zipfile

    with zipfile.ZipFile(bundle / extra["build"]["file"]) as z:
        assert "qk_head_dim ** -0.5 * 1.05" in z.read("toyds/model.py").decode()
    with zipfile.ZipFile(bundle / manifest["builds"]["patched"]["file"]) as z:
        assert "qk_head_dim ** -0.5 * 1.05" not in z.read("toyds/model.py").decode()
    # an extra stack costs its overlay wheel (and its patches), nothing more
    extra_bytes = sum(f.stat().st_size for f in (bundle / "stacks").rglob("*") if f.is_file())
    assert extra_bytes < 200_000, extra_bytes

    # bad --stack values are refused before anything is built
    for bad in ("noequals", f"main={planted}", f"x={tmp_path}"):
        r = run("bundle", PIN, "--out", str(tmp_path / "nope"), "--stack", bad)
        assert r.returncode == 2 and not (tmp_path / "nope").exists(), (bad, r.stderr)

    out = tmp_path / "OUT"
    chains = ("first main check --model v2-lite --config-style deepseek\n"
              "a scale check --model v2-lite --config-style deepseek\n"
              "b main check --model v2-lite --config-style deepseek\n"
              "b main check --model v2-lite --config-style deepseek --unpatched\n"
              # the parallel path's lines: an environment word for one command, --tp (the toy runs in one
              # process, so TP 2 is the exit 6 a one-GPU machine gives LMDeploy's)
              "c main LMDEPLOY_EXECUTOR_BACKEND=mp check --model v2-lite --config-style deepseek --tp 1\n"
              "c scale check --model v2-lite --config-style deepseek --tp 2\n")
    env = {**offline_env, "DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": "", "OUT": str(out), "CHAINS": chains,
           "PIN": PIN, "VARIANT": "cpu", "PYTHON": sys.executable, "DEADLINE": "1500", "CMD_S": "600"}
    r = subprocess.run(["bash", str(DEVICE / "lmdeploy_h200.sh"), str(bundle)], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-2000:])
    files = sorted(p.name for p in out.iterdir())
    assert files == ["host-pip-list.json", "install.json", "log.txt", "reports.tgz", "summary.json", "summary.txt"]
    assert len(files) <= 8  # the device returns 8 files at most, whatever the number of chains
    installed = json.loads((out / "install.json").read_text())
    assert set(installed["stacks"]) == {"scale"} and installed["stacks"]["scale"]["seconds"] < 120
    summary = json.loads((out / "summary.json").read_text())
    got = {(row["chain"], row["stack"], row["command"]): [c["verdict"] for c in row["checks"]] for row in summary}
    assert got == {
        ("first", "main", "check --model v2-lite --config-style deepseek"): ["pass"],  # alone, before the fan-out
        ("a", "scale", "check --model v2-lite --config-style deepseek"): ["fail"],  # the planted bug
        ("b", "main", "check --model v2-lite --config-style deepseek"): ["pass"],
        ("b", "main", "check --model v2-lite --config-style deepseek --unpatched"): ["fail"],  # the release
        ("c", "main", "check --model v2-lite --config-style deepseek --tp 1"): ["pass"],
        ("c", "scale", "check --model v2-lite --config-style deepseek --tp 2"): ["error"],  # exit 6, said why
    }, (out / "summary.txt").read_text()
    text = (out / "summary.txt").read_text()
    assert "below its limit" in text and "above its limit" in text and "6 commands: error 1, fail 2, pass 3" in text
    tp1 = next(r for r in summary if r["chain"] == "c" and r["stack"] == "main")
    assert tp1["env"] == "LMDEPLOY_EXECUTOR_BACKEND=mp" and tp1["rc"] == 0
    assert json.loads(Path(tp1["file"]).read_text())["parallel"]["label"] == "tp1"
    tp2 = next(r for r in summary if r["chain"] == "c" and r["stack"] == "scale")
    assert tp2["rc"] == 6 and "runs the gate in one process only" in \
        json.loads(Path(tp2["file"]).read_text())["error"]["message"]
    # the planted run used the planted environment, seeded from the main one
    row = next(r for r in summary if r["stack"] == "scale")
    detail = json.loads(Path(row["file"]).read_text())
    assert detail["provenance"]["installed"]["venv"].startswith(str(bundle / "stacks" / "scale"))
    assert detail["provenance"]["stack_hash"] == extra["stack_hash"]

    # what comes back becomes the docs' tables
    unpacked = tmp_path / "back"
    unpacked.mkdir()
    with tarfile.open(out / "reports.tgz") as t:
        t.extractall(unpacked, filter="data")
    assert any(unpacked.glob("stacks/scale/reports/toy/*/*.json")) and any(unpacked.glob("reports/toy/*/*.json"))
    r = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "calibrate_low_precision.py"), "table",
                        str(unpacked)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr
    assert "| scale |" in r.stdout and "| main |" in r.stdout, r.stdout

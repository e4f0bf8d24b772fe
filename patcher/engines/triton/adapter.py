"""Triton's vLLM backend: no compiled code.

- build: the applied backend (`src/`: model.py + utils/) laid out as `backends/vllm/`, a sample
  model repository (`config.pbtxt` with backend "vllm", `1/model.json`), packed into a
  reproducible tarball; the served engine is the pin named by `serves` in the lock.
- environment: the served pin's own recipe in a separate environment ('<pin>-<variant>-triton')
  with nvidia-pytriton added (it ships tritonserver, its python backend and stubs).
- gate / serve: a real tritonserver is started on 127.0.0.1 with the backend and the model,
  and queried by the Triton runner (runner.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from patcher.base.errors import EngineUnavailable, plural
from patcher.base.fsutil import sha256_file
from patcher.engines.base import (
    BuildKind,
    BuildResult,
    BuildServices,
    EngineBase,
    EnvPlan,
    GateRun,
    GateSession,
    RunServices,
    Served,
    Tree,
    VariantSpec,
)
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.stackfiles import Stack
from patcher.runners.launch import RunnerSpec

HERE = Path(__file__).resolve().parent

#: What the served engine's environment needs on top of the engine (the stub is built
#: against numpy 1.x; numpy 2 corrupts BYTES inputs).
SERVER_REQUIREMENTS = ("nvidia-pytriton==0.7.0", "numpy<2", "tritonclient[http]")
MODEL_NAME = "deepseek"
#: Seconds tritonserver gets to load the backend and the model. About a minute on an idle
#: 2-core machine; vLLM's engine start alone took 315 s under a load average of 12.
SERVER_READY_TIMEOUT_S = 900.0


def _tar_dir(src: Path, out: Path) -> None:
    """Deterministic tar.gz: sorted names, zero mtimes/uids, fixed gzip header."""
    import gzip
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(src.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(Path(src.name) / p.relative_to(src)))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644
            if p.is_file():
                with open(p, "rb") as member:
                    tar.addfile(info, member)
            else:
                tar.addfile(info)
    with open(out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(buf.getvalue())


def export_src(tree: Tree, dest: Path) -> Path:
    """vllm_backend's src/ (model.py + utils/) of the checkout's tree, written to dest."""
    import io
    import tarfile

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", tree.rev, "src"],
                             cwd=tree.path, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith("src/"):
                continue
            target = dest / m.name[len("src/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())  # type: ignore[union-attr]
    return dest


class TritonEngine(EngineBase):
    name = "triton"
    git_url = "https://github.com/triton-inference-server/vllm_backend.git"
    pypi = ()
    packages = ()
    variants = (VariantSpec("cpu", "", "cpu", description="served by tritonserver from nvidia-pytriton"),)
    tag_prefix = "r"
    docs_page = "docs/engines/triton.md"
    # the client side of a served model: per-run --url/--model-name come from the server session
    runner = RunnerSpec("triton", HERE / "runner.py", dtypes=("float32", "bfloat16", "float16"))
    serve_api = "triton-generate"
    compile_note = "nothing to compile upstream: the backend is Python files copied into Triton's backends dir"

    # -- build

    def build_kind(self, stack: Stack) -> BuildKind:
        return BuildKind("backend")

    def build(self, entry: LockEntry, spec: VariantSpec, stack: Stack, out_dir: Path,
              svc: BuildServices) -> BuildResult:
        from patcher.engines.triton.server import config_pbtxt, vllm_model

        t0 = time.monotonic()
        tree = svc.checkout(entry.ref)
        name = f"triton-{entry.tag}+ds.{stack.hash[:8]}"
        dest = out_dir / name
        if dest.exists():
            shutil.rmtree(dest)
        export_src(tree, dest / "backends" / "vllm")
        model = vllm_model(MODEL_NAME, Path("/path/to/deepseek-model"))
        repo = dest / "model_repository" / MODEL_NAME
        (repo / "1").mkdir(parents=True)
        (repo / "config.pbtxt").write_text(config_pbtxt(model))
        (repo / "1" / "model.json").write_text(json.dumps(dict(model.engine_args), indent=2, sort_keys=True) + "\n")
        served = entry.serves or "no pinned engine (see the lock note)"
        (dest / "README.txt").write_text(
            f"dsadapt build of {entry.ref} (stack {stack.hash[:10]}, {plural(len(stack), 'patch')})\n\n"
            f"backends/vllm/            the patched vllm_backend (copy to <backend-directory>/vllm)\n"
            f"model_repository/{MODEL_NAME}/  a sample model: edit 1/model.json's \"model\"\n\n"
            f"Serves: {served}. Install that pin's patched engine (`dsadapt install {served}`) plus "
            f"{' '.join(SERVER_REQUIREMENTS)} into the environment tritonserver runs the backend with,\n"
            f"or let `dsadapt serve {entry.ref}` do all of it.\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        tarball = out_dir / f"{name}.tar.gz"
        _tar_dir(dest, tarball)
        return BuildResult(ref=str(entry.ref), variant=spec.name, kind="backend", artifact=str(tarball),
                           sha256=sha256_file(tarball), size=tarball.stat().st_size,
                           seconds=round(time.monotonic() - t0, 2), stack_hash=stack.hash,
                           version=f"{entry.tag}+ds.{stack.hash[:8]}",
                           how=f"backend directory {dest} (src/ of the applied checkout + sample model "
                               f"repository); serves {served}")

    # -- environment: the served engine's own, with the server added

    def env_plan(self, entry: LockEntry, spec: VariantSpec, lock: Lock) -> EnvPlan:
        from patcher.engines.registry import engine

        if not entry.serves:
            raise EngineUnavailable(f"{entry} serves no pinned engine ({entry.note or 'see upstream.lock'})",
                                    hint="it can be applied and built here, not served")
        served = lock.pin(entry.serves)
        served_engine = engine(served.engine)
        plan = served_engine.env_plan(served, served_engine.variant_for(served, None), lock)
        return replace(plan, suffix="-triton", recipe=replace(plan.recipe, post=plan.recipe.post + SERVER_REQUIREMENTS),
                       note=f"serving environment of {entry.ref}: {served.ref} with tritonserver "
                            f"(start it with `dsadapt serve {entry.ref}`)")

    # -- the gate and serving

    def run_blocker(self, entry: LockEntry, spec: VariantSpec) -> str | None:
        if not entry.serves:
            return entry.note or "serves no pinned engine"
        return super().run_blocker(entry, spec)

    @contextmanager
    def serve(self, run: GateRun, svc: RunServices, port: int | None = None) -> Iterator[Served]:
        """The applied backend (or the pristine one, `run.unpatched`) served by tritonserver with
        the served pin's engine (pristine with `run.unpatched_engine`), on 127.0.0.1."""
        from patcher.engines.triton.server import prepare, serve, vllm_model

        entry = run.entry
        root = svc.cfg.workdir / "serve" / f"{entry.engine}-{entry.tag}"
        tree = svc.checkout(entry.ref, patched=not run.unpatched)
        src = export_src(tree, root / ("src-unpatched" if run.unpatched else "src"))
        plan = self.env_plan(entry, run.variant, svc.lock)
        env = svc.environment(plan, unpatched=run.unpatched_engine)
        layout = prepare(root, env.venv, [vllm_model(MODEL_NAME, run.model_dir, dtype=run.dtype)], {"vllm": src})
        log_path = root / "tritonserver.log"
        if svc.progress:
            svc.progress(f"starting tritonserver for {entry.ref} (model load takes about a minute on CPU); "
                         f"log: {log_path}")
        with serve(layout, port=port, log_path=log_path, ready_timeout_s=SERVER_READY_TIMEOUT_S) as server:
            body = {"text_input": "Hello", "parameters": {"temperature": 0, "max_tokens": 8, "logprobs": 3},
                    "exclude_input_in_output": True, "return_logprobs": True}
            yield Served(url=server.url, model=MODEL_NAME, log_path=server.log_path, pid=server.pid,
                         api=self.serve_api or "", python=env.python,
                         installed={**env.provenance(), "served": str(plan.pin), "server_log": str(server.log_path)},
                         usage=(f"curl -s {server.url}/v2/models/{MODEL_NAME}/generate -d '{json.dumps(body)}'",
                                "python: import tritonclient.http as h; h.InferenceServerClient('"
                                f"{server.url.removeprefix('http://')}').is_model_ready('{MODEL_NAME}')"))

    @contextmanager
    def gate_session(self, run: GateRun, svc: RunServices) -> Iterator[GateSession]:
        assert self.runner is not None
        with self.serve(run, svc) as served:
            runner = replace(self.runner, extra_args=("--url", served.url, "--model-name", served.model))
            assert served.python is not None
            yield GateSession(served.python, runner, {}, served.installed)

    # -- bisect: a server hides the model from hooks, so the vLLM build it serves is captured
    #    in-process by vLLM's own runner, in this pin's serving environment (the backend itself
    #    computes no tensor of the model)

    @property
    def bisect_table(self):
        from patcher.engines.registry import engine

        return engine("vllm").bisect_table

    @contextmanager
    def bisect_session(self, run: GateRun, svc: RunServices) -> Iterator[GateSession]:
        from patcher.engines.registry import engine

        plan = self.env_plan(run.entry, run.variant, svc.lock)
        env = svc.environment(plan, unpatched=run.unpatched_engine)
        served_engine = engine(plan.pin.engine)
        assert served_engine.runner is not None
        yield GateSession(env.python, served_engine.runner, {}, {**env.provenance(), "served": str(plan.pin)})

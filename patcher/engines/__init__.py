"""Engines: found through the entry-point group ``dsadapt.engines``, loaded when first asked for.

Each entry point names an engine (the lock's ``[engines.<name>]``) and the adapter class that
implements `patcher.engines.base.Engine`; dsadapt's own engines are declared in its
pyproject.toml like any other package's::

    [project.entry-points."dsadapt.engines"]
    vllm = "patcher.engines.vllm.adapter:VllmEngine"

An engine can therefore live in another distribution: install it (or put its ``*.dist-info``
with an ``entry_points.txt`` on the path) and dsadapt finds it. Nothing is imported until an
engine is asked for, so ``dsadapt --help`` never pays for the engines. Run from a source
checkout where the dsadapt distribution is not installed, its own entry points are read from
the pyproject.toml next to the package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from patcher.base.errors import MachineError, UsageError

if TYPE_CHECKING:
    from patcher.engines.base import Engine

GROUP = "dsadapt.engines"
DIST = "dsadapt"


class EngineLoadError(MachineError):
    """An engine's entry point exists but does not load into an adapter: an installed package is
    broken, not the user's input (exit 7, like any tool that fails on this machine)."""


@dataclass(frozen=True)
class EngineEntry:
    name: str
    value: str       # "module:attribute"
    dist: str        # the distribution declaring it


_ENTRIES: dict[str, EngineEntry] | None = None
_LOADED: dict[str, Engine] = {}


def _pyproject_entries() -> list[EngineEntry]:
    """dsadapt's own declaration, read from pyproject.toml when its metadata is not installed."""
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return []
    table = data.get("project", {}).get("entry-points", {}).get(GROUP, {})
    return [EngineEntry(n, v, DIST) for n, v in table.items()] if data.get("project", {}).get("name") == DIST else []


def entries() -> dict[str, EngineEntry]:
    """Every declared engine by name (metadata only: nothing is imported)."""
    global _ENTRIES
    if _ENTRIES is None:
        from importlib.metadata import entry_points

        found: dict[str, EngineEntry] = {}
        own = False
        for ep in entry_points(group=GROUP):
            dist = ep.dist.name if ep.dist is not None else "?"
            own |= dist == DIST
            found.setdefault(ep.name, EngineEntry(ep.name, ep.value, dist))
        if not own:
            for e in _pyproject_entries():
                found.setdefault(e.name, e)
        _ENTRIES = found
    return _ENTRIES


def engine_names() -> list[str]:
    return sorted(entries())


def engine(name: str) -> Engine:
    """The adapter of engine `name`, loaded on first use."""
    if name in _LOADED:
        return _LOADED[name]
    known = entries()
    if name not in known:
        raise UsageError(f"no adapter for engine '{name}'",
                         hint=f"known engines: {', '.join(sorted(known)) or 'none'}; an engine is a package "
                              f"registered under the '{GROUP}' entry point (docs/architecture.md)")
    _LOADED[name] = _load(known[name])
    return _LOADED[name]


def _load(e: EngineEntry) -> Engine:
    from patcher.engines.base import Engine

    module, _, attr = e.value.partition(":")
    try:
        obj = importlib.import_module(module.strip())
        for part in attr.strip().split(".") if attr.strip() else []:
            obj = getattr(obj, part)
        adapter = obj() if isinstance(obj, type) else obj
    except Exception as err:  # a broken plugin: say which and why, never a traceback
        raise EngineLoadError(f"engine '{e.name}' ({e.value}, from {e.dist}) does not load: "
                              f"{type(err).__name__}: {err}",
                              hint=f"fix or uninstall the package {e.dist}") from None
    if not isinstance(adapter, Engine):
        missing = [m for m in _protocol_members() if not hasattr(adapter, m)]
        raise EngineLoadError(f"engine '{e.name}' ({e.value}) does not implement the engine protocol "
                              f"(missing: {', '.join(missing[:6]) or '?'})",
                              hint="derive the adapter from patcher.engines.base.WheelEngine or EngineBase")
    if adapter.name != e.name:
        raise EngineLoadError(f"entry point '{e.name}' ({e.value}) loads the adapter of '{adapter.name}'",
                              hint=f"name the entry point after the engine ({adapter.name})")
    return adapter


def _protocol_members() -> list[str]:
    from patcher.engines.base import Engine

    return sorted(m for m in dir(Engine) if not m.startswith("_")) + \
        sorted(getattr(Engine, "__annotations__", {}))


def adapter(name: str) -> Engine:
    """The adapter of engine `name` (the older name of `engine`)."""
    return engine(name)


def reset() -> None:
    """Forget what was found and loaded (tests that install an engine mid-run)."""
    global _ENTRIES
    _ENTRIES = None
    _LOADED.clear()

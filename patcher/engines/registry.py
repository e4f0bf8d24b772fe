"""Engines: found through the entry-point group ``dsadapt.engines``, loaded when first asked for.

Each entry point names an engine (the lock's ``[engines.<name>]``) and the adapter class that
implements `patcher.engines.base.Engine`; dsadapt's own engines are declared in its
pyproject.toml like any other package's::

    [project.entry-points."dsadapt.engines"]
    vllm = "patcher.engines.vllm.adapter:VllmEngine"

An engine can therefore live in another distribution: install it (or put its ``*.dist-info``
with an ``entry_points.txt`` on the path) and dsadapt finds it. Nothing is imported until an
engine is asked for, so ``dsadapt --help`` never pays for the engines.

Start-up: dsadapt's own engines are also named in `OWN` (the same table as its pyproject's
entry points; tests/project/test_architecture.py keeps the two equal), so asking for one of them
(`dsadapt list` on the shipped lock) loads its adapter without reading any distribution's
metadata -- `importlib.metadata` and the scan of every installed package cost more than the
rest of such a command. Installed packages are scanned when an engine outside `OWN` is asked
for, or when every engine is listed (`entries`, `engine_names`). A plugin cannot replace one of
dsadapt's own engines: its entry point of the same name is ignored.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
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


#: dsadapt's own engines: pyproject.toml's ``[project.entry-points."dsadapt.engines"]``, here too so
#: that they load without a metadata scan (see the module's doc).
OWN: dict[str, str] = {
    "vllm": "patcher.engines.vllm.adapter:VllmEngine",
    "lmdeploy": "patcher.engines.lmdeploy.adapter:LmdeployEngine",
    "triton": "patcher.engines.triton.adapter:TritonEngine",
}

_ENTRIES: dict[str, EngineEntry] | None = None
_LOADED: dict[str, Engine] = {}


def entries() -> dict[str, EngineEntry]:
    """Every declared engine by name: dsadapt's own, then every installed package's (metadata
    only: nothing is imported)."""
    global _ENTRIES
    if _ENTRIES is None:
        from importlib.metadata import entry_points

        found = {n: EngineEntry(n, v, DIST) for n, v in OWN.items()}
        for ep in entry_points(group=GROUP):
            if ep.name not in found:
                found[ep.name] = EngineEntry(ep.name, ep.value, ep.dist.name if ep.dist is not None else "?")
        _ENTRIES = found
    return _ENTRIES


def engine_names() -> list[str]:
    return sorted(entries())


def engine(name: str) -> Engine:
    """The adapter of engine `name`, loaded on first use."""
    if name in _LOADED:
        return _LOADED[name]
    if name in OWN:  # no metadata scan for dsadapt's own engines
        _LOADED[name] = _load(EngineEntry(name, OWN[name], DIST))
        return _LOADED[name]
    known = entries()
    if name not in known:
        raise UsageError(f"no adapter for engine '{name}'",
                         hint=f"known engines: {', '.join(sorted(known)) or 'none'}; an engine is a package "
                              f"registered under the '{GROUP}' entry point (docs/architecture.md)")
    _LOADED[name] = _load(known[name])
    return _LOADED[name]


def _load(e: EngineEntry) -> Engine:
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
    missing = [m for m in _protocol_members() if not _declares(adapter, m)]
    if missing:
        raise EngineLoadError(f"engine '{e.name}' ({e.value}) does not implement the engine protocol "
                              f"(missing: {', '.join(missing[:6]) or '?'})",
                              hint="derive the adapter from patcher.engines.base.WheelEngine or EngineBase")
    if adapter.name != e.name:
        raise EngineLoadError(f"entry point '{e.name}' ({e.value}) loads the adapter of '{adapter.name}'",
                              hint=f"name the entry point after the engine ({adapter.name})")
    return adapter


def _protocol_members() -> list[str]:
    """What `Engine` asks for: its methods and its data attributes."""
    from patcher.engines.base import Engine

    return sorted({m for m in dir(Engine) if not m.startswith("_")} | set(getattr(Engine, "__annotations__", {})))


def _declares(adapter: object, member: str) -> bool:
    """`adapter` has `member` (on itself or its class) -- looked up without evaluating it, unlike
    `isinstance(adapter, Engine)`, which reads every attribute and so would import what an adapter
    defers until used (its bisect table, its perf recipe)."""
    return member in getattr(adapter, "__dict__", {}) or any(member in vars(k) for k in type(adapter).__mro__)


def adapter(name: str) -> Engine:
    """The adapter of engine `name` (the older name of `engine`)."""
    return engine(name)


def reset() -> None:
    """Forget what was found and loaded (tests that install an engine mid-run)."""
    global _ENTRIES
    _ENTRIES = None
    _LOADED.clear()

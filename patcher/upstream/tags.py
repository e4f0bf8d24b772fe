"""tags: upstream release tags newer than an engine's newest stack, from git or PyPI.

The baseline is the newest pin that has a stack (patches/ENGINE/TAG/series), else the newest
pin: tags newer than it are the candidates for `dsadapt rebase`. Each is marked pinned or not.
The git source (`git ls-remote --tags`) answers where reachable; otherwise PyPI's release list
of the engine's distributions, mapped to tags with the adapter's version_to_tag.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass, field

from packaging.version import InvalidVersion, Version

from patcher.base.config import Config
from patcher.base.errors import SourceError
from patcher.engines.base import EngineAdapter
from patcher.engines.registry import adapter
from patcher.formats.lock import Lock, LockEntry, version_key
from patcher.upstream.sources import Unreachable, git_remote_tags, pypi_versions


@dataclass(frozen=True)
class UpstreamTag:
    tag: str
    version: str
    pinned: bool
    prerelease: bool
    commit: str | None = None         # from git only
    dists: tuple[str, ...] = ()       # PyPI distributions that released it (from PyPI only)


@dataclass
class TagsResult:
    engine: str
    source: str                        # "git <url>" | "pypi <dist>, <dist>"
    baseline: str | None               # the tag the candidates are newer than
    tags: list[UpstreamTag] = field(default_factory=list)
    passed_over: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def tag_version(ad: EngineAdapter, tag: str) -> Version | None:
    try:
        return Version(ad.tag_to_version(tag))
    except InvalidVersion:
        return None


def baseline_pin(lock: Lock, engine: str, has_stack) -> LockEntry | None:
    pins = lock.pins_of(engine)
    stacked = [p for p in pins if has_stack(p)]
    found = stacked or pins
    return found[-1] if found else None


def newer_tags(ad: EngineAdapter, candidates: dict[str, tuple[str | None, tuple[str, ...]]], baseline: str | None,
               pinned: set[str], pre: bool) -> list[UpstreamTag]:
    """Pure: tags (name -> (commit, dists)) whose version is above the baseline's, oldest first."""
    floor = Version(baseline) if baseline and version_key(baseline)[0] == 0 else None
    out = []
    for tag, (commit, dists) in candidates.items():
        v = tag_version(ad, tag)
        if v is None or (v.is_prerelease and not pre) or (floor is not None and v <= floor):
            continue
        out.append(UpstreamTag(tag, str(v), tag in pinned, v.is_prerelease, commit, dists))
    return sorted(out, key=lambda t: (Version(t.version), t.tag))


def upstream_tags(cfg: Config, lock: Lock, engine: str, *, pre: bool = False) -> TagsResult:
    base = baseline_pin(lock, engine, lambda p: (cfg.patches_root / p.engine / p.tag / "series").is_file())
    return _tags(cfg, lock, engine, base.tag if base else None, base.version if base else None, pre)


def release_tags(cfg: Config, lock: Lock, engine: str, *, pre: bool = False) -> TagsResult:
    """Every release tag of the engine (oldest first) from the first source that answers, pinned or
    not, whatever the stacks: what `dsadapt replay` walks through."""
    return _tags(cfg, lock, engine, None, None, pre)


def _tags(cfg: Config, lock: Lock, engine: str, baseline: str | None, floor: str | None, pre: bool) -> TagsResult:
    decl = lock.engine(engine)
    ad = adapter(engine)
    pinned = {p.tag for p in lock.pins_of(engine)}
    passed: list[str] = []
    try:
        remote = git_remote_tags(decl.git, cfg.git_timeout)
        cands: dict[str, tuple[str | None, tuple[str, ...]]] = {t: (c, ()) for t, c in remote.items()}
        return TagsResult(engine, f"git {decl.git}", baseline, newer_tags(ad, cands, floor, pinned, pre), passed)
    except Unreachable as e:
        passed.append(f"git: {e.message}")
    except subprocess.TimeoutExpired:
        passed.append(f"git: {decl.git}: no answer in {cfg.git_timeout:.0f} s")
    if not decl.pypi:
        raise SourceError(f"no source lists {engine}'s releases: {'; '.join(passed)}",
                          hint="the engine has no PyPI distributions; configure network access to its git remote")
    by_version: dict[str, list[str]] = {}
    for dist in decl.pypi:
        try:
            for v in pypi_versions(dist):
                by_version.setdefault(v, []).append(dist)
        except Unreachable as e:
            passed.append(f"pypi {dist}: {e.message}")
    if not by_version:
        raise SourceError(f"no source lists {engine}'s releases: {'; '.join(passed)}",
                          hint="check the network (git remote or PyPI)")
    cands = {ad.version_to_tag(v): (None, tuple(d)) for v, d in by_version.items()}
    return TagsResult(engine, "pypi " + ", ".join(decl.pypi), baseline, newer_tags(ad, cands, floor, pinned, pre),
                      passed)

"""pin: add or update a pin in upstream.lock from what the upstream publishes."""

from __future__ import annotations

from dataclasses import replace

from patcher.base.config import Config
from patcher.base.errors import SourceError, UsageError, VerificationError, plural
from patcher.engines.registry import adapter
from patcher.formats.lock import Artifact, Lock, LockEntry
from patcher.formats.pinref import PinRef, near_miss
from patcher.upstream.sources import Unreachable, engine_cache, git_remote_tags, pypi_files


def select_pypi_artifacts(engine: str, dist_files: dict[str, list[dict]], version: str) -> list[Artifact]:
    """The artifacts worth pinning for a version: per dist, one x86_64 wheel (abi3 or cp311 first;
    a pure-Python `py3-none-any` wheel runs anywhere).

    Pure and canonical: the same PyPI file lists give the same artifacts in the same order
    whatever order the lists (or the files in them) come in: by the engine's variant order, then
    distribution and file name; the first is the `source` (the artifact a checkout unpacks), so
    for vLLM the CPU build's wheel where a release has one, else the CUDA wheel."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    ad = adapter(engine)
    order = {v.dist: i for i, v in reversed(list(enumerate(ad.variants)))}
    try:
        want = Version(version)
    except InvalidVersion:
        want = None
    arts: list[Artifact] = []
    for dist in sorted(dist_files):
        variant = next((v.name for v in ad.variants if v.dist == dist), dist)
        ranked = []
        for f in dist_files[dist]:
            name = f["filename"]
            if not name.endswith(".whl"):
                continue
            try:
                _n, ver, _b, tags = parse_wheel_filename(name)
            except (InvalidWheelFilename, InvalidVersion):
                continue
            if (ver != want) if want is not None else (str(ver) != version):
                continue
            tagset = {str(t) for t in tags}
            if not any("x86_64" in t or t.endswith("-any") for t in tagset):
                continue
            score = 3 if any(t.startswith(("cp311-", "cp38-abi3")) or "abi3" in t for t in tagset) else \
                2 if any(t.endswith("-none-any") for t in tagset) else 1
            ranked.append((-score, name, f))
        if ranked:
            f = min(ranked, key=lambda r: (r[0], r[1]))[2]
            arts.append(Artifact(dist, variant, f["filename"], f["hashes"]["sha256"], size=f.get("size")))
    arts.sort(key=lambda a: (order.get(a.dist, len(order)), a.dist, a.file))
    if arts:
        arts[0] = replace(arts[0], source=True)
    return arts


def resolve_pin(cfg: Config, lock: Lock, ref: PinRef, *, update: bool = False, progress=None) -> tuple[LockEntry, list[str]]:
    """Build the LockEntry for ref from reachable upstream sources; returns (entry, notes)."""
    decl = lock.engine(ref.engine)
    old = lock.pins.get(str(ref))
    version = old.version if old else adapter(ref.engine).tag_to_version(ref.tag)
    notes: list[str] = []
    commit, tree = _resolve_git(cfg, lock, ref, update=update, progress=progress, notes=notes)
    arts = list(old.artifacts) if old else []
    if decl.pypi:
        arts = _resolve_pypi(ref, decl.pypi, version, arts, notes)
    if not commit and not arts:
        raise SourceError(f"{ref}: nothing reachable describes this tag (no git, no PyPI release {version})",
                          hint="check the tag, or pin where the upstream is reachable")
    entry = LockEntry(engine=ref.engine, tag=ref.tag, version=version, commit=commit, tree=tree,
                      artifacts=tuple(arts), serves=old.serves if old else None,
                      python=old.python if old else None, note=old.note if old else None)
    return entry, notes


def _resolve_git(cfg: Config, lock: Lock, ref: PinRef, *, update: bool, progress, notes: list[str]
                 ) -> tuple[str | None, str | None]:
    """The tag's (commit, tree) from the engine's git remote, fetched into its cache; the lock's when the
    remote cannot be reached (said in notes). A tag the remote lacks is refused with the tag meant, if any."""
    decl = lock.engine(ref.engine)
    ad = adapter(ref.engine)
    old = lock.pins.get(str(ref))
    commit = old.commit if old else None
    tree = old.tree if old else None
    try:
        if progress:
            progress(f"resolving {ref.tag} at {decl.git}")
        tags = git_remote_tags(decl.git, cfg.git_timeout)
        if ref.tag not in tags:
            meant = near_miss(ref.tag, tags)
            raise SourceError(f"{decl.git} has no tag {ref.tag}",
                              hint=f"did you mean {ref.engine}@{meant}?" if meant else
                              f"check the tag name (`dsadapt tags {ref.engine}`)")
        got = tags[ref.tag]
        if commit and got != commit and not update:
            raise VerificationError(f"{ref}: tag moved: upstream says {got[:12]}, lock pins {commit[:12]}",
                                    hint="investigate; pass --update to accept the new commit")
        cache = engine_cache(cfg, ref.engine)
        cache.run("fetch", "-q", "--depth", "1", "--no-tags", decl.git, f"+refs/tags/{ref.tag}:refs/dsadapt/fetched/{ref.tag}",
                  timeout=cfg.git_timeout)
        fetched = cache.rev(f"refs/dsadapt/fetched/{ref.tag}")
        if fetched is None:
            raise SourceError(f"{decl.git}: {ref.tag} did not arrive in the cache", hint="retry; the cache may be damaged")
        commit, tree = fetched, cache.tree_of(fetched)
        notes.append(f"git: {ref.tag} -> commit {commit[:12]}, tree {tree[:12]}")
    except Unreachable as e:
        usual = ad.version_to_tag(ad.tag_to_version(ref.tag))
        if old is None and usual != ref.tag:  # nothing can say the tag exists, and it is not spelled like a release
            raise UsageError(f"{ref}: {decl.git} cannot be reached to look the tag up, and {ref.engine}'s release "
                             f"tags are spelled like {usual}", hint=f"did you mean {ref.engine}@{usual}?") from None
        notes.append(f"git: {e.message}; commit/tree {'kept from the lock' if commit else 'unknown'}")
    except Exception as e:  # ls-remote timeouts and the like
        if isinstance(e, (SourceError, VerificationError)):
            raise
        notes.append(f"git: unreachable ({e.__class__.__name__}); commit/tree {'kept' if commit else 'unknown'}")
    return commit, tree


def _resolve_pypi(ref: PinRef, dists, version: str, arts: list[Artifact], notes: list[str]) -> list[Artifact]:
    """The pin's PyPI artifacts: the lock's (refused when PyPI now serves one of them with another hash),
    else what PyPI serves for the version; an unreachable index is said in notes."""
    try:
        dist_files = {d: pypi_files(d) for d in dists}
        fresh = select_pypi_artifacts(ref.engine, dist_files, version)
        known = {a.file: a for a in arts}
        for a in fresh:
            if a.file in known and known[a.file].sha256 != a.sha256:
                raise VerificationError(f"{ref}: PyPI now serves {a.file} with sha256 {a.sha256[:16]}…, "
                                        f"lock pins {known[a.file].sha256[:16]}…",
                                        hint="a re-uploaded artifact: investigate before trusting it")
        notes.append(f"pypi: {plural(len(fresh), 'artifact')} for {version}: " + ", ".join(a.file for a in fresh))
        return arts or fresh
    except Unreachable as e:
        notes.append(f"pypi: {e.message}")
        return arts

"""A checkpoint's fingerprint: sha256 over its files, streamed, each file's digest cached.

A single-file checkpoint (the built-in tiny models) keeps the fingerprint `tiny.model_fingerprint`
gives it: sha256 over config.json and model.safetensors. A sharded one is fingerprinted by its
config.json, its index and every shard the index names: each file's sha256 is read in 8 MiB
chunks (never whole) and cached by (real path, size, mtime) in ``<cache>/checkpoint-digests.json``,
so checking a 700 GB checkpoint a second time costs a stat per file. The fingerprint is the
sha256 of the list of (name, size, sha256) lines.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base.errors import size_words
from patcher.checkpoints.model_dir import CONFIG_FILE, INDEX_FILE, Checkpoint

CACHE_FILE = "checkpoint-digests.json"
CHUNK = 8 * 1024 * 1024
SCHEME = "dsadapt-checkpoint/1"


@dataclass
class Fingerprint:
    sha256: str
    files: dict[str, str] = field(default_factory=dict)   # name -> sha256 (sharded checkpoints)
    hashed_bytes: int = 0                                 # read this time
    cached_bytes: int = 0                                 # taken from the cache


def _key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def _load(cache: Path | None) -> dict:
    if cache is None:
        return {}
    try:
        doc = json.loads((cache / CACHE_FILE).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def remember(cache: Path | None, path: Path, sha256: str) -> None:
    """Record `path`'s digest (computed elsewhere, e.g. while writing it) under its current size and mtime."""
    if cache is None:
        return
    record(cache, {_key(Path(path)): sha256})


def record(cache: Path, digests: dict[tuple[str, int, int], str]) -> None:
    doc = _load(cache)
    for (real, size, mtime), sha in digests.items():
        doc[real] = {"size": size, "mtime_ns": mtime, "sha256": sha}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{CACHE_FILE}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(doc, indent=0, sort_keys=True))
        os.replace(tmp, cache / CACHE_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)  # a cache that cannot be written only costs time


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while True:
            data = f.read(CHUNK)
            if not data:
                break
            h.update(data)
            if on_bytes:
                on_bytes(len(data))
    return h.hexdigest()


def fingerprint(ckpt: Checkpoint, cache: Path | None = None,
                progress: Callable[[str], None] | None = None) -> Fingerprint:
    """The checkpoint's fingerprint (see the module doc); `cache`: where digests are kept."""
    if not ckpt.sharded:
        from patcher.checkpoints.tiny import model_fingerprint

        return Fingerprint(model_fingerprint(ckpt.path))
    names = [CONFIG_FILE, INDEX_FILE] + sorted(ckpt.shards)
    known = _load(cache)
    fp = Fingerprint("")
    fresh: dict[tuple[str, int, int], str] = {}
    todo = []
    for name in names:
        key = _key(ckpt.path / name)
        hit = known.get(key[0])
        if hit and hit.get("size") == key[1] and hit.get("mtime_ns") == key[2] and hit.get("sha256"):
            fp.files[name] = hit["sha256"]
            fp.cached_bytes += key[1]
        else:
            todo.append((name, key))
    if todo and progress:
        total = sum(k[1] for _, k in todo)
        progress(f"fingerprinting {ckpt.path.name}: sha256 of {len(todo)} file(s), {size_words(total)} "
                 "(cached by size and mtime afterwards)")
    for name, key in todo:
        sha = file_sha256(ckpt.path / name)
        fp.files[name] = sha
        fp.hashed_bytes += key[1]
        fresh[key] = sha
    if fresh and cache is not None:
        record(cache, fresh)
    lines = [SCHEME] + [f"{name}\0{(ckpt.path / name).stat().st_size}\0{fp.files[name]}" for name in names]
    fp.sha256 = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return fp


#: What dsadapt wrote a checkpoint folder from (`model make --like`, `model slice`), next to its weights.
INFO_FILE = "dsadapt.json"


def publish_folder(tmp: Path, out: Path, info: dict, digests: dict[str, str], cache: Path | None) -> None:
    """Finish a checkpoint folder written in `tmp`: its `INFO_FILE`, then one rename onto `out`
    (an empty folder there, checked by the caller, is replaced), then the digests computed while
    writing are remembered, so the first check does not hash the files again."""
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked by the caller)
    os.replace(tmp, out)
    if cache is not None:
        for name, sha in digests.items():
            remember(cache, out / name, sha)

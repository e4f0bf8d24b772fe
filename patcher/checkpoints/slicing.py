"""The first K decoder layers of a checkpoint, as a checkpoint of its own (`dsadapt model slice`).

A slice keeps the embeddings, layers 0..K-1, the final norm and ``lm_head``, drops every later
layer and the MTP modules, and says so in its config.json (``num_hidden_layers`` K,
``num_nextn_predict_layers`` 0); everything else, ``quantization_config`` and the FP8 block
scales included, is kept as released. It reads only the shards that hold kept tensors, and
copies each tensor's bytes in chunks of 64 MiB straight from its shard to the new one: memory
stays at one chunk whatever the model's size (a K=4 slice of DeepSeek-V3 is how its float32
reference fits a machine at all). The slice's shards keep the source's grouping (one new shard
per source shard that holds a kept tensor, renumbered), its small files (tokenizer, generation
config, remote code) are copied, and each shard's sha256 is computed while it is written, so the
gate's fingerprint of the slice costs nothing more. Written into a temporary folder renamed at
the end: OUT never holds half a slice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patcher.base.errors import UsageError, show, size_words
from patcher.checkpoints.fingerprint import INFO_FILE, publish_folder
from patcher.checkpoints.folder import (
    WrittenFolder,
    require_disk,
    require_new_folder,
    temporary_folder,
    write_index,
)
from patcher.checkpoints.layout import layer_of
from patcher.checkpoints.model_dir import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    Checkpoint,
    open_checkpoint,
    require_layers,
)
from patcher.checkpoints.safetensors_io import COPY_CHUNK, TensorEntry, copy_tensor, encode_header

SMALL_FILE = 256 * 1024 * 1024  # other files up to this size are copied into the slice


@dataclass(kw_only=True)
class SliceResult(WrittenFolder):
    """`model slice`'s result: the folder, and what it was cut from."""

    source: Path
    source_layers: int
    dropped_mtp: int
    tensors: int
    read_files: int

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "source": str(self.source), "layers": self.layers,
                "source_layers": self.source_layers, "dropped_mtp_layers": self.dropped_mtp,
                "tensors": self.tensors, "bytes": self.bytes, "source_files_read": self.read_files,
                "files": len(self.files), "seconds": round(self.seconds, 2)}


def kept(ckpt: Checkpoint, k: int) -> list[str]:
    """The tensors a K-layer slice keeps, in the source's file order (then offset)."""
    def keep(name: str) -> bool:
        layer = layer_of(name)
        return layer is None or layer < k

    names = [n for n in ckpt.weight_map if keep(n)]
    order = {f: i for i, f in enumerate(ckpt.shards)}
    return sorted(names, key=lambda n: (order[ckpt.weight_map[n]], ckpt.entry(n).begin))


def sliced_config(config: dict[str, Any], k: int) -> dict[str, Any]:
    out = dict(config)
    out["num_hidden_layers"] = k
    if "num_nextn_predict_layers" in out:
        out["num_nextn_predict_layers"] = 0
    return out


def _plan_slice(ckpt: Checkpoint, names: list[str]) -> list[tuple[str, list[TensorEntry], str]]:
    """(source file, the slice's entries, the slice's file name) per source shard holding kept tensors."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(ckpt.weight_map[n], []).append(n)
    plan: list[tuple[str, list[TensorEntry], str]] = []
    for i, (src_file, members) in enumerate(groups.items()):
        offset, entries = 0, []
        for n in members:
            e = ckpt.entry(n)
            entries.append(TensorEntry(n, e.dtype, e.shape, offset, offset + e.nbytes))
            offset += e.nbytes
        fname = (f"model-{i + 1:05d}-of-{len(groups):06d}.safetensors" if ckpt.sharded else SINGLE_FILE)
        plan.append((src_file, entries, fname))
    return plan


def _copy_small_files(src: Path, tmp: Path, ckpt: Checkpoint) -> None:
    """The source's other small files (tokenizer, generation config, remote code), weights excluded."""
    weights = set(ckpt.shards) | {INDEX_FILE, CONFIG_FILE, INFO_FILE}
    for p in sorted(src.iterdir()):
        if p.name in weights or p.name.startswith(".") or not p.is_file() or p.is_symlink() \
                or p.suffix == ".safetensors" or p.stat().st_size > SMALL_FILE:
            continue
        shutil.copy2(p, tmp / p.name)


def _source_info(src: Path) -> Any:
    """The source's own dsadapt.json (what it was made or cut from), None when it has none readable."""
    if not (src / INFO_FILE).is_file():
        return None
    with contextlib.suppress(OSError, ValueError):
        return json.loads((src / INFO_FILE).read_text())
    return None


def slice_checkpoint(src: Path, k: int, out: Path, cache: Path | None = None,
                     progress: Callable[[str], None] | None = None, chunk: int = COPY_CHUNK) -> SliceResult:
    """Write the K-layer slice of the checkpoint in `src` into `out` (a new folder)."""
    t0 = time.monotonic()
    src, out = Path(src), Path(out)
    ckpt = open_checkpoint(src)
    require_layers(ckpt, k)
    require_new_folder(out, "a slice")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise UsageError(f"--out {show(out, 100)} is inside the checkpoint being sliced",
                         hint="write the slice next to the source, not into it")
    names = kept(ckpt, k)
    plan = _plan_slice(ckpt, names)
    total = sum(e[-1].end for _, e, _ in plan if e)
    require_disk(out, total, "free disk space or write --out elsewhere")
    dropped_mtp = sum(1 for layer in {layer_of(n) for n in ckpt.weight_map}
                      if layer is not None and layer >= ckpt.layers)
    if progress:
        progress(f"slicing {src.name}: layers 0-{k - 1} of {ckpt.layers}"
                 + (f", {dropped_mtp} MTP module(s) dropped" if dropped_mtp else "")
                 + f": {len(names)} tensors, {size_words(total)} from {len(plan)} of {len(ckpt.shards)} file(s)")
    digests: dict[str, str] = {}
    with temporary_folder(out, "slicing") as tmp:
        for src_file, entries, fname in plan:
            header = ckpt.shards[src_file]
            h = hashlib.sha256()
            head = encode_header(entries, header.metadata or {"format": "pt"})
            with (tmp / fname).open("wb") as f:
                f.write(head)
                h.update(head)
                for e in entries:
                    copy_tensor(header, e.name, f, chunk=chunk, hasher=h)
            digests[fname] = h.hexdigest()
        config = sliced_config(ckpt.config, k)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        if ckpt.sharded:
            write_index(tmp, {e.name: fname for _, entries, fname in plan for e in entries}, total)
        _copy_small_files(src, tmp, ckpt)
        info: dict[str, Any] = {"sliced_from": str(src.resolve()), "layers": k, "source_layers": ckpt.layers,
                                "dropped_mtp_layers": dropped_mtp, "files": digests}
        source_info = _source_info(src)
        if source_info is not None:
            info["source_info"] = source_info
        publish_folder(tmp, out, info, digests, cache)
    return SliceResult(out, k, total, digests, time.monotonic() - t0, source=src, source_layers=ckpt.layers,
                       dropped_mtp=dropped_mtp, tensors=len(names), read_files=len(plan))

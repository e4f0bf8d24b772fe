"""Checkpoints in the released layout without a download (`dsadapt model make --like`).

`make_like(OUT, "deepseek-v3", layers=K)` writes DeepSeek-V3's released config.json with K decoder
layers (and its MTP module, unless ``mtp=0``), and seeded random weights with the released
checkpoint's tensor names, dtypes (bf16; block-FP8 e4m3 with float32 ``weight_scale_inv`` for V3's
projections), shards of a few GB (``model-00001-of-00000N.safetensors``, DeepSeek's naming) and
``model.safetensors.index.json``. A real checkpoint sliced to the same layers has the same files,
names, shapes and dtypes; only the numbers differ.

Weights: the structure of trained weights (`patcher.checkpoints.structure`: outlier channels,
attention sinks, confident routing, peaked logits, heavy-tailed per-block magnitudes), every value
drawn from generators seeded by (seed, tensor name, 128-row block); FP8 weights are then quantized
per 128 x 128 block as DeepSeek's are (scale = amax / 448). The same arguments give byte-identical
files, however many worker processes write them.

Writing is streamed: each shard's header is written first, then every tensor at its offset in
chunks of at most 32 M values, so memory stays near one chunk per worker. Files appear under
OUT only when the whole checkpoint is written (a temporary folder is renamed at the end).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patcher.base.errors import UsageError, size_words
from patcher.checkpoints import structure, tiny
from patcher.checkpoints.fingerprint import publish_folder
from patcher.checkpoints.folder import (
    WrittenFolder,
    require_disk,
    require_new_folder,
    temporary_folder,
    write_index,
)
from patcher.checkpoints.layout import TensorSpec, expected_tensors, fp8_scheme, mtp_layers
from patcher.checkpoints.model_dir import CONFIG_FILE
from patcher.checkpoints.released import REPOS, released_config
from patcher.checkpoints.safetensors_io import TensorEntry, encode_header, layout

#: Shard size DeepSeek's releases use (DeepSeek-V3: 163 shards of about 4.3 GB).
SHARD_BYTES = 4_300_000_000
CHUNK_VALUES = 32 * 1024 * 1024
GENERATOR = "dsadapt-like/2"


@dataclass(kw_only=True)
class MadeModel(WrittenFolder):
    """`model make`'s result: the folder, and what it was made like, from which seed."""

    like: str | None
    mtp: int
    seed: int
    params: int
    workers: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "like": self.like, "layers": self.layers, "mtp_layers": self.mtp,
                "seed": self.seed, "params": self.params, "bytes": self.bytes, "files": len(self.files),
                "seconds": round(self.seconds, 1), "workers": self.workers}


def shard_name(i: int, n: int) -> str:
    """DeepSeek's shard names: ``model-00001-of-000163.safetensors``."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def plan_shards(specs: list[TensorSpec], shard_bytes: int = SHARD_BYTES) -> list[list[TensorSpec]]:
    """Tensors in order, a new shard when the next would pass `shard_bytes`; a weight and its
    ``weight_scale_inv`` always share a shard."""
    from patcher.checkpoints.safetensors_io import DTYPE_SIZES

    shards: list[list[TensorSpec]] = [[]]
    size = 0
    i = 0
    while i < len(specs):
        group = [specs[i]]
        if i + 1 < len(specs) and specs[i + 1].name == specs[i].name + "_scale_inv":
            group.append(specs[i + 1])
        n = sum(math.prod(t.shape) * DTYPE_SIZES[t.dtype] for t in group)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += n
        i += len(group)
    return shards


def _source_name(t: TensorSpec, n_layers: int) -> str:
    """MTP modules store the main embedding and head again: the same values, as released."""
    if t.layer is not None and t.layer >= n_layers:
        if t.name.endswith(".embed_tokens.weight"):
            return "model.embed_tokens.weight"
        if t.name.endswith(".shared_head.head.weight"):
            return "lm_head.weight"
    return t.name


@dataclass(frozen=True)
class _Task:
    """One tensor (or an FP8 weight and its scales) to write at known offsets of one file."""

    path: str
    name: str
    source: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    seed: int
    config: str                          # the config.json (JSON text): the structure is planned from it
    block: tuple[int, int] | None = None
    scale_offset: int | None = None


def _raw(t: Any) -> Any:
    """A tensor's bytes as a buffer os.pwrite takes (no copy)."""
    import torch

    return t.contiguous().view(torch.uint8).numpy()


@functools.lru_cache(maxsize=4)
def _structure(config_json: str, seed: int) -> Any:
    """The checkpoint's structure (patcher.checkpoints.structure), planned once per process."""
    return structure.plan(json.loads(config_json), seed)


def _write(task: _Task) -> int:
    """Fill one tensor's bytes (worker side). Returns the values written."""
    import torch

    st = _structure(task.config, task.seed)
    rows = task.shape[0]
    cols = math.prod(task.shape[1:]) if len(task.shape) > 1 else 1
    fd = os.open(task.path, os.O_WRONLY)
    try:
        if task.block is None:
            dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[task.dtype]
            step = max(structure.ROW_BLOCK, (CHUNK_VALUES // cols) // structure.ROW_BLOCK * structure.ROW_BLOCK)
            item = torch.empty((), dtype=dt).element_size()
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                x = structure.tensor_rows(st, task.source, task.shape, r0, r0 + n).to(dt)
                os.pwrite(fd, _raw(x), task.offset + r0 * cols * item)
            return rows * cols
        from patcher.checkpoints import blockfp8

        b0, _ = task.block
        gr, gc = blockfp8.grid(task.shape, task.block)
        scales = torch.empty(gr, gc, dtype=torch.float32)
        step = max(b0, (CHUNK_VALUES // cols) // b0 * b0)
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            w = structure.tensor_rows(st, task.source, task.shape, r0, r0 + n)
            q, sc = blockfp8.quantize(w, task.block)
            i0, i1 = r0 // b0, -(-(r0 + n) // b0)
            scales[i0:i1] = sc
            os.pwrite(fd, _raw(q), task.offset + r0 * cols)
        assert task.scale_offset is not None
        os.pwrite(fd, _raw(scales), task.scale_offset)
        return rows * cols
    finally:
        os.close(fd)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _hash(path: str) -> str:
    from patcher.checkpoints.fingerprint import file_sha256

    return file_sha256(Path(path))


def default_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 1) - 1))


@dataclass(frozen=True)
class _Files:
    """The files a checkpoint is written into: their names, tensor entries and encoded headers."""

    names: list[str]
    headers: list[list[TensorEntry]]
    encoded: list[bytes]

    @property
    def total(self) -> int:
        return sum(len(e) + (h[-1].end if h else 0) for e, h in zip(self.encoded, self.headers))

    @property
    def indexed(self) -> bool:
        return self.names != ["model.safetensors"]


def _plan_files(specs: list[TensorSpec], shard_bytes: int, like: str | None) -> _Files:
    shards = plan_shards(specs, shard_bytes)
    # the released layout is sharded with an index (even in one shard); a bare config makes one file
    names = [shard_name(i + 1, len(shards)) for i in range(len(shards))] if (like or len(shards) > 1) \
        else ["model.safetensors"]
    headers = [layout((t.name, t.dtype, t.shape) for t in shard) for shard in shards]
    return _Files(names, headers, [encode_header(h, {"format": "pt"}) for h in headers])


def _create_files(tmp: Path, files: _Files, specs: list[TensorSpec], config: dict[str, Any], seed: int) -> list[_Task]:
    """Each file created at its full size with its header; one task per tensor (an FP8 weight and its scales)."""
    n_layers = int(config["num_hidden_layers"])
    fp8 = fp8_scheme(config)
    config_json = json.dumps(config, sort_keys=True)
    spec_of = {t.name: t for t in specs}
    tasks: list[_Task] = []
    for fname, entries, head in zip(files.names, files.headers, files.encoded):
        path = tmp / fname
        with path.open("wb") as f:
            f.write(head)
            f.truncate(len(head) + (entries[-1].end if entries else 0))
        by_name: dict[str, TensorEntry] = {e.name: e for e in entries}
        for e in entries:
            if e.name.endswith("_scale_inv") and e.name[: -len("_scale_inv")] in by_name:
                continue
            scale = by_name.get(e.name + "_scale_inv")
            source = _source_name(spec_of[e.name], n_layers)
            tasks.append(_Task(str(path), e.name, source, e.shape, e.dtype, len(head) + e.begin, seed, config_json,
                               fp8.block if (fp8 and scale is not None) else None,
                               len(head) + scale.begin if scale is not None else None))
    tasks.sort(key=lambda t: -math.prod(t.shape))  # largest first: the pool finishes together
    return tasks


def _run_tasks(tasks: list[_Task], paths: list[str], workers: int,
               progress: Callable[[str], None] | None) -> list[str]:
    """Every task written by `workers` processes (in this one when 1); the files' sha256 after."""
    if workers == 1:
        for t in tasks:
            _write(t)
        return [_hash(p) for p in paths]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = last = time.monotonic()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)
    try:
        for done, _ in enumerate(pool.map(_write, tasks, chunksize=1), 1):
            if progress and time.monotonic() - last > 15:
                progress(f"  {done}/{len(tasks)} tensors written ({time.monotonic() - t0:.0f}s)")
                last = time.monotonic()
        return list(pool.map(_hash, paths))
    finally:
        # interrupted: the tensors not started are dropped, the running ones end (one each)
        pool.shutdown(wait=True, cancel_futures=True)


def _write_small_files(tmp: Path, config: dict[str, Any], chat_variant: str) -> None:
    """config.json, generation_config.json and the tokenizer."""
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": config.get("bos_token_id"),
         "do_sample": False, "eos_token_id": config.get("eos_token_id")}, indent=2) + "\n")
    (tmp / "tokenizer.json").write_text(tiny.tokenizer_json(), encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(tiny.tokenizer_config(chat_variant), indent=2, sort_keys=True, ensure_ascii=False) + "\n",
        encoding="utf-8")


def write_checkpoint(out: Path, config: dict[str, Any], seed: int = 0, mtp: int | None = None,
                     shard_bytes: int = SHARD_BYTES, workers: int | None = None, like: str | None = None,
                     chat_variant: str = "v3", cache: Path | None = None,
                     progress: Callable[[str], None] | None = None) -> MadeModel:
    """Write a checkpoint of `config` (its layout: `layout.expected_tensors`) into `out` (new)."""
    t0 = time.monotonic()
    out = Path(out)
    require_new_folder(out, "a checkpoint")
    specs = expected_tensors(config, mtp=mtp)
    files = _plan_files(specs, shard_bytes, like)
    require_disk(out, files.total, "free disk space, or make fewer --layers")
    fp8 = fp8_scheme(config)
    if fp8 is not None and fp8.block[0] % structure.ROW_BLOCK:
        raise UsageError(f"quantization_config.weight_block_size {list(fp8.block)}: fabricated block-FP8 weights need "
                         f"row blocks that are a multiple of {structure.ROW_BLOCK}",
                         hint="DeepSeek-V3's block is [128, 128]")
    with temporary_folder(out, "making") as tmp:
        tasks = _create_files(tmp, files, specs, config, seed)
        workers = max(1, min(workers or default_workers(), len(tasks)))
        if progress:
            progress(f"writing {len(tasks)} tensors ({sum(math.prod(t.shape) for t in specs) / 1e9:.2f} B values, "
                     f"{size_words(files.total)}) into {len(files.names)} file(s) with {workers} worker(s)")
        digests = _run_tasks(tasks, [str(tmp / n) for n in files.names], workers, progress)
        if files.indexed:
            write_index(tmp, {e.name: fname for fname, entries in zip(files.names, files.headers) for e in entries},
                        sum(h[-1].end for h in files.headers if h))
        _write_small_files(tmp, config, chat_variant)
        params = sum(math.prod(t.shape) for t in specs if not t.name.endswith("_scale_inv"))
        made = MadeModel(out, int(config["num_hidden_layers"]), sum((tmp / n).stat().st_size for n in files.names),
                         dict(zip(files.names, digests)), like=like, mtp=mtp_layers(config) if mtp is None else mtp,
                         seed=seed, params=params, workers=workers)
        info = {"generator": GENERATOR, "like": like, "released_as": REPOS.get(like or ""), "layers": made.layers,
                "mtp_layers": made.mtp, "seed": seed, "params": params,
                "structure": structure.plan(config, seed).to_json(), "files": made.files}
        publish_folder(tmp, out, info, made.files, cache)
    made.seconds = time.monotonic() - t0
    return made


def make_like(out: Path, like: str, layers: int, seed: int = 0, mtp: int | None = None,
              shard_bytes: int = SHARD_BYTES, workers: int | None = None, cache: Path | None = None,
              progress: Callable[[str], None] | None = None) -> MadeModel:
    """The released checkpoint of `like` with `layers` decoder layers, random weights (module doc)."""
    if seed < 0:
        raise UsageError(f"--seed {seed}: must be >= 0", hint="pass a non-negative --seed")
    config = released_config(like, layers, mtp)
    return write_checkpoint(out, config, seed=seed, shard_bytes=shard_bytes, workers=workers, like=like,
                            chat_variant="v3" if like == "deepseek-v3" else "v2-lite", cache=cache,
                            progress=progress)

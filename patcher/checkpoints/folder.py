"""Writing a new checkpoint folder: what `model make` and `model slice` share.

A new checkpoint goes to an OUT that is not there yet (or empty), is checked against the free disk
first, is written into a temporary folder next to OUT (removed if anything fails, an interrupt
included) and appears under OUT in one rename (`fingerprint.publish_folder`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from patcher.base.errors import MachineError, UsageError, show, size_words
from patcher.checkpoints.model_dir import INDEX_FILE

#: Disk kept free beyond the checkpoint's own bytes.
DISK_SLACK = 1 << 28


@dataclass
class WrittenFolder:
    """A checkpoint folder `model make` or `model slice` wrote: where, its decoder layers, its bytes,
    each tensor file's sha256, and how long it took (what each command adds: its own fields)."""

    path: Path
    layers: int
    bytes: int
    files: dict[str, str]   # tensor file -> sha256
    seconds: float = 0.0


def require_new_folder(out: Path, what: str) -> None:
    """Refuse an `out` that exists and is not an empty folder (a checkpoint is never written over another)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {show(out, 100)} exists and is not an empty folder",
                         hint=f"pick a new folder ({what} is never written over another checkpoint)")


def require_disk(out: Path, total: int, hint: str) -> None:
    """Refuse (exit 7, with the numbers) when `total` bytes do not fit under out's parent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if total + DISK_SLACK > free:
        raise MachineError(f"not enough disk for {show(out, 80)}: it takes {size_words(total)}, "
                           f"{size_words(free)} free", hint=hint)


@contextmanager
def temporary_folder(out: Path, doing: str) -> Iterator[Path]:
    """A fresh folder ``.OUT.<doing>-<pid>`` next to `out`, removed when the block raises."""
    tmp = out.parent / f".{out.name}.{doing}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: the tensors' files, sorted by name, and their bytes in all."""
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_size},
                                                 "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")

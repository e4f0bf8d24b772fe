"""The safetensors file format, read and written with the standard library only.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (the header:
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets
relative to the end of the header), then the tensors' bytes. dsadapt reads headers to validate
checkpoints and to plan slices without loading a tensor, and copies tensors byte for byte in
bounded chunks, so a slice of a 700 GB checkpoint never holds more than one chunk in memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

#: Bytes per element of each safetensors dtype.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E8M0": 1}
#: torch's names for the dtypes the checkpoints here use.
TORCH_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
               "F8_E5M2": "float8_e5m2", "F64": "float64", "I64": "int64", "I32": "int32", "U8": "uint8",
               "I8": "int8", "BOOL": "bool"}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: A header larger than this is not a checkpoint dsadapt reads (DeepSeek-V3's largest: ~60 KB).
MAX_HEADER = 100 * 1024 * 1024
COPY_CHUNK = 64 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file is not a well-formed safetensors file (message says where and why)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset of the first byte, relative to the data section
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.begin, self.end]}


@dataclass(frozen=True)
class Header:
    path: Path
    size: int               # the file's size in bytes
    data_start: int         # 8 + header length
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> Header:
    """The header of `path`, checked: every tensor's dtype is known, its byte range matches its
    shape and lies inside the file, and no two ranges overlap."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path.name}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise SafetensorsError(f"{path.name}: header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path.name}: cannot read ({e.strerror or e})") from e
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path.name}: the header is not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{path.name}: the header is not a JSON object")
    data_start = 8 + n
    meta = doc.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    for name, d in doc.items():
        try:
            dtype, shape, (begin, end) = d["dtype"], tuple(int(x) for x in d["shape"]), d["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path.name}: tensor {name!r} has a malformed entry") from e
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{path.name}: tensor {name!r} has unknown dtype {dtype!r}")
        t = TensorEntry(name, dtype, shape, int(begin), int(end))
        if t.nbytes != t.numel * DTYPE_SIZES[dtype] or t.begin < 0:
            raise SafetensorsError(f"{path.name}: tensor {name!r} ({dtype} {list(shape)}) has {t.nbytes} bytes "
                                   f"at [{t.begin}, {t.end})")
        if data_start + t.end > size:
            raise SafetensorsError(f"{path.name}: tensor {name!r} ends at byte {data_start + t.end}, past the end "
                                   f"of the file ({size} bytes): the file is truncated")
        tensors[name] = t
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, e1, a), (b2, _, b) in zip(spans, spans[1:]):
        if b2 < e1:
            raise SafetensorsError(f"{path.name}: tensors {a!r} and {b!r} overlap")
    return Header(path, size, data_start, tensors, {str(k): str(v) for k, v in dict(meta).items()})


def encode_header(entries: Iterable[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header for `entries` (their offsets as given), padded with
    spaces to a multiple of 8 bytes as safetensors' own writer does."""
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    for t in entries:
        doc[t.name] = t.to_json()
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def layout(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[TensorEntry]:
    """Consecutive byte ranges for (name, dtype, shape) in that order."""
    out, offset = [], 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        out.append(TensorEntry(name, dtype, tuple(shape), offset, offset + n))
        offset += n
    return out


def read_chunks(header: Header, name: str, chunk: int = COPY_CHUNK) -> Iterator[bytes]:
    """The bytes of tensor `name`, in chunks of at most `chunk` bytes (never the whole tensor at once)."""
    t = header.tensors[name]
    with header.path.open("rb") as f:
        f.seek(header.data_start + t.begin)
        left = t.nbytes
        while left:
            data = f.read(min(chunk, left))
            if not data:
                raise SafetensorsError(f"{header.path.name}: tensor {name!r} is cut short")
            left -= len(data)
            yield data


def read_tensor_bytes(header: Header, name: str) -> bytes:
    return b"".join(read_chunks(header, name))


def copy_tensor(header: Header, name: str, out: BinaryIO, chunk: int = COPY_CHUNK, hasher=None) -> int:
    """Append tensor `name`'s bytes to `out` in chunks; returns the byte count."""
    n = 0
    for data in read_chunks(header, name, chunk):
        out.write(data)
        if hasher is not None:
            hasher.update(data)
        n += len(data)
    return n

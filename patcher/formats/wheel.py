"""Rewriting wheels without recompressing them: the core of the overlay build.

Unchanged members are copied as raw compressed bytes (fast, and bit-identical to the
release); changed members are deflated with a fixed level. Every member gets a fixed
timestamp and the archive a fixed order, so the same inputs give a byte-identical wheel.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from patcher.base.errors import BuildError

FIXED_DOS_TIME = (0, (1 << 5) | 1)  # 1980-01-01 00:00:00: (time, date)
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")


@dataclass
class Member:
    name: str
    external_attr: int
    flag_utf8: bool
    method: int
    crc: int
    compress_size: int
    file_size: int
    raw: bytes  # compressed bytes as stored


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def read_raw_members(path: Path) -> tuple[list[Member], zipfile.ZipFile]:
    z = zipfile.ZipFile(path)
    members = []
    fp = z.fp
    assert fp is not None
    for info in z.infolist():
        fp.seek(info.header_offset)
        hdr = fp.read(_LOCAL.size)
        sig, _v, _flag, _m, _t, _d, _crc, _cs, _us, nlen, elen = _LOCAL.unpack(hdr)
        if sig != 0x04034B50:
            raise BuildError(f"{path.name}: bad local header for {info.filename}", hint="the wheel is corrupt")
        fp.seek(info.header_offset + _LOCAL.size + nlen + elen)
        raw = fp.read(info.compress_size)
        members.append(Member(info.filename, info.external_attr, bool(info.flag_bits & 0x800),
                              info.compress_type, info.CRC, info.compress_size, info.file_size, raw))
    return members, z


def new_member(name: str, data: bytes, external_attr: int = 0o644 << 16) -> Member:
    co = zlib.compressobj(6, zlib.DEFLATED, -15)
    raw = co.compress(data) + co.flush()
    return Member(name, external_attr, not name.isascii(), zipfile.ZIP_DEFLATED, zlib.crc32(data) & 0xFFFFFFFF,
                  len(raw), len(data), raw)


def _archive_chunks(path: Path, members: list[Member]) -> Iterator[bytes]:
    """The bytes of a zip archive holding `members` (in order, fixed times), piece by piece."""
    central = []
    offset = 0
    for m in members:
        if offset > 0xFFFFFFFF or m.compress_size > 0xFFFFFFFF or m.file_size > 0xFFFFFFFF:
            raise BuildError(f"{path.name}: member {m.name} needs ZIP64", hint="wheels over 4 GiB are not supported")
        name = m.name.encode("utf-8")
        flag = 0x800 if m.flag_utf8 else 0
        head = _LOCAL.pack(0x04034B50, 20, flag, m.method, *FIXED_DOS_TIME, m.crc, m.compress_size,
                           m.file_size, len(name), 0) + name
        yield head
        yield m.raw
        central.append(_CENTRAL.pack(0x02014B50, (3 << 8) | 20, 20, flag, m.method, *FIXED_DOS_TIME, m.crc,
                                     m.compress_size, m.file_size, len(name), 0, 0, 0, 0,
                                     m.external_attr, offset) + name)
        offset += len(head) + len(m.raw)
    directory = b"".join(central)
    yield directory
    yield _END.pack(0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0)


def write_members(path: Path, members: list[Member]) -> str:
    """Write the members as a zip archive at `path`; returns the archive's sha256 (hashed while
    writing: a build never reads its output back to hash it)."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in _archive_chunks(path, members):
            f.write(chunk)
            h.update(chunk)
    return h.hexdigest()


def members_match(path: Path, members: list[Member], block: int = 1 << 22) -> str | None:
    """Whether the file at `path` holds exactly the archive `write_members` would write: its sha256
    if so, else None. Reads the file once, in large blocks, and writes nothing (a warm rebuild of an
    unchanged stack finds its output already there, byte for byte)."""
    h = hashlib.sha256()
    pending: list[bytes] = []
    size = 0
    with open(path, "rb") as f:
        for chunk in _archive_chunks(path, members):
            h.update(chunk)
            pending.append(chunk)
            size += len(chunk)
            if size >= block:
                if f.read(size) != b"".join(pending):
                    return None
                pending, size = [], 0
        if f.read(size) != b"".join(pending) or f.read(1):
            return None
    return h.hexdigest()


def parse_record(text: str) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(text)) if row]


def format_record(rows: list[list[str]]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for r in rows:
        w.writerow(r)
    return out.getvalue()


def verify_record(path: Path) -> list[str]:
    """Problems with a wheel's RECORD (missing entries, wrong hashes or sizes)."""
    problems = []
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        record_name = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if not record_name:
            return ["no RECORD"]
        rows = {r[0]: r for r in parse_record(z.read(record_name).decode())}
        for n in names:
            if n == record_name:
                continue
            r = rows.get(n)
            if r is None:
                problems.append(f"{n}: not in RECORD")
                continue
            data = z.read(n)
            if r[1] != record_hash(data) or r[2] != str(len(data)):
                problems.append(f"{n}: RECORD hash or size mismatch")
        for n in rows:
            if n not in names:
                problems.append(f"{n}: in RECORD but not in the wheel")
    return problems

"""Reading the project's text inputs (upstream.lock, dsadapt.toml, series, patches) exactly.

Bytes are read as they are (no universal-newline translation: a CRLF file stays CRLF, so the
format checks can see it) and decoded as strict UTF-8; a bad byte is an input error that
names the file, the line and the byte offset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from patcher.base.errors import DsadaptError, UsageError, show


def decode_utf8(data: bytes, where: str, error: type[DsadaptError] = UsageError, hint: str | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        bad = data[e.start:e.start + 1].hex()
        raise error(f"{where}:{line}: not UTF-8 text (byte 0x{bad} at offset {e.start})",
                    hint=hint or "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None


def read_text(path: Path, error: type[DsadaptError] = UsageError, hint: str | None = None,
              where: str | None = None) -> str:
    """The file's text, byte-exact (CRLF kept), strictly UTF-8. Missing files raise FileNotFoundError;
    a directory where a file should be raises `error`."""
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise error(f"{where or path}: is a directory, not a file", hint=f"remove or rename the directory {path}") \
            from None
    return decode_utf8(data, where or str(path), error, hint)


def read_json(path: Path, where: str, hint: str, error: type[DsadaptError] = UsageError) -> Any:
    """The file's JSON value, or `error` (`where`: not valid JSON, with `hint`) when its bytes are
    not UTF-8 JSON. A missing or unreadable file is the caller's (OSError)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not valid JSON ({show(e, 80)})", hint=hint) from None
    return loads_json(text, where, hint, error)


def loads_json(text: str, where: str, hint: str, error: type[DsadaptError] = UsageError) -> Any:
    """`text`'s JSON value, or `error` naming `where` (its line) when it is not JSON, or nests
    deeper than Python's parser goes (a file of 100,000 `[`: bad input, not a crash)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}:{e.lineno}: not valid JSON ({e.msg})", hint=hint) from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply to read)", hint=hint) from None

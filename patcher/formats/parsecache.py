"""Parsed patch files remembered by their content, so that a stack is parsed and linted once per
distinct file content, not at every command.

One file in the work dir (`.dsadapt/parsed/patches.bin`): a checksum, then a marshal'ed dict from
a key -- sha256 of the parser's own source, of what is asked (a parse, or a lint at one path) and
of the patch file's bytes -- to the plain values the parse or the lint gave. So:

- a changed patch file, or a dsadapt whose parser or lint changed, has other keys: nothing stale
  is ever looked up (there is nothing to invalidate);
- the file is replaced atomically (a temporary file renamed over it): a reader sees the old or the
  new whole file, also when a writer is killed; concurrent writers each write a whole valid file
  (the last one's entries win, the other's are only parsed again next time);
- a file that is damaged in any way (truncated, foreign, a flipped bit) fails its checksum or its
  decoding and is treated as empty: the cost is a parse, never a wrong result.

Only plain values (str, int, bool, None, tuples) are stored, decoded with `marshal`, which builds
data and runs nothing.
"""

from __future__ import annotations

import hashlib
import marshal
import os
from pathlib import Path

from patcher.formats import patchfile
from patcher.formats.patchfile import FileChange, Patch

FORMAT = b"dsadapt-parsed-v1\n"
#: entries kept: past it, a save keeps only what this process used
MAX_ENTRIES = 20_000


def _code_salt() -> bytes:
    """What the stored values depend on besides the file: the parser and lint's own source (any
    change to them gives every entry another key)."""
    try:
        return hashlib.sha256(Path(patchfile.__file__).read_bytes()).digest()
    except OSError:  # no source to hash (a zip import): a salt that never matches an old entry
        return os.urandom(32)


_OPEN: dict[Path, ParseCache] = {}


class ParseCache:
    """`parse(text, where)` and `lint(patch, text, where)`, remembered in `path` (None: nothing is
    remembered; the same results, computed every time)."""

    @classmethod
    def in_workdir(cls, workdir: Path) -> ParseCache:
        """The work dir's cache (`parsed/patches.bin`), one instance per process and work dir: the
        file is read once however many stacks a command loads."""
        path = Path(workdir) / "parsed" / "patches.bin"
        got = _OPEN.get(path)
        if got is None:
            got = _OPEN[path] = cls(path)
        return got

    def __init__(self, path: Path | None):
        self.path = path
        self._salt = _code_salt() if path is not None else b""
        self._old: dict = self._read() if path is not None else {}
        self._new: dict = {}
        self._used: set = set()

    def _read(self) -> dict:
        assert self.path is not None
        try:
            data = self.path.read_bytes()
        except OSError:
            return {}
        head, digest, body = data[:len(FORMAT)], data[len(FORMAT):len(FORMAT) + 32], data[len(FORMAT) + 32:]
        if head != FORMAT or hashlib.sha256(body).digest() != digest:
            return {}
        try:
            got = marshal.loads(body)
        except (EOFError, ValueError, TypeError):
            return {}
        return got if isinstance(got, dict) else {}

    def _key(self, kind: bytes, text: str, where: str = "") -> bytes:
        h = hashlib.sha256(self._salt)
        h.update(kind + b"\0" + where.encode("utf-8", "surrogateescape") + b"\0")
        h.update(text.encode("utf-8", "surrogateescape"))
        return h.digest()[:20]

    def _get(self, key: bytes):
        value = self._new.get(key, self._old.get(key))
        if value is not None:
            self._used.add(key)
        return value

    def parse(self, text: str, where: str) -> Patch:
        """`patchfile.parse_patch(text, where)` (its errors too: a file that does not parse is never stored)."""
        if self.path is None:
            return patchfile.parse_patch(text, where)
        key = self._key(b"parse", text)
        got = self._get(key)
        if got is not None:
            p = _decode_patch(got)
            if p is not None:
                return p
        p = patchfile.parse_patch(text, where)
        self._new[key] = _encode_patch(p)
        self._used.add(key)
        return p

    def lint(self, p: Patch, text: str, where: str) -> list[str]:
        """`patchfile.lint_patch(p, text, where)` for the `p` that `parse(text)` gave."""
        if self.path is None:
            return patchfile.lint_patch(p, text, where)
        key = self._key(b"lint", text, where)
        got = self._get(key)
        if isinstance(got, tuple) and all(isinstance(x, str) for x in got):
            return list(got)
        problems = patchfile.lint_patch(p, text, where)
        self._new[key] = tuple(problems)
        self._used.add(key)
        return problems

    def save(self) -> None:
        """Write what was learnt (nothing when nothing new was; a failure to write costs only the
        parsing next time)."""
        if self.path is None or not self._new:
            return
        merged = {**self._old, **self._new}
        if len(merged) > MAX_ENTRIES:
            merged = {k: v for k, v in merged.items() if k in self._used}
        body = marshal.dumps(merged)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(FORMAT + hashlib.sha256(body).digest() + body)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return
        self._old, self._new = merged, {}


def _encode_patch(p: Patch) -> tuple:
    return (p.subject, p.body, tuple(tuple(t) for t in p.trailers), p.diff, p.author,
            tuple((f.old_path, f.new_path, f.old_blob, f.new_blob, f.binary, f.mode, f.old_mode, f.copy, f.content,
                   f.link_target) for f in p.files))


def _decode_patch(v) -> Patch | None:
    """The Patch of a stored value, or None when the value is not one (a foreign or older entry)."""
    try:
        subject, body, trailers, diff, author, files = v
        return Patch(subject=subject, body=body, trailers=tuple((k, x) for k, x in trailers), diff=diff,
                     author=author, files=tuple(FileChange(*f) for f in files))
    except (TypeError, ValueError):
        return None

"""One patch of a stack: a git mail patch in dsadapt's normalized form.

Normalized form (what `format_patch` writes and `verify` demands)::

    From: Name <email>
    Subject: [PATCH] one-line subject
    (MIME headers only when the message is not ASCII)

    Body paragraphs saying why the change exists.

    Upstream-Status: Backport vllm-project/vllm#4650
    Drop-When: vllm>=0.5.1
    Covered-By: tests/test_x.py::test_y
    ---
    diff --git a/path b/path
    index <40-hex>..<40-hex> 100644
    ...

No mbox "From <commit>" line, no Date, no diffstat, no version signature, full blob ids.
`git am` accepts it as is. Parsing is pure: text in, `Patch` out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from patcher.base.errors import PatchFormatError, show
from patcher.base.paths import symlink_target_error, tree_path_error

KNOWN_TRAILERS = ("Upstream-Status", "Drop-When", "Covered-By")
UPSTREAM_STATUSES = ("Pending", "Submitted", "Backport", "Inappropriate", "Accepted")
_STATUS_NEEDS_ARG = {"Submitted", "Backport", "Inappropriate", "Accepted"}
_TRAILER_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9-]*):\s?(.*)$")
_INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: ([0-7]{6}))?$")
_MBOX_FROM_RE = re.compile(r"^From [0-9a-f]{40} ")
_SUBJECT_PREFIX_RE = re.compile(r"^\[PATCH[^\]]*\]\s*")
ZERO_ID = "0" * 40


@dataclass(frozen=True)
class FileChange:
    """What a patch does to one file; blob ids are the full 40-hex pre/post images."""

    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    old_blob: str | None
    new_blob: str | None
    binary: bool = False
    mode: str | None = None  # the new mode when the patch states one (100644, 100755, 120000 = symlink)
    old_mode: str | None = None   # the old mode when the patch states one
    copy: bool = False            # a copy: old_path stays
    content: bool = False         # the patch changes the bytes (hunks or a binary patch), not only name or mode
    link_target: str | None = None  # the whole post-image when the diff gives it (what a symbolic link points at)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for p in (self.old_path, self.new_path) if p))


@dataclass(frozen=True)
class Patch:
    subject: str
    body: str = ""
    trailers: tuple[tuple[str, str], ...] = ()
    diff: str = ""
    author: str = "dsadapt <dsadapt@localhost>"
    files: tuple[FileChange, ...] = field(default=(), compare=False)

    def trailer(self, key: str) -> str | None:
        for k, v in self.trailers:
            if k.lower() == key.lower():
                return v
        return None

    def trailer_values(self, key: str) -> list[str]:
        return [v for k, v in self.trailers if k.lower() == key.lower()]

    @property
    def upstream_status(self) -> str | None:
        v = self.trailer("Upstream-Status")
        return v.split()[0] if v else None

    @property
    def touched_paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for f in self.files for p in f.paths))

    @property
    def message(self) -> str:
        """The commit message (subject, body, trailers) as git stores it."""
        parts = [self.subject]
        if self.body:
            parts.append(self.body)
        if self.trailers:
            parts.append("\n".join(f"{k}: {v}" for k, v in self.trailers))
        return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------- parsing


def _decode_header(value: str) -> str:
    if "=?" not in value:  # no encoded-word: nothing to decode (and email.header is not imported)
        return value
    from email.header import decode_header, make_header

    try:
        return str(make_header(decode_header(value)))
    except Exception:  # malformed encoded-word: keep it raw
        return value


def split_message(message: str) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """Split a commit message into (subject, body, trailers).

    Trailers are the last paragraph when every line of it is ``Key: value`` (git's rule,
    without continuation lines).
    """
    lines = message.strip("\n").split("\n")
    subject_lines = []
    while lines and lines[0].strip():
        subject_lines.append(lines.pop(0).strip())
    subject = " ".join(subject_lines)
    rest = "\n".join(lines).strip("\n")
    paragraphs = re.split(r"\n\s*\n", rest) if rest else []
    trailers: tuple[tuple[str, str], ...] = ()
    if paragraphs:
        last = paragraphs[-1].split("\n")
        matches = [_TRAILER_RE.match(l) for l in last]
        if all(matches):
            trailers = tuple((m.group(1), m.group(2).strip()) for m in matches)  # type: ignore[union-attr]
            paragraphs = paragraphs[:-1]
    body = "\n\n".join(p.rstrip() for p in paragraphs).strip("\n")
    body = "\n".join(l.rstrip() for l in body.split("\n")) if body else ""
    return subject, body, trailers


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_C_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\",
              '"': '"'}
_SYMLINK_MODE = "120000"
_GITLINK_MODE = "160000"


def _bad(where: str, msg: str, hint: str = "regenerate the patch with `git format-patch --full-index`") \
        -> PatchFormatError:
    return PatchFormatError(f"{where}: {msg}", hint=hint)


def unquote_c(text: str, start: int, where: str) -> tuple[str, int]:
    """A C-style quoted name as git writes it ("a/x\\ty", octal UTF-8 bytes) starting at text[start]
    (a double quote); returns (name, index after the closing quote)."""
    assert text[start] == '"'
    out = bytearray()
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            try:
                return out.decode("utf-8"), i + 1
            except UnicodeDecodeError:
                raise _bad(where, f"quoted path {show(text[start:i + 1], 60)!r} is not UTF-8") from None
        if c == "\\":
            nxt = text[i + 1:i + 2]
            if nxt in _C_ESCAPES:
                out += _C_ESCAPES[nxt].encode()
                i += 2
                continue
            if re.match(r"[0-7]{3}", text[i + 1:i + 4]):
                out.append(int(text[i + 1:i + 4], 8) & 0xFF)
                i += 4
                continue
            raise _bad(where, f"bad escape in quoted path {show(text[start:], 60)!r}")
        out += c.encode("utf-8")
        i += 1
    raise _bad(where, f"unterminated quoted path {show(text[start:], 60)!r}")


def _name(text: str, where: str) -> str:
    """A whole name field: quoted ("...") or taken as it is."""
    if text.startswith('"'):
        name, end = unquote_c(text, 0, where)
        if text[end:].strip():
            raise _bad(where, f"text after the quoted path {show(text, 60)!r}")
        return name
    return text


def _header_names(rest: str, where: str) -> tuple[str, str] | None:
    """(a-name, b-name) from what follows `diff --git `; None when ambiguous (unquoted names with
    spaces that differ: then rename/copy or ---/+++ lines must name the files)."""
    if rest.startswith('"'):
        a, end = unquote_c(rest, 0, where)
        if rest[end:end + 1] != " ":
            raise _bad(where, f"malformed diff header 'diff --git {show(rest, 60)}'")
        return a, _name(rest[end + 1:], where)
    if rest.endswith('"'):
        for k in range(len(rest) - 1, 0, -1):
            if rest[k] == '"' and rest[k - 1] == " ":
                try:
                    b, end = unquote_c(rest, k, where)
                except PatchFormatError:
                    continue
                if end == len(rest):
                    return rest[:k - 1], b
        raise _bad(where, f"malformed diff header 'diff --git {show(rest, 60)}'")
    splits = [k for k in range(len(rest)) if rest[k] == " " and rest[k + 1:].startswith("b/") and rest.startswith("a/")]
    if len(splits) == 1:
        k = splits[0]
        return rest[:k], rest[k + 1:]
    same = [k for k in splits if rest[2:k] == rest[k + 3:]]
    if len(same) == 1:
        k = same[0]
        return rest[:k], rest[k + 1:]
    if not splits:
        raise _bad(where, f"malformed diff header 'diff --git {show(rest, 60)}'",
                   hint="patches must be made with git (a/ b/ prefixes)")
    return None


def _file_name(text: str, where: str) -> str:
    """The name on a ---/+++ line: quoted, or up to a tab (git adds one after names with spaces)."""
    if text.startswith('"'):
        name, end = unquote_c(text, 0, where)
        return name
    return text.split("\t", 1)[0]


def parse_diff_files(diff: str, where: str = "patch") -> tuple[FileChange, ...]:
    """The files a git diff touches, with every path git would write checked.

    Hunk-aware: a `---`/`+++` pair outside a hunk that is not the current file's header (a
    "traditional" diff section git apply would also act on) is refused, as are unparsable
    headers, paths outside the tree or inside `.git`, gitlinks, and symbolic links whose target
    leaves the tree.
    """
    r = _DiffReader(where)
    for n, line in enumerate(diff.split("\n"), 1):
        r.line(n, line)
    r.close()
    return tuple(r.files)


class _DiffReader:
    """`parse_diff_files` line by line: inside a hunk, its content; outside, a file's headers."""

    def __init__(self, where: str):
        self.where = where
        self.files: list[FileChange] = []
        self.cur: dict | None = None
        self.old_left = self.new_left = 0
        self.last = ""  # the side of the last hunk line: " " both, "-" old, "+" new

    def close(self) -> None:
        if self.cur is not None:
            self.files.append(_file_change(self.cur, self.where))

    def line(self, n: int, line: str) -> None:
        if self.old_left > 0 or self.new_left > 0:  # inside a hunk: content, whatever it looks like
            self._hunk_line(n, line)
        elif line.startswith("diff --git "):
            self._file_header(n, line)
        elif self.cur is None:
            if line.strip():
                raise _bad(self.where, f"diff line {n}: text before the first `diff --git` header")
        elif line.startswith("\\"):  # "\ No newline at end of file" after a hunk's last line
            if self.last in (" ", "+"):
                self.cur["new_eof"] = True
        elif line.startswith("@@"):
            self._hunk_header(n, line)
        elif not self.cur["binary"]:  # a binary patch's base85 lines, literal/delta headers, blank separators
            _extended_header(self.cur, n, line, self.where)

    def _hunk_line(self, n: int, line: str) -> None:
        cur = self.cur
        if line.startswith(" ") or line == "":
            self.old_left, self.new_left = self.old_left - 1, self.new_left - 1
            if cur is not None:
                cur["new_side"].append(line[1:])
            self.last = " "
        elif line.startswith("-"):
            self.old_left -= 1
            self.last = "-"
        elif line.startswith("+"):
            self.new_left -= 1
            if cur is not None:
                cur["plus_lines"].append(line[1:])
                cur["new_side"].append(line[1:])
            self.last = "+"
        elif line.startswith("\\"):
            if cur is not None and self.last in (" ", "+"):
                cur["new_eof"] = True
        else:
            raise _bad(self.where, f"diff line {n}: a hunk ends before its header says ({show(line, 40)!r})")
        if self.old_left < 0 or self.new_left < 0:
            raise _bad(self.where, f"diff line {n}: a hunk is longer than its header says")

    def _file_header(self, n: int, line: str) -> None:
        if line.endswith("\r"):
            raise _bad(self.where, "CRLF line endings", hint="convert the file to LF line endings (dos2unix)")
        self.close()
        names = _header_names(line[len("diff --git "):], self.where)
        self.cur = {"a": names[0] if names else None, "b": names[1] if names else None, "new": False,
                    "deleted": False, "index": None, "binary": False, "rename_from": None, "rename_to": None,
                    "copy_from": None, "copy_to": None, "minus": None, "plus": None, "hunks": 0,
                    "old_mode": None, "new_mode": None, "plus_lines": [], "line": n, "new_side": [],
                    "new_start": None, "new_eof": False}

    def _hunk_header(self, n: int, line: str) -> None:
        cur = self.cur
        assert cur is not None
        m = _HUNK_RE.match(line)
        if not m or cur["binary"]:
            raise _bad(self.where, f"diff line {n}: malformed hunk header {show(line, 40)!r}")
        self.old_left = int(m.group(2)) if m.group(2) is not None else 1
        self.new_left = int(m.group(4)) if m.group(4) is not None else 1
        cur["hunks"] += 1
        if cur["new_start"] is None:
            cur["new_start"] = int(m.group(3))
        self.last = ""


def _extended_header(cur: dict, n: int, line: str, where: str) -> None:
    """One line of a file's header after `diff --git`: ---/+++ names, modes, renames and copies,
    the index line, the start of a binary patch."""
    if line.startswith("--- ") or line.startswith("+++ "):
        key = "minus" if line.startswith("-") else "plus"
        if cur["hunks"] or cur[key] is not None:
            raise _bad(where, f"diff line {n}: a file section without its own `diff --git` header "
                              "(a non-git diff inside the patch)")
        cur[key] = _file_name(line[4:], where)
    elif line.startswith("new file mode "):
        cur["new"], cur["new_mode"] = True, line.split()[-1]
    elif line.startswith("deleted file mode "):
        cur["deleted"], cur["old_mode"] = True, line.split()[-1]
    elif line.startswith("old mode "):
        cur["old_mode"] = line.split()[-1]
    elif line.startswith("new mode "):
        cur["new_mode"] = line.split()[-1]
    elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
        words = line.split(" ", 2)
        cur[f"{words[0]}_{words[1]}"] = _name(words[2], where)
    elif line.startswith("index ") and cur["index"] is None:
        im = _INDEX_RE.match(line)
        if not im:
            raise _bad(where, f"malformed index line {show(line, 60)!r}")
        cur["index"] = (im.group(1), im.group(2))
        if im.group(3):
            cur["new_mode"] = cur["new_mode"] or im.group(3)
            cur["old_mode"] = cur["old_mode"] or im.group(3)
    elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
        cur["binary"] = True


def _strip_prefix(p: str, prefix: str, where: str) -> str:
    if not p.startswith(prefix):
        raise PatchFormatError(f"{where}: path {show(p, 80)!r} lacks the '{prefix}' prefix",
                               hint="patches must be made with git (a/ b/ prefixes)")
    return p[len(prefix):]


def check_path(path: str, where: str) -> str:
    """Refuse paths that escape the tree or touch git's own files (see patcher.base.paths)."""
    why = tree_path_error(path)
    if why:
        raise PatchFormatError(f"{where}: path {show(path, 80)!r} {why}",
                               hint="a patch may only touch files inside the upstream tree, never .git")
    return path


def _file_change(cur: dict, where: str) -> FileChange:
    """A file section read by `_DiffReader`: its names checked and agreeing, no gitlink, a
    symbolic link's target inside the tree."""
    old_name, new_name = _section_names(cur, where)
    if _GITLINK_MODE in (cur["new_mode"], cur["old_mode"]):
        raise _bad(where, f"{new_name}: a submodule (gitlink) change", hint="a stack patches files, not submodules")
    # the whole post-image, when the diff gives it: one hunk from the first line to an end without
    # a newline (a symbolic link's blob is its target, with no newline), or an empty new file
    target = None
    if cur["hunks"] == 1 and cur["new_start"] in (0, 1) and cur["new_eof"]:
        target = "\n".join(cur["new_side"])
    if cur["new_mode"] == _SYMLINK_MODE and not cur["deleted"]:
        _check_link(cur, new_name, target, where)
    old_blob, new_blob = cur["index"] or (None, None)
    return FileChange(
        old_path=None if cur["new"] else old_name,
        new_path=None if cur["deleted"] else new_name,
        old_blob=old_blob, new_blob=new_blob, binary=cur["binary"],
        mode=cur["new_mode"], old_mode=cur["old_mode"], copy=bool(cur["copy_from"] or cur["copy_to"]),
        content=bool(cur["hunks"] or cur["binary"]), link_target=target,
    )


def _section_names(cur: dict, where: str) -> tuple[str, str]:
    """(old, new) path of a file section, every name it gives checked (inside the tree, not .git),
    and the header's names agreeing with the rest, as git's own header parser takes them."""
    a = check_path(_strip_prefix(cur["a"], "a/", where), where) if cur["a"] is not None else None
    b = check_path(_strip_prefix(cur["b"], "b/", where), where) if cur["b"] is not None else None
    for key in ("rename_from", "rename_to", "copy_from", "copy_to"):
        if cur[key]:
            check_path(cur[key], where)
    side = {key: check_path(_strip_prefix(cur[key], prefix, where), where)
            for key, prefix in (("minus", "a/"), ("plus", "b/")) if cur[key] and cur[key] != "/dev/null"}
    old_name = cur["rename_from"] or cur["copy_from"] or side.get("minus") or a
    new_name = cur["rename_to"] or cur["copy_to"] or side.get("plus") or b
    if old_name is None or new_name is None:
        raise _bad(where, f"diff line {cur['line']}: cannot tell which files the section touches "
                          "(unquoted names with spaces)")
    for name in (a, b):
        if name is not None and name not in (old_name, new_name) and not (cur["new"] or cur["deleted"]):
            raise _bad(where, f"diff line {cur['line']}: the header names {show(name, 60)!r}, the section "
                              f"{show(new_name, 60)!r}")
    return old_name, new_name


def _check_link(cur: dict, name: str, target: str | None, where: str) -> None:
    """A symbolic link the section makes: never a binary patch, its target given whole and inside the tree."""
    if cur["binary"]:
        raise _bad(where, f"{name}: a symbolic link given as a binary patch")
    if cur["hunks"]:
        why = symlink_target_error(name, target) if target is not None else \
            "has a target the patch does not give whole"
        if why:
            raise PatchFormatError(f"{where}: symbolic link {show(name, 60)!r} {why}",
                                   hint="a patch may create symbolic links only to files inside the tree")


def parse_patch(text: str, where: str = "patch") -> Patch:
    """Parse a git mail patch (format-patch output, normalized or not)."""
    # A patch file converted to CRLF (an editor, a checkout with autocrlf) has CR on its own lines;
    # CR inside hunk content is the content of a CRLF file and stays (checked per line below).
    if text.split("\n", 1)[0].endswith("\r"):
        raise PatchFormatError(f"{where}: CRLF line endings",
                               hint="convert the file to LF line endings (dos2unix), and keep git from converting "
                                    "it (`*.patch -text` in .gitattributes)")
    lines = text.split("\n")
    if lines and _MBOX_FROM_RE.match(lines[0]):
        lines = lines[1:]
    headers: list[tuple[str, str]] = []
    i = 0
    while i < len(lines) and lines[i] != "":
        line = lines[i]
        if line[:1] in (" ", "\t") and headers:
            k, v = headers[-1]
            headers[-1] = (k, v + " " + line.strip())
        else:
            k, sep, v = line.partition(":")
            if not sep or " " in k:
                raise PatchFormatError(f"{where}: line {i + 1} is not a mail header: {show(line, 60)!r}",
                                       hint="a patch starts with From:/Subject: headers (git format-patch)")
            headers.append((k.strip(), v.strip()))
        i += 1
    hdr = {k.lower(): v for k, v in headers}
    if "subject" not in hdr:
        raise PatchFormatError(f"{where}: no Subject header", hint="make patches with `git format-patch`")
    subject = _SUBJECT_PREFIX_RE.sub("", _decode_header(hdr["subject"])).strip()
    if not subject:
        raise PatchFormatError(f"{where}: empty subject", hint="every patch needs a one-line subject")
    author = _decode_header(hdr.get("from", "dsadapt <dsadapt@localhost>"))
    rest = lines[i + 1:]
    # message runs up to the '---' separator or the first 'diff --git'
    msg_end = None
    for j, line in enumerate(rest):
        if line == "---" or line.startswith("diff --git "):
            msg_end = j
            break
    if msg_end is None:
        raise PatchFormatError(f"{where}: no diff found", hint="the patch must contain a `diff --git` section")
    message_text = "\n".join(rest[:msg_end])
    diff_start = None
    for j in range(msg_end, len(rest)):
        if rest[j].startswith("diff --git "):
            diff_start = j
            break
    if diff_start is None:
        raise PatchFormatError(f"{where}: no diff found", hint="the patch must contain a `diff --git` section")
    diff_lines = rest[diff_start:]
    # drop a trailing version signature ("-- " then version) and trailing blank lines; a "-- "
    # with nothing after it is the diff's own last line (deleting a line "- "), not a signature
    for j in range(len(diff_lines) - 1, -1, -1):
        if diff_lines[j] == "-- " and any(diff_lines[j + 1:]):
            diff_lines = diff_lines[:j]
            break
        if diff_lines[j].startswith(("+", "-", " ", "@@", "\\", "literal ", "delta ", "GIT binary patch")) \
                and diff_lines[j] != "":
            break
    while diff_lines and diff_lines[-1] == "":
        diff_lines.pop()
    diff = "\n".join(diff_lines) + "\n"
    if _ends_in_binary_hunk(diff_lines):
        diff += "\n"  # git's binary patch format ends each hunk with a blank line; `git apply` needs it
    _, body, trailers = split_message(subject + "\n\n" + message_text)
    files = parse_diff_files(diff, where)
    return Patch(subject=subject, body=body, trailers=trailers, diff=diff, author=author, files=files)


def _ends_in_binary_hunk(diff_lines: list[str]) -> bool:
    """True when the last file of the diff is a `GIT binary patch` (its data runs to the end)."""
    for line in reversed(diff_lines):
        if line.startswith("GIT binary patch"):
            return True
        if line.startswith(("diff --git ", "@@", "+++ ", "--- ")):
            return False
    return False


# ---------------------------------------------------------------- formatting


def _needs_mime(p: Patch) -> bool:
    return not (p.subject + p.body + p.author + "".join(k + v for k, v in p.trailers)).isascii()


def format_patch(p: Patch) -> str:
    """The normalized text of a patch. format_patch(parse_patch(x)) is idempotent."""
    out = [f"From: {p.author}", f"Subject: [PATCH] {p.subject}"]
    if _needs_mime(p):
        out += ["MIME-Version: 1.0", "Content-Type: text/plain; charset=UTF-8", "Content-Transfer-Encoding: 8bit"]
    out.append("")
    if p.body:
        out += [p.body, ""]
    if p.trailers:
        out += [f"{k}: {v}" for k, v in p.trailers]
    out.append("---")
    text = "\n".join(out) + "\n" + p.diff
    return text if text.endswith("\n") else text + "\n"


def slugify(subject: str, limit: int = 52) -> str:
    """The file-name slug git format-patch would derive from a subject."""
    s = re.sub(r"[^A-Za-z0-9._]+", "-", subject).strip("-.")
    s = re.sub(r"\.+", ".", s)
    return (s[:limit].rstrip("-.") or "patch")


def patch_filename(index: int, subject: str) -> str:
    return f"{index:04d}-{slugify(subject)}.patch"


# ---------------------------------------------------------------- lint


def lint_patch(p: Patch, text: str, where: str) -> list[str]:
    """Problems that make a patch unfit for a stack. Empty list means fine."""
    problems = []
    if format_patch(p) != text:
        problems.append(f"{where}: not normalized (run `dsadapt refresh` or `dsadapt normalize`)")
    if not p.body:
        problems.append(f"{where}: no body saying why the change exists")
    status = p.trailer("Upstream-Status")
    if not status:
        problems.append(f"{where}: missing Upstream-Status trailer")
    else:
        word, _, arg = status.partition(" ")
        if word not in UPSTREAM_STATUSES:
            problems.append(f"{where}: Upstream-Status {word!r} is not one of {', '.join(UPSTREAM_STATUSES)}")
        elif word in _STATUS_NEEDS_ARG and not arg.strip():
            problems.append(f"{where}: Upstream-Status {word} needs an argument (url, commit, reason or version)")
    for spec in p.trailer_values("Drop-When"):
        err = drop_when_error(spec)
        if err:
            problems.append(f"{where}: Drop-When {spec!r}: {err}")
    if not p.trailer_values("Covered-By"):
        problems.append(f"{where}: missing Covered-By trailer (the test ids that exercise the patch)")
    if not p.files:
        problems.append(f"{where}: the diff touches no file")
    for f in p.files:
        for blob in (f.old_blob, f.new_blob):
            if blob is None:
                if not f.binary:
                    problems.append(f"{where}: {f.path}: no index line (pure mode change or rename?)")
            elif len(blob) != 40:
                problems.append(f"{where}: {f.path}: abbreviated blob id {blob} (use --full-index)")
    return problems


#: what the lint problems a commit message causes (no body, missing or malformed trailers) say: they
#: are fixed by rewording the commit in the checkout, not by editing the diff
MESSAGE_PROBLEMS = ("no body saying why", "trailer", "Upstream-Status", "Drop-When")


def is_message_problem(problem: str) -> bool:
    """Whether a `lint_patch` problem is about the commit message."""
    return any(k in problem for k in MESSAGE_PROBLEMS)


def drop_when_error(spec: str) -> str | None:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        return f"not a version spec ({e})"
    if not str(req.specifier):
        return "no version bound (write e.g. vllm>=0.5.1)"
    return None


#: The usual Drop-When spec, a name and version bounds (``vllm>=0.5.1``, ``lmdeploy>=0.19,<1``): read
#: without packaging's requirement parser (markers, extras), which `dsadapt report` would otherwise pay
#: for at start-up. Anything else goes through `packaging.requirements.Requirement`. (A pattern, compiled
#: by `re` on first use, not at import.)
_SIMPLE_SPEC = (r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*((?:~=|==|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
                r"(?:\s*,\s*(?:~=|==|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+)*)\s*")


def _canonical(name: str) -> str:
    """PEP 503's normalized distribution name (packaging.utils.canonicalize_name)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def drop_when_satisfied(spec: str, dist_names: tuple[str, ...], version: str) -> bool:
    """True when `version` of one of `dist_names` satisfies the Drop-When spec
    (packaging.requirements.InvalidRequirement for a spec that is not one)."""
    names = {_canonical(n) for n in dist_names}
    m = re.fullmatch(_SIMPLE_SPEC, spec)
    if m:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        try:
            bounds = SpecifierSet(m.group(2))
        except InvalidSpecifier:
            bounds = None  # let the requirement parser say what is wrong
        if bounds is not None:
            return _canonical(m.group(1)) in names and bounds.contains(version, prereleases=True)
    from packaging.requirements import Requirement

    req = Requirement(spec)
    if _canonical(req.name) not in names:
        return False
    return req.specifier.contains(version, prereleases=True)

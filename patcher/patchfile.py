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

from .errors import PatchFormatError

KNOWN_TRAILERS = ("Upstream-Status", "Drop-When", "Covered-By")
UPSTREAM_STATUSES = ("Pending", "Submitted", "Backport", "Inappropriate", "Accepted")
_STATUS_NEEDS_ARG = {"Submitted", "Backport", "Inappropriate", "Accepted"}
_TRAILER_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9-]*):\s?(.*)$")
_INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: ([0-7]{6}))?$")
_DIFF_GIT_RE = re.compile(r"^diff --git (\S+) (\S+)$")
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


def parse_diff_files(diff: str, where: str = "patch") -> tuple[FileChange, ...]:
    files: list[FileChange] = []
    cur: dict | None = None

    def close():
        if cur is not None:
            files.append(_file_change(cur, where))

    for line in diff.split("\n"):
        m = _DIFF_GIT_RE.match(line)
        if m:
            close()
            cur = {"a": m.group(1), "b": m.group(2), "new": False, "deleted": False, "index": None,
                   "binary": False, "rename_from": None, "rename_to": None, "minus": None, "plus": None}
            continue
        if cur is None:
            continue
        if line.startswith("new file mode"):
            cur["new"] = True
        elif line.startswith("deleted file mode"):
            cur["deleted"] = True
        elif line.startswith("rename from "):
            cur["rename_from"] = line[len("rename from "):]
        elif line.startswith("rename to "):
            cur["rename_to"] = line[len("rename to "):]
        elif line.startswith("index ") and cur["index"] is None:
            im = _INDEX_RE.match(line)
            if not im:
                raise PatchFormatError(f"{where}: malformed index line {line!r}",
                                       hint="regenerate the patch with `git format-patch --full-index`")
            cur["index"] = (im.group(1), im.group(2))
        elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
            cur["binary"] = True
        elif line.startswith("--- ") and cur["minus"] is None:
            cur["minus"] = line[4:]
        elif line.startswith("+++ ") and cur["plus"] is None:
            cur["plus"] = line[4:]
    close()
    return tuple(files)


def _strip_prefix(p: str, prefix: str, where: str) -> str:
    if not p.startswith(prefix):
        raise PatchFormatError(f"{where}: path {p!r} lacks the '{prefix}' prefix",
                               hint="patches must be made with git (a/ b/ prefixes)")
    return p[len(prefix):]


def check_path(path: str, where: str) -> str:
    """Refuse paths that escape the tree or touch git's own files."""
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or any(x in ("..", ".", "") for x in parts) or parts[0] == ".git":
        raise PatchFormatError(f"{where}: path {path!r} escapes the source tree",
                               hint="a patch may only touch files inside the upstream tree")
    return path


def _file_change(cur: dict, where: str) -> FileChange:
    a = check_path(_strip_prefix(cur["a"], "a/", where), where)
    b = check_path(_strip_prefix(cur["b"], "b/", where), where)
    for key in ("rename_from", "rename_to"):
        if cur[key]:
            check_path(cur[key], where)
    for key, prefix in (("minus", "a/"), ("plus", "b/")):
        v = cur[key]
        if v and v != "/dev/null":
            check_path(_strip_prefix(v, prefix, where), where)
    old_blob = new_blob = None
    if cur["index"]:
        old_blob, new_blob = cur["index"]
    return FileChange(
        old_path=None if cur["new"] else (cur["rename_from"] or a),
        new_path=None if cur["deleted"] else (cur["rename_to"] or b),
        old_blob=old_blob, new_blob=new_blob, binary=cur["binary"],
    )


def parse_patch(text: str, where: str = "patch") -> Patch:
    """Parse a git mail patch (format-patch output, normalized or not)."""
    if "\r\n" in text:
        raise PatchFormatError(f"{where}: CRLF line endings", hint="convert the file to LF line endings")
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
                raise PatchFormatError(f"{where}: line {i + 1} is not a mail header: {line[:60]!r}",
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


def drop_when_error(spec: str) -> str | None:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        return f"not a version spec ({e})"
    if not str(req.specifier):
        return "no version bound (write e.g. vllm>=0.5.1)"
    return None


def drop_when_satisfied(spec: str, dist_names: tuple[str, ...], version: str) -> bool:
    """True when `version` of one of `dist_names` satisfies the Drop-When spec."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(spec)
    names = {canonicalize_name(n) for n in dist_names}
    if canonicalize_name(req.name) not in names:
        return False
    return req.specifier.contains(version, prereleases=True)

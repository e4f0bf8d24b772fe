"""Which paths a patch or an artifact may write: inside the tree, never into git's own files.

One rule for both (patch paths and wheel members), pure and strict: relative POSIX paths
without empty, `.` or `..` components, no backslashes, drive letters or control characters,
and no component that git (on any file system) would take for `.git`: any case, trailing dots
or spaces (NTFS), zero-width characters (HFS+), or the 8.3 short name `GIT~1`.
Symbolic links may point only inside the tree and never into `.git` (`symlink_target_error`).
"""

from __future__ import annotations

import posixpath
import re
import unicodedata

_DRIVE = re.compile(r"^[A-Za-z]:")
# characters HFS+ ignores when it compares names (git's is_hfs_dotgit list)
_IGNORABLE = dict.fromkeys(map(ord, "\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                                    "\u206a\u206b\u206c\u206d\u206e\u206f\ufeff"), None)


def is_dotgit(component: str) -> bool:
    """True when a file system could resolve this name to `.git` (or it is git's own 8.3 alias)."""
    name = unicodedata.normalize("NFC", component.translate(_IGNORABLE)).rstrip(". ").lower()
    return name == ".git" or re.fullmatch(r"git~\d+", name) is not None


def tree_path_error(path: str) -> str | None:
    """Why `path` may not be written into a source tree, or None when it may."""
    if not path:
        return "is empty"
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):
        return "contains a control character"
    if path.startswith("/") or _DRIVE.match(path):
        return "is absolute"
    if "\\" in path:
        return "contains a backslash"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "escapes the source tree"
    if any(is_dotgit(p) for p in parts):
        return "is inside .git (git's own files)"
    return None


def symlink_target_error(link: str, target: str) -> str | None:
    """Why a symbolic link at `link` (a tree path) may not point at `target`, or None."""
    if not target or "\0" in target or "\n" in target:
        return "has an empty or malformed target"
    if target.startswith("/") or _DRIVE.match(target) or "\\" in target:
        return f"points outside the tree ({target})"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
    if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        return f"points outside the tree ({target})"
    if any(is_dotgit(p) for p in resolved.split("/")) or any(is_dotgit(p) for p in target.split("/")):
        return f"points into .git ({target})"
    return None

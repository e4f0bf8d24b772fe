"""Which paths a patch or an artifact may write: inside the tree, never into git's own files.

One rule for both (patch paths and wheel members), pure and strict: relative POSIX paths
without empty, `.` or `..` components, no backslashes, drive letters or control characters,
and no component that git (on any file system) would take for `.git`: any case, trailing dots
or spaces (NTFS), zero-width characters (HFS+), or the 8.3 short name `GIT~1`.
Symbolic links may point only inside the tree and never into `.git`: each target on its own
(`symlink_target_error`), and followed as the OS follows it through the tree's other links
(`resolve_in_tree`), so a chain of links that each look harmless cannot reach out either.
"""

from __future__ import annotations

import functools
import posixpath
import re
import unicodedata

_DRIVE = re.compile(r"^[A-Za-z]:")
# characters HFS+ ignores when it compares names (git's is_hfs_dotgit list)
_IGNORABLE = dict.fromkeys(map(ord, "\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                                    "\u206a\u206b\u206c\u206d\u206e\u206f\ufeff"), None)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_GIT_8_3 = re.compile(r"git~\d+")


def is_dotgit(component: str) -> bool:
    """True when a file system could resolve this name to `.git` (or it is git's own 8.3 alias)."""
    if component.isascii():  # nothing to normalize or ignore (the usual case, and the cheap one)
        name = component.rstrip(". ").lower()
    else:
        name = unicodedata.normalize("NFC", component.translate(_IGNORABLE)).rstrip(". ").lower()
    return name == ".git" or (name[:4] == "git~" and _GIT_8_3.fullmatch(name) is not None)


@functools.lru_cache(maxsize=1 << 16)
def tree_path_error(path: str) -> str | None:
    """Why `path` may not be written into a source tree, or None when it may (pure; remembered, since
    a patch names each path up to four times and a stack the same paths again)."""
    if not path:
        return "is empty"
    if _CONTROL.search(path):
        return "contains a control character"
    if path[0] == "/" or _DRIVE.match(path):
        return "is absolute"
    if "\\" in path:
        return "contains a backslash"
    parts = path.split("/")
    if "" in parts or "." in parts or ".." in parts:
        return "escapes the source tree"
    # only a name starting with "." or "g", or one that is not ASCII, can resolve to .git
    if any((p[0] in ".gG" or not p.isascii()) and is_dotgit(p) for p in parts):
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


MAX_LINK_HOPS = 40  # what Linux allows (ELOOP) when it follows a path's symbolic links


def resolve_in_tree(path: str, links: dict[str, str]) -> tuple[str | None, set[str]]:
    """Follow `path` through the tree the way the OS would, where `links` ({tree path: target}) are
    the tree's symbolic links: every component that is a link is replaced by its target before the
    next `..` is taken, so a chain of links that each look harmless is seen for what it reaches.

    Returns (why it leaves the tree or reaches into .git, or None; the links it went through)."""
    todo = [p for p in path.split("/") if p]
    cur: list[str] = []
    used: set[str] = set()
    hops = 0
    while todo:
        c = todo.pop(0)
        if c in ("", "."):
            continue
        if c == "..":
            if not cur:
                return "points outside the tree", used
            cur.pop()
            continue
        if is_dotgit(c):
            return "points into .git", used
        cur.append(c)
        here = "/".join(cur)
        target = links.get(here)
        if target is None:
            continue
        used.add(here)
        hops += 1
        if hops > MAX_LINK_HOPS:
            return "is a loop of symbolic links", used
        if not target or "\0" in target or "\n" in target:
            return "has an empty or malformed target", used
        if target.startswith("/") or _DRIVE.match(target) or "\\" in target:
            return f"points outside the tree ({target})", used
        cur.pop()
        todo = target.split("/") + todo
    return None, used

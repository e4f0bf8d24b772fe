"""A patch stack: `patches/<engine>/<tag>/series` plus one normalized patch per line."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from patcher.base.errors import PatchFormatError, StackError, show
from patcher.base.fsutil import atomic_write_text
from patcher.base.textfile import read_text
from patcher.formats.patchfile import Patch, format_patch, lint_patch, parse_patch, patch_filename
from patcher.formats.pinref import PinRef

if TYPE_CHECKING:
    from patcher.formats.parsecache import ParseCache

SERIES_HEADER = "# Patch order for this stack; one file per line. Written by dsadapt; comments survive.\n"


@dataclass(frozen=True)
class StackEntry:
    name: str
    patch: Patch
    text: str


@dataclass(frozen=True)
class Stack:
    ref: PinRef
    dir: Path
    entries: tuple[StackEntry, ...]
    exists: bool = True

    @property
    def patches(self) -> tuple[Patch, ...]:
        return tuple(e.patch for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def hash(self) -> str:
        return stack_hash(self.entries)

    @property
    def short_hash(self) -> str:
        return self.hash[:10]

    def touched_paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for e in self.entries for p in e.patch.touched_paths))


def stack_hash(entries) -> str:
    """sha256 over the ordered (name, bytes) of every patch: names the exact stack."""
    h = hashlib.sha256(b"dsadapt-stack-v1\0")
    for e in entries:
        h.update(e.name.encode() + b"\0" + e.text.encode("utf-8") + b"\0")
    return h.hexdigest()


def stack_dir(patches_root: Path, ref: PinRef) -> Path:
    return patches_root / ref.engine / ref.tag


_NOT_PLAIN = re.compile(r"[/\\\s\x00-\x1f\x7f]")


def series_name_error(name: str) -> str | None:
    """Why a series line is not a plain patch file name of the stack's own directory."""
    if name.startswith(".") or _NOT_PLAIN.search(name):
        return "is not a plain patch file name"
    if len(name) > 200:
        return "is longer than 200 characters"
    return None


def parse_series(text: str, where: str = "series") -> list[str]:
    names: list[str] = []
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        why = series_name_error(line)
        if why:
            raise StackError(f"{where}:{n}: {show(line, 60)!r} {why}",
                             hint="series lines name files in the same directory, e.g. 0001-fix.patch")
        if line in names:
            raise StackError(f"{where}:{n}: {line} is listed twice", hint="remove the duplicate line")
        names.append(line)
    return names


def _regular_file(path: Path, what: str) -> bool:
    """Whether a regular file is there (one lstat); a symbolic link is refused."""
    import stat

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        raise StackError(f"{path}: the {what} is a symbolic link",
                         hint="a stack holds regular files only; replace the link with the file it points to")
    return stat.S_ISREG(mode)


def load_stack(patches_root: Path, ref: PinRef, *, must_exist: bool = True, cache: ParseCache | None = None) -> Stack:
    """The stack of `ref` under `patches_root`, every patch parsed (`cache`: parses remembered by
    the files' content, `patcher.formats.parsecache`; the same Stack either way; the caller saves
    the cache once its command has got that far without an error)."""
    d = stack_dir(patches_root, ref)
    series = d / "series"
    if not series.exists():
        if must_exist:
            raise StackError(f"no stack for {ref}: {series} does not exist",
                             hint="create it (an empty series file is a valid stack) or check the tag")
        return Stack(ref, d, (), exists=False)
    _regular_file(series, "series file")
    names = parse_series(read_text(series, StackError, where=str(series)), where=str(series))
    entries = []
    for name in names:
        f = d / name
        if not _regular_file(f, "patch file"):
            raise StackError(f"{series}: names {name}, which does not exist",
                             hint=f"restore {f} or remove its line from series")
        # bytes as they are: a CRLF patch stays CRLF, and the format check refuses it
        text = read_text(f, PatchFormatError, where=str(f),
                         hint="a patch is UTF-8 text; regenerate it with `dsadapt refresh` or `git format-patch`")
        entries.append(StackEntry(name, cache.parse(text, str(f)) if cache is not None else parse_patch(text, where=str(f)), text))
    stack = Stack(ref, d, tuple(entries))
    refuse_unsafe_links(stack, None)  # what the stack's own links do (the base's: once it is known)
    return stack


def refuse_unsafe_links(stack: Stack, base_links: dict[str, str] | None) -> None:
    """Raise (exit 2) when the stack makes a symbolic link lead outside the tree (`symlink_problems`)."""
    if not touches_links(stack.patches):
        return
    problems = symlink_problems(stack.patches, base_links)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PatchFormatError(f"{stack.dir}: {problems[0]}{more}",
                               hint="a stack may create, move or retarget symbolic links only to files inside the "
                                    "tree; fix or drop that patch")


def lint_stack(stack: Stack, cache: ParseCache | None = None) -> list[str]:
    """Problems in the stack's files themselves (not whether it applies); `cache` as for `load_stack`."""
    problems = []
    listed = {e.name for e in stack.entries}
    if stack.dir.is_dir():
        for f in sorted(stack.dir.glob("*.patch")):
            if f.name not in listed:
                problems.append(f"{f}: not listed in series")
    for i, e in enumerate(stack.entries, 1):
        where = str(stack.dir / e.name)
        problems += cache.lint(e.patch, e.text, where) if cache is not None else lint_patch(e.patch, e.text, where)
        expected = patch_filename(i, e.patch.subject)
        if e.name != expected:
            problems.append(f"{where}: file name should be {expected} (position {i}, from its subject)")
    return problems


def format_series(names: list[str], old_text: str | None = None) -> str:
    """Series text keeping the leading comment block of the old file."""
    head = SERIES_HEADER
    if old_text:
        lead = []
        for line in old_text.split("\n"):
            if line.startswith("#") or not line.strip():
                lead.append(line)
            else:
                break
        while lead and not lead[-1].strip():
            lead.pop()
        if lead:
            head = "\n".join(lead) + "\n"
    return head + "".join(n + "\n" for n in names)


def write_stack(d: Path, patches: list[Patch]) -> list[str]:
    """Write patches in normalized form with stable names and rewrite series.

    Files of the old series that are no longer part of the stack are removed.
    Returns the new file names. Unchanged content is not rewritten (zero-byte change).
    """
    d.mkdir(parents=True, exist_ok=True)
    series = d / "series"
    old_text = series.read_text(encoding="utf-8") if series.exists() else None
    old_names = parse_series(old_text) if old_text else []
    names = []
    for i, p in enumerate(patches, 1):
        name = patch_filename(i, p.subject)
        text = format_patch(p)
        f = d / name
        if not f.exists() or f.read_text(encoding="utf-8") != text:
            atomic_write_text(f, text)
        names.append(name)
    for old in old_names:
        if old not in names:
            (d / old).unlink(missing_ok=True)
    new_series = format_series(names, old_text)
    if new_series != old_text:
        atomic_write_text(series, new_series)
    return names


def expected_preimages(patches) -> tuple[dict[str, tuple[str | None, int]], dict[str, str | None], list[str]]:
    """What the base tree must hold for the stack to apply byte-exactly, and what it leaves.

    Returns (base, post, problems): base is {path: (blob id or None for 'absent', index of the
    first patch touching it)}; post is {path: blob id the last patch touching it leaves, or None
    where it leaves the path absent}; problems are inconsistencies inside the stack (a patch whose
    pre-image is not what the previous patch of the same file produced).
    """
    from patcher.formats.patchfile import ZERO_ID

    current: dict[str, str | None] = {}
    base: dict[str, tuple[str | None, int]] = {}
    problems: list[str] = []
    for i, p in enumerate(patches, 1):
        for f in p.files:
            if f.old_path is not None:
                old = f.old_blob if f.old_blob != ZERO_ID else None
                if f.old_path in current:
                    if old is not None and current[f.old_path] != old:
                        problems.append(f"patch {i} ({p.subject}): {f.old_path} pre-image {old[:12]} is not what "
                                        f"an earlier patch left ({(current[f.old_path] or 'absent')[:12]})")
                elif old is not None:
                    base[f.old_path] = (old, i)
            elif f.new_path is not None and f.new_path not in current:
                base.setdefault(f.new_path, (None, i))
            if f.old_path and f.old_path != f.new_path:
                current[f.old_path] = None
            if f.new_path is not None:
                current[f.new_path] = f.new_blob if f.new_blob != ZERO_ID else None
    return base, current, problems


SYMLINK_MODE = "120000"


def touches_links(patches) -> bool:
    """Whether any patch could create, move, copy or retarget a symbolic link: a link mode, a rename
    or copy, or a change that states no mode (it keeps whatever the tree has, a link included)."""
    for p in patches:
        for f in p.files:
            if SYMLINK_MODE in (f.mode, f.old_mode):
                return True
            if f.old_path and f.new_path and (f.old_path != f.new_path or f.copy):
                return True
            if f.old_path and f.new_path and f.mode is None:
                return True
    return False


def symlink_problems(patches, base_links: dict[str, str] | None) -> list[str]:
    """Symbolic links the stack creates, renames, copies or retargets that lead outside the tree or
    into .git, after any patch: each link is followed through every link the tree holds at that
    point (`paths.resolve_in_tree`), so chains, links made by one patch and moved by another, and
    retargets by a change without a mode are all seen. `base_links` ({path: target}) are the base
    tree's links; None when the base is not known yet (then only what the stack itself makes is
    followed). A base link nobody touches is upstream's business and is not judged."""
    from patcher.base.paths import resolve_in_tree

    known = base_links is not None
    links: dict[str, str] = dict(base_links or {})
    touched: set[str] = set()
    reported: set[str] = set()
    problems: list[str] = []
    for i, p in enumerate(patches, 1):
        changed = False
        for f in p.files:
            old, new = f.old_path, f.new_path
            src = links.get(old) if old else None
            if old and old != new and not f.copy and old in links:
                del links[old]  # renamed away or deleted
                changed = True
            if new is None:
                continue
            mode = f.mode or (SYMLINK_MODE if src is not None else None)
            if mode is None and not known and old is not None and old not in touched:
                continue  # a path of the base: whether it is a link is told by the base pass
            if mode == SYMLINK_MODE:
                target = f.link_target if f.content else src
                if target is None:
                    problems.append(f"patch {i} ({p.subject}): {new} becomes a symbolic link whose target the "
                                    "patch does not give")
                    continue
                if links.get(new) != target or new not in links:
                    links[new] = target
                    changed = True
                touched.add(new)
            elif new in links:
                del links[new]
                changed = True
        if not changed:
            continue
        for path in sorted(links):
            if path in reported:
                continue
            why, used = resolve_in_tree(path, links)
            if why and (path in touched or used & touched):
                reported.add(path)
                problems.append(f"patch {i} ({p.subject}): symbolic link {path} -> {links[path]} {why}")
    return problems


def tree_link_problems(base_links: dict[str, str], links: dict[str, str]) -> list[str]:
    """The links of a finished tree (`links`) that lead outside it or into .git, where the stack made,
    moved or retargeted them or one they go through (the base's own, untouched, are not judged)."""
    from patcher.base.paths import resolve_in_tree

    touched = {p for p, t in links.items() if base_links.get(p) != t}
    out = []
    for path in sorted(links):
        why, used = resolve_in_tree(path, links)
        if why and (path in touched or used & touched):
            out.append(f"symbolic link {path} -> {links[path]} {why}")
    return out


def preimage_mismatches(expected: dict[str, tuple[str | None, int]], actual: dict[str, str | None],
                        stack: Stack) -> list[str]:
    """Human-readable mismatches between expected base blobs and the tree's actual blobs."""
    out = []
    for path, (want, idx) in sorted(expected.items(), key=lambda kv: (kv[1][1], kv[0])):
        got = actual.get(path)
        if want != got:
            name = stack.entries[idx - 1].name if idx - 1 < len(stack.entries) else f"patch {idx}"
            w = want[:12] if want else "absent"
            g = got[:12] if got else "absent"
            out.append(f"{name}: {path} is {g} in the tree, the patch expects {w}")
    return out

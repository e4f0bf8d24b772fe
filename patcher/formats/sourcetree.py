"""Which members of a release artifact make an engine's trees (pure).

One rule, used by every place that turns a wheel into a tree: the pypi source (the base
tree a checkout is made from), the overlay build (which members a variant ships), and the
tests (which build base trees only through dsadapt itself).

- The base tree is the wheel's source files: everything except the ``*.dist-info/`` and
  ``*.data/`` directories and compiled binaries (``.so`` and versioned ``.so.N``, ``.pyd``,
  ``.dylib``, ``.dll``, ``.a``, ``.o``), minus what the engine declares on top
  (`TreeRules.drop`).
- A variant ships every member except its `leave_out` patterns (e.g. LMDeploy's PyTorch-only
  variant leaves TurboMind's 364 MB extension out).

Patterns are `fnmatch` patterns over the member's full name (``lmdeploy/lib/_turbomind*.so``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

#: Compiled members: never part of a source tree.
BINARY_SUFFIXES = (".so", ".pyd", ".dylib", ".dll", ".a", ".o")
#: Top-level directories of a wheel that hold metadata or install-scheme data, not sources.
METADATA_DIRS = (".dist-info", ".data")


@dataclass(frozen=True)
class TreeRules:
    """What an engine adds to the default base-tree rule (declared by its adapter)."""

    drop: tuple[str, ...] = ()   # fnmatch patterns of members that are not source


def is_binary(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith(BINARY_SUFFIXES) or ".so." in base


def is_tree_member(name: str, rules: TreeRules = TreeRules()) -> bool:
    """True when the artifact member `name` belongs to the base tree."""
    if not name or name.endswith("/"):
        return False
    top = name.split("/", 1)[0]
    if top.endswith(METADATA_DIRS) or is_binary(name):
        return False
    return not any(fnmatch.fnmatch(name, pat) for pat in rules.drop)


def split_tree_members(names: Iterable[str], rules: TreeRules = TreeRules()) -> tuple[list[str], list[str]]:
    """(members of the base tree, members left out), each sorted; directory entries are neither."""
    keep: list[str] = []
    drop: list[str] = []
    for name in sorted(names):
        if name.endswith("/"):
            continue
        (keep if is_tree_member(name, rules) else drop).append(name)
    return keep, drop


def left_out(name: str, patterns: Iterable[str]) -> bool:
    """True when a variant's `leave_out` patterns drop the member `name` from what it ships."""
    return any(fnmatch.fnmatch(name, pat) for pat in patterns)

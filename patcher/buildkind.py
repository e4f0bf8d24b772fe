"""Which kind of build a stack needs, decided from the paths its patches touch (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from .engines.base import EngineAdapter
from .stack import Stack


@dataclass(frozen=True)
class BuildKind:
    kind: str                       # overlay | full | backend
    reasons: tuple[str, ...] = ()   # for full: "NNNN-x.patch touches csrc/foo.cu"

    def __str__(self) -> str:
        return self.kind


def classify(ad: EngineAdapter, stack: Stack) -> BuildKind:
    if ad.build_kind == "backend":
        return BuildKind("backend")
    reasons = tuple(f"{e.name} touches {p}" for e in stack.entries for p in e.patch.touched_paths if ad.is_compiled(p))
    return BuildKind("full", reasons) if reasons else BuildKind("overlay")

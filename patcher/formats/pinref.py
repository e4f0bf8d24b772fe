"""`ENGINE@TAG` references, as users type them."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from patcher.base.errors import UsageError, show

_ENGINE_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
MAX_ENGINE = 40
MAX_TAG = 128


@dataclass(frozen=True, order=True)
class PinRef:
    engine: str
    tag: str

    def __str__(self) -> str:
        return f"{self.engine}@{self.tag}"


def tag_error(tag: str) -> str | None:
    """Why `tag` is not a plain git tag name dsadapt accepts (None when it is)."""
    if not tag:
        return "is empty"
    if len(tag) > MAX_TAG:
        return f"is longer than {MAX_TAG} characters"
    if not _TAG_RE.match(tag) or ".." in tag or tag.endswith((".lock", ".")):
        return "is not a valid tag name"
    return None


def check_tag(tag: str, what: str = "tag") -> str:
    """`tag` itself when it is a plain tag name, else a one-line usage error."""
    why = tag_error(tag)
    if why:
        raise UsageError(f"{what} '{show(tag, 60)}' {why}",
                         hint="tags are letters, digits and . _ + - (like v0.32.0 or r24.08), no slashes or '..'")
    return tag


def parse_pinref(text: str) -> PinRef:
    """Parse ``ENGINE@TAG``; the tag must be a plain git ref name component."""
    engine, sep, tag = text.partition("@")
    if not sep or not engine or not tag:
        raise UsageError(f"'{show(text, 60)}' is not ENGINE@TAG", hint="write it like vllm@v0.32.0")
    if not _ENGINE_RE.match(engine) or len(engine) > MAX_ENGINE:
        raise UsageError(f"'{show(engine, 40)}' is not a valid engine name",
                         hint="engine names are lower-case letters, digits, - and _, e.g. vllm")
    check_tag(tag)
    return PinRef(engine, tag)


def _loose(name: str) -> str:
    """A tag or engine name as people mistype it: case, a leading v/r and the separator ignored."""
    text = name.strip().lower().replace("_", ".").replace("-", ".")
    return text[1:] if len(text) > 1 and text[0] in "vr" and text[1].isdigit() else text


def _version(loose: str) -> tuple[int, ...] | None:
    return tuple(int(x) for x in loose.split(".")) if re.fullmatch(r"\d+(\.\d+)*", loose) else None


def _same(a: str, b: str) -> bool:
    """Equal loose names; release numbers equal up to trailing zeros (0.32 and 0.32.0)."""
    va, vb = _version(a), _version(b)
    if va is None or vb is None:
        return a == b
    n = max(len(va), len(vb))
    return va + (0,) * (n - len(va)) == vb + (0,) * (n - len(vb))


def near_miss(text: str, known: Iterable[str]) -> str | None:
    """Pure: the one known name `text` was most likely meant to be, or None. The same name up to
    case, a leading `v`/`r` (0.32.0 for v0.32.0, 26.01 for r26.01), `-`/`_`/`.` and, for release
    numbers, trailing zeros (v0.32 for v0.32.0) wins; a release number is never guessed otherwise
    (v0.32.1 is another release, not a typo of v0.32.0); other names: the closest by difflib's
    ratio (0.8 and up: a character or two off), only when no other name is as close."""
    if len(text) > MAX_TAG:  # no name is that long: nothing is near it
        return None
    names = sorted(set(known))
    loose = _loose(text)
    same = [n for n in names if _same(_loose(n), loose)]
    if len(same) == 1:
        return same[0]
    if same or not loose or _version(loose):
        return None  # another release number is another release, not a typo: no guess
    scored = sorted(((difflib.SequenceMatcher(None, loose, _loose(n)).ratio(), n) for n in names), reverse=True)
    if not scored or scored[0][0] < 0.8 or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return None
    return scored[0][1]


def near_pin(text: str, pins: Iterable[str]) -> str | None:
    """Pure: the pinned ENGINE@TAG that `text` (a pin, or a pin with another separator: vllm-v0.32.0,
    vllm v0.32.0, vllm:v0.32.0) most likely means, or None: the engine and the tag each a near miss
    (`near_miss`), the engine first."""
    if len(text) > MAX_ENGINE + 1 + MAX_TAG:
        return None
    pins = sorted(set(pins))
    engine, sep, tag = text.strip().partition("@")
    if not sep:
        m = re.match(r"^([A-Za-z][A-Za-z0-9_]*?)[\s:/=#-]+([A-Za-z0-9][A-Za-z0-9._+-]*)$", text.strip())
        if not m:
            return None
        engine, tag = m.groups()
    by_engine: dict[str, list[str]] = {}
    for p in pins:
        name, _, pinned = p.partition("@")
        by_engine.setdefault(name, []).append(pinned)
    eng = engine.lower() if engine.lower() in by_engine else near_miss(engine, by_engine)
    if eng is None:
        return None
    meant = tag if tag in by_engine[eng] else near_miss(tag, by_engine[eng])
    return None if meant is None else f"{eng}@{meant}"

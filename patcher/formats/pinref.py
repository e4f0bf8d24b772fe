"""`ENGINE@TAG` references, as users type them."""

from __future__ import annotations

import re
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

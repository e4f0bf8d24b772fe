"""`ENGINE@TAG` references, as users type them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError

_ENGINE_RE = re.compile(r"^[a-z][a-z0-9_-]*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True, order=True)
class PinRef:
    engine: str
    tag: str

    def __str__(self) -> str:
        return f"{self.engine}@{self.tag}"


def parse_pinref(text: str) -> PinRef:
    """Parse ``ENGINE@TAG``; the tag must be a plain git ref name component."""
    engine, sep, tag = text.partition("@")
    if not sep or not engine or not tag:
        raise UsageError(f"'{text}' is not ENGINE@TAG", hint="write it like vllm@v0.32.0")
    if not _ENGINE_RE.match(engine):
        raise UsageError(f"'{engine}' is not a valid engine name", hint="engine names are lower-case, e.g. vllm")
    if not _TAG_RE.match(tag) or ".." in tag or tag.endswith(".lock"):
        raise UsageError(f"'{tag}' is not a valid tag name", hint="tags look like v0.32.0 or r24.08")
    return PinRef(engine, tag)

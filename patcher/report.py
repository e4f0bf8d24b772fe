"""report: one row per pin: stack size, patches by Upstream-Status, the last check verdict, and
patches whose Drop-When a newer pin already satisfies (candidates to drop).

Check verdicts come from the JSON files `dsadapt check` writes under
reports/<engine>/<tag>/*.json (top-level keys pin, verdict, date, device, stack_hash); the
newest by date wins. Files without those keys (e.g. reports/rebase/) are not verdicts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import Config
from .engines import adapter
from .errors import DsadaptError
from .lock import Lock, LockEntry
from .patchfile import drop_when_satisfied
from .stack import Stack, load_stack

_GPU_RE = re.compile(r"gpu|cuda|nvidia|\b[ahlb]\d{2,3}\b|h200|h100|rocm|hip", re.IGNORECASE)
_VERDICT_KEYS = {"pin", "verdict", "date", "device", "stack_hash"}


@dataclass(frozen=True)
class Verdict:
    file: str
    verdict: str
    date: str
    device: str
    stack_hash: str

    @property
    def gpu(self) -> bool:
        return bool(_GPU_RE.search(self.device))


@dataclass(frozen=True)
class DropCandidate:
    patch: str
    spec: str
    satisfied_by: str          # the newer pin whose version satisfies the spec


@dataclass
class PinReport:
    pin: str
    patches: int
    stack_exists: bool
    stack_hash: str | None
    upstream_status: dict[str, int]
    check: str                 # never checked | pass <date> | GPU-verified <date> | fail <date> (+ stale)
    last_check: dict | None = None
    drop_candidates: list[DropCandidate] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def read_verdicts(reports_root: Path, entry: LockEntry) -> list[Verdict]:
    d = reports_root / entry.engine / entry.tag
    out = []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or not _VERDICT_KEYS <= set(data) or data.get("pin") != str(entry.ref):
            continue
        out.append(Verdict(str(f), str(data["verdict"]), str(data["date"]), str(data["device"]),
                           str(data["stack_hash"])))
    return out


def check_words(verdicts: list[Verdict], stack_hash: str | None) -> tuple[str, Verdict | None]:
    """Pure: the last verdict (newest date) in words."""
    if not verdicts:
        return "never checked", None
    last = max(verdicts, key=lambda v: (v.date, v.file))
    if last.verdict == "pass":
        words = f"GPU-verified {last.date}" if last.gpu else f"pass {last.date} ({last.device})"
    else:
        words = f"{last.verdict} {last.date} ({last.device})"
    if stack_hash and last.stack_hash != stack_hash:
        words += "; stack changed since"
    return words, last


def drop_candidates(stack: Stack, entry: LockEntry, newer: list[LockEntry], dists: tuple[str, ...]) -> list[DropCandidate]:
    """Pure: patches whose Drop-When spec a newer pin's version satisfies (the oldest such pin)."""
    from packaging.requirements import InvalidRequirement

    out = []
    for e in stack.entries:
        for spec in e.patch.trailer_values("Drop-When"):
            for n in newer:
                try:
                    hit = drop_when_satisfied(spec, dists, n.version)
                except InvalidRequirement:
                    break
                if hit:
                    out.append(DropCandidate(e.name, spec, str(n.ref)))
                    break
    return out


def build_report(cfg: Config, lock: Lock) -> list[PinReport]:
    rows = []
    for engine in sorted(lock.engines):
        ad = adapter(engine)
        dists = (ad.name, *ad.pypi)
        pins = lock.pins_of(engine)
        for i, entry in enumerate(pins):
            try:
                stack = load_stack(cfg.patches_root, entry.ref, must_exist=False)
            except DsadaptError as e:
                rows.append(PinReport(str(entry.ref), 0, True, None, {}, "never checked", error=e.message))
                continue
            words, last = check_words(read_verdicts(cfg.reports_root, entry), stack.hash if stack.exists else None)
            statuses = Counter(p.upstream_status or "(none)" for p in stack.patches)
            rows.append(PinReport(
                str(entry.ref), len(stack), stack.exists, stack.hash if stack.exists else None,
                dict(sorted(statuses.items())), words, asdict(last) if last else None,
                drop_candidates(stack, entry, pins[i + 1:], dists)))
    return rows

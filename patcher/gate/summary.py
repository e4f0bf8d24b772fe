"""report: one row per pin: stack size, patches by Upstream-Status, the last check verdict, and
patches whose Drop-When a newer pin already satisfies (candidates to drop).

Check verdicts come from the JSON reports under the project's committed reports/ and under this
machine's scratch reports (the work dir's reports/, where `dsadapt check` writes
<engine>/<tag>/<model>-<dtype>.json unless `--publish` sends it to reports/), any depth, that
state `pin` and `verdict`, with `date`, `device` and `stack_hash` at the top level or under
`provenance`; the newest by date wins. Other JSON (e.g. reports/rebase/) and unpatched control
runs are not verdicts.
Speed-gate reports (`dsadapt perf`, schema dsadapt.perf-report/1) give the "last perf"
column the same way; A/A calibration runs are not verdicts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import DsadaptError
from patcher.engines import adapter
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.patchfile import drop_when_satisfied
from patcher.formats.stackfiles import Stack, load_stack

_GPU_RE = re.compile(r"\bgpu\b|cuda|nvidia|rocm", re.IGNORECASE)
_VERDICT_KEYS = ("pin", "verdict", "date", "device", "stack_hash")


@dataclass(frozen=True)
class Verdict:
    file: str
    pin: str
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
    perf: str = "never measured"   # the speed gate's last verdict, in the same words
    last_perf: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def verdict_of(data, file: str) -> Verdict | None:
    """Pure: the verdict a check report states, or None if the JSON is not a check report.

    Accepts `pin`/`verdict` at the top level with `date`/`device`/`stack_hash` either at the top
    level or under `provenance` (where `dsadapt check` puts them). Reports of the unpatched
    engine (`"unpatched": true`, a control run) are not the stack's verdict.
    """
    if not isinstance(data, dict) or data.get("unpatched") or _is_perf(data):
        return None
    raw_prov = data.get("provenance")
    prov: dict = raw_prov if isinstance(raw_prov, dict) else {}
    if prov.get("unpatched_engine"):  # Triton served with the pristine engine: a control run too
        return None
    fields = {k: data.get(k, prov.get(k)) for k in _VERDICT_KEYS}
    if any(fields[k] is None for k in ("pin", "verdict", "date", "device")):
        return None
    return Verdict(file, str(fields["pin"]), str(fields["verdict"]), str(fields["date"]), str(fields["device"]),
                   str(fields["stack_hash"] or ""))


def _is_perf(data: dict) -> bool:
    return str(data.get("schema", "")).startswith("dsadapt.perf-report/")


def perf_verdict_of(data, file: str) -> Verdict | None:
    """Pure: the verdict a speed-gate report states, or None (not a perf report, an A/A
    calibration run, or a report without date/device)."""
    if not isinstance(data, dict) or not _is_perf(data) or data.get("mode") != "patched-vs-unpatched":
        return None
    raw_prov = data.get("provenance")
    prov: dict = raw_prov if isinstance(raw_prov, dict) else {}
    fields = {k: data.get(k, prov.get(k)) for k in _VERDICT_KEYS}
    if any(fields[k] is None for k in ("pin", "verdict", "date", "device")):
        return None
    return Verdict(file, str(fields["pin"]), str(fields["verdict"]), str(fields["date"]), str(fields["device"]),
                   str(fields["stack_hash"] or ""))


def read_verdicts(*reports_roots: Path, of=None) -> dict[str, list[Verdict]]:
    """Every check report under the given report folders (any depth), by pin (`of=perf_verdict_of`:
    every speed-gate report instead)."""
    of = of or verdict_of
    out: dict[str, list[Verdict]] = {}
    files = [f for root in reports_roots if root.is_dir() for f in sorted(root.rglob("*.json"))]
    for f in files:
        data = _report_doc(f)
        if data is None:
            continue
        v = of(data, str(f))
        if v is not None:
            out.setdefault(v.pin, []).append(v)
    return out


_DOCS: dict[tuple[str, int, int], object] = {}


def _report_doc(f: Path) -> object | None:
    """The parsed JSON of a report file, read once per process while it is unchanged (`report`
    reads every report for the check verdicts and again for the speed gate's)."""
    try:
        st = f.stat()
        key = (str(f), st.st_mtime_ns, st.st_size)
        if key not in _DOCS:
            _DOCS[key] = json.loads(f.read_text(encoding="utf-8"))
        return _DOCS[key]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def check_words(verdicts: list[Verdict], stack_hash: str | None, never: str = "never checked") -> tuple[str, Verdict | None]:
    """Pure: the last verdict in words: the newest check of the current stack; only when the
    current stack was never checked, the newest of any (and "stack changed since"). A newer check
    of another stack (a planted-bug copy, an older branch) never hides the current stack's."""
    if not verdicts:
        return never, None
    current = [v for v in verdicts if stack_hash and v.stack_hash == stack_hash]
    last = max(current or verdicts, key=lambda v: (v.date, v.file))
    if last.verdict == "pass":
        words = f"GPU-verified {last.date}" if last.gpu else f"pass {last.date} ({last.device})"
    else:
        words = f"{last.verdict} {last.date} ({last.device})"
    if stack_hash and last.stack_hash != stack_hash:
        words += "; stack changed since"
    return words, last


def drop_candidates(stack: Stack, entry: LockEntry, newer: list[LockEntry], dists: tuple[str, ...]) -> list[DropCandidate]:
    """Pure: patches whose Drop-When spec a newer pin's version satisfies (the oldest such pin)."""
    out = []
    for e in stack.entries:
        for spec in e.patch.trailer_values("Drop-When"):
            for n in newer:
                try:
                    hit = drop_when_satisfied(spec, dists, n.version)
                except ValueError:  # packaging's InvalidRequirement: not a spec (`verify` says so)
                    break
                if hit:
                    out.append(DropCandidate(e.name, spec, str(n.ref)))
                    break
    return out


def build_report(cfg: Config, lock: Lock) -> list[PinReport]:
    rows = []
    verdicts = read_verdicts(*cfg.report_roots)
    perfs = read_verdicts(*cfg.report_roots, of=perf_verdict_of)
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
            words, last = check_words(verdicts.get(str(entry.ref), []), stack.hash if stack.exists else None)
            perf_words, last_perf = check_words(perfs.get(str(entry.ref), []), stack.hash if stack.exists else None,
                                                never="never measured")
            statuses = Counter(p.upstream_status or "(none)" for p in stack.patches)
            rows.append(PinReport(
                str(entry.ref), len(stack), stack.exists, stack.hash if stack.exists else None,
                dict(sorted(statuses.items())), words, asdict(last) if last else None,
                drop_candidates(stack, entry, pins[i + 1:], dists), perf=perf_words,
                last_perf=asdict(last_perf) if last_perf else None))
    return rows

"""report: one row per pin: stack size, patches by Upstream-Status, what the gates say of the
current stack, and patches whose Drop-When a newer pin already satisfies (candidates to drop).

Verdicts come from the JSON reports under the project's committed reports/ and under this
machine's scratch reports (the work dir's reports/, where `dsadapt check` writes
<engine>/<tag>/<model>-<style>-<dtype>.json unless `--publish` sends it to reports/), any depth,
that state `pin` and `verdict`, with `date`, `device` and `stack_hash` at the top level or under
`provenance`. Other JSON (e.g. reports/rebase/) and unpatched control runs are not verdicts.

**Which verdicts count.** A pin's verdicts are those of its current stack (its stack hash); only
when the current stack was never checked, those of any stack ("stack changed since"). Each
verdict belongs to a *configuration*: (variant, model, config style, dtype, parallel config: the
tensor-parallel size a report states, 1 when it states none). Per configuration the newest
verdict wins; the pin's verdict is the worst of its configurations, so a passing float32 run of
one model never hides a failing float16 run of another.

**Speed gate** (`dsadapt perf`, schema dsadapt.perf-report/1) the same way, with the workload as
part of the configuration: a *calibrated* run (the default workload, threshold and at least the
default rounds; docs/speed.md) is the verdict; a quicker run is shown next to it, never in its
place. A/A calibration runs are not verdicts.

**Rules change.** A check report scored by another rule than today's is flagged (`stale`):
`patcher.gate.equivalence.rule_drift` applies the current rule to the report's recorded inputs, or, for a
report without them, compares the rule's parameters; `dsadapt check --rescore REPORT` rescores one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patcher.base.config import Config
from patcher.base.errors import DsadaptError, UsageError
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.parsecache import ParseCache
from patcher.formats.patchfile import drop_when_satisfied
from patcher.formats.stackfiles import Stack, load_stack

if TYPE_CHECKING:
    from patcher.rules.logits import Comparison, LogitReport

SCHEMA = "dsadapt.report/1"
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
    variant: str = ""
    model: str = ""
    config_style: str = ""
    dtype: str = ""
    parallel: str = "1"
    workload: str = ""          # perf: "calibrated", or what makes a run quicker than the calibrated one
    stale: str | None = None    # why the verdict may not be what the current rule gives
    #: how far the check's worst judged quantity is from its limit, in words ("" when unknown)
    margin: str = ""
    #: the patch files of the stack it judged (provenance.patches), to tell an older version of the
    #: pin's stack (a subset of today's) from another stack (a planted-bug copy: one patch more)
    patches: tuple[str, ...] = ()

    @property
    def gpu(self) -> bool:
        return bool(_GPU_RE.search(self.device))

    @property
    def machine(self) -> str:
        """The machine in a word or two: the GPU's model ('H200') or 'CPU'."""
        return machine_name(self.device)

    @property
    def config(self) -> tuple[str, str, str, str, str]:
        """The configuration this verdict is about (one newest verdict each)."""
        return (self.variant, self.model, self.config_style, self.dtype, self.parallel)

    @property
    def label(self) -> str:
        from patcher.rules.verdicts import parallel_label

        return " ".join(x for x in (self.variant, self.model, self.config_style, self.dtype,
                                    parallel_label(self.parallel)) if x)


def machine_name(device: str) -> str:
    """Pure: a report's `device` ('GPU NVIDIA H200', 'CPU AMD EPYC (2 cores)') as a table names the
    machine: the GPU's model without the vendor ('H200'), else 'CPU'."""
    if _GPU_RE.search(device or ""):
        name = re.sub(r"^\s*GPU\s+|\bNVIDIA\s+|\bAMD\s+", "", device or "").strip()
        return name or "GPU"
    return "CPU"


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
    check: str                 # never checked | pass <date> | GPU-verified <date> | fail <date> (+ how many configs)
    last_check: dict | None = None
    drop_candidates: list[DropCandidate] = field(default_factory=list)
    error: str | None = None
    perf: str = "never measured"   # the speed gate's verdict, in the same words
    last_perf: dict | None = None
    #: the newest verdict per configuration, worst first (what `check` and `perf` summarize)
    checks: list[dict] = field(default_factory=list)
    perfs: list[dict] = field(default_factory=list)
    verdict: str = "never checked"   # pass | fail | never checked: the worst configuration's
    stale: int = 0                   # verdicts in `checks` scored by another rule than today's
    #: the verdicts in `checks` are of the current stack (False: of an earlier one, "stack changed since")
    current: bool = False
    #: where the verdicts in `checks` were judged ('CPU', 'H200'), and the newest of their dates
    machines: list[str] = field(default_factory=list)
    newest: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _fields(data: dict) -> dict | None:
    raw_prov = data.get("provenance")
    prov: dict = raw_prov if isinstance(raw_prov, dict) else {}
    fields = {k: data.get(k, prov.get(k)) for k in _VERDICT_KEYS}
    if any(fields[k] is None for k in ("pin", "verdict", "date", "device")):
        return None
    raw_settings = prov.get("engine_settings")
    settings: dict = raw_settings if isinstance(raw_settings, dict) else {}
    parallel = data.get("parallel", prov.get("parallel", settings.get("tensor_parallel_size", settings.get("tp"))))
    if isinstance(parallel, dict):  # {"tp", "ep", "label", ...} as check reports state it: "2", "2+ep"
        parallel = f"{int(parallel.get('tp') or 1)}" + ("+ep" if parallel.get("ep") else "")
    patches = prov.get("patches")
    return {"pin": str(fields["pin"]), "verdict": str(fields["verdict"]), "date": str(fields["date"]),
            "device": str(fields["device"]), "stack_hash": str(fields["stack_hash"] or ""),
            "patches": tuple(str(x) for x in patches) if isinstance(patches, list) else (),
            "variant": str(data.get("variant") or ""), "model": str(data.get("model") or ""),
            "config_style": str(data.get("config_style") or ""), "dtype": str(data.get("dtype") or ""),
            "parallel": str(parallel or 1)}


def verdict_of(data, file: str, *, stale=None, margin=None) -> Verdict | None:
    """Pure (but for `stale`): the verdict a check report states, or None if the JSON is not a check report.

    Accepts `pin`/`verdict` at the top level with `date`/`device`/`stack_hash` either at the top
    level or under `provenance` (where `dsadapt check` puts them). Reports of the unpatched
    engine (`"unpatched": true`, a control run) are not the stack's verdict. `stale(data, file)`
    says why the verdict may not be the current rule's (None: it is); `margin(data, file)` stands in
    for `margin_of` (a cache of it)."""
    if not isinstance(data, dict) or data.get("unpatched") or _is_perf(data):
        return None
    raw_prov = data.get("provenance")
    prov: dict = raw_prov if isinstance(raw_prov, dict) else {}
    if prov.get("unpatched_engine"):  # Triton served with the pristine engine: a control run too
        return None
    fields = _fields(data)
    if fields is None:
        return None
    return Verdict(file, **fields, stale=stale(data, file) if stale else None,
                   margin=margin(data, file) if margin else margin_of(data))

def margin_of(data: dict) -> str:
    """Pure: a check report's margin in a few words: 'margin 1.63x' (a pass: the worst point is at
    1/1.63 of its limit) or 'over by 2.10x' (a fail), from its stored margins (or, for a report
    written before margins were stored, from its comparison and bisect summary)."""
    m = data.get("margins")
    if not isinstance(m, dict) or "worst" not in m:
        from patcher.rules.verdicts import check_margins  # only for reports without stored margins

        try:
            m = check_margins(data.get("comparison") or {}, (data.get("bisect") or {}).get("margin")).to_json()
        except (KeyError, TypeError, ValueError, AttributeError):
            return ""
    worst = m.get(m.get("worst") or "") if m.get("worst") else None
    if not isinstance(worst, dict) or worst.get("margin") is None:
        return ""
    if bool(worst.get("above")) != (data.get("verdict") == "fail"):
        return ""  # an older report whose failing part stored no margin: unknown, not a pass's margin
    where = " at the logits" if m["worst"] == "logits" else f" at {worst.get('where')}" if worst.get("where") else ""
    return (f"over by {worst['margin']:.2f}x{where}" if worst.get("above") else f"margin {worst['margin']:.2f}x{where}")


def _is_perf(data: dict) -> bool:
    return str(data.get("schema", "")).startswith("dsadapt.perf-report/")


def perf_workload(data: dict) -> str:
    """Pure: "calibrated" for a speed-gate run of the default workload (levels, mixes, requests,
    at least the default rounds and warm-up, the default threshold: what docs/speed.md calibrated),
    else what makes it quicker or different ("3 rounds", "concurrency 4", ...)."""
    from patcher.rules.speed import DEFAULT_CONCURRENCY, DEFAULT_ROUNDS, DEFAULT_THRESHOLD, default_requests

    raw = data.get("workload")
    w: dict = raw if isinstance(raw, dict) else {}
    diffs = []
    rounds = w.get("rounds")
    if not isinstance(rounds, int) or rounds < DEFAULT_ROUNDS:
        diffs.append(f"{rounds} rounds")
    conc = list(w.get("concurrency") or [])
    if conc != list(DEFAULT_CONCURRENCY):
        diffs.append("concurrency " + ",".join(map(str, conc)))
    mixes = [m.get("name") for m in w.get("mixes") or [] if isinstance(m, dict)]
    if mixes != ["short", "medium", "long"]:
        diffs.append("mixes " + ",".join(str(m) for m in mixes))
    raw_levels = w.get("requests_per_level")
    per_level: dict = raw_levels if isinstance(raw_levels, dict) else {}
    sent = {str(c): int(per_level.get(str(c)) or w.get("requests_per_run") or 0) for c in conc}
    if any(n < default_requests(int(c)) for c, n in sent.items()):
        counts = sorted(set(sent.values()))
        diffs.append(f"{','.join(map(str, sent.values())) if len(counts) > 1 else counts[0]} requests per run")
    if not (w.get("warmup_rounds") or 0) >= 1:
        diffs.append("no warm-up")
    if data.get("threshold") not in (None, DEFAULT_THRESHOLD):
        diffs.append(f"threshold {data.get('threshold')}")
    return "calibrated" if not diffs else ", ".join(diffs)


def perf_verdict_of(data, file: str) -> Verdict | None:
    """Pure: the verdict a speed-gate report states, or None (not a perf report, an A/A
    calibration run, or a report without date/device)."""
    if not isinstance(data, dict) or not _is_perf(data) or data.get("mode") != "patched-vs-unpatched":
        return None
    fields = _fields(data)
    if fields is None:
        return None
    return Verdict(file, **fields, workload=perf_workload(data))


def read_verdicts(*reports_roots: Path, of=None, memo: dict | None = None) -> dict[str, list[Verdict]]:
    """Every check report under the given report folders (any depth), by pin (`of=perf_verdict_of`:
    every speed-gate report instead). `memo` ({file: [stamps, verdict fields or None]}, read and
    updated): a file whose report, inputs and bisect report are unchanged (size, mtime) is not
    parsed again -- `report` reads every report of the project at each start."""
    of = of or verdict_of
    out: dict[str, list[Verdict]] = {}
    # a bisect report (<check>-bisect.json) is read with its check report, never as a verdict
    files = [f for root in reports_roots if root.is_dir() for f in sorted(root.rglob("*.json"))
             if not f.name.endswith("-bisect.json")]
    for f in files:
        key = _stamps(f) if memo is not None else None
        hit = memo.get(str(f)) if memo is not None else None
        found, v = _remembered(hit, key)
        if not found:
            data = _report_doc(f)
            if data is None:
                continue
            v = of(data, str(f))
            if memo is not None:
                memo[str(f)] = [key, asdict(v) if v is not None else None]
        if v is not None:
            out.setdefault(v.pin, []).append(v)
    return out


def _remembered(hit, key: list | None) -> tuple[bool, Verdict | None]:
    """(True, the verdict or None) from a memo entry ([stamps, fields or None]) whose stamps are
    `key`; (False, None) otherwise -- an entry of another shape or of other fields (a damaged
    cache) is a miss, never an error. Lists come back as the tuples they were (JSON has none)."""
    if not (isinstance(hit, list) and len(hit) == 2 and hit[0] == key):
        return False, None
    if hit[1] is None:
        return True, None
    if not isinstance(hit[1], dict):
        return False, None
    fields: dict[str, Any] = {k: tuple(x) if isinstance(x, list) else x for k, x in hit[1].items()}
    try:
        return True, Verdict(**fields)
    except TypeError:
        return False, None


def _stamps(f: Path) -> list:
    """(size, mtime) of a report and of the files its verdict reads besides it (inputs, bisect report)."""
    return [_stamp(f), _stamp(inputs_path(f)), _stamp(f.with_name(f.stem + "-bisect.json"))]


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


def _severity(v: Verdict) -> int:
    """0 the worst: a failure, then anything else that is not a pass, then a stale pass, then a pass."""
    return 0 if v.verdict == "fail" else 1 if v.verdict != "pass" else 2 if v.stale else 3


def newest_per_config(verdicts: list[Verdict], stack_hash: str | None,
                      patches: tuple[str, ...] | None = None) -> tuple[list[Verdict], bool]:
    """Pure: the newest verdict of each configuration, worst first, of the current stack (only when
    the current stack has none: of the earlier versions of this stack, and True for "stack changed
    since"). A newer check of another stack (a planted-bug copy, an older branch) never hides the
    current stack's. With the current stack's `patches` (file names), an earlier version is a stack
    whose recorded patches are all among today's (a patch changed or added since); a stack that
    carried a patch today's does not (a planted bug on top) is another stack, counted only when no
    earlier version was ever checked."""
    current = [v for v in verdicts if stack_hash and v.stack_hash == stack_hash]
    earlier = [v for v in verdicts if patches is not None and v.patches and set(v.patches) <= set(patches)]
    pool = current or earlier or verdicts
    newest: dict[tuple, Verdict] = {}
    for v in sorted(pool, key=lambda v: (v.date, v.file)):
        newest[v.config] = v
    rows = sorted(newest.values(), key=lambda v: (_severity(v), v.label))
    return rows, bool(verdicts) and not current and bool(stack_hash)


def _words(v: Verdict) -> str:
    date = v.date
    if v.verdict == "pass":
        words = f"GPU-verified {date} ({v.device})" if v.gpu else f"pass {date} ({v.device})"
    else:
        words = f"{v.verdict} {date} ({v.device})"
    return words + (f", {v.margin}" if v.margin else "")


def machines(rows: list[Verdict]) -> list[str]:
    """Pure: the machines the verdicts were judged on ('CPU', 'H200'), in order of first mention."""
    return list(dict.fromkeys(v.machine for v in rows))


def check_words(verdicts: list[Verdict], stack_hash: str | None, never: str = "never checked",
                patches: tuple[str, ...] | None = None) -> tuple[str, Verdict | None]:
    """Pure: the pin's verdict in words: the worst of the newest verdict per configuration
    (`newest_per_config`) and its date, the newest check's date when that is later, how many
    configurations were judged and, when they ran on more than one machine, where else; returns it
    and the worst verdict."""
    rows, changed = newest_per_config(verdicts, stack_hash, patches)
    if not rows:
        return never, None
    worst = rows[0]
    words = _words(worst)
    newest = max(v.date for v in rows)
    if newest > worst.date:
        words += f"; newest check {newest}"
    others = [m for m in machines(rows) if m != worst.machine]
    if others:
        words += f"; also on {', '.join(others)}"
    if len(rows) > 1:
        bad = [v for v in rows if v.verdict != "pass"]
        words += (f"; {len(bad)} of {len(rows)} configs fail: " + ", ".join(v.label for v in bad[:3])
                  + (" …" if len(bad) > 3 else "")) if bad else f"; {len(rows)} configs pass"
    stale = [v for v in rows if v.stale]
    if stale:
        words += f"; {len(stale)} scored by an older rule (`dsadapt check --rescore REPORT`)"
    if changed:
        words += "; stack changed since"
    return words, worst


def perf_words(verdicts: list[Verdict], stack_hash: str | None,
               patches: tuple[str, ...] | None = None) -> tuple[str, Verdict | None, list[Verdict]]:
    """Pure: the speed gate's verdict in words: the worst calibrated configuration; quicker runs are
    named next to it (never in its place), or stand alone, said to be quick, when there is no
    calibrated run. Returns (words, the verdict, every configuration's newest run)."""
    rows, changed = newest_per_config([v for v in verdicts if v.workload == "calibrated"], stack_hash, patches)
    quick, qchanged = newest_per_config([v for v in verdicts if v.workload != "calibrated"], stack_hash, patches)
    if not rows and not quick:
        return "never measured", None, []
    if rows:
        words, worst = check_words([v for v in verdicts if v.workload == "calibrated"], stack_hash,
                                   never="never measured", patches=patches)
        newer = [q for q in quick if q.date > max(v.date for v in rows)]
        if newer:
            q = newer[0]
            words += f"; newer quick run {q.date}: {q.verdict} ({q.workload})"
        return words, worst, rows + quick
    worst = quick[0]
    words = f"{_words(worst)} (quick run: {worst.workload}; no calibrated run)" + \
            ("; stack changed since" if qchanged else "")
    return words, worst, quick


def drop_candidates(stack: Stack, entry: LockEntry, newer: list[LockEntry], dists: tuple[str, ...],
                    satisfied=drop_when_satisfied) -> list[DropCandidate]:
    """Pure: patches whose Drop-When spec a newer pin's version satisfies (the oldest such pin);
    `satisfied` stands in for `drop_when_satisfied` (a cache of it)."""
    out = []
    for e in stack.entries:
        for spec in e.patch.trailer_values("Drop-When"):
            for n in newer:
                try:
                    hit = satisfied(spec, dists, n.version)
                except ValueError:  # packaging's InvalidRequirement: not a spec (`verify` says so)
                    break
                if hit:
                    out.append(DropCandidate(e.name, spec, str(n.ref)))
                    break
    return out


def _row(v: Verdict, project: Path) -> dict:
    d = asdict(v)
    with contextlib.suppress(ValueError):
        d["file"] = str(Path(v.file).relative_to(project))
    d["config"] = v.label
    d["machine"] = v.machine
    d["patches"] = list(v.patches)
    return d


def _rules_digest(stored: dict | None = None) -> tuple[str, dict]:
    """What today's rules are: a digest of the modules that judge a stored check (a change to any of
    them re-judges every report) and of the logit rule's parameters as the rule states them now (a
    rule changed without a change to these files, e.g. by a plugin or a test, is a changed rule too).

    Returns (digest, what the cache keeps to say it next time). The parameters are a function of
    the files while `patcher.rules.logits` is as its import made it: a process that has not
    imported it takes them from `stored` when they were stated, for the same files, by a process
    that imported the module only to state them (so never changed it) -- `report` then imports no
    rule module; any other process states them itself."""
    import hashlib
    import sys

    h = hashlib.sha256()
    rules = Path(__file__).resolve().parents[1] / "rules"
    for f in sorted([*rules.glob("*.py"), Path(__file__).resolve()]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    files = h.hexdigest()
    kept = (stored or {}).get("rule_of_files")
    fresh = "patcher.rules.logits" not in sys.modules
    if fresh and isinstance(kept, dict) and kept.get("files") == files and isinstance(kept.get("params"), list):
        params = kept["params"]
    else:
        params = [current_rule(d) for d in ("float32", "bfloat16", "float16")]
        kept = {"files": files, "params": params} if fresh else None
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest()[:16], {"rule_of_files": kept} if kept else {}


def _stamp(path: Path) -> list:
    try:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns]
    except OSError:
        return []


def build_report(cfg: Config, lock: Lock) -> list[PinReport]:
    # re-judging a stored check is a pure function of its files and of the rules: remembered per
    # machine (the work dir's cache), keyed by both, so an unchanged report is read, not re-judged
    cache_file = cfg.cache / "report-rejudged.json"
    seen = _read_cache(cache_file)
    digest, rule_note = _rules_digest(seen)
    if seen.get("rules") != digest:
        seen = {}
    known = dict(seen.get("reports") or {})
    fresh: dict[str, list] = {}

    def judged(data: dict, file: str) -> list:
        """[stamps, drift, margin] of one report, from the cache while its files are unchanged."""
        f = Path(file)
        key = _stamps(f)
        hit = known.get(file)
        if isinstance(hit, list) and len(hit) == 3 and hit[0] == key:
            fresh[file] = hit
            return hit
        try:
            drift = rule_drift(data, f)
        except DsadaptError as e:  # a report the rule cannot read is said to be so, never counted as current
            drift = f"cannot be scored by the current rule ({e.message})"
        fresh[file] = [key, drift, margin_of(data)]
        return fresh[file]

    def stale(data: dict, file: str) -> str | None:
        return judged(data, file)[1]

    def margin(data: dict, file: str) -> str:
        return judged(data, file)[2]

    rows = []
    # whether a version satisfies a Drop-When spec: remembered (packaging's parser is most of a
    # `report` start-up otherwise); a spec it cannot read is never remembered
    drops: dict[str, bool] = {k: v for k, v in (seen.get("drops") or {}).items() if isinstance(v, bool)}

    def satisfied(spec: str, dist_names: tuple[str, ...], version: str) -> bool:
        key = json.dumps([spec, sorted(dist_names), version])
        if key not in drops:
            drops[key] = drop_when_satisfied(spec, dist_names, version)
        return drops[key]

    # the verdicts themselves, per file while it is unchanged (same rules: the digest keys the cache)
    memo = {k: dict(v) for k, v in (seen.get("verdicts") or {}).items() if isinstance(v, dict)}
    memo.setdefault("check", {})
    memo.setdefault("perf", {})
    verdicts = read_verdicts(*cfg.report_roots, of=lambda d, f: verdict_of(d, f, stale=stale, margin=margin),
                             memo=memo["check"])
    perfs = read_verdicts(*cfg.report_roots, of=perf_verdict_of, memo=memo["perf"])
    parse_cache = ParseCache.in_workdir(cfg.workdir)
    for engine in sorted(lock.engines):
        decl = lock.engine(engine)  # its PyPI names as the project declares them, as `verify` judges Drop-When
        pins = lock.pins_of(engine)
        for i, entry in enumerate(pins):
            rows.append(_pin_row(cfg, entry, pins[i + 1:], (decl.name, *decl.pypi), (verdicts, perfs),
                                 satisfied, parse_cache))
    # what a file no longer listed left in the memo goes, as the re-judging cache's entries do
    listed = {str(f) for root in cfg.report_roots if root.is_dir() for f in root.rglob("*.json")}
    memo = {k: {f: v for f, v in m.items() if f in listed} for k, m in memo.items()}
    # a report read from the memo was not re-judged this time: its re-judging entry stays
    fresh = {**{f: v for f, v in known.items() if f in listed and f in memo["check"]}, **fresh}
    if not rule_note and seen.get("rule_of_files"):  # stated by a pristine process for today's files: kept
        rule_note = {"rule_of_files": seen["rule_of_files"]}
    parse_cache.save()
    _write_cache(cache_file, seen, {"rules": digest, "reports": fresh, "verdicts": memo, "drops": drops, **rule_note})
    return rows


def _read_cache(cache_file: Path) -> dict:
    """The re-judging cache as last written ({} when absent, unreadable or not an object)."""
    try:
        seen = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return seen if isinstance(seen, dict) else {}


def _write_cache(cache_file: Path, seen: dict, new: dict) -> None:
    """Write the re-judging cache when anything in it changed since `seen` was read."""
    if all(new.get(k) == seen.get(k) for k in ("rules", "reports", "verdicts", "drops", "rule_of_files")):
        return
    with contextlib.suppress(OSError):  # a cache: a read-only work dir only costs the re-judging
        from patcher.base.fsutil import atomic_write_text

        cache_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_file, json.dumps(new, sort_keys=True))


def _pin_row(cfg: Config, entry: LockEntry, newer: list[LockEntry], dists: tuple[str, ...],
             read: tuple[dict[str, list[Verdict]], dict[str, list[Verdict]]], satisfied,
             parse_cache: ParseCache) -> PinReport:
    """One pin's row: its stack, its checks' and speed-gate runs' verdicts (`read`: check and perf
    verdicts by pin) and the patches a newer pin may drop."""
    verdicts, perfs = read
    try:
        stack = load_stack(cfg.patches_root, entry.ref, must_exist=False, cache=parse_cache)
    except DsadaptError as e:
        return PinReport(str(entry.ref), 0, True, None, {}, "never checked", error=e.message)
    current = stack.hash if stack.exists else None
    names = tuple(e.name for e in stack.entries) if stack.exists else None
    mine = verdicts.get(str(entry.ref), [])
    words, last = check_words(mine, current, patches=names)
    checks, changed = newest_per_config(mine, current, names)
    p_words, last_perf, perf_rows = perf_words(perfs.get(str(entry.ref), []), current, names)
    statuses = Counter(p.upstream_status or "(none)" for p in stack.patches)
    return PinReport(
        str(entry.ref), len(stack), stack.exists, current,
        dict(sorted(statuses.items())), words, asdict(last) if last else None,
        drop_candidates(stack, entry, newer, dists, satisfied), perf=p_words,
        last_perf=asdict(last_perf) if last_perf else None,
        checks=[_row(v, cfg.project) for v in checks], perfs=[_row(v, cfg.project) for v in perf_rows],
        verdict=(last.verdict if last else "never checked"), stale=sum(bool(v.stale) for v in checks),
        current=bool(checks) and not changed, machines=machines(checks),
        newest=max((v.date for v in checks), default=None))

# ---------------------------------------------------------------- re-judging stored checks
#
# A check report keeps the logit reports its rule compared (<report>.inputs.json.gz) and, in low
# precision, the yardstick in its comparison and the per-module evidence in its bisect report, so
# a later rule can be applied without running anything (`dsadapt check --rescore`, and `report`'s
# stale flags).

INPUTS_SCHEMA = "dsadapt.check-inputs/1"


def inputs_path(report: Path) -> Path:
    """Where a check report's inputs are kept: the logit reports the rule compared (the reference,
    the engine, and in low precision the reference's own run in that dtype), as
    <report>.inputs.json.gz, so that `check --rescore` can apply a later rule to them."""
    return report.with_name(report.stem + ".inputs.json.gz")


def save_inputs(report: Path, reference: LogitReport, engine_report: LogitReport, top_k: int,
                noise: LogitReport | None = None) -> Path:
    import gzip

    path = inputs_path(report)
    doc = {"schema": INPUTS_SCHEMA, "top_k": top_k, "reference": reference.to_json(), "engine": engine_report.to_json(),
           "noise": None if noise is None else noise.to_json()}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    tmp.replace(path)
    return path


def load_inputs(report: Path) -> tuple[LogitReport, LogitReport, LogitReport | None, int] | None:
    """The recorded inputs of a check report, or None when it has none (made before they were kept)."""
    import gzip

    from patcher.rules.logits import LogitReport

    path = inputs_path(report)
    if not path.is_file():
        return None
    try:
        doc = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, EOFError, ValueError) as e:
        raise UsageError(f"{path}: not readable ({e})", hint="rerun the check to record them again") from None
    if not isinstance(doc, dict) or doc.get("schema") != INPUTS_SCHEMA:
        raise UsageError(f"{path}: not a {INPUTS_SCHEMA} document", hint="rerun the check to record them again")
    noise = LogitReport.from_json(doc["noise"]) if doc.get("noise") else None
    return LogitReport.from_json(doc["reference"]), LogitReport.from_json(doc["engine"]), noise, int(doc["top_k"])


@dataclass
class Rejudged:
    """A stored check re-judged under today's rule (`rejudge`)."""

    verdict: str | None              # None: the stored report lacks what today's rule needs
    reasons: list[str]
    logits: Comparison | None        # today's comparison, when the logits could be compared again
    bisect: dict | None              # today's per-module summary (as the check report keeps it), or None
    missing: list[str]               # what today's rule needs that the report does not keep
    judged_comparison: dict | None = None  # without recorded inputs: the stored comparison, judged today


def rejudge(doc: dict, path: Path | None) -> Rejudged:
    """Re-judge a stored check report under the rule as it is now: the logits from the recorded
    inputs (<report>.inputs.json.gz) when there are any, else from the stored comparison
    (`patcher.rules.verdicts.rescore`); the per-module part from the bisect report next to it."""
    from patcher.rules.logits import LOW_PRECISION_DTYPES, compare
    from patcher.rules.verdicts import rescore

    dtype = str(doc.get("dtype") or "")
    bisect_doc = None
    if path is not None:
        bpath = Path(path).with_name(Path(path).stem + "-bisect.json")  # gate.bisect.report_paths
        got = _report_doc(bpath) if bpath.is_file() else None  # parsed once per process
        bisect_doc = got if isinstance(got, dict) else None
    stored = rescore(doc, bisect_doc)
    inputs = None
    if path is not None:
        inputs = load_inputs(Path(path))
    if inputs is None:
        return Rejudged(stored["verdict"], stored["reasons"], None, None, list(stored.get("cannot_judge") or []),
                        judged_comparison=stored.get("comparison"))
    ref, eng, noise, k = inputs
    comparison = compare(ref, eng, k, noise=noise, routing_flips=(bisect_doc or {}).get("routing_flips"))
    module_reasons = [x for x in stored["reasons"] if x.startswith("per-module comparison")]
    reasons = list(comparison.reasons) + module_reasons
    missing = [m for m in (stored.get("cannot_judge") or []) if "per-module" in m or "bisect" in m]
    bisect = None
    if bisect_doc is not None and doc.get("bisect"):
        bisect = {**doc["bisect"], "passed": not module_reasons}
    if dtype not in LOW_PRECISION_DTYPES:
        missing = []
    return Rejudged(None if missing else ("pass" if not reasons else "fail"), reasons, comparison, bisect, missing)


def current_rule(dtype: str) -> dict:
    """The logit rule the gate applies today to an engine in `dtype` when it has no yardstick, as the
    rule itself states it: {"rule", "tolerance", "thresholds"} of `compare` on a one-position pair
    (so a change of the rule's parameters is seen here without a copy of them)."""
    from patcher.rules.logits import LogitReport, PositionLogprobs, PromptResult, compare

    def side(d: str) -> LogitReport:
        top = {t: -1.0 - t for t in range(20)}
        pos = PositionLogprobs(0, -1.0, top)
        return LogitReport("probe", "probe", "0", d, 20, 1, [PromptResult("p", None, [0, 0], [None, pos], [0], [pos])])

    c = compare(side("float32"), side(dtype), 5)
    return {"rule": c.rule, "tolerance": c.tolerance, "thresholds": c.thresholds}


def rule_drift(doc: dict, path: Path | None) -> str | None:
    """Why a check report's verdict may not be what the current rule gives, or None: today's rule
    gives another verdict (`dsadapt check --rescore REPORT` rewrites it), or the report lacks what
    today's rule needs (rerun its command)."""
    if not (doc.get("comparison") or {}).get("rule"):
        return None  # the engine produced no logits: no rule was applied
    comp = doc.get("comparison") or {}
    cmd = (doc.get("provenance") or {}).get("command") or "dsadapt check"
    try:
        has_inputs = path is not None and load_inputs(Path(path)) is not None
    except DsadaptError as e:
        return f"its recorded inputs are unreadable ({e.message})"
    if not has_inputs and comp.get("rule") == "strict":  # the strict rule's verdict needs its inputs again
        rule = current_rule(str(doc.get("dtype") or "float32"))
        changed = [k for k in ("rule", "tolerance") if comp.get(k) != rule[k]]
        if changed:
            return (f"scored by an older rule ({', '.join(changed)} differ) and has no recorded inputs to rescore: "
                    f"rerun `{cmd}`")
        return None
    try:
        now = rejudge(doc, path)
    except DsadaptError as e:  # an unreadable inputs file
        return f"its recorded inputs are unreadable ({e.message})"
    if now.verdict is None:
        return (f"scored by an older rule; today's needs {', '.join(now.missing)}: rerun "
                f"`{(doc.get('provenance') or {}).get('command') or 'dsadapt check'}`")
    if now.verdict != doc.get("verdict"):
        return f"the current rule says {now.verdict}: `dsadapt check --rescore {path}`"
    return None

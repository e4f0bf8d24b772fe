"""upstream.lock: pinned upstream trees and release artifacts.

The file is TOML written by dsadapt (stable ordering, one table per pin) and readable by
people. Loading validates every field and names the offending line on error. See
docs/lock-format.md.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from patcher.base.errors import LockError, UsageError, show
from patcher.base.textfile import read_text
from patcher.formats.pinref import PinRef, near_miss, near_pin, parse_pinref

LOCK_VERSION = 1
HEADER = (
    "# upstream.lock: the upstream trees and release artifacts dsadapt's patch stacks are pinned to.\n"
    "# Written by `dsadapt pin`; ordering is stable so diffs stay small. Format: docs/lock-format.md\n"
)
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*\.(whl|tar\.gz|zip)$")
# A git remote: a URL with a transport git runs itself (never ext::, fd:: or a "-option"), or a path.
_GIT_URL_RE = re.compile(r"^(?:(?:https?|git|ssh|file)://[^\s]+|[A-Za-z0-9_.~-]+@[A-Za-z0-9_.-]+:[^\s]*|[/.~][^\s]*)$")
_ENGINE_KEYS = {"git", "pypi"}
_PIN_KEYS = {"version", "commit", "tree", "serves", "python", "artifacts", "note"}
_ART_KEYS = {"dist", "variant", "file", "sha256", "source", "size"}


@dataclass(frozen=True)
class Artifact:
    """A release artifact usable as a source (unpacked) or as an overlay-build base."""

    dist: str
    variant: str
    file: str
    sha256: str
    source: bool = False
    size: int | None = None

    @property
    def is_wheel(self) -> bool:
        return self.file.endswith(".whl")


@dataclass(frozen=True)
class EngineDecl:
    name: str
    git: str
    pypi: tuple[str, ...] = ()


@dataclass(frozen=True)
class LockEntry:
    """One pin: ENGINE@TAG with what is known about its upstream tree."""

    engine: str
    tag: str
    version: str
    commit: str | None = None
    tree: str | None = None
    artifacts: tuple[Artifact, ...] = ()
    serves: str | None = None
    python: str | None = None
    note: str | None = None

    @property
    def ref(self) -> PinRef:
        return PinRef(self.engine, self.tag)

    def __str__(self) -> str:
        return f"{self.engine}@{self.tag}"

    def artifact(self, variant: str | None = None, *, wheel: bool | None = None) -> Artifact | None:
        for a in self.artifacts:
            if variant is not None and a.variant != variant:
                continue
            if wheel is not None and a.is_wheel != wheel:
                continue
            return a
        return None

    def source_artifact(self) -> Artifact | None:
        marked = [a for a in self.artifacts if a.source]
        return marked[0] if marked else (self.artifacts[0] if self.artifacts else None)

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.variant for a in self.artifacts))


@dataclass(frozen=True)
class Lock:
    engines: dict[str, EngineDecl]
    pins: dict[str, LockEntry] = field(default_factory=dict)
    path: Path | None = None

    def engine(self, name: str) -> EngineDecl:
        try:
            return self.engines[name]
        except KeyError:
            known = ", ".join(sorted(self.engines)) or "none"
            meant = near_miss(name.partition("@")[0], self.engines)
            raise UsageError(
                f"unknown engine '{show(name, 40)}'",
                hint=(f"did you mean {meant}? " if meant else "") + f"engines in upstream.lock: {known}",
            ) from None

    def pin(self, ref: PinRef | str) -> LockEntry:
        if isinstance(ref, str):
            text = ref
            try:
                ref = parse_pinref(text)
            except UsageError as e:
                meant = near_pin(text, self.pins)
                if meant:
                    raise UsageError(e.message, hint=f"did you mean {meant}?") from None
                raise
        if ref.engine not in self.engines:
            meant = near_pin(str(ref), self.pins)
            if meant:
                raise UsageError(f"unknown engine '{show(ref.engine, 40)}'",
                                 hint=f"did you mean {meant}? engines in upstream.lock: "
                                      f"{', '.join(sorted(self.engines))}")
        self.engine(ref.engine)
        try:
            return self.pins[str(ref)]
        except KeyError:
            tags = ", ".join(p.tag for p in self.pins_of(ref.engine)) or "none"
            meant = near_pin(str(ref), self.pins)
            raise UsageError(
                f"{ref} is not pinned",
                hint=(f"did you mean {meant}? (pinned {ref.engine} tags: {tags})" if meant else
                      f"pinned {ref.engine} tags: {tags}; add one with `dsadapt pin {ref}`"),
            ) from None

    def pins_of(self, engine: str) -> list[LockEntry]:
        return sorted((p for p in self.pins.values() if p.engine == engine), key=pin_sort_key)

    def sorted_pins(self) -> list[LockEntry]:
        """Every pin, by engine, then by release version (v0.4.0 before v0.18.0), then tag."""
        return sorted(self.pins.values(), key=pin_sort_key)

    def with_pin(self, entry: LockEntry) -> Lock:
        pins = dict(self.pins)
        pins[str(entry.ref)] = entry
        return replace(self, pins=pins)


def pin_sort_key(p: LockEntry):
    return (p.engine, version_key(p.version), version_key(p.tag.lstrip("vVrR")), p.tag)


def version_key(v: str):
    """(0, a PEP 440 version) for a valid version, (1, the text) for anything else: valid versions
    first, in PEP 440 order. A plain release (``0.32.0``, ``26.01``) is compared without packaging's
    parser (`_Release`), which a start-up that only sorts the lock's pins would otherwise import."""
    if _PLAIN_RELEASE.fullmatch(v):
        return (0, _Release(v))
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(v))
    except InvalidVersion:
        return (1, v)


_PLAIN_RELEASE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})*")


@functools.total_ordering
class _Release:
    """A plain release version, ordered as packaging.version.Version orders it (by its numbers,
    trailing zeros left out: 1.0 == 1.0.0); compared with any other version through packaging."""

    __slots__ = ("text", "release")

    def __init__(self, text: str):
        self.text = text
        parts = [int(x) for x in text.split(".")]
        while len(parts) > 1 and parts[-1] == 0:
            parts.pop()
        self.release = tuple(parts)

    def _other(self, other):
        if isinstance(other, _Release):
            return other.release, self.release
        from packaging.version import Version

        if isinstance(other, Version):
            return other, Version(self.text)
        return None

    def __eq__(self, other) -> bool:
        got = self._other(other)
        return NotImplemented if got is None else got[1] == got[0]

    def __lt__(self, other) -> bool:
        got = self._other(other)
        return NotImplemented if got is None else got[1] < got[0]

    def __hash__(self) -> int:
        return hash(self.release)

    def __str__(self) -> str:
        return self.text


# ---------------------------------------------------------------- loading


def _line_of(text: str, *needles: str, start: int = 1, end: int | None = None) -> int | None:
    """1-based line of the first line in [start, end) containing all needles."""
    for i, line in enumerate(text.splitlines(), 1):
        if i < start or (end is not None and i >= end):
            continue
        if all(n in line for n in needles):
            return i
    return None


def _section(text: str, header: str, nth: int = 1) -> tuple[int, int | None] | None:
    """Line range [start, end) of the nth table whose header line starts with `header`."""
    lines = text.splitlines()
    seen = 0
    for i, line in enumerate(lines, 1):
        if line.strip().startswith(header):
            seen += 1
            if seen == nth:
                for j in range(i + 1, len(lines) + 1):
                    if lines[j - 1].lstrip().startswith("["):
                        return i, j
                return i, None
    return None


class _Ctx:
    def __init__(self, path: Path, text: str):
        self.path, self.text = path, text

    def fail(self, msg: str, *needles: str | tuple[str, ...], hint: str | None = None,
             section: tuple[str, int] | None = None) -> LockError:
        """The error, located at the first line matching a needle (inside `section`, the nth
        table with that header, when given: a key repeated in other tables is not the culprit)."""
        line = None
        rng = _section(self.text, *section) if section else None
        for n in needles:
            parts = (n,) if isinstance(n, str) else n
            if rng:
                line = _line_of(self.text, *parts, start=rng[0], end=rng[1])
            if not line:
                line = _line_of(self.text, *parts)
            if line:
                break
        where = f"{self.path.name}:{line}" if line else f"{self.path.name}"
        return LockError(f"{where}: {msg}", hint=hint or "fix the entry or regenerate it with `dsadapt pin`")


def parse_lock(text: str, path: Path = Path("upstream.lock")) -> Lock:
    ctx = _Ctx(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        where = f"{path.name}:{m.group(1)}" if m else path.name
        raise LockError(f"{where}: not valid TOML ({e})", hint="fix the syntax; the file is TOML") from None
    unknown = set(data) - {"version", "engines", "pins"}
    if unknown:
        k = sorted(unknown)[0]
        raise ctx.fail(f"unknown top-level key '{show(k, 40)}'", f"{k} =", f"[{k}",
                       hint="the top-level keys are version, engines and pins (docs/lock-format.md)")
    for table_key in ("engines", "pins"):
        if table_key in data and not isinstance(data[table_key], dict):
            raise ctx.fail(f"'{table_key}' must be a table ([{table_key}.NAME] sections), "
                           f"got {type(data[table_key]).__name__}", f"{table_key} =", f"{table_key}=",
                           hint=f"write [{table_key}.\"...\"] tables (docs/lock-format.md)")
    if data.get("version") != LOCK_VERSION:
        raise ctx.fail(
            f"lock format version must be {LOCK_VERSION}, found {data.get('version')!r}", "version ="
        )
    engines = {name: _engine_decl(ctx, name, edecl) for name, edecl in (data.get("engines") or {}).items()}
    pins = {key: _pin_entry(ctx, key, p, engines) for key, p in (data.get("pins") or {}).items()}
    for key, p in pins.items():
        if p.serves and p.serves not in pins:
            raise ctx.fail(f"pin '{key}' serves '{p.serves}', which is not pinned", ("serves", p.serves),
                           section=(f'[pins."{key}"]', 1))
    return Lock(engines=engines, pins=pins, path=path)


def _engine_decl(ctx: _Ctx, name: str, edecl) -> EngineDecl:
    """One [engines.NAME] table."""
    needle = f"[engines.{name}]"
    sec = (needle, 1)
    if not re.match(r"^[a-z][a-z0-9_-]*$", name):
        raise ctx.fail(f"engine name '{show(name, 40)}' is not lower-case letters, digits, - or _", needle)
    if not isinstance(edecl, dict):
        raise ctx.fail(f"engine '{name}' must be a table", needle)
    bad = set(edecl) - _ENGINE_KEYS
    if bad:
        raise ctx.fail(f"engine '{name}': unknown key '{sorted(bad)[0]}'", (sorted(bad)[0], "="), needle,
                       section=sec)
    git = edecl.get("git")
    if not isinstance(git, str) or not git:
        raise ctx.fail(f"engine '{name}': 'git' must be a URL string", ("git", "="), needle, section=sec)
    if not _GIT_URL_RE.match(git) or git.startswith("-"):
        raise ctx.fail(f"engine '{name}': 'git' = {show(git, 60)!r} is not a git URL dsadapt will use",
                       ("git", "="), needle, section=sec,
                       hint="use an https://, ssh://, git://, file:// URL, user@host:path, or a path")
    pypi = edecl.get("pypi", [])
    if not isinstance(pypi, list) or not all(isinstance(x, str) and x for x in pypi):
        raise ctx.fail(f"engine '{name}': 'pypi' must be a list of distribution names", ("pypi", "="), needle,
                       section=sec)
    return EngineDecl(name, git, tuple(pypi))


def _pin_entry(ctx: _Ctx, key: str, p, engines: dict[str, EngineDecl]) -> LockEntry:
    """One [pins."ENGINE@TAG"] table and its artifacts."""
    needle = f'[pins."{key}"]'
    sec = (needle, 1)
    try:
        ref = parse_pinref(key)
    except UsageError as e:
        raise ctx.fail(f"pin key '{show(key, 60)}': {e.message}", needle) from None
    if ref.engine not in engines:
        raise ctx.fail(f"pin '{key}' names engine '{ref.engine}', which is not declared", needle,
                       hint=f"add [engines.{ref.engine}] or fix the pin name")
    if not isinstance(p, dict):
        raise ctx.fail(f"pin '{key}' must be a table", needle)
    bad = set(p) - _PIN_KEYS
    if bad:
        k = sorted(bad)[0]
        raise ctx.fail(f"pin '{key}': unknown key '{k}'", (k, "="), needle, section=sec)
    version = p.get("version")
    if not isinstance(version, str) or not version:
        raise ctx.fail(f"pin '{key}': 'version' (the release version) is required", needle)
    for hk in ("commit", "tree"):
        v = p.get(hk)
        if v is not None and (not isinstance(v, str) or not _HEX40.match(v)):
            raise ctx.fail(f"pin '{key}': '{hk}' must be a 40-hex git id, got {v!r}", (hk, "=", str(v)), needle,
                           section=sec)
    for sk in ("serves", "python", "note"):
        v = p.get(sk)
        if v is not None and not isinstance(v, str):
            raise ctx.fail(f"pin '{key}': '{sk}' must be a string", (sk, "="), needle, section=sec)
    if p.get("serves") is not None:
        try:
            parse_pinref(p["serves"])
        except UsageError:
            raise ctx.fail(f"pin '{key}': 'serves' must be ENGINE@TAG", ("serves", "="), needle,
                           section=sec) from None
    raw_arts = p.get("artifacts", [])
    if not isinstance(raw_arts, list):
        raise ctx.fail(f"pin '{key}': 'artifacts' must be an array of tables", needle)
    arts = [_artifact(ctx, key, engines[ref.engine], n, a) for n, a in enumerate(raw_arts, 1)]
    return LockEntry(
        engine=ref.engine, tag=ref.tag, version=version, commit=p.get("commit"), tree=p.get("tree"),
        artifacts=tuple(arts), serves=p.get("serves"), python=p.get("python"), note=p.get("note"),
    )


def _artifact(ctx: _Ctx, key: str, engine: EngineDecl, n_art: int, a) -> Artifact:
    """One [[pins."KEY".artifacts]] table."""
    aneedle = f'[[pins."{key}".artifacts]]'
    asec = (aneedle, n_art)
    if not isinstance(a, dict):
        raise ctx.fail(f"pin '{key}': artifact must be a table", aneedle, section=asec)
    bad = set(a) - _ART_KEYS
    if bad:
        k = sorted(bad)[0]
        raise ctx.fail(f"pin '{key}': artifact has unknown key '{k}'", (k, "="), aneedle, section=asec)
    for req in ("dist", "variant", "file", "sha256"):
        if not isinstance(a.get(req), str) or not a.get(req):
            raise ctx.fail(f"pin '{key}': artifact lacks '{req}'", aneedle, section=asec)
    if not _FILE_RE.match(a["file"]):
        raise ctx.fail(f"pin '{key}': artifact file name {a['file']!r} is not a wheel or sdist name",
                       ("file", "="), aneedle, section=asec)
    if not _HEX64.match(a["sha256"]):
        raise ctx.fail(f"pin '{key}': artifact sha256 must be 64 lower-case hex digits, got {a['sha256']!r}",
                       ("sha256", "="), aneedle, section=asec)
    if engine.pypi and a["dist"] not in engine.pypi:
        raise ctx.fail(f"pin '{key}': artifact dist '{a['dist']}' is not one of engine "
                       f"'{engine.name}' PyPI distributions {list(engine.pypi)}",
                       ("dist", "="), aneedle, section=asec)
    size = a.get("size")
    if size is not None and (not isinstance(size, int) or size <= 0):
        raise ctx.fail(f"pin '{key}': artifact size must be a positive integer", ("size", "="), aneedle,
                       section=asec)
    source = a.get("source", False)
    if not isinstance(source, bool):
        raise ctx.fail(f"pin '{key}': artifact 'source' must be true or false", ("source", "="), aneedle,
                       section=asec)
    return Artifact(a["dist"], a["variant"], a["file"], a["sha256"], source, size)


def load_lock(path: Path) -> Lock:
    try:
        text = read_text(path, LockError, hint="upstream.lock is UTF-8 TOML; fix the byte or regenerate the entry "
                                              "with `dsadapt pin`", where=path.name)
    except FileNotFoundError:
        raise LockError(f"{path} not found", hint="run dsadapt from the project root, or pass --project DIR") from None
    return parse_lock(text, path)


# ---------------------------------------------------------------- writing


def format_lock(lock: Lock) -> str:
    """Deterministic TOML: engines then pins, each sorted; artifacts in stored order."""
    doc: dict = {"version": LOCK_VERSION, "engines": {}, "pins": {}}
    for name in sorted(lock.engines):
        e = lock.engines[name]
        doc["engines"][name] = {"git": e.git, "pypi": list(e.pypi)}
    for key in sorted(lock.pins, key=lambda k: pin_sort_key(lock.pins[k])):
        p = lock.pins[key]
        t: dict = {"version": p.version}
        for k in ("commit", "tree", "serves", "python", "note"):
            v = getattr(p, k)
            if v is not None:
                t[k] = v
        arts = []
        for a in p.artifacts:
            d: dict[str, object] = {"dist": a.dist, "variant": a.variant, "file": a.file, "sha256": a.sha256}
            if a.size is not None:
                d["size"] = a.size
            if a.source:
                d["source"] = True
            arts.append(d)
        if arts:
            t["artifacts"] = arts
        doc["pins"][key] = t
    import tomli_w  # (only when a lock is written: reading it is every command's start-up)

    return HEADER + "\n" + tomli_w.dumps(doc)


def write_lock(lock: Lock, path: Path) -> None:
    from patcher.base.fsutil import atomic_write_text

    atomic_write_text(path, format_lock(lock))

"""The offline bundle on disk (`dsadapt bundle` writes it, `dsadapt install --offline` reads it).

A bundle is one directory (or a tar of it) holding everything a machine without network needs
to run `dsadapt check PIN`; it is also a dsadapt project (its own upstream.lock and the pin's
stack), so `dsadapt check` runs in it. `bundle.json` (schema ``dsadapt.bundle/1``) names every
file with its sha256; nothing in a bundle is trusted before that is checked.

    bundle.json        the manifest (below)
    README.txt         what it is and the commands to run on the target
    bootstrap.py       stdlib only: makes dsadapt's environment on the target from the bundle
    upstream.lock      the pin (and the pin whose build its environment holds)
    patches/E/T/       the pin's stack (the stack hash is checked against the builds)
    wheels/            every carried wheel: dsadapt, its dependencies, the engine's dependencies
    engine/            the engine builds: the patched overlay build and the unpatched one
    locks/dsadapt.txt  hash lock of dsadapt's environment: exactly the carried wheels (sha256)
    locks/engine.txt   hash lock of the engine's environment: exactly the carried wheels (sha256)

Packages the target already has (`--have`) are not carried; the manifest lists them per part,
with the version the bundle was made for and the requirements that apply to them, and
`install --offline` checks the target against that before it installs anything.

After `install --offline`, a record next to the environments (``<venvs>/offline-installs/
<engine>-<tag>-<variant>.json``) says which bundle's builds the pin's environments hold; `install` and `check` then use those
builds instead of building (which would need the release wheel and a network).
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.base.config import Config
from patcher.base.errors import UnsafeArtifact, UsageError, VerificationError, plural, show
from patcher.base.fsutil import atomic_write_text, sha256_file
from patcher.base.textfile import read_json
from patcher.formats.pinref import PinRef, parse_pinref

SCHEMA = "dsadapt.bundle/1"
RECORD_SCHEMA = "dsadapt.offline-install/1"
MANIFEST = "bundle.json"


@dataclass(frozen=True)
class BuiltWheel:
    """An engine build in the bundle: file (relative to the bundle), sha256, version, how made."""

    file: str
    sha256: str
    version: str
    kind: str
    how: str = ""


@dataclass
class Part:
    """One environment's share of the bundle: its lock, its carried wheels, what the host gives."""

    lock: str                                   # relative path of the part's hash lock
    wheels: dict[str, str] = field(default_factory=dict)   # file -> sha256 (the lock's lines)
    host: dict[str, dict] = field(default_factory=dict)    # name -> {"have": version|None, "need": [specs]}
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why (unused by the gate, excluded)


@dataclass
class Manifest:
    pin: str
    engine: str
    variant: str
    python: str
    platforms: list[str]
    stack_hash: str
    patches: list[str]
    dsadapt: str
    created: str
    host_packages: bool                         # the target must lend its packages (--system-site-packages)
    builds: dict[str, BuiltWheel]               # "patched", and "unpatched" unless left out
    parts: dict[str, Part]                      # "dsadapt", "engine"
    files: dict[str, str]                       # every file but bundle.json -> sha256
    plan: dict = field(default_factory=dict)    # the engine's environment plan (pin, variant, suffix)
    host_source: str = ""                       # where the host's package list came from
    commands: list[str] = field(default_factory=list)
    #: other stacks of the same pin carried as overlays on the main build (`bundle --stack NAME=DIR`):
    #: name -> {"project": "stacks/NAME", "stack_hash", "patches", "build": BuiltWheel as a dict};
    #: `install --offline` makes each its project and an environment seeded from the main one
    stacks: dict[str, dict] = field(default_factory=dict)
    schema: str = SCHEMA

    @property
    def ref(self) -> PinRef:
        return parse_pinref(self.pin)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, where: str) -> Manifest:
        try:
            builds = {k: BuiltWheel(**v) for k, v in data["builds"].items()}
            parts = {k: Part(**v) for k, v in data["parts"].items()}
            fields = {k: data[k] for k in ("pin", "engine", "variant", "python", "platforms", "stack_hash", "patches",
                                           "dsadapt", "created", "host_packages", "files")}
            extra = {k: data[k] for k in ("plan", "host_source", "commands", "stacks") if k in data}
            m = cls(builds=builds, parts=parts, **fields, **extra)
        except (KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{where}: not a dsadapt bundle manifest ({type(e).__name__}: {show(e, 80)})",
                             hint="make the bundle again with `dsadapt bundle`") from None
        if data.get("schema") != SCHEMA:
            raise UsageError(f"{where}: schema {show(data.get('schema'), 40)!r}, this dsadapt reads {SCHEMA}",
                             hint="make the bundle with the same dsadapt version as the target runs")
        parse_pinref(m.pin)
        return m


def safe_rel(rel: str, where: str) -> str:
    """A path inside the bundle (relative, no '..', no absolute paths): refused otherwise."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not rel or rel.startswith("~"):
        raise UnsafeArtifact(f"{where}: {show(rel, 80)} points outside the bundle", hint="the bundle is not dsadapt's")
    return rel


def read_manifest(bundle: Path) -> Manifest:
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise UsageError(f"{show(bundle, 120)} is not a directory", hint="pass the folder (or .tar) `dsadapt bundle` wrote")
    if not path.is_file():
        raise UsageError(f"{show(bundle, 120)} has no {MANIFEST}: not a dsadapt bundle",
                         hint="pass the folder (or .tar) `dsadapt bundle` wrote")
    data = read_json(path, show(path, 120), hint="the bundle is damaged; copy it again")
    if not isinstance(data, dict):
        raise UsageError(f"{show(path, 120)}: not a JSON object", hint="the bundle is damaged; copy it again")
    m = Manifest.from_json(data, str(path))
    for rel in m.files:
        safe_rel(rel, str(path))
    return m


def verify_bundle(bundle: Path, progress=None) -> Manifest:
    """The manifest, after checking that every file it names is there with its sha256 (exit 3 if not)."""
    m = read_manifest(bundle)
    if progress:
        progress(f"verifying {plural(len(m.files), 'file')} of the bundle (sha256)")
    for rel, want in sorted(m.files.items()):
        f = bundle / rel
        if not f.is_file():
            raise VerificationError(f"bundle {show(bundle, 80)}: {rel} is missing",
                                    hint="the bundle is incomplete; copy it again")
        got = sha256_file(f)
        if got != want:
            raise VerificationError(f"bundle {show(bundle, 80)}: {rel} has sha256 {got[:16]}…, the manifest says "
                                    f"{want[:16]}…", hint="the bundle was changed or damaged; copy it again")
    for part in m.parts.values():
        for rel in (part.lock, *part.wheels):
            if rel not in m.files:
                raise VerificationError(f"bundle {show(bundle, 80)}: {rel} is not in the manifest's files",
                                        hint="the bundle is not dsadapt's")
    return m


def unpack_tar(tar: Path, dest: Path) -> Path:
    """Extract a bundle tarball into `dest` (members checked: regular files and folders inside it)."""
    try:
        with tarfile.open(tar) as t:
            members = t.getmembers()
            for mem in members:
                safe_rel(mem.name, str(tar))
                if not (mem.isfile() or mem.isdir()):
                    raise UnsafeArtifact(f"{tar}: {show(mem.name, 80)} is not a regular file",
                                         hint="the tarball is not a dsadapt bundle")
            tops = {Path(mem.name).parts[0] for mem in members}
            dest.mkdir(parents=True, exist_ok=True)
            t.extractall(dest, filter="data")
    except tarfile.TarError as e:
        raise UsageError(f"{show(tar, 120)}: not a readable tar ({show(e, 80)})",
                         hint="pass the .tar `dsadapt bundle --tar` wrote") from None
    if len(tops) == 1 and (dest / next(iter(tops)) / MANIFEST).is_file():
        return dest / next(iter(tops))
    return dest


# ---------------------------------------------------------------- the record of an offline install


@dataclass
class OfflineRecord:
    """What `install --offline` installed for a pin: from which bundle, which builds, which lock."""

    pin: str
    variant: str
    bundle: str                     # absolute path of the bundle directory
    stack_hash: str
    builds: dict[str, dict]         # "patched"/"unpatched" -> {"wheel": abs path, "sha256", "version", "kind"}
    lock: str                       # absolute path of the engine part's hash lock
    wheels: str                     # absolute path of the bundle's wheels/ (pip --find-links)
    host_packages: bool
    host: dict[str, dict] = field(default_factory=dict)
    created: str = ""
    schema: str = RECORD_SCHEMA

    def to_json(self) -> dict:
        return asdict(self)


def records_dir(cfg: Config) -> Path:
    """Records live with the environments they describe (several work dirs may share one
    DSADAPT_VENVS: two `check` runs at once need two work dirs, each holding its own lock)."""
    return cfg.venvs_root / "offline-installs"


def record_path(cfg: Config, ref: PinRef, variant: str) -> Path:
    return records_dir(cfg) / f"{ref.engine}-{ref.tag}-{variant}.json"


def write_record(cfg: Config, rec: OfflineRecord) -> Path:
    path = record_path(cfg, parse_pinref(rec.pin), rec.variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(rec.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def find_record(cfg: Config, ref: PinRef, variant: str) -> OfflineRecord | None:
    """The offline install of `ref`'s `variant` for these environments, or None."""
    path = record_path(cfg, ref, variant)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != RECORD_SCHEMA:
            return None
        return OfflineRecord(**{k: v for k, v in data.items() if k in OfflineRecord.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise UsageError(f"{path}: damaged offline-install record ({show(e, 80)})",
                         hint=f"run `dsadapt install --offline BUNDLE` again (or delete {path})") from None


def offline_variants(cfg: Config, ref: PinRef) -> list[str]:
    """Variants of `ref` installed from a bundle (the default variant of check/install there)."""
    d = records_dir(cfg)
    out = []
    for p in sorted(d.glob(f"{ref.engine}-*.json")) if d.is_dir() else []:
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and data.get("pin") == str(ref) and isinstance(data.get("variant"), str):
            out.append(data["variant"])
    return out


def default_variant(cfg: Config, ref: PinRef, variant: str | None) -> str | None:
    """The variant asked for; else, where a bundle installed exactly one variant of the pin, that one
    (what `check` and `install` run without --variant)."""
    if variant is not None:
        return variant
    found = offline_variants(cfg, ref)
    return found[0] if len(found) == 1 else None

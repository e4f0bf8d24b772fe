"""Sources: how a pinned upstream tree gets into a checkout, verified against the lock.

Each source puts the pinned tree into the checkout repository as a commit and returns a
`SourceResult` saying what was verified. Sources are tried in the configured order; the
first that can produce a verified tree wins. A verification failure (moved tag, sha256 or
tree mismatch) is a hard error, never a reason to fall through to the next source.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.dotgit import BASE_REF
from patcher.base.errors import (
    DsadaptError,
    LockError,
    MachineError,
    SourceError,
    UnsafeArtifact,
    VerificationError,
    show,
)
from patcher.base.fsutil import sha256_file
from patcher.base.gitutil import ALLOWED_PROTOCOLS, Git, init_repo
from patcher.base.paths import tree_path_error
from patcher.formats.lock import Artifact, EngineDecl, LockEntry
from patcher.formats.sourcetree import TreeRules, is_tree_member

if TYPE_CHECKING:
    import zipfile

PYPI_SIMPLE = "https://pypi.org/simple"
#: A package index to ask instead of PyPI (a mirror such as devpi or Artifactory serving the JSON
#: simple API, PEP 691): release lists, artifact hashes, downloads and environment locks.
PYPI_INDEX_VAR = "DSADAPT_PYPI_INDEX"


def pypi_index() -> str:
    """The simple index dsadapt asks about releases: DSADAPT_PYPI_INDEX, else PyPI's."""
    return (os.environ.get(PYPI_INDEX_VAR, "").strip() or PYPI_SIMPLE).rstrip("/")


@dataclass(frozen=True)
class SourceResult:
    kind: str        # git | mirror | pypi
    origin: str      # URL, mirror path, or artifact file name
    commit: str      # the base commit in the checkout
    tree: str
    verified: str    # what was checked, in words
    snapshot: bool   # True when the base commit id is not upstream's (artifact or tree-only match)
    passed_over: tuple[str, ...] = ()  # earlier sources that could not be used, and why

    def to_json(self) -> dict:
        return asdict(self)


class Unreachable(SourceError):
    """This source cannot be used here (no network, no mirror, no artifact): try the next."""


# ---------------------------------------------------------------- git + mirror


def engine_cache(cfg: Config, engine: str) -> Git:
    path = cfg.cache / "git" / f"{engine}.git"
    if not (path / "HEAD").exists():
        return init_repo(path, bare=True)
    return Git(path)


def _fetch_ref(cache: Git, remote: str, entry: LockEntry, timeout: float, shallow: bool) -> str | None:
    """Fetch the pin's tag (or release branch, or the locked commit) into the cache.

    Returns the fetched commit id, or None if the remote has no such ref.
    """
    dest = f"refs/dsadapt/fetched/{entry.tag}"
    depth = ["--depth", "1"] if shallow else []
    for ref in (f"refs/tags/{entry.tag}", f"refs/heads/{entry.tag}"):
        r = cache.run("fetch", "-q", "--no-tags", *depth, remote, f"+{ref}:{dest}", check=False, timeout=timeout)
        if r.ok:
            return cache.rev(dest)
        err = r.err.lower()
        if any(s in err for s in ("could not resolve host", "unable to access", "could not read from remote",
                                  "connection refused", "timed out", "does not appear to be a git repository",
                                  "not a git repository", "no such file", "network is unreachable")):
            raise Unreachable(f"{remote}: unreachable ({r.err.strip().splitlines()[-1] if r.err.strip() else r.rc})")
    if entry.commit:
        r = cache.run("fetch", "-q", "--no-tags", *depth, remote, f"+{entry.commit}:{dest}", check=False,
                      timeout=timeout)
        if r.ok:
            return cache.rev(dest)
    return None


def _verify_commit(cache: Git, entry: LockEntry, commit: str, origin: str, allow_snapshot: bool) -> tuple[str, bool]:
    tree = cache.tree_of(commit)
    if entry.commit and commit == entry.commit:
        if entry.tree and tree != entry.tree:
            raise VerificationError(f"{entry}: {origin} commit {commit[:12]} has tree {tree[:12]}, lock says "
                                    f"{entry.tree[:12]}", hint="the lock is inconsistent; re-pin with `dsadapt pin`")
        return "commit id matches the lock", False
    if allow_snapshot and entry.tree and tree == entry.tree:
        return f"tree id {tree[:12]} matches the lock (snapshot commit {commit[:12]})", True
    if entry.commit or entry.tree:
        pinned = " ".join(x for x in (f"commit {entry.commit}" if entry.commit else "",
                                      f"tree {entry.tree}" if entry.tree else "") if x)
        raise VerificationError(
            f"{entry}: tag moved at {show(origin, 120)}: {entry.tag} is now commit {commit} tree {tree}; "
            f"the lock pins {pinned}",
            hint="investigate before trusting it (another mirror, a force-pushed tag?); if the move is legitimate, "
                 "re-pin with `dsadapt pin --update`")
    raise VerificationError(
        f"{entry}: the lock records no commit or tree id, so {origin} cannot be verified",
        hint=f"record them with `dsadapt pin {entry}` where the upstream is reachable")


def from_git(cfg: Config, decl: EngineDecl, entry: LockEntry, checkout: Git) -> SourceResult:
    if not entry.commit and not entry.tree:
        raise Unreachable(f"{entry}: no commit/tree id in the lock to verify a git fetch against")
    cache = engine_cache(cfg, decl.name)
    commit = _fetch_ref(cache, decl.git, entry, cfg.git_timeout, shallow=True)
    if commit is None:
        raise VerificationError(f"{decl.git} has no tag or branch {entry.tag} (the lock pins it)",
                                hint="check the tag name in upstream.lock; a deleted upstream tag needs investigating")
    verified, snapshot = _verify_commit(cache, entry, commit, decl.git, allow_snapshot=False)
    _import_commit(checkout, cache, commit, entry.tag)
    return SourceResult("git", decl.git, commit, checkout.tree_of(commit), verified, snapshot)


def from_mirror(cfg: Config, decl: EngineDecl, entry: LockEntry, checkout: Git) -> SourceResult:
    mirrors = cfg.mirrors.get(decl.name, ())
    if not mirrors:
        raise Unreachable(f"no mirror configured for {decl.name} (DSADAPT_MIRRORS or [mirrors] in dsadapt.toml)")
    cache = engine_cache(cfg, decl.name)
    tried = []
    for m in mirrors:
        if not m.exists():
            tried.append(f"{m} (missing)")
            continue
        try:
            commit = _fetch_ref(cache, str(m), entry, cfg.git_timeout, shallow=False)
        except Unreachable as e:
            tried.append(f"{m} ({e.message})")
            continue
        if commit is None:
            tried.append(f"{m} (no {entry.tag})")
            continue
        verified, snapshot = _verify_commit(cache, entry, commit, str(m), allow_snapshot=True)
        _import_commit(checkout, cache, commit, entry.tag)
        return SourceResult("mirror", str(m), commit, checkout.tree_of(commit), verified, snapshot)
    raise Unreachable(f"no mirror of {decl.name} has {entry.tag}: {'; '.join(tried)}")


def _import_commit(checkout: Git, cache: Git, commit: str, tag: str) -> None:
    """Bring the verified commit into the checkout as refs/dsadapt/base (and nothing else)."""
    # --update-shallow: the cache may be shallow (pin fetches --depth 1); without it the checkout
    # gets the commit but not the shallow marker, and every walk past it fails (log, range-diff).
    checkout.run("fetch", "-q", "--no-tags", "--update-shallow", str(cache.path),
                 f"+refs/dsadapt/fetched/{tag}:{BASE_REF}")
    if not checkout.rev(commit):
        raise MachineError(f"commit {commit[:12]} did not arrive in the checkout", hint="retry; the cache may be damaged")


# ---------------------------------------------------------------- pypi


def artifact_path(cfg: Config, art: Artifact) -> Path:
    return cfg.cache / "artifacts" / art.file


def find_local_artifact(cfg: Config, art: Artifact) -> Path | None:
    for d in (cfg.cache / "artifacts", *cfg.artifact_dirs):
        p = d / art.file
        if p.is_file():
            return p
    return None


def _pip_download(art: Artifact, version: str, dest: Path, progress=None) -> None:
    from packaging.utils import parse_wheel_filename

    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
            "-d", str(dest), *(["--index-url", pypi_index()] if os.environ.get(PYPI_INDEX_VAR, "").strip() else [])]
    if art.is_wheel:
        _, _, _, tags = parse_wheel_filename(art.file)
        tag = sorted(tags, key=str)[0]
        here = f"{sys.version_info.major}{sys.version_info.minor}"
        pyver = tag.interpreter[2:] if tag.interpreter.startswith("cp") else here
        if tag.abi == "abi3" or tag.interpreter.startswith("py"):
            pyver = max(pyver, here, key=lambda v: (int(v[0]), int(v[1:] or 0)))
        args += ["--only-binary=:all:", "--implementation", "cp", "--python-version", f"{pyver[0]}.{pyver[1:]}",
                 "--abi", tag.abi]
        for t in tags:
            args += ["--platform", t.platform]
    else:
        args += ["--no-binary=:all:", "--no-build-isolation"]
    args.append(f"{art.dist}=={version}")
    args = [a for a in args if a != "-q"] + ["--progress-bar", "off"]
    from patcher.base.procs import OutputTail, run_logged

    tail = OutputTail(progress, "pip: ", quiet=("WARNING: ",))
    with open(os.devnull, "w") as log:  # what the download is waiting on goes to the progress display only
        rc = run_logged(args, log, None, on_line=tail).returncode
    if rc != 0:
        raise Unreachable(f"pip download {art.dist}=={version} failed: {tail.last or rc}")


def fetch_artifact(cfg: Config, entry: LockEntry, art: Artifact, progress=None) -> Path:
    """The verified local path of a pinned artifact (cache, artifact dirs, then PyPI via pip)."""
    leftovers.clean_downloads(cfg.cache / "artifacts")  # what killed downloads left where this one works
    local = find_local_artifact(cfg, art)
    if local is None:
        listed = _listed_sha256(art)  # a wrong sha256 in the lock is said before the slow download
        if listed and listed != art.sha256:
            raise VerificationError(f"{entry}: PyPI lists {art.file} with sha256 {listed[:16]}…, the lock pins "
                                    f"{art.sha256[:16]}…",
                                    hint="the lock's sha256 is wrong, or PyPI serves other bytes than were pinned: "
                                         "find out which, then re-pin with `dsadapt pin`")
        need_space(_mkdir(cfg.cache / "artifacts"), (art.size or 0) * 2, f"downloading {art.file}")
        if progress:
            progress(f"downloading {art.file} from PyPI (pip download --no-deps)")
        # pid in the name: a partial download of a dead run is told apart from a live one (leftovers.py)
        import tempfile  # not at import: `list` asks this module only whether a source can run

        with tempfile.TemporaryDirectory(prefix=f".download-{os.getpid()}-", dir=_mkdir(cfg.cache / "artifacts")) as tmp:
            _pip_download(art, entry.version, Path(tmp), progress)
            got = Path(tmp) / art.file
            if not got.is_file():
                names = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
                raise VerificationError(f"pip fetched {names}, not {art.file}",
                                  hint="the lock's file name does not match what PyPI serves; re-pin")
            _check_sha(got, art, entry)
            final = artifact_path(cfg, art)
            got.replace(final)
            return final
    _check_sha(local, art, entry)
    return local


def _listed_sha256(art: Artifact) -> str | None:
    """The sha256 PyPI's index lists for the artifact's file (None: not listed, or no index here)."""
    try:
        files = pypi_files(art.dist, timeout=10)
    except Unreachable:
        return None
    for f in files:
        if f.get("filename") == art.file:
            return (f.get("hashes") or {}).get("sha256")
    return None


def need_space(where: Path, nbytes: int, what: str) -> None:
    """Refuse (exit 7, before any progress line) when the file system of `where` has less than
    `nbytes` (plus a small margin) free."""
    import shutil

    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    margin = 16 << 20
    if nbytes and free < nbytes + margin:
        raise MachineError(f"no space left on the device: {what} needs about {(nbytes + margin) / 1e6:.1f} MB, "
                           f"{free / 1e6:.1f} MB are free on the disk of {where}", hint="free some space (`dsadapt gc` removes leftovers of killed "
                                                        "runs), or point DSADAPT_WORKDIR / DSADAPT_CACHE elsewhere")


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _check_sha(path: Path, art: Artifact, entry: LockEntry) -> None:
    got = sha256_file(path)
    if got != art.sha256:
        raise VerificationError(
            f"{entry}: {art.file} has sha256 {got[:16]}…, lock pins {art.sha256[:16]}…",
            hint=f"delete {path} if it is corrupt; if PyPI really serves other bytes, stop and investigate")


def check_members(path: Path, infos: list[zipfile.ZipInfo]) -> None:
    """Refuse the whole artifact if any member would land outside the tree, inside `.git` (any
    case or spelling git would resolve there), or is a symbolic link or device: an artifact is data."""
    for info in infos:
        name = info.filename.rstrip("/") if info.filename.endswith("/") else info.filename
        why = tree_path_error(name)
        if why:
            raise UnsafeArtifact(f"{path.name}: member {show(info.filename, 80)!r} {why}",
                                 hint="the artifact is unsafe: nothing was unpacked; investigate where it came from")
        fmt = stat.S_IFMT(info.external_attr >> 16)  # 0: no type recorded (zip tools that write none)
        if fmt and fmt not in (stat.S_IFREG, stat.S_IFDIR):
            kind = "a symbolic link" if fmt == stat.S_IFLNK else "not a regular file"
            raise UnsafeArtifact(f"{path.name}: member {show(info.filename, 80)!r} is {kind}",
                                 hint="the artifact is unsafe: nothing was unpacked; investigate where it came from")


def check_wheel(path: Path) -> None:
    """Refuse an unsafe artifact (`check_members`) without unpacking anything."""
    import zipfile

    if not path.name.endswith(".whl"):
        raise LockError(f"{path.name}: only wheels can be unpacked as a source tree",
                        hint="pin a wheel artifact with source = true")
    try:
        with zipfile.ZipFile(path) as z:
            check_members(path, z.infolist())
    except zipfile.BadZipFile as e:
        raise UnsafeArtifact(f"{path.name}: not a valid wheel ({e})",
                             hint="the pinned artifact is damaged or is not a wheel: re-pin it, and investigate") from None


def unpack_artifact(path: Path, dest: Path, rules: TreeRules = TreeRules()) -> tuple[int, list[str]]:
    """Unpack a wheel's base-tree members (`sourcetree.is_tree_member`: the one rule for which
    members form the tree) into dest; returns (files written, skipped names).

    Every member, base-tree or not, is checked before anything is written (`check_members`)."""
    import zipfile

    skipped: list[str] = []
    n = 0
    if not path.name.endswith(".whl"):
        raise LockError(f"{path.name}: only wheels can be unpacked as a source tree",
                        hint="pin a wheel artifact with source = true")
    with zipfile.ZipFile(path) as z:
        infos = sorted(z.infolist(), key=lambda i: i.filename)
        check_members(path, infos)
        for info in infos:
            name = info.filename
            if name.endswith("/"):
                continue
            if not is_tree_member(name, rules):
                skipped.append(name)
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
            n += 1
    return n, skipped


def from_pypi(cfg: Config, decl: EngineDecl, entry: LockEntry, checkout: Git, progress=None) -> SourceResult:
    import zipfile

    art = entry.source_artifact()
    if art is None:
        raise Unreachable(f"{entry} has no release artifact in the lock")
    path = fetch_artifact(cfg, entry, art, progress)
    check_wheel(path)  # an unsafe artifact is refused before anything is said or written
    from patcher.engines.registry import engine

    rules = engine(decl.name).tree_rules
    with zipfile.ZipFile(path) as z:  # a full disk too is answered before the slow step: the files, their objects
        need_space(checkout.path, 2 * sum(i.file_size for i in z.infolist() if is_tree_member(i.filename, rules)),
                   f"unpacking {art.file}")
    if progress:
        progress(f"unpacking {art.file}")
    n, skipped = unpack_artifact(path, checkout.path, rules)
    checkout.run("add", "-A", "-f", ".")
    msg = (f"{decl.name} {entry.version}: upstream tree from {art.file}\n\n"
           f"Unpacked by dsadapt's pypi source; {n} files. Left out: {len(skipped)} "
           f"(dist-info, binaries).\n\nArtifact-Sha256: {art.sha256}\n")
    checkout.run("commit", "-q", "--allow-empty", "-m", msg, fixed_dates=True,
                 env={"GIT_AUTHOR_NAME": "dsadapt", "GIT_AUTHOR_EMAIL": "dsadapt@localhost"})
    commit = checkout.rev("HEAD")
    assert commit
    return SourceResult("pypi", art.file, commit, checkout.tree_of(commit),
                        f"sha256 {art.sha256[:12]}… matches the lock; patch pre-images are checked by blob id", True)


# ---------------------------------------------------------------- driver


def materialize(cfg: Config, decl: EngineDecl, entry: LockEntry, checkout: Git, progress=None) -> SourceResult:
    """Try the configured sources in order; return the first verified result."""
    reasons: list[str] = []
    for kind in cfg.sources:
        try:
            if kind == "git":
                res = from_git(cfg, decl, entry, checkout)
            elif kind == "mirror":
                res = from_mirror(cfg, decl, entry, checkout)
            else:
                res = from_pypi(cfg, decl, entry, checkout, progress)
            return replace(res, passed_over=tuple(reasons))
        except Unreachable as e:  # said in the result (passed_over) or in the error: no line now, so a
            reasons.append(f"{kind}: {e.message}")  # bad input found by the next source is still answered first
    raise SourceError(f"no source could provide {entry}: " + "; ".join(reasons),
                      hint="configure a mirror (DSADAPT_MIRRORS), allow PyPI, or check the network")


def source_blocker(cfg: Config, decl: EngineDecl, entry: LockEntry, probe_timeout: float = 5.0) -> str | None:
    """Why no configured source can provide the pin's tree here, or None (one can, as far as can
    be told without fetching: a checkout or a fetched copy exists, PyPI holds its release artifact,
    a mirror is configured, or its git remote answers `git ls-remote` within `probe_timeout`)."""
    if (cfg.checkout_dir(entry.engine, entry.tag) / ".git").exists():
        return None
    cache = cfg.cache / "git" / f"{decl.name}.git"
    if (cache / "refs" / "dsadapt" / "fetched" / entry.tag).is_file():
        return None
    reasons: dict[str, str] = {}
    # whether ANY source can provide the tree does not depend on the order they are tried in: the
    # local answers first, so a remote is probed only when nothing here can provide the tree
    for kind in sorted(cfg.sources, key=lambda k: k == "git"):
        if kind == "pypi":
            if entry.source_artifact() is not None:
                return None
            reasons[kind] = "pypi: no release artifact in the lock"
        elif kind == "mirror":
            if any(m.exists() for m in cfg.mirrors.get(decl.name, ())):
                return None
            reasons[kind] = "mirror: none configured"
        elif kind == "git" and decl.git:
            try:
                git_remote_tags(decl.git, probe_timeout)
                return None
            except (Unreachable, subprocess.TimeoutExpired, OSError, DsadaptError):
                reasons[kind] = f"git: {decl.git} unreachable"
    said = [reasons[k] for k in cfg.sources if k in reasons]  # in the order the sources are tried
    return "no source here for its tree (" + "; ".join(said) + ")" if said else "no source configured"


# ---------------------------------------------------------------- PyPI index (for pin and tags)


def _pypi_index(dist: str, timeout: float) -> dict:
    """PyPI's PEP 691 JSON simple-API page for a distribution."""
    import urllib.request  # (not at import: `dsadapt tags` against a git remote never needs HTTP)

    req = urllib.request.Request(f"{pypi_index()}/{dist}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except Exception as e:  # network errors of every kind
        raise Unreachable(f"PyPI index for {dist} unreachable ({e})") from None


def pypi_files(dist: str, timeout: float = 30) -> list[dict]:
    """Files PyPI lists for a distribution."""
    return _pypi_index(dist, timeout).get("files", [])


def pypi_versions(dist: str, timeout: float = 30) -> list[str]:
    """Versions PyPI lists for a distribution."""
    return list(_pypi_index(dist, timeout).get("versions", []))


def git_remote_tags(url: str, timeout: float) -> dict[str, str]:
    """tag -> commit from `git ls-remote --tags` (peeled where annotated)."""
    from patcher.base.gitutil import base_env

    if url.startswith("-"):
        raise LockError(f"git URL {show(url, 60)!r} starts with '-'", hint="fix the engine's git URL in upstream.lock")
    env = {**base_env(), "PATH": "/usr/bin:/bin:/usr/local/bin", "GIT_ALLOW_PROTOCOL": ALLOWED_PROTOCOLS}
    r = subprocess.run(["git", "ls-remote", "--tags", url], capture_output=True, text=True, timeout=timeout,
                       env=env)
    if r.returncode != 0:
        raise Unreachable(f"{url}: {(r.stderr.strip().splitlines() or ['unreachable'])[-1]}")
    tags: dict[str, str] = {}
    for line in r.stdout.splitlines():
        sha, ref = line.split("\t")
        name = ref.removeprefix("refs/tags/")
        if name.endswith("^{}"):
            tags[name[:-3]] = sha
        else:
            tags.setdefault(name, sha)
    return tags

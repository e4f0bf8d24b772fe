"""verify: lint a stack and prove it applies cleanly onto the pinned tree, in a place of its own.

The work happens in a scratch directory of the work dir (`tmp/verify-PID-…`): a temporary index
and a temporary object directory that borrows the checkout's objects as an alternate
(GIT_OBJECT_DIRECTORY, GIT_ALTERNATE_OBJECT_DIRECTORIES, GIT_INDEX_FILE), so `read-tree` of the
base, one `git apply --cached` of the whole stack and `write-tree` write nothing into the
checkout's `.git`, whatever the outcome. The patched `.py` files are compiled once per distinct
blob id: the ids that compiled are remembered in the work dir (`compiled/<python>.txt`), so a
verify of an unchanged or slightly changed stack compiles only what changed; a missing or
damaged file of ids only costs the compiles.

What `git apply` made of a stack is remembered too (`verified/<key>.json`): whether a stack
applies, and the blob ids and modes it leaves, is a function of the base commit, the text `git
apply` reads, and the git that applies it, so the key is a digest of exactly those (plus this
module's and the patch parser's source, `apply_key`). A verify of a stack whose patches changed
only in their messages (a reword) or not at all then runs no `git apply`; every problem is still
computed from what is here now (names, lint, pre-images). Only a clean apply of a stack that makes
no symbolic link is remembered, with a checksum; an entry that is missing, damaged, written by
another version or half-written (it is replaced atomically: a kill leaves the old one or none)
is a miss, and verify applies the stack as if it had never run -- never another verdict.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.errors import DsadaptError, SourceError
from patcher.base.gitutil import Git
from patcher.formats.lock import Lock
from patcher.formats.parsecache import ParseCache
from patcher.formats.patchfile import ZERO_ID
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import (
    SYMLINK_MODE,
    Stack,
    expected_preimages,
    lint_stack,
    load_stack,
    preimage_mismatches,
    symlink_problems,
    touches_links,
    tree_link_problems,
)
from patcher.stack.checkout import ensure_checkout, tree_links

CACHE_LIMIT = 200_000  # ids kept in a compile cache file; past that it starts again from the newest half
APPLIED_KEEP = 64      # remembered applies kept in the work dir (the newest)
APPLIED_FORMAT = "dsadapt.verified/1"


@dataclass
class VerifyResult:
    ref: str
    patches: int
    problems: list[str] = field(default_factory=list)
    applied: bool = False
    compiled: int = 0        # patched .py files that compile (fresh or remembered)
    compiled_now: int = 0    # of them, compiled in this run (the rest: by blob id, from an earlier run)
    compile_s: float = 0.0   # the time those compiles took
    source: str | None = None
    unverifiable: str | None = None  # no source could provide the pinned tree here
    apply_remembered: bool = False   # what `git apply` made of this exact diff text was known from an earlier run

    @property
    def ok(self) -> bool:
        return not self.problems and self.applied

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def verify_stack(cfg: Config, lock: Lock, ref: PinRef, progress=None, stack: Stack | None = None) -> VerifyResult:
    entry = lock.pin(ref)
    parsed = ParseCache.in_workdir(cfg.workdir)
    if stack is None:
        try:
            stack = load_stack(cfg.patches_root, ref, cache=parsed)
        except DsadaptError as broken:
            return VerifyResult(str(ref), 0, [broken.message])
    res = VerifyResult(str(ref), len(stack))
    res.problems += lint_stack(stack, parsed)
    decl = lock.engine(ref.engine)  # the engine's PyPI names as the project declares them (no adapter loaded)
    allowed = {decl.name, *decl.pypi}
    for e in stack.entries:
        for spec in e.patch.trailer_values("Drop-When"):
            name = spec.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip()
            if name and name not in allowed:
                res.problems.append(f"{stack.dir / e.name}: Drop-When names {name!r}, not one of {sorted(allowed)}")
    try:
        co, _ = ensure_checkout(cfg, lock, entry, progress)
    except SourceError as unreachable:  # lint results stand; applying needs the tree
        res.unverifiable = unreachable.message
        parsed.save()
        return res
    state = co.load()
    src = state.source or {}
    res.source = f"{src.get('kind')} {src.get('origin')}"
    base = co.base()
    expected, _post, chain = expected_preimages(stack.patches)
    res.problems += chain
    pypi = src.get("kind") == "pypi"
    key = apply_key(stack, base, pypi)
    known = recall_apply(cfg, key) if key else None
    compiled = _read_ids(compile_cache_path(cfg)) if known is not None else set()
    if known is not None and _compile(cfg, None, stack, _blob_ids(known["changed"]), res, compiled):
        res.applied, res.apply_remembered = True, True
        if pypi:
            res.problems += [f"pre-image: {m}" for m in preimage_mismatches(expected, known["base_blobs"], stack)]
        parsed.save()
        return res
    base_blobs = co.git.blobs_at(base, sorted(expected)) if pypi else {}
    if pypi:
        res.problems += [f"pre-image: {m}" for m in preimage_mismatches(expected, base_blobs, stack)]
    with scratch_git(cfg, co.git) as g:
        base_links = tree_links(g, base) if touches_links(stack.patches) else None
        if base_links is not None:  # links the stack makes, moves or retargets, after each patch
            res.problems += symlink_problems(stack.patches, base_links)
        res.applied, tree = _apply_in_temp_index(g, stack, base, res.problems)
        named = any("symbolic link" in p for p in res.problems)
        if res.applied and tree:
            changed = _changed(g, base, tree)  # one diff-tree: new blob ids and modes, as git made them
            links_made = any(SYMLINK_MODE in modes for modes, _oid in changed.values())
            if not named and links_made:
                res.problems += tree_link_problems(tree_links(g, base) if base_links is None else base_links,
                                                   tree_links(g, tree))
            _compile(cfg, g, stack, _blob_ids(changed), res)
            if key and not links_made:
                remember_apply(cfg, key, {"changed": changed, "base_blobs": base_blobs})
    parsed.save()  # (after the checkout is known good: a refused input writes nothing)
    return res


# ---------------------------------------------------------------- what `git apply` made, remembered


def _code_digest() -> bytes:
    """This module's and the patch parser's source: a change to how verify applies or reads a stack
    gives every remembered apply another key."""
    import hashlib

    from patcher.formats import patchfile, stackfiles

    h = hashlib.sha256()
    for mod in (sys.modules[__name__], patchfile, stackfiles):
        try:
            h.update(Path(mod.__file__ or "").read_bytes())
        except OSError:
            h.update(os.urandom(16))  # no source to hash: never matches
    return h.digest()


def _git_identity() -> str:
    """The git that applies (its path, size and mtime: another git may apply differently)."""
    exe = shutil.which("git") or "git"
    try:
        st = os.stat(exe)
        return f"{os.path.realpath(exe)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return exe


#: lines of a patch's message part that `git apply` could take for a diff header (it reads the
#: whole text it is given, message included)
_HEADERISH = ("diff ", "--- ", "+++ ", "@@ ", "Index: ", "*** ", "GIT binary patch", "Binary files ")


def applied_text(text: str) -> str:
    """Pure: the part of a patch file that decides what `git apply` does with it: everything from
    the first `diff --git` line, plus the message part whenever a line there looks like a diff
    header (then the whole file). A reword of a message leaves it unchanged."""
    at = 0 if text.startswith("diff --git ") else text.find("\ndiff --git ") + 1
    if at <= 0:
        return text
    head = text[:at]
    if any(line.startswith(_HEADERISH) for line in head.split("\n")):
        return text
    return text[at:]


def apply_key(stack: Stack, base: str, pypi: bool) -> str | None:
    """The digest naming what `git apply --cached` of the whole stack onto `base` gives (None: not
    remembered -- a stack that may touch symbolic links is always applied)."""
    import hashlib

    if not stack.entries or touches_links(stack.patches):
        return None
    h = hashlib.sha256(APPLIED_FORMAT.encode() + b"\0" + _code_digest())
    h.update(f"{_git_identity()}\0{base}\0{int(pypi)}\0".encode())
    for e in stack.entries:
        body = applied_text(e.text if e.text.endswith("\n") else e.text + "\n").encode("utf-8", "surrogateescape")
        h.update(len(body).to_bytes(8, "big") + body)
    return h.hexdigest()


def _applied_dir(cfg: Config) -> Path:
    return cfg.workdir / "verified"


def _entry_digest(value: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def recall_apply(cfg: Config, key: str) -> dict | None:
    """The remembered outcome of a clean apply ({"changed", "base_blobs"}), or None (unknown, or an
    entry that does not check out: never trusted)."""
    import json

    try:
        doc = json.loads((_applied_dir(cfg) / f"{key}.json").read_text(encoding="utf-8"))
        value = doc["value"]
        if doc.get("format") != APPLIED_FORMAT or doc.get("key") != key or doc.get("sha256") != _entry_digest(value):
            return None
        changed = {str(p): ((str(m[0][0]), str(m[0][1])), str(m[1])) for p, m in value["changed"].items()}
        blobs = {str(p): (None if o is None else str(o)) for p, o in value["base_blobs"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return {"changed": changed, "base_blobs": blobs}


def remember_apply(cfg: Config, key: str, value: dict) -> None:
    """Keep a clean apply's outcome (atomically: a kill leaves the old entry or none; concurrent
    writers of one key write the same thing). Only the newest `APPLIED_KEEP` entries stay."""
    import json

    d = _applied_dir(cfg)
    plain = json.loads(json.dumps(value))
    doc = {"format": APPLIED_FORMAT, "key": key, "value": plain, "sha256": _entry_digest(plain)}
    tmp = d / f".{key}.json.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, sort_keys=True), encoding="utf-8")
        os.replace(tmp, d / f"{key}.json")
        entries = sorted(d.glob("*.json"), key=lambda f: f.stat().st_mtime_ns)
        for old in entries[:-APPLIED_KEEP]:
            old.unlink(missing_ok=True)
    except OSError:  # a memory that cannot be written only costs the apply next time
        tmp.unlink(missing_ok=True)


def _blob_ids(changed: dict[str, tuple[tuple[str, str], str]]) -> dict[str, str]:
    """{path: new blob id} of the regular files the stack changed (deleted ones left out)."""
    return {p: oid for p, (modes, oid) in changed.items() if oid != ZERO_ID and modes[1] in ("100644", "100755")}


class scratch_git:
    """A Git of the checkout that writes nowhere in it: a private index and object directory in the
    work dir's tmp/ (the checkout's objects lent as an alternate), removed on the way out. Scratch
    dirs of dead runs are removed when the next one is made."""

    def __init__(self, cfg: Config, git: Git):
        self.root = cfg.workdir / "tmp"
        self.git = git
        self.dir: Path | None = None

    def __enter__(self) -> Git:
        self.root.mkdir(parents=True, exist_ok=True)
        leftovers.clean_scratch(self.root)
        self.dir = self.root / f"verify-{os.getpid()}-{time.monotonic_ns()}"
        (self.dir / "objects").mkdir(parents=True)
        objects = self.git.git_dir() / "objects"
        return self.git.with_env(GIT_OBJECT_DIRECTORY=str(self.dir / "objects"),
                                 GIT_ALTERNATE_OBJECT_DIRECTORIES=str(objects.resolve()),
                                 GIT_INDEX_FILE=str(self.dir / "index"))

    def __exit__(self, *exc) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _changed(g: Git, base: str, tree: str) -> dict[str, tuple[tuple[str, str], str]]:
    """{path: ((old mode, new mode), new blob id)} of every path that differs between two trees."""
    out = g.run_bytes("diff-tree", "-r", "--raw", "--no-renames", "-z", base, tree)[1].decode("utf-8", "surrogateescape")
    recs = out.split("\0")
    got: dict[str, tuple[tuple[str, str], str]] = {}
    for meta, path in zip(recs[0::2], recs[1::2]):
        if meta.startswith(":"):
            f = meta[1:].split(" ")
            got[path] = ((f[0], f[1]), f[3])
    return got


def _apply_in_temp_index(g: Git, stack: Stack, base: str, problems: list[str]) -> tuple[bool, str | None]:
    """Apply the whole stack onto the base in the scratch index (no work tree): one `git apply
    --cached` of all patches; on failure, one patch at a time to name the first that fails."""
    if not stack.entries:
        return True, g.tree_of(base)
    whole = "".join(e.text if e.text.endswith("\n") else e.text + "\n" for e in stack.entries)
    g.run("read-tree", base)
    if g.run("apply", "--cached", input=whole, check=False).ok:
        return True, g.out("write-tree")
    g.run("read-tree", base)
    for e in stack.entries:
        r = g.run("apply", "--cached", input=e.text, check=False)
        if not r.ok:
            msg = [l for l in (r.out + r.err).splitlines() if l.startswith(("error:", "Patch failed"))]
            problems.append(f"{e.name}: does not apply cleanly onto {base[:12]}" + (f" ({msg[0]})" if msg else ""))
            return False, None
    problems.append(f"the stack does not apply as a whole onto {base[:12]} (each patch does, in order)")
    return False, None


# ---------------------------------------------------------------- the syntax check, once per blob


def compile_cache_path(cfg: Config) -> Path:
    impl = sys.implementation.name
    return cfg.workdir / "compiled" / f"{impl}-{sys.version_info[0]}.{sys.version_info[1]}.txt"


def _read_ids(path: Path) -> set[str]:
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    return {l for l in text.split("\n") if len(l) == 40 and all(c in "0123456789abcdef" for c in l)}


def _remember(path: Path, known: set[str], new: list[str]) -> None:
    """Add ids that compiled (appended: a kill leaves at most a partial last line, which is ignored)."""
    if not new:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if len(known) + len(new) > CACHE_LIMIT:
            from patcher.base.fsutil import atomic_write_text

            keep = sorted(known)[-CACHE_LIMIT // 2:]
            atomic_write_text(path, "".join(i + "\n" for i in [*keep, *new]))
            return
        with open(path, "a", encoding="ascii") as f:
            f.write("".join(i + "\n" for i in new))
    except OSError:
        pass  # a cache that cannot be written only costs the compiles next time


def _compile(cfg: Config, g: Git | None, stack: Stack, blobs_of: dict[str, str], res: VerifyResult,
             known: set[str] | None = None) -> bool:
    """Compile every patched .py file of the result tree (`blobs_of`: path -> blob id of what the
    stack changed), skipping blob ids that compiled before (`known`: those ids, read from the work
    dir when not given). Without `g` (no tree to read blobs from) nothing is compiled: False, and
    `res` untouched, when some blob would need it."""
    owner = {f.new_path: e.name for e in stack.entries for f in e.patch.files if f.new_path}
    ids = {p: oid for p, oid in blobs_of.items() if p.endswith(".py") and p in owner}
    cache = compile_cache_path(cfg)
    known = _read_ids(cache) if known is None else known
    todo = sorted({oid for oid in ids.values() if oid not in known})
    if g is None and todo:
        return False
    t0 = time.perf_counter()
    blobs = g.cat_blobs(todo) if g is not None else {}
    good: set[str] = set()
    bad: dict[str, SyntaxError] = {}
    for oid in todo:
        src = blobs.get(oid)
        if src is None:
            continue
        try:
            compile(src, oid, "exec", dont_inherit=True)
            good.add(oid)
        except (SyntaxError, ValueError) as err:
            bad[oid] = err if isinstance(err, SyntaxError) else SyntaxError(str(err))
    for p, oid in sorted(ids.items()):
        if oid in known or oid in good:
            res.compiled += 1
        elif oid in bad:
            why = bad[oid]
            res.problems.append(f"{owner.get(p, '?')}: {p}:{why.lineno}: does not compile: {why.msg}")
    res.compiled_now = len(good) + len(bad)
    res.compile_s = round(time.perf_counter() - t0, 3)
    _remember(cache, known, sorted(good))
    return True


def verify_pins(cfg: Config, lock: Lock, refs: list[PinRef], *, fetch: bool = False,
                progress=None) -> list[VerifyResult]:
    """Each pin's stack verified (`verify_stack`) where its pinned tree is here (a checkout exists)
    or may be fetched (`fetch`); the others linted only and marked `unverifiable` (never ok). A
    stack that does not even parse is its own result (the error as its problem)."""
    from patcher.formats.stackfiles import lint_stack, load_stack

    results = []
    for ref in refs:
        if fetch or (cfg.checkout_dir(ref.engine, ref.tag) / ".git").exists():
            results.append(verify_stack(cfg, lock, ref, progress))
            continue
        try:  # lint only: the pinned tree is not here, and fetching it is what --fetch is for
            parsed = ParseCache.in_workdir(cfg.workdir)
            stack = load_stack(cfg.patches_root, ref, cache=parsed)
            res = VerifyResult(str(ref), len(stack), lint_stack(stack, parsed))
            parsed.save()
        except Exception as broken:  # noqa: BLE001 - a broken stack is its result
            res = VerifyResult(str(ref), 0, [getattr(broken, "message", str(broken))])
        res.unverifiable = (f"no checkout of its pinned tree here (`dsadapt verify {ref}` or `dsadapt verify "
                            "--fetch` fetches it)")
        results.append(res)
    return results

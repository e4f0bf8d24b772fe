"""The checkout's state record on disk: read, written durably with a copy in git, and rebuilt from
git when it is damaged or missing.

`.git/dsadapt/state.json` (base.dotgit) is the record. Every write first puts the same
bytes, with the files of the op in progress (`.git/dsadapt/op/`), into a commit under
`refs/dsadapt/state` (loose objects and a loose ref, written without starting git), then writes
the record itself (temporary file, fsync, rename). A record deleted, truncated, half written or
overwritten by hand is therefore taken back from git exactly, op and all.

Without that copy (a checkout made by an older dsadapt, or the ref deleted too) the record is
derived from git itself: the base is `refs/dsadapt/base`, or else the commit of the branch that
the lock pins (its commit id, its tree id, or the `Artifact-Sha256` trailer of an unpacked
release); what is applied is the longest run of the branch's first commits whose patch-ids are,
in order, those of the stack files `refs/dsadapt/stack` holds, or else of patches/. An op in
progress cannot be derived: the record comes back without one and the commands refuse a `git am`
they have no record of, naming `dsadapt apply --force` (which keeps everything in backup refs).

Everything here is pure or reads git; nothing writes except `write_record` and `put_ref`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base.dotgit import BASE_REF, REFS, STACK_REF, STATE_REF, CheckoutLayout
from patcher.base.errors import DsadaptError, WorkspaceError
from patcher.base.fsutil import atomic_write_text, file_identity, git_blob_id
from patcher.base.gitutil import FIXED_DATE, Git
from patcher.formats.lock import LockEntry
from patcher.formats.stackfiles import parse_series, stack_hash
from patcher.stack.state import Applied, NewerState, State

SNAPSHOT_IDENT = f"dsadapt <dsadapt@localhost> {FIXED_DATE}"
ARTIFACT_TRAILER = "Artifact-Sha256"   # the pypi source's base commit names the wheel it unpacked
BASE_SEARCH = 5000                     # commits of the branch searched for the pinned base
REFLOG_SEARCH = 20                     # and the latest values of the branch's and HEAD's reflogs, each once


# ---------------------------------------------------------------- the stack files as data (pure)


@dataclass(frozen=True)
class NamedText:
    """A stack file as `stack_hash` reads it."""

    name: str
    text: str


def files_hash(files: dict[str, bytes], names: list[str]) -> str:
    """The stack hash of the patch files `names` among `files`."""
    return stack_hash([NamedText(n, files.get(n, b"").decode("utf-8", "replace")) for n in names])


def series_names(data: bytes | None) -> list[str]:
    """The patch names of a series file's bytes ([] for none, or for one that does not parse)."""
    if not data:
        return []
    try:
        return parse_series(data.decode("utf-8"))
    except (DsadaptError, UnicodeDecodeError):
        return []


def tree_entries(g: Git, entries: list[tuple[str, str, str]]) -> str:
    """A tree object of (mode, name, id) entries, written without starting git."""
    def key(e: tuple[str, str, str]) -> bytes:
        return e[1].encode("utf-8") + (b"/" if e[0] == "40000" else b"")

    body = b"".join(m.encode() + b" " + n.encode("utf-8") + b"\0" + bytes.fromhex(oid)
                    for m, n, oid in sorted(entries, key=key))
    return g.write_object("tree", body)


def files_commit(g: Git, files: dict[str, bytes], message: str = "dsadapt: stack files") -> str:
    """A parentless commit whose flat tree holds `files`, written as loose objects without starting
    git; fixed identity, date and message, so the same files give the same commit."""
    tree = tree_entries(g, [("100644", n, g.write_object("blob", data)) for n, data in files.items()])
    msg = f"tree {tree}\nauthor {SNAPSHOT_IDENT}\ncommitter {SNAPSHOT_IDENT}\n\n{message}\n"
    return g.write_object("commit", msg.encode("utf-8"))


# ---------------------------------------------------------------- the pin the checkout was verified against


def lock_identity(entry: LockEntry) -> dict:
    """What of a pin says which tree it is: its commit and tree ids and its source artifact."""
    art = entry.source_artifact()
    return {"commit": entry.commit, "tree": entry.tree,
            "artifact": {"file": art.file, "sha256": art.sha256} if art else None}


def lock_record(entry: LockEntry) -> dict:
    """The record of a pin kept in the checkout's state: its identity and that identity's digest."""
    ident = lock_identity(entry)
    return {"digest": hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest(), "pin": ident}


def base_trailer(g: Git, commit: str) -> str | None:
    """The Artifact-Sha256 trailer of a base commit (the pypi source writes it), or None."""
    out = g.run("log", "-1", f"--format=%(trailers:key={ARTIFACT_TRAILER},valueonly)", commit, check=False).out
    return out.strip().splitlines()[0].strip() if out.strip() else None


def lock_mismatch(g: Git, state: State, entry: LockEntry) -> str | None:
    """Why the checkout's base is not the tree `entry` pins (None: it is), in words: what the lock
    says next to what the checkout holds, for every id the base can be checked against."""
    base = state.base
    if not base or not g.rev(base):
        return "its base commit is missing"
    src = state.source or {}
    art = entry.source_artifact()
    if src.get("kind") == "pypi":
        got = base_trailer(g, base)
        if art is None:
            return f"the lock no longer has a release artifact; the checkout was unpacked from one ({src.get('origin')})"
        if got != art.sha256:
            return (f"the lock's artifact sha256 is {art.sha256[:16]}…; the checkout was unpacked from "
                    f"{(got or 'an unrecorded artifact')[:16]}…")
        return None
    if not entry.commit and not entry.tree:
        return "the lock records no commit or tree id to check the checkout's base against"
    if entry.commit and not src.get("snapshot") and base != entry.commit:
        return f"the lock pins commit {entry.commit[:12]}; the checkout's base is {base[:12]}"
    if entry.tree:
        tree = g.tree_of(base)
        if tree != entry.tree:
            return f"the lock pins tree {entry.tree[:12]}; the checkout's base has tree {tree[:12]}"
    return None


# ---------------------------------------------------------------- writing the record and its copy


@dataclass
class Written:
    """Blob ids of the op's files already written into the copy (so a big mbox is hashed once)."""

    ids: dict[str, tuple[tuple, str]] = field(default_factory=dict)

    def blob(self, g: Git, path: Path) -> str | None:
        try:
            st = path.stat()
        except OSError:
            return None
        ident = file_identity(st)
        got = self.ids.get(path.name)
        if got and got[0] == ident:
            return got[1]
        try:
            oid = g.write_object("blob", path.read_bytes())
        except OSError:
            return None
        self.ids[path.name] = (ident, oid)
        return oid


def put_ref(layout: CheckoutLayout, ref: str, commit: str) -> None:
    """Write a loose ref the way git does (temporary file, rename); no process is started. A value
    of the same ref in packed-refs is shadowed by it, as git reads refs."""
    target = layout.git_dir / ref
    target.parent.mkdir(parents=True, exist_ok=True)
    layout.scratch.mkdir(parents=True, exist_ok=True)
    tmp = layout.scratch / f"ref-{os.getpid()}-{time.monotonic_ns()}"
    tmp.write_text(commit + "\n")
    os.replace(tmp, target)


def write_record(g: Git, layout: CheckoutLayout, state: State, written: Written) -> None:
    """The copy in git first, then the record: a kill in between leaves the copy at most one write
    ahead, which the record being read first makes harmless."""
    text = json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n"
    entries = [("100644", "state.json", g.write_object("blob", text.encode("utf-8")))]
    if state.op is not None and layout.op_dir.is_dir():
        ops = []
        for f in sorted(layout.op_dir.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                oid = written.blob(g, f)
                if oid:
                    ops.append(("100644", f.name, oid))
        if ops:
            entries.append(("40000", "op", tree_entries(g, ops)))
    tree = tree_entries(g, entries)
    msg = f"tree {tree}\nauthor {SNAPSHOT_IDENT}\ncommitter {SNAPSHOT_IDENT}\n\ndsadapt: state record\n"
    put_ref(layout, STATE_REF, g.write_object("commit", msg.encode("utf-8")))
    atomic_write_text(layout.state, text)


# ---------------------------------------------------------------- reading


class Unreadable(Exception):
    """The record exists but is not a state (its words say why)."""


def parse_record(raw: bytes) -> State:
    """The state in a record's bytes; Unreadable when they are not one, NewerState when a newer
    dsadapt wrote them."""
    try:
        d = json.loads(raw.decode("utf-8"))
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return State.from_json(d)
    except NewerState:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise Unreadable(f"{e.__class__.__name__}: {e}" if str(e) else e.__class__.__name__) from None


def read_copy(g: Git, ref: str) -> tuple[State, dict[str, bytes]] | None:
    """The state and op files of the copy under refs/dsadapt/state, or None (absent, unreadable, or
    the record of another pin)."""
    commit = g.rev(STATE_REF)
    if not commit:
        return None
    names = [l.split("\t", 1)[1] for l in g.run("ls-tree", "-r", "--full-tree", commit, check=False).out.splitlines()
             if "\t" in l]
    blobs = g.cat_blobs([f"{commit}:{n}" for n in names])
    raw = blobs.get(f"{commit}:state.json")
    if raw is None:
        return None
    try:
        st = parse_record(raw)
    except (Unreadable, NewerState):
        return None
    if st.ref != ref:
        return None
    ops = {n.removeprefix("op/"): blobs[f"{commit}:{n}"] or b"" for n in names if n.startswith("op/")}
    return st, ops


# ---------------------------------------------------------------- deriving it from git


@dataclass
class Derived:
    state: State
    how: list[str]            # what it was derived from, in words


def reflog_values(layout: CheckoutLayout, ref: str) -> list[str]:
    """The commits a ref's reflog recorded it at, newest first, read from its file (git refuses to
    read the reflog of a ref whose own file is damaged)."""
    try:
        lines = (layout.git_dir / "logs" / ref).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    parts = (l.split(maxsplit=2) for l in reversed(lines))
    return [p[1] for p in parts if len(p) > 1 and len(p[1]) == 40 and p[1] != "0" * 40]


def _tips(layout: CheckoutLayout, tip: str | None, branch_ref: str) -> list[str]:
    """Where the pinned base is looked for: the branch (or HEAD), then what the branch's and HEAD's
    reflogs held last (a branch recommitted from scratch, a HEAD moved away)."""
    out = [tip] if tip else []
    for ref in (branch_ref, "HEAD"):
        for c in reflog_values(layout, ref):
            if c not in out and len(out) <= REFLOG_SEARCH:
                out.append(c)
    return out


def _base_from_lock(g: Git, tip: str, entry: LockEntry) -> tuple[str, dict] | None:
    """The commit of `tip`'s first-parent history that `entry` pins, and the source it came from."""
    if entry.commit and g.run("merge-base", "--is-ancestor", entry.commit, tip, check=False).ok:
        return entry.commit, {"kind": "git", "snapshot": False,
                              "verified": "re-derived from git: commit id matches the lock"}
    art = entry.source_artifact()
    out = g.run("log", "--first-parent", f"-n{BASE_SEARCH}",
                f"--format=%H %T %(trailers:key={ARTIFACT_TRAILER},valueonly,separator=%x2C)", tip, check=False).out
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 2:
            continue
        commit, tree, trailer = parts[0], parts[1], (parts[2].strip() if len(parts) > 2 else "")
        if art is not None and trailer and trailer == art.sha256:
            return commit, {"kind": "pypi", "origin": art.file, "snapshot": True,
                            "verified": f"re-derived from git: the {ARTIFACT_TRAILER} trailer matches the lock"}
        if entry.tree and tree == entry.tree:
            return commit, {"kind": "mirror", "snapshot": commit != entry.commit,
                            "verified": "re-derived from git: tree id matches the lock"}
    return None


def _patch_ids(g: Git, text: str) -> list[str]:
    out = g.run("patch-id", "--stable", input=text, check=False).out
    return [l.split()[0] for l in out.splitlines() if l.split()]


def _applied_head(g: Git, base: str, tip: str, texts: list[str]) -> str | None:
    """The branch commit after which the branch holds exactly `texts` (by patch-id, in order), or
    None when its first commits are not those patches."""
    commits = g.out("rev-list", "--reverse", "--first-parent", f"{base}..{tip}").split()
    if not texts:
        return base
    if len(commits) < len(texts):
        return None
    want = [_patch_ids(g, t) for t in texts]
    if any(len(w) != 1 for w in want):
        return None
    log = g.run("log", "-p", "--reverse", "--first-parent", "--no-color", "--full-index", "--format=commit %H",
                f"{base}..{commits[len(texts) - 1]}", check=False).out
    got = {}
    for line in g.run("patch-id", "--stable", input=log, check=False).out.splitlines():
        pid, _, commit = line.partition(" ")
        got[commit] = pid
    if all(got.get(commits[i]) == want[i][0] for i in range(len(texts))):
        return commits[len(texts) - 1]
    return None


def derive(g: Git, layout: CheckoutLayout, ref: str, branch_ref: str, entry: LockEntry | None,
           stack_texts: tuple[list[str], str] | None) -> Derived:
    """A state record derived from git alone (no op). `stack_texts`: patches/ as (patch texts in
    series order, stack hash), or None where it cannot be read. WorkspaceError when the base
    cannot be told."""
    how: list[str] = []
    refs = dict(g.refs("refs/heads/", REFS))
    # (a branch whose ref file git cannot read is made again from its reflog's last value: that is its tip)
    tip = refs.get(branch_ref) or g.rev("HEAD") or next(iter(reflog_values(layout, branch_ref)), None)
    base = refs.get(BASE_REF)
    source: dict = {}
    if base:
        how.append(f"the base from {BASE_REF}")
    elif entry is not None:
        for at in _tips(layout, tip, branch_ref):
            found = _base_from_lock(g, at, entry)
            if found:
                base, source = found
                seen = "the branch's commit" if at == tip else f"the commit (of {at[:12]}, in the reflog)"
                how.append(f"the base from {seen} the lock pins ({source['verified'].split(': ', 1)[1]})")
                break
    if not base:
        raise WorkspaceError(f"{ref}: the checkout's state record is lost and its base cannot be told from git "
                             f"({BASE_REF} is missing and no commit of the branch is the one upstream.lock pins)",
                             hint=f"move {layout.root} away (your commits stay in it) and run `dsadapt apply {ref}` "
                                  "to make the checkout again")
    if not source:
        source = {"kind": "git", "snapshot": False, "verified": "re-derived from git: refs/dsadapt/base"}
        if entry is not None:
            art = entry.source_artifact()
            if art is not None and base_trailer(g, base) == art.sha256:
                source = {"kind": "pypi", "origin": art.file, "snapshot": True,
                          "verified": f"re-derived from git: the {ARTIFACT_TRAILER} trailer matches the lock"}
            elif entry.commit and base != entry.commit:
                source["snapshot"] = True
    source = {"kind": source["kind"], "origin": source.get("origin", "(re-derived)"), "commit": base,
              "tree": g.tree_of(base), "verified": source["verified"], "snapshot": source["snapshot"],
              "passed_over": []}
    applied = None
    if tip:
        snap = refs.get(STACK_REF)
        if snap:
            files = _flat_files(g, snap)
            names = series_names(files.get("series"))
            texts = [files.get(n, b"").decode("utf-8", "replace") for n in names]
            head = _applied_head(g, base, tip, texts) if all(n in files for n in names) else None
            if head:
                applied = Applied(files_hash(files, names), head, [], snap, flat_tree_id(files))
                how.append(f"what is applied from {STACK_REF} (the stack files last applied or exported)")
        if applied is None and stack_texts is not None:
            texts, hash_ = stack_texts
            head = _applied_head(g, base, tip, texts)
            if head:
                applied = Applied(hash_, head, [])
                how.append("what is applied from patches/ (the branch's first commits are its patches)")
        if applied is None and tip != base:
            how.append("nothing recorded as applied (the branch's commits are not the stack's)")
    return Derived(State(ref, source, base, applied, None), how)


def _flat_files(g: Git, commit: str) -> dict[str, bytes]:
    names = [l.split("\t", 1)[1] for l in g.run("ls-tree", commit, check=False).out.splitlines() if "\t" in l]
    got = g.cat_blobs([f"{commit}:{n}" for n in names])
    return {n: got[f"{commit}:{n}"] or b"" for n in names}


def flat_tree_id(files: dict[str, bytes]) -> str:
    """The id git gives a tree of plain files (mode 100644) with these names and bytes."""
    body = b"".join(b"100644 " + n.encode("utf-8") + b"\0" + bytes.fromhex(git_blob_id(files[n]))
                    for n in sorted(files, key=lambda x: x.encode("utf-8")))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


__all__ = ["Derived", "NamedText", "Unreadable", "Written", "derive", "files_commit", "files_hash", "flat_tree_id",
           "lock_identity", "lock_mismatch", "lock_record", "parse_record", "put_ref", "read_copy", "series_names",
           "write_record"]

"""The checkout: materialize it, apply a stack as commits, stop/continue/skip/abort, refresh, status.

Every change to a stack's checkout or to its patches/ files goes through a `Transaction`
(transaction.py): apply and refresh are op kinds registered here, rebase registers its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.errors import DsadaptError, RefusedToClobber, StackError, VerificationError, WorkspaceError, plural
from patcher.base.fsutil import atomic_write_bytes, remove_file
from patcher.base.gitutil import Git, GitError, clear_stale_locks, init_repo, work_fingerprint
from patcher.base.workdir import lock_holder, workdir_lock
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.patchfile import Patch, parse_patch
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import (
    Stack,
    expected_preimages,
    format_series,
    load_stack,
    parse_series,
    preimage_mismatches,
    stack_dir,
    stack_hash,
)
from patcher.stack.transaction import (
    BACKUP_PREFIX,
    BASE_REF,
    MBOX_FROM,
    STACK_REF,
    Applied,
    Checkout,
    Op,
    Orig,
    PatchMeta,
    PatchOutcome,
    StackResult,
    State,
    Transaction,
    branch_name,
    describe_op,
    flat_tree_id,
    register,
)

__all__ = ["BACKUP_PREFIX", "BASE_REF", "Checkout", "CheckoutStatus", "PatchOutcome", "StackResult", "abort_apply",
           "apply_stack", "branch_name", "checkout_status", "continue_apply", "ensure_checkout", "export_commits",
           "refresh_stack", "skip_patch", "workdir_lock"]

Progress = Callable[[str], None]


@dataclass
class CheckoutStatus:
    ref: str
    path: str
    state: str  # not fetched | clean base | stack applied | stack outdated | stopped | interrupted | running
    #             | dirty | diverged | broken
    detail: str
    source: dict | None = None
    base: str | None = None
    head: str | None = None
    stack_hash: str | None = None
    applied_hash: str | None = None
    backups: list[str] = field(default_factory=list)
    next: str | None = None          # the command that moves it on, when one does
    op: dict | None = None           # kind, phase, done, total of an op in progress
    locks: list[str] = field(default_factory=list)   # git lock files in the checkout (stale ones are removed by the next command)
    pinned: bool = True

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- the checkout


def ensure_checkout(cfg: Config, lock: Lock, entry: LockEntry, progress: Progress | None = None) -> tuple[Checkout, bool]:
    """The pin's checkout, materialized from a verified source if it does not exist yet.

    It is built under `.TAG.tmp-PID` and renamed into place when complete, so a kill leaves
    either no checkout or a whole one; leftovers of dead runs are removed first."""
    from patcher.upstream.sources import materialize

    co = Checkout(cfg, entry.ref)
    if co.exists:
        return co, False
    if co.path.exists() and any(co.path.iterdir()):
        raise WorkspaceError(f"{co.path} exists but is not a dsadapt checkout",
                             hint="move it away; dsadapt will not overwrite it")
    import shutil

    leftovers.clean_checkout_tmps(co.path.parent)
    cache = cfg.cache / "git" / f"{entry.engine}.git"
    if cache.is_dir():  # a fetch killed there leaves shallow.lock / refs locks behind
        clear_stale_locks(cache, cache)
    tmp = co.path.with_name(f".{co.path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        g = init_repo(tmp, identity=False)
        src = materialize(cfg, lock.engine(entry.engine), entry, g, progress)
        g.run("update-ref", BASE_REF, src.commit)
        g.run("checkout", "-q", "-B", branch_name(entry.tag), src.commit)
        state = State(str(entry.ref), src.to_json(), src.commit)
        (tmp / ".git" / "dsadapt").mkdir(parents=True, exist_ok=True)
        _AtPath(cfg, entry.ref, tmp).save(state)
        co.path.parent.mkdir(parents=True, exist_ok=True)
        if co.path.exists():
            co.path.rmdir()
        os.replace(tmp, co.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Checkout(cfg, entry.ref), True


class _AtPath(Checkout):
    def __init__(self, cfg, ref, path: Path):
        super().__init__(cfg, ref)
        self.path = path
        self.git = Git(path)


def check_preimages(co: Checkout, stack: Stack, base: str) -> None:
    """For artifact-based trees: every touched file must be byte-identical to the patch's pre-image."""
    expected, problems = expected_preimages(stack.patches)
    if problems:
        raise VerificationError(f"{stack.ref}: the stack is inconsistent: {problems[0]}",
                                hint="refresh the stack from a checkout where it applies")
    actual = co.git.blobs_at(base, sorted(expected))
    bad = preimage_mismatches(expected, actual, stack)
    if bad:
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        raise VerificationError(
            f"{stack.ref}: pre-image differs from the patch: {bad[0]}{more}",
            hint="the release artifact is not byte-identical to the upstream tree the patch was made on; "
                 "use the git or mirror source, or rebase the stack")


def stack_files(stack: Stack) -> dict[str, bytes]:
    """The stack's files as bytes: series and every patch it lists."""
    files: dict[str, bytes] = {}
    if (stack.dir / "series").is_file():
        files["series"] = (stack.dir / "series").read_bytes()
    for e in stack.entries:
        files[e.name] = (stack.dir / e.name).read_bytes()
    return files


def _refuse_op(tx: Transaction) -> None:
    co = tx.co
    if tx.state.legacy_op:
        raise WorkspaceError(f"{co.ref}: an apply recorded by an older dsadapt is in progress in {co.path}",
                             hint=f"run `dsadapt abort {co.ref}`, then apply again")
    state, detail, _nxt = describe_op(co, tx.op)
    what = "stopped on a conflict" if state == "stopped" else state
    raise WorkspaceError(f"{co.ref}: an {tx.op.kind} is in progress in {co.path} ({what})", hint=detail)


def _finish_interrupted(tx: Transaction, kinds: tuple[str, ...]) -> Transaction:
    """Roll an interrupted op of one of `kinds` forward (a rerun of the command that died);
    refuse anything else that is in progress."""
    if tx.state.legacy_op:
        _refuse_op(tx)
    if tx.state.op is None:
        return tx
    op = tx.op
    if op.kind in kinds and op.phase not in ("stopped", "abort"):
        if tx.progress:
            tx.progress(f"finishing the interrupted {op.kind} first")
        tx.run()
        notes = tx.notes
        tx = Transaction.open(tx.co, tx.on_patch, tx.progress)
        tx.notes = notes
        return tx
    _refuse_op(tx)
    return tx  # pragma: no cover


# ---------------------------------------------------------------- apply


class ApplyKind:
    name = "apply"
    verb = "apply"
    touches_checkout = True

    def prepare(self, tx: Transaction) -> None:
        return None

    def pre_outcomes(self, tx: Transaction) -> dict[int, tuple[str, str]]:
        return {}

    def on_stop(self, tx: Transaction, index: int) -> str | None:
        return None

    def label(self, tx: Transaction, index: int, commit: str | None, merged: bool | None) -> tuple[str, str | None]:
        if commit is None:
            return "skipped", "no changes: the tree already has them"
        return ("merged" if merged else "clean"), None

    def finish(self, tx: Transaction) -> StackResult:
        op, g = tx.op, tx.git
        head = g.head_commit()
        edited = [op.outcomes[i].name for i in sorted(op.outcomes) if op.outcomes[i].outcome in ("changed", "skipped")]
        if op.snapshot:
            g.update_ref(STACK_REF, op.snapshot)
        res = tx.result(head, op.stack_hash)
        tx.close(Applied(op.stack_hash, head, edited, op.snapshot, op.extra.get("snapshot_tree")))
        return res

    def undo(self, tx: Transaction) -> None:
        return None


register(ApplyKind())


def apply_stack(cfg: Config, lock: Lock, ref: PinRef, *, force: bool = False, progress: Progress | None = None,
                on_patch: Callable[[PatchOutcome], None] | None = None) -> StackResult:
    entry = lock.pin(ref)
    stack = load_stack(cfg.patches_root, ref)  # parse everything before touching anything
    co, _created = ensure_checkout(cfg, lock, entry, progress)
    tx = _finish_interrupted(Transaction.open(co, on_patch, progress), ("apply", "refresh"))
    state, g = tx.state, co.git
    cur_branch, head, refs = g.head()
    base = refs.get(BASE_REF) or co.base()
    co._base = base
    head_branch = refs.get(co.branch_ref)
    applied = state.applied
    dirty = g.dirty_files()
    if (not dirty and applied and not applied.needs_refresh and applied.stack_hash == stack.hash
            and head_branch == applied.head and cur_branch == co.branch):
        return StackResult(str(ref), str(co.path), state.source, base, head_branch, stack.hash, noop=True,
                           notes=tx.notes)
    if dirty and not force:
        raise WorkspaceError(f"{ref}: {co.path} has uncommitted changes ({', '.join(dirty[:3])}"
                             f"{'…' if len(dirty) > 3 else ''})",
                             hint="commit them and run `dsadapt refresh`, or pass --force (they are kept in a backup ref)")
    expected_head = applied.head if applied else base
    if applied and applied.needs_refresh and head_branch == applied.head and not force:
        raise WorkspaceError(f"{ref}: {co.branch} holds conflict resolutions or skips not exported to the stack "
                             f"({', '.join(applied.needs_refresh)})",
                             hint=f"run `dsadapt refresh {ref}` to keep them, or pass --force (the branch is kept in a backup ref)")
    if head_branch and head_branch != expected_head and not force:
        n = g.out("rev-list", "--count", f"{expected_head}..{head_branch}") if expected_head and g.rev(expected_head) else "?"
        raise WorkspaceError(f"{ref}: branch {co.branch} has {n} commit(s) not exported to the stack",
                             hint=f"run `dsadapt refresh {ref}` to keep them, or pass --force (the branch is kept in a backup ref)")
    if (state.source or {}).get("kind") == "pypi":
        check_preimages(co, stack, base)
    want = [k for k, cond in (("work", bool(dirty)), ("branch", bool(head_branch and head_branch != base))) if cond]
    taken = {r.removeprefix(BACKUP_PREFIX) for r in refs if r.startswith(BACKUP_PREFIX)}
    names = [f"{BACKUP_PREFIX}{i}" for i in range(1, len(taken) + len(want) + 2) if str(i) not in taken]
    saves = dict(zip(want, names))
    op = Op(kind="apply", ref=str(ref), stack_hash=stack.hash,
            patches=[PatchMeta(e.name, e.patch.subject) for e in stack.entries],
            orig=Orig(cur_branch, head, head_branch, refs.get(STACK_REF), bool(dirty),
                      work_fingerprint(g) if dirty else None), saves=saves)
    tx.begin(op, [e.text for e in stack.entries], stack_files(stack))
    return tx.run()


def _op_kind(co: Checkout) -> str:
    try:
        st = co.load()
    except DsadaptError:
        return "operation"
    return st.op.kind if st.op else "apply"


def _in_progress(cfg: Config, ref: PinRef | None) -> Checkout:
    found = [co for co in all_checkouts(cfg) if _has_op(co)]
    if ref is not None:
        co = Checkout(cfg, ref)
        if co.exists:
            st = co.load()
            if st.op or st.legacy_op:
                return co
        elsewhere = [c for c in found if c.ref != ref]
        if elsewhere:  # a rebase stops in the NEW tag's checkout: name it, never "nothing in progress"
            c = elsewhere[0]
            raise WorkspaceError(f"{ref}: nothing in progress in its checkout; the {_op_kind(c)} stopped in "
                                 f"{c.ref}'s checkout", hint=f"`dsadapt continue {c.ref}` (or skip, abort)")
        raise WorkspaceError(f"{ref}: no apply, rebase or refresh in progress", hint="nothing to continue, skip or abort")
    if not found:
        raise WorkspaceError("no apply, rebase or refresh in progress", hint="nothing to continue, skip or abort")
    if len(found) > 1:
        raise WorkspaceError(f"{len(found)} operations in progress: {', '.join(str(c.ref) for c in found)}",
                             hint="name one, e.g. `dsadapt continue vllm@v0.32.0`")
    return found[0]


def has_op(cfg: Config, ref: PinRef) -> bool:
    """Whether the pin's checkout holds an operation in progress."""
    co = Checkout(cfg, ref)
    return co.exists and _has_op(co)


def _has_op(co: Checkout) -> bool:
    try:
        st = co.load()
    except DsadaptError:
        return False
    return bool(st.op or st.legacy_op)


def all_checkouts(cfg: Config) -> list[Checkout]:
    out = []
    root = cfg.workdir / "checkouts"
    if root.is_dir():
        for engine_dir in sorted(root.iterdir()):
            if not engine_dir.is_dir() or engine_dir.name.startswith("."):
                continue
            for tag_dir in sorted(engine_dir.iterdir()):
                if tag_dir.name.startswith(".") or not tag_dir.is_dir():
                    continue
                try:
                    co = Checkout(cfg, PinRef(engine_dir.name, tag_dir.name))
                except DsadaptError:
                    continue
                if co.exists:
                    out.append(co)
    return out


def continue_apply(cfg: Config, ref: PinRef | None = None, on_patch=None, progress=None) -> StackResult:
    co = _in_progress(cfg, ref)
    tx = Transaction.open(co, on_patch, progress)
    if tx.state.legacy_op:
        _refuse_op(tx)
    return tx.user_continue()


def skip_patch(cfg: Config, ref: PinRef | None = None, on_patch=None, progress=None) -> StackResult:
    co = _in_progress(cfg, ref)
    tx = Transaction.open(co, on_patch, progress)
    if tx.state.legacy_op:
        _refuse_op(tx)
    return tx.user_skip()


def abort_apply(cfg: Config, ref: PinRef | None = None, progress=None) -> Checkout:
    """Return the checkout exactly to where it was before the operation (branches, HEAD, work tree,
    uncommitted and untracked work). Notes about kept work are in `co.notes`."""
    co = _in_progress(cfg, ref)
    tx = Transaction.open(co, None, progress)
    if tx.state.legacy_op:
        _abort_legacy(tx)
        co.notes = tx.notes  # type: ignore[attr-defined]
        return co
    tx.abort()
    co.notes = tx.notes  # type: ignore[attr-defined]
    co.kind = tx.state.op.kind if tx.state.op else None  # type: ignore[attr-defined]
    return co


def _abort_legacy(tx: Transaction) -> None:
    """Undo an op recorded by dsadapt < 0.2 (state schema 1): save what is there, then restore."""
    import shutil

    from patcher.base.gitutil import snapshot_commit, work_snapshot

    co, g, op = tx.co, tx.git, tx.state.legacy_op or {}
    if co.am_in_progress():
        shutil.rmtree(co.am_dir, ignore_errors=True)
    if g.is_dirty():
        ref = co.next_backup_names(1)[0]
        g.update_ref(ref, snapshot_commit(g, work_snapshot(g), "dsadapt: work tree when aborting"))
        tx.notes.append(f"the work tree's changes are kept in {ref}")
    g.run("reset", "-q", "--hard")
    g.run("clean", "-qfd")
    before = op.get("branch_head_before")
    if before:
        g.update_ref(co.branch_ref, before)
    if op.get("orig_branch"):
        g.run("checkout", "-q", "-f", op["orig_branch"])
    elif op.get("orig_head"):
        g.run("checkout", "-q", "-f", "--detach", op["orig_head"])
    if op.get("dirty_backup") and g.run("stash", "apply", "-q", "--index", op["dirty_backup"], check=False).ok:
        g.delete_ref(op["dirty_backup"])
    tx.state.legacy_op = None
    tx.write()
    shutil.rmtree(co.op_dir, ignore_errors=True)


# ---------------------------------------------------------------- export (refresh, rebase)

FORMAT_PATCH = ("-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "format.signature=",
                "-c", "diff.algorithm=myers", "-c", "diff.context=3", "-c", "diff.renames=false",
                "format-patch", "--stdout", "--full-index", "--binary", "--no-signature", "--no-stat",
                "--zero-commit", "--no-numbered", "--subject-prefix=PATCH", "--no-renames", "--no-color",
                "--src-prefix=a/", "--dst-prefix=b/", "--no-notes", "--no-cover-letter")


def export_commits(git: Git, base: str, head: str) -> list[Patch]:
    """Commits base..head as normalized Patch objects: one `git format-patch` for all of them."""
    lines = git.out("rev-list", "--reverse", "--parents", f"{base}..{head}").splitlines()
    merges = [l.split()[0] for l in lines if len(l.split()) > 2]
    if merges:
        raise WorkspaceError(f"merge commit {merges[0][:12]} in the stack branch",
                             hint="a stack is linear: rebase the branch onto the base without merges")
    commits = [l.split()[0] for l in lines]
    if not commits:
        return []
    text = git.run(*FORMAT_PATCH, f"{base}..{head}").out  # not git.out: stripping would eat a last " " line
    pieces = text.split(MBOX_FROM)[1:]
    if len(pieces) != len(commits):  # e.g. an empty commit format-patch leaves out: one at a time
        pieces = [git.run(*FORMAT_PATCH, "-1", c).out.split(MBOX_FROM, 1)[-1] for c in commits]
    return [parse_patch(MBOX_FROM + p, where=f"commit {c[:12]}") for c, p in zip(commits, pieces)]


def exported_files(patches: list[Patch], old_series: str | None) -> tuple[dict[str, bytes], list[str]]:
    """The stack files `write_stack` would write for these patches: ({name: bytes}, patch names)."""
    from patcher.formats.patchfile import format_patch, patch_filename

    files: dict[str, bytes] = {}
    names = []
    for i, p in enumerate(patches, 1):
        name = patch_filename(i, p.subject)
        files[name] = format_patch(p).encode("utf-8")
        names.append(name)
    files["series"] = format_series(names, old_series).encode("utf-8")
    return files, names


def sync_stack_dir(d: Path, files: dict[str, bytes], old_names: list[str]) -> tuple[list[str], list[str]]:
    """Make the stack dir hold exactly `files` (series written last), removing `old_names` that are not
    among them. Idempotent; unchanged files are not rewritten. Returns (changed, removed)."""
    d.mkdir(parents=True, exist_ok=True)
    leftovers.clean_tmp_files(d)
    changed, removed = [], []
    for name in sorted(n for n in files if n != "series"):
        f = d / name
        if not f.is_file() or f.read_bytes() != files[name]:
            atomic_write_bytes(f, files[name])
            changed.append(name)
    for name in old_names:
        if name not in files and name != "series" and remove_file(d / name):
            removed.append(name)
    if "series" in files:
        f = d / "series"
        if not f.is_file() or f.read_bytes() != files["series"]:
            atomic_write_bytes(f, files["series"])
            changed.append("series")
    return changed, removed


def read_stack_files(d: Path, names: list[str]) -> dict[str, bytes]:
    out = {}
    for n in ["series", *names]:
        f = d / n
        if f.is_file():
            out[n] = f.read_bytes()
    return out


def _series_names(data: bytes | None) -> list[str]:
    if not data:
        return []
    try:
        return parse_series(data.decode("utf-8"))
    except (DsadaptError, UnicodeDecodeError):
        return []


# ---------------------------------------------------------------- refresh


@dataclass
class RefreshResult:
    ref: str
    changed: list[str]
    removed: list[str]
    backup: str | None = None
    notes: list[str] = field(default_factory=list)


class RefreshKind:
    """Writing patches/ from the branch. The checkout itself is not touched; the op records the
    stack files before and after, so a killed refresh is finished or undone byte for byte."""

    name = "refresh"
    verb = "refresh"
    touches_checkout = False

    def prepare(self, tx: Transaction) -> None:
        return None

    def pre_outcomes(self, tx: Transaction) -> dict[int, tuple[str, str]]:
        return {}

    def on_stop(self, tx: Transaction, index: int) -> str | None:
        return None

    def label(self, tx: Transaction, index: int, commit: str | None, merged: bool | None) -> tuple[str, str | None]:
        return "clean", None

    def finish(self, tx: Transaction) -> StackResult:
        op, g = tx.op, tx.git
        ex = op.extra
        d = tx.co.cfg.project / ex["stack_dir"]
        backup = ex.get("backup")
        if backup and g.rev(backup) != ex["before"]:  # the files about to be overwritten, kept first
            g.update_ref(backup, ex["before"], why="refresh --force")
        files = tx.read_files(ex["after"])
        changed, removed = sync_stack_dir(d, files, ex["names_before"])
        ex["changed"] = sorted(set(ex.get("changed", [])) | set(changed))
        ex["removed"] = sorted(set(ex.get("removed", [])) | set(removed))
        if g.rev(STACK_REF) != ex["after"]:
            g.update_ref(STACK_REF, ex["after"])
        res = StackResult(str(tx.co.ref), str(tx.co.path), tx.state.source, tx.co.base(), ex["head"], op.stack_hash,
                          backup_ref=ex.get("backup"), notes=tx.notes)
        tx.close(Applied(op.stack_hash, ex["head"], [], ex["after"], flat_tree_id(files)))
        res.changed, res.removed = ex["changed"], ex["removed"]  # type: ignore[attr-defined]
        return res

    def undo(self, tx: Transaction) -> None:
        ex = tx.op.extra
        d = tx.co.cfg.project / ex["stack_dir"]
        before = tx.read_files(ex["before"])
        after_names = _series_names(tx.read_files(ex["after"]).get("series"))
        sync_stack_dir(d, before, after_names)
        if tx.git.rev(STACK_REF) != tx.op.orig.stack_ref and tx.op.orig.stack_ref:
            tx.git.update_ref(STACK_REF, tx.op.orig.stack_ref)
        if ex.get("backup") and read_stack_files(d, _series_names(before.get("series"))) == before:
            tx.git.delete_ref(ex["backup"])  # the files it kept are back in patches/


register(RefreshKind())


def refresh_stack(cfg: Config, lock: Lock, ref: PinRef, *, force: bool = False) -> RefreshResult:
    """Export the checkout branch's commits back into patches/<engine>/<tag>/.

    Refuses (exit 4) to overwrite patches/ files that changed since the stack was applied or last
    refreshed when the branch does not hold that change; `force` overwrites them and keeps the
    previous files in a backup ref. An unchanged stack changes zero bytes."""
    lock.pin(ref)
    co = Checkout(cfg, ref)
    if not co.exists:
        raise WorkspaceError(f"{ref}: no checkout at {co.path}", hint=f"run `dsadapt apply {ref}` first")
    tx = Transaction.open(co)
    if tx.state.op is not None and tx.op.kind == "refresh" and tx.op.phase != "abort":
        res = tx.run()  # a refresh that was killed: finish writing what it recorded
        return RefreshResult(str(ref), res.changed, res.removed, res.backup_ref,  # type: ignore[attr-defined]
                             ["finished the interrupted refresh", *tx.notes])
    if tx.state.op is not None or tx.state.legacy_op:
        _refuse_op(tx)
    g = co.git
    dirty = g.dirty_files()
    if dirty:
        raise WorkspaceError(f"{ref}: {co.path} has uncommitted changes; refresh exports commits only",
                             hint=f"commit them on {co.branch} (git commit, or git commit --fixup + rebase), then refresh")
    head = g.rev(co.branch_ref)
    if not head:
        raise WorkspaceError(f"{ref}: branch {co.branch} is missing", hint=f"run `dsadapt apply {ref}`")
    base = co.base()
    d = stack_dir(cfg.patches_root, ref)
    rel = str(d.relative_to(cfg.project))
    cur_series = (d / "series").read_bytes() if (d / "series").is_file() else None
    cur_names = _series_names(cur_series)
    patches = export_commits(g, base, head)
    target, names = exported_files(patches, cur_series.decode("utf-8", "replace") if cur_series else None)
    cur = read_stack_files(d, sorted(set(cur_names) | set(names)))
    new_hash = stack_hash([_Entry(n, target[n].decode("utf-8")) for n in names])
    applied = tx.state.applied
    if cur == target:  # nothing to write; the record catches up with the branch
        if not applied or applied.head != head or applied.stack_hash != new_hash or applied.needs_refresh:
            tx.state.applied = Applied(new_hash, head, [], applied.snapshot if applied else None,
                                       applied.snapshot_tree if applied else None)
            if applied and applied.snapshot_tree != flat_tree_id(target):
                snap = tx.files_commit(target)
                tx.state.applied.snapshot, tx.state.applied.snapshot_tree = snap, flat_tree_id(target)
                g.update_ref(STACK_REF, snap)
            tx.write()
        return RefreshResult(str(ref), [], [], None, tx.notes)
    # What patches/ held when the branch was last in step with it (the apply, or the last refresh)
    if applied and applied.snapshot:
        rec: dict[str, bytes] | None = tx.read_files(applied.snapshot)
    elif applied and stack_hash([_Entry(n, cur.get(n, b"").decode("utf-8", "replace")) for n in cur_names]) == applied.stack_hash:
        rec = cur
    else:
        rec = None
    newer = [n for n in sorted(set(cur) | set(rec or {}) | set(target))
             if (rec is None or cur.get(n) != rec.get(n)) and cur.get(n) != target.get(n)
             and (n in cur or (rec is not None and n in rec))]
    backup = None
    if newer and not force:
        what = "changed (or removed) since it was applied" if rec is not None else "not what this checkout applied"
        more = f" (+{len(newer) - 1} more)" if len(newer) > 1 else ""
        raise RefusedToClobber(f"{ref}: {rel}/{newer[0]}{more} {what}, and branch {co.branch} does not hold that change; "
                      "refresh would overwrite it",
                      hint=f"take the newer patches/ with `dsadapt apply {ref} --force` (your branch is kept in a "
                           f"backup ref), or overwrite them with `dsadapt refresh {ref} --force` (the current files "
                           "are kept in a backup ref)")
    before = tx.files_commit(cur) if cur else tx.files_commit({})
    if newer:
        backup = co.next_backup_names(1)[0]
    after = tx.files_commit(target)
    op = Op(kind="refresh", ref=str(ref), stack_hash=new_hash, patches=[],
            orig=Orig(g.current_branch(), g.rev("HEAD"), head, g.rev(STACK_REF), False), phase="finish",
            saves={"backup": backup} if backup else {},
            extra={"stack_dir": rel, "before": before, "after": after, "head": head, "backup": backup,
                   "names_before": cur_names})
    tx.begin(op, [], None)
    if backup:
        tx.notes.append(f"the previous files of {rel} are kept in {backup} "
                        f"(`git -C {co.path} show {backup}:<file>`)")
    res = tx.run()
    return RefreshResult(str(ref), res.changed, res.removed, backup, tx.notes)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Entry:
    name: str
    text: str


# ---------------------------------------------------------------- status


def checkout_status(cfg: Config, lock: Lock, entry: LockEntry, running: int | None = None) -> CheckoutStatus:
    """Where a pin's checkout stands. Read-only; never fails because of another pin."""
    co = Checkout(cfg, entry.ref)
    st = CheckoutStatus(str(entry.ref), str(co.path), "not fetched", "no checkout yet",
                        next=f"dsadapt apply {entry.ref}")
    stack_error = None
    try:
        stack: Stack | None = load_stack(cfg.patches_root, entry.ref, must_exist=False)
        st.stack_hash = stack.hash if stack else None
    except DsadaptError as e:
        stack, stack_error = None, e.message
    if not co.exists:
        if stack_error:
            st.state, st.detail, st.next = "broken", f"the stack cannot be read: {stack_error}", None
        elif stack is not None and not stack.exists:
            st.detail, st.next = "no checkout yet (and no stack)", None
        return st
    return _status_of(co, st, stack, stack_error, running)


def unpinned_status(cfg: Config, co: Checkout, running: int | None = None) -> CheckoutStatus:
    st = CheckoutStatus(str(co.ref), str(co.path), "unknown", "", pinned=False)
    return _status_of(co, st, None, None, running)


def _status_of(co: Checkout, st: CheckoutStatus, stack: Stack | None, stack_error: str | None,
               running: int | None) -> CheckoutStatus:
    from patcher.base.gitutil import git_processes_in, lock_files

    ref = co.ref
    st.next = None
    try:
        state = co.load()
    except DsadaptError as e:
        st.state, st.detail = "broken", e.message + (f"; {e.hint}" if e.hint else "")
        return st
    g = co.git
    st.source = state.source
    refs = dict(g.refs("refs/dsadapt/", co.branch_ref))
    st.base = refs.get(BASE_REF)
    st.head = refs.get(co.branch_ref)
    st.backups = sorted(r for r in refs if r.startswith(BACKUP_PREFIX))
    applied = state.applied
    st.applied_hash = applied.stack_hash if applied else None
    locks = lock_files(co.path / ".git")
    if locks:
        holders = git_processes_in(co.path)
        st.locks = [str(lf.relative_to(co.path)) for lf in locks]
        lock_note = (f"; git lock file {', '.join(st.locks)} " +
                     (f"is held by running git (pid {holders[0][0]})" if holders
                      else "is left from a killed git: the next dsadapt command removes it"))
    else:
        lock_note = ""
    if state.op or state.legacy_op:
        if state.op:
            st.op = {"kind": state.op.kind, "phase": state.op.phase, "done": len(state.op.outcomes),
                     "total": state.op.total}
            st.state, st.detail, st.next = describe_op(co, state.op, running is not None)
        else:
            st.op = {"kind": "apply", "phase": "legacy"}
            st.state, st.detail, st.next = ("interrupted", "an apply recorded by an older dsadapt is in progress; "
                                            f"run `dsadapt abort {ref}`, then apply again", f"dsadapt abort {ref}")
        st.detail += lock_note
        return st
    if stack_error:
        st.state, st.detail = "broken", f"the stack cannot be read: {stack_error}{lock_note}"
        return st
    dirty = g.dirty_files()
    if dirty:
        st.state = "dirty"
        st.detail = f"uncommitted changes: {', '.join(dirty[:5])}{lock_note}"
        return st
    if applied and st.head == applied.head:
        if applied.needs_refresh:
            st.state = "diverged"
            st.detail = f"resolved or skipped during apply: {', '.join(applied.needs_refresh)}; " \
                        f"run `dsadapt refresh {ref}` to export the branch"
            st.next = f"dsadapt refresh {ref}"
        elif stack is not None and applied.stack_hash == stack.hash:
            st.state, st.detail = "stack applied", f"{plural(len(stack), 'patch')} on {st.base[:12] if st.base else '?'}"
        elif stack is None:
            st.state, st.detail = "stack applied", "applied; this checkout's tag is not pinned"
        else:
            st.state, st.detail = "stack outdated", f"patches/ changed since apply; run `dsadapt apply {ref}`"
            st.next = f"dsadapt apply {ref}"
        st.detail += lock_note
        return st
    if st.head == st.base:
        st.state, st.detail = "clean base", "upstream tree, no patches applied"
        if stack is not None and len(stack):
            st.next = f"dsadapt apply {ref}"
        st.detail += lock_note
        return st
    since = (applied.head if applied else None) or st.base
    n = g.out("rev-list", "--count", f"{since}..{st.head}") if st.head and since and g.rev(since) else "?"
    st.state, st.detail = "diverged", f"{n} new commit(s) on {co.branch}; run `dsadapt refresh {ref}` to export them"
    st.next = f"dsadapt refresh {ref}"
    st.detail += lock_note
    return st


def _natural(tag: str) -> tuple:
    """v0.4.0 before v0.18.0 (numbers compare as numbers), without importing packaging."""
    import re

    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", tag) if p)


def status_all(cfg: Config, lock: Lock, status_of=None) -> list[CheckoutStatus]:
    """Status of every pin, plus checkouts on disk that hold an op but whose pin is gone (a rebase
    killed before it pinned NEW)."""
    running = lock_holder(cfg)
    entries = sorted(lock.pins.values(), key=lambda e: (e.engine, _natural(e.tag)))
    out = []
    for e in entries:
        try:
            out.append((status_of or checkout_status)(cfg, lock, e, running))
        except (StackError, WorkspaceError, VerificationError, GitError) as err:  # one broken checkout never hides the others
            out.append(CheckoutStatus(str(e.ref), str(cfg.checkout_dir(e.engine, e.tag)), "broken", err.message))
    pinned = {str(e.ref) for e in entries}
    for co in all_checkouts(cfg):
        if str(co.ref) not in pinned and _has_op(co):
            out.append(unpinned_status(cfg, co, running))
    return out

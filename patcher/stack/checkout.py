"""The checkout: one git repository per pin under the work dir, made from a verified source, and its
dsadapt state (the record, the refs dsadapt keeps there), read as git shows it.

`ensure_checkout` materializes a pin's tree (git, mirror or release artifact, verified against the
lock) into `checkouts/<engine>/<tag>/`, and re-verifies an existing checkout whenever the lock's
pin changed; `Checkout` names what lives in it (base.dotgit) and reads its record
(record.py: rebuilt from git when damaged or missing). What the user did by hand is read here
before any command acts: where HEAD is and which commits only it holds (`head_state`), another
worktree holding the stack branch (`shared_branch`), a git operation of the user's in progress
(`git_in_progress`). Nothing here changes a checkout that exists beyond repairing its record and
refs: every change goes through the transaction (transaction.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.dotgit import (
    BACKUP_PREFIX,
    BASE_REF,
    OP_PREFIX,
    REFS,
    STACK_REF,
    STATE_REF,
    CheckoutLayout,
    branch_name,
)
from patcher.base.errors import DsadaptError, VerificationError, WorkspaceError
from patcher.base.fsutil import atomic_write_bytes
from patcher.base.gitutil import FIXED_DATE, Git, clear_stale_locks, init_repo
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import SYMLINK_MODE, Stack, expected_preimages, preimage_mismatches
from patcher.stack import record
from patcher.stack.state import NewerState, State

__all__ = ["BACKUP_PREFIX", "BASE_REF", "OP_PREFIX", "STACK_REF", "STATE_REF", "Checkout", "HeadState", "Worktree",
           "all_checkouts", "branch_lag", "branch_name", "check_lock", "check_preimages", "ensure_checkout",
           "git_in_progress", "has_op", "head_state", "in_progress", "reflog_only", "refuse_hand_made",
           "shared_branch", "stack_files", "tree_links"]

Progress = Callable[[str], None]


class Checkout:
    """One checkout directory (a normal git repository) and its dsadapt state."""

    def __init__(self, cfg: Config, ref: PinRef) -> None:
        self.cfg = cfg
        self.ref = ref
        self.path: Path = cfg.checkout_dir(ref.engine, ref.tag)
        self.git = Git(self.path)
        self.notes: list[str] = []          # what reading or repairing the record did, for the command's output
        self.rebuilt: str | None = None     # how the last `load` rebuilt the record (None: read as written)
        self.damage: str | None = None      # what was wrong with the record then ("missing", "unreadable (...)")
        self._copy_files: dict[str, bytes] = {}   # the op's files as the record's copy in git holds them
        self._written = record.Written()

    @property
    def layout(self) -> CheckoutLayout:
        return CheckoutLayout(self.path)

    @property
    def exists(self) -> bool:
        """A git repository at the checkout's path that dsadapt made (its record, its refs or its
        branch are there; a record lost by hand is rebuilt when it is read)."""
        lay = self.layout
        return lay.git_dir.is_dir() and (lay.state.is_file() or self._marked())

    def _marked(self) -> bool:
        lay = self.layout
        if lay.own.is_dir() or (lay.git_dir / REFS).is_dir() \
                or (lay.git_dir / self.branch_ref).is_file():
            return True
        try:
            packed = (lay.git_dir / "packed-refs").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
        return f" {REFS}" in packed or f" {self.branch_ref}\n" in packed

    @property
    def state_path(self) -> Path:
        return self.layout.state

    @property
    def op_dir(self) -> Path:
        return self.layout.op_dir

    @property
    def am_dir(self) -> Path:
        return self.layout.am_dir

    @property
    def branch(self) -> str:
        return branch_name(self.ref.tag)

    @property
    def branch_ref(self) -> str:
        return f"refs/heads/{self.branch}"

    # ------------------------------------------------------------ the record

    def load(self) -> State:
        """The record; one that is missing or unreadable is rebuilt in memory (from its copy in git,
        or derived from git: record.py) and `rebuilt` says why. Nothing is written (`repair` does)."""
        self.rebuilt = self.damage = None
        try:
            raw: bytes | None = self.layout.state.read_bytes()
        except FileNotFoundError:
            raw = None
        except IsADirectoryError:
            raw = b"(a directory)"
        if raw is not None:
            try:
                return record.parse_record(raw)
            except NewerState as e:
                raise WorkspaceError(f"{self.path}: {e}",
                                     hint="use a dsadapt at least as new as the one that wrote it") from None
            except record.Unreadable as e:
                return self._rebuild(f"unreadable ({e})")
        return self._rebuild("missing")

    def _rebuild(self, why: str) -> State:
        self.damage = why
        if not self.layout.git_dir.is_dir():
            raise WorkspaceError(f"{self.path} has no dsadapt state", hint=f"run `dsadapt apply {self.ref}`")
        copy = record.read_copy(self.git, str(self.ref))
        if copy is not None:
            state, self._copy_files = copy
            self.rebuilt = f"its state record was {why}; it was taken back from its copy in {STATE_REF}"
            return state
        derived = record.derive(self.git, self.layout, str(self.ref), self.branch_ref, self._lock_entry(),
                                self._stack_texts())
        self.rebuilt = f"its state record was {why}; it was re-derived from git ({'; '.join(derived.how)})"
        return derived.state

    def _lock_entry(self) -> LockEntry | None:
        from patcher.formats.lock import load_lock

        try:
            return load_lock(self.cfg.lock_path).pins.get(str(self.ref))
        except (DsadaptError, OSError):
            return None

    def _stack_texts(self) -> tuple[list[str], str] | None:
        from patcher.formats.stackfiles import load_stack

        try:
            stack = load_stack(self.cfg.patches_root, self.ref, must_exist=False)
        except (DsadaptError, OSError):
            return None
        return ([e.text for e in stack.entries], stack.hash) if stack.exists else None

    def load_state(self) -> dict:
        """The state as JSON (what `.git/dsadapt/state.json` holds)."""
        return self.load().to_json()

    def save(self, state: State) -> None:
        self.layout.own.mkdir(parents=True, exist_ok=True)
        record.write_record(self.git, self.layout, state, self._written)

    def repair(self, state: State) -> State:
        """Make on disk what `load` read: a rebuilt record written (the damaged file kept beside
        it), the op's files put back from the record's copy, and dsadapt's refs that are missing or
        broken made again from the record (a ref that exists with another value is left alone).
        `notes` says what was done."""
        lay, g = self.layout, self.git
        if self.rebuilt:
            lay.own.mkdir(parents=True, exist_ok=True)
            kept = None
            if lay.state.exists() or lay.state.is_symlink():
                kept = lay.damaged_state(f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
                os.replace(lay.state, kept)
            if state.op is not None:
                lay.op_dir.mkdir(parents=True, exist_ok=True)
                for name, data in sorted(self._copy_files.items()):
                    if not (lay.op_dir / name).is_file():
                        atomic_write_bytes(lay.op_dir / name, data)
            self.save(state)
            self.notes.append(f"{self.rebuilt}" + (f"; the damaged record is kept as {kept}" if kept else ""))
            self.rebuilt = None
        refs = dict(g.refs(REFS, self.branch_ref))
        for ref in self._broken_refs(refs):  # git skips them (with a warning on every command): kept aside
            self._set_aside_broken(ref)
            if ref == self.branch_ref:  # the branch's last value is in its reflog
                last = next(iter(record.reflog_values(self.layout, ref)), None)
                if last and g.rev(last):
                    g.update_ref(ref, last, why="dsadapt: the branch's ref was damaged; its reflog's last value")
                    self.notes.append(f"made branch {self.branch} again at {last[:12]}, its reflog's last value")
        want = [(BASE_REF, state.base)]
        if state.op is None and state.applied is not None:
            want.append((STACK_REF, state.applied.snapshot))
        if state.op is not None:
            want += sorted(state.op.saved.items())
        made = []
        for ref, commit in want:
            if not commit or ref in refs or not g.rev(commit):
                continue
            g.update_ref(ref, commit)
            made.append(ref)
        if made:
            self.notes.append(f"made {', '.join(made)} again from the checkout's record (missing or damaged)")
        return state

    def _broken_refs(self, valid: dict[str, str]) -> list[str]:
        """Loose ref files of dsadapt's (refs/dsadapt/**, the stack branch) that git cannot read."""
        gd = self.layout.git_dir
        files = [self.branch_ref] if (gd / self.branch_ref).is_file() else []
        root = gd / REFS
        if root.is_dir():
            for dirpath, _dirs, names in os.walk(root):
                files += [str((Path(dirpath) / n).relative_to(gd)) for n in names if not n.startswith(".")
                          and not n.endswith(".lock")]
        return sorted(f for f in files if f not in valid)


    def _set_aside_broken(self, ref: str) -> None:
        """A loose ref file git cannot read (git skips it as broken) is kept aside before the ref is
        written again."""
        f = self.layout.git_dir / ref
        if f.is_file() or f.is_symlink():
            aside = self.layout.own / "damaged" / f"{ref.replace('/', '-')}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, aside)
            self.notes.append(f"kept the damaged {ref} as {aside}")

    def am_in_progress(self) -> bool:
        return self.am_dir.exists()

    def base(self) -> str:
        """refs/dsadapt/base, or the base the record names where that ref is gone (it never moves
        once the checkout exists: read once)."""
        b = getattr(self, "_base", None) or self.git.rev(BASE_REF)
        if not b:
            try:
                st = self.load()
            except DsadaptError:
                st = None
            b = st.base if st is not None and st.base and self.git.rev(st.base) else None
        if not b:
            raise WorkspaceError(f"{self.path}: {BASE_REF} is missing and the checkout's record names no base",
                                 hint=f"move {self.path} away (your commits stay in it) and run "
                                      f"`dsadapt apply {self.ref}` to make the checkout again")
        self._base = b
        return b

    def backups(self) -> list[str]:
        return [r for r, _ in self.git.refs(BACKUP_PREFIX)]

    def next_backup_names(self, n: int, taken: set[str] | None = None) -> list[str]:
        """`n` unused backup ref names (refs/dsadapt/backup/<k>, lowest k first)."""
        used = {r.removeprefix(BACKUP_PREFIX) for r in (self.backups() if taken is None else taken)}
        out: list[str] = []
        i = 1
        while len(out) < n:
            if str(i) not in used:
                out.append(f"{BACKUP_PREFIX}{i}")
            i += 1
        return out

    def has_op(self) -> bool:
        """Whether the checkout holds an operation in progress (an unreadable state: no)."""
        try:
            return self.load().op is not None
        except DsadaptError:
            return False


# ---------------------------------------------------------------- the lock, re-verified


def check_lock(co: Checkout, entry: LockEntry, state: State | None = None, *, record_it: bool = True) -> State:
    """Re-verify an existing checkout against the lock's pin whenever the pin changed since it was
    last verified (its digest is in the record): VerificationError (exit 3) when the base is not
    the tree the lock now pins; otherwise the new digest is recorded (`record_it`). Returns the
    state (repaired on disk when `record_it`)."""
    state = state if state is not None else co.load()
    rec = record.lock_record(entry)
    changed = (state.lock or {}).get("digest") != rec["digest"]
    if changed:
        why = record.lock_mismatch(co.git, state, entry)
        if why:
            raise VerificationError(
                f"{co.ref}: the checkout does not match upstream.lock: {why}",
                hint=f"if upstream.lock is right, move {co.path} away (your commits stay in it) and run "
                     f"`dsadapt apply {co.ref}` to make the checkout from a source verified against it; if not, "
                     "put upstream.lock back as it was (`git checkout upstream.lock` in the project)")
        state.lock = rec
    if record_it:
        wrote = co.rebuilt is not None
        co.repair(state)
        if changed and not wrote:
            co.save(state)
    return state


# ---------------------------------------------------------------- what the user did by hand


@dataclass(frozen=True)
class Worktree:
    """A linked worktree (`git worktree add`) that has the stack branch checked out."""

    path: Path
    present: bool   # False: its directory is gone (git still counts the branch as checked out there)


def shared_branch(co: Checkout) -> list[Worktree]:
    """The other worktrees holding the stack branch (checked out there, or being rebased there);
    read from `.git/worktrees/` without starting git."""
    d = co.layout.worktrees
    if not d.is_dir():
        return []
    want = f"ref: {co.branch_ref}"
    out = []
    for w in sorted(d.iterdir()):
        held = False
        for f in (w / "HEAD", w / "rebase-merge" / "head-name", w / "rebase-apply" / "head-name"):  # (git's own names)
            try:
                text = f.read_text(encoding="utf-8", errors="replace").strip()
            except OSError:
                continue
            if text in (want, co.branch_ref):
                held = True
        if not held:
            continue
        try:
            gitfile = Path((w / "gitdir").read_text(encoding="utf-8").strip())
        except OSError:
            gitfile = None
        out.append(Worktree(gitfile.parent if gitfile else w, bool(gitfile and gitfile.exists())))
    return out


def shared_words(co: Checkout, wts: list[Worktree]) -> tuple[str, str]:
    """(what, the command that frees the branch) for a stack branch held by another worktree."""
    w = wts[0]
    more = f" (and {len(wts) - 1} more)" if len(wts) > 1 else ""
    if w.present:
        return (f"branch {co.branch} is checked out in another worktree, {w.path}{more}; dsadapt does not move "
                "a branch under a worktree",
                f"`git -C {w.path} switch --detach` frees it (what is in that worktree stays there); then run "
                "the command again")
    return (f"branch {co.branch} is checked out in a worktree that is gone ({w.path}){more}",
            f"`git -C {co.path} worktree prune` frees it; then run the command again")


def git_in_progress(co: Checkout, has_op: bool) -> tuple[str, str] | None:
    """(what, how to finish it) when a git operation of the user's is half done in the checkout: a
    rebase, a merge, a cherry-pick or revert, a bisect, or a `git am` no dsadapt op started."""
    lay, ref = co.layout, co.ref
    gd = lay.git_dir
    if lay.rebase_merge.is_dir() or (lay.am_dir / "rebasing").exists():
        return ("a git rebase is in progress", "finish it with `git rebase --continue` (or undo it with "
                f"`git rebase --abort`), then run the command again; or `dsadapt apply {ref} --force` keeps the "
                "work tree, HEAD and the branch in backup refs and applies patches/ again")
    if co.am_in_progress() and not has_op:
        return ("a git am is in progress that no dsadapt operation on record started",
                f"finish it with `git am --continue` (after `git add`), then `dsadapt refresh {ref}`; or "
                f"`dsadapt apply {ref} --force` keeps the work tree and the branch in backup refs and applies "
                "patches/ again")
    for name, what, cmd in (("MERGE_HEAD", "a git merge", "merge"), ("CHERRY_PICK_HEAD", "a git cherry-pick", "cherry-pick"),
                            ("REVERT_HEAD", "a git revert", "revert")):
        if (gd / name).exists():
            return (f"{what} is in progress", f"finish it with `git {cmd} --continue` (or undo it with "
                    f"`git {cmd} --abort`), then run the command again")
    if (gd / "BISECT_LOG").exists():
        return ("a git bisect is in progress", "end it with `git bisect reset`, then run the command again")
    return None


def refuse_hand_made(co: Checkout, has_op: bool, *, force: bool = False) -> None:
    """Refuse (exit 4) a stack branch another worktree holds (always) and a half-done git operation
    of the user's (unless `force`), naming the command that reconciles it. Costs no git process."""
    wts = shared_branch(co)
    if wts:
        what, fix = shared_words(co, wts)
        raise WorkspaceError(f"{co.ref}: {what}", hint=fix)
    busy = None if force else git_in_progress(co, has_op)
    if busy:
        raise WorkspaceError(f"{co.ref}: {busy[0]} in {co.path}", hint=busy[1])


def _subject_key(s: str) -> str:
    return " ".join(s.split()).lower()


@dataclass
class HeadState:
    """Where HEAD and the stack branch are, as git shows them: read before any command acts, so
    that nothing acts on a guess about a checkout the user changed by hand."""

    branch: str | None            # the branch HEAD is on (None: detached)
    head: str | None              # HEAD's commit
    branch_head: str | None       # refs/heads/dsadapt/<tag> (None: missing)
    refs: dict[str, str]          # refs/heads/* and refs/dsadapt/*
    only_head: int = 0            # commits only a detached HEAD reaches (on no branch, tag or backup)
    beyond: int = 0               # commits of the other branch HEAD is on that dsadapt/<tag> lacks
    lacks: list[tuple[str, str]] = field(default_factory=list)  # commits of dsadapt/<tag> HEAD lacks (id, subject)
    replaced: int = 0             # of them, the first ones HEAD holds a commit of the same subject for (an amend)

    def problem(self, co: Checkout) -> tuple[str, str] | None:
        """(what, how to reconcile) when HEAD holds work that is not on the stack branch. Every git
        command named keeps every commit: HEAD's, and the stack branch's that HEAD lacks."""
        br = co.branch
        if self.branch is None and self.only_head:
            short = (self.head or "?")[:12]
            fix = self._onto(co, short)
            return (f"HEAD is detached at {short} with {self.only_head} commit(s) on no branch",
                    f"{fix}; `dsadapt apply {co.ref} --force` keeps them in a backup ref and re-applies the stack")
        if self.branch is not None and self.branch != br and self.beyond:
            if self.branch_head is None:
                fix = f"if you renamed the stack branch, `git branch -m {self.branch} {br}`, then `dsadapt refresh {co.ref}`"
            else:
                fix = self._onto(co, self.branch)
            missing = f"; branch {br} is missing" if self.branch_head is None else ""
            return (f"HEAD is on branch {self.branch} with {self.beyond} commit(s) not on {br}{missing}",
                    f"{fix}; or `dsadapt apply {co.ref} --force` (branch {self.branch} stays as it is)")
        return None

    def _onto(self, co: Checkout, target: str) -> str:
        """The git command that makes HEAD's commits the stack branch's, keeping the branch's own."""
        br, ref = co.branch, co.ref
        then = f" (then `dsadapt refresh {ref}`)"
        if self.branch_head is None:
            return f"`git checkout -b {br}` makes them the stack branch{then}"
        n = len(self.lacks)
        if n == 0:
            return f"`git checkout -B {br}` makes them the stack branch's{then}"
        keep = (f"`git branch {br}-was-{(self.branch_head or '')[:8]} {br}` keeps the stack branch as it is "
                f"(its {n} commit(s) HEAD lacks included), then ")
        if self.replaced == n:
            return (f"{keep}`git checkout -B {br}` makes them the stack branch's (they replace its last {n} "
                    f"commit(s), by subject){then}")
        if self.replaced:
            last = self.lacks[self.replaced - 1][0][:12]
            return (f"{keep}`git rebase --onto {target} {last} {br}` puts the {n - self.replaced} commit(s) of {br} "
                    f"after the one(s) you replaced on top of yours{then}")
        return f"{keep}`git rebase {target} {br}` puts the {n} commit(s) of {br} that HEAD lacks on top of yours{then}"


def head_state(co: Checkout) -> HeadState:
    """HEAD, the stack branch and, only where HEAD is off that branch, how much work sits there and
    what of the branch HEAD lacks (one `for-each-ref` in the usual case, a few more otherwise)."""
    g = co.git
    branch, head, refs = g.head()
    st = HeadState(branch, head, refs.get(co.branch_ref), refs)
    if head and branch is None and head != st.branch_head:
        st.only_head = int(g.out("rev-list", "--count", head, "--not", "--branches", "--tags", "--remotes",
                                 f"--glob={REFS}*") or 0)
    elif head and branch is not None and branch != co.branch:
        since = st.branch_head or g.rev(BASE_REF)
        st.beyond = int(g.out("rev-list", "--count", head, *([f"^{since}"] if since else [])) or 0)
    if (st.only_head or st.beyond) and st.branch_head and head:
        fork = g.run("merge-base", head, st.branch_head, check=False).out.strip()
        if fork:
            st.lacks = [(c, s) for c, s, _ in g.commits(f"{fork}..{st.branch_head}")]
            if st.lacks:
                mine = {_subject_key(s) for _, s, _ in g.commits(f"{fork}..{head}")}
                while st.replaced < len(st.lacks) and _subject_key(st.lacks[st.replaced][1]) in mine:
                    st.replaced += 1
    return st


def branch_lag(g: Git, expected: str | None, branch_head: str) -> tuple[int | None, int]:
    """(commits the branch has beyond `expected`, commits of `expected` it lacks); (None, 0) when
    `expected` is not in the repository."""
    if not expected or not g.rev(expected):
        return None, 0
    parts = g.out("rev-list", "--left-right", "--count", f"{expected}...{branch_head}").split()
    return (int(parts[1]), int(parts[0])) if len(parts) == 2 else (None, 0)


def tree_links(g: Git, rev: str) -> dict[str, str]:
    """The symbolic links of a tree: {path: target} (one `ls-tree`, one `cat-file` when there are any)."""
    out = g.run_bytes("ls-tree", "-r", "-z", rev)[1].decode("utf-8", "surrogateescape")
    ids = {}
    for rec in out.split("\0"):
        meta, _, path = rec.partition("\t")
        if meta.startswith("120000 "):
            ids[path] = meta.split()[2]
    blobs = g.cat_blobs(sorted(set(ids.values())))
    return {p: (blobs.get(oid) or b"").decode("utf-8", "surrogateescape") for p, oid in ids.items()}


def changed_links(g: Git, base: str, head: str) -> bool:
    """Whether base..head adds, changes or removes a symbolic link (one `diff-tree`, as git sees it)."""
    out = g.run("diff-tree", "-r", "--raw", "--no-renames", "-z", base, head).out
    return any(rec.startswith(":") and SYMLINK_MODE in rec[1:].split(" ")[:2] for rec in out.split("\0"))


def reflog_only(g: Git) -> list[str]:
    """Commits of the user's that only git's reflogs still reach (reset or checked out away from),
    newest ones only (the tips); dsadapt's own commits, which carry its fixed date, are not counted."""
    out = g.run("log", "--format=%H %ct %P", "--reflog", "--not", "--all", check=False).out
    rows = [l.split() for l in out.splitlines() if l.strip()]
    fixed = FIXED_DATE.split()[0]
    mine = {r[0]: r[2:] for r in rows if len(r) >= 2 and r[1] != fixed}
    parents = {p for ps in mine.values() for p in ps}
    return [c for c in mine if c not in parents]


class _AtPath(Checkout):
    def __init__(self, cfg: Config, ref: PinRef, path: Path) -> None:
        super().__init__(cfg, ref)
        self.path = path
        self.git = Git(path)


def ensure_checkout(cfg: Config, lock: Lock, entry: LockEntry, progress: Progress | None = None) -> tuple[Checkout, bool]:
    """The pin's checkout, materialized from a verified source if it does not exist yet; one that
    exists is re-verified when the pin changed (`check_lock`) and its record repaired.

    It is built under `.TAG.tmp-PID` and renamed into place when complete, so a kill leaves
    either no checkout or a whole one; leftovers of dead runs are removed first."""
    co = Checkout(cfg, entry.ref)
    if co.exists:
        check_lock(co, entry)
        return co, False
    from patcher.upstream.sources import materialize  # (network modules: only when a tree is to be made)

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
        state = State(str(entry.ref), src.to_json(), src.commit, lock=record.lock_record(entry))
        _AtPath(cfg, entry.ref, tmp).save(state)
        co.path.parent.mkdir(parents=True, exist_ok=True)
        if co.path.exists():
            co.path.rmdir()
        os.replace(tmp, co.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Checkout(cfg, entry.ref), True


def check_preimages(co: Checkout, stack: Stack, base: str) -> None:
    """For artifact-based trees: every touched file must be byte-identical to the patch's pre-image."""
    expected, _post, problems = expected_preimages(stack.patches)
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


def has_op(cfg: Config, ref: PinRef) -> bool:
    """Whether the pin's checkout holds an operation in progress."""
    co = Checkout(cfg, ref)
    return co.exists and co.has_op()


def _op_kind(co: Checkout) -> str:
    try:
        st = co.load()
    except DsadaptError:
        return "operation"
    return st.op.kind if st.op else "apply"


def in_progress(cfg: Config, ref: PinRef | None) -> Checkout:
    """The checkout whose op `continue` / `skip` / `abort` mean: the named pin's, or the only one."""
    found = [co for co in all_checkouts(cfg) if co.has_op()]
    if ref is not None:
        co = Checkout(cfg, ref)
        if co.exists and co.load().op is not None:
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
                             hint=f"name one, e.g. `dsadapt continue {found[0].ref}`")
    return found[0]

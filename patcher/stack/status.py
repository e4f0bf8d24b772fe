"""status: where each pin's checkout stands, read from its state and from git (never changed).

The states (docs/user-guide.md): not fetched, clean base, stack applied, stack outdated, stopped,
interrupted, running, dirty, diverged, broken; each comes with the command that moves it on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from patcher.base.config import Config
from patcher.base.dotgit import BACKUP_PREFIX, BASE_REF
from patcher.base.errors import DsadaptError, StackError, VerificationError, WorkspaceError, plural
from patcher.base.gitutil import GitError
from patcher.base.workdir import lock_holder
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.parsecache import ParseCache
from patcher.formats.stackfiles import Stack, load_stack
from patcher.stack.checkout import (
    Checkout,
    all_checkouts,
    branch_lag,
    check_lock,
    git_in_progress,
    head_state,
    shared_branch,
    shared_words,
)
from patcher.stack.refresh import branch_commits
from patcher.stack.transaction import am_done, describe_op, kind_of

__all__ = ["CheckoutStatus", "checkout_status", "status_all", "unpinned_status"]


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


def checkout_status(cfg: Config, lock: Lock, entry: LockEntry, running: int | None = None) -> CheckoutStatus:
    """Where a pin's checkout stands. Read-only; never fails because of another pin."""
    co = Checkout(cfg, entry.ref)
    st = CheckoutStatus(str(entry.ref), str(co.path), "not fetched", "no checkout yet",
                        next=f"dsadapt apply {entry.ref}")
    stack_error = None
    try:
        stack: Stack | None = load_stack(cfg.patches_root, entry.ref, must_exist=False,
                                          cache=ParseCache.in_workdir(cfg.workdir))
        st.stack_hash = stack.hash if stack else None
    except DsadaptError as e:
        stack, stack_error = None, e.message
    if not co.exists:
        if stack_error:
            st.state, st.detail, st.next = "broken", f"the stack cannot be read: {stack_error}", None
        elif stack is not None and not stack.exists:
            st.detail, st.next = "no checkout yet (and no stack)", None
        return st
    return _status_of(co, st, stack, stack_error, running, entry)


def unpinned_status(cfg: Config, co: Checkout, running: int | None = None) -> CheckoutStatus:
    st = CheckoutStatus(str(co.ref), str(co.path), "unknown", "", pinned=False)
    return _status_of(co, st, None, None, running)


def _status_of(co: Checkout, st: CheckoutStatus, stack: Stack | None, stack_error: str | None,
               running: int | None, entry: LockEntry | None = None) -> CheckoutStatus:
    st.next = None
    try:
        state = co.load()
        if entry is not None:
            check_lock(co, entry, state, record_it=False)  # a pin changed under the checkout: exit 3 for the commands
    except DsadaptError as e:
        st.state, st.detail = "broken", e.message + (f"; {e.hint}" if e.hint else "")
        return st
    st.source = state.source
    hs = head_state(co)
    st.base = hs.refs.get(BASE_REF)
    st.head = hs.branch_head
    st.backups = sorted(r for r in hs.refs if r.startswith(BACKUP_PREFIX))
    st.applied_hash = state.applied.stack_hash if state.applied else None
    lock_note = _rebuilt_note(co) + _lock_note(co, st)
    if state.op:
        st.op = {"kind": state.op.kind, "phase": state.op.phase, "done": am_done(co, state.op),
                 "total": state.op.total}
        st.state, st.detail, st.next = describe_op(co, state.op, running is not None)
        wts = shared_branch(co) if getattr(_kind_or_none(state.op.kind), "touches_checkout", True) else []
        if wts:
            what, fix = shared_words(co, wts)
            st.detail += f"; {what}: {fix}"
        st.detail += lock_note
        return st
    if _not_on_the_branch(co, st, hs, stack_error, lock_note):
        return st
    elsewhere = ""
    if hs.branch != co.branch:
        where = "detached at the head of" if hs.branch is None else f"on branch {hs.branch}, at the head of"
        elsewhere = f"; HEAD is {where} {co.branch}: `git switch {co.branch}` before you commit"
    _on_the_branch(co, st, stack, state.applied)
    st.detail += elsewhere + lock_note
    return st


def _rebuilt_note(co: Checkout) -> str:
    return (f"; its state record was {co.damage}: rebuilt from git when the next dsadapt command runs"
            if co.rebuilt else "")


def _lock_note(co: Checkout, st: CheckoutStatus) -> str:
    from patcher.base.gitutil import git_processes_in, lock_files

    locks = lock_files(co.path / ".git")
    if not locks:
        return ""
    holders = git_processes_in(co.path)
    st.locks = [str(lf.relative_to(co.path)) for lf in locks]
    return (f"; git lock file {', '.join(st.locks)} " +
            (f"is held by running git (pid {holders[0][0]})" if holders
             else "is left from a killed git: the next dsadapt command removes it"))


def _not_on_the_branch(co: Checkout, st: CheckoutStatus, hs, stack_error: str | None, lock_note: str) -> bool:
    """Fill in st and say True where the checkout is not (only) the stack branch at rest: an unreadable
    stack, a branch shared with another worktree, the user's own git operation, uncommitted changes,
    work on a detached HEAD or another branch, a missing branch."""
    ref = co.ref
    if stack_error:
        st.state, st.detail = "broken", f"the stack cannot be read: {stack_error}{lock_note}"
        return True
    wts = shared_branch(co)
    if wts:  # never "applied" or "git switch" over a branch another worktree has checked out
        what, fix = shared_words(co, wts)
        st.state, st.detail = "diverged", f"{what}: {fix}{lock_note}"
        return True
    busy = git_in_progress(co, False)
    if busy:  # the user's own git operation, half done: theirs to finish
        st.state, st.detail = "dirty", f"{busy[0]}: {busy[1]}{lock_note}"
        if "dsadapt apply" in busy[1]:
            st.next = f"dsadapt apply {ref} --force"
        return True
    dirty = co.git.dirty_files()
    if dirty:
        st.state = "dirty"
        st.detail = f"uncommitted changes: {', '.join(dirty[:5])}{lock_note}"
        return True
    off = hs.problem(co)
    if off:  # work on a detached HEAD or another branch: never "applied" over it
        st.state, st.detail = "diverged", f"{off[0]}: {off[1]}{lock_note}"
        return True
    if st.head is None:
        st.state, st.detail = "diverged", f"branch {co.branch} is missing; `dsadapt apply {ref}` makes it again{lock_note}"
        st.next = f"dsadapt apply {ref}"
        return True
    if hs.head != st.head:  # HEAD holds no work of its own, but the work tree is not the branch's
        where = f"detached at {(hs.head or '?')[:12]}" if hs.branch is None else f"on branch {hs.branch}"
        st.state, st.detail = "diverged", (f"HEAD is {where}, not on {co.branch}: `git switch {co.branch}` (or "
                                           f"`dsadapt apply {ref}`){lock_note}")
        st.next = f"dsadapt apply {ref}"
        return True
    return False


def _on_the_branch(co: Checkout, st: CheckoutStatus, stack: Stack | None, applied) -> None:
    """The verdict for a checkout whose work tree is its stack branch: applied, outdated, clean base, or
    commits of the user's own that refresh would export (or refuse)."""
    ref = co.ref
    head = st.head
    assert head is not None  # a missing branch was told by _not_on_the_branch
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
        return
    if st.head == st.base:
        st.state, st.detail = "clean base", "upstream tree, no patches applied"
        if stack is not None and len(stack):
            st.next = f"dsadapt apply {ref}"
        return
    g = co.git
    since = (applied.head if applied else None) or st.base
    ahead, behind = branch_lag(g, since, head)
    if ahead == 0 and behind:
        st.state, st.detail = "diverged", (f"branch {co.branch} was moved back by hand: it lacks {behind} commit(s) "
                                           f"of the applied stack; `dsadapt refresh {ref}` drops their patches from "
                                           f"the stack, `dsadapt apply {ref} --force` applies patches/ again")
        return
    new = f"{ahead if ahead is not None else '?'} new commit(s) on {co.branch}" + \
        (f" ({behind} of the applied stack's replaced)" if behind else "")
    try:
        branch_commits(g, st.base or since or "", head)
    except WorkspaceError as merge:  # refresh would refuse it: say so, and what gets out of it
        st.state, st.detail = "diverged", (f"{new}, {merge.message}: {merge.hint}; or `dsadapt apply {ref} "
                                           "--force` (the branch is kept in a backup ref)")
    else:
        st.state, st.detail = "diverged", f"{new}; run `dsadapt refresh {ref}` to export them"
        st.next = f"dsadapt refresh {ref}"


def _kind_or_none(name: str):
    try:
        return kind_of(name)
    except WorkspaceError:
        return None


def _natural(tag: str) -> tuple:
    """v0.4.0 before v0.18.0 (numbers compare as numbers), without importing packaging."""
    import re

    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", tag) if p)


def status_all(cfg: Config, lock: Lock, status_of=None) -> list[CheckoutStatus]:
    """Status of every pin, plus every checkout on disk whose tag is not pinned: one that holds an
    op (a rebase killed before it pinned NEW) or a leftover (a rebase aborted, a pin removed),
    which a later `apply` or `rebase --onto` of that tag reuses as it is."""
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
        if str(co.ref) not in pinned:
            try:
                st = unpinned_status(cfg, co, running)
            except (StackError, WorkspaceError, VerificationError, GitError) as err:
                st = CheckoutStatus(str(co.ref), str(co.path), "broken", err.message, pinned=False)
            if st.op is None:
                st.detail += (f"; not pinned: a later `dsadapt rebase … --onto {co.ref.tag}` (or `apply`) reuses this "
                              f"checkout as it is; move it away to have it made again")
            out.append(st)
    ParseCache.in_workdir(cfg.workdir).save()
    return out

"""apply: put a stack onto its pinned checkout as commits (the apply op kind), and the commands
that move an op on at a stop: continue, skip, abort. Also the pin's tree as engines see it.

Everything goes through a `Transaction` (transaction.py); this module says what an apply is:
what it saves, what it refuses, how it finishes.
"""

from __future__ import annotations

from collections.abc import Callable

from patcher.base.config import Config
from patcher.base.dotgit import BACKUP_PREFIX, BASE_REF, STACK_REF
from patcher.base.errors import WorkspaceError
from patcher.base.gitutil import work_fingerprint
from patcher.engines.base import Tree
from patcher.formats.lock import Lock
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, load_stack, refuse_unsafe_links, touches_links
from patcher.stack.checkout import (
    Checkout,
    HeadState,
    Progress,
    branch_lag,
    check_preimages,
    ensure_checkout,
    head_state,
    in_progress,
    reflog_only,
    refuse_hand_made,
    stack_files,
    tree_links,
)
from patcher.stack.state import EDITED, Applied, Op, Orig, Outcome, PatchMeta, PatchOutcome
from patcher.stack.transaction import NoHooks, StackResult, Transaction, register

__all__ = ["ApplyKind", "abort_apply", "apply_stack", "checkout_tree", "continue_apply", "skip_patch"]


class ApplyKind(NoHooks):
    name = "apply"
    verb = "apply"
    touches_checkout = True

    def label(self, tx: Transaction, index: int, commit: str | None, merged: bool | None) -> tuple[Outcome, str | None]:
        if commit is None:
            return Outcome.SKIPPED, "no changes: the tree already has them"
        return (Outcome.MERGED if merged else Outcome.CLEAN), None

    def finish(self, tx: Transaction) -> StackResult:
        op, g = tx.op, tx.git
        head = g.head_commit()
        assert head
        tx.refuse_links_out_of_tree(head)
        edited = [op.outcomes[i].name for i in sorted(op.outcomes) if op.outcomes[i].outcome in EDITED]
        if op.snapshot:
            g.update_ref(STACK_REF, op.snapshot)
        res = tx.result(head, op.stack_hash)
        tx.close(Applied(op.stack_hash, head, edited, op.snapshot, op.extra.get("snapshot_tree")))
        return res

    def undo(self, tx: Transaction) -> None:
        return None

    def describe(self, co: Checkout, op: Op) -> tuple[str, str, str | None] | None:
        return None


register(ApplyKind())


def apply_stack(cfg: Config, lock: Lock, ref: PinRef, *, force: bool = False, progress: Progress | None = None,
                on_patch: Callable[[PatchOutcome], None] | None = None, stack: Stack | None = None) -> StackResult:
    """Apply the pin's stack onto its checkout (`stack`: already loaded by the caller, parsed once)."""
    entry = lock.pin(ref)
    if stack is None:
        stack = load_stack(cfg.patches_root, ref)  # parse everything before touching anything
    co, _created = ensure_checkout(cfg, lock, entry, progress)
    tx = Transaction.open(co, on_patch, progress)
    refuse_hand_made(co, tx.state.op is not None, force=force)  # another worktree's branch; a git op of the user's
    tx = tx.finish_interrupted(("apply", "refresh"))
    state, g = tx.state, co.git
    hs = head_state(co)
    base = hs.refs.get(BASE_REF) or co.base()
    co._base = base
    head_branch = hs.branch_head
    applied = state.applied
    dirty = g.dirty_files()
    if (not dirty and applied and not applied.needs_refresh and applied.stack_hash == stack.hash
            and head_branch == applied.head and hs.branch == co.branch):
        return StackResult(str(ref), str(co.path), state.source, base, head_branch, stack.hash, noop=True,
                           notes=tx.notes)
    if not force:
        _refuse_to_move(co, hs, applied, base, dirty)
    if (state.source or {}).get("kind") == "pypi":
        check_preimages(co, stack, base)
    if touches_links(stack.patches):  # the links the base holds count as well: chains, renames, retargets
        refuse_unsafe_links(stack, tree_links(g, base))
    op = _apply_op(co, stack, hs, base, dirty)
    tx.begin(op, [e.text for e in stack.entries], stack_files(stack))
    return tx.run()


def _refuse_to_move(co: Checkout, hs: HeadState, applied: Applied | None, base: str, dirty: list[str]) -> None:
    """(apply without --force) Refused while the checkout holds work patches/ does not: HEAD off
    the branch, uncommitted changes, resolutions not exported, or commits the branch gained or lost
    by hand since the stack was applied."""
    ref, g, head_branch = co.ref, co.git, hs.branch_head
    off = hs.problem(co)
    if off:
        raise WorkspaceError(f"{ref}: {off[0]} in {co.path}", hint=off[1])
    if dirty:
        raise WorkspaceError(f"{ref}: {co.path} has uncommitted changes ({', '.join(dirty[:3])}"
                             f"{'…' if len(dirty) > 3 else ''})",
                             hint="commit them and run `dsadapt refresh`, or pass --force (they are kept in a backup ref)")
    expected_head = applied.head if applied else base
    if applied and applied.needs_refresh and head_branch == applied.head:
        raise WorkspaceError(f"{ref}: {co.branch} holds conflict resolutions or skips not exported to the stack "
                             f"({', '.join(applied.needs_refresh)})",
                             hint=f"run `dsadapt refresh {ref}` to keep them, or pass --force (the branch is kept in a backup ref)")
    if not head_branch or head_branch == expected_head:
        return
    ahead, behind = branch_lag(g, expected_head, head_branch)
    again = f"`dsadapt apply {ref} --force` applies patches/ again (the branch is kept in a backup ref)"
    if ahead == 0 and behind:
        raise WorkspaceError(f"{ref}: branch {co.branch} was moved back by hand: it lacks {behind} commit(s) of "
                             "the applied stack",
                             hint=f"`dsadapt refresh {ref}` drops their patches from the stack (the files are kept "
                                  f"in a backup ref); {again}")
    if behind:
        raise WorkspaceError(f"{ref}: branch {co.branch} has {ahead} commit(s) not exported to the stack and lacks "
                             f"{behind} of the applied stack (rewritten or reset by hand)",
                             hint=f"`dsadapt refresh {ref}` exports the branch as it is (patches of the commits it "
                                  f"lacks are dropped; the files are kept in a backup ref); {again}")
    raise WorkspaceError(f"{ref}: branch {co.branch} has {ahead if ahead is not None else '?'} commit(s) not "
                         "exported to the stack",
                         hint=f"run `dsadapt refresh {ref}` to keep them, or pass --force (the branch is kept in a backup ref)")


def _apply_op(co: Checkout, stack: Stack, hs: HeadState, base: str, dirty: list[str]) -> Op:
    """The apply op, with a backup ref named for each kind of work it would move away: uncommitted
    work, the branch's commits, HEAD's own commits, commits only git's reflog holds."""
    g, refs, head_branch = co.git, hs.refs, hs.branch_head
    only_reflog = reflog_only(g)  # what the user left behind by hand: kept before anything moves
    want = [k for k, cond in (("work", bool(dirty)), ("branch", bool(head_branch and head_branch != base)),
                              ("head", bool(hs.only_head)), ("reflog", bool(only_reflog))) if cond]
    names = co.next_backup_names(len(want), {r for r in refs if r.startswith(BACKUP_PREFIX)})
    return Op(kind="apply", ref=str(co.ref), stack_hash=stack.hash,
              patches=[PatchMeta(e.name, e.patch.subject) for e in stack.entries],
              orig=Orig(hs.branch, hs.head, head_branch, refs.get(STACK_REF), bool(dirty),
                        work_fingerprint(g) if dirty else None), saves=dict(zip(want, names)),
              extra={"reflog": only_reflog} if only_reflog else {})


def _open_op(cfg: Config, ref: PinRef | None, on_patch, progress) -> Transaction:
    """The transaction of the op in progress, refused while another worktree holds the branch it
    moves (continue, skip and abort all may move it)."""
    tx = Transaction.open(in_progress(cfg, ref), on_patch, progress)
    if getattr(tx.kind, "touches_checkout", True):
        refuse_hand_made(tx.co, True, force=True)
    return tx


def continue_apply(cfg: Config, ref: PinRef | None = None, on_patch=None, progress=None) -> StackResult:
    return _open_op(cfg, ref, on_patch, progress).user_continue()


def skip_patch(cfg: Config, ref: PinRef | None = None, on_patch=None, progress=None) -> StackResult:
    return _open_op(cfg, ref, on_patch, progress).user_skip()


def abort_apply(cfg: Config, ref: PinRef | None = None, progress=None) -> Checkout:
    """Return the checkout exactly to where it was before the operation (branches, HEAD, work tree,
    uncommitted and untracked work). Notes about kept work are in `co.notes`."""
    tx = _open_op(cfg, ref, None, progress)
    co = tx.co
    kind = tx.op.kind
    tx.abort()
    co.notes = tx.notes
    co.kind = kind  # type: ignore[attr-defined]
    return co


def checkout_tree(cfg: Config, lock: Lock, ref: PinRef, *, patched: bool = True,
                  progress: Progress | None = None) -> Tree:
    """The pin's tree as engines see it (`engines.base.Tree`): the checkout of `ref` with its stack
    applied (a no-op when it already is), or, with `patched` false, the checkout's verified
    upstream base (the checkout is left as it is)."""
    if patched:
        apply_stack(cfg, lock, ref, progress=progress)
        co = Checkout(cfg, ref)
        head = co.git.rev(co.branch_ref)
        assert head, f"{ref}: the applied branch {co.branch} is missing"
        return Tree(ref, co.path, head, True)
    co, _ = ensure_checkout(cfg, lock, lock.pin(ref), progress)
    return Tree(ref, co.path, co.base(), False)

"""The one place a stack's checkout changes: a crash-consistent transaction over `git am -3`.

Modelled on StGit's StackTransaction and on git's own sequencer: before any step that could
lose something, the transaction durably records (in ``.git/dsadapt/state.json``: temporary
file, fsync, rename, fsync of the directory) what it is about to do, and saves what the step
could destroy -- uncommitted and untracked work as a stash-shaped commit under
``refs/dsadapt/backup/<n>``, the branch head, the patches/ files it replaces. Every step is
idempotent. When a run dies at any point, the next `continue`, `skip`, `abort` (or a rerun)
reads the record and what git shows (HEAD, the ``rebase-apply`` directory, the commits since
the run started) and either finishes or rolls back: the same decision whatever instant the
process died at.

What differs between kinds of operation (apply, rebase, refresh) plugs in as an `OpKind`
registered by name; the transaction itself knows nothing about rebase.

Phases of an op (`state.Phase`, each one recorded before its step runs)::

    SAVE      backups being made; the work tree is untouched        (abort: drop the backups)
    RESET     work tree being reset to the base (its work is saved)
    REPLAY    one `git am -3` is applying the remaining patches
    STOPPED   am stopped on a real conflict: the user resolves       (continue | skip | abort)
    CONTINUE  `git am --continue` is committing the user's resolution
    SKIP      `git am --skip` is dropping the stopped patch
    FINISH    the kind writes its results (state, patches/, report)
    ABORT     going back to the recorded starting point

Every backup ref the op makes is recorded with its commit (`Op.saved`), so one deleted by hand
during the op is made again before anything reads it (`Checkout.repair`, at `open`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from patcher.base.dotgit import OP_PREFIX, REFS, STACK_REF
from patcher.base.errors import ConflictStop, PatchFormatError, WorkspaceError, plural
from patcher.base.fsutil import atomic_write_text, remove_tree
from patcher.base.gitutil import (
    WorkSnapshot,
    clear_stale_locks,
    keeping_commit,
    signal_words,
    snapshot_commit,
    work_fingerprint,
    work_snapshot,
)
from patcher.stack.checkout import Checkout, Progress, changed_links, tree_links
from patcher.stack.record import files_commit, flat_tree_id
from patcher.stack.state import SCHEMA, WAITING, AmRun, Applied, Op, Outcome, PatchOutcome, Phase, State

MBOX_FROM = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
FIXED_MAIL_DATE = "Tue, 14 Nov 2023 22:13:20 -0000"  # RFC 2822 form of gitutil.FIXED_DATE (email.utils.formatdate)


# ---------------------------------------------------------------- op kinds (registration)


class OpKind(Protocol):
    """What differs between kinds of stack operation. Methods run inside a Transaction."""

    name: str
    verb: str   # "apply" / "rebase": in messages ("undo the whole rebase")

    def prepare(self, tx: Transaction) -> None:
        """Idempotent steps before the checkout is touched (rebase: pin NEW, comparison refs)."""

    def pre_outcomes(self, tx: Transaction) -> dict[int, tuple[Outcome, str]]:
        """Patches decided without running them: {index: (outcome, detail)}."""

    def on_stop(self, tx: Transaction, index: int) -> str | None:
        """A patch stopped `git am`: a reason to drop it instead of stopping (rebase: already upstream)."""

    def label(self, tx: Transaction, index: int, commit: str | None, merged: bool | None) -> tuple[Outcome, str | None]:
        """(outcome, detail) of a patch am applied (commit) or found empty (None)."""

    def finish(self, tx: Transaction) -> StackResult:
        """Write the op's results and close it (tx.close)."""

    def undo(self, tx: Transaction) -> None:
        """Idempotently undo what prepare/finish did outside the checkout's branch and work tree."""

    def describe(self, co: Checkout, op: Op) -> tuple[str, str, str | None] | None:
        """(state, detail, next command) of an interrupted op of this kind, where the kind has its own
        words for it (refresh: patches/ half written); None: the transaction's words for its phase."""


class NoHooks:
    """The hooks an op kind without extra steps leaves empty (apply, refresh): nothing to prepare,
    no patch decided beforehand, a stop is a stop."""

    def prepare(self, tx: Transaction) -> None:
        return None

    def pre_outcomes(self, tx: Transaction) -> dict[int, tuple[Outcome, str]]:
        return {}

    def on_stop(self, tx: Transaction, index: int) -> str | None:
        return None


KINDS: dict[str, OpKind] = {}
OPS_GROUP = "dsadapt.ops"


def register(kind: OpKind) -> OpKind:
    KINDS[kind.name] = kind
    return kind


#: dsadapt's own op kinds (name -> module), the same table as its pyproject's `dsadapt.ops` entry
#: points (tests/project/test_architecture.py keeps the two equal): asking for one of them reads no
#: distribution's metadata, and a stale installed metadata cannot hide one.
OWN: dict[str, str] = {
    "apply": "patcher.stack.apply",
    "refresh": "patcher.stack.refresh",
    "rebase": "patcher.stack.rebase.carry",
}


def _declared_kinds() -> dict[str, str]:
    """Op kinds by name -> module: dsadapt's own (`OWN`), then other packages' `dsadapt.ops`
    entry points (one of dsadapt's own names cannot be replaced by a plugin)."""
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group=OPS_GROUP)}
    return {**found, **OWN}


def kind_of(name: str) -> OpKind:
    if name not in KINDS:  # kinds register themselves when their module is imported (entry points)
        import importlib

        module = OWN.get(name) or _declared_kinds().get(name)
        if module:
            importlib.import_module(module.partition(":")[0].strip())
    if name not in KINDS:
        raise WorkspaceError(f"unknown operation kind {name!r} in the checkout's state",
                             hint="it was started by another dsadapt version; `dsadapt abort` undoes it")
    return KINDS[name]


# ---------------------------------------------------------------- results


@dataclass
class StackResult:
    ref: str
    checkout: str
    source: dict | None
    base: str
    head: str | None
    stack_hash: str
    outcomes: list[PatchOutcome] = field(default_factory=list)
    noop: bool = False
    backup_ref: str | None = None
    backups: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- helpers


def with_fixed_date(text: str) -> str:
    """The patch with a fixed Date header: `git am` takes the author date from the mail and
    ignores GIT_AUTHOR_DATE, so without it the same stack gives new commit ids on every run."""
    first, sep, rest = text.partition("\n")
    if first.startswith("From ") and not first.startswith("From:"):
        text = rest  # a patch as `git format-patch` wrote it: the mbox separator is ours to write
    head, sep, body = text.partition("\n\n")
    kept = [l for l in head.split("\n") if not l.lower().startswith("date:")]  # one Date: ours
    return f"Date: {FIXED_MAIL_DATE}\n" + "\n".join(kept) + sep + body


def mbox(texts: list[str]) -> str:
    return "".join(MBOX_FROM + with_fixed_date(t) + ("" if t.endswith("\n") else "\n") for t in texts)


def split_mbox(text: str) -> list[str]:
    parts = text.split(MBOX_FROM)
    return [p.split("\n", 1)[1] if p.startswith("Date: ") else p for p in parts[1:]]


_BRACKET = re.compile(r"^\s*(\[[^\]]*\]|re:)\s*", re.IGNORECASE)


def norm_subject(s: str) -> str:
    """A subject as `git am` turns it into a commit subject (mailinfo strips [..] and Re: prefixes)."""
    s = " ".join(s.split())
    while True:
        m = _BRACKET.match(s)
        if not m or not m.group(0):
            return s.strip().lower()
        s = s[m.end():]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _am_blocks(stdout: str) -> list[str]:
    """`git am` output split per patch it looked at ("Applying: ..." starts each)."""
    blocks, cur = [], None
    for line in stdout.splitlines():
        if line.startswith("Applying: "):
            if cur is not None:
                blocks.append(cur)
            cur = line + "\n"
        elif cur is not None:
            cur += line + "\n"
    if cur is not None:
        blocks.append(cur)
    return blocks


# ---------------------------------------------------------------- the transaction


def conflict_kinds(ls_files_u: str) -> dict[str, str]:
    """Pure: each unmerged path of `git ls-files -u -z` and its conflict, in git's words (`git am
    -3`: "ours" is the upstream tree at HEAD, "theirs" the patch): content, add/add, modify/delete."""
    stages: dict[str, set[int]] = {}
    for rec in ls_files_u.split("\0"):
        if "\t" not in rec:
            continue
        meta, path = rec.split("\t", 1)
        parts = meta.split()
        if len(parts) == 3 and parts[2].isdigit():
            stages.setdefault(path, set()).add(int(parts[2]))
    words = {frozenset({1, 2, 3}): "content", frozenset({2, 3}): "add/add",
             frozenset({1, 2}): "modify/delete: the patch deletes it, upstream changed it",
             frozenset({1, 3}): "modify/delete: upstream deleted it, the patch changes it",
             frozenset({2}): "added upstream", frozenset({3}): "added by the patch"}
    return {p: words.get(frozenset(st), "conflict") for p, st in stages.items()}


class Transaction:
    """An op on one checkout: begin, run, stop, continue, skip, abort, recover."""

    def __init__(self, co: Checkout, state: State, on_patch: Callable[[PatchOutcome], None] | None = None,
                 progress: Progress | None = None):
        self.co = co
        self.git = co.git
        self.state = state
        self.on_patch = on_patch
        self.progress = progress
        self.notes: list[str] = []
        self._reported: set[int] = set()
        self._fresh = False  # begun in this process: nothing to recover, no existence checks needed
        self.cache: dict = {}  # what a kind computes once per run (rebase: the exported commits)

    # ------------------------------------------------------------ opening

    @classmethod
    def open(cls, co: Checkout, on_patch=None, progress=None) -> Transaction:
        """Load the checkout's state after making sure no git process still works in it and
        removing the lock files a killed git left behind."""
        tx = cls(co, co.load(), on_patch, progress)
        tx.clear_stale_locks()
        co.repair(tx.state)  # a record rebuilt from git written, refs deleted or damaged by hand made again
        tx.notes += co.notes
        co.notes = []
        for n in tx.notes:
            if progress:
                progress(n)
        return tx

    @property
    def op(self) -> Op:
        assert self.state.op is not None
        return self.state.op

    @property
    def kind(self) -> OpKind:
        return kind_of(self.op.kind)

    def clear_stale_locks(self) -> list[str]:
        """Remove git lock files whose holder is gone; wait for (then refuse) a live git process."""
        try:
            gone = clear_stale_locks(self.co.path, busy_check=self.co.am_in_progress())
        except WorkspaceError as e:
            raise WorkspaceError(f"{self.co.ref}: {e.message}", hint=e.hint) from None
        removed = [str(lf.relative_to(self.co.path)) for lf in gone]
        if removed:
            self.notes.append(f"removed stale {', '.join(removed)} (its git process is gone)")
            if self.progress:
                self.progress(self.notes[-1])
        return removed

    def write(self) -> None:
        self.co.save(self.state)

    def set_phase(self, phase: Phase) -> None:
        self.op.phase = phase
        self.write()

    # ------------------------------------------------------------ begin

    def begin(self, op: Op, texts: list[str], stack_files: dict[str, bytes] | None = None) -> None:
        """Record the op (nothing in the checkout has changed yet)."""
        if self.state.op is not None:
            raise WorkspaceError(f"{self.co.ref}: an operation is already in progress",
                                 hint=f"finish it with `dsadapt continue {self.co.ref}` or `dsadapt abort {self.co.ref}`")
        op.started = time.time()
        remove_tree(self.co.op_dir)
        self.co.op_dir.mkdir(parents=True, exist_ok=True)
        if texts:
            atomic_write_text(self.co.op_dir / "all.mbox", mbox(texts))
        if stack_files is not None:
            op.snapshot = self.files_commit(stack_files)
            op.extra["snapshot_tree"] = flat_tree_id(stack_files)
        self.state.op = op
        self.write()
        self._fresh = True

    def files_commit(self, files: dict[str, bytes]) -> str:
        """A parentless commit whose flat tree holds `files`, written as loose objects without
        starting git; fixed identity, date and message, so the same files give the same commit."""
        return files_commit(self.git, files)

    def read_files(self, commit: str | None) -> dict[str, bytes]:
        """The flat files of a `files_commit`."""
        if not commit:
            return {}
        names = [l.split("\t", 1)[1] for l in self.git.run("ls-tree", commit).out.splitlines() if "\t" in l]
        got = self.git.cat_blobs([f"{commit}:{n}" for n in names])
        return {n: got[f"{commit}:{n}"] or b"" for n in names}

    def texts(self) -> list[str]:
        return split_mbox((self.co.op_dir / "all.mbox").read_text(encoding="utf-8"))

    # ------------------------------------------------------------ running an op to its end or a stop

    def refuse(self) -> None:
        """Raise: an op is in progress that the command at hand does not finish (what it is, what does)."""
        co = self.co
        state, detail, _nxt = describe_op(co, self.op)
        what = "stopped on a conflict" if state == "stopped" else state
        article = "an" if self.op.kind[:1] in "aeiou" else "a"
        raise WorkspaceError(f"{co.ref}: {article} {self.op.kind} is in progress in {co.path} ({what})", hint=detail)

    def finish_interrupted(self, kinds: tuple[str, ...]) -> Transaction:
        """Roll an interrupted op of one of `kinds` forward (a rerun of the command that died) and
        return the transaction to go on with; refuse anything else in progress."""
        if self.state.op is None:
            return self
        op = self.op
        if op.kind in kinds and op.phase not in WAITING:
            if self.progress:
                self.progress(f"finishing the interrupted {op.kind} first")
            self.run()
            tx = Transaction.open(self.co, self.on_patch, self.progress)
            tx.notes = self.notes
            return tx
        self.refuse()
        return self  # pragma: no cover

    def _refuse_legacy(self) -> None:
        if self.op.phase == Phase.LEGACY:
            raise WorkspaceError(f"{self.co.ref}: an apply recorded by an older dsadapt is in progress in {self.co.path}",
                                 hint=f"run `dsadapt abort {self.co.ref}`, then apply again")

    def run(self) -> StackResult:
        """Drive the op from whatever phase it is in (also after a kill) to its end, or raise ConflictStop."""
        op = self.op
        self._refuse_legacy()
        if op.phase == Phase.ABORT:
            raise WorkspaceError(f"{self.co.ref}: an abort was interrupted",
                                 hint=f"run `dsadapt abort {self.co.ref}` to finish it")
        if op.phase == Phase.SAVE:
            self._prepare_and_save()
        if op.phase == Phase.RESET:
            self._reset()
        if op.phase == Phase.STOPPED:
            self._adopt_stop()
        if op.phase == Phase.STOPPED:
            at = self._settle()
            self.report_new()
            if at is not None and at == op.stopped and self.co.am_in_progress():
                raise self._conflict(at)
            op.phase = Phase.REPLAY
        if op.phase in (Phase.REPLAY, Phase.CONTINUE, Phase.SKIP):
            self._replay()
        return self.kind.finish(self)  # recorded outcomes + git say it is done; finish is idempotent

    def _prepare_and_save(self) -> None:
        op = self.op
        self.kind.prepare(self)
        g = self.git
        existing = {} if self._fresh else dict(g.refs(REFS))

        def keep(ref: str | None, make: Callable[[], str], why: str) -> None:
            if not ref:
                return
            if ref in existing:  # made by the run that died here
                op.saved[ref] = existing[ref]
                return
            commit = make()
            g.update_ref(ref, commit, why=why)
            op.saved[ref] = commit

        keep(op.saves.get("work"), lambda: snapshot_commit(g, work_snapshot(g), f"dsadapt: uncommitted work before "
                                                                                 f"{op.kind} {op.ref}"),
             f"uncommitted work before {op.kind}")
        if op.orig.branch_head:
            keep(op.saves.get("branch"), lambda: op.orig.branch_head or "", f"{self.co.branch} before {op.kind}")
        if op.orig.head:  # a detached HEAD's own commits, which nothing else reaches
            keep(op.saves.get("head"), lambda: op.orig.head or "", f"detached HEAD before {op.kind}")
        if op.extra.get("reflog"):  # the user's commits only git's reflog still reaches
            keep(op.saves.get("reflog"), lambda: keeping_commit(g, op.extra["reflog"], "dsadapt: commits only the "
                                                                                          "reflog held"),
                 f"commits only the reflog held before {op.kind}")
        self.set_phase(Phase.RESET)

    def _reset(self) -> None:
        """Put the branch and the work tree on the base (what it holds is saved, see _prepare_and_save)."""
        op, g = self.op, self.git
        base = self.co.base()
        if self.co.am_in_progress():
            remove_tree(self.co.am_dir)
        if self.co.layout.rebase_merge.is_dir():  # a rebase of the user's (apply --force saved it)
            g.run("rebase", "--quit", check=False)
        if op.orig.dirty or (not self._fresh and g.is_dirty()):
            g.run("reset", "-q", "--hard")  # (also ends a merge, cherry-pick or revert of the user's)
            g.run("clean", "-fdq")
        if (self.co.layout.git_dir / "BISECT_LOG").exists():
            g.run("bisect", "reset", check=False)
        g.run("checkout", "-q", "-f", "-B", self.co.branch, base)
        self._new_am(base)

    def _new_am(self, start: str) -> None:
        """Record a new am sequence over the patches without an outcome (phase replay)."""
        op = self.op
        for i, (outcome, detail) in sorted(self.kind.pre_outcomes(self).items()):
            if i not in op.outcomes:
                self._decide(i, outcome, None, detail)
        indices = [i for i in range(1, op.total + 1) if i not in op.outcomes]
        name = "all.mbox"
        if len(indices) != op.total:
            texts = self.texts()
            name = f"am-{indices[0] if indices else 0}-{len(indices)}.mbox"
            atomic_write_text(self.co.op_dir / name, mbox([texts[i - 1] for i in indices]))
        op.am = AmRun(start=start, indices=indices, mbox=name)
        op.stopped = None
        op.phase = Phase.REPLAY
        self.write()

    # ------------------------------------------------------------ am and what it left

    def _run_am(self, *args: str) -> tuple[int, str]:
        r = self.git.run("am", *args, check=False, fixed_dates=True)
        return r.rc, r.out + r.err

    def _am_pos(self) -> int | None:
        if not self.co.am_in_progress():
            return None
        cur, last = _read_int(self.co.am_dir / "next"), _read_int(self.co.am_dir / "last")
        return cur if (cur is not None and last is not None) else None

    def _observe(self, ran: bool = False) -> tuple[dict[int, str], int, list, list]:
        """What git shows of the current am sequence: ({index: commit} made since it started, am's
        position (1-based) or None, commits nobody accounts for, commits the user made at a stop)."""
        op = self.op
        am = op.am
        assert am is not None
        head = self.git.head_commit()
        commits = self.git.commits(f"{am.start}..HEAD") if head and head != am.start else []
        at_stop: list = []
        if op.phase in (Phase.STOPPED, Phase.ABORT) and op.stopped and not am.resolution and am.head_at_stop \
                and head != am.head_at_stop:
            ids = [c[0] for c in commits]
            cut = ids.index(am.head_at_stop) + 1 if am.head_at_stop in ids else (0 if am.head_at_stop == am.start else None)
            if cut is not None:
                commits, at_stop = commits[:cut], commits[cut:]
        cur = self._am_pos()
        if cur is not None:
            processed = cur - 1
        elif (ran and not self.co.am_in_progress()) or commits:
            processed = len(am.indices)  # am ran to its end (its state is gone, or going)
        else:
            processed = 0  # nothing ran, or all were empty: running them again gives the same
        applied: dict[int, str] = {}
        ids = [c[0] for c in commits]
        ci = 0
        for pos, idx in enumerate(am.indices, 1):
            o = op.outcomes.get(idx)
            if o is not None:
                if o.commit and o.commit in ids[ci:]:
                    ci = ids.index(o.commit, ci) + 1
                continue
            if idx == op.stopped and am.resolution and am.resolution in ids[ci:]:
                ci = ids.index(am.resolution, ci) + 1
                applied[idx] = am.resolution
                continue
            if ci < len(commits) and norm_subject(commits[ci][1]) == norm_subject(op.meta(idx).subject):
                applied[idx] = commits[ci][0]
                ci += 1
                continue
            if pos <= processed:
                continue  # am went past it without a commit: empty
            break
        return applied, processed, commits[ci:], at_stop

    def _settle(self, blocks: list[str] | None = None, first_pos: int = 1) -> int | None:
        """Turn what the current am sequence did into outcomes. Returns the stack index of the first
        patch still without one (am stands on it, or nothing runs it), or None when all have one."""
        op = self.op
        am = op.am
        assert am is not None
        applied, done_upto, foreign, _ = self._observe(blocks is not None)
        if foreign:
            ref = self._keep_foreign(foreign)
            raise WorkspaceError(
                f"{self.co.ref}: {len(foreign)} commit(s) on {self.co.branch} are not from the stack "
                f"(made during the {self.kind.verb}); kept as {ref}",
                hint=f"`dsadapt abort {self.co.ref}` goes back to where the {self.kind.verb} started "
                     f"(those commits stay in {ref})")
        flags: dict[int, str] = {}
        if blocks is not None:
            for k, b in enumerate(blocks):
                if 1 <= first_pos + k <= len(am.indices):
                    flags[am.indices[first_pos + k - 1]] = b
        for pos, idx in enumerate(am.indices, 1):
            if idx in op.outcomes:
                continue
            if idx in applied:
                merged = ("Falling back to patching base and 3-way merge" in flags[idx]) if idx in flags else None
                self._label(idx, applied[idx], merged)
            elif pos <= done_upto:
                self._label(idx, None, None)
            else:
                break
        pending = [i for i in am.indices if i not in op.outcomes]
        if not pending:
            if self.co.am_in_progress():
                remove_tree(self.co.am_dir)  # am was killed after its last patch, before cleaning up
            return None
        return pending[0]

    def _label(self, idx: int, commit: str | None, merged: bool | None) -> None:
        op = self.op
        detail: str | None
        if idx == op.stopped:
            outcome, detail = (Outcome.CHANGED, "conflict resolved by the user (dsadapt continue)") if commit else \
                (Outcome.SKIPPED, "conflict; dropped by the user (dsadapt skip)")
        else:
            outcome, detail = self.kind.label(self, idx, commit, merged)
        self._decide(idx, outcome, commit, detail)

    def _decide(self, idx: int, outcome: Outcome, commit: str | None, detail: str | None = None) -> None:
        m = self.op.meta(idx)
        self.op.outcomes[idx] = PatchOutcome(idx, m.name, m.subject, outcome, commit)
        if detail is not None:
            self.op.extra.setdefault("details", {})[str(idx)] = detail

    def report_new(self, all_of_them: bool = False) -> None:
        """Tell on_patch about new outcomes, in stack order (a later patch decided early waits)."""
        for idx in range(1, self.op.total + 1):
            o = self.op.outcomes.get(idx)
            if o is None:
                if all_of_them:
                    continue
                return
            if idx not in self._reported:
                self._reported.add(idx)
                if self.on_patch:
                    self.on_patch(o)

    def _keep_foreign(self, foreign) -> str:
        op = self.op
        ref = op.saves.get("foreign")
        if not ref:
            ref = self.co.next_backup_names(1)[0]
            op.saves["foreign"] = ref
            self.write()
        commit = self.git.head_commit() or foreign[-1][0]
        self.git.update_ref(ref, commit, why="commits made during an op")
        op.saved[ref] = commit
        return ref

    def _junk_paths(self, idx: int) -> set[str]:
        from patcher.formats.patchfile import parse_patch

        try:
            return set(parse_patch(self.texts()[idx - 1]).touched_paths)
        except Exception:  # an unparsable patch cannot have written anything we could tell apart
            return set()

    @staticmethod
    def _within(dirty: list[str], paths: set[str]) -> bool:
        return all(d.rstrip("/") in paths or any(p.startswith(d) for p in paths if d.endswith("/")) for d in dirty)

    def _clear_killed_am(self, *indices: int) -> None:
        """am died while applying one of these patches: its half-applied change is junk; anything
        else in the work tree is the user's and is saved first."""
        g = self.git
        dirty = g.dirty_files()
        junk: set[str] = set()
        for idx in indices:
            junk |= self._junk_paths(idx)
        if dirty and not self._within(dirty, junk):
            self._save_work("work tree of an interrupted run")
        if dirty:
            g.run("reset", "-q", "--hard")
            if junk:
                g.run("clean", "-fdq", "--", *sorted(junk))
        remove_tree(self.co.am_dir)

    def _save_work(self, why: str, snap: WorkSnapshot | None = None) -> str:
        """Save the work tree as a backup ref (stash-shaped); returns the ref."""
        g = self.git
        snap = snap or work_snapshot(g)
        ref = self.co.next_backup_names(1)[0]
        commit = snapshot_commit(g, snap, f"dsadapt: {why} ({self.op.kind} {self.op.ref})")
        g.update_ref(ref, commit, why=why)
        self.op.saved[ref] = commit
        kept = [r for r in (self.op.saves.get("kept") or "").split(",") if r]
        self.op.saves["kept"] = ",".join([*kept, ref])
        self.write()
        self.notes.append(f"kept the work tree's changes ({why}) as {ref} "
                          f"(`git -C {self.co.path} stash apply {ref}` brings them back)")
        return ref

    def _replay(self) -> None:
        """Run or resume the am sequence until every patch has an outcome or a real stop."""
        op = self.op
        while True:
            am = op.am
            assert am is not None
            if op.phase in (Phase.CONTINUE, Phase.SKIP):
                pos = self._am_pos()
                if (pos is not None and am.indices[pos - 1] == op.stopped and op.stopped not in op.outcomes
                        and self.git.head_commit() == (am.resolution or am.head_at_stop)):
                    # the interrupted `continue` / `skip` had not got past the stopped patch: do it again
                    if op.phase == Phase.CONTINUE and not am.resolution:
                        rc, out = self._run_am("--continue")
                        done = self._after_am(rc, out, pos) is None
                    else:
                        rc, out = self._run_am("--skip")
                        done = self._after_am(rc, out, pos + 1) is None
                    if done:
                        return
                    continue
                op.phase = Phase.REPLAY
            at = self._settle()
            self.report_new()
            if at is None:
                op.stopped = None
                op.phase = Phase.REPLAY
                self.write()
                return
            if self.co.am_in_progress():  # am died (or was left behind) before `at` got an outcome
                pos = self._am_pos()
                stands = am.indices[pos - 1] if pos is not None and 1 <= pos <= len(am.indices) else at
                self._clear_killed_am(at, stands)
            head = self.git.head_commit()
            assert head
            fresh = head == am.start and not any(i in op.outcomes for i in am.indices)
            if not fresh:
                self._new_am(head)
                am = op.am
                assert am is not None
            elif op.phase != Phase.REPLAY or op.stopped:
                op.stopped = None
                self.set_phase(Phase.REPLAY)
            rc, out = self._run_am("-3", "--no-signoff", str(self.co.op_dir / am.mbox))
            if self._after_am(rc, out, 1) is None:
                return

    def _after_am(self, rc: int, out: str, first_pos: int) -> int | None:
        """An am invocation of ours returned: record outcomes; on a stop, ask the kind, then stop."""
        op = self.op
        at = self._settle(_am_blocks(out), first_pos)
        self.report_new()
        if rc < 0 and at is not None:  # a signal stopped am (a file-size limit, the OOM killer): no stop of
            op.phase = Phase.REPLAY        # a patch, whatever its state looks like; it said nothing
            self.write()
            what, fix = signal_words(rc)
            raise WorkspaceError(f"{self.co.ref}: git am was {what}",
                                 hint=f"{fix}: `dsadapt continue {self.co.ref}` finishes the {self.kind.verb} "
                                      f"(or `dsadapt abort {self.co.ref}` undoes it)")
        while at is not None and self.co.am_in_progress() and self._am_pos() is not None:
            am = op.am
            assert am is not None
            pos = self._am_pos()
            assert pos is not None
            if am.indices[pos - 1] != at:
                return at  # am's count lags behind the commits: the caller starts afresh
            detail = self.kind.on_stop(self, at)
            if detail is None:  # a real conflict: the user resolves it
                op.stopped = at
                am.head_at_stop = self.git.head_commit()
                am.resolution = None
                am.stop_print = work_fingerprint(self.git)
                op.phase = Phase.STOPPED
                self.write()
                raise self._conflict(at)
            self._decide(at, Outcome.UPSTREAM, None, detail)
            op.phase = Phase.REPLAY
            self.write()
            self.report_new()
            rc, out = self._run_am("--skip")
            at = self._settle(_am_blocks(out), pos + 1)
            self.report_new()
        if at is not None and not self.co.am_in_progress() and rc != 0 and not out.count("Applying: "):
            msg = [l for l in out.splitlines() if l.strip()]
            op.phase = Phase.REPLAY
            self.write()
            raise WorkspaceError(f"{self.co.ref}: git am did not run: {msg[-1] if msg else rc}",
                                 hint=f"fix what git says, then `dsadapt continue {self.co.ref}` "
                                      f"(or `dsadapt abort {self.co.ref}`)")
        if at is None:
            op.stopped = None
            op.phase = Phase.REPLAY
            self.write()
        return at

    def _conflict(self, idx: int) -> ConflictStop:
        op, ref = self.op, self.co.ref
        files = self._conflicted_files()
        kinds = conflict_kinds(self.git.run("ls-files", "-u", "-z", check=False).out)
        verb = self.kind.verb
        head = f"{op.extra.get('stop_prefix', '')}patch {idx}/{op.total} {op.meta(idx).name} does not apply"
        named = [f"{f} ({kinds[f]})" if f in kinds else f for f in files]
        return ConflictStop(
            f"{ref}: {head}; conflicts in: {', '.join(named) or '(see git status)'}",
            hint=f"resolve in {self.co.path}, `git add` the files, then `dsadapt continue {ref}`; "
                 f"or `dsadapt skip {ref}` to drop this patch, `dsadapt abort {ref}` to undo the whole {verb}")

    def _conflicted_files(self) -> list[str]:
        out = self.git.run("diff", "--name-only", "--diff-filter=U", check=False).out
        files = [l for l in out.splitlines() if l]
        if not files and self.op.stopped:
            files = sorted(self._junk_paths(self.op.stopped))
        return files

    # ------------------------------------------------------------ git by hand at a stop

    def _adopt_stop(self) -> None:
        """What the user did with git at the stop, read before anything acts on it: their own
        `git am --continue` / `--skip` is taken as if dsadapt had run it (and a new stop it ran into
        becomes the op's stop); an am aborted, quit or rewound by hand is refused with the command
        that reconciles it. Nothing changes while am still stands on the stopped patch."""
        op = self.op
        am = op.am
        if op.phase != Phase.STOPPED or am is None or not op.stopped:
            return
        seen = stop_seen(self.co, op)
        if seen.how == "same":
            return
        if seen.how in ("rewound", "ended"):
            raise WorkspaceError(f"{self.co.ref}: {seen.words(self.co, op)}",
                                 hint=f"run `dsadapt abort {self.co.ref}` to go back to where the {self.kind.verb} "
                                      f"started (what you made meanwhile is kept in a backup ref), then "
                                      f"`dsadapt {self.kind.verb}` again")
        later = [norm_subject(op.meta(i).subject) for i in am.indices[am.indices.index(op.stopped):]]
        if seen.after and not am.resolution and norm_subject(seen.after[0][1]) not in later:
            am.resolution = seen.after[0][0]  # the user's own commit for the stopped patch (any subject)
        op.phase = Phase.REPLAY
        self.write()
        at = self._settle()
        self.report_new()
        if at is not None and seen.how == "moved" and seen.at == at and self.co.am_in_progress():
            op.stopped = at  # the user's `git am --continue` stopped on this one: it is the op's stop now
            am.head_at_stop = self.git.head_commit()
            am.stop_print = None  # not seen by dsadapt: whatever is dirty is kept before skip or abort
            am.resolution = None
            op.phase = Phase.STOPPED
            self.write()
            self.notes.append(f"took what you did with git am in {self.co.path} (stopped on {op.meta(at).name})")
        else:
            self.notes.append(f"took what you did with git am in {self.co.path}")

    # ------------------------------------------------------------ user commands at a stop

    def _at_stop(self) -> bool:
        """True while am still stands on the stopped patch (nothing committed it yet)."""
        op = self.op
        if op.phase != Phase.STOPPED or op.am is None or not op.stopped:
            return False
        pos = self._am_pos()
        return pos is not None and op.am.indices[pos - 1] == op.stopped and op.stopped not in op.outcomes

    def _stop_of_user(self) -> tuple[AmRun, int] | None:
        """(continue, skip) The stop git am still stands on, with its position; None when there is
        none (what the user did at the stop by hand is adopted first)."""
        self._refuse_legacy()
        self._adopt_stop()
        if not self._at_stop():
            return None
        pos = self._am_pos()
        assert self.op.am is not None and pos is not None
        return self.op.am, pos

    def user_continue(self) -> StackResult:
        op = self.op
        stop = self._stop_of_user()
        if stop is not None:
            am, pos = stop
            head = self.git.head_commit()
            if head != am.head_at_stop:
                # the user committed the resolution by hand: that commit is the patch's new form
                self._save_beyond_stop()
                am.resolution = head
                op.phase = Phase.SKIP
                self.write()
                rc, out = self._run_am("--skip")
                self._after_am(rc, out, pos + 1)
                return self.run()
            unresolved = self.git.run("diff", "--name-only", "--diff-filter=U", check=False).out.split()
            if unresolved:
                raise ConflictStop(f"{self.co.ref}: still unresolved: {', '.join(unresolved)}",
                                   hint=f"edit them, `git add` them in {self.co.path}, then `dsadapt continue {self.co.ref}`")
            self.set_phase(Phase.CONTINUE)
            rc, out = self._run_am("--continue")
            if rc != 0 and self._am_pos() == pos and self.git.head_commit() == am.head_at_stop:
                self.set_phase(Phase.STOPPED)
                msg = [l for l in out.strip().splitlines() if l.strip() and not l.startswith("hint:")]
                raise ConflictStop(f"{self.co.ref}: git am --continue: {msg[0] if msg else rc}",
                                   hint=f"`git add` the resolved files in {self.co.path}, or `dsadapt skip {self.co.ref}` "
                                        "if the patch is now empty")
            self._after_am(rc, out, pos)
        return self.run()

    def _save_beyond_stop(self) -> None:
        """Before anything resets the work tree at a stop: keep what the user changed since it."""
        am = self.op.am
        if am is None or not self.git.is_dirty():
            return
        if am.stop_print is not None and work_fingerprint(self.git) == am.stop_print \
                and self.git.head_commit() == am.head_at_stop:
            return  # exactly what am left: its own conflict, nothing of the user's
        self._save_work("your changes while the patch was stopped")

    def user_skip(self) -> StackResult:
        stop = self._stop_of_user()
        if stop is not None:
            pos = stop[1]
            self._save_beyond_stop()
            self.set_phase(Phase.SKIP)
            rc, out = self._run_am("--skip")
            self._after_am(rc, out, pos + 1)
            return self.run()
        if self.op.phase == Phase.SKIP:
            return self.run()
        raise WorkspaceError(f"{self.co.ref}: not stopped on a patch", hint=f"run `dsadapt continue {self.co.ref}`")

    # ------------------------------------------------------------ closing

    def close(self, applied: Applied | None, keep_stack: bool = True) -> None:
        """End the op: record `applied`, drop the op (one durable write), then clean up."""
        op = self.op
        if applied is not None:
            self.state.applied = applied
        self.state.op = None
        self.write()
        self._cleanup(op)

    def _cleanup(self, op: Op) -> None:
        if op.schema < SCHEMA or op.extra.get("op_refs"):
            for r, _ in self.git.refs(OP_PREFIX):
                self.git.delete_ref(r)
        if self.co.am_in_progress() and op.kind != "refresh":
            remove_tree(self.co.am_dir)
        remove_tree(self.co.op_dir)

    def refuse_links_out_of_tree(self, head: str) -> None:
        """The final tree, as git made it: when the stack left a symbolic link leading outside the tree
        (which the check of the patches before the op should have refused), undo the whole op and
        refuse. Costs one `diff-tree` when no link changed."""
        from patcher.formats.stackfiles import tree_link_problems

        base = self.co.base()
        if not changed_links(self.git, base, head):
            return
        problems = tree_link_problems(tree_links(self.git, base), tree_links(self.git, head))
        if problems:
            self.abort()
            raise PatchFormatError(f"{self.co.ref}: the stack leaves {problems[0]}; the {self.kind.verb} was undone",
                                   hint="a stack may create, move or retarget symbolic links only to files inside "
                                        "the tree; fix or drop that patch")

    def result(self, head: str | None, stack_hash: str, backup: str | None = None) -> StackResult:
        op = self.op
        self.report_new(all_of_them=True)
        for what, words in (("head", "the commits of your detached HEAD are"),
                            ("reflog", "your commits that only git's reflog held are")):
            if op.saves.get(what):
                self.notes.append(f"{words} kept in {op.saves[what]} (`git -C {self.co.path} log {op.saves[what]}"
                                  f"{'^@' if what == 'reflog' else ''}`)")
        kept = [r for r in (op.saves.get("kept") or "").split(",") if r]
        return StackResult(str(self.co.ref), str(self.co.path), self.state.source, self.co.base(), head, stack_hash,
                           [op.outcomes[i] for i in sorted(op.outcomes)], backup_ref=backup or op.saves.get("branch"),
                           backups=[r for r in (op.saves.get("work"), *kept) if r], notes=self.notes)

    # ------------------------------------------------------------ abort

    def abort(self) -> list[str]:
        """Back to the recorded starting point: branch, HEAD, work tree (including uncommitted and
        untracked work). Returns notes (backup refs kept for work made during the op)."""
        op = self.op
        if op.phase != Phase.ABORT:
            op.abort_from = op.phase
            op.phase = Phase.ABORT
            self.write()
        touched = getattr(self.kind, "touches_checkout", True) and op.abort_from != "save"
        if not op.abort_saved:
            if touched:
                self._save_for_abort()
            op.abort_saved = True
            self.write()
        if touched and not op.restored:
            self._restore_checkout()
            op.restored = True
            self.write()
        self.kind.undo(self)
        self._drop_redundant_backups(touched)
        self._restore_stack_ref()
        kept = [k for k in (op.saves.get("kept") or "").split(",") + [op.saves.get("foreign") or ""] if k]
        for k in kept:
            self.notes.append(f"work made during the {self.kind.verb} is kept in {k}")
        self.close(None)
        return self.notes

    def _restore_checkout(self) -> None:
        """(abort) The branch, HEAD and work tree as they were, then the user's uncommitted work."""
        op, g = self.op, self.git
        if self.co.am_in_progress():
            remove_tree(self.co.am_dir)
        self._restore_branch_and_tree()
        if op.orig.dirty and op.saves.get("work"):
            work = op.saves["work"]
            r = g.run("stash", "apply", "--index", work, check=False)
            if not r.ok:
                r = g.run("stash", "apply", work, check=False)
            if not r.ok or (op.orig.print is not None and work_fingerprint(g) != op.orig.print):
                self.notes.append(f"your uncommitted work could not be restored exactly; it is kept in {work} "
                                  f"(`git -C {self.co.path} stash apply {work}`)")
                op.saves["keep_work"] = "1"

    def _drop_redundant_backups(self, touched: bool) -> None:
        """(abort) Backups that are now redundant: everything they hold is back in place."""
        op, g = self.op, self.git
        if op.saves.get("work") and not op.saves.get("keep_work") and touched or op.saves.get("work") and not touched:
            self._drop_backup(op.saves["work"])
        branch = op.saves.get("branch")
        if branch and g.rev(self.co.branch_ref) == g.rev(branch):
            self._drop_backup(branch)
        if op.saves.get("head") and g.rev("HEAD") == g.rev(op.saves["head"]):
            self._drop_backup(op.saves["head"])  # HEAD holds them again, as before the op
        if op.saves.get("reflog") and g.rev(op.saves["reflog"]):  # kept: a reflog is no place for work
            self.notes.append(f"your commits that only git's reflog held stay kept in {op.saves['reflog']}")

    def _restore_stack_ref(self) -> None:
        """(abort) refs/dsadapt/stack as before the op (or gone, when there was none)."""
        op, g = self.op, self.git
        if op.orig.stack_ref:
            if g.rev(STACK_REF) != op.orig.stack_ref:
                g.update_ref(STACK_REF, op.orig.stack_ref)
        elif g.rev(STACK_REF):
            g.delete_ref(STACK_REF)

    def _drop_backup(self, ref: str) -> None:
        """A backup whose content is back in place: no longer kept (nor made again by `repair`)."""
        self.git.delete_ref(ref)
        self.op.saved.pop(ref, None)

    def _save_for_abort(self) -> None:
        """Keep what the user made during the op before the work tree goes back."""
        op, g = self.op, self.git
        if op.am is not None and g.rev("HEAD"):
            _, _, foreign, at_stop = self._observe()
            if foreign or at_stop:
                self._keep_foreign(foreign or at_stop)
        dirty = g.dirty_files()
        if not dirty:
            return
        src = op.abort_from
        if src == Phase.RESET:
            return  # a half-done reset of ours; the user's work is in saves["work"]
        if src in (Phase.STOPPED, Phase.CONTINUE, Phase.SKIP) and op.am is not None and g.rev("HEAD") == op.am.head_at_stop:
            self._save_beyond_stop()
            return
        pos = self._am_pos()
        if op.am is not None and pos is not None and 1 <= pos <= len(op.am.indices) \
                and self._within(dirty, self._junk_paths(op.am.indices[pos - 1])):
            return  # what a killed am left of the patch it was applying
        self._save_work("changes found in the work tree when aborting")

    def _restore_branch_and_tree(self) -> None:
        op, g, co = self.op, self.git, self.co
        if op.orig.branch_head:
            g.update_ref(co.branch_ref, op.orig.branch_head)
        if op.orig.branch:
            g.run("checkout", "-q", "-f", op.orig.branch)
        elif op.orig.head:
            g.run("checkout", "-q", "-f", "--detach", op.orig.head)
        if not op.orig.branch_head and op.orig.branch != co.branch and g.rev(co.branch_ref):
            g.run("branch", "-q", "-D", co.branch, check=False)
        g.run("clean", "-fdq")


# ---------------------------------------------------------------- status of an op (read-only)


@dataclass
class StopSeen:
    """What git shows of a recorded stop (read-only).

    how: same     am still stands on the stopped patch (HEAD on top of the stop)
         moved    am stands on a later patch: the user went on with `git am --continue / --skip`
         done     no am any more, commits on top of the stop: the user's am ran to its end
         ended    no am any more, nothing on top of the stop (`git am --quit`, or an abort of a stop
                  on the first patch)
         rewound  HEAD no longer holds the stop's commits (`git am --abort`, a reset, a checkout)
    """

    how: str
    at: int | None = None                        # the stack index am stands on now
    after: list[tuple[str, str, str]] = field(default_factory=list)  # commits on top of the stop

    def words(self, co: Checkout, op: Op) -> str:
        name = op.meta(op.stopped).name if op.stopped else "?"
        if self.how == "rewound":
            return (f"git am was aborted by hand (git am --abort, or a reset) at the stop on {name}: the branch "
                    f"no longer holds the patches applied before it")
        if self.how == "ended":
            return f"the stop on {name} was ended by hand (git am --quit, or git am --abort): no git am is in progress"
        if self.how == "done":
            return f"git am was continued by hand past {name} and finished"
        if self.how == "moved" and self.at:
            return f"git am was continued by hand past {name}; it stopped on {op.meta(self.at).name}"
        return f"stopped on {name}"


def stop_seen(co: Checkout, op: Op) -> StopSeen:
    am = op.am
    assert am is not None and op.stopped
    g = co.git
    head = g.head_commit()
    pos = None
    if co.am_in_progress():
        cur, last = _read_int(co.am_dir / "next"), _read_int(co.am_dir / "last")
        pos = cur if cur is not None and last is not None and 1 <= cur <= len(am.indices) else None
    at = am.indices[pos - 1] if pos is not None else None
    after: list[tuple[str, str, str]] = []
    if head != am.head_at_stop:
        on_top = bool(head and am.head_at_stop) and \
            g.run("merge-base", "--is-ancestor", am.head_at_stop or "", head or "", check=False).ok
        if not on_top:
            return StopSeen("rewound", at)
        after = g.commits(f"{am.head_at_stop}..{head}")
    if at == op.stopped:
        return StopSeen("same", at, after)
    if at is not None:
        return StopSeen("moved", at, after)
    return StopSeen("done" if after else "ended", None, after)


def am_done(co: Checkout, op: Op) -> int:
    """How many of the op's patches have an outcome or are behind a running (or killed) `git am`:
    the recorded outcomes are written when a run stops, am's own counter moves per patch."""
    done = set(op.outcomes)
    if op.am is not None and co.am_in_progress():
        cur = _read_int(co.am_dir / "next")
        if cur is not None:
            done |= set(op.am.indices[:max(cur - 1, 0)])
    return len(done)


def describe_op(co: Checkout, op: Op, running: bool = False) -> tuple[str, str, str | None]:
    """(state, detail, next command) of a checkout holding an op, without changing anything."""
    ref = co.ref
    done = am_done(co, op)
    try:
        kind: OpKind | None = kind_of(op.kind)
    except WorkspaceError:
        kind = None
    verb = kind.verb if kind is not None else op.kind
    if running:
        return "running", f"a dsadapt {verb} is running now ({done}/{plural(op.total, 'patch')} done)", None
    if op.phase == Phase.LEGACY:
        return "interrupted", (f"an {verb} recorded by an older dsadapt is in progress; run `dsadapt abort {ref}`, "
                               "then apply again"), f"dsadapt abort {ref}"
    if op.phase == Phase.ABORT:
        return "interrupted", f"an abort of the {verb} was interrupted; run `dsadapt abort {ref}` to finish it", \
            f"dsadapt abort {ref}"
    own = kind.describe(co, op) if kind is not None else None
    if own is not None:
        return own
    name = op.meta(op.stopped).name if op.stopped and op.stopped <= op.total else None
    if op.phase == Phase.STOPPED and name and op.am is not None:
        seen = stop_seen(co, op)
        if seen.how in ("rewound", "ended"):
            return "interrupted", (f"{seen.words(co, op)}; run `dsadapt abort {ref}` to go back to where the {verb} "
                                   f"started, then {verb} again"), f"dsadapt abort {ref}"
        if seen.how == "moved" and seen.at:
            return "stopped", (f"{done}/{plural(op.total, 'patch')} done; {seen.words(co, op)} (a conflict): resolve, "
                               f"`git add`, then `dsadapt continue {ref}` (or `dsadapt skip {ref}` / "
                               f"`dsadapt abort {ref}`)"), f"dsadapt continue {ref}"
        if seen.how == "done":
            return "interrupted", (f"{seen.words(co, op)}; run `dsadapt continue {ref}` to record it (or "
                                   f"`dsadapt abort {ref}` to undo the whole {verb})"), f"dsadapt continue {ref}"
    if op.phase == Phase.STOPPED and name:
        return "stopped", (f"{done}/{plural(op.total, 'patch')} done; stopped on a conflict in {name}: resolve, `git add`, "
                           f"then `dsadapt continue {ref}` (or `dsadapt skip {ref}` / `dsadapt abort {ref}`)"), \
            f"dsadapt continue {ref}"
    where = "between patches"
    if op.phase in (Phase.CONTINUE, Phase.SKIP) and name:
        where = f"during `dsadapt {op.phase}` of {name}"
    elif co.am_in_progress() and op.am is not None:
        cur = _read_int(co.am_dir / "next")
        if cur is not None and 1 <= cur <= len(op.am.indices):
            where = f"while applying {op.meta(op.am.indices[cur - 1]).name}"
    elif op.phase in (Phase.SAVE, Phase.RESET):
        where = "before the first patch"
    elif op.phase == Phase.FINISH:
        where = "while writing its results"
    legacy = " (recorded by an older dsadapt)" if op.schema < SCHEMA else ""
    return "interrupted", (f"{verb}{legacy} interrupted {where} ({done}/{plural(op.total, 'patch')} done); "
                           f"run `dsadapt continue {ref}` to finish it or `dsadapt abort {ref}` to undo it"), \
        f"dsadapt continue {ref}"


__all__ = ["KINDS", "OpKind", "StackResult", "Transaction", "describe_op", "files_commit", "flat_tree_id", "kind_of",
           "register"]

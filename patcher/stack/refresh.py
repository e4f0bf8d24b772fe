"""refresh: write the checkout branch's commits back into patches/<engine>/<tag>/ (the refresh op
kind), and the export both refresh and rebase use (one `git format-patch` for a range).

A refresh never touches the checkout; its op records the stack files before and after (as commits
in the checkout's repository), so a killed refresh is finished by `dsadapt refresh` or undone byte
for byte by `dsadapt abort`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.dotgit import STACK_REF
from patcher.base.errors import DsadaptError, RefusedToClobber, WorkspaceError
from patcher.base.fsutil import atomic_write_bytes, remove_file
from patcher.base.gitutil import Git
from patcher.formats.lock import Lock
from patcher.formats.parsecache import ParseCache
from patcher.formats.patchfile import Patch, parse_patch
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import format_series, stack_dir
from patcher.stack.checkout import Checkout, check_lock, head_state, refuse_hand_made
from patcher.stack.record import NamedText, files_hash, series_names
from patcher.stack.state import Applied, Op, Orig, Outcome, Phase
from patcher.stack.transaction import MBOX_FROM, NoHooks, StackResult, Transaction, flat_tree_id, register

__all__ = ["NamedText", "RefreshKind", "RefreshResult", "branch_commits", "export_commits", "exported_files", "files_hash",
           "read_stack_files", "refresh_stack", "series_names", "sync_stack_dir"]


# ---------------------------------------------------------------- export (refresh, rebase)

FORMAT_PATCH = ("-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "format.signature=",
                "-c", "diff.algorithm=myers", "-c", "diff.context=3", "-c", "diff.renames=false",
                "format-patch", "--stdout", "--full-index", "--binary", "--no-signature", "--no-stat",
                "--zero-commit", "--no-numbered", "--subject-prefix=PATCH", "--no-renames", "--no-color",
                "--src-prefix=a/", "--dst-prefix=b/", "--no-notes", "--no-cover-letter")


@dataclass(frozen=True)
class BranchCommit:
    commit: str
    subject: str
    empty: bool      # its tree is its parent's: nothing to export


def branch_commits(git: Git, base: str, head: str, branch: str | None = None) -> list[BranchCommit]:
    """The commits base..head, oldest first, as a stack is made of them (one `git log`). A merge
    commit is refused (a stack is linear) with the command that makes the branch linear."""
    out = git.run("log", "--reverse", "--boundary", "--format=%m %H %T %P%x00%s", f"{base}..{head}").out
    trees: dict[str, str] = {}
    rows = []
    for line in out.splitlines():
        head_part, _, subject = line.partition("\0")
        f = head_part.split()
        if len(f) < 3:
            continue
        trees[f[1]] = f[2]
        if f[0] != "-":
            rows.append((f[1], f[2], f[3:], subject))
    merges = [c for c, _t, parents, _s in rows if len(parents) > 1]
    if merges:
        tip = branch or head[:12]
        raise WorkspaceError(f"merge commit {merges[0][:12]} in the stack branch: a stack is linear, one patch per commit",
                             hint=f"`git -C {git.path} branch merged-{merges[0][:12]} {tip}` keeps the branch as it "
                                  f"is, then `git -C {git.path} rebase {base[:12]} {tip}` makes it linear (git leaves "
                                  "the merge out and replays the commits it brought); then refresh again")
    return [BranchCommit(c, s, bool(parents) and trees.get(parents[0]) == t) for c, t, parents, s in rows]


def changed_lines(diff: str) -> list[str]:
    """The +/- lines of a diff (file headers excluded): the change itself, without context."""
    return [l for l in diff.split("\n") if l[:1] in ("+", "-") and not l.startswith(("+++ ", "--- "))]


def export_commits(git: Git, base: str, head: str, empty: list[BranchCommit] | None = None,
                   branch: str | None = None, cache: ParseCache | None = None) -> list[Patch]:
    """Commits base..head as normalized Patch objects: one `git format-patch` for all of them. Empty
    commits (`git commit --allow-empty`: no change to export) are left out and added to `empty`
    (`cache`: the work dir's parse cache, which an unchanged commit's text hits)."""
    commits = branch_commits(git, base, head, branch)
    if empty is not None:
        empty += [c for c in commits if c.empty]
    commits = [c for c in commits if not c.empty]
    if not commits:
        return []
    text = git.run(*FORMAT_PATCH, f"{base}..{head}").out  # not git.out: stripping would eat a last " " line
    pieces = text.split(MBOX_FROM)[1:]
    if len(pieces) != len(commits):  # (format-patch leaves out what it finds empty: one at a time)
        pieces = [git.run(*FORMAT_PATCH, "-1", c.commit).out.split(MBOX_FROM, 1)[-1] for c in commits]
    pieces = [with_mode_only_index(git, c.commit, p) for c, p in zip(commits, pieces)]
    parse = cache.parse if cache is not None else (lambda text, where: parse_patch(text, where=where))
    return [parse(MBOX_FROM + p, f"commit {c.commit[:12]}") for c, p in zip(commits, pieces)]


_MODE_ONLY = re.compile(r"^diff --git a/(?P<path>[^\n]+?) b/(?P=path)\nold mode (\d+)\nnew mode (\d+)\n(?!index )", re.M)


def with_mode_only_index(git: Git, commit: str, piece: str) -> str:
    """A file whose commit only changes its mode gets the index line git leaves out (`index B..B`,
    its blob id on both sides): the patch then names the file's pre-image like every other (the
    lint and the release-artifact pre-image check need it), and git applies it as before."""
    hits = list(_MODE_ONLY.finditer(piece))
    if not hits:
        return piece
    blobs = git.blobs_at(commit, sorted({m.group("path") for m in hits}))
    for m in reversed(hits):
        oid = blobs.get(m.group("path"))
        if oid:
            piece = piece[:m.end()] + f"index {oid}..{oid}\n" + piece[m.end():]
    return piece


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


# ---------------------------------------------------------------- the op kind


@dataclass
class RefreshResult:
    ref: str
    changed: list[str]
    removed: list[str]
    backup: str | None = None
    notes: list[str] = field(default_factory=list)


class RefreshKind(NoHooks):
    """Writing patches/ from the branch. The checkout itself is not touched; the op records the
    stack files before and after, so a killed refresh is finished or undone byte for byte."""

    name = "refresh"
    verb = "refresh"
    touches_checkout = False

    def label(self, tx: Transaction, index: int, commit: str | None, merged: bool | None) -> tuple[Outcome, str | None]:
        return Outcome.CLEAN, None

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
        after_names = series_names(tx.read_files(ex["after"]).get("series"))
        sync_stack_dir(d, before, after_names)
        if tx.git.rev(STACK_REF) != tx.op.orig.stack_ref and tx.op.orig.stack_ref:
            tx.git.update_ref(STACK_REF, tx.op.orig.stack_ref)
        if ex.get("backup") and read_stack_files(d, series_names(before.get("series"))) == before:
            tx.git.delete_ref(ex["backup"])  # the files it kept are back in patches/

    def describe(self, co: Checkout, op: Op) -> tuple[str, str, str | None] | None:
        ref = co.ref
        return "interrupted", (f"a refresh was interrupted while writing patches/; run `dsadapt refresh {ref}` "
                               f"to finish it or `dsadapt abort {ref}` to put patches/ back"), f"dsadapt refresh {ref}"


register(RefreshKind())


def refresh_stack(cfg: Config, lock: Lock, ref: PinRef, *, force: bool = False) -> RefreshResult:
    """Export the checkout branch's commits back into patches/<engine>/<tag>/.

    Refuses (exit 4) to overwrite patches/ files that changed since the stack was applied or last
    refreshed when the branch does not hold that change; `force` overwrites them and keeps the
    previous files in a backup ref. An unchanged stack changes zero bytes."""
    entry = lock.pin(ref)
    co = Checkout(cfg, ref)
    if not co.exists:
        raise WorkspaceError(f"{ref}: no checkout at {co.path}", hint=f"run `dsadapt apply {ref}` first")
    check_lock(co, entry)
    tx = Transaction.open(co)
    if tx.state.op is not None and tx.op.kind == "refresh" and tx.op.phase not in (Phase.ABORT, Phase.LEGACY):
        res = tx.run()  # a refresh that was killed: finish writing what it recorded
        return RefreshResult(str(ref), res.changed, res.removed, res.backup_ref,  # type: ignore[attr-defined]
                             ["finished the interrupted refresh", *tx.notes])
    if tx.state.op is not None:
        tx.refuse()
    head = _exported_head(co)
    ex = _export(tx, co, head)
    applied = tx.state.applied
    if ex.cur == ex.target and applied and applied.head == head and applied.stack_hash == ex.new_hash \
            and not applied.needs_refresh:
        return RefreshResult(str(ref), [], [], None, tx.notes)  # nothing to write, nothing to record
    # (when only the record lags behind the branch, the op below writes no file: the same files before and after)
    rec = _last_in_step(tx, ex)
    newer = [n for n in sorted(set(ex.cur) | set(rec or {}) | set(ex.target))
             if (rec is None or ex.cur.get(n) != rec.get(n)) and ex.cur.get(n) != ex.target.get(n)
             and (n in ex.cur or (rec is not None and n in rec))]
    if newer and not force:
        what = "changed (or removed) since it was applied" if rec is not None else "not what this checkout applied"
        more = f" (+{len(newer) - 1} more)" if len(newer) > 1 else ""
        raise RefusedToClobber(f"{ref}: {ex.rel}/{newer[0]}{more} {what}, and branch {co.branch} does not hold that "
                               "change; refresh would overwrite it",
                               hint=f"take the newer patches/ with `dsadapt apply {ref} --force` (your branch is kept "
                                    f"in a backup ref), or overwrite them with `dsadapt refresh {ref} --force` (the "
                                    "current files are kept in a backup ref)")
    return _write_stack(tx, ex, bool(newer))


@dataclass
class _Export:
    """What a refresh would write: the branch's commits as stack files, beside patches/ now."""

    head: str                     # the branch's commit exported
    rel: str                      # the stack dir, from the project root
    patches: list[Patch]
    target: dict[str, bytes]      # the files the export gives
    cur: dict[str, bytes]         # the files patches/ holds now (of either series)
    cur_names: list[str]          # the patches patches/ lists now
    new_hash: str


def _exported_head(co: Checkout) -> str:
    """The branch's head that refresh exports, refused while work is elsewhere (uncommitted, off
    the branch, a git operation of the user's, another worktree) or the branch is missing."""
    ref = co.ref
    refuse_hand_made(co, False)
    if co.git.dirty_files():
        raise WorkspaceError(f"{ref}: {co.path} has uncommitted changes; refresh exports commits only",
                             hint=f"commit them on {co.branch} (git commit, or git commit --fixup + rebase), then refresh")
    hs = head_state(co)
    off = hs.problem(co)
    if off:  # work that is not on the branch refresh exports: never report "unchanged" over it
        raise WorkspaceError(f"{ref}: {off[0]} in {co.path}; refresh exports branch {co.branch}", hint=off[1])
    if not hs.branch_head:
        raise WorkspaceError(f"{ref}: branch {co.branch} is missing", hint=f"run `dsadapt apply {ref}`")
    return hs.branch_head


def _export(tx: Transaction, co: Checkout, head: str) -> _Export:
    """The branch base..head exported (empty commits left out, with a note) beside patches/ now."""
    d = stack_dir(co.cfg.patches_root, co.ref)
    cur_series = (d / "series").read_bytes() if (d / "series").is_file() else None
    cur_names = series_names(cur_series)
    empty: list[BranchCommit] = []
    patches = export_commits(co.git, co.base(), head, empty, co.branch, ParseCache.in_workdir(co.cfg.workdir))
    for c in empty:
        tx.notes.append(f"commit {c.commit[:12]} ({c.subject}) is empty: left out of the stack (a patch must "
                        "change something; the commit stays on the branch)")
    target, names = exported_files(patches, cur_series.decode("utf-8", "replace") if cur_series else None)
    cur = read_stack_files(d, sorted(set(cur_names) | set(names)))
    return _Export(head, str(d.relative_to(co.cfg.project)), patches, target, cur, cur_names,
                   files_hash(target, names))


def _last_in_step(tx: Transaction, ex: _Export) -> dict[str, bytes] | None:
    """What patches/ held when the branch was last in step with it (the apply, or the last
    refresh); None when that is not known."""
    applied = tx.state.applied
    if applied and applied.snapshot:
        return tx.read_files(applied.snapshot)
    if applied and files_hash(ex.cur, ex.cur_names) == applied.stack_hash:
        return ex.cur
    return None


def _write_stack(tx: Transaction, ex: _Export, clobbers: bool) -> RefreshResult:
    """The refresh op: the files before and after recorded as commits, then written (a backup ref
    keeps the previous files when newer ones are overwritten or a patch is dropped)."""
    co, g = tx.co, tx.git
    dropped = dropped_patches(ex.cur, ex.cur_names, ex.patches)
    before = tx.files_commit(ex.cur) if ex.cur else tx.files_commit({})
    backup = co.next_backup_names(1)[0] if clobbers or dropped else None
    after = tx.files_commit(ex.target)
    op = Op(kind="refresh", ref=str(co.ref), stack_hash=ex.new_hash, patches=[],
            orig=Orig(g.current_branch(), g.rev("HEAD"), ex.head, g.rev(STACK_REF), False), phase=Phase.FINISH,
            saves={"backup": backup} if backup else {},
            extra={"stack_dir": ex.rel, "before": before, "after": after, "head": ex.head, "backup": backup,
                   "names_before": ex.cur_names})
    tx.begin(op, [], None)
    if dropped:
        more = f" (+{len(dropped) - 1} more)" if len(dropped) > 1 else ""
        tx.notes.append(f"no longer in the stack: {dropped[0]}{more} (no commit of branch {co.branch} has its subject "
                        f"or its change)")
    if backup:
        tx.notes.append(f"the previous files of {ex.rel} are kept in {backup} "
                        f"(`git -C {co.path} show {backup}:<file>`)")
    res = tx.run()
    return RefreshResult(str(co.ref), res.changed, res.removed, backup, tx.notes)  # type: ignore[attr-defined]


def dropped_patches(cur: dict[str, bytes], names: list[str], patches: list[Patch]) -> list[str]:
    """The patches of `names` (patches/ now) that the export leaves out: no exported commit has their
    subject or their change (a patch reworded or amended is not dropped; one reset away is)."""
    subjects = {" ".join(p.subject.split()).lower() for p in patches}
    changes = {tuple(changed_lines(p.diff)) for p in patches}
    out = []
    for n in names:
        try:
            old = parse_patch(cur.get(n, b"").decode("utf-8", "replace"), where=n)
        except DsadaptError:
            continue  # not a patch dsadapt can read: the clobber check above speaks for it
        if " ".join(old.subject.split()).lower() not in subjects and tuple(changed_lines(old.diff)) not in changes:
            out.append(n)
    return out

"""The checkout: materialize, apply a stack as commits, stop/continue/skip/abort, refresh.

Modelled on `git am` (which does the per-patch work, with 3-way merge) wrapped in a
transaction: dsadapt records what it is doing in `.git/dsadapt/state.json` *before* it
touches anything, keeps backup refs whenever history is rewritten, and can always return
the checkout to where it was (`abort`), even after being killed mid-apply.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from email.utils import formatdate
from pathlib import Path

from .config import Config
from .errors import ConflictStop, VerificationError, WorkspaceError, plural
from .fsutil import atomic_write_text
from .gitutil import DSADAPT_IDENT, FIXED_DATE, Git, init_repo
from .lock import Lock, LockEntry
from .patchfile import parse_patch
from .pinref import PinRef
from .sources import SourceResult, materialize
from .stack import Stack, expected_preimages, load_stack, preimage_mismatches, write_stack

BASE_REF = "refs/dsadapt/base"
BACKUP_PREFIX = "refs/dsadapt/backup/"
FIXED_MAIL_DATE = formatdate(int(FIXED_DATE.split()[0]))  # RFC 2822 form of gitutil.FIXED_DATE

Progress = Callable[[str], None]


def branch_name(tag: str) -> str:
    return f"dsadapt/{tag}"


@dataclass
class PatchOutcome:
    index: int
    name: str
    subject: str
    outcome: str  # clean | merged | changed | skipped | conflict | upstream (rebase only)
    commit: str | None = None


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

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class CheckoutStatus:
    ref: str
    path: str
    state: str  # not fetched | clean base | stack applied | stack outdated | mid-apply | dirty | diverged
    detail: str
    source: dict | None = None
    base: str | None = None
    head: str | None = None
    stack_hash: str | None = None
    applied_hash: str | None = None
    backups: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- work-dir lock


@contextmanager
def workdir_lock(cfg: Config, timeout: float | None = None) -> Iterator[None]:
    """Serialize dsadapt runs on one work dir. flock dies with the process: no stale locks."""
    timeout = cfg.lock_timeout if timeout is None else timeout  # DSADAPT_LOCK_TIMEOUT, validated by load_config
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    path = cfg.workdir / "lock"
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise WorkspaceError(f"another dsadapt run holds {path} (pid {holder})",
                                         hint="wait for it to finish, or set DSADAPT_LOCK_TIMEOUT") from None
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- state


class Checkout:
    """One checkout directory and its dsadapt state."""

    def __init__(self, cfg: Config, ref: PinRef):
        self.cfg = cfg
        self.ref = ref
        self.path = cfg.checkout_dir(ref.engine, ref.tag)
        self.git = Git(self.path)

    @property
    def exists(self) -> bool:
        return (self.path / ".git").is_dir() and self.state_path.is_file()

    @property
    def state_path(self) -> Path:
        return self.path / ".git" / "dsadapt" / "state.json"

    @property
    def op_dir(self) -> Path:
        return self.path / ".git" / "dsadapt" / "op"

    @property
    def branch(self) -> str:
        return branch_name(self.ref.tag)

    def load_state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise WorkspaceError(f"{self.path} has no readable dsadapt state ({e.__class__.__name__})",
                                 hint=f"move the directory away and run `dsadapt apply {self.ref}` again") from None

    def save_state(self, state: dict) -> None:
        atomic_write_text(self.state_path, json.dumps(state, indent=2, sort_keys=True) + "\n")

    def am_in_progress(self) -> bool:
        return (self.path / ".git" / "rebase-apply").exists()

    def base(self) -> str:
        b = self.git.rev(BASE_REF)
        if not b:
            raise WorkspaceError(f"{self.path}: {BASE_REF} is missing", hint="the checkout is damaged; move it away and re-apply")
        return b

    def backups(self) -> list[str]:
        return [r for r, _ in self.git.refs(BACKUP_PREFIX)]

    def new_backup(self, commit: str, why: str) -> str:
        n = len(self.backups()) + 1
        while self.git.rev(f"{BACKUP_PREFIX}{n}"):
            n += 1
        ref = f"{BACKUP_PREFIX}{n}"
        self.git.run("update-ref", "-m", why, ref, commit)
        return ref


def ensure_checkout(cfg: Config, lock: Lock, entry: LockEntry, progress: Progress | None = None) -> tuple[Checkout, bool]:
    """The pin's checkout, materialized from a verified source if it does not exist yet."""
    co = Checkout(cfg, entry.ref)
    if co.exists:
        return co, False
    if co.path.exists() and any(co.path.iterdir()):
        raise WorkspaceError(f"{co.path} exists but is not a dsadapt checkout",
                             hint="move it away; dsadapt will not overwrite it")
    tmp = co.path.with_name(f".{co.path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        g = init_repo(tmp, identity=False)
        src: SourceResult = materialize(cfg, lock.engine(entry.engine), entry, g, progress)
        g.run("update-ref", BASE_REF, src.commit)
        g.run("checkout", "-q", "-B", branch_name(entry.tag), src.commit)
        state = {"ref": str(entry.ref), "source": src.to_json(), "base": src.commit, "applied": None, "op": None}
        (tmp / ".git" / "dsadapt").mkdir(parents=True, exist_ok=True)
        atomic_write_text(tmp / ".git" / "dsadapt" / "state.json", json.dumps(state, indent=2, sort_keys=True) + "\n")
        co.path.parent.mkdir(parents=True, exist_ok=True)
        if co.path.exists():
            co.path.rmdir()
        tmp.rename(co.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Checkout(cfg, entry.ref), True


# ---------------------------------------------------------------- apply


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


def apply_stack(cfg: Config, lock: Lock, ref: PinRef, *, force: bool = False, progress: Progress | None = None,
                on_patch: Callable[[PatchOutcome], None] | None = None) -> StackResult:
    entry = lock.pin(ref)
    stack = load_stack(cfg.patches_root, ref)  # parse everything before touching anything
    co, _created = ensure_checkout(cfg, lock, entry, progress)
    state = co.load_state()
    if state.get("op") or co.am_in_progress():
        raise WorkspaceError(f"{ref}: an apply is in progress in {co.path}",
                             hint=f"finish it with `dsadapt continue {ref}`, `dsadapt skip {ref}` or `dsadapt abort {ref}`")
    base = co.base()
    head_branch = co.git.rev(f"refs/heads/{co.branch}")
    applied = state.get("applied")
    dirty = co.git.is_dirty()
    if (not dirty and applied and not applied.get("needs_refresh") and applied.get("stack_hash") == stack.hash
            and head_branch == applied.get("head")
            and co.git.current_branch() == co.branch):
        return StackResult(str(ref), str(co.path), state.get("source"), base, head_branch, stack.hash, noop=True)
    if dirty and not force:
        files = co.git.dirty_files()
        raise WorkspaceError(f"{ref}: {co.path} has uncommitted changes ({', '.join(files[:3])}"
                             f"{'…' if len(files) > 3 else ''})",
                             hint="commit them and run `dsadapt refresh`, or pass --force (they are kept in a backup ref)")
    expected_head = applied.get("head") if applied else base
    if applied and applied.get("needs_refresh") and head_branch == applied.get("head") and not force:
        raise WorkspaceError(f"{ref}: {co.branch} holds conflict resolutions or skips not exported to the stack "
                             f"({', '.join(applied['needs_refresh'])})",
                             hint=f"run `dsadapt refresh {ref}` to keep them, or pass --force (the branch is kept in a backup ref)")
    if head_branch and head_branch != expected_head and not force:
        n = co.git.out("rev-list", "--count", f"{expected_head}..{head_branch}") if co.git.rev(expected_head) else "?"
        raise WorkspaceError(f"{ref}: branch {co.branch} has {n} commit(s) not exported to the stack",
                             hint=f"run `dsadapt refresh {ref}` to keep them, or pass --force (the branch is kept in a backup ref)")
    if state["source"]["kind"] == "pypi":
        check_preimages(co, stack, base)

    op = {
        "kind": "apply", "stack_hash": stack.hash, "stack_dir": str(stack.dir),
        "patches": [{"name": e.name, "subject": e.patch.subject} for e in stack.entries],
        "outcomes": [], "orig_branch": co.git.current_branch(), "orig_head": co.git.rev("HEAD"),
        "branch_head_before": head_branch, "backup_ref": None, "dirty_backup": None,
    }
    # Record intent first: a run killed from here on leaves a state `status` explains.
    if co.op_dir.exists():
        shutil.rmtree(co.op_dir)
    co.op_dir.mkdir(parents=True)
    for i, e in enumerate(stack.entries, 1):
        (co.op_dir / f"{i:04d}.patch").write_text(_with_fixed_date(e.text), encoding="utf-8")
    state["op"] = op
    co.save_state(state)
    if dirty:
        co.git.run("stash", "push", "-q", "--include-untracked", "-m", f"dsadapt apply --force {ref}",
                   env={"GIT_AUTHOR_NAME": DSADAPT_IDENT["name"], "GIT_AUTHOR_EMAIL": DSADAPT_IDENT["email"]})
        op["dirty_backup"] = co.new_backup(co.git.out("rev-parse", "stash@{0}"), "uncommitted changes before apply --force")
        co.git.run("stash", "drop", "-q")
    if head_branch and head_branch != base:
        op["backup_ref"] = co.new_backup(head_branch, f"{co.branch} before apply")
    co.save_state(state)
    co.git.run("checkout", "-q", "-f", "-B", co.branch, base)
    return _run_patches(co, state, on_patch)


def _with_fixed_date(text: str) -> str:
    """The patch with a fixed Date header: `git am` takes the author date from the mail and
    ignores GIT_AUTHOR_DATE, so without it the same stack gives new commit ids on every run."""
    first, sep, rest = text.partition("\n")
    if first.startswith("From ") and not first.startswith("From:"):
        return f"{first}{sep}Date: {FIXED_MAIL_DATE}\n{rest}"
    return f"Date: {FIXED_MAIL_DATE}\n{text}"


def _conflicted_files(co: Checkout) -> list[str]:
    out = co.git.run("diff", "--name-only", "--diff-filter=U", check=False).out
    files = [l for l in out.splitlines() if l]
    if not files:  # a patch that failed without a merge (e.g. missing file): list what it touches
        files = [l for l in co.git.run("am", "--show-current-patch=diff", check=False).out.splitlines()
                 if l.startswith("diff --git ")]
        files = [l.split(" b/", 1)[-1] for l in files]
    return files


def stop_on_conflict(co: Checkout, state: dict, i: int, what: str, headline: str) -> ConflictStop:
    """Record a real stop on patch `i` (for the user to resolve) and the error that says what next."""
    state["op"]["stopped"] = i  # not a run killed inside git am: continue commits the resolution
    co.save_state(state)
    ref = state["ref"]
    files = _conflicted_files(co)
    return ConflictStop(
        f"{ref}: {headline}; conflicts in: {', '.join(files) or '(see git status)'}",
        hint=f"resolve in {co.path}, `git add` the files, then `dsadapt continue {ref}`; "
             f"or `dsadapt skip {ref}` to drop this patch, `dsadapt abort {ref}` to undo the whole {what}")


def _run_patches(co: Checkout, state: dict, on_patch) -> StackResult:
    op = state["op"]
    if op.get("kind") == "rebase":  # same transaction; rebase classifies and finishes differently
        from .rebase import run_rebase_patches

        return run_rebase_patches(co, state, on_patch)
    patches = op["patches"]
    outcomes = op["outcomes"]
    while len(outcomes) < len(patches):
        i = len(outcomes) + 1
        meta = patches[i - 1]
        before = co.git.rev("HEAD")
        r = co.git.run("am", "-3", "--no-signoff", str(co.op_dir / f"{i:04d}.patch"), check=False, fixed_dates=True)
        if not r.ok:
            raise stop_on_conflict(co, state, i, "apply", f"patch {i}/{len(patches)} {meta['name']} does not apply")
        head = co.git.rev("HEAD")
        merged = "Falling back to patching base and 3-way merge" in (r.out + r.err)
        outcome = "merged" if merged else "clean"
        if head == before:
            outcome = "skipped"
        o = PatchOutcome(i, meta["name"], meta["subject"], outcome, head)
        outcomes.append(asdict(o))
        co.save_state(state)
        if on_patch:
            on_patch(o)
    return _finish(co, state)


def _finish(co: Checkout, state: dict) -> StackResult:
    op = state["op"]
    head = co.git.rev("HEAD")
    edited = [o["name"] for o in op["outcomes"] if o["outcome"] in ("changed", "skipped")]
    # After a resolved or skipped patch the branch no longer equals the stack's files: record
    # that, so `status` says to refresh and `apply` will not silently redo the conflict.
    state["applied"] = {"stack_hash": op["stack_hash"], "head": head, "needs_refresh": edited}
    state["op"] = None
    co.save_state(state)
    shutil.rmtree(co.op_dir, ignore_errors=True)
    return StackResult(state["ref"], str(co.path), state.get("source"), co.base(), head, op["stack_hash"],
                       [PatchOutcome(**o) for o in op["outcomes"]], backup_ref=op.get("backup_ref"))


def _in_progress(cfg: Config, ref: PinRef | None) -> Checkout:
    if ref is not None:
        co = Checkout(cfg, ref)
        if not co.exists or not co.load_state().get("op"):
            raise WorkspaceError(f"{ref}: no apply in progress", hint="nothing to continue, skip or abort")
        return co
    found = []
    root = cfg.workdir / "checkouts"
    if root.is_dir():
        for engine_dir in sorted(root.iterdir()):
            for tag_dir in sorted(engine_dir.iterdir()) if engine_dir.is_dir() else []:
                co = Checkout(cfg, PinRef(engine_dir.name, tag_dir.name))
                if co.exists and co.load_state().get("op"):
                    found.append(co)
    if not found:
        raise WorkspaceError("no apply in progress", hint="nothing to continue, skip or abort")
    if len(found) > 1:
        raise WorkspaceError(f"{len(found)} applies in progress: {', '.join(str(c.ref) for c in found)}",
                             hint="name one, e.g. `dsadapt continue vllm@v0.32.0`")
    return found[0]


def continue_apply(cfg: Config, ref: PinRef | None = None, on_patch=None) -> StackResult:
    co = _in_progress(cfg, ref)
    state = co.load_state()
    op = state["op"]
    _reconcile_killed(co, state)
    if co.am_in_progress() and op.get("stopped") != len(op["outcomes"]) + 1:
        # killed inside `git am`: the patch was not committed and nobody resolved anything;
        # undo the partial am (HEAD stays on the last committed patch) and apply it again.
        co.git.run("am", "--abort", check=False)
        if co.am_in_progress():
            shutil.rmtree(co.path / ".git" / "rebase-apply")
        co.git.run("reset", "-q", "--hard")
    if co.am_in_progress():
        r = co.git.run("am", "--continue", check=False, fixed_dates=True)
        if not r.ok:
            msg = (r.out + r.err).strip().splitlines()
            unresolved = co.git.run("diff", "--name-only", "--diff-filter=U", check=False).out.split()
            if unresolved:
                raise ConflictStop(f"{co.ref}: still unresolved: {', '.join(unresolved)}",
                                   hint=f"edit them, `git add` them in {co.path}, then `dsadapt continue {co.ref}`")
            raise WorkspaceError(f"{co.ref}: git am --continue failed: {msg[-1] if msg else r.rc}",
                                 hint=f"if the patch is now empty, run `dsadapt skip {co.ref}`")
        _record_next(co, state, "changed", on_patch)
    return _run_patches(co, state, on_patch)


def _record_next(co: Checkout, state: dict, outcome: str, on_patch) -> None:
    """Record the outcome of the patch the apply stopped on (the next one without an outcome)."""
    op = state["op"]
    i = len(op["outcomes"]) + 1
    meta = op["patches"][i - 1]
    o = PatchOutcome(i, meta["name"], meta["subject"], outcome, co.git.rev("HEAD"))
    op["outcomes"].append(asdict(o))
    co.save_state(state)
    if on_patch:
        on_patch(o)


def skip_patch(cfg: Config, ref: PinRef | None = None, on_patch=None) -> StackResult:
    co = _in_progress(cfg, ref)
    state = co.load_state()
    _reconcile_killed(co, state)
    if not co.am_in_progress():
        raise WorkspaceError(f"{co.ref}: not stopped on a patch", hint=f"run `dsadapt continue {co.ref}`")
    co.git.run("am", "--skip", check=False, fixed_dates=True)
    if co.am_in_progress():
        co.git.run("am", "--abort", check=False)
    _record_next(co, state, "skipped", on_patch)
    return _run_patches(co, state, on_patch)


def abort_apply(cfg: Config, ref: PinRef | None = None) -> Checkout:
    """Return the checkout exactly to where it was before `apply` (branches, HEAD, work tree)."""
    co = _in_progress(cfg, ref)
    state = co.load_state()
    op = state["op"]
    if co.am_in_progress():
        co.git.run("am", "--abort", check=False)
        if co.am_in_progress():
            shutil.rmtree(co.path / ".git" / "rebase-apply")
    co.git.run("reset", "-q", "--hard")
    co.git.run("clean", "-qfd")
    before = op.get("branch_head_before")
    if before:
        co.git.run("update-ref", f"refs/heads/{co.branch}", before)
    orig_branch, orig_head = op.get("orig_branch"), op.get("orig_head")
    if orig_branch == co.branch and not before:
        co.git.run("update-ref", f"refs/heads/{co.branch}", orig_head)
    if orig_branch:
        co.git.run("checkout", "-q", "-f", orig_branch)
    elif orig_head:
        co.git.run("checkout", "-q", "-f", "--detach", orig_head)
    if orig_branch != co.branch and not before:
        co.git.run("branch", "-q", "-D", co.branch, check=False)
    # The backup refs this apply made are redundant once everything is restored: drop them,
    # so the checkout is exactly as before (a dirty backup is kept if it could not be re-applied).
    if op.get("backup_ref") and co.git.rev(f"refs/heads/{co.branch}") == co.git.rev(op["backup_ref"]):
        co.git.delete_ref(op["backup_ref"])
    if op.get("dirty_backup"):
        r = co.git.run("stash", "apply", "-q", "--index", op["dirty_backup"], check=False)
        if r.ok:
            co.git.delete_ref(op["dirty_backup"])
    if op.get("kind") == "rebase":  # undo what a rebase did outside the checkout (lock entry, refs)
        from .rebase import undo_rebase_extras

        undo_rebase_extras(co, op)
    state["op"] = None
    co.save_state(state)
    shutil.rmtree(co.op_dir, ignore_errors=True)
    return co


def _reconcile_killed(co: Checkout, state: dict) -> None:
    """A run killed after git committed a patch but before dsadapt recorded it: record it."""
    op = state["op"]
    if co.am_in_progress():
        return
    n_commits = int(co.git.out("rev-list", "--count", f"{co.base()}..HEAD"))
    n_recorded = sum(1 for o in op["outcomes"] if o["outcome"] not in ("skipped", "upstream"))
    while n_commits > n_recorded and len(op["outcomes"]) < len(op["patches"]):
        i = len(op["outcomes"]) + 1
        meta = op["patches"][i - 1]
        op["outcomes"].append(asdict(PatchOutcome(i, meta["name"], meta["subject"], "clean", co.git.rev("HEAD"))))
        n_recorded += 1
    co.save_state(state)


# ---------------------------------------------------------------- refresh


def export_commits(git: Git, base: str, head: str) -> list:
    """Commits base..head as normalized Patch objects (format-patch with pinned diff options)."""
    merges = git.out("rev-list", "--min-parents=2", f"{base}..{head}")
    if merges:
        raise WorkspaceError(f"merge commit {merges.split()[0][:12]} in the stack branch",
                             hint="a stack is linear: rebase the branch onto the base without merges")
    commits = git.out("rev-list", "--reverse", f"{base}..{head}").split()
    patches = []
    for c in commits:
        text = git.run(  # not git.out: stripping would eat a final context line of one space
            "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "format.signature=",
            "-c", "diff.algorithm=myers", "-c", "diff.context=3", "-c", "diff.renames=false",
            "format-patch", "-1", "--stdout", "--full-index", "--binary", "--no-signature", "--no-stat",
            "--zero-commit", "--no-numbered", "--subject-prefix=PATCH", "--no-renames", "--no-color",
            "--src-prefix=a/", "--dst-prefix=b/", "--no-notes", "--no-cover-letter", c).out
        p = parse_patch(text, where=f"commit {c[:12]}")
        patches.append(p)
    return patches


def refresh_stack(cfg: Config, lock: Lock, ref: PinRef) -> tuple[list[str], list[str]]:
    """Export the checkout branch's commits back into patches/<engine>/<tag>/.

    Returns (files written or changed, files removed). An unchanged stack changes zero bytes.
    """
    lock.pin(ref)
    co = Checkout(cfg, ref)
    if not co.exists:
        raise WorkspaceError(f"{ref}: no checkout at {co.path}", hint=f"run `dsadapt apply {ref}` first")
    state = co.load_state()
    if state.get("op") or co.am_in_progress():
        raise WorkspaceError(f"{ref}: an apply is in progress", hint=f"finish it (`dsadapt continue {ref}`) or abort it first")
    if co.git.is_dirty():
        raise WorkspaceError(f"{ref}: {co.path} has uncommitted changes; refresh exports commits only",
                             hint=f"commit them on {co.branch} (git commit, or git commit --fixup + rebase), then refresh")
    head = co.git.rev(f"refs/heads/{co.branch}")
    if not head:
        raise WorkspaceError(f"{ref}: branch {co.branch} is missing", hint=f"run `dsadapt apply {ref}`")
    patches = export_commits(co.git, co.base(), head)
    d = cfg.patches_root / ref.engine / ref.tag
    before = {f.name: f.read_bytes() for f in d.iterdir()} if d.is_dir() else {}
    write_stack(d, patches)
    after = {f.name: f.read_bytes() for f in d.iterdir()}
    changed = sorted(n for n in after if before.get(n) != after[n])
    removed = sorted(n for n in before if n not in after)
    new_stack = load_stack(cfg.patches_root, ref)
    state["applied"] = {"stack_hash": new_stack.hash, "head": head}
    co.save_state(state)
    return changed, removed


# ---------------------------------------------------------------- status


def checkout_status(cfg: Config, lock: Lock, entry: LockEntry) -> CheckoutStatus:
    co = Checkout(cfg, entry.ref)
    stack = load_stack(cfg.patches_root, entry.ref, must_exist=False)
    st = CheckoutStatus(str(entry.ref), str(co.path), "not fetched", "no checkout yet", stack_hash=stack.hash)
    if not co.exists:
        return st
    state = co.load_state()
    st.source = state.get("source")
    st.base = co.git.rev(BASE_REF)
    st.head = co.git.rev(f"refs/heads/{co.branch}")
    st.backups = co.backups()
    applied = state.get("applied")
    st.applied_hash = applied.get("stack_hash") if applied else None
    op: dict | None = state.get("op")
    if op or co.am_in_progress():
        done = len(op["outcomes"]) if op else 0
        total = len(op["patches"]) if op else 0
        stopped = co.am_in_progress() and op is not None and op.get("stopped") == done + 1
        killed_in_am = co.am_in_progress() and not stopped
        st.state = "mid-apply"
        st.detail = (f"{done}/{plural(total, 'patch')} done; " +
                     (f"stopped on {op['patches'][done]['name']}" if stopped and op and done < total
                      else f"interrupted while applying {op['patches'][done]['name']}" if killed_in_am and op
                      and done < total else "interrupted between patches") +
                     f"; run `dsadapt continue {entry.ref}` or `dsadapt abort {entry.ref}`")
        return st
    if co.git.is_dirty():
        st.state, st.detail = "dirty", f"uncommitted changes: {', '.join(co.git.dirty_files()[:5])}"
        return st
    if applied and st.head == applied.get("head"):
        if applied.get("needs_refresh"):
            st.state = "diverged"
            st.detail = (f"resolved or skipped during apply: {', '.join(applied['needs_refresh'])}; "
                         f"run `dsadapt refresh {entry.ref}` to export the branch")
        elif applied.get("stack_hash") == stack.hash:
            st.state, st.detail = "stack applied", f"{plural(len(stack), 'patch')} on {st.base[:12] if st.base else '?'}"
        else:
            st.state, st.detail = "stack outdated", f"patches/ changed since apply; run `dsadapt apply {entry.ref}`"
        return st
    if st.head == st.base:
        st.state, st.detail = "clean base", "upstream tree, no patches applied"
        return st
    n = co.git.out("rev-list", "--count", f"{(applied or {}).get('head') or st.base}..{st.head}") \
        if st.head and co.git.rev((applied or {}).get('head') or st.base or "") else "?"
    st.state, st.detail = "diverged", f"{n} new commit(s) on {co.branch}; run `dsadapt refresh {entry.ref}` to export them"
    return st

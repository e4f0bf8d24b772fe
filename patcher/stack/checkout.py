"""The checkout: one git repository per pin under the work dir, made from a verified source, and its
dsadapt state (state.json, the refs dsadapt keeps there).

`ensure_checkout` materializes a pin's tree (git, mirror or release artifact, verified against the
lock) into `checkouts/<engine>/<tag>/`; `Checkout` names what lives in it. Nothing here changes a
checkout that exists: every change goes through the transaction (transaction.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from patcher.base import leftovers
from patcher.base.config import Config
from patcher.base.errors import DsadaptError, VerificationError, WorkspaceError
from patcher.base.fsutil import atomic_write_text
from patcher.base.gitutil import FIXED_DATE, Git, clear_stale_locks, init_repo
from patcher.formats.lock import Lock, LockEntry
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import SYMLINK_MODE, Stack, expected_preimages, preimage_mismatches
from patcher.stack.state import State

BASE_REF = "refs/dsadapt/base"
STACK_REF = "refs/dsadapt/stack"          # the stack files (series + patches) last applied or exported
BACKUP_PREFIX = "refs/dsadapt/backup/"
OP_PREFIX = "refs/dsadapt/op/"            # (refs of ops recorded by earlier versions; cleaned up)

Progress = Callable[[str], None]


def branch_name(tag: str) -> str:
    return f"dsadapt/{tag}"


class Checkout:
    """One checkout directory (a normal git repository) and its dsadapt state."""

    def __init__(self, cfg, ref):
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
    def am_dir(self) -> Path:
        return self.path / ".git" / "rebase-apply"

    @property
    def branch(self) -> str:
        return branch_name(self.ref.tag)

    @property
    def branch_ref(self) -> str:
        return f"refs/heads/{self.branch}"

    def load(self) -> State:
        try:
            return State.from_json(json.loads(self.state_path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise WorkspaceError(f"{self.path} has no dsadapt state", hint=f"run `dsadapt apply {self.ref}`") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WorkspaceError(f"{self.path}: unreadable dsadapt state ({e.__class__.__name__}: {e})",
                                 hint=f"move the directory away and run `dsadapt apply {self.ref}` again") from None

    def load_state(self) -> dict:
        """The state as JSON (what `.git/dsadapt/state.json` holds)."""
        return self.load().to_json()

    def save(self, state: State) -> None:
        atomic_write_text(self.state_path, json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n")

    def am_in_progress(self) -> bool:
        return self.am_dir.exists()

    def base(self) -> str:
        """refs/dsadapt/base (it never moves once the checkout exists: read once)."""
        b = getattr(self, "_base", None) or self.git.rev(BASE_REF)
        if not b:
            raise WorkspaceError(f"{self.path}: {BASE_REF} is missing", hint="the checkout is damaged; move it away and re-apply")
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

    def problem(self, co: Checkout) -> tuple[str, str] | None:
        """(what, how to reconcile) when HEAD holds work that is not on the stack branch."""
        br = co.branch
        if self.branch is None and self.only_head:
            short = (self.head or "?")[:12]
            if self.branch_head and self.head and self.branch_head != self.head and self._on_top(co):
                fix = f"`git checkout -B {br}` makes them the stack branch's (then `dsadapt refresh {co.ref}`)"
            else:
                fix = f"`git switch -c NAME` keeps them on a branch of yours (or cherry-pick them onto {br})"
            return (f"HEAD is detached at {short} with {self.only_head} commit(s) on no branch",
                    f"{fix}; `dsadapt apply {co.ref} --force` keeps them in a backup ref and re-applies the stack")
        if self.branch is not None and self.branch != br and self.beyond:
            if self.branch_head is None:
                fix = f"if you renamed the stack branch, `git branch -m {self.branch} {br}`, then `dsadapt refresh {co.ref}`"
            else:
                fix = f"`git checkout -B {br}` makes them the stack branch's (then `dsadapt refresh {co.ref}`)"
            missing = f"; branch {br} is missing" if self.branch_head is None else ""
            return (f"HEAD is on branch {self.branch} with {self.beyond} commit(s) not on {br}{missing}",
                    f"{fix}; or `dsadapt apply {co.ref} --force` (branch {self.branch} stays as it is)")
        return None

    def _on_top(self, co: Checkout) -> bool:
        return co.git.run("merge-base", "--is-ancestor", self.branch_head or "", self.head or "", check=False).ok


def head_state(co: Checkout) -> HeadState:
    """HEAD, the stack branch and, only where HEAD is off that branch, how much work sits there
    (one `for-each-ref` in the usual case, one `rev-list` more otherwise)."""
    g = co.git
    branch, head, refs = g.head()
    st = HeadState(branch, head, refs.get(co.branch_ref), refs)
    if head and branch is None and head != st.branch_head:
        st.only_head = int(g.out("rev-list", "--count", head, "--not", "--branches", "--tags", "--remotes",
                                 "--glob=refs/dsadapt/*") or 0)
    elif head and branch is not None and branch != co.branch:
        since = st.branch_head or g.rev(BASE_REF)
        st.beyond = int(g.out("rev-list", "--count", head, *([f"^{since}"] if since else [])) or 0)
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
    def __init__(self, cfg, ref, path: Path):
        super().__init__(cfg, ref)
        self.path = path
        self.git = Git(path)


def ensure_checkout(cfg: Config, lock: Lock, entry: LockEntry, progress: Progress | None = None) -> tuple[Checkout, bool]:
    """The pin's checkout, materialized from a verified source if it does not exist yet.

    It is built under `.TAG.tmp-PID` and renamed into place when complete, so a kill leaves
    either no checkout or a whole one; leftovers of dead runs are removed first."""
    co = Checkout(cfg, entry.ref)
    if co.exists:
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

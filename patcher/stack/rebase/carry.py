"""rebase: carry OLD's stack forward onto NEW and say what happened to each patch.

The replay is an op of kind "rebase" in NEW's checkout, run by the same `Transaction` as apply
(one `git am -3` for the whole stack; a conflict stops it, `dsadapt continue / skip / abort`
finish it). This module registers the kind: what is decided before am runs (Drop-When), what a
stop means (already upstream?), how an applied or empty patch is classified, and how the op
finishes (NEW's stack, the report) or is undone (the lock entry, comparison refs, patches/NEW).

Every patch gets one classification (docs/rebase.md):

- upstream: its Drop-When spec matches NEW's version; or `git am -3` found nothing left to
  commit; or it stopped am and its patch-id is in NEW's history or it reverse-applies onto NEW
  (exactly, then ignoring whitespace). Dropped from NEW's stack.
- clean:   applied with the same hunks (only the index line's blob ids differ).
- merged:  applied without help, but at an offset or through a 3-way merge (context differs).
- changed: stopped on a conflict the user resolved (`dsadapt continue`).
- skipped: stopped on a conflict the user dropped (`dsadapt skip`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from patcher.base.config import Config
from patcher.base.dotgit import BASE_REF, REBASE_FROM_BASE, REBASE_FROM_HEAD, STACK_REF
from patcher.base.errors import StackError, WorkspaceError
from patcher.base.fsutil import atomic_write_text, remove_file
from patcher.base.gitutil import Git, link_objects
from patcher.engines.registry import adapter
from patcher.formats.lock import Lock, format_lock, load_lock, parse_lock, write_lock
from patcher.formats.patchfile import Patch, drop_when_satisfied, parse_patch
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import Stack, load_stack, refuse_unsafe_links, stack_dir, touches_links
from patcher.stack.checkout import (
    Checkout,
    Progress,
    ensure_checkout,
    head_state,
    refuse_hand_made,
    stack_files,
    tree_links,
)
from patcher.stack.rebase.summary import (
    CARRIED,
    PatchReport,
    RebaseReport,
    format_markdown,
    report_stem,
    split_range_diff,
)
from patcher.stack.refresh import (
    changed_lines,
    export_commits,
    exported_files,
    files_hash,
    series_names,
    sync_stack_dir,
)
from patcher.stack.state import WAITING, Applied, Op, Orig, Outcome, PatchMeta, PatchOutcome
from patcher.stack.transaction import StackResult, Transaction, flat_tree_id, register
from patcher.upstream.resolve import resolve_pin

FROM_BASE = REBASE_FROM_BASE
FROM_HEAD = REBASE_FROM_HEAD
PATCH_ID_HISTORY = 5000  # commits of NEW's history searched by patch-id
RANGE_DIFF_CREATION = 100  # git's default (60) leaves small patches with moved context unpaired


# ---------------------------------------------------------------- pure helpers


def hunks_key(diff: str) -> str:
    """A diff without its index lines: equal keys mean the same hunks at the same places."""
    return "\n".join(l for l in diff.split("\n") if not l.startswith("index "))


def drop_when_hit(patch: Patch, dists: tuple[str, ...], version: str) -> str | None:
    from packaging.requirements import InvalidRequirement

    for spec in patch.trailer_values("Drop-When"):
        try:
            if drop_when_satisfied(spec, dists, version):
                return f"Drop-When {spec} matches {version}"
        except InvalidRequirement:
            continue  # `dsadapt verify` reports malformed specs
    return None


def applied_detail(old: Patch, new: Patch, three_way: bool) -> tuple[Outcome, str]:
    """(outcome, detail) for a patch git applied on its own."""
    if hunks_key(old.diff) == hunks_key(new.diff):
        return Outcome.CLEAN, "same hunks" + (" (after a 3-way merge)" if three_way else "")
    how = "3-way merge" if three_way else "applied at an offset"
    same = changed_lines(old.diff) == changed_lines(new.diff)
    return Outcome.MERGED, f"{how}; {'only context and line numbers differ' if same else 'changed lines differ'}"


# ---------------------------------------------------------------- detection (git, read-only)


def _patch_id(git: Git, text: str) -> str | None:
    out = git.run("patch-id", "--stable", input=text, check=False).out.split()
    return out[0] if out else None


def upstream_by_patch_id(git: Git, text: str, patch: Patch, new_base: str, old_base: str) -> str | None:
    """The patch's patch-id among NEW's commits (not OLD's) that touch its files."""
    pid = _patch_id(git, text)
    paths = list(patch.touched_paths)
    if not pid or not paths:
        return None
    excl = [f"^{old_base}"] if old_base != new_base else []
    log = git.run("log", "--no-merges", "-p", "--full-index", "--no-color", "--no-renames", "--format=commit %H",
                  f"-n{PATCH_ID_HISTORY}", new_base, *excl, "--", *paths, check=False)
    if not log.ok or not log.out.strip():
        return None
    for line in git.run("patch-id", "--stable", input=log.out, check=False).out.splitlines():
        got, _, commit = line.partition(" ")
        if got == pid:
            return f"patch-id {pid[:12]} matches upstream commit {commit[:12]}"
    return None


def upstream_by_reverse_apply(git: Git, text: str, tree: str) -> str | None:
    """Whether the patch reverse-applies onto `tree` (its change is already there), checked in a
    temporary index: the work tree is not read."""
    with git.temp_index(tree) as t:
        if t.run("apply", "--cached", "--reverse", "--check", input=text, check=False).ok:
            return "reverse-applies onto NEW (its change is already there)"
        if t.run("apply", "--cached", "--reverse", "--check", "--ignore-whitespace", input=text, check=False).ok:
            return "reverse-applies onto NEW ignoring whitespace (same change, other formatting)"
    return None


# ---------------------------------------------------------------- the op kind


def report_paths(cfg: Config, engine: str, old: str, new: str) -> tuple[Path, Path]:
    d, stem = cfg.reports_root / "rebase", report_stem(engine, old, new)
    return d / f"{stem}.md", d / f"{stem}.json"


class RebaseKind:
    name = "rebase"
    verb = "rebase"
    touches_checkout = True

    # the steps before the checkout is touched (idempotent)
    def prepare(self, tx: Transaction) -> None:
        ex = tx.op.extra
        cfg = tx.co.cfg
        if ex.get("lock_after") is not None:
            _move_lock(cfg.lock_path, ex["lock_before"], ex["lock_after"], str(tx.co.ref), pinned=True)
        old = PinRef(*ex["from"].split("@", 1))
        g = tx.git
        base = tx.co.base()
        if old == tx.co.ref:
            g.update_ref(FROM_BASE, base)
            old_co = tx.co
        else:
            # OLD's objects (its base tree, its stack's commits) into NEW's repository: the blobs on the
            # patches' index lines are OLD's, and `git am -3` and range-diff need them here.
            old_co = Checkout(cfg, old)
            old_base = old_co.base()
            try:
                link_objects(old_co.path / ".git", tx.co.path / ".git")
                ok = g.rev(old_base) is not None
            except OSError:
                ok = False
            if ok:
                g.update_ref(FROM_BASE, old_base)
            else:
                g.run("fetch", "-q", "--no-tags", "--update-shallow", str(old_co.path), f"+{BASE_REF}:{FROM_BASE}")
        from_base = g.rev(FROM_BASE)
        assert from_base
        from_head = _old_head(tx, old_co, from_base)
        if from_head != g.rev(FROM_HEAD):
            g.update_ref(FROM_HEAD, from_head)
        ex["from_base"], ex["from_head"] = from_base, from_head

    def pre_outcomes(self, tx: Transaction) -> dict[int, tuple[Outcome, str]]:
        ex = tx.op.extra
        out = {}
        for i, text in enumerate(tx.texts(), 1):
            hit = drop_when_hit(parse_patch(text, where=tx.op.meta(i).name), tuple(ex["dists"]), ex["to_version"])
            if hit:
                out[i] = (Outcome.UPSTREAM, hit)
        return out

    def on_stop(self, tx: Transaction, index: int) -> str | None:
        text = tx.texts()[index - 1]
        patch = parse_patch(text, where=tx.op.meta(index).name)
        g = tx.git
        head = g.rev("HEAD")
        assert head
        base = tx.co.base()
        return upstream_by_patch_id(g, text, patch, base, tx.op.extra.get("from_base") or base) \
            or upstream_by_reverse_apply(g, text, head)

    def label(self, tx: Transaction, index: int, commit: str | None, merged: bool | None) -> tuple[Outcome, str | None]:
        g = tx.git
        text = tx.texts()[index - 1]
        old = parse_patch(text, where=tx.op.meta(index).name)
        if commit is None:
            before = _commit_before(tx, index) or tx.co.base()
            return Outcome.UPSTREAM, (_by_patch_id(tx, text, old) or upstream_by_reverse_apply(g, text, before)
                                or "the 3-way merge left nothing to commit (already in NEW)")
        am = tx.op.am
        assert am is not None
        head = g.rev("HEAD") or commit
        key = ("exported", am.start, head)  # one format-patch for the commits of this am run
        if key not in tx.cache:
            commits = [c for c, _, _ in g.commits(f"{am.start}..{head}")]
            tx.cache[key] = dict(zip(commits, export_commits(g, am.start, head)))
        new = tx.cache[key].get(commit) or export_commits(g, f"{commit}^", commit)[0]
        return applied_detail(old, new, bool(merged))

    def finish(self, tx: Transaction) -> StackResult:
        """Write NEW's stack and the report; close the op. Safe to run again after a kill."""
        op, g, co = tx.op, tx.git, tx.co
        ex = op.extra
        cfg = co.cfg
        base, head = co.base(), g.rev("HEAD")
        assert head
        tx.refuse_links_out_of_tree(head)
        d = cfg.project / ex["stack_dir"]
        cur_series = (d / "series").read_text(encoding="utf-8") if (d / "series").is_file() else None
        files, names = exported_files(export_commits(g, base, head), cur_series)
        if "written" not in ex:
            ex["written"] = names
            ex["names_before"] = series_names(cur_series.encode("utf-8")) if cur_series else []
            tx.write()
        sync_stack_dir(d, files, ex["names_before"])
        new_hash = files_hash(files, names)
        md, js = report_paths(cfg, co.ref.engine, ex["from"].split("@", 1)[1], co.ref.tag)
        if "reports_before" not in ex:
            ex["reports_before"] = {_portable(cfg, p): (p.read_text(encoding="utf-8") if p.is_file() else None)
                                    for p in (md, js)}
            tx.write()
        report = _report(tx, base, head, names, new_hash)
        atomic_write_text(md, format_markdown(report))
        atomic_write_text(js, json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
        snap = tx.files_commit(files)
        if g.rev(STACK_REF) != snap:
            g.update_ref(STACK_REF, snap)
        kept = op.saves.get("stack") if ex.get("replaces_stack") else None
        if kept and g.rev(kept):
            note = (f"the stack it replaced in {ex['stack_dir']}/ is kept as {kept} "
                    f"(git -C {co.path} show {kept}:series)")
            if note not in tx.notes:
                tx.notes.append(note)
        res = tx.result(head, new_hash)
        tx.close(Applied(new_hash, head, [], snap, flat_tree_id(files)))
        return res

    def undo(self, tx: Transaction) -> None:
        op, co, g = tx.op, tx.co, tx.git
        ex = op.extra
        cfg = co.cfg
        g.delete_ref(FROM_BASE)
        g.delete_ref(FROM_HEAD)
        for rel, text in (ex.get("reports_before") or {}).items():
            p = _resolve(cfg, rel)
            if text is None:
                remove_file(p)
            elif not p.is_file() or p.read_text(encoding="utf-8") != text:
                atomic_write_text(p, text)
        d = cfg.project / ex["stack_dir"]
        if ex.get("identity") or ex.get("replaces_stack"):
            before = tx.read_files(op.snapshot)
            sync_stack_dir(d, before, ex.get("written") or [])
            if ex.get("replaces_stack") and op.saves.get("stack"):
                g.delete_ref(op.saves["stack"])  # everything it held is back in patches/
        else:
            written = set(ex.get("written") or [])
            if d.is_dir():
                cur = series_names((d / "series").read_bytes()) if (d / "series").is_file() else []
                for name in sorted(written | set(cur)):
                    remove_file(d / name)
                remove_file(d / "series")
                with contextlib.suppress(OSError):
                    d.rmdir()
        if ex.get("lock_before") is not None:
            _move_lock(cfg.lock_path, ex["lock_after"], ex["lock_before"], str(co.ref), pinned=False)


    def describe(self, co: Checkout, op: Op) -> tuple[str, str, str | None] | None:
        return None


register(RebaseKind())


def _by_patch_id(tx: Transaction, text: str, patch: Patch) -> str | None:
    """patch-id search, where NEW's checkout has history to search (not a release-artifact snapshot,
    not a shallow single commit)."""
    base = tx.co.base()
    if (tx.state.source or {}).get("snapshot"):
        return None
    shallow = tx.co.path / ".git" / "shallow"
    if shallow.is_file() and base in shallow.read_text().split():
        return None
    return upstream_by_patch_id(tx.git, text, patch, base, tx.op.extra.get("from_base") or base)


def _portable(cfg: Config, p: Path) -> str:
    """A path for the op record that survives moving the project and work dir: relative to one of them."""
    for prefix, root in (("project:", cfg.project), ("workdir:", cfg.workdir)):
        try:
            return prefix + str(p.relative_to(root))
        except ValueError:
            continue
    return str(p)


def _resolve(cfg: Config, s: str) -> Path:
    if s.startswith("project:"):
        return cfg.project / s[len("project:"):]
    if s.startswith("workdir:"):
        return cfg.workdir / s[len("workdir:"):]
    return cfg.project / s  # relative paths of older records are the project's


def _move_lock(path: Path, frm: str, to: str, key: str, *, pinned: bool) -> None:
    """Make upstream.lock hold `to` where it holds `frm` (nothing to do where it holds `to`); a lock
    someone edited meanwhile gets only the one change: `key` pinned (its entry as `to` has it) or
    unpinned. Rolling forward pins NEW (`frm` the lock before, `to` after); rolling back unpins it."""
    cur = path.read_text(encoding="utf-8")
    if cur == to:
        return
    if cur == frm:
        atomic_write_text(path, to)
        return
    lock = load_lock(path)
    if pinned and key not in lock.pins:
        write_lock(lock.with_pin(parse_lock(to, path).pin(key)), path)
    elif not pinned and key in lock.pins:
        write_lock(replace(lock, pins={k: v for k, v in lock.pins.items() if k != key}), path)


def _commit_before(tx: Transaction, index: int) -> str | None:
    """The commit the patch at `index` was applied on top of (the last commit before it)."""
    op = tx.op
    am = op.am
    assert am is not None
    prev = am.start
    for i in am.indices:
        if i == index:
            break
        o = op.outcomes.get(i)
        if o is not None and o.commit:
            prev = o.commit
    return prev


def _old_head(tx: Transaction, old_co: Checkout, from_base: str) -> str:
    """OLD's stack applied onto OLD's base, as commits in NEW's repository (for range-diff and for
    the pre-image blobs `git am -3` needs). OLD's checkout already holds exactly that when its
    stack is applied there: fetched. Otherwise built in a temporary index (no work tree)."""
    g = tx.git
    old_ref = old_co.ref
    cfg = tx.co.cfg
    old_stack = load_stack(cfg.patches_root, old_ref)
    if not old_stack.entries:
        return from_base
    try:
        st = old_co.load()
    except WorkspaceError:
        st = None
    if st and not st.op and st.applied and st.applied.stack_hash == old_stack.hash and not st.applied.needs_refresh:
        head = old_co.git.rev(old_co.branch_ref)
        if head == st.applied.head and head:
            if old_co.path == tx.co.path or g.rev(head):  # its objects are here (linked above)
                return head
            g.run("fetch", "-q", "--no-tags", "--update-shallow", str(old_co.path), f"+{old_co.branch_ref}:{FROM_HEAD}")
            got = g.rev(FROM_HEAD)
            if got == head:
                return head
    parent = from_base
    with g.temp_index(from_base) as t:
        for e in old_stack.entries:
            if not t.run("apply", "--cached", input=e.text, check=False).ok:
                raise StackError(f"{old_ref}: {e.name} does not apply onto {old_ref}'s own base",
                                 hint=f"run `dsadapt verify {old_ref}` and fix that stack first")
            tree = t.out("write-tree")
            msg = e.patch.message
            name, _, email = e.patch.author.rpartition(" <")
            parent = t.out("commit-tree", tree, "-p", parent, input=msg, fixed_dates=True,
                           env={"GIT_AUTHOR_NAME": name or "dsadapt", "GIT_AUTHOR_EMAIL": email.rstrip(">")})
    return parent


def _report(tx: Transaction, base: str, head: str, names: list[str], new_hash: str) -> RebaseReport:
    op, co, g = tx.op, tx.co, tx.git
    ex = op.extra
    from_base, from_head = g.rev(FROM_BASE), g.rev(FROM_HEAD)
    rd_cmd = f"git range-diff {FROM_BASE}..{FROM_HEAD} {BASE_REF}..{co.branch}"
    outcomes = [op.outcomes[i] for i in sorted(op.outcomes)]
    blocks = _range_diff_blocks(g, from_base, from_head, base, head, outcomes)
    carried = iter(names)
    details = ex.get("details", {})
    reports = []
    for o in outcomes:
        new_name = next(carried, None) if o.outcome in CARRIED else None
        reports.append(PatchReport(o.index, o.name, o.subject, o.outcome, _detail(o.outcome, details.get(str(o.index))),
                                   new_name, blocks.get(o.index, "")))
    old_ref = PinRef(*ex["from"].split("@", 1))
    return RebaseReport(
        engine=co.ref.engine, old=old_ref.tag, new=co.ref.tag, old_version=ex["from_version"],
        new_version=ex["to_version"], date=report_date(),
        old_source=ex["from_source"], new_source=_source_words(tx.state.source),
        pinned_new=ex.get("lock_before") is not None, old_stack_hash=op.stack_hash,
        new_stack_hash=new_hash, range_diff_command=rd_cmd, patches=reports,
        direction=ex.get("direction") or direction(ex["from_version"], ex["to_version"]))


def report_date() -> str:
    """The report's `date`: SOURCE_DATE_EPOCH where it is set (reproducible reports: the upstream
    workflow sets it to the project commit's time), else now (UTC, ISO 8601)."""
    import os

    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    when = datetime.fromtimestamp(int(epoch), UTC) if epoch.isdigit() else datetime.now(UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def direction(old_version: str, new_version: str) -> str:
    """'forward' (onto a newer release), 'backward' (onto an older one: a backport) or 'same'."""
    from patcher.formats.lock import version_key

    a, b = version_key(old_version), version_key(new_version)
    if a[0] != b[0]:
        return "forward" if a[0] > b[0] else "backward"  # (a release version sorts before a branch name)
    return "forward" if b > a else "backward" if b < a else "same"


def _detail(outcome: Outcome, recorded: str | None) -> str:
    if recorded:
        return recorded
    return {Outcome.CHANGED: "conflict resolved by the user (dsadapt continue)",
            Outcome.SKIPPED: "conflict; dropped by the user (dsadapt skip)",
            Outcome.CLEAN: "applied"}.get(outcome, "")


def _range_diff_blocks(git: Git, from_base: str | None, from_head: str | None, base: str, head: str,
                       outcomes: list[PatchOutcome]) -> dict[int, str]:
    """`git range-diff` of OLD's applied commits against NEW's, one block per OLD patch.

    A carried patch whose context changed a lot can come out unpaired (`<` then `>`); we know
    which commit it became, so such a patch gets its own one-pair range-diff instead.
    """
    if not from_base or not from_head or from_base == from_head:
        return {}
    r = git.run("range-diff", "--no-color", f"--creation-factor={RANGE_DIFF_CREATION}",
                f"{from_base}..{from_head}", f"{base}..{head}", check=False)
    blocks = split_range_diff(r.out) if r.ok else {}
    old_commits = git.out("rev-list", "--reverse", f"{from_base}..{from_head}").split()
    for o in outcomes:
        i = o.index
        if o.outcome not in CARRIED or not o.commit or " < " not in blocks.get(i, " < ") or i > len(old_commits):
            continue
        pair = git.run("range-diff", "--no-color", f"--creation-factor={RANGE_DIFF_CREATION}",
                       f"{old_commits[i - 1]}^!", f"{o.commit}^!", check=False)
        one = split_range_diff(pair.out).get(1) if pair.ok else None
        if one:
            blocks[i] = one
    return blocks


def _source_words(src: dict | None) -> str:
    """The tree a checkout holds, in words that depend on the lock's pin only: `pypi FILE` (the
    release artifact unpacked) or `git tree ID` (a git clone or a mirror, verified against the
    lock: never this machine's mirror path)."""
    if not src:
        return "unknown"
    if src.get("kind") == "pypi":
        return f"pypi {src.get('origin')}"
    return f"git tree {src.get('tree')}"


def source_mismatch(src: dict | None, entry) -> str | None:
    """Why an existing checkout does not hold the tree the lock pins now (made from another
    release artifact, or under another commit), or None."""
    if not src:
        return None
    if src.get("kind") == "pypi":
        art = entry.source_artifact()
        if art is not None and src.get("origin") != art.file:
            return f"it was unpacked from {src.get('origin')}; the lock's source artifact is {art.file}"
        return None
    if (entry.commit and src.get("commit") == entry.commit) or (entry.tree and src.get("tree") == entry.tree):
        return None
    if entry.commit or entry.tree:
        return f"it holds tree {str(src.get('tree'))[:12]}, not the one the lock pins"
    return None


def _reused(co: Checkout, created: bool, entry) -> None:
    """Refuse a checkout made earlier from something the lock no longer pins (a leftover of another
    lock): the rebase would silently carry the stack onto another tree."""
    if created:
        return
    why = source_mismatch(co.load().source, entry)
    if why:
        from patcher.base.errors import VerificationError

        raise VerificationError(f"{entry.ref}: the existing checkout {co.path} does not match upstream.lock: {why}",
                                hint=f"move it away (`mv {co.path} {co.path}.old`); the next rebase makes it "
                                     "again from the lock")


def load_report(cfg: Config, engine: str, old: str, new: str) -> dict:
    return json.loads(report_paths(cfg, engine, old, new)[1].read_text(encoding="utf-8"))


# ---------------------------------------------------------------- start


def _check_target(co: Checkout, tx: Transaction, new_ref: PinRef) -> str | None:
    """Refuse a NEW checkout that holds work; returns its branch head (None if absent)."""
    if tx.state.op is not None:
        tx.refuse()
    refuse_hand_made(co, False)
    off = head_state(co).problem(co)
    if off:
        raise WorkspaceError(f"{new_ref}: {off[0]} in {co.path}", hint=off[1])
    if co.git.is_dirty():
        raise WorkspaceError(f"{new_ref}: {co.path} has uncommitted changes",
                             hint="commit them and `dsadapt refresh`, or discard them, then rebase")
    head = co.git.rev(co.branch_ref)
    applied = tx.state.applied
    expected = applied.head if applied else co.base()
    if head and head not in (expected, co.base()):
        raise WorkspaceError(f"{new_ref}: branch {co.branch} has commits not exported to a stack",
                             hint=f"`dsadapt refresh {new_ref}` exports them to that pin's stack; a rebase with "
                                  "--force then replaces that stack (keeping it in a backup ref)")
    return head


def rebase_stack(cfg: Config, lock: Lock, old_ref: PinRef, new_tag: str, *, progress: Progress | None = None,
                 on_patch=None, force: bool = False) -> tuple[StackResult, list[str]]:
    """Replay OLD's stack onto NEW (pinning NEW first if needed). Returns (result, notes).

    A stack already in patches/ENGINE/NEW is refused, or with `force` replaced: its files are kept
    in a backup ref of NEW's checkout (named in the notes) and put back by an abort.
    Raises ConflictStop when a patch needs the user; the op then waits in NEW's checkout.
    """
    old_entry = lock.pin(old_ref)
    new_ref = PinRef(old_ref.engine, new_tag)
    old_stack = load_stack(cfg.patches_root, old_ref)  # parse everything before touching anything
    identity = new_ref == old_ref
    new_dir = stack_dir(cfg.patches_root, new_ref)
    new_co = Checkout(cfg, new_ref)
    if new_co.exists and new_co.has_op():  # before anything slow: a rerun after a kill, or a stop
        tx = Transaction.open(new_co, on_patch, progress)
        op = tx.op
        if op.kind == "rebase" and op.extra.get("from") == str(old_ref) and op.phase not in WAITING:
            if progress:
                progress(f"finishing the interrupted rebase of {old_ref} onto {new_ref} first")
            return tx.run(), ["finished the interrupted rebase", *tx.notes]
        tx.refuse()
    replaced: Stack | None = None
    if not identity and (new_dir / "series").exists():
        if not force:
            raise WorkspaceError(f"{new_ref} already has a stack ({new_dir.relative_to(cfg.project) if new_dir.is_relative_to(cfg.project) else new_dir}/series)",
                                 hint=f"`dsadapt apply {new_ref}` uses it; `dsadapt rebase {old_ref} --onto {new_tag} "
                                      f"--force` replaces it (the stack there is kept in a backup ref of "
                                      f"{new_ref}'s checkout, and an abort puts it back)")
        replaced = load_stack(cfg.patches_root, new_ref)  # parsed before anything changes
    notes: list[str] = []
    lock_before = lock_after = None
    if str(new_ref) not in lock.pins:
        entry, pin_notes = resolve_pin(cfg, lock, new_ref, progress=progress)
        notes += pin_notes
        lock_before = cfg.lock_path.read_text(encoding="utf-8")
        lock = lock.with_pin(entry)
        lock_after = format_lock(lock)
        notes.append(f"pinned {new_ref} in upstream.lock")
        if progress:
            for n in notes:
                progress(n)
    new_entry = lock.pin(new_ref)
    way = direction(old_entry.version, new_entry.version)
    if way == "backward":
        notes.append(f"backward: {new_ref} ({new_entry.version}) is older than {old_ref} ({old_entry.version}): "
                     "the stack is carried back (a backport)")
        if progress:
            progress(notes[-1])
    old_co, made = ensure_checkout(cfg, lock, old_entry, progress)
    _reused(old_co, made, old_entry)
    co, made = ensure_checkout(cfg, lock, new_entry, progress)
    _reused(co, made, new_entry)
    tx = Transaction.open(co, on_patch, progress)
    head_branch = _check_target(co, tx, new_ref)
    base = co.base()
    if touches_links(old_stack.patches):  # OLD's patches onto NEW's tree: NEW's links count
        refuse_unsafe_links(old_stack, tree_links(co.git, base))
    g = co.git
    if progress:
        progress(f"replaying {old_ref}'s {len(old_stack)} patch(es) onto {new_ref}")
    ad = adapter(old_ref.engine)
    refs = g.revs("HEAD", STACK_REF)
    names = iter(co.next_backup_names(2))
    saves = {"branch": next(names)} if head_branch and head_branch != base else {}
    if replaced is not None:
        saves["stack"] = next(names)
    op = Op(kind="rebase", ref=str(new_ref), stack_hash=old_stack.hash,
            patches=[PatchMeta(e.name, e.patch.subject) for e in old_stack.entries],
            orig=Orig(g.current_branch(), refs["HEAD"], head_branch, refs[STACK_REF], False), saves=saves,
            extra={"from": str(old_ref), "from_version": old_entry.version, "to_version": new_entry.version,
                   "from_source": _source_words(old_co.load().source), "dists": [ad.name, *ad.pypi],
                   "lock_before": lock_before, "lock_after": lock_after, "details": {}, "identity": identity,
                   "stack_dir": str(new_dir.relative_to(cfg.project)), "stop_prefix": f"rebasing {old_ref}: ",
                   "direction": way,
                   "replaces_stack": replaced is not None})
    tx.begin(op, [e.text for e in old_stack.entries],
             stack_files(old_stack) if identity else stack_files(replaced) if replaced is not None else None)
    if replaced is not None and op.snapshot:  # the stack it replaces, kept before anything changes
        g.update_ref(saves["stack"], op.snapshot)  # the result's notes name it (finish)
        op.saved[saves["stack"]] = op.snapshot
        tx.write()
    return tx.run(), notes

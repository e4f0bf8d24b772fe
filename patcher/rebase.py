"""rebase: carry OLD's stack forward onto NEW, patch by patch, and say what happened to each.

The replay runs inside NEW's checkout under workspace's transaction (state file, op dir,
backup refs), as an op of kind "rebase": a conflict stops it exactly like `apply`, and
`dsadapt continue / skip / abort` finish it. `workspace` hands rebase ops back to
`run_rebase_patches` and `undo_rebase_extras` here.

Every patch gets one classification (docs/rebase.md):

- upstream: its Drop-When spec matches NEW's version; or, when it does not apply forward, its
  patch-id is in NEW's history, or it reverse-applies (exactly, then ignoring whitespace), or
  the 3-way merge leaves nothing to commit. Dropped from NEW's stack.
- clean:   applied with the same hunks (only the index line's blob ids differ).
- merged:  applied without help, but at an offset or through a 3-way merge (context differs).
- changed: stopped on a conflict the user resolved (`dsadapt continue`).
- skipped: stopped on a conflict the user dropped (`dsadapt skip`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

from .config import Config
from .engines import adapter
from .errors import StackError, WorkspaceError
from .fsutil import atomic_write_text
from .gitutil import Git
from .lock import Lock, load_lock, write_lock
from .patchfile import Patch, drop_when_satisfied, parse_patch
from .pin import resolve_pin
from .pinref import PinRef
from .rebase_report import CARRIED, PatchReport, RebaseReport, format_markdown, report_stem, split_range_diff
from .stack import Stack, load_stack, stack_dir, write_stack
from .workspace import (
    BASE_REF,
    Checkout,
    PatchOutcome,
    Progress,
    StackResult,
    ensure_checkout,
    export_commits,
    stop_on_conflict,
)

FROM_BASE = "refs/dsadapt/rebase-from/base"
FROM_HEAD = "refs/dsadapt/rebase-from/head"
PATCH_ID_HISTORY = 5000  # commits of NEW's history searched by patch-id
RANGE_DIFF_CREATION = 100  # git's default (60) leaves small patches with moved context unpaired


# ---------------------------------------------------------------- pure helpers


def hunks_key(diff: str) -> str:
    """A diff without its index lines: equal keys mean the same hunks at the same places."""
    return "\n".join(l for l in diff.split("\n") if not l.startswith("index "))


def changed_lines(diff: str) -> list[str]:
    """The +/- lines of a diff (file headers excluded): the change itself, without context."""
    return [l for l in diff.split("\n") if l[:1] in ("+", "-") and not l.startswith(("+++ ", "--- "))]


def drop_when_hit(patch: Patch, dists: tuple[str, ...], version: str) -> str | None:
    from packaging.requirements import InvalidRequirement

    for spec in patch.trailer_values("Drop-When"):
        try:
            if drop_when_satisfied(spec, dists, version):
                return f"Drop-When {spec} matches {version}"
        except InvalidRequirement:
            continue  # `dsadapt verify` reports malformed specs
    return None


def applied_detail(old: Patch, new: Patch, three_way: bool) -> tuple[str, str]:
    """(outcome, detail) for a patch git applied on its own."""
    if hunks_key(old.diff) == hunks_key(new.diff):
        return "clean", "same hunks" + (" (after a 3-way merge)" if three_way else "")
    how = "3-way merge" if three_way else "applied at an offset"
    same = changed_lines(old.diff) == changed_lines(new.diff)
    return "merged", f"{how}; {'only context and line numbers differ' if same else 'changed lines differ'}"


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
    excl = [f"^{old_base}"] if old_base != new_base and git.rev(old_base) else []
    log = git.run("log", "--no-merges", "-p", "--full-index", "--no-color", "--no-renames", "--format=commit %H",
                  f"-n{PATCH_ID_HISTORY}", new_base, *excl, "--", *paths, check=False)
    if not log.ok or not log.out.strip():
        return None
    for line in git.run("patch-id", "--stable", input=log.out, check=False).out.splitlines():
        got, _, commit = line.partition(" ")
        if got == pid:
            return f"patch-id {pid[:12]} matches upstream commit {commit[:12]}"
    return None


def upstream_by_reverse_apply(git: Git, patch_file: Path) -> str | None:
    if git.run("apply", "--reverse", "--check", str(patch_file), check=False).ok:
        return "reverse-applies onto NEW (its change is already there)"
    if git.run("apply", "--reverse", "--check", "--ignore-whitespace", str(patch_file), check=False).ok:
        return "reverse-applies onto NEW ignoring whitespace (same change, other formatting)"
    return None


def find_upstream(git: Git, patch_file: Path, text: str, patch: Patch, dists: tuple[str, ...], version: str,
                  new_base: str, old_base: str) -> str | None:
    """Why the patch is already in NEW, or None. Only patches that do not apply forward are searched,
    so a change that was merged and later reverted upstream is carried, not dropped."""
    hit = drop_when_hit(patch, dists, version)
    if hit:
        return hit
    if git.run("apply", "--check", str(patch_file), check=False).ok:
        return None
    return upstream_by_patch_id(git, text, patch, new_base, old_base) or upstream_by_reverse_apply(git, patch_file)


# ---------------------------------------------------------------- start


def report_paths(cfg: Config, engine: str, old: str, new: str) -> tuple[Path, Path]:
    d, stem = cfg.reports_root / "rebase", report_stem(engine, old, new)
    return d / f"{stem}.md", d / f"{stem}.json"


def _build_old_head(co: Checkout, stack: Stack, from_base: str) -> str:
    """OLD's stack applied onto OLD's base, as commits inside NEW's checkout (for range-diff and
    for the pre-image blobs `git am -3` needs). Uses a temporary worktree; NEW's tree is untouched."""
    if not stack.entries:
        return from_base
    tmp = Path(tempfile.mkdtemp(prefix="dsadapt-rebase-"))
    wt = tmp / "tree"
    try:
        co.git.run("worktree", "add", "-q", "--detach", str(wt), from_base)
        g = Git(wt)
        for e in stack.entries:
            pf = tmp / e.name
            pf.write_text(e.text, encoding="utf-8")
            if not g.run("am", "--no-signoff", str(pf), check=False, fixed_dates=True).ok:
                g.run("am", "--abort", check=False)
                raise StackError(f"{stack.ref}: {e.name} does not apply onto {stack.ref}'s own base",
                                 hint=f"run `dsadapt verify {stack.ref}` and fix that stack first")
        head = g.rev("HEAD")
        assert head
        return head
    finally:
        co.git.run("worktree", "remove", "--force", str(wt), check=False)
        co.git.run("worktree", "prune", check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _check_target(co: Checkout, new_ref: PinRef) -> str | None:
    """Refuse a NEW checkout that holds work; returns its branch head (None if absent)."""
    state = co.load_state()
    if state.get("op") or co.am_in_progress():
        raise WorkspaceError(f"{new_ref}: an apply or rebase is in progress in {co.path}",
                             hint=f"finish it with `dsadapt continue {new_ref}` or `dsadapt abort {new_ref}`")
    if co.git.is_dirty():
        raise WorkspaceError(f"{new_ref}: {co.path} has uncommitted changes",
                             hint="commit them and `dsadapt refresh`, or discard them, then rebase")
    head = co.git.rev(f"refs/heads/{co.branch}")
    applied = state.get("applied")
    expected = applied.get("head") if applied else co.base()
    if head and head not in (expected, co.base()):
        raise WorkspaceError(f"{new_ref}: branch {co.branch} has commits not exported to a stack",
                             hint=f"run `dsadapt refresh {new_ref}` to keep them, or reset the branch")
    return head


def rebase_stack(cfg: Config, lock: Lock, old_ref: PinRef, new_tag: str, *, progress: Progress | None = None,
                 on_patch=None) -> tuple[StackResult, list[str]]:
    """Replay OLD's stack onto NEW (pinning NEW first if needed). Returns (result, notes).

    Raises ConflictStop when a patch needs the user; the op then waits in NEW's checkout.
    """
    old_entry = lock.pin(old_ref)
    new_ref = PinRef(old_ref.engine, new_tag)
    old_stack = load_stack(cfg.patches_root, old_ref)  # parse everything before touching anything
    identity = new_ref == old_ref
    new_dir = stack_dir(cfg.patches_root, new_ref)
    if not identity and (new_dir / "series").exists():
        raise WorkspaceError(f"{new_ref} already has a stack ({new_dir / 'series'})",
                             hint=f"a rebase writes a new stack; apply that one, or move {new_dir} away first")
    notes: list[str] = []
    lock_before = lock_after = None
    if str(new_ref) not in lock.pins:
        entry, pin_notes = resolve_pin(cfg, lock, new_ref, progress=progress)
        notes += pin_notes
        lock_before = cfg.lock_path.read_text(encoding="utf-8")
        lock = lock.with_pin(entry)
        write_lock(lock, cfg.lock_path)
        lock_after = cfg.lock_path.read_text(encoding="utf-8")
        notes.append(f"pinned {new_ref} in upstream.lock")
        if progress:
            for n in notes:
                progress(n)
    started = False
    try:
        new_entry = lock.pin(new_ref)
        old_co, _ = ensure_checkout(cfg, lock, old_entry, progress)
        co, _ = ensure_checkout(cfg, lock, new_entry, progress)
        head_branch = _check_target(co, new_ref)
        base = co.base()
        if identity:
            co.git.update_ref(FROM_BASE, base)
        else:
            co.git.run("fetch", "-q", "--no-tags", "--update-shallow", str(old_co.path), f"+{BASE_REF}:{FROM_BASE}")
        from_base = co.git.rev(FROM_BASE)
        assert from_base
        if progress:
            progress(f"replaying {old_ref}'s {len(old_stack)} patch(es) onto its own base for comparison")
        co.git.update_ref(FROM_HEAD, _build_old_head(co, old_stack, from_base))
        ad = adapter(old_ref.engine)
        state = co.load_state()
        op: dict = {
            "kind": "rebase", "stack_hash": old_stack.hash, "stack_dir": str(new_dir),
            "patches": [{"name": e.name, "subject": e.patch.subject} for e in old_stack.entries],
            "outcomes": [], "orig_branch": co.git.current_branch(), "orig_head": co.git.rev("HEAD"),
            "branch_head_before": head_branch, "backup_ref": None, "dirty_backup": None,
            "rebase": {
                "from": str(old_ref), "from_version": old_entry.version, "to_version": new_entry.version,
                "from_source": _source_words(old_co.load_state().get("source")),
                "dists": [ad.name, *ad.pypi], "lock_before": lock_before, "lock_after": lock_after,
                "details": {},
            },
        }
        if co.op_dir.exists():
            shutil.rmtree(co.op_dir)
        co.op_dir.mkdir(parents=True)
        for i, e in enumerate(old_stack.entries, 1):
            (co.op_dir / f"{i:04d}.patch").write_text(e.text, encoding="utf-8")
        state["op"] = op
        co.save_state(state)
        started = True
        if head_branch and head_branch != base:
            op["backup_ref"] = co.new_backup(head_branch, f"{co.branch} before rebase from {old_ref}")
            co.save_state(state)
        co.git.run("checkout", "-q", "-f", "-B", co.branch, base)
    except BaseException:
        if not started and lock_before is not None and cfg.lock_path.read_text(encoding="utf-8") == lock_after:
            atomic_write_text(cfg.lock_path, lock_before)
        raise
    return run_rebase_patches(co, state, on_patch), notes


def _source_words(src: dict | None) -> str:
    return f"{src.get('kind')} {src.get('origin')}" if src else "unknown"


# ---------------------------------------------------------------- the replay (also entered from continue/skip)


def run_rebase_patches(co: Checkout, state: dict, on_patch) -> StackResult:
    op = state["op"]
    rb = op["rebase"]
    patches, outcomes = op["patches"], op["outcomes"]
    base = co.base()
    from_base = co.git.rev(FROM_BASE) or base
    dists = tuple(rb["dists"])
    while len(outcomes) < len(patches):
        i = len(outcomes) + 1
        meta = patches[i - 1]
        pf = co.op_dir / f"{i:04d}.patch"
        text = pf.read_text(encoding="utf-8")
        patch = parse_patch(text, where=meta["name"])
        before = co.git.rev("HEAD")
        hit = find_upstream(co.git, pf, text, patch, dists, rb["to_version"], base, from_base)
        if hit is None:
            r = co.git.run("am", "-3", "--no-signoff", str(pf), check=False, fixed_dates=True)
            if not r.ok:
                raise stop_on_conflict(co, state, i, "rebase",
                                       f"rebasing {rb['from']}: patch {i}/{len(patches)} {meta['name']} does not apply")
            head = co.git.rev("HEAD")
            if head == before:
                hit = "the 3-way merge left nothing to commit (already in NEW)"
            else:
                assert before is not None and head is not None
                new_patch = export_commits(co.git, before, head)[0]
                outcome, detail = applied_detail(patch, new_patch, "3-way merge" in (r.out + r.err))
                _record(co, state, PatchOutcome(i, meta["name"], meta["subject"], outcome, head), detail, on_patch)
                continue
        _record(co, state, PatchOutcome(i, meta["name"], meta["subject"], "upstream", before), hit, on_patch)
    return finish_rebase(co, state)


def _record(co: Checkout, state: dict, o: PatchOutcome, detail: str, on_patch) -> None:
    state["op"]["outcomes"].append(asdict(o))
    state["op"]["rebase"]["details"][str(o.index)] = detail
    co.save_state(state)
    if on_patch:
        on_patch(o)


def _detail(outcome: str, recorded: str | None) -> str:
    if recorded:
        return recorded
    return {"changed": "conflict resolved by the user (dsadapt continue)",
            "skipped": "conflict; dropped by the user (dsadapt skip)",
            "clean": "applied (recorded after an interrupted run)"}.get(outcome, "")


def finish_rebase(co: Checkout, state: dict) -> StackResult:
    """Write NEW's stack and the report; close the op."""
    op = state["op"]
    rb = op["rebase"]
    cfg = co.cfg
    base, head = co.base(), co.git.rev("HEAD")
    assert head
    new_dir = Path(op["stack_dir"])
    names = write_stack(new_dir, export_commits(co.git, base, head))
    new_stack = load_stack(cfg.patches_root, co.ref)
    from_base, from_head = co.git.rev(FROM_BASE), co.git.rev(FROM_HEAD)
    rd_cmd = f"git range-diff {FROM_BASE}..{FROM_HEAD} {BASE_REF}..{co.branch}"
    blocks = _range_diff_blocks(co.git, from_base, from_head, base, head, op["outcomes"])
    carried = iter(names)
    reports = []
    for o in op["outcomes"]:
        new_name = next(carried, None) if o["outcome"] in CARRIED else None
        reports.append(PatchReport(o["index"], o["name"], o["subject"], o["outcome"],
                                   _detail(o["outcome"], rb["details"].get(str(o["index"]))), new_name,
                                   blocks.get(o["index"], "")))
    old_ref = PinRef(*rb["from"].split("@", 1))
    report = RebaseReport(
        engine=co.ref.engine, old=old_ref.tag, new=co.ref.tag, old_version=rb["from_version"],
        new_version=rb["to_version"], date=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        old_source=rb["from_source"], new_source=_source_words(state.get("source")),
        pinned_new=rb.get("lock_before") is not None, old_stack_hash=op["stack_hash"],
        new_stack_hash=new_stack.hash, range_diff_command=rd_cmd, patches=reports)
    md, js = report_paths(cfg, co.ref.engine, old_ref.tag, co.ref.tag)
    atomic_write_text(md, format_markdown(report))
    atomic_write_text(js, json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
    state["applied"] = {"stack_hash": new_stack.hash, "head": head}
    state["op"] = None
    co.save_state(state)
    shutil.rmtree(co.op_dir, ignore_errors=True)
    return StackResult(state["ref"], str(co.path), state.get("source"), base, head, new_stack.hash,
                       [PatchOutcome(**o) for o in op["outcomes"]], backup_ref=op.get("backup_ref"))


def _range_diff_blocks(git: Git, from_base: str | None, from_head: str | None, base: str, head: str,
                       outcomes: list[dict]) -> dict[int, str]:
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
        i = o["index"]
        if o["outcome"] not in CARRIED or not o.get("commit") or " < " not in blocks.get(i, " < "):
            continue
        pair = git.run("range-diff", "--no-color", f"--creation-factor={RANGE_DIFF_CREATION}",
                       f"{old_commits[i - 1]}^!", f"{o['commit']}^!", check=False)
        one = split_range_diff(pair.out).get(1) if pair.ok else None
        if one:
            blocks[i] = one
    return blocks


def load_report(cfg: Config, engine: str, old: str, new: str) -> dict:
    return json.loads(report_paths(cfg, engine, old, new)[1].read_text(encoding="utf-8"))


# ---------------------------------------------------------------- abort


def undo_rebase_extras(co: Checkout, op: dict) -> None:
    """What `abort` must undo beyond the checkout: the comparison refs and a lock entry the rebase
    added (restored byte for byte unless someone changed upstream.lock since)."""
    co.git.delete_ref(FROM_BASE)
    co.git.delete_ref(FROM_HEAD)
    rb = op["rebase"]
    before, after = rb.get("lock_before"), rb.get("lock_after")
    if before is None:
        return
    path = co.cfg.lock_path
    if path.read_text(encoding="utf-8") == after:
        atomic_write_text(path, before)
        return
    lock = load_lock(path)
    if str(co.ref) in lock.pins:
        pins = {k: v for k, v in lock.pins.items() if k != str(co.ref)}
        write_lock(replace(lock, pins=pins), path)

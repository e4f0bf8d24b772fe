"""End-to-end rebases on the fixture upstream (local git repo): every classification, continue,
skip and abort, OLD untouched, report contents."""

from __future__ import annotations

import json

import pytest
import rebase_fixture as fx

from patcher.base.errors import ConflictStop, WorkspaceError
from patcher.formats.lock import load_lock
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import lint_stack, load_stack
from patcher.stack.apply import abort_apply, apply_stack, continue_apply, skip_patch
from patcher.stack.checkout import Checkout, ensure_checkout
from patcher.stack.rebase.carry import FROM_BASE, FROM_HEAD, rebase_stack
from patcher.stack.status import checkout_status

OLD = PinRef(fx.ENGINE, "v1.0.0")
NEW = PinRef(fx.ENGINE, "v1.1.0")


@pytest.fixture
def env(tmp_path):
    up = fx.make_upstream(tmp_path)
    proj = fx.make_project(tmp_path, up)
    return tmp_path, up, proj


def _start(cfg):
    """Rebase until it stops on patch 5 (d.py); returns the outcomes seen so far."""
    seen = []
    with pytest.raises(ConflictStop) as stop:
        rebase_stack(cfg, load_lock(cfg.lock_path), OLD, NEW.tag, on_patch=seen.append)
    assert "0005-d-raise-the-timeout.patch" in stop.value.message and "pkg/d.py" in stop.value.message
    return seen


def _resolve_and_continue(cfg):
    co = Checkout(cfg, NEW)
    (co.path / "pkg/d.py").write_text(fx.RESOLVED_D)
    co.git.run("add", "pkg/d.py")
    return continue_apply(cfg, None)


def test_rebase_classifies_each_patch_and_writes_new_stack(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    old_dir = proj / "patches" / fx.ENGINE / "v1.0.0"
    old_bytes = fx.snapshot(old_dir)
    seen = _start(cfg)
    assert [o.outcome for o in seen] == ["upstream", "upstream", "upstream", "merged"]
    # the lock now pins NEW (resolved from the fixture's git remote)
    lock = load_lock(cfg.lock_path)
    assert lock.pin(NEW).commit == fx.git(up, "rev-parse", "v1.1.0^{commit}")

    res = _resolve_and_continue(cfg)
    assert [o.outcome for o in res.outcomes] == ["upstream", "upstream", "upstream", "merged", "changed",
                                                "upstream", "clean"]
    report = json.loads((cfg.reports_root / "rebase/vllm-v1.0.0-to-v1.1.0.json").read_text())
    detail = {p["index"]: p["detail"] for p in report["patches"]}
    assert "reverse-applies onto NEW (" in detail[1]           # git source is shallow: no history for patch-id
    assert "ignoring whitespace" in detail[2]
    assert "3-way merge left nothing" in detail[3]
    assert detail[4].startswith("3-way merge; only context")
    assert "conflict resolved by the user" in detail[5]
    assert "Drop-When vllm>=1.1.0 matches 1.1.0" in detail[6]
    assert detail[7] == "same hunks"
    assert report["counts"] == {"clean": 1, "merged": 1, "changed": 1, "upstream": 4}

    # NEW's stack: the three carried patches, renumbered, normalized, lint-clean
    new_stack = load_stack(cfg.patches_root, NEW)
    assert [e.name for e in new_stack.entries] == [
        "0001-c-double-the-total.patch", "0002-d-raise-the-timeout.patch", "0003-f-shift-f2.patch"]
    assert lint_stack(new_stack) == []
    assert "+    timeout = 30  # ours; upstream moved to 20" in new_stack.entries[1].text
    assert [p["new_name"] for p in report["patches"] if p["outcome"] != "upstream"] == [
        e.name for e in new_stack.entries]
    # OLD's stack is untouched, byte for byte
    assert fx.snapshot(old_dir) == old_bytes

    # the range-diff names the changed patch and shows the resolution
    rd = {p["index"]: p["range_diff"] for p in report["patches"]}
    assert rd[5].splitlines()[0].endswith("d: raise the timeout") and " ! " in rd[5].splitlines()[0]
    assert "timeout = 30  # ours" in rd[5]
    assert " = " in rd[7].splitlines()[0]
    md = (cfg.reports_root / "rebase/vllm-v1.0.0-to-v1.1.0.md").read_text()
    assert "### 5. d: raise the timeout (changed)" in md
    assert "- 0006-e-prefer-b.patch: already upstream: Drop-When" in md

    # the checkout is left with NEW's stack applied: apply is a no-op
    again = apply_stack(cfg, load_lock(cfg.lock_path), NEW)
    assert again.noop


def test_patch_id_finds_a_verbatim_backport_when_history_is_there(env):
    root, up, proj = env
    cfg = fx.config(proj, root, sources="mirror", mirror=up)  # mirrors are fetched with full history
    # NEW pinned beforehand (as from a machine with network): `dsadapt pin` would leave the
    # engine cache shallow at NEW, and patch-id has no history to search then.
    from patcher.formats.lock import LockEntry, write_lock

    lock = load_lock(cfg.lock_path)
    write_lock(lock.with_pin(LockEntry(fx.ENGINE, NEW.tag, "1.1.0", commit=fx.git(up, "rev-parse", "v1.1.0^{commit}"),
                                       tree=fx.git(up, "rev-parse", "v1.1.0^{tree}"))), cfg.lock_path)
    _start(cfg)
    state = Checkout(cfg, NEW).load_state()
    detail = state["op"]["extra"]["details"]["1"]
    cherry = fx.git(up, "rev-parse", "v1.1.0~4")  # the cherry-pick, first commit after v1.0.0
    assert detail.startswith("patch-id ") and cherry[:12] in detail


def test_abort_restores_everything(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    before = fx.snapshot(proj)
    _start(cfg)
    co = Checkout(cfg, NEW)
    assert checkout_status(cfg, load_lock(cfg.lock_path), load_lock(cfg.lock_path).pin(NEW)).state == "stopped"
    (co.path / "pkg/d.py").write_text("half-resolved\n")  # the user started resolving, then gave up
    abort_apply(cfg, NEW)
    assert fx.snapshot(proj) == before  # lock entry removed, no NEW stack, no report, OLD untouched
    assert co.load_state()["op"] is None
    assert not co.am_in_progress() and not co.git.is_dirty()
    assert co.git.rev("HEAD") == co.base() == fx.git(up, "rev-parse", "v1.1.0^{commit}")
    assert co.git.current_branch() == co.branch
    assert co.git.rev(FROM_BASE) is None and co.git.rev(FROM_HEAD) is None
    assert not (co.path / ".git" / "dsadapt" / "op").exists()


def test_abort_keeps_a_pin_the_user_made(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    from patcher.formats.lock import write_lock
    from patcher.upstream.resolve import resolve_pin

    lock = load_lock(cfg.lock_path)
    entry, _ = resolve_pin(cfg, lock, NEW)
    write_lock(lock.with_pin(entry), cfg.lock_path)
    before = fx.snapshot(proj)
    _start(cfg)
    abort_apply(cfg, None)
    assert fx.snapshot(proj) == before
    assert str(NEW) in load_lock(cfg.lock_path).pins


def test_skip_drops_the_conflicting_patch(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    _start(cfg)
    res = skip_patch(cfg, NEW)
    assert [o.outcome for o in res.outcomes][4:] == ["skipped", "upstream", "clean"]
    assert [e.name for e in load_stack(cfg.patches_root, NEW).entries] == [
        "0001-c-double-the-total.patch", "0002-f-shift-f2.patch"]
    md = (cfg.reports_root / "rebase/vllm-v1.0.0-to-v1.1.0.md").read_text()
    assert "- 0005-d-raise-the-timeout.patch: skipped by the user" in md


def test_refuses_to_overwrite_an_existing_new_stack(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    d = proj / "patches" / fx.ENGINE / "v1.1.0"
    d.mkdir(parents=True)
    (d / "series").write_text("")
    lock_before = cfg.lock_path.read_bytes()
    with pytest.raises(WorkspaceError, match="already has a stack"):
        rebase_stack(cfg, load_lock(cfg.lock_path), OLD, NEW.tag)
    assert cfg.lock_path.read_bytes() == lock_before


def test_a_second_rebase_onto_a_stopped_one_is_refused(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    _start(cfg)
    with pytest.raises(WorkspaceError, match="in progress"):
        rebase_stack(cfg, load_lock(cfg.lock_path), OLD, NEW.tag)
    assert Checkout(cfg, NEW).load_state()["op"]["kind"] == "rebase"


def test_release_artifact_trees_merge_with_old_blobs(tmp_path):
    """PyPI-style trees are parentless snapshots: the 3-way merge only works because OLD's base
    (holding the blobs named on the patches' index lines) is fetched into NEW's checkout."""
    up = fx.make_upstream(tmp_path)
    proj, wheels = fx.make_pypi_project(tmp_path, up)
    from patcher.base.config import load_config

    cfg = load_config(proj, env={"DSADAPT_WORKDIR": str(tmp_path / "work"), "DSADAPT_SOURCES": "pypi",
                                 "DSADAPT_ARTIFACTS": str(wheels)})
    lock_before = cfg.lock_path.read_bytes()
    seen = _start(cfg)
    co = Checkout(cfg, NEW)
    assert co.load_state()["source"]["kind"] == "pypi"
    assert co.git.out("rev-list", "--count", co.base()) == "1"  # a snapshot: no upstream history
    assert [o.outcome for o in seen] == ["upstream", "upstream", "upstream", "merged"]
    res = _resolve_and_continue(cfg)
    assert [o.outcome for o in res.outcomes] == ["upstream", "upstream", "upstream", "merged", "changed",
                                                "upstream", "clean"]
    assert cfg.lock_path.read_bytes() == lock_before  # NEW was pinned already
    report = json.loads((cfg.reports_root / "rebase/vllm-v1.0.0-to-v1.1.0.json").read_text())
    assert report["pinned_new"] is False and report["new_source"].startswith("pypi vllm-1.1.0-")
    assert "reverse-applies" in report["patches"][0]["detail"]
    assert [e.name for e in load_stack(cfg.patches_root, NEW).entries][0] == "0001-c-double-the-total.patch"

    # control: in a NEW snapshot checkout without OLD's base fetched, the same patch cannot merge
    other = load_config(proj, env={"DSADAPT_WORKDIR": str(tmp_path / "work2"), "DSADAPT_SOURCES": "pypi",
                                   "DSADAPT_ARTIFACTS": str(wheels)})
    co2, _ = ensure_checkout(other, load_lock(cfg.lock_path), load_lock(cfg.lock_path).pin(NEW))
    c_patch = proj / "patches" / fx.ENGINE / "v1.0.0" / "0004-c-double-the-total.patch"
    r = co2.git.run("am", "-3", str(c_patch), check=False)
    assert not r.ok and "lacks necessary blobs to fall back on 3-way merge" in r.err


def test_plain_apply_is_untouched_by_the_rebase_hooks(env):
    root, up, proj = env
    cfg = fx.config(proj, root)
    res = apply_stack(cfg, load_lock(cfg.lock_path), OLD)
    assert [o.outcome for o in res.outcomes] == ["clean"] * 7
    assert not (proj / "reports").exists()

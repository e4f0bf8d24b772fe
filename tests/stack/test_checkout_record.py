"""The checkout's state record and dsadapt's refs, damaged or removed by hand, are rebuilt from git
(docs/robustness.md, "The record and the refs"): from the record's copy under refs/dsadapt/state
when it is there (exactly, an op in progress included), else derived from git itself (the base from
refs/dsadapt/base or the branch commit the lock pins, what is applied from the commits whose
patch-ids are the stack's). What cannot be derived is refused with the command that reconciles it.
No case needs the user's git; no commit, file or patch of the user's is lost."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import MOD_V1, REF1, TAG1, commit_msg, conflicting_stack, edit, git
from misuse_support import error_shape, lost, status_problems, work_now

STATE = ".git/dsadapt/state.json"
RESOLVED = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", None) or "tanh"')


def _applied_with_a_commit(project):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    (co / "vllm" / "mine.py").write_text("# user work: mine\n")
    git(co, "add", "vllm/mine.py")
    git(co, "commit", "-qm", commit_msg("mine: a module of my own"))
    return co


def _half(co):
    f = co / STATE
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])


def _keys_only(co):
    (co / STATE).write_text(json.dumps({"schema": 2, "ref": REF1, "applied": {"stack_hash": 5}}))


def _not_json(co):
    (co / STATE).write_bytes(b"\x00\xff garbage")


def _a_list(co):
    (co / STATE).write_text("[]")


def _a_directory(co):
    (co / STATE).unlink()
    (co / STATE).mkdir()


def _deleted(co):
    (co / STATE).unlink()


def _own_dir_and_copy(co):
    shutil.rmtree(co / ".git" / "dsadapt")
    git(co, "update-ref", "-d", "refs/dsadapt/state")


def _every_dsadapt_ref_and_file(co):
    shutil.rmtree(co / ".git" / "dsadapt")
    for r in git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/").split():
        git(co, "update-ref", "-d", r)


def _base_and_stack_refs(co):
    git(co, "update-ref", "-d", "refs/dsadapt/base")
    git(co, "update-ref", "-d", "refs/dsadapt/stack")


def _broken_ref_files(co):
    git(co, "pack-refs", "--all")  # a packed value under a loose file git cannot read
    for r in ("base", "stack", "state"):
        (co / ".git" / "refs" / "dsadapt" / r).parent.mkdir(parents=True, exist_ok=True)
        (co / ".git" / "refs" / "dsadapt" / r).write_text("not a commit id\n")


def _everything_and_the_branch_ref(co):
    """No record, no copy, no dsadapt ref, and the branch's own ref file damaged: neither the
    branch nor HEAD reach the base; their reflogs do."""
    _every_dsadapt_ref_and_file(co)
    (co / ".git" / git(co, "symbolic-ref", "HEAD")).write_text("damaged\n")


DAMAGE = {"deleted": _deleted, "half written": _half, "keys missing, wrong types": _keys_only,
          "not JSON": _not_json, "a list": _a_list, "a directory": _a_directory,
          "the record's folder and its copy removed": _own_dir_and_copy,
          "every dsadapt ref and file removed": _every_dsadapt_ref_and_file,
          "base and stack refs deleted": _base_and_stack_refs, "ref files damaged": _broken_ref_files}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_record_or_ref_with_an_unexported_commit_needs_no_git_and_loses_nothing(project, clean_stack,
                                                                                          damage, tmp_path):
    co = _applied_with_a_commit(project)
    DAMAGE[damage](co)
    before = work_now(project)
    assert status_problems(project, tmp_path / "oracle") == []
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "diverged" and st["next"] == f"dsadapt refresh {REF1}", st
    r = project.run("apply", REF1)  # says what status says: the commit is not exported
    assert r.rc == 4 and "not exported" in r.err and error_shape(r.err) is None, r
    r = project.run("refresh", REF1)
    assert r.rc == 0, r
    assert "0004-mine-a-module-of-my-own.patch" in r.out
    assert lost(project, before) == []
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "stack applied" and "rebuilt" not in st["detail"], st
    assert project.run("apply", REF1).rc == 0  # a no-op now
    assert (co / STATE).is_file() and json.loads((co / STATE).read_text())["base"] == \
        git(co, "rev-parse", "refs/dsadapt/base")
    assert git(co, "rev-parse", "refs/dsadapt/stack") and git(co, "rev-parse", "refs/dsadapt/state")


def test_the_damaged_record_is_kept_beside_the_rebuilt_one(project, clean_stack):
    co = _applied_with_a_commit(project)
    _half(co)
    half = (co / STATE).read_bytes()
    r = project.run("refresh", REF1)
    assert r.rc == 0 and "unreadable" in r.out + r.err and "kept as" in r.out + r.err, r
    kept = list((co / ".git" / "dsadapt").glob("state.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == half


def test_a_record_lost_at_a_stop_comes_back_from_its_copy_and_the_stop_goes_on(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    (co / "README.md").write_text("# user work: an edit before the apply\n")
    conflicting_stack(project)
    assert project.run("apply", REF1, "--force").rc == 4
    shutil.rmtree(co / ".git" / "dsadapt")  # the record and the op's patches (its mbox) both gone
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] == "stopped" and st["next"] == f"dsadapt continue {REF1}", st
    (co / "vllm" / "mod.py").write_text(RESOLVED)
    git(co, "add", "vllm/mod.py")
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["clean", "changed", "clean"]
    assert any("taken back from its copy" in n for n in r.json()["notes"]), r.json()["notes"]


def test_an_abort_after_the_record_was_lost_at_a_stop_restores_the_work_from_before(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    before_head = git(co, "rev-parse", "HEAD")
    (co / "README.md").write_text("# user work: an edit before the apply\n")
    conflicting_stack(project)
    assert project.run("apply", REF1, "--force").rc == 4
    (co / STATE).write_text("{")
    for r in git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/").split():
        git(co, "update-ref", "-d", r)  # the backups the op made, deleted by hand as well
    r = project.run("abort", REF1)
    assert r.rc == 0, r
    assert (co / "README.md").read_text() == "# user work: an edit before the apply\n"
    assert git(co, "rev-parse", "HEAD") == before_head


def test_without_any_record_a_git_am_in_progress_is_refused_naming_apply_force_which_keeps_everything(
        project, clean_stack, tmp_path):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    conflicting_stack(project)
    (co / "notes.txt").write_text("# user work: notes\n")
    assert project.run("apply", REF1, "--force").rc == 4
    _every_dsadapt_ref_and_file(co)
    before = work_now(project)
    assert status_problems(project, tmp_path / "oracle") == []
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["next"] == f"dsadapt apply {REF1} --force", st
    for cmd in (["apply", REF1], ["refresh", REF1], ["continue", REF1]):
        r = project.run(*cmd)
        assert r.rc == 4 and error_shape(r.err) is None, (cmd, r)
    r = project.run("apply", REF1)
    assert "git am" in r.err and f"dsadapt apply {REF1} --force" in r.err, r
    r = project.run("apply", REF1, "--force")
    assert r.rc == 4, r  # the same conflict, in an op dsadapt records this time
    assert lost(project, before) == []
    assert project.run("abort", REF1).rc == 0
    assert lost(project, before) == []


def test_a_base_that_git_cannot_tell_is_refused_with_the_command_that_makes_the_checkout_again(project,
                                                                                                clean_stack):
    co = _applied_with_a_commit(project)
    _every_dsadapt_ref_and_file(co)
    lock = (project.root / "upstream.lock").read_text()
    commit = project.upstream.commits[TAG1]
    (project.root / "upstream.lock").write_text(lock.replace(commit, "1" * 40).replace(
        project.upstream.trees[TAG1], "2" * 40))
    for cmd in (["apply", REF1], ["refresh", REF1], ["status", "--json"]):
        r = project.run(*cmd)
        text = r.err if r.rc else r.json()["checkouts"][0]["detail"]
        assert f"move {co} away" in text and f"dsadapt apply {REF1}" in text, (cmd, r)
        assert r.rc in (0, 4) and (r.rc == 0 or error_shape(r.err) is None), r
    assert git(co, "log", "-1", "--format=%s") == "mine: a module of my own"  # nothing moved


def test_with_the_branch_ref_damaged_too_the_base_comes_from_the_reflogs(project, clean_stack, tmp_path):
    """Neither the branch nor HEAD reach the base (the branch's ref file is damaged, every dsadapt
    ref and file is gone): the base is found through their reflogs, the branch is made again from
    its reflog, and the unexported commit is refused, then exported, as in every other case."""
    co = _applied_with_a_commit(project)
    _everything_and_the_branch_ref(co)
    before = work_now(project)
    st = project.run("status", "--json").json()["checkouts"][0]
    assert st["state"] != "stack applied" and "rebuilt" in st["detail"], st
    r = project.run("apply", REF1)
    assert r.rc == 4 and "not exported" in r.err and error_shape(r.err) is None, r
    assert git(co, "rev-parse", "refs/dsadapt/base") == project.upstream.commits[TAG1]
    r = project.run("refresh", REF1)
    assert r.rc == 0 and "0004-mine-a-module-of-my-own.patch" in r.out, r
    assert lost(project, before) == []
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"
    assert status_problems(project, tmp_path / "oracle") == []


def test_a_record_written_by_a_newer_dsadapt_is_refused_not_rebuilt(project, clean_stack):
    co = _applied_with_a_commit(project)
    d = json.loads((co / STATE).read_text())
    d["schema"] = 99
    (co / STATE).write_text(json.dumps(d))
    r = project.run("apply", REF1)
    assert r.rc == 4 and "newer" in r.err and error_shape(r.err) is None, r
    assert json.loads((co / STATE).read_text())["schema"] == 99


def test_a_backup_ref_deleted_during_a_stop_is_made_again_before_abort_needs_it(project, clean_stack):
    assert project.run("apply", REF1).rc == 0
    co = project.checkout()
    (co / "README.md").write_text("# user work: uncommitted\n")
    conflicting_stack(project)
    assert project.run("apply", REF1, "--force").rc == 4
    backups = git(co, "for-each-ref", "--format=%(refname) %(objectname)", "refs/dsadapt/backup/").splitlines()
    assert backups
    for line in backups:
        git(co, "update-ref", "-d", line.split()[0])
    r = project.run("abort", REF1)
    assert r.rc == 0 and "again from the checkout's record" in r.out + r.err, r
    assert (co / "README.md").read_text() == "# user work: uncommitted\n"


def test_the_copy_of_the_record_follows_every_write_and_is_the_same_commit_for_the_same_state(project, clean_stack):
    co = _applied_with_a_commit(project)
    first = git(co, "rev-parse", "refs/dsadapt/state")
    assert json.loads(git(co, "show", "refs/dsadapt/state:state.json")) == json.loads((co / STATE).read_text())
    assert project.run("refresh", REF1).rc == 0
    assert git(co, "rev-parse", "refs/dsadapt/state") != first
    assert json.loads(git(co, "show", "refs/dsadapt/state:state.json")) == json.loads((co / STATE).read_text())
    # deterministic: a state written again gives the same commit (abort leaves every ref as it was)
    from patcher.stack.checkout import Checkout

    c = Checkout(project.config(), project.lock().pin(REF1).ref)
    now = git(co, "rev-parse", "refs/dsadapt/state")
    c.save(c.load())
    assert git(co, "rev-parse", "refs/dsadapt/state") == now


def test_a_damaged_stack_branch_ref_is_made_again_from_its_reflog(project, clean_stack, tmp_path):
    co = _applied_with_a_commit(project)
    mine = git(co, "rev-parse", "HEAD")
    git(co, "pack-refs", "--all")
    (co / ".git" / "refs" / "heads" / "dsadapt").mkdir(parents=True, exist_ok=True)
    (co / ".git" / "refs" / "heads" / "dsadapt" / TAG1).write_text("damaged\n")
    before = work_now(project)
    assert status_problems(project, tmp_path / "oracle") == []
    r = project.run("apply", REF1)
    assert r.rc == 4 and "not exported" in r.err and "reflog" in r.err, r  # the branch is back, with the commit
    assert git(co, "rev-parse", f"refs/heads/dsadapt/{TAG1}") == mine
    assert project.run("refresh", REF1).rc == 0
    assert lost(project, before) == []
    assert project.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"

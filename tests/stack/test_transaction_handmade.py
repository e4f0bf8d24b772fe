"""The checkout is the user's: git steps made by hand between dsadapt's commands. Each is adopted
(the user's `git am --continue` is as good as `dsadapt continue`) or refused with the command that
reconciles it, whatever dsadapt moves away from is kept under a backup ref first, and `status`
tells the truth. One test per case of docs/user-guide.md ("Git by hand in the checkout")."""

from __future__ import annotations

from conftest import (
    MOD_V1,
    P1_MOD,
    REF1,
    TAG1,
    commit_msg,
    conflicting_stack,
    edit,
    git,
    make_patches,
)

BRANCH = f"dsadapt/{TAG1}"
RESOLVED = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", None) or "tanh"')


def _status(project):
    return {c["ref"]: c for c in project.run("status", "--json").json()["checkouts"]}[REF1]


def _kept(co, commit: str) -> list[str]:
    """The refs holding a commit (a user's commit must be on one: a branch or a backup ref)."""
    return git(co, "for-each-ref", "--contains", commit, "--format=%(refname)").split()


def _refs_and_tree(co) -> tuple[str, str, str]:
    return (git(co, "for-each-ref", "--format=%(refname) %(objectname)"), git(co, "rev-parse", "HEAD"),
            git(co, "status", "--porcelain", "--untracked-files=all"))


def _applied(project):
    assert project.run("apply", REF1).rc == 0
    return project.checkout()


def _user_commit(co, path: str, text: str, msg: str) -> str:
    (co / path).write_text(text)
    git(co, "add", path)
    git(co, "commit", "-qm", msg)
    return git(co, "rev-parse", "HEAD")


def _stopped_over_edits(project):
    """`apply --force` over uncommitted edits, stopped on a conflict (patch 2 of 3)."""
    co = _applied(project)
    (co / "README.md").write_text("my uncommitted edit\n")
    (co / "todo.txt").write_text("untracked notes\n")
    conflicting_stack(project)
    r = project.run("apply", REF1, "--force")
    assert r.rc == 4 and "patch 2/3" in r.err, r
    return co


# ---------------------------------------------------------------- git am --abort by hand at a stop


def test_git_am_abort_by_hand_then_continue_or_skip_is_refused_naming_abort(project, clean_stack):
    co = _stopped_over_edits(project)
    git(co, "am", "--abort")
    before = _refs_and_tree(co)
    for cmd in ("continue", "skip"):
        r = project.run(cmd, REF1)
        assert r.rc == 4, (cmd, r)
        assert "git am --abort" in r.err and f"dsadapt abort {REF1}" in r.err, r
        assert r.err.count("\n") == 2, r  # one error line, one hint
        assert _refs_and_tree(co) == before  # refused: nothing moved
    st = _status(project)
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt abort {REF1}", st
    assert "by hand" in st["detail"], st
    r = project.run("refresh", REF1)
    assert r.rc == 4 and "in progress" in r.err, r  # the stack's patches/ are safe
    assert project.run("abort", REF1).rc == 0
    # back where the apply --force started: the old stack's branch and the edits
    assert (co / "README.md").read_text() == "my uncommitted edit\n"
    assert (co / "todo.txt").read_text() == "untracked notes\n"
    assert git(co, "log", "--format=%s", "refs/dsadapt/base..HEAD").splitlines()[-1] == "mod: default scoring to sigmoid"
    assert _status(project)["state"] == "dirty"


# ---------------------------------------------------------------- detached HEAD with commits


def _detached_with_commit(project):
    co = _applied(project)
    git(co, "checkout", "-q", "--detach", "HEAD~1")
    mine = _user_commit(co, "vllm/extra.py", "X = 1\n", "my work on a detached HEAD")
    return co, mine


def test_apply_over_a_detached_head_with_commits_refuses_then_force_keeps_them(project, clean_stack):
    co, mine = _detached_with_commit(project)
    before = _refs_and_tree(co)
    r = project.run("apply", REF1)
    assert r.rc == 4 and "detached" in r.err and "--force" in r.err, r
    assert _refs_and_tree(co) == before
    r = project.run("apply", REF1, "--force", "--json")
    assert r.rc == 0, r
    assert git(co, "symbolic-ref", "HEAD") == f"refs/heads/{BRANCH}"
    kept = [ref for ref in _kept(co, mine) if ref.startswith("refs/dsadapt/backup/")]
    assert kept, _kept(co, mine)
    assert any(kept[0] in n for n in r.json()["notes"]), r.json()


def test_refresh_on_a_detached_head_with_commits_is_refused_and_status_says_so(project, clean_stack):
    co, mine = _detached_with_commit(project)
    st = _status(project)
    assert st["state"] == "diverged" and "detached" in st["detail"], st
    patches_before = {p.name: p.read_bytes() for p in project.stack_dir().iterdir()}
    r = project.run("refresh", REF1)
    assert r.rc == 4 and "detached" in r.err and "git" in r.err, r
    assert {p.name: p.read_bytes() for p in project.stack_dir().iterdir()} == patches_before
    # the reconciling step the message names, then refresh exports the commit
    git(co, "branch", "-f", BRANCH, mine)
    git(co, "checkout", "-q", BRANCH)
    r = project.run("refresh", REF1)
    assert r.rc == 0 and "vllm/extra.py" in (project.stack_dir() / "0003-my-work-on-a-detached-HEAD.patch").read_text(), r


def test_a_detached_head_on_the_branch_head_is_just_applied(project, clean_stack):
    co = _applied(project)
    git(co, "checkout", "-q", "--detach", BRANCH)
    st = _status(project)
    assert st["state"] == "stack applied" and "detached" in st["detail"], st
    assert project.run("refresh", REF1).rc == 0
    assert project.run("apply", REF1).rc == 0
    assert git(co, "symbolic-ref", "HEAD") == f"refs/heads/{BRANCH}"


# ---------------------------------------------------------------- git am --continue by hand


def test_git_am_continue_by_hand_is_adopted_by_continue(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    (co / "vllm" / "mod.py").write_text(RESOLVED)
    git(co, "add", "vllm/mod.py")
    git(co, "am", "--continue")  # what `git status` suggests
    st = _status(project)
    assert st["state"] == "interrupted" and st["next"] == f"dsadapt continue {REF1}", st
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["clean", "changed", "clean"]
    assert not r.json()["backups"] and r.json()["backup_ref"] is None, r.json()
    assert (co / "vllm" / "mod.py").read_text() == RESOLVED
    assert git(co, "rev-list", "--count", "refs/dsadapt/base..HEAD") == "3"
    assert not git(co, "for-each-ref", "refs/dsadapt/backup/")
    assert _status(project)["state"] == "diverged"  # the resolution is not in patches/ yet
    assert project.run("refresh", REF1).rc == 0
    assert _status(project)["state"] == "stack applied"
    assert "or \"tanh\"" in (project.stack_dir() / "0002-mod-default-scoring-to-tanh.patch").read_text()


def test_git_am_continue_by_hand_that_stops_again_is_a_stop_on_the_next_patch(project):
    """Two conflicts: the user resolves the first with git am --continue, which stops at the second."""
    tanh = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", "tanh")')
    relu = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", "relu")')
    project.write_stack(make_patches(project.upstream, project.tmp / "mk2", TAG1, [
        (commit_msg("mod: sigmoid"), {"vllm/mod.py": P1_MOD}),
        (commit_msg("mod: tanh"), {"vllm/mod.py": tanh}),
        (commit_msg("mod: relu"), {"vllm/mod.py": relu}),
    ], independent=True))
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    (co / "vllm" / "mod.py").write_text(RESOLVED)
    git(co, "add", "vllm/mod.py")
    git(co, "am", "--continue", check=False)  # stops on patch 3
    st = _status(project)
    assert st["state"] == "stopped" and "0003-mod-relu.patch" in st["detail"] and "2/3" in st["detail"], st
    (co / "vllm" / "mod.py").write_text(RESOLVED.replace("tanh", "relu"))
    git(co, "add", "vllm/mod.py")
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["clean", "changed", "changed"]


def test_git_am_skip_by_hand_is_adopted_as_a_skip(project):
    conflicting_stack(project)
    assert project.run("apply", REF1).rc == 4
    co = project.checkout()
    git(co, "am", "--skip")
    r = project.run("continue", REF1, "--json")
    assert r.rc == 0, r
    assert [o["outcome"] for o in r.json()["outcomes"]] == ["clean", "skipped", "clean"]


# ---------------------------------------------------------------- a renamed branch


def test_a_renamed_branch_with_commits_is_named_by_status_refresh_and_apply(project, clean_stack):
    co = _applied(project)
    git(co, "branch", "-m", BRANCH, "mine")
    mine = _user_commit(co, "vllm/extra.py", "X = 1\n", "my work on a renamed branch")
    st = _status(project)
    assert st["state"] == "diverged" and "mine" in st["detail"] and "missing" in st["detail"], st
    assert f"git branch -m mine {BRANCH}" in st["detail"]
    before = _refs_and_tree(co)
    r = project.run("refresh", REF1)
    assert r.rc == 4 and f"git branch -m mine {BRANCH}" in r.err, r
    r = project.run("apply", REF1)
    assert r.rc == 4 and "mine" in r.err and f"git branch -m mine {BRANCH}" in r.err, r
    assert _refs_and_tree(co) == before
    git(co, "branch", "-m", "mine", BRANCH)  # the reconciling command
    assert project.run("refresh", REF1).rc == 0
    assert _status(project)["state"] == "stack applied"
    assert BRANCH in " ".join(_kept(co, mine))


def test_apply_force_over_a_renamed_branch_leaves_it_and_rebuilds_the_stack(project, clean_stack):
    co = _applied(project)
    git(co, "branch", "-m", BRANCH, "mine")
    mine = _user_commit(co, "vllm/extra.py", "X = 1\n", "my work on a renamed branch")
    assert project.run("apply", REF1, "--force").rc == 0
    assert "refs/heads/mine" in _kept(co, mine)
    assert _status(project)["state"] == "stack applied"


# ---------------------------------------------------------------- commits only the reflog holds


def test_commits_only_the_reflog_holds_are_kept_before_apply_moves_the_branch(project, clean_stack):
    co = _applied(project)
    mine = _user_commit(co, "vllm/extra.py", "X = 1\n", "my commit, then reset away")
    git(co, "reset", "-q", "--hard", "HEAD~1")  # the commit is in the reflog only
    texts = make_patches(project.upstream, project.tmp / "mk3", TAG1, [
        (commit_msg("util: another step"), {"vllm/util.py": "def helper(x):\n    return x + 7\n"})])
    project.write_stack(texts)
    r = project.run("apply", REF1, "--json")
    assert r.rc == 0, r
    kept = [ref for ref in _kept(co, mine) if ref.startswith("refs/dsadapt/backup/")]
    assert kept and any(kept[0] in n for n in r.json()["notes"]), (kept, r.json())


def test_a_branch_moved_back_by_hand_is_named_as_such(project, clean_stack):
    co = _applied(project)
    git(co, "reset", "-q", "--hard", "HEAD~1")
    st = _status(project)
    assert st["state"] == "diverged" and "1 commit" in st["detail"] and "back" in st["detail"], st
    r = project.run("apply", REF1)
    assert r.rc == 4 and "back" in r.err, r

"""What users do to a checkout by hand, round two (docs/robustness.md): histories rewritten off the
stack branch (an amend of a middle patch on a detached HEAD, a branch of one's own), every hint
that names a git command followed literally, the stack branch checked out in another worktree,
empty, merge and mode-only commits on the branch, a git operation of the user's left half done,
and a lock that changed under an existing checkout. Hand-made histories are generated
(hypothesis, bounded and derandomized under the CI profile), not listed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import REF1, TAG1, Project, commit_msg, git, lock_text
from fault_harness import copy_project
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from misuse_support import (
    BRANCH,
    alternatives,
    change_in,
    error_shape,
    fixture_project,
    follow,
    hint_of,
    lost,
    status_problems,
    subjects_in_patches,
    work_now,
)


def _project(root: Path) -> Project:
    return fixture_project(root)


def _commit(co: Path, path: str, text: str, subject: str, amend: bool = False) -> None:
    (co / path).parent.mkdir(parents=True, exist_ok=True)
    (co / path).write_text(text)
    git(co, "add", path)
    git(co, "commit", "-q", *(["--amend"] if amend else []), "-m", commit_msg(subject))


def _held(co: Path, *revs: str) -> dict[str, str]:
    """{commit: subject} of what these revisions hold above the base."""
    out = {}
    for rev in revs:
        for line in git(co, "log", "--format=%H %s", f"refs/dsadapt/base..{rev}", check=False).splitlines():
            c, _, s = line.partition(" ")
            out[c] = " ".join(s.split()).lower()
    return out


# ---------------------------------------------------------------- hand-made histories off the branch

STEP = st.sampled_from(["detach 1", "detach 2", "amend same subject", "amend new subject", "commit",
                        "switch -c", "checkout branch", "reset branch back"])
#: a history that leaves the stack branch first (then anything): most draws end with work off the
#: branch, the state whose hints name git commands; the rest still check that nothing is refused wrongly
HISTORY = st.tuples(st.sampled_from(["detach 1", "detach 2", "switch -c"]), st.lists(STEP, min_size=1, max_size=4)) \
    .map(lambda t: [t[0], *t[1]])


def _hand(co: Path, step: str, n: int) -> None:
    def g(*a: str) -> None:
        git(co, *a, check=False)

    if step.startswith("detach"):
        g("checkout", "-q", "--detach", f"HEAD~{step.split()[1]}")
    elif step == "amend same subject":
        subject = git(co, "log", "-1", "--format=%s", check=False)
        if subject and git(co, "rev-parse", "HEAD") != git(co, "rev-parse", "refs/dsadapt/base"):
            _commit(co, f"vllm/amend_{n}.py", f"# user work: amend {n}\n", subject, amend=True)
    elif step == "amend new subject":
        if git(co, "rev-parse", "HEAD") != git(co, "rev-parse", "refs/dsadapt/base"):
            _commit(co, f"vllm/amend_{n}.py", f"# user work: amend {n}\n", f"amended {n}", amend=True)
    elif step == "commit":
        _commit(co, f"vllm/user_{n}.py", f"# user work: commit {n}\n", f"user commit {n}")
    elif step == "switch -c":
        g("switch", "-q", "-c", f"mine-{n}")
    elif step == "checkout branch":
        g("checkout", "-q", BRANCH)
    elif step == "reset branch back" and git(co, "symbolic-ref", "-q", "HEAD", check=False) == f"refs/heads/{BRANCH}":
        g("reset", "-q", "--hard", "HEAD~1")


HINT_RUNS: list[str] = []


@settings(max_examples=int(os.environ.get("MISUSE_EXAMPLES", "12")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(steps=HISTORY)
def test_every_git_hint_for_a_hand_made_history_keeps_every_commit(steps):
    """Whatever the user did off the branch, the refusal of apply, refresh and status names git
    commands that, followed literally (then `dsadapt refresh`), lose no commit and drop no patch:
    every subject the branch or HEAD held is in patches/ after (a git command that stops on a
    conflict is undone with its own --abort, and then nothing has changed)."""
    with tempfile.TemporaryDirectory(prefix="dsadapt-hint-") as tmp:
        root = Path(tmp)
        p = _project(root / "p")
        assert p.run("apply", REF1).rc == 0
        co = p.checkout()
        for n, step in enumerate(steps, 1):
            _hand(co, step, n)
        hints = []
        for cmd in (["apply", REF1], ["refresh", REF1]):
            r = p.run(*cmd)
            if r.rc:
                assert error_shape(r.err) is None, (steps, r)
                hints.append(hint_of(r.err))
        st_ = p.run("status", "--json").json()["checkouts"][0]
        assert status_problems(p, root / "oracle") == [], steps
        if st_["state"] == "diverged" and ": " in st_["detail"]:
            hints.append(st_["detail"].split(": ", 1)[1])
        for k, hint in enumerate(dict.fromkeys(hints)):
            for j, alt in enumerate(alternatives(hint)):
                if not alt[0].startswith("git "):
                    continue
                q = copy_project(p, root / f"alt-{k}-{j}")
                qco = q.checkout()
                held = _held(qco, "HEAD", BRANCH)
                before = work_now(q)
                refs_before = git(qco, "for-each-ref", "--format=%(refname) %(objectname)")
                done = follow(q, alt)
                HINT_RUNS.append(f"{steps} -> {alt}: {'ok' if done.ok else done.results[-1][:2]}")
                if os.environ.get("MISUSE_LOG"):
                    with open(os.environ["MISUSE_LOG"], "a") as f:
                        f.write(HINT_RUNS[-1] + "\n")
                if not done.ok:
                    failed = done.results[-1][0]
                    assert failed.startswith("git "), (steps, alt, done.results)
                    verb = failed.split()[1] if not failed.startswith("git -C") else failed.split()[3]
                    if (qco / ".git" / "rebase-merge").is_dir() or (qco / ".git" / "rebase-apply").is_dir():
                        git(qco, verb, "--abort")
                    refs_after = git(qco, "for-each-ref", "--format=%(refname) %(objectname)").splitlines()
                    assert set(refs_before.splitlines()) <= set(refs_after), (steps, alt)  # (a kept branch added)
                    assert lost(q, before) == [], (steps, alt)
                    continue
                if not any(c.startswith("dsadapt refresh") for c in alt):
                    r = q.run("refresh", REF1)
                    assert r.rc == 0, (steps, alt, r)
                assert lost(q, before) == [], (steps, alt)
                now = subjects_in_patches(q.stack_dir())
                missing = [s for c, s in held.items() if s not in now and not change_in(qco, c, BRANCH, root / "idx")]
                assert not missing, (steps, alt, f"following the hint dropped {missing} from the stack")
                assert status_problems(q, root / "oracle") == [], (steps, alt)


def test_the_hint_runs_followed_git_commands_to_their_end():
    """(runs after the generated test) most hints were followed through: a property over hints that
    all stopped on a conflict would prove little."""
    if not HINT_RUNS:
        pytest.skip("the generated hint test did not run in this session")
    ok = [r for r in HINT_RUNS if r.endswith(": ok")]
    assert len(ok) >= 0.5 * len(HINT_RUNS), HINT_RUNS
    if os.environ.get("MISUSE_SUMMARY"):
        import json

        with open(os.environ["MISUSE_SUMMARY"], "a") as f:
            f.write(json.dumps({"suite": "git hints followed", "followed": len(HINT_RUNS), "ran through": len(ok),
                                "stopped on a conflict, undone": len(HINT_RUNS) - len(ok)}) + "\n")


def test_the_amend_of_a_middle_patch_on_a_detached_head_is_carried_with_the_later_patch(tmp_path):
    """The case that lost work: `git checkout HEAD~1 && git commit --amend`, then what the hints say."""
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    git(co, "checkout", "-q", "--detach", "HEAD~1")
    (co / "vllm" / "util.py").write_text((co / "vllm" / "util.py").read_text() + "# user work: amended\n")
    git(co, "commit", "-qa", "--amend", "--no-edit")
    for cmd in (["apply", REF1], ["refresh", REF1]):
        r = p.run(*cmd)
        assert r.rc == 4 and "detached" in r.err and "git checkout -B" not in r.err, r
        assert "git rebase --onto" in r.err and f"git branch {BRANCH}-was-" in r.err, r
    alt = alternatives(hint_of(p.run("apply", REF1).err))[0]
    done = follow(p, alt)
    assert done.ok, done.results
    names = sorted(f.name for f in p.stack_dir().glob("*.patch"))
    assert len(names) == 3 and "# user work: amended" in (p.stack_dir() / names[1]).read_text()
    assert git(co, "symbolic-ref", "HEAD") == f"refs/heads/{BRANCH}"
    assert p.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"


# ---------------------------------------------------------------- another worktree holds the branch


def _worktree(p: Project) -> tuple[Path, Path]:
    co = p.checkout()
    git(co, "switch", "-q", "--detach")
    wt = p.tmp / "elsewhere"
    git(co, "worktree", "add", "-q", str(wt), BRANCH)
    (wt / "README.md").write_text("# user work: uncommitted in the other worktree\n")
    _commit(wt, "vllm/there.py", "# user work: committed there\n", "there: a commit in the other worktree")
    (wt / "README.md").write_text("# user work: uncommitted in the other worktree\n")
    return co, wt


def _wt_state(wt: Path) -> tuple[str, str, str]:
    return (git(wt, "rev-parse", "HEAD"), git(wt, "status", "--porcelain", "--untracked-files=all"),
            git(wt, "symbolic-ref", "HEAD"))


def test_a_branch_checked_out_in_another_worktree_is_never_moved_under_it(tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co, wt = _worktree(p)
    before = _wt_state(wt)
    st_ = p.run("status", "--json").json()["checkouts"][0]
    assert st_["state"] == "diverged" and str(wt) in st_["detail"] and "switch --detach" in st_["detail"], st_
    for cmd in (["apply", REF1], ["apply", REF1, "--force"], ["refresh", REF1], ["refresh", REF1, "--force"]):
        r = p.run(*cmd)
        assert r.rc == 4 and str(wt) in r.err and f"git -C {wt} switch --detach" in r.err, (cmd, r)
        assert error_shape(r.err) is None
        assert _wt_state(wt) == before
    follow(p, alternatives(hint_of(p.run("apply", REF1).err))[0])  # the command that frees it
    assert (wt / "README.md").read_text() == "# user work: uncommitted in the other worktree\n"  # its work stays
    r = p.run("refresh", REF1)
    assert r.rc == 0 and "there-a-commit-in-the-other-worktree" in r.out, r
    git(co, "switch", "-q", BRANCH)
    assert p.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"


def test_a_stop_whose_branch_another_worktree_takes_is_not_continued_skipped_or_aborted_under_it(tmp_path):
    from conftest import conflicting_stack

    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    conflicting_stack(p)
    assert p.run("apply", REF1).rc == 4
    co = p.checkout()
    wt = p.tmp / "elsewhere"
    git(co, "worktree", "add", "-q", "-f", str(wt), BRANCH)  # git refuses without -f: the user insisted
    before = (git(co, "rev-parse", f"refs/heads/{BRANCH}"), _wt_state(wt))
    for cmd in ("continue", "skip", "abort"):
        r = p.run(cmd, REF1)
        assert r.rc == 4 and f"git -C {wt} switch --detach" in r.err, (cmd, r)
        assert (git(co, "rev-parse", f"refs/heads/{BRANCH}"), _wt_state(wt)) == before
    git(wt, "switch", "-q", "--detach")
    assert p.run("abort", REF1).rc == 0


def test_a_worktree_that_is_gone_is_named_with_prune(tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co, wt = _worktree(p)
    shutil.rmtree(wt)
    r = p.run("apply", REF1)
    assert r.rc == 4 and "gone" in r.err and f"git -C {co} worktree prune" in r.err, r
    follow(p, alternatives(hint_of(r.err))[0])
    assert p.run("apply", REF1).rc == 4  # now: the commit made there is not exported (and HEAD is detached)
    assert p.run("refresh", REF1).rc == 0


# ---------------------------------------------------------------- empty, merge and mode-only commits


def test_an_empty_commit_is_left_out_of_the_stack_with_a_note(tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    git(co, "commit", "-q", "--allow-empty", "-m", commit_msg("an empty commit"))
    r = p.run("apply", REF1)
    assert r.rc == 4 and "refresh" in r.err, r
    before = {f.name: f.read_bytes() for f in p.stack_dir().iterdir()}
    r = p.run("refresh", REF1, "--json")
    assert r.rc == 0 and any("is empty: left out of the stack" in n for n in r.json()["notes"]), r
    assert {f.name: f.read_bytes() for f in p.stack_dir().iterdir()} == before
    assert p.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"
    assert p.run("apply", REF1).rc == 0
    # an empty commit between two real ones: the real ones are exported, in order
    _commit(co, "vllm/a.py", "A = 1\n", "a: one")
    git(co, "commit", "-q", "--allow-empty", "-m", commit_msg("empty again"))
    _commit(co, "vllm/b.py", "B = 1\n", "b: two")
    r = p.run("refresh", REF1)
    assert r.rc == 0, r
    assert sorted(f.name for f in p.stack_dir().glob("*.patch"))[-2:] == ["0004-a-one.patch", "0005-b-two.patch"]


def test_a_merge_commit_is_refused_and_the_command_named_makes_the_branch_linear(tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    git(co, "switch", "-q", "-c", "side", "HEAD~1")
    _commit(co, "vllm/side.py", "# user work: side\n", "side: a commit on a side branch")
    git(co, "switch", "-q", BRANCH)
    git(co, "merge", "-q", "--no-ff", "-m", "merge side", "side")
    before = work_now(p)
    r = p.run("refresh", REF1)
    assert r.rc == 4 and "merge commit" in r.err and error_shape(r.err) is None, r
    assert before.patches == subjects_in_patches(p.stack_dir())
    done = follow(p, alternatives(hint_of(r.err))[0])
    assert done.ok, done.results
    r = p.run("refresh", REF1)
    assert r.rc == 0 and "side-a-commit-on-a-side-branch" in r.out, r
    assert lost(p, before) == []


def test_a_mode_only_commit_is_exported_and_applies_again(tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    (co / "README.md").chmod(0o755)
    git(co, "commit", "-qam", commit_msg("readme: executable"))
    r = p.run("refresh", REF1)
    assert r.rc == 0, r
    text = (p.stack_dir() / "0004-readme-executable.patch").read_text()
    assert "old mode 100644\nnew mode 100755" in text, text
    assert p.run("verify", REF1).rc == 0
    tree = git(co, "rev-parse", "HEAD^{tree}")
    assert p.run("apply", REF1, "--force").rc == 0  # applied again from patches/: the same tree
    assert git(co, "rev-parse", "HEAD^{tree}") == tree
    assert git(co, "ls-tree", "HEAD", "README.md").startswith("100755")


# ---------------------------------------------------------------- a git operation of the user's, half done


def _rebase_stopped(co: Path) -> None:
    env = {**os.environ, "GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"}
    subprocess.run(["git", "rebase", "-q", "-i", "HEAD~2"], cwd=co, env=env, capture_output=True)


def _merge_conflict(co: Path) -> None:
    git(co, "switch", "-q", "-c", "side", "refs/dsadapt/base")
    _commit(co, "vllm/util.py", "# user work: the side's util\n", "side: util")
    git(co, "switch", "-q", BRANCH)
    git(co, "merge", "side", check=False)


def _cherry_pick_conflict(co: Path) -> None:
    git(co, "switch", "-q", "-c", "side", "refs/dsadapt/base")
    _commit(co, "vllm/util.py", "# user work: the side's util\n", "side: util")
    git(co, "switch", "-q", BRANCH)
    git(co, "cherry-pick", "side", check=False)


def _revert_conflict(co: Path) -> None:
    (co / "vllm" / "util.py").write_text("# user work: util rewritten\n")
    git(co, "commit", "-qam", commit_msg("util: rewritten"))
    git(co, "revert", "--no-edit", "HEAD~2", check=False)


def _bisect(co: Path) -> None:
    git(co, "bisect", "start", "HEAD", "refs/dsadapt/base")


def _am_by_hand(co: Path) -> None:
    patch = git(co, "format-patch", "-1", "--stdout", "HEAD~1", strip=False)
    git(co, "reset", "-q", "--hard", "HEAD~2")
    (co / "vllm" / "util.py").write_text("# user work: conflicting util\n")
    git(co, "commit", "-qam", commit_msg("util: conflicting"))
    subprocess.run(["git", "am", "-3"], cwd=co, input=patch, text=True, capture_output=True)


IN_PROGRESS = {"git rebase -i stopped at an edit": (_rebase_stopped, "git rebase --continue"),
               "git merge stopped on a conflict": (_merge_conflict, "git merge --abort"),
               "git cherry-pick stopped on a conflict": (_cherry_pick_conflict, "git cherry-pick --abort"),
               "git revert stopped on a conflict": (_revert_conflict, "git revert --abort"),
               "git bisect running": (_bisect, "git bisect reset"),
               "git am by hand stopped on a conflict": (_am_by_hand, "git am --continue")}


@pytest.mark.parametrize("what", list(IN_PROGRESS))
def test_a_git_operation_left_half_done_is_refused_naming_how_to_finish_it(what, tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    make, named = IN_PROGRESS[what]
    make(co)
    before = work_now(p)
    refs = git(co, "for-each-ref", "--format=%(refname) %(objectname)")
    st_ = p.run("status", "--json").json()["checkouts"][0]
    assert st_["state"] != "stack applied" and status_problems(p, tmp_path / "oracle") == [], st_
    for cmd in (["apply", REF1], ["refresh", REF1]):
        r = p.run(*cmd)
        assert r.rc == 4 and error_shape(r.err) is None, (what, cmd, r)
        assert named in r.err, (what, cmd, r)
    assert git(co, "for-each-ref", "--format=%(refname) %(objectname)") == refs  # refused: nothing moved
    q = copy_project(p, tmp_path / "forced")
    r = q.run("apply", REF1, "--force")
    assert r.rc == 0, r
    assert lost(q, before) == [], what
    assert not any((q.checkout() / ".git" / f).exists()
                   for f in ("rebase-merge", "rebase-apply", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "BISECT_LOG"))
    assert status_problems(q, tmp_path / "oracle") == []
    r = q.run("apply", REF1)
    assert r.rc == 0 and "already applied" in r.out, r  # nothing of the user's operation is left to refuse


# ---------------------------------------------------------------- the lock changed under a checkout


def _lock_with(p: Project, old: str, new: str) -> None:
    text = (p.root / "upstream.lock").read_text()
    assert old in text
    (p.root / "upstream.lock").write_text(text.replace(old, new))


@pytest.mark.parametrize("field", ["commit", "tree"])
def test_a_pin_changed_under_an_existing_checkout_is_exit_3_with_the_fix(field, tmp_path):
    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    before = git(co, "for-each-ref", "--format=%(refname) %(objectname)")
    good = p.upstream.commits[TAG1] if field == "commit" else p.upstream.trees[TAG1]
    _lock_with(p, good, "ab" * 20)
    for cmd in (["apply", REF1], ["refresh", REF1], ["verify", REF1], ["apply", REF1, "--force"]):
        r = p.run(*cmd)
        assert r.rc == 3 and "does not match upstream.lock" in r.err and f"dsadapt apply {REF1}" in r.err, (cmd, r)
        assert error_shape(r.err) is None
    st_ = p.run("status", "--json").json()["checkouts"][0]
    assert st_["state"] == "broken" and "does not match upstream.lock" in st_["detail"], st_
    assert git(co, "for-each-ref", "--format=%(refname) %(objectname)") == before
    _lock_with(p, "ab" * 20, good)  # the lock put back: all is as it was
    r = p.run("apply", REF1)
    assert r.rc == 0 and "already applied" in r.out, r


def test_a_release_artifact_changed_under_a_checkout_unpacked_from_it_is_exit_3(project, clean_stack, tmp_path):
    from conftest import artifact_toml, make_wheel

    wheel, sha = make_wheel(project.upstream, tmp_path / "artifacts")
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, sha)))
    project.env["DSADAPT_SOURCES"] = "pypi"
    assert project.run("apply", REF1).rc == 0
    _lock_with(project, sha, "cd" * 32)
    r = project.run("apply", REF1)
    assert r.rc == 3 and "artifact sha256" in r.err and error_shape(r.err) is None, r


def test_a_change_to_the_pin_that_does_not_touch_its_tree_is_verified_and_recorded(tmp_path):
    from conftest import artifact_toml

    p = _project(tmp_path / "p")
    assert p.run("apply", REF1).rc == 0
    co = p.checkout()
    digest = git(co, "show", "refs/dsadapt/state:state.json")
    p.write_lock(lock_text(p.upstream, artifact=artifact_toml("vllm-1.0.0-py3-none-any.whl", "ef" * 32)))
    r = p.run("apply", REF1)
    assert r.rc == 0 and "already applied" in r.out, r  # the base is still the commit and tree it pins
    assert git(co, "show", "refs/dsadapt/state:state.json") != digest  # the new pin's digest is recorded
    assert p.run("status", "--json").json()["checkouts"][0]["state"] == "stack applied"

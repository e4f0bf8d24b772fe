"""A hypothesis state machine over a checkout: dsadapt's commands, the user's own git in it (commits,
amends on a detached HEAD, branches, resets, stashes, empty / merge / mode-only commits, `git am`
by hand at a stop, worktrees), damage to dsadapt's record and refs, a lock edited under the
checkout, patches/ changing under it, kills of dsadapt at random points, and every hint a refusal
gives, followed literally. Sequences are generated, not listed (docs/robustness.md has the counts).

After every step: no work of the user's that a ref or HEAD held is lost (misuse_support.lost), a
refused command answers with one error line and one hint, status tells the truth
(misuse_support.status_problems), a branch another worktree holds has not moved, a lock that no
longer matches is answered with exit 3. At the end of every sequence the checkout is driven to a
clean "stack applied" with dsadapt's own commands (after the user puts the lock back and frees the
branch, as the hints say): never a git command of the user's ("manual").

MISUSE_MACHINE_EXAMPLES / MISUSE_MACHINE_STEPS bound the run; the CI profile (HYPOTHESIS_PROFILE=ci)
(misuse_support) is derandomized. MISUSE_SHRINK=1 shrinks a failing sequence (minutes). MISUSE_SUMMARY=<file>
appends the tally as one JSON line; MISUSE_LOG=<file> every sequence's steps.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from conftest import (
    MOD_V1,
    REF1,
    TAG1,
    Project,
    clean_stack_edits,
    commit_msg,
    conflicting_stack,
    edit,
    git,
    make_patches,
)
from fault_harness import fork_run
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from misuse_support import (
    BRANCH,
    alternatives,
    error_shape,
    fixture_project,
    follow,
    hint_of,
    lost,
    status_problems,
    work_now,
)

SHRINK = os.environ.get("MISUSE_SHRINK") == "1"  # shrinking a sequence of git and dsadapt steps takes minutes

RESOLVED = edit(MOD_V1, 'scoring = getattr(config, "scoring_func", "softmax")',
                'scoring = getattr(config, "scoring_func", None) or "tanh"')
HISTORY = ("detach", "amend middle", "switch -c", "branch -m", "checkout branch", "reset back", "stash", "merge")
DAMAGE = ("delete record", "truncate record", "garbage record", "remove .git/dsadapt", "remove .git/dsadapt and its copy",
          "delete stack and base refs", "delete backups", "damage ref files")
COMMANDS = ["apply", "apply --force", "continue", "skip", "abort", "refresh", "refresh --force"]
TALLY = {"sequences": 0, "steps": 0, "dsadapt": 0, "kill runs": 0, "kills": 0, "hints followed": 0, "git steps": 0,
         "damage": 0, "lock edits": 0, "worktrees": 0, "lost": 0, "wrong": 0, "manual": 0}


def _project(root: Path) -> Project:
    return fixture_project(root)


class Checkout(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="dsadapt-machine-"))
        self.p = _project(self.tmp / "p")
        self.n = 0
        self.hint = ""
        self.lock_good = (self.p.root / "upstream.lock").read_text()
        self.wt: Path | None = None
        self.log: list[str] = []
        TALLY["sequences"] += 1

    @property
    def co(self) -> Path:
        return self.p.checkout()

    def teardown(self) -> None:
        try:
            self._drive_to_done()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if os.environ.get("MISUSE_LOG"):  # every sequence, one line each (what the tally counts)
                with open(os.environ["MISUSE_LOG"], "a") as f:
                    f.write("machine: " + " | ".join(self.log) + "\n")

    # ------------------------------------------------------------ judging

    def _fail(self, what: str, problem: str) -> None:
        TALLY[what] += 1
        raise AssertionError(f"{what.upper()}: {problem}\nsteps: {self.log}")

    def _judged(self, label: str, run, *, locked_out: bool = False):
        """Run a step that is a dsadapt command: what the user had is still there afterwards."""
        before = work_now(self.p)
        wt_before = self._wt_state()
        res = run()
        self.log.append(f"{label} -> {getattr(res, 'rc', res)}" + (f" ({res.err.strip().splitlines()[-2][:160]})"
                                                                   if getattr(res, "rc", 0) and res.err.count("\n") > 1
                                                                   else ""))
        gone = lost(self.p, before)
        if gone:
            self._fail("lost", f"{label} lost {gone}")
        wt_after = self._wt_state()
        if wt_before is not None and wt_after is not None and wt_after != wt_before:
            self._fail("wrong", f"{label} moved the branch or the files under the other worktree")
        if wt_before is not None and wt_after is None:
            self.wt = None  # the user freed it (as the hint said)
        if hasattr(res, "rc") and res.rc:
            shape = error_shape(res.err)
            if shape or "Traceback" in res.err:
                self._fail("wrong", f"{label}: {shape or res.err[-500:]}")
            if res.rc not in (2, 3, 4, 6, 7):
                self._fail("wrong", f"{label} exited {res.rc}: {res.err[-400:]}")
            self.hint = hint_of(res.err)
        if locked_out and hasattr(res, "rc") and label.split()[0] in ("apply", "refresh") and res.rc != 3 \
                and not (res.rc == 4 and "cannot be told" in res.err):
            self._fail("wrong", f"{label} over a lock that does not match the checkout: exit {res.rc}, not 3")
        return res

    def _wt_state(self):
        """The branch's head and the other worktree's files, while that worktree holds the branch."""
        if self.wt is None or not self.wt.is_dir():
            return None
        if git(self.wt, "symbolic-ref", "-q", "HEAD", check=False) != f"refs/heads/{BRANCH}":
            return None
        return (git(self.co, "rev-parse", f"refs/heads/{BRANCH}", check=False),
                git(self.wt, "status", "--porcelain", "--untracked-files=all", check=False))

    @invariant()
    def status_tells_the_truth(self) -> None:
        if not (self.co / ".git").is_dir():
            return
        probs = status_problems(self.p, self.tmp / "oracle")
        if probs:
            self._fail("wrong", "; ".join(probs))

    def _locked_out(self) -> bool:
        return (self.p.root / "upstream.lock").read_text() != self.lock_good

    # ------------------------------------------------------------ dsadapt

    @initialize()
    def applied(self) -> None:
        assert self.p.run("apply", REF1).rc == 0

    @rule(cmd=st.sampled_from(COMMANDS), follow=st.one_of(st.none(), st.integers(0, 3)))
    def dsadapt(self, cmd: str, follow: int | None) -> None:
        """A dsadapt command; when it refuses, the user mostly does what its hint says, right away
        and literally (`follow` picks one of its alternatives; None: the user does something else)."""
        TALLY["steps"] += 1
        TALLY["dsadapt"] += 1
        argv = cmd.split()
        argv.insert(1, REF1)
        self.hint = ""
        self._judged(cmd, lambda: self.p.run(*argv), locked_out=self._locked_out())
        if follow is not None and self.hint:
            self._follow_hint(follow)

    @rule(cmd=st.sampled_from(COMMANDS), at=st.integers(1, 24))
    def killed(self, cmd: str, at: int) -> None:
        """A dsadapt command killed with -9 at its `at`-th fault point (a git start or end, a durable
        write, a removal); most commands have 25 to 140 of them, so most such runs are killed."""
        TALLY["steps"] += 1
        TALLY["kill runs"] += 1
        argv = cmd.split()
        argv.insert(1, REF1)
        self.hint = ""

        def run():
            killed, rc = fork_run(self.p, argv, {"DSADAPT_FAULT": f"any:{at}"})
            TALLY["kills"] += killed
            return f"{'killed' if killed else rc} at {at}"

        self._judged(f"{cmd} (kill -9 at point {at})", run)

    def _follow_hint(self, which: int) -> None:
        """The user does what the refusal just said, literally (one of its alternatives): git in the
        checkout, dsadapt through the CLI; a git command that stops on a conflict is undone with its
        own --abort."""
        alts = alternatives(self.hint)
        self.hint = ""
        if not alts:
            return
        TALLY["steps"] += 1
        TALLY["hints followed"] += 1
        alt = alts[which % len(alts)]

        def run():
            done = follow(self.p, alt, name=f"mine-{self.n}")
            if not done.ok and done.results[-1][0].startswith("git "):
                for verb in ("rebase", "am", "merge", "cherry-pick", "revert"):  # a conflict: undone
                    git(self.co, verb, "--abort", check=False)
            return f"{alt}: {'ok' if done.ok else done.results[-1][:2]}"

        self._judged(f"follow {alt}", run)

    # ------------------------------------------------------------ the user's git

    def _g(self, *args: str) -> str:
        return git(self.co, *args, check=False)

    def _git_step(self, what: str) -> None:
        self.hint = ""   # a hint is followed right after the refusal that gave it, or not at all
        TALLY["steps"] += 1
        TALLY["git steps"] += 1
        self.n += 1
        self.log.append(what)

    @rule(kind=st.sampled_from(["commit", "amend", "empty", "mode", "edit", "untracked", "detach", "amend middle",
                                "switch -c", "branch -m", "checkout branch", "reset back", "stash", "merge"]))
    def user_git(self, kind: str) -> None:
        """The user's own git in the checkout."""
        if kind in HISTORY:
            self.user_history(kind)
        else:
            self.user_commit(kind)

    def user_commit(self, kind: str) -> None:
        self._git_step(f"git {kind}")
        co, n = self.co, self.n
        if kind == "commit":
            (co / f"user-{n}.txt").write_text(f"user work {n}\n")
            self._g("add", f"user-{n}.txt")
            self._g("commit", "-qm", commit_msg(f"user commit {n}"))
        elif kind == "amend":
            (co / f"amend-{n}.txt").write_text(f"user work {n} (amended)\n")
            self._g("add", f"amend-{n}.txt")
            self._g("commit", "-q", "--amend", "--no-edit")
        elif kind == "empty":
            self._g("commit", "-q", "--allow-empty", "-m", commit_msg(f"empty {n}"))
        elif kind == "mode":
            f = co / "README.md"
            if f.is_file():
                f.chmod(f.stat().st_mode ^ 0o111)
                self._g("commit", "-qm", commit_msg(f"readme: mode {n}"), "README.md")
        elif kind == "edit":
            with open(co / "vllm" / "util.py", "a") as f:
                f.write(f"# user work {n}\n")
        else:
            (co / f"notes-{n}.txt").write_text(f"user work {n}: notes\n")

    def user_history(self, kind: str) -> None:
        self._git_step(f"git {kind}")
        n = self.n
        if kind == "detach":
            self._g("checkout", "-q", "--detach", "HEAD~1")
        elif kind == "amend middle":  # the case that lost a patch
            self._g("checkout", "-q", "--detach", "HEAD~1")
            (self.co / f"middle-{n}.txt").write_text(f"user work {n} (amended middle)\n")
            self._g("add", f"middle-{n}.txt")
            self._g("commit", "-q", "--amend", "--no-edit")
        elif kind == "switch -c":
            self._g("switch", "-q", "-c", f"mine-{n}")
        elif kind == "branch -m":
            self._g("branch", "-m", BRANCH, f"renamed-{n}")
        elif kind == "checkout branch":
            self._g("checkout", "-q", BRANCH)
        elif kind == "reset back":
            self._g("reset", "-q", "--hard", "HEAD~1")
        elif kind == "stash":
            self._g("stash", "-q", "-u")
        else:
            self._g("switch", "-q", "-c", f"side-{n}", "HEAD~1")
            (self.co / f"side-{n}.txt").write_text(f"user work {n} (side)\n")
            self._g("add", f"side-{n}.txt")
            self._g("commit", "-qm", commit_msg(f"side {n}"))
            self._g("switch", "-q", "-")
            self._g("merge", "-q", "--no-ff", "--no-edit", f"side-{n}")

    @precondition(lambda self: (self.p.checkout() / ".git" / "rebase-apply").is_dir())
    @rule(kind=st.sampled_from(["--continue", "--skip", "--abort", "--quit"]))
    def git_am_by_hand(self, kind: str) -> None:
        self._git_step(f"git am {kind}")
        if kind == "--continue":
            (self.co / "vllm" / "mod.py").write_text(RESOLVED)
            self._g("add", "vllm/mod.py")
        self._g("am", kind)

    @precondition(lambda self: self.wt is None)
    @rule()
    def worktree_of_the_branch(self) -> None:
        self._git_step("git worktree add (the stack branch)")
        TALLY["worktrees"] += 1
        wt = self.tmp / f"wt-{self.n}"
        if self._g("symbolic-ref", "-q", "HEAD") == f"refs/heads/{BRANCH}":
            self._g("switch", "-q", "--detach")
        self._g("worktree", "add", "-q", "-f", str(wt), BRANCH)
        if wt.is_dir():
            self.wt = wt
            (wt / f"wt-{self.n}.txt").write_text(f"user work {self.n} (in the other worktree)\n")

    @precondition(lambda self: self.wt is not None)
    @rule()
    def worktree_freed(self) -> None:
        self._git_step("git -C WT switch --detach")
        assert self.wt is not None
        git(self.wt, "switch", "-q", "--detach", check=False)
        self.wt = None

    # ------------------------------------------------------------ patches/ and the lock change

    @rule(kind=st.sampled_from(["pull clean", "pull conflicting", "lock edited", "lock restored", *DAMAGE]))
    def outside(self, kind: str) -> None:
        """What changes besides the checkout's git: patches/ (a pull), upstream.lock, dsadapt's own files."""
        if kind.startswith("pull"):
            self.pull(kind == "pull conflicting")
        elif kind.startswith("lock"):
            self.lock_edited(kind == "lock restored")
        else:
            self.damage(kind)

    def pull(self, conflicting: bool) -> None:
        self._git_step(f"pull ({'conflicting' if conflicting else 'clean'} stack)")
        if conflicting:
            conflicting_stack(self.p)
        else:
            self.p.write_stack(make_patches(self.p.upstream, self.tmp / f"mk-{self.n}", TAG1,
                                            clean_stack_edits()[:2]))

    def lock_edited(self, restore: bool) -> None:
        self._git_step("lock restored" if restore else "lock edited (another commit and tree id)")
        TALLY["lock edits"] += 1
        lock = self.p.root / "upstream.lock"
        if restore:
            lock.write_text(self.lock_good)
        else:
            lock.write_text(self.lock_good.replace(self.p.upstream.commits[TAG1], "ab" * 20)
                            .replace(self.p.upstream.trees[TAG1], "cd" * 20))

    # ------------------------------------------------------------ damage to dsadapt's own files

    def damage(self, kind: str) -> None:
        self._git_step(f"damage: {kind}")
        TALLY["damage"] += 1
        own = self.co / ".git" / "dsadapt"
        rec = own / "state.json"
        if kind == "delete record":
            rec.unlink(missing_ok=True)
        elif kind == "truncate record":
            if rec.is_file():
                rec.write_bytes(rec.read_bytes()[: len(rec.read_bytes()) // 3])
        elif kind == "garbage record":
            if rec.is_file():
                rec.write_text('{"schema": 2, "ref": 7}')
        elif kind.startswith("remove .git/dsadapt"):
            shutil.rmtree(own, ignore_errors=True)
            if "copy" in kind:
                self._g("update-ref", "-d", "refs/dsadapt/state")
        elif kind == "delete stack and base refs":
            self._g("update-ref", "-d", "refs/dsadapt/stack")
            self._g("update-ref", "-d", "refs/dsadapt/base")
        elif kind == "delete backups":
            for r in self._g("for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/").split():
                self._g("update-ref", "-d", r)
        elif kind == "damage ref files":
            for r in ("refs/dsadapt/base", "refs/dsadapt/stack", f"refs/heads/{BRANCH}"):
                f = self.co / ".git" / r
                if f.is_file():
                    f.write_text("damaged\n")

    # ------------------------------------------------------------ the end: dsadapt alone finishes

    def _drive_to_done(self) -> None:
        """The user puts the lock back and frees the branch (what those hints say); then only
        dsadapt's commands, as status names them, must reach "stack applied"."""
        (self.p.root / "upstream.lock").write_text(self.lock_good)
        if self.wt is not None:
            git(self.wt, "switch", "-q", "--detach", check=False)
            self.wt = None
        before = work_now(self.p)
        ran: list[str] = []
        then: str | None = None   # the dsadapt command the last refusal's hint named
        for _ in range(10):
            r = self.p.run("status", "--json")
            stt = r.json()["checkouts"][0]
            if stt["state"] == "stack applied":
                break
            if stt["state"] == "stopped":
                cmd = f"skip {REF1}"
            elif then:
                cmd = then
            elif stt["next"]:
                cmd = stt["next"].removeprefix("dsadapt ")
            else:
                cmd = f"apply {REF1} --force"
            res = self.p.run(*cmd.split())
            own = [a for a in alternatives(hint_of(res.err)) if all(c.startswith("dsadapt ") for c in a)] \
                if res.rc else []
            then = own[0][0].removeprefix("dsadapt ") if own and own[0][0].removeprefix("dsadapt ") != cmd else None
            ran.append(f"{stt['state']}: {cmd} -> {res.rc} {res.err.strip()[-200:]}")
            if res.rc and "Traceback" in res.err:
                self._fail("wrong", f"{cmd}: {res.err[-500:]}")
            if res.rc and "worktree" in res.err:  # the user frees the branch as the hint says (their worktree)
                alts = alternatives(hint_of(res.err))
                if alts:
                    follow(self.p, alts[0])
        else:
            self._fail("manual", f"dsadapt's own commands did not finish the checkout: {ran}")
        gone = lost(self.p, before)
        if gone:
            self._fail("lost", f"finishing with {ran} lost {gone}")


Checkout.TestCase.settings = settings(
    max_examples=int(os.environ.get("MISUSE_MACHINE_EXAMPLES", "10")),
    stateful_step_count=int(os.environ.get("MISUSE_MACHINE_STEPS", "10")), deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, *([Phase.shrink] if SHRINK else [])])
TestCheckoutMisuse = Checkout.TestCase


def test_the_machine_ran_and_its_tally_is_written():
    """(after the machine) it ran sequences with kills and hints, and found nothing; with
    MISUSE_SUMMARY set the tally is appended there (docs/robustness.md quotes it)."""
    if not TALLY["sequences"]:
        import pytest

        pytest.skip("the state machine did not run in this session")
    assert TALLY["lost"] == TALLY["wrong"] == TALLY["manual"] == 0, TALLY
    assert TALLY["dsadapt"] and TALLY["git steps"], TALLY
    if os.environ.get("MISUSE_SUMMARY"):
        with open(os.environ["MISUSE_SUMMARY"], "a") as f:
            f.write(json.dumps({"suite": "misuse machine", **TALLY}) + "\n")

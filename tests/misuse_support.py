"""What the misuse and fault suites judge a checkout by: the user's work (commits, files, patches)
before and after a command, whether `status` tells the truth, and the commands a hint names, run
the way a user who follows it would.

The judgement is made with git and the file system only (never with dsadapt's own reading of the
checkout): "lost" is a commit of the user's that some ref or HEAD reached before and none reaches
after, a file of the user's that is neither in place nor in a backup ref, a patch of patches/ that
is neither in patches/ nor in a commit under refs/dsadapt/; "wrong" is status calling a state fine
that is not, a branch moved under another worktree, a changed lock not answered with exit 3.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from conftest import TAG1, Project, clean_stack_edits, git, lock_text, make_patches, make_upstream
from hypothesis import settings

# The hypothesis profile of CI (HYPOTHESIS_PROFILE=ci, or any CI that sets CI): the same examples on
# every run, so a red run is the code's doing, never the draw's. Example counts are each test's own,
# bounded (and raised locally through their environment variables).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "explore"))

def fixture_project(root: Path, *, stack: bool = True) -> Project:
    """A fixture upstream, a project pinning it (git source only) and, with `stack`, the three-patch
    clean stack on v1.0.0: what the generated suites start every example from."""
    root.mkdir(parents=True)
    up = make_upstream(root)
    proj = root / "project"
    proj.mkdir()
    env = {"DSADAPT_PROJECT": str(proj), "DSADAPT_WORKDIR": str(root / "work"),
           "DSADAPT_CACHE": str(root / "work" / "cache"), "DSADAPT_SOURCES": "git", "DSADAPT_MIRRORS": "",
           "DSADAPT_ARTIFACTS": str(root / "artifacts"), "DSADAPT_LOCK_TIMEOUT": "5", "DSADAPT_GIT_WAIT": "2"}
    (root / "artifacts").mkdir()
    (root / "work").mkdir()
    p = Project(proj, up, env, root)
    p.write_lock(lock_text(up))
    if stack:
        p.write_stack(make_patches(up, root / "mk", TAG1, clean_stack_edits()))
    return p


FIXED_CT = "1700000000"   # dsadapt's own commits carry this committer date (gitutil.FIXED_DATE)
BRANCH = f"dsadapt/{TAG1}"


# ---------------------------------------------------------------- the user's work


def user_commits(co: Path) -> set[str]:
    """Commits of the user's that a ref, HEAD or another worktree's HEAD reaches (dsadapt's own,
    with its fixed date, and upstream's history below the base left out)."""
    out = git(co, "log", "--all", "--format=%H %ct", "--not", "refs/dsadapt/base", check=False)
    if not out and not git(co, "rev-parse", "--verify", "--quiet", "refs/dsadapt/base", check=False):
        out = git(co, "log", "--all", "--format=%H %ct", check=False)
    return {l.split()[0] for l in out.splitlines() if l.split() and l.split()[1] != FIXED_CT}


def reachable(co: Path, commit: str) -> bool:
    """On a ref (a branch, a tag, a backup), reached from HEAD or from another worktree's HEAD."""
    if git(co, "for-each-ref", "--contains", commit, "--format=%(refname)", check=False):
        return True
    heads = ["HEAD"] + [p for p in _worktree_heads(co)]
    return any(subprocess.run(["git", "merge-base", "--is-ancestor", commit, h], cwd=co,
                              capture_output=True).returncode == 0 for h in heads)


def _worktree_heads(co: Path) -> list[str]:
    d = co / ".git" / "worktrees"
    out = []
    if d.is_dir():
        for w in d.iterdir():
            try:
                text = (w / "HEAD").read_text().strip()
            except OSError:
                continue
            out.append(text[5:] if text.startswith("ref: ") else text)
    return out


@dataclass
class UserFile:
    kind: str      # file | untracked
    path: str
    content: str


def user_files(co: Path, marker: str = "user work") -> list[UserFile]:
    """Files of the user's in the work tree now (their content carries `marker`)."""
    out = []
    for line in git(co, "status", "--porcelain", "--untracked-files=all", check=False).splitlines():
        path = line[3:].split(" -> ")[-1]
        p = co / path
        if p.is_file() and not p.is_symlink():
            text = p.read_text(errors="replace")
            if marker in text:
                out.append(UserFile("untracked" if line.startswith("??") else "file", path, text))
    return out


def file_kept(co: Path, f: UserFile) -> bool:
    p = co / f.path
    if p.is_file() and p.read_text(errors="replace") == f.content:
        return True
    for ref in git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/", check=False).split():
        for spec in (f"{ref}:{f.path}", f"{ref}^3:{f.path}"):
            if git(co, "show", spec, check=False, strip=False) == f.content:
                return True
    return False


def subjects_in_patches(d: Path) -> set[str]:
    out = set()
    if d.is_dir():
        for f in d.glob("*.patch"):
            m = re.search(r"^Subject: (?:\[PATCH\] )?(.*)$", f.read_text(errors="replace"), re.M)
            if m:
                out.add(" ".join(m.group(1).split()).lower())
    return out


def subjects_kept_in_refs(co: Path) -> set[str]:
    """Subjects of the patch files the commits under refs/dsadapt/ hold (backups, stack snapshots)."""
    out = set()
    for ref in git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/", check=False).split():
        names = [n for n in git(co, "ls-tree", "--name-only", ref, check=False).split() if n.endswith(".patch")]
        for n in names:
            m = re.search(r"^Subject: (?:\[PATCH\] )?(.*)$", git(co, "show", f"{ref}:{n}", check=False), re.M)
            if m:
                out.add(" ".join(m.group(1).split()).lower())
    return out


@dataclass
class Work:
    """What of the user's is in a checkout at one instant."""

    commits: set[str] = field(default_factory=set)
    files: list[UserFile] = field(default_factory=list)
    patches: set[str] = field(default_factory=set)


def work_now(p: Project) -> Work:
    co = p.checkout()
    if not (co / ".git").is_dir():
        return Work()
    return Work(user_commits(co), user_files(co), subjects_in_patches(p.stack_dir()))


def _patch_id(co: Path, rev: str) -> str | None:
    show = subprocess.run(["git", "show", "--format=", "--no-color", rev], cwd=co, capture_output=True, text=True)
    out = subprocess.run(["git", "patch-id", "--stable"], cwd=co, input=show.stdout, capture_output=True,
                         text=True).stdout.split()
    return out[0] if out else None


def carried(co: Path, commit: str) -> bool:
    """A commit no ref reaches whose change a reachable commit carries (same patch-id): rebased,
    as `git rebase` and `git cherry` count it."""
    pid = _patch_id(co, commit)
    if pid is None:
        return False
    log = subprocess.run(["git", "log", "--all", "-p", "--no-color", "--no-merges", "--format=commit %H"], cwd=co,
                         capture_output=True, text=True).stdout
    ids = subprocess.run(["git", "patch-id", "--stable"], cwd=co, input=log, capture_output=True, text=True).stdout
    return any(l.split()[0] == pid for l in ids.splitlines() if l.split())


def change_in(co: Path, commit: str, rev: str, scratch: Path) -> bool:
    """Whether `rev`'s tree already holds `commit`'s change (its diff reverse-applies there)."""
    diff = subprocess.run(["git", "diff", "--binary", "--full-index", f"{commit}^", commit], cwd=co,
                          capture_output=True, text=True).stdout
    if not diff.strip():
        return True
    scratch.mkdir(parents=True, exist_ok=True)
    idx = scratch / f"index-{commit[:12]}"
    env = {**os.environ, "GIT_INDEX_FILE": str(idx)}
    subprocess.run(["git", "read-tree", rev], cwd=co, env=env, check=True)
    r = subprocess.run(["git", "apply", "--cached", "--check", "-R"], cwd=co, input=diff, text=True, env=env,
                       capture_output=True)
    idx.unlink(missing_ok=True)
    return r.returncode == 0


def lost(p: Project, before: Work) -> list[str]:
    """What of `before` is gone now (empty: nothing). A commit counts as kept when a ref or HEAD
    reaches it, or a commit they reach carries its change (it was rebased)."""
    co = p.checkout()
    out = [f"commit {c[:12]}" for c in sorted(before.commits) if not reachable(co, c) and not carried(co, c)]
    out += [f"{f.kind} {f.path}" for f in before.files if not file_kept(co, f)]
    gone = before.patches - subjects_in_patches(p.stack_dir())
    if gone:
        gone -= subjects_kept_in_refs(co)
    out += [f"patch {s!r}" for s in sorted(gone)]
    return out


# ---------------------------------------------------------------- status tells the truth


def expected_tree(co: Path, patches_dir: Path, scratch: Path, base: str = "refs/dsadapt/base") -> str | None:
    """The tree patches/ gives on the base (git apply --cached in a scratch index and object dir):
    the oracle for "stack applied"."""
    series = [l.split("#", 1)[0].strip() for l in (patches_dir / "series").read_text().splitlines()]
    series = [s for s in series if s]
    scratch.mkdir(parents=True, exist_ok=True)
    n = len(list(scratch.glob("oracle-*")))
    d = scratch / f"oracle-{n}"
    (d / "objects").mkdir(parents=True)
    env = {"GIT_INDEX_FILE": str(d / "index"), "GIT_OBJECT_DIRECTORY": str(d / "objects"),
           "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(co / ".git" / "objects")}
    git(co, "read-tree", base, env=env)
    for name in series:
        r = subprocess.run(["git", "apply", "--cached"], cwd=co, input=(patches_dir / name).read_text(),
                           text=True, capture_output=True, env={**os.environ, **env})
        if r.returncode:
            return None
    return git(co, "write-tree", env=env)


def status_problems(p: Project, scratch: Path) -> list[str]:
    """Where `dsadapt status` calls a state fine that git shows is not (empty: it tells the truth)."""
    r = p.run("status", "--json")
    if r.rc != 0 or "Traceback" in r.err:
        return [f"status failed: {r}"]
    st = next((c for c in r.json()["checkouts"] if c["ref"] == f"vllm@{TAG1}"), None)
    if st is None:
        return ["status does not list the pin"]
    co = p.checkout()
    out = []
    if st["state"] in ("stopped", "interrupted") and not (st["next"] or "").startswith("dsadapt "):
        out.append(f"status {st['state']} names no next command: {st['detail']}")
    if st["state"] == "stopped" and not (co / ".git" / "rebase-apply").is_dir():
        out.append(f"status says stopped but no git am stands on a patch: {st['detail']}")
    if st["state"] == "stack applied":
        head = git(co, "rev-parse", "HEAD", check=False)
        if head != git(co, "rev-parse", f"refs/heads/{BRANCH}", check=False):
            out.append("status says 'stack applied' but HEAD is not the branch's head")
        if git(co, "status", "--porcelain", "--untracked-files=all", check=False):
            out.append("status says 'stack applied' over uncommitted changes")
        base = p.upstream.commits[TAG1]  # what the lock pinned when the checkout was made (not dsadapt's ref)
        want = expected_tree(co, p.stack_dir(), scratch, base) if (p.stack_dir() / "series").is_file() else None
        if want is None or git(co, "rev-parse", "HEAD^{tree}", check=False) != want:
            out.append("status says 'stack applied' but the branch is not what patches/ gives")
        if _worktree_holds_branch(co):
            out.append("status says 'stack applied' while another worktree holds the branch")
        if not _lock_matches(p, co):
            out.append("status says 'stack applied' but the base is not what upstream.lock pins")
    if st["state"] == "clean base" and git(co, "rev-parse", "HEAD", check=False) != p.upstream.commits[TAG1]:
        out.append("status says 'clean base' but HEAD is not the base")
    return [f"{o} [{st['state']}: {st['detail']}]" for o in out]


def _worktree_holds_branch(co: Path) -> bool:
    return f"refs/heads/{BRANCH}" in _worktree_heads(co)


def _lock_matches(p: Project, co: Path) -> bool:
    text = (p.root / "upstream.lock").read_text()
    m = re.search(rf'\[pins."vllm@{re.escape(TAG1)}"\][^\[]*?commit = "([0-9a-f]+)"', text, re.S)
    return m is None or m.group(1) == p.upstream.commits[TAG1]


# ---------------------------------------------------------------- hints, followed


def alternatives(hint: str) -> list[list[str]]:
    """The command sequences a hint offers, in its order: it is split at `;` and `, or` outside
    backticks, and each part's backticked `git` / `dsadapt` commands are one sequence."""
    parts, cur, inside = [], "", False
    i = 0
    while i < len(hint):
        ch = hint[i]
        if ch == "`":
            inside = not inside
        if not inside and (ch == ";" or hint.startswith(", or ", i)):
            parts.append(cur)
            cur = ""
            i += 1
            continue
        cur += ch
        i += 1
    parts.append(cur)
    out = []
    for part in parts:
        cmds = [c.strip() for c in re.findall(r"`([^`]+)`", part)]
        cmds = [c for c in cmds if c.startswith(("git ", "dsadapt ")) and "<" not in c and "…" not in c]
        if cmds:
            out.append(cmds)
    return out


@dataclass
class Followed:
    commands: list[str]
    results: list[tuple[str, int, str]]   # (command, rc, output)

    @property
    def ok(self) -> bool:
        return all(rc == 0 for _, rc, _ in self.results)


def follow(p: Project, cmds: list[str], name: str = "mine") -> Followed:
    """Run a hint's command sequence as a user would: git in the checkout (NAME -> `name`), dsadapt
    through the CLI; stops at the first command that fails."""
    co = p.checkout()
    done = Followed(cmds, [])
    for c in cmds:
        argv = shlex.split(c.replace("NAME", name))
        if argv[0] == "git":
            r = subprocess.run(argv, cwd=co, capture_output=True, text=True,
                               env={**os.environ, "GIT_EDITOR": "true", "EDITOR": "true"})
            done.results.append((c, r.returncode, r.stdout + r.stderr))
        else:
            res = p.run(*argv[1:])
            done.results.append((c, res.rc, res.out + res.err))
        if done.results[-1][1] != 0:
            break
    return done


def hint_of(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.startswith("hint: ")]
    return lines[-1][len("hint: "):] if lines else ""


def error_shape(err: str) -> str | None:
    """None when a failed command answered with one error line then one hint (the last two lines)."""
    lines = err.strip().splitlines()
    if len(lines) < 2 or not lines[-2].startswith("error: ") or not lines[-1].startswith("hint: "):
        return f"not one error line and one hint: {err[-400:]!r}"
    if sum(l.startswith("error: ") for l in lines) != 1:
        return f"more than one error line: {err[-400:]!r}"
    return None

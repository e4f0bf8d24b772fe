"""A thin, explicit layer over git.

Everything dsadapt does to a repository goes through `Git.run`, so the exact commands are easy
to audit, to log and to interrupt (`faults.point` before and after each one). Git is run as a
plain subprocess: that is all GitPython's command runner does too, and importing GitPython
costs 65-80 ms on every dsadapt start (see docs/architecture.md); `Git.repo` hands out a
GitPython `Repo` for callers that want its object model, imported only then.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from patcher.base import faults
from patcher.base.dotgit import REFS, CheckoutLayout
from patcher.base.errors import DsadaptError

# Fixed identity and dates for the commits dsadapt itself makes (base snapshots, applied
# patches), so the same inputs give the same commit ids on every machine.
FIXED_DATE = "1700000000 +0000"
DSADAPT_IDENT = {"name": "dsadapt", "email": "dsadapt@localhost"}
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


@dataclass(frozen=True)
class GitResult:
    rc: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


class GitError(DsadaptError):
    pass


def signal_words(rc: int) -> tuple[str, str]:
    """(what happened, what to do) for a git process that a signal stopped (rc < 0), in words: git
    itself says nothing then."""
    import signal

    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    if name == "SIGXFSZ":
        return (f"stopped by {name}: a file it wrote grew past the file-size limit (ulimit -f)",
                "raise the limit (`ulimit -f unlimited`) or free space, then run the command again")
    if name == "SIGKILL":
        return f"stopped by {name} (out of memory, or another process)", "run the command again"
    return f"stopped by {name}", "run the command again"


# Trees dsadapt handles (release artifacts, mirrors, upstream commits) are data: nothing in them
# or next to them may make git run a program or change how git reads them. Every git command
# runs with hooks off, no fsmonitor, no signing, no submodule recursion, only these transports,
# and no attributes from the user's or the system's files; init_repo adds an attributes file
# that turns off, in every repository dsadapt creates, whatever a tree's .gitattributes asks for.
HARDENING_CONFIG = (
    ("core.hooksPath", "/dev/null"),
    ("core.fsmonitor", "false"),
    ("core.attributesFile", "/dev/null"),
    ("commit.gpgSign", "false"),
    ("tag.gpgSign", "false"),
    ("fetch.recurseSubmodules", "false"),
    ("submodule.recurse", "false"),
    ("protocol.ext.allow", "never"),
    ("protocol.fd.allow", "never"),
)
ALLOWED_PROTOCOLS = "file:git:http:https:ssh"
NEUTRAL_ATTRIBUTES = ("# written by dsadapt: attributes from the trees it unpacks never take effect here\n"
                      "* !filter !diff !merge !text !eol !crlf !ident !working-tree-encoding !export-subst "
                      "!export-ignore !whitespace !conflict-marker-size !delta !encoding\n")


def base_env(fixed_dates: bool = False) -> dict[str, str]:
    env = {
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "true",
        "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_ALLOW_PROTOCOL": ALLOWED_PROTOCOLS,
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_CONFIG_COUNT": str(len(HARDENING_CONFIG)),
        "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME", DSADAPT_IDENT["name"]),
        "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL", DSADAPT_IDENT["email"]),
    }
    for i, (key, value) in enumerate(HARDENING_CONFIG):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    if fixed_dates:
        env["GIT_AUTHOR_DATE"] = FIXED_DATE
        env["GIT_COMMITTER_DATE"] = FIXED_DATE
    return env


DSADAPT_AUTHOR = {"GIT_AUTHOR_NAME": DSADAPT_IDENT["name"], "GIT_AUTHOR_EMAIL": DSADAPT_IDENT["email"]}


class Git:
    def __init__(self, path: Path, env: dict[str, str] | None = None):
        self.path = Path(path)
        self.env = env or {}

    def with_env(self, **env: str) -> Git:
        """The same repository with extra environment (e.g. GIT_INDEX_FILE for a temporary index)."""
        return Git(self.path, {**self.env, **env})

    def _environ(self, fixed_dates: bool, env: dict[str, str] | None) -> dict[str, str]:
        full = dict(os.environ)
        full.update(base_env(fixed_dates))
        full.update(self.env)
        if env:
            full.update(env)
        return full

    def run_bytes(self, *args: str, check: bool = True, input: bytes | None = None,
                  env: dict[str, str] | None = None, fixed_dates: bool = False,
                  timeout: float | None = None) -> tuple[int, bytes, bytes]:
        faults.point("git-start", " ".join(args[:2]))
        try:
            p = subprocess.run(["git", *args], cwd=self.path, input=input, capture_output=True,
                               env=self._environ(fixed_dates, env), timeout=timeout)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = -9, e.stdout or b"", (e.stderr or b"") + b"\ntimed out"
        faults.point("git-end", " ".join(args[:2]))
        if check and rc != 0:
            self._raise(args, rc, err.decode("utf-8", "replace") or out.decode("utf-8", "replace"))
        return rc, out, err

    def run(self, *args: str, check: bool = True, input: str | None = None,
            env: dict[str, str] | None = None, fixed_dates: bool = False, timeout: float | None = None) -> GitResult:
        rc, out, err = self.run_bytes(*args, check=False, input=None if input is None else input.encode("utf-8"),
                                      env=env, fixed_dates=fixed_dates, timeout=timeout)
        res = GitResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
        if check and rc != 0:
            self._raise(args, rc, res.err or res.out)
        return res

    def _raise(self, args: tuple[str, ...], rc: int, text: str) -> None:
        msg = text.strip().splitlines()
        words = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-c")]
        what = f"git {' '.join(words[:2])}"
        if rc < 0 and not msg:  # killed by a signal: git said nothing
            words_, fix = signal_words(rc)
            raise GitError(f"{what} was {words_} in {self.path}", hint=f"{fix}; the repository was left as git left it")
        raise GitError(f"{what} failed in {self.path}: {msg[-1] if msg else rc}",
                       hint="that is git's own last line; the repository was left as git left it")

    def out(self, *args: str, **kw) -> str:
        return self.run(*args, **kw).out.strip()

    @property
    def repo(self):
        """GitPython's Repo for this path (imported on first use only)."""
        # GitPython refuses to import where git is missing unless told to stay quiet; commands
        # that never touch a repository (`install --offline`, `check` on an air-gapped host) never
        # get here, and the ones that do fail when they call git (GitCommandNotFound: exit 5).
        os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
        import git as gitpython

        return gitpython.Repo(self.path)

    # ------------------------------------------------------------ queries

    def rev(self, rev: str) -> str | None:
        r = self.run("rev-parse", "--verify", "--quiet", rev + "^{commit}", check=False)
        return r.out.strip() if r.ok else None

    def revs(self, *revs: str) -> dict[str, str | None]:
        """Many revisions in one process: {rev: commit id or None}."""
        if not revs:
            return {}
        out: dict[str, str | None] = {}
        res = self.run("cat-file", "--batch-check=%(objectname) %(objecttype)",
                       input="".join(f"{x}^{{commit}}\n" for x in revs), check=False)
        for rev, line in zip(revs, res.out.splitlines()):
            parts = line.split()
            out[rev] = parts[0] if len(parts) == 2 and parts[1] == "commit" else None
        return out

    def tree_of(self, rev: str) -> str:
        return self.out("rev-parse", rev + "^{tree}")

    def blob_at(self, rev: str, path: str) -> str | None:
        r = self.run("rev-parse", "--verify", "--quiet", f"{rev}:{path}", check=False)
        return r.out.strip() if r.ok else None

    def blobs_at(self, rev: str, paths: list[str]) -> dict[str, str | None]:
        """Blob ids of many paths at once (ls-tree), None where absent."""
        if not paths:
            return {}
        res: dict[str, str | None] = {p: None for p in paths}
        out = self.run("ls-tree", "-z", rev, "--", *paths).out
        for rec in out.split("\0"):
            if not rec:
                continue
            meta, path = rec.split("\t", 1)
            _mode, kind, oid = meta.split()
            if kind == "blob" and path in res:
                res[path] = oid
        return res

    def cat_blobs(self, specs: list[str]) -> dict[str, bytes | None]:
        """Contents of many objects in one `cat-file --batch` ("<rev>:<path>" or ids); None if missing."""
        if not specs:
            return {}
        _, out, _ = self.run_bytes("cat-file", "--batch", input="".join(s + "\n" for s in specs).encode())
        res: dict[str, bytes | None] = {}
        pos = 0
        for spec in specs:
            nl = out.index(b"\n", pos)
            header = out[pos:nl].decode("utf-8", "replace").split()
            pos = nl + 1
            if len(header) == 3 and header[1] in ("blob", "commit", "tree", "tag"):
                size = int(header[2])
                res[spec] = out[pos:pos + size]
                pos += size + 1
            else:
                res[spec] = None
        return res

    def current_branch(self) -> str | None:
        r = self.run("symbolic-ref", "--quiet", "--short", "HEAD", check=False)
        return r.out.strip() if r.ok else None

    def status_entries(self) -> list[str]:
        """`git status --porcelain` lines (untracked files included, ignored ones not)."""
        out = self.run("status", "--porcelain", "-z", "--untracked-files=all").out
        entries, parts, i = [], out.split("\0"), 0
        while i < len(parts):
            e = parts[i]
            i += 1
            if not e:
                continue
            if e[:1] in ("R", "C"):  # a rename carries its source as the next field
                i += 1
            entries.append(e)
        return entries

    def is_dirty(self) -> bool:
        return bool(self.status_entries())

    def dirty_files(self) -> list[str]:
        return [e[3:] for e in self.status_entries()]

    def git_dir(self) -> Path:
        return self.path / ".git"

    def refs(self, *prefixes: str) -> list[tuple[str, str]]:
        out = self.out("for-each-ref", "--format=%(refname) %(objectname)", *prefixes)
        return [tuple(l.split(" ", 1)) for l in out.splitlines() if l]  # type: ignore[misc]

    def update_ref(self, ref: str, value: str, why: str | None = None) -> None:
        self.run("update-ref", *(["-m", why] if why else []), ref, value)

    def delete_ref(self, ref: str) -> None:
        self.run("update-ref", "-d", ref, check=False)

    def commits(self, rng: str) -> list[tuple[str, str, str]]:
        """(commit, subject, 'Author <email>') of a first-parent range, oldest first."""
        out = self.run("log", "--first-parent", "--reverse", "--format=%H%x00%s%x00%an <%ae>", rng,
                       check=False).out
        res = []
        for line in out.splitlines():
            parts = line.split("\0")
            if len(parts) == 3:
                res.append((parts[0], parts[1], parts[2]))
        return res

    # ------------------------------------------------------------ objects

    def write_object(self, kind: str, data: bytes) -> str:
        """Write a loose object the way git does (zlib of "<kind> <size>\\0<data>" under its sha1);
        no process is started. Returns its id."""
        import hashlib
        import zlib

        raw = f"{kind} {len(data)}\0".encode() + data
        oid = hashlib.sha1(raw).hexdigest()
        path = self.git_dir() / "objects" / oid[:2] / oid[2:]
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"tmp_obj_{os.getpid()}_{time.monotonic_ns()}"
            tmp.write_bytes(zlib.compress(raw, 1))
            os.chmod(tmp, 0o444)
            os.replace(tmp, path)
        return oid

    def head_commit(self) -> str | None:
        """HEAD's commit, read from .git (HEAD, then the loose ref) when it can be, else `rev-parse`."""
        try:
            text = (self.git_dir() / "HEAD").read_text().strip()
            if text.startswith("ref: refs/"):
                ref = (self.git_dir() / text[5:]).read_text().strip()
                if len(ref) == 40:
                    return ref
            elif len(text) == 40:
                return text
        except OSError:
            pass
        return self.rev("HEAD")

    def head(self) -> tuple[str | None, str | None, dict[str, str]]:
        """(branch HEAD is on or None, HEAD's commit, {ref: commit} of refs/heads/ and refs/dsadapt/),
        with one process: `for-each-ref` plus reading .git/HEAD."""
        refs = dict(self.refs("refs/heads/", REFS))
        try:
            text = (self.git_dir() / "HEAD").read_text().strip()
        except OSError:
            text = ""
        if text.startswith("ref: "):
            name = text[5:]
            branch = name.removeprefix("refs/heads/") if name.startswith("refs/heads/") else None
            return branch, refs.get(name), refs
        return None, (text if len(text) == 40 else self.rev("HEAD")), refs

    def scratch_dir(self) -> Path:
        d = CheckoutLayout.of_git_dir(self.git_dir()).scratch
        d.mkdir(parents=True, exist_ok=True)
        return d

    @contextlib.contextmanager
    def temp_index(self, tree: str | None = None) -> Iterator[Git]:
        """This repository with a private index (GIT_INDEX_FILE), optionally loaded with `tree`."""
        idx = self.scratch_dir() / f"index-{os.getpid()}-{time.monotonic_ns()}"
        g = self.with_env(GIT_INDEX_FILE=str(idx))
        try:
            if tree is not None:
                g.run("read-tree", tree)
            yield g
        finally:
            idx.unlink(missing_ok=True)
            Path(f"{idx}.lock").unlink(missing_ok=True)


def init_repo(path: Path, bare: bool = False, identity: bool = True) -> Git:
    """A new repository; identity=False leaves user.name/email to the user's own git config
    (for the user's checkout, where their commits must carry their name). One git process: the
    settings are appended to the new repository's config file (git reads repeated sections)."""
    path.mkdir(parents=True, exist_ok=True)
    g = Git(path)
    g.run("init", "-q", *(["--bare"] if bare else []), "-b", "main")
    text = "[core]\n\tautocrlf = false\n[gc]\n\tauto = 0\n"
    if identity:
        text = f"[user]\n\tname = {DSADAPT_IDENT['name']}\n\temail = {DSADAPT_IDENT['email']}\n" + text
    git_dir = path if bare else path / ".git"
    with open(git_dir / "config", "a", encoding="utf-8") as f:
        f.write(text)
    (git_dir / "info").mkdir(parents=True, exist_ok=True)
    (git_dir / "info" / "attributes").write_text(NEUTRAL_ATTRIBUTES)
    return g


# ---------------------------------------------------------------- the work tree as objects


@dataclass(frozen=True)
class WorkSnapshot:
    """Uncommitted work as trees, the way `git stash -u` sees it (nothing in the checkout changes)."""

    head: str | None
    index: str | None      # the index's tree (None when it has unmerged entries)
    work: str              # tracked files as they are in the work tree
    untracked: str | None  # untracked, not ignored files (None when there are none)


def work_snapshot(g: Git) -> WorkSnapshot:
    head = g.head_commit()
    idx = g.run("write-tree", check=False)
    index_tree = idx.out.strip() if idx.ok else None
    real_index = g.git_dir() / "index"
    with g.temp_index() as t:
        tpath = Path(t.env["GIT_INDEX_FILE"])
        if real_index.exists():
            tpath.write_bytes(real_index.read_bytes())
        elif head:
            t.run("read-tree", head)
        t.run("add", "-u", "--", ".")
        work = t.out("write-tree")
    untracked = [p for p in g.run("ls-files", "-z", "-o", "--exclude-standard").out.split("\0") if p]
    u_tree = None
    if untracked:
        with g.temp_index() as t:
            t.run("update-index", "--add", "-z", "--stdin", input="".join(p + "\0" for p in untracked))
            u_tree = t.out("write-tree")
    return WorkSnapshot(head, index_tree, work, u_tree)


def _commit_object(g: Git, tree: str, parents: tuple[str, ...], message: str) -> str:
    ident = f"{DSADAPT_IDENT['name']} <{DSADAPT_IDENT['email']}> {FIXED_DATE}"
    body = f"tree {tree}\n" + "".join(f"parent {p}\n" for p in parents) + \
        f"author {ident}\ncommitter {ident}\n\n{message}"
    return g.write_object("commit", body.encode("utf-8"))


def keeping_commit(g: Git, commits: list[str], message: str) -> str:
    """A commit (empty tree) whose parents are `commits`: one ref on it keeps them all reachable
    (`git log <ref>^@` lists them). Written without starting git."""
    return _commit_object(g, EMPTY_TREE, tuple(commits), f"{message}\n")


def snapshot_commit(g: Git, snap: WorkSnapshot, message: str) -> str:
    """A stash-shaped commit of the snapshot: `git stash apply --index <it>` brings the work back
    (tracked changes, what was staged, untracked files). Written without starting git."""
    head_tree = g.tree_of(snap.head) if snap.head else EMPTY_TREE
    parents_head = (snap.head,) if snap.head else ()
    i_commit = _commit_object(g, snap.index or head_tree, parents_head, f"index on {message}\n")
    parents = [*parents_head, i_commit]
    if snap.untracked:
        parents.append(_commit_object(g, snap.untracked, (), f"untracked files on {message}\n"))
    return _commit_object(g, snap.work, tuple(parents), f"{message}\n")


def work_fingerprint(g: Git) -> str:
    """A digest of the index and the work tree (tracked changes, untracked files, their bytes) from
    one `git status`: equal digests mean nobody touched either in between."""
    import hashlib

    out = g.run("status", "--porcelain=v2", "-z", "--untracked-files=all").out
    h = hashlib.sha256(out.encode("utf-8", "replace"))
    fields = out.split("\0")
    i = 0
    while i < len(fields):
        rec = fields[i]
        i += 1
        if not rec:
            continue
        kind = rec[0]
        if kind == "2":  # rename/copy: the next field is the source path
            path = rec.split(" ", 9)[-1]
            i += 1
        elif kind == "1":
            path = rec.split(" ", 8)[-1]
        elif kind == "u":
            path = rec.split(" ", 10)[-1]
        elif kind in "?!":
            path = rec[2:]
        else:
            continue
        p = g.path / path
        try:
            h.update(b"\0" + path.encode() + b"\0" + (p.read_bytes() if p.is_file() and not p.is_symlink()
                                                      else os.readlink(p).encode() if p.is_symlink() else b"-"))
        except OSError:
            h.update(b"\0" + path.encode() + b"\0?")
    return h.hexdigest()


# ---------------------------------------------------------------- processes and lock files


def git_processes_in(path: Path) -> list[tuple[int, str]]:
    """Running git processes whose working directory or command line is inside `path`."""
    root = os.path.realpath(path)
    found = []
    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
            if not argv or os.path.basename(argv[0]) not in ("git", "git-am", "git-apply") and \
                    not argv[0].endswith("/git"):
                continue
            cwd = os.path.realpath(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + os.sep) or any(root in a for a in argv[1:]):
            found.append((pid, " ".join(argv)[:120]))
    return found


def lock_files(git_dir: Path) -> list[Path]:
    """git's own lock files in a repository (index.lock, HEAD.lock, refs/**.lock, ...)."""
    out: list[Path] = []
    try:
        out += [p for p in git_dir.glob("*.lock") if p.is_file()]
    except OSError:
        return out
    refs = git_dir / "refs"
    if refs.is_dir():
        for dirpath, _dirs, files in os.walk(refs):
            out += [Path(dirpath) / f for f in files if f.endswith(".lock")]
    return sorted(out)


def clear_stale_locks(repo: Path, git_dir: Path | None = None, busy_check: bool = False) -> list[Path]:
    """Remove git's lock files in a repository once no git process works in it (one that does is
    waited for, DSADAPT_GIT_WAIT seconds, default 10, then named in the error). Returns the files removed."""
    from patcher.base.errors import WorkspaceError
    from patcher.base.fsutil import remove_file

    git_dir = git_dir or repo / ".git"
    locks = lock_files(git_dir)
    if not locks and not busy_check:
        return []
    try:
        wait = float(os.environ.get("DSADAPT_GIT_WAIT", "10"))
    except ValueError:
        wait = 10.0
    deadline = time.monotonic() + wait
    busy = git_processes_in(repo)
    while busy and time.monotonic() < deadline:
        time.sleep(0.1)
        busy = git_processes_in(repo)
    if busy:
        pid, cmd = busy[0]
        raise WorkspaceError(f"git is still running in {repo} (pid {pid}: {cmd})",
                             hint="wait for it to finish (or stop it), then run the command again")
    removed = []
    for lf in lock_files(git_dir):
        remove_file(lf)
        removed.append(lf)
    return removed


def link_objects(src: Path, dst: Path) -> int:
    """Give repository `dst` every object of repository `src` by hard-linking its object files (what
    `git clone --local` does; objects are immutable, so sharing the files is safe), copying where a
    link is impossible, plus src's shallow boundary. Returns the number of files added."""
    import shutil

    so, do = src / "objects", dst / "objects"
    n = 0
    for sub in sorted(so.iterdir()) if so.is_dir() else []:
        if not sub.is_dir() or not (len(sub.name) == 2 or sub.name == "pack"):
            continue
        files = sorted(sub.iterdir(), key=lambda f: (not f.name.endswith(".pack"), f.name))  # a pack before its index
        for f in files:
            if sub.name == "pack" and not f.name.endswith((".pack", ".idx", ".rev")):
                continue
            target = do / sub.name / f.name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"tmp_link_{os.getpid()}_{f.name}")
            try:
                os.link(f, tmp)
            except OSError:
                shutil.copy2(f, tmp)
            os.replace(tmp, target)
            n += 1
    shallow = src / "shallow"
    if shallow.is_file():
        from patcher.base.fsutil import atomic_write_text

        have = (dst / "shallow").read_text().split() if (dst / "shallow").is_file() else []
        add = [c for c in shallow.read_text().split() if c not in have]
        if add:
            atomic_write_text(dst / "shallow", "".join(c + "\n" for c in [*have, *add]))
    return n

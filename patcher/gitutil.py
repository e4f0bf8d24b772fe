"""A thin, explicit layer over git (through GitPython's command runner).

Everything dsadapt does to a repository goes through `Git.run`, so the exact commands are
easy to audit and to log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import git as gitpython

from .errors import DsadaptError

# Fixed identity and dates for the commits dsadapt itself makes (base snapshots, applied
# patches), so the same inputs give the same commit ids on every machine.
FIXED_DATE = "1700000000 +0000"
DSADAPT_IDENT = {"name": "dsadapt", "email": "dsadapt@localhost"}


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
    }
    for i, (key, value) in enumerate(HARDENING_CONFIG):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    env.setdefault("GIT_COMMITTER_NAME", os.environ.get("GIT_COMMITTER_NAME", DSADAPT_IDENT["name"]))
    env.setdefault("GIT_COMMITTER_EMAIL", os.environ.get("GIT_COMMITTER_EMAIL", DSADAPT_IDENT["email"]))
    if fixed_dates:
        env["GIT_AUTHOR_DATE"] = FIXED_DATE
        env["GIT_COMMITTER_DATE"] = FIXED_DATE
    return env


class Git:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._git = gitpython.Git(str(self.path))

    def run(self, *args: str, check: bool = True, input: str | None = None,
            env: dict[str, str] | None = None, fixed_dates: bool = False, timeout: float | None = None) -> GitResult:
        full_env = base_env(fixed_dates)
        if env:
            full_env.update(env)
        istream = None
        if input is not None:
            import tempfile

            istream = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
            istream.write(input.encode("utf-8"))
            istream.seek(0)
        try:
            rc, out, err = self._git.execute(
                ["git", *args], with_extended_output=True, with_exceptions=False, istream=istream,
                env=full_env, strip_newline_in_stdout=False, kill_after_timeout=timeout,
                stdout_as_string=True,
            )
        finally:
            if istream is not None:
                istream.close()
        res = GitResult(rc, out or "", err or "")
        if check and rc != 0:
            msg = (res.err or res.out).strip().splitlines()
            words = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-c")]
            raise GitError(f"git {' '.join(words[:2])} failed in {self.path}: {msg[-1] if msg else rc}",
                           hint="see the git message above; the repository was left as git left it")
        return res

    def out(self, *args: str, **kw) -> str:
        return self.run(*args, **kw).out.strip()

    # ------------------------------------------------------------ queries

    def rev(self, rev: str) -> str | None:
        r = self.run("rev-parse", "--verify", "--quiet", rev + "^{commit}", check=False)
        return r.out.strip() if r.ok else None

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

    def current_branch(self) -> str | None:
        r = self.run("symbolic-ref", "--quiet", "--short", "HEAD", check=False)
        return r.out.strip() if r.ok else None

    def is_dirty(self) -> bool:
        return bool(self.out("status", "--porcelain", "--untracked-files=normal"))

    def dirty_files(self) -> list[str]:
        return [l[3:] for l in self.run("status", "--porcelain", "--untracked-files=normal").out.splitlines() if l]

    def git_dir(self) -> Path:
        return (self.path / self.out("rev-parse", "--git-dir")).resolve()

    def refs(self, prefix: str) -> list[tuple[str, str]]:
        out = self.out("for-each-ref", "--format=%(refname) %(objectname)", prefix)
        return [tuple(l.split(" ", 1)) for l in out.splitlines() if l]  # type: ignore[misc]

    def update_ref(self, ref: str, value: str) -> None:
        self.run("update-ref", ref, value)

    def delete_ref(self, ref: str) -> None:
        self.run("update-ref", "-d", ref, check=False)


def init_repo(path: Path, bare: bool = False, identity: bool = True) -> Git:
    """A new repository; identity=False leaves user.name/email to the user's own git config
    (for the user's checkout, where their commits must carry their name)."""
    path.mkdir(parents=True, exist_ok=True)
    g = Git(path)
    g.run("init", "-q", *(["--bare"] if bare else []), "-b", "main" if not bare else "main")
    if identity:
        g.run("config", "user.name", DSADAPT_IDENT["name"])
        g.run("config", "user.email", DSADAPT_IDENT["email"])
    g.run("config", "core.autocrlf", "false")
    g.run("config", "gc.auto", "0")
    info = g.git_dir() / "info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "attributes").write_text(NEUTRAL_ATTRIBUTES)
    return g

"""What dsadapt keeps inside a checkout's .git, named once: every path and every ref.

A checkout is a normal git repository (`checkouts/ENGINE/TAG/`). dsadapt's own files live in
`.git/dsadapt/` and its refs under `refs/dsadapt/`; git's own `rebase-apply/` is where a `git am`
that dsadapt (or the user) started keeps its state. Everything that reads or writes one of these
(the stack's checkout and transaction, the scratch index of `Git.temp_index`, the leftovers
`dsadapt status` and `dsadapt gc` find) takes the name from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------- refs

REFS = "refs/dsadapt/"
BASE_REF = "refs/dsadapt/base"            # the verified upstream commit (never moves once made)
STACK_REF = "refs/dsadapt/stack"          # the stack files (series + patches) last applied or exported
STATE_REF = "refs/dsadapt/state"          # a copy of the state record (and the op's files) as a commit
BACKUP_PREFIX = "refs/dsadapt/backup/"    # what an op moved away from (work, branch, HEAD, reflog, stack)
OP_PREFIX = "refs/dsadapt/op/"            # (refs of ops recorded by earlier versions; cleaned up)
REBASE_FROM_BASE = "refs/dsadapt/rebase-from/base"   # a rebase's OLD base and OLD stack, for range-diff
REBASE_FROM_HEAD = "refs/dsadapt/rebase-from/head"
BRANCH_PREFIX = "dsadapt/"                # the stack branch: dsadapt/<tag>


def branch_name(tag: str) -> str:
    return f"{BRANCH_PREFIX}{tag}"


# ---------------------------------------------------------------- paths


@dataclass(frozen=True)
class CheckoutLayout:
    """The paths of one checkout (`root` is its work tree; `.git` is a directory in it)."""

    root: Path
    git_dir: Path = field(init=False)       # .git
    own: Path = field(init=False)           # .git/dsadapt/: everything of dsadapt's that is a file
    state: Path = field(init=False)         # the state record (source, pin, what is applied, the op)
    op_dir: Path = field(init=False)        # the files of the op in progress (its patches as mbox files)
    scratch: Path = field(init=False)       # temporary indexes and ref files of running commands (PID-named)
    am_dir: Path = field(init=False)        # git's own: a `git am` in progress
    rebase_merge: Path = field(init=False)  # git's own: a `git rebase` (merge backend) in progress
    worktrees: Path = field(init=False)     # git's own: linked worktrees (`git worktree add`)

    def __post_init__(self) -> None:
        root = Path(self.root)
        git_dir = root / ".git"
        own = git_dir / "dsadapt"
        for name, path in (("root", root), ("git_dir", git_dir), ("own", own), ("state", own / "state.json"),
                           ("op_dir", own / "op"), ("scratch", own / "tmp"), ("am_dir", git_dir / "rebase-apply"),
                           ("rebase_merge", git_dir / "rebase-merge"), ("worktrees", git_dir / "worktrees")):
            object.__setattr__(self, name, path)

    @classmethod
    def of_git_dir(cls, git_dir: Path) -> CheckoutLayout:
        return cls(Path(git_dir).parent)

    def damaged_state(self, stamp: str) -> Path:
        """Where an unreadable state record is kept when it is rebuilt (never removed by dsadapt)."""
        return self.own / f"state.json.damaged-{stamp}"

"""What dsadapt keeps inside a checkout, named once: every path under `.git/` and every ref.

A checkout is a normal git repository (`checkouts/ENGINE/TAG/`). dsadapt's own files live in
`.git/dsadapt/` and its refs under `refs/dsadapt/`; git's own `rebase-apply/` is where a `git am`
that dsadapt (or the user) started keeps its state. Everything that reads or writes one of these
(the stack's checkout and transaction, the scratch index of `Git.temp_index`, the leftovers
`dsadapt status` and `dsadapt gc` find) takes the name from here.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    @classmethod
    def of_git_dir(cls, git_dir: Path) -> CheckoutLayout:
        return cls(Path(git_dir).parent)

    @property
    def git_dir(self) -> Path:
        return self.root / ".git"

    @property
    def own(self) -> Path:
        """`.git/dsadapt/`: everything of dsadapt's that is a file."""
        return self.git_dir / "dsadapt"

    @property
    def state(self) -> Path:
        """The state record (where the tree came from, what is applied, the op in progress)."""
        return self.own / "state.json"

    @property
    def op_dir(self) -> Path:
        """The files of the op in progress (its patches as mbox files)."""
        return self.own / "op"

    @property
    def scratch(self) -> Path:
        """Temporary indexes (`index-PID-…`) of running commands."""
        return self.own / "tmp"

    @property
    def am_dir(self) -> Path:
        """git's own: the state of a `git am` in progress."""
        return self.git_dir / "rebase-apply"

    @property
    def rebase_merge(self) -> Path:
        """git's own: the state of a `git rebase` (merge backend) in progress."""
        return self.git_dir / "rebase-merge"

    @property
    def worktrees(self) -> Path:
        """git's own: the registrations of linked worktrees (`git worktree add`)."""
        return self.git_dir / "worktrees"

    def damaged_state(self, stamp: str) -> Path:
        """Where an unreadable state record is kept when it is rebuilt (never removed by dsadapt)."""
        return self.own / f"state.json.damaged-{stamp}"

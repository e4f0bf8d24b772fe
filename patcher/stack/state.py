"""What a checkout's `.git/dsadapt/state.json` holds: where its tree came from, what is applied,
and the record of the operation in progress (plain data, pure; the transaction writes it).

State files of earlier versions are read and migrated here, once, into the current schema: an op
recorded by schema 1 becomes an op in phase `Phase.LEGACY`, which the transaction can only abort.
A record that does not have the shape of a state (truncated, half written, hand-edited) raises
ValueError; the checkout then rebuilds it from git (stack/record.py).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

SCHEMA = 2


class NewerState(ValueError):
    """The record was written by a newer dsadapt (its schema is above this one's)."""


class Phase(enum.StrEnum):
    """Where an op stands; each phase is recorded before its step runs (transaction.py)."""

    SAVE = "save"          # backups being made; the work tree is untouched
    RESET = "reset"        # the work tree being reset to the base (its work is saved)
    REPLAY = "replay"      # one `git am -3` applying the remaining patches
    STOPPED = "stopped"    # am stopped on a real conflict: the user resolves
    CONTINUE = "continue"  # `git am --continue` committing the user's resolution
    SKIP = "skip"          # `git am --skip` dropping the stopped patch
    FINISH = "finish"      # the kind writes its results (state, patches/, report)
    ABORT = "abort"        # going back to the recorded starting point
    LEGACY = "legacy"      # recorded by schema 1: only `abort` moves it on


#: phases a rerun of the command that died does not finish (the user decides, or abort does)
WAITING = (Phase.STOPPED, Phase.ABORT, Phase.LEGACY)


class Outcome(enum.StrEnum):
    """What happened to one patch of an op (docs/rebase.md has the rebase's meaning of each)."""

    CLEAN = "clean"        # applied with the same hunks
    MERGED = "merged"      # applied through a 3-way merge or at an offset
    CHANGED = "changed"    # stopped on a conflict the user resolved (continue)
    SKIPPED = "skipped"    # dropped: a conflict the user skipped, or nothing left to apply
    UPSTREAM = "upstream"  # rebase: already in the new upstream (dropped from the stack)


#: outcomes whose patch is in the result (the rest are dropped from it)
CARRIED = (Outcome.CLEAN, Outcome.MERGED, Outcome.CHANGED)
#: outcomes that leave the branch different from patches/ until a refresh
EDITED = (Outcome.CHANGED, Outcome.SKIPPED)


@dataclass
class PatchMeta:
    name: str
    subject: str


@dataclass
class PatchOutcome:
    index: int
    name: str
    subject: str
    outcome: Outcome
    commit: str | None = None

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.outcome)


@dataclass
class Orig:
    """Where the checkout was before the op: what `abort` returns to."""

    branch: str | None         # the branch HEAD was on (None: detached)
    head: str | None           # HEAD's commit
    branch_head: str | None    # refs/heads/dsadapt/<tag> (None: the branch did not exist)
    stack_ref: str | None      # refs/dsadapt/stack
    dirty: bool                # uncommitted or untracked work (saved in saves["work"])
    print: str | None = None   # its work_fingerprint: `abort` checks the work is back exactly


@dataclass
class AmRun:
    """One `git am` sequence: the patches it was given, in order, and where it started."""

    start: str                  # HEAD when it started
    indices: list[int]          # 1-based stack positions, in am's order
    mbox: str                   # file in the op dir
    head_at_stop: str | None = None
    stop_print: str | None = None    # work_fingerprint when it stopped: any other state is the user's doing
    resolution: str | None = None    # commit the user made by hand for the stopped patch


@dataclass
class Op:
    kind: str
    ref: str
    stack_hash: str
    patches: list[PatchMeta]
    orig: Orig
    phase: Phase = Phase.SAVE
    saves: dict[str, str] = field(default_factory=dict)   # what -> backup ref (planned names)
    saved: dict[str, str] = field(default_factory=dict)   # backup ref -> commit, once made (a ref deleted
    #                                                        by hand is made again from it)
    outcomes: dict[int, PatchOutcome] = field(default_factory=dict)
    am: AmRun | None = None
    stopped: int | None = None
    abort_from: str | None = None
    abort_saved: bool = False
    restored: bool = False
    snapshot: str | None = None      # commit holding the stack's files as this op read them
    started: float = 0.0
    extra: dict = field(default_factory=dict)   # the kind's own data
    schema: int = SCHEMA             # the schema the op was recorded with (1: migrated, abort only)

    def __post_init__(self) -> None:
        self.phase = Phase(self.phase)

    def to_json(self) -> dict:
        d = asdict(self)
        d["outcomes"] = [asdict(o) for _, o in sorted(self.outcomes.items())]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Op:
        d = dict(d)
        d["patches"] = [PatchMeta(**p) for p in d.get("patches", [])]
        d["orig"] = Orig(**d["orig"])
        d["outcomes"] = {o["index"]: PatchOutcome(**o) for o in d.get("outcomes", [])}
        d["am"] = AmRun(**d["am"]) if d.get("am") else None
        return cls(**d)

    @property
    def total(self) -> int:
        return len(self.patches)

    def meta(self, index: int) -> PatchMeta:
        return self.patches[index - 1]

    def done_count(self) -> int:
        return len(self.outcomes)


@dataclass
class Applied:
    stack_hash: str
    head: str | None
    needs_refresh: list[str] = field(default_factory=list)
    snapshot: str | None = None      # commit of the stack files this head corresponds to
    snapshot_tree: str | None = None


@dataclass
class State:
    ref: str
    source: dict | None
    base: str | None
    applied: Applied | None = None
    op: Op | None = None
    schema: int = SCHEMA
    lock: dict | None = None   # the pin as the checkout was verified against it (lock_identity), and its digest

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "ref": self.ref, "source": self.source, "base": self.base,
                "applied": asdict(self.applied) if self.applied else None,
                "op": self.op.to_json() if self.op else None, "lock": self.lock}

    @classmethod
    def from_json(cls, d: dict) -> State:
        schema = d.get("schema", 1)
        if not isinstance(schema, int) or isinstance(schema, bool):
            raise ValueError(f"schema {schema!r} is not a number")
        if schema > SCHEMA:
            raise NewerState(f"state schema {schema} is newer than this dsadapt ({SCHEMA})")
        applied = d.get("applied")
        if schema < 2:
            ap = Applied(applied["stack_hash"], applied.get("head"), list(applied.get("needs_refresh") or [])) \
                if applied else None
            return cls(d["ref"], d.get("source"), d.get("base"), ap, migrate_op_v1(d["ref"], d.get("op")))
        op = d.get("op")
        if op is None and d.get("legacy_op"):  # written by a version that kept schema-1 ops as they were
            op = migrate_op_v1(d["ref"], d["legacy_op"])
        elif op is not None:
            op = Op.from_json(op)
        lock = d.get("lock")
        st = cls(d["ref"], d.get("source"), d.get("base"), Applied(**applied) if applied else None, op,
                 lock=lock if isinstance(lock, dict) else None)
        _check_shape(st)
        return st


def _check_shape(st: State) -> None:
    """ValueError unless the record has the types the code reads (a hand-edited or damaged file
    that still parses as JSON)."""
    ok = isinstance(st.ref, str) and (st.base is None or isinstance(st.base, str)) \
        and (st.source is None or isinstance(st.source, dict))
    if st.applied is not None:
        a = st.applied
        ok = ok and isinstance(a.stack_hash, str) and (a.head is None or isinstance(a.head, str)) \
            and isinstance(a.needs_refresh, list)
    if st.op is not None:
        o = st.op
        ok = ok and isinstance(o.kind, str) and isinstance(o.patches, list) and isinstance(o.saves, dict) \
            and isinstance(o.extra, dict) and isinstance(o.saved, dict)
    if not ok:
        raise ValueError("a field has the wrong type")


def migrate_op_v1(ref: str, op: dict | None) -> Op | None:
    """A schema-1 op (one `git am` per patch, a stash for the work) as the current record: phase
    `Phase.LEGACY`, which only `abort` moves on (its patches cannot be replayed by this version)."""
    if not op:
        return None
    saves = {k: v for k, v in (("work", op.get("dirty_backup")), ("branch", op.get("backup_ref"))) if v}
    patches = [PatchMeta(str(p.get("name", "")), str(p.get("subject", ""))) for p in op.get("patches") or []]
    outcomes = {}
    for i, o in enumerate(op.get("outcomes") or [], 1):
        m = patches[i - 1] if i <= len(patches) else PatchMeta("", "")
        outcomes[i] = PatchOutcome(int(o.get("index", i)), str(o.get("name", m.name)), str(o.get("subject", m.subject)),
                                   Outcome(str(o.get("outcome", Outcome.CLEAN))), o.get("commit"))
    return Op(kind="apply", ref=ref, stack_hash=str(op.get("stack_hash", "")), patches=patches,
              orig=Orig(op.get("orig_branch"), op.get("orig_head"), op.get("branch_head_before"), None,
                        bool(op.get("dirty_backup"))),
              phase=Phase.LEGACY, saves=saves, outcomes=outcomes, schema=1)

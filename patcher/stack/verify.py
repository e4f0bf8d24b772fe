"""verify: lint a stack and prove it applies cleanly onto the pinned tree, without touching
the user's checkout (the work happens in a temporary index: `read-tree` of the base, `git apply
--cached` of the stack, `write-tree`, and `cat-file --batch` for the files that must compile)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from patcher.base.config import Config
from patcher.base.errors import DsadaptError, SourceError
from patcher.formats.lock import Lock
from patcher.formats.patchfile import ZERO_ID
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import expected_preimages, lint_stack, load_stack, preimage_mismatches
from patcher.stack.materialize import ensure_checkout


@dataclass
class VerifyResult:
    ref: str
    patches: int
    problems: list[str] = field(default_factory=list)
    applied: bool = False
    compiled: int = 0
    source: str | None = None
    unverifiable: str | None = None  # no source could provide the pinned tree here

    @property
    def ok(self) -> bool:
        return not self.problems and self.applied

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def verify_stack(cfg: Config, lock: Lock, ref: PinRef, progress=None) -> VerifyResult:
    entry = lock.pin(ref)
    try:
        stack = load_stack(cfg.patches_root, ref)
    except DsadaptError as broken:
        return VerifyResult(str(ref), 0, [broken.message])
    res = VerifyResult(str(ref), len(stack))
    res.problems += lint_stack(stack)
    from patcher.engines import adapter

    ad = adapter(ref.engine)
    allowed = {ad.name, *ad.pypi}
    for e in stack.entries:
        for spec in e.patch.trailer_values("Drop-When"):
            name = spec.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip()
            if name and name not in allowed:
                res.problems.append(f"{stack.dir / e.name}: Drop-When names {name!r}, not one of {sorted(allowed)}")
    try:
        co, _ = ensure_checkout(cfg, lock, entry, progress)
    except SourceError as unreachable:  # lint results stand; applying needs the tree
        res.unverifiable = unreachable.message
        return res
    state = co.load_state()
    res.source = f"{state['source']['kind']} {state['source']['origin']}"
    base = co.base()
    expected, _post, chain = expected_preimages(stack.patches)
    res.problems += chain
    if state["source"]["kind"] == "pypi":
        res.problems += [f"pre-image: {m}" for m in
                         preimage_mismatches(expected, co.git.blobs_at(base, sorted(expected)), stack)]
    res.applied, tree = _apply_in_temp_index(co, stack, base, res.problems)
    if res.applied and tree:
        paths = sorted({f.new_path for e in stack.entries for f in e.patch.files
                        if f.new_path and f.new_path.endswith(".py") and f.new_blob != ZERO_ID})
        blobs = co.git.cat_blobs([f"{tree}:{p}" for p in paths])
        owner = {f.new_path: e.name for e in stack.entries for f in e.patch.files if f.new_path}
        for p in paths:
            src = blobs.get(f"{tree}:{p}")
            if src is None:
                continue
            try:
                compile(src, p, "exec", dont_inherit=True)
                res.compiled += 1
            except SyntaxError as err:
                res.problems.append(f"{owner.get(p, '?')}: {p}:{err.lineno}: does not compile: {err.msg}")
    return res


def _apply_in_temp_index(co, stack, base: str, problems: list[str]) -> tuple[bool, str | None]:
    """Apply the whole stack onto the base in a temporary index (no work tree, no worktree): one
    `git apply --cached` of all patches; on failure, one patch at a time to name the first that fails."""
    if not stack.entries:
        return True, co.git.tree_of(base)
    with co.git.temp_index(base) as t:
        whole = "".join(e.text if e.text.endswith("\n") else e.text + "\n" for e in stack.entries)
        if t.run("apply", "--cached", input=whole, check=False).ok:
            return True, t.out("write-tree")
    with co.git.temp_index(base) as t:
        for e in stack.entries:
            r = t.run("apply", "--cached", input=e.text, check=False)
            if not r.ok:
                msg = [l for l in (r.out + r.err).splitlines() if l.startswith(("error:", "Patch failed"))]
                problems.append(f"{e.name}: does not apply cleanly onto {base[:12]}" + (f" ({msg[0]})" if msg else ""))
                return False, None
    problems.append(f"the stack does not apply as a whole onto {base[:12]} (each patch does, in order)")
    return False, None

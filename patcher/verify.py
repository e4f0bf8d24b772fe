"""verify: lint a stack and prove it applies cleanly onto the pinned tree, without touching
the user's checkout (the work happens in a temporary git worktree)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import Config
from .errors import DsadaptError, SourceError
from .lock import Lock
from .patchfile import ZERO_ID
from .pinref import PinRef
from .stack import expected_preimages, lint_stack, load_stack, preimage_mismatches
from .workspace import ensure_checkout


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
    from .engines import adapter

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
    expected, chain = expected_preimages(stack.patches)
    res.problems += chain
    if state["source"]["kind"] == "pypi":
        res.problems += [f"pre-image: {m}" for m in
                         preimage_mismatches(expected, co.git.blobs_at(base, sorted(expected)), stack)]
    tmp = Path(tempfile.mkdtemp(prefix="dsadapt-verify-"))
    wt = tmp / "tree"
    try:
        co.git.run("worktree", "add", "-q", "--detach", str(wt), base)
        from .gitutil import Git

        g = Git(wt)
        ok = True
        for e in stack.entries:
            pf = tmp / e.name
            pf.write_text(e.text, encoding="utf-8")
            r = g.run("am", "--no-signoff", str(pf), check=False, fixed_dates=True)
            if not r.ok:
                msg = [l for l in (r.out + r.err).splitlines() if l.startswith(("error:", "Patch failed"))]
                res.problems.append(f"{e.name}: does not apply cleanly onto {base[:12]}" +
                                    (f" ({msg[0]})" if msg else ""))
                g.run("am", "--abort", check=False)
                ok = False
                break
        res.applied = ok
        if ok:
            for e in stack.entries:
                for f in e.patch.files:
                    if f.new_path and f.new_path.endswith(".py") and f.new_blob != ZERO_ID:
                        src = (wt / f.new_path).read_bytes()
                        try:
                            compile(src, f.new_path, "exec", dont_inherit=True)
                            res.compiled += 1
                        except SyntaxError as err:
                            res.problems.append(f"{e.name}: {f.new_path}:{err.lineno}: does not compile: {err.msg}")
    finally:
        co.git.run("worktree", "remove", "--force", str(wt), check=False)
        co.git.run("worktree", "prune", check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    return res

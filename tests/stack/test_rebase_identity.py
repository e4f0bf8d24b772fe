"""Property: rebasing a stack onto its own tag is the identity (zero byte change in patches/)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import rebase_fixture as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patcher.base.gitutil import Git
from patcher.formats.lock import load_lock
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import write_stack
from patcher.stack.rebase.carry import rebase_stack
from patcher.stack.refresh import export_commits

FILES = sorted(fx.BASE_FILES)
edit = st.tuples(st.sampled_from(FILES), st.integers(0, 20),
                 st.text(alphabet="abcxyz_=+ ", min_size=1, max_size=10).map(lambda s: s.strip() or "x"),
                 st.booleans())


def _make_stack(up: Path, proj: Path, edits) -> None:
    """One commit per edit on top of v1.0.0, exported as vllm@v1.0.0's stack."""
    fx.git(up, "checkout", "-q", "-B", "gen", "v1.0.0")
    for n, (path, line_no, text, insert) in enumerate(edits, 1):
        p = up / path
        lines = p.read_text().split("\n")[:-1]
        i = line_no % len(lines)
        new = f"    # {text} ({n})"
        if insert:
            lines.insert(i, new)
        else:
            lines[i] = new
        p.write_text("\n".join(lines) + "\n")
        msg = f"edit {n} of {path}\n\nWhy: generated.\n\nUpstream-Status: Pending\nCovered-By: tests/x.py::t"
        fx.git(up, "commit", "-qam", msg)
    d = proj / "patches" / fx.ENGINE / "v1.0.0"
    write_stack(d, export_commits(Git(up), fx.git(up, "rev-parse", "v1.0.0"), fx.git(up, "rev-parse", "gen")))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(edit, min_size=1, max_size=4))
def test_rebase_onto_the_same_tag_changes_no_byte(edits):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        up = fx.make_upstream(root)
        proj = fx.make_project(root, up, stack=False)
        _make_stack(up, proj, edits)
        cfg = fx.config(proj, root)
        before = fx.snapshot(proj / "patches")
        lock_before = cfg.lock_path.read_bytes()
        res, notes = rebase_stack(cfg, load_lock(cfg.lock_path), PinRef(fx.ENGINE, "v1.0.0"), "v1.0.0")
        assert notes == []
        assert [o.outcome for o in res.outcomes] == ["clean"] * len(edits)
        assert fx.snapshot(proj / "patches") == before
        assert cfg.lock_path.read_bytes() == lock_before

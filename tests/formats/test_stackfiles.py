"""Stacks: series handling, loading, linting, writing, expected pre-image chains, stack hash."""

from __future__ import annotations

import hashlib

import pytest

from patcher.base.errors import PatchFormatError, StackError
from patcher.formats.patchfile import ZERO_ID, FileChange, Patch, format_patch
from patcher.formats.pinref import PinRef
from patcher.formats.stackfiles import (
    StackEntry,
    expected_preimages,
    format_series,
    lint_stack,
    load_stack,
    parse_series,
    preimage_mismatches,
    stack_hash,
    write_stack,
)

REF = PinRef("vllm", "v1.0.0")
A, B, C, D = ("a" * 40, "b" * 40, "c" * 40, "d" * 40)
DIFF = ("diff --git a/m.py b/m.py\nindex " + A + ".." + B + " 100644\n--- a/m.py\n+++ b/m.py\n"
        "@@ -1 +1 @@\n-x = 1\n+x = 2\n")


def _patch(subject: str, *files: FileChange, diff: str = DIFF) -> Patch:
    return Patch(subject, "why", (("Upstream-Status", "Pending"), ("Covered-By", "t::t")), diff, files=files)


def _write(root, names_texts: dict[str, str], series: str):
    d = root / "vllm" / "v1.0.0"
    d.mkdir(parents=True)
    for n, t in names_texts.items():
        (d / n).write_text(t)
    (d / "series").write_text(series)
    return d


# ---------------------------------------------------------------- series


def test_series_comments_blank_lines_and_order():
    text = "# header\n\n0002-b.patch  # trailing comment\n   \n0001-a.patch\n# 0003-c.patch\n"
    assert parse_series(text) == ["0002-b.patch", "0001-a.patch"]


@pytest.mark.parametrize("line,match", [("0001-a.patch\n0001-a.patch", "listed twice"),
                                        ("../x.patch", "not a plain patch file name"),
                                        ("sub/x.patch", "not a plain patch file name"),
                                        ("a b.patch", "not a plain patch file name"),
                                        ("..", "not a plain patch file name")])
def test_series_bad_lines_name_the_line(line, match):
    with pytest.raises(StackError, match=match) as ei:
        parse_series("# c\n" + line + "\n", where="patches/vllm/v1/series")
    assert f"series:{line.count(chr(10)) + 2}:" in ei.value.message


def test_load_stack_missing_file_and_missing_series(tmp_path):
    text = format_patch(_patch("one"))
    _write(tmp_path, {"0001-one.patch": text}, "0001-one.patch\n0002-gone.patch\n")
    with pytest.raises(StackError, match="0002-gone.patch, which does not exist"):
        load_stack(tmp_path, REF)
    with pytest.raises(StackError, match="does not exist"):
        load_stack(tmp_path, PinRef("vllm", "v9"))
    empty = load_stack(tmp_path, PinRef("vllm", "v9"), must_exist=False)
    assert not empty.exists and len(empty) == 0


def test_load_stack_refuses_escaping_patch(tmp_path):
    text = format_patch(_patch("evil", diff=DIFF.replace("m.py", "../outside.py")))
    _write(tmp_path, {"0001-evil.patch": text}, "0001-evil.patch\n")
    with pytest.raises(PatchFormatError, match="escapes the source tree"):
        load_stack(tmp_path, REF)


def test_empty_series_is_a_valid_stack(tmp_path):
    _write(tmp_path, {}, "# nothing yet\n")
    st = load_stack(tmp_path, REF)
    assert st.exists and len(st) == 0 and lint_stack(st) == []


def test_lint_stack_unlisted_file_and_wrong_name(tmp_path):
    text = format_patch(_patch("one"))
    d = _write(tmp_path, {"0001-wrong-name.patch": text, "0009-stray.patch": text}, "0001-wrong-name.patch\n")
    problems = lint_stack(load_stack(tmp_path, REF))
    assert any("0009-stray.patch: not listed in series" in p for p in problems)
    assert any("file name should be 0001-one.patch" in p for p in problems)
    assert str(d) in problems[0]


def test_write_stack_names_keeps_series_comments_removes_dropped_and_skips_unchanged(tmp_path):
    d = tmp_path / "s"
    names = write_stack(d, [_patch("one"), _patch("two")])
    assert names == ["0001-one.patch", "0002-two.patch"]
    (d / "series").write_text("# my notes about this stack\n# second line\n" + "".join(n + "\n" for n in names))
    mtimes = {f.name: f.stat().st_mtime_ns for f in d.iterdir()}
    assert write_stack(d, [_patch("one"), _patch("two")]) == names
    assert {f.name: f.stat().st_mtime_ns for f in d.iterdir()} == mtimes  # nothing rewritten
    write_stack(d, [_patch("one")])
    assert sorted(f.name for f in d.iterdir()) == ["0001-one.patch", "series"]
    assert (d / "series").read_text() == "# my notes about this stack\n# second line\n0001-one.patch\n"
    assert format_series(["x.patch"]).endswith("\nx.patch\n")


# ---------------------------------------------------------------- pre-images


def test_expected_preimages_chain_and_new_files():
    p1 = _patch("p1", FileChange("m.py", "m.py", A, B), FileChange(None, "new.py", ZERO_ID, C))
    p2 = _patch("p2", FileChange("m.py", "m.py", B, D), FileChange("u.py", "u.py", C, A))
    p3 = _patch("p3", FileChange("new.py", "new.py", C, A))
    base, post, problems = expected_preimages([p1, p2, p3])
    assert problems == []
    # the base tree must hold m.py at A (patch 1) and u.py at C (patch 2); new.py must be absent
    assert base == {"m.py": (A, 1), "new.py": (None, 1), "u.py": (C, 2)}
    # and what the last patch touching each path leaves there
    assert post == {"m.py": D, "new.py": A, "u.py": A}


def test_expected_preimages_broken_chain_is_a_problem():
    p1 = _patch("p1", FileChange("m.py", "m.py", A, B))
    p2 = _patch("p2", FileChange("m.py", "m.py", C, D))
    base, _post, problems = expected_preimages([p1, p2])
    assert base == {"m.py": (A, 1)}
    assert len(problems) == 1 and "patch 2 (p2): m.py pre-image cccccccccccc" in problems[0]
    assert "bbbbbbbbbbbb" in problems[0]


def test_expected_preimages_delete_rename_and_recreate():
    p1 = _patch("p1", FileChange("old.py", None, A, ZERO_ID))
    p2 = _patch("p2", FileChange(None, "old.py", ZERO_ID, B))  # re-created: absent in between, fine
    p3 = _patch("p3", FileChange("r.py", "s.py", C, D))
    p4 = _patch("p4", FileChange("s.py", "s.py", D, A))
    base, post, problems = expected_preimages([p1, p2, p3, p4])
    assert problems == []
    assert base == {"old.py": (A, 1), "r.py": (C, 3)}
    assert post == {"old.py": B, "r.py": None, "s.py": A}  # renamed away: absent


def test_preimage_mismatches_names_patch_file_and_ids(tmp_path):
    text = format_patch(_patch("one"))
    _write(tmp_path, {"0001-one.patch": text}, "0001-one.patch\n")
    st = load_stack(tmp_path, REF)
    expected, _post, _problems = expected_preimages(st.patches)
    assert expected == {"m.py": (A, 1)}
    assert preimage_mismatches(expected, {"m.py": A}, st) == []
    (msg,) = preimage_mismatches(expected, {"m.py": C}, st)
    assert msg == "0001-one.patch: m.py is cccccccccccc in the tree, the patch expects aaaaaaaaaaaa"
    (msg,) = preimage_mismatches(expected, {"m.py": None}, st)
    assert "m.py is absent in the tree" in msg


# ---------------------------------------------------------------- stack hash


def test_stack_hash_is_stable_and_sensitive():
    e1, e2 = StackEntry("0001-a.patch", _patch("a"), "text a\n"), StackEntry("0002-b.patch", _patch("b"), "tëxt b\n")
    h = stack_hash([e1, e2])
    # the definition, spelled out: changing it would orphan every recorded applied hash
    ref = hashlib.sha256(b"dsadapt-stack-v1\0" + b"0001-a.patch\0text a\n\0" + "0002-b.patch\0tëxt b\n\0".encode())
    assert h == ref.hexdigest()
    assert stack_hash([e1, e2]) == h
    assert stack_hash([e2, e1]) != h
    assert stack_hash([e1]) != h
    assert stack_hash([e1, StackEntry("0002-c.patch", e2.patch, e2.text)]) != h
    assert stack_hash([e1, StackEntry(e2.name, e2.patch, e2.text + " ")]) != h
    assert stack_hash([]) == hashlib.sha256(b"dsadapt-stack-v1\0").hexdigest()


def test_stack_hash_of_loaded_stack_ignores_series_comments(tmp_path):
    text = format_patch(_patch("one"))
    _write(tmp_path, {"0001-one.patch": text}, "0001-one.patch\n")
    h1 = load_stack(tmp_path, REF).hash
    (tmp_path / "vllm" / "v1.0.0" / "series").write_text("# a comment\n\n0001-one.patch  # why\n")
    assert load_stack(tmp_path, REF).hash == h1

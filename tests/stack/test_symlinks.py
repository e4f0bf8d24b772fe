"""No patch or stack may make a symbolic link lead outside the tree, by any path: a link of the
tree renamed or copied to where its target escapes, a chain of links that each look harmless, a
link retargeted by a change without a mode, a link made by one patch and moved by another. Each
is refused with one line, a hint and exit 2 before anything is written; links that stay inside
still apply; `verify` names them; the build never ships a link's text as a file."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REF1, TAG1, TAG2, Upstream, commit_msg, files_snapshot, git, lock_text, make_upstream

from patcher.formats.patchfile import format_patch, parse_patch


@pytest.fixture
def linked(tmp_path, project):
    """The fixture upstream plus, in both tags, an in-tree link vllm/docs/readme -> ../../README.md."""
    up = project.upstream
    git(up.path, "checkout", "-q", "main")
    for tag in (TAG1, TAG2):
        git(up.path, "checkout", "-q", "--detach", tag)
        (up.path / "vllm" / "docs").mkdir(exist_ok=True)
        os.symlink("../../README.md", up.path / "vllm" / "docs" / "readme")
        git(up.path, "add", "-A")
        git(up.path, "commit", "-qm", f"docs link ({tag})")
        git(up.path, "tag", "-f", tag)
        up.commits[tag] = git(up.path, "rev-parse", f"{tag}^{{commit}}")
        up.trees[tag] = git(up.path, "rev-parse", f"{tag}^{{tree}}")
    project.write_lock(lock_text(up))
    return project


def _patches(project, steps, *, fmt=("-M", "-C", "--find-copies-harder"), edit=None) -> list[str]:
    """Patches made with git in a clone at v1.0.0: each step is (subject, shell commands run there)."""
    clone = project.tmp / f"mk-links-{len(list(project.tmp.glob('mk-links-*')))}"
    git(project.tmp, "clone", "-q", project.upstream.url, str(clone))
    git(clone, "checkout", "-q", "--detach", TAG1)
    texts = []
    for subject, script in steps:
        subprocess.run(["sh", "-ec", script], cwd=clone, check=True)
        git(clone, "add", "-A")
        git(clone, "commit", "-q", "-m", commit_msg(subject))
        raw = git(clone, "format-patch", "-1", "--stdout", "--full-index", "--no-signature", "--no-stat",
                  "--zero-commit", *fmt, "HEAD", strip=False)
        texts.append(edit(raw) if edit else raw)
    return texts


def _write(project, texts):
    """The stack files as git wrote them (renames and copies stay: dsadapt's own export never makes them)."""
    d = project.stack_dir()
    d.mkdir(parents=True, exist_ok=True)
    names = []
    for i, t in enumerate(texts, 1):
        name = f"{i:04d}-p.patch"
        (d / name).write_text(t)
        names.append(name)
    (d / "series").write_text("".join(n + "\n" for n in names))


def _refused(project, *args, before=None):
    snap = before if before is not None else files_snapshot(project.workdir, project.root)
    r = project.run(*args)
    assert r.rc == 2, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and "symbolic link" in lines[0], r.err
    assert lines[1].startswith("hint: ") and "inside the tree" in lines[1], r.err
    assert files_snapshot(project.workdir, project.root) == snap, "nothing may be written"
    return r


def _applied_first(project):
    """A checkout holding a clean one-patch stack: the refusals below must leave it exactly so."""
    _write(project, _patches(project, [("a harmless change", "echo '# x' >> vllm/util.py")]))
    r = project.run("apply", REF1)
    assert r.rc == 0, r


def test_a_link_of_the_tree_renamed_to_the_top_is_refused(linked):
    _applied_first(linked)
    _write(linked, _patches(linked, [("move the docs link up", "git mv vllm/docs/readme readme")]))
    assert "rename from vllm/docs/readme" in (linked.stack_dir() / "0001-p.patch").read_text()
    r = _refused(linked, "apply", REF1)
    assert "readme -> ../../README.md points outside the tree" in r.err


def test_a_link_of_the_tree_copied_to_the_top_is_refused(linked):
    _applied_first(linked)
    _write(linked, _patches(linked, [("copy the docs link up", "cp -P vllm/docs/readme readme")]))
    assert "copy from vllm/docs/readme" in (linked.stack_dir() / "0001-p.patch").read_text()
    _refused(linked, "apply", REF1)


def test_a_chain_of_links_each_harmless_alone_is_refused_before_anything(project):
    texts = _patches(project, [
        ("a link up three levels", "mkdir -p d/e/f && ln -s ../../.. d/e/f/up"),
        ("a link through it", "ln -s d/e/f/up/../../../../upstream.lock esc"),
    ])
    _write(project, texts)
    r = _refused(project, "apply", REF1)
    assert "esc -> d/e/f/up/../../../../upstream.lock points outside the tree" in r.err
    assert not project.checkout().exists()  # refused while reading the stack: no checkout made
    r = project.run("verify", REF1)  # a verdict: the stack has a problem (exit 1), named
    assert r.rc == 1 and "esc -> d/e/f/up/../../../../upstream.lock points outside the tree" in r.out, r


def test_a_link_retargeted_by_a_change_without_a_mode_is_refused(linked):
    _applied_first(linked)

    def drop_mode(raw: str) -> str:
        return "\n".join(l.rsplit(" ", 1)[0] if l.startswith("index ") and l.endswith(" 120000") else l
                         for l in raw.split("\n"))

    texts = _patches(linked, [("point the docs link elsewhere",
                               "rm vllm/docs/readme && ln -s /etc/hostname vllm/docs/readme")], edit=drop_mode)
    assert "120000" not in texts[0]
    _write(linked, texts)
    r = _refused(linked, "apply", REF1)
    assert "/etc/hostname" in r.err


def test_a_link_made_by_one_patch_and_moved_by_another_is_refused(project):
    texts = _patches(project, [
        ("a link to a sibling", "ln -s ../README.md vllm/readme"),
        ("move it to the top", "git mv vllm/readme readme"),
    ])
    _write(project, texts)
    r = _refused(project, "apply", REF1)
    assert "patch 2" in r.err and "readme -> ../README.md" in r.err


def test_links_that_stay_inside_apply_and_build_nothing_out_of_them(linked):
    texts = _patches(linked, [
        ("a link to the module", "ln -s mod.py vllm/alias.py"),
        ("move the docs link next to its target", "git mv vllm/docs/readme vllm/readme && "
                                                  "rm vllm/readme && ln -s ../README.md vllm/readme"),
    ])
    _write(linked, texts)
    r = linked.run("apply", REF1)
    assert r.rc == 0, r
    co = linked.checkout()
    assert os.readlink(co / "vllm" / "alias.py") == "mod.py" and os.readlink(co / "vllm" / "readme") == "../README.md"


def test_verify_names_a_link_that_leads_out_and_leaves_the_checkout_as_it_is(linked):
    _applied_first(linked)
    _write(linked, _patches(linked, [("move the docs link up", "git mv vllm/docs/readme readme")]))
    before = files_snapshot(linked.checkout() / ".git")
    r = linked.run("verify", REF1, "--json")
    assert r.rc == 1, r
    problems = r.json()["stacks"][0]["problems"]
    assert any("readme -> ../../README.md points outside the tree" in p for p in problems), problems
    assert files_snapshot(linked.checkout() / ".git") == before


def test_the_parser_gives_a_links_target_only_when_the_diff_holds_it_whole():
    raw = _link_patch("sub/ln", "../x", new=True)
    (f,) = parse_patch(raw).files
    assert f.mode == "120000" and f.link_target == "../x" and f.content
    assert format_patch(parse_patch(raw))  # still a patch dsadapt can write back


def _link_patch(name: str, target: str, new: bool) -> str:
    from patcher.base.fsutil import git_blob_id

    blob = git_blob_id(target.encode())
    return (f"From: A <a@b>\nSubject: [PATCH] link\n\nWhy.\n\nUpstream-Status: Pending\nCovered-By: t\n---\n"
            f"diff --git a/{name} b/{name}\nnew file mode 120000\nindex {'0' * 40}..{blob}\n--- /dev/null\n"
            f"+++ b/{name}\n@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n")


_ = Upstream, make_upstream  # (fixtures these tests build on)

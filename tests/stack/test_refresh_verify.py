"""refresh (export the checkout branch back to patches/) and verify (lint + apply in a temp worktree)."""

from __future__ import annotations

from conftest import (
    MOD_V1,
    REF1,
    TAG1,
    clean_stack_edits,
    commit_msg,
    edit,
    files_snapshot,
    git,
    make_patches,
    refs_snapshot,
)

from patcher.formats.patchfile import format_patch, parse_patch


def _applied(project):
    r = project.run("apply", REF1)
    assert r.rc == 0, r
    return project.checkout()


# ---------------------------------------------------------------- refresh


def test_refresh_of_unchanged_stack_changes_zero_bytes(project, clean_stack):
    _applied(project)
    d = project.stack_dir()
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in d.iterdir()}
    r = project.run("refresh", REF1)
    assert r.rc == 0 and "stack unchanged" in r.out, r
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in d.iterdir()} == before
    rj = project.run("refresh", REF1, "--json")
    assert rj.json() == {"schema": "dsadapt.refresh/1", "ref": REF1, "changed": [], "removed": [], "backup": None,
                         "notes": [], "warnings": []}


def test_refresh_writes_normalized_patches_for_new_and_amended_commits(project, clean_stack):
    co = _applied(project)
    (co / "vllm" / "mod.py").write_text((co / "vllm" / "mod.py").read_text().replace('"upstream"', '"patched"'))
    git(co, "commit", "-q", "-am", commit_msg("mod: untouched says patched"))
    r = project.run("refresh", REF1, "--json")
    assert r.rc == 0, r
    assert r.json()["changed"] == ["0004-mod-untouched-says-patched.patch", "series"]
    new = project.stack_dir() / "0004-mod-untouched-says-patched.patch"
    text = new.read_text()
    assert format_patch(parse_patch(text)) == text
    # the user's own identity (their git config), not dsadapt's
    assert text.startswith("From: Fixture <fixture@example.org>\nSubject: [PATCH] mod: untouched says patched\n")
    assert "-    return \"upstream\"\n+    return \"patched\"\n" in text
    assert "Date:" not in text and "index " in text
    assert project.stack_dir().joinpath("series").read_text().splitlines()[-1] == new.name
    assert project.stack_dir().joinpath("series").read_text().startswith("# fixture stack\n")
    # the refreshed stack is what the checkout holds: apply is now a no-op, verify is clean
    again = project.run("apply", REF1)
    assert again.rc == 0 and "already applied" in again.out, again
    v = project.run("verify", REF1, "--json")
    assert v.rc == 0 and v.json()["ok"], v


def test_refresh_keeps_hand_written_trailers(project):
    trailers = ("Upstream-Status: Backport vllm-project/vllm#4650\nDrop-When: vllm>=2.0\n"
                "Covered-By: tests/stack/test_refresh_verify.py::test_refresh_keeps_hand_written_trailers\n"
                "Reported-by: Zoë Tester <zoe@example.org>")
    body = "Zoë found this.\n\nSecond paragraph, with détails."
    texts = make_patches(project.upstream, project.tmp / "mk", TAG1, [
        ("mod: widen the default\n\n" + body + "\n\n" + trailers + "\n",
         {"vllm/mod.py": edit(MOD_V1, '"hidden_size", 16', '"hidden_size", 32')})])
    project.write_stack(texts)
    co = _applied(project)
    # reword the commit (a real edit) so refresh has to re-export it
    msg = git(co, "log", "-1", "--format=%B")
    git(co, "commit", "-q", "--amend", "-m", msg.replace("mod: widen the default", "mod: widen the default width"))
    r = project.run("refresh", REF1, "--json")
    assert r.rc == 0, r
    assert r.json()["removed"] == ["0001-mod-widen-the-default.patch"]
    p = parse_patch((project.stack_dir() / "0001-mod-widen-the-default-width.patch").read_text())
    assert p.subject == "mod: widen the default width"
    assert p.body == body
    assert [f"{k}: {v}" for k, v in p.trailers] == trailers.split("\n")


def test_refresh_exports_a_patch_ending_in_blank_context_lines_intact(project, clean_stack):
    """format-patch output ending in blank context lines must not be stripped (it would corrupt the hunk)."""
    _applied(project)
    d = project.stack_dir()
    for f in d.glob("*.patch"):
        f.unlink()
    (d / "series").write_text("")
    r = project.run("refresh", REF1)
    assert r.rc == 4 and f"refresh {REF1} --force" in r.err, r  # patches/ changed since apply: refused
    assert (d / "series").read_text() == ""
    r = project.run("refresh", REF1, "--force")
    assert r.rc == 0, r
    for f in sorted(d.glob("*.patch")):
        assert f.read_text() in clean_stack, f.name
    assert project.run("verify", REF1).rc == 0


def test_refresh_refuses_uncommitted_changes(project, clean_stack):
    co = _applied(project)
    (co / "vllm" / "util.py").write_text("# wip\n")
    before = files_snapshot(project.root)
    r = project.run("refresh", REF1)
    assert r.rc == 4 and "uncommitted changes" in r.err, r
    assert files_snapshot(project.root) == before


# ---------------------------------------------------------------- verify


def test_verify_clean_stack_ok_and_leaves_checkout_alone(project, clean_stack):
    co = _applied(project)
    (co / "scratch.txt").write_text("my notes\n")
    before = refs_snapshot(co)
    r = project.run("verify", REF1, "--json")
    assert r.rc == 0, r
    (res,) = r.json()["stacks"]
    assert res["ok"] and res["applied"] and res["patches"] == 3 and res["compiled"] == 3 and res["problems"] == []
    assert refs_snapshot(co) == before
    assert git(co, "worktree", "list").count("\n") == 0  # no worktree is made
    assert not list((co / ".git" / "dsadapt" / "tmp").glob("index-*"))  # the temporary index is gone


def _verify_problems(project, texts, names=None) -> list[str]:
    project.write_stack(texts, names=names)
    r = project.run("verify", REF1, "--json")
    assert r.rc == 1, r
    data = r.json()
    assert data["ok"] is False
    return data["stacks"][0]["problems"]


def _one(project, msg: str, files: dict) -> list[str]:
    return make_patches(project.upstream, project.tmp / "mk", TAG1, [(msg, files)])


def test_verify_unlisted_patch_file(project, clean_stack):
    (project.stack_dir() / "0009-stray.patch").write_text(clean_stack[0])
    r = project.run("verify", REF1)
    assert r.rc == 1 and "0009-stray.patch: not listed in series" in r.out, r


def test_verify_non_normalized_patch(project):
    (text,) = _one(project, commit_msg("mod: wider"), {"vllm/mod.py": edit(MOD_V1, '16', '32')})
    raw = text.replace("Subject:", "Date: Sat, 28 Nov 2026 10:00:00 +0100\nSubject:")
    problems = _verify_problems(project, [raw])
    assert any("not normalized" in p for p in problems), problems


def test_verify_missing_trailers(project):
    (text,) = _one(project, "mod: wider\n\nBecause.\n", {"vllm/mod.py": edit(MOD_V1, '16', '32')})
    problems = _verify_problems(project, [text])
    assert any("missing Upstream-Status" in p for p in problems) and any("missing Covered-By" in p for p in problems)


def test_verify_bad_upstream_status(project):
    (text,) = _one(project, commit_msg("mod: wider", trailers="Upstream-Status: Maybe\nCovered-By: t::t"),
                   {"vllm/mod.py": edit(MOD_V1, '16', '32')})
    assert any("Upstream-Status 'Maybe'" in p for p in _verify_problems(project, [text]))


def test_verify_bad_drop_when(project):
    (text,) = _one(project, commit_msg("mod: wider", trailers="Upstream-Status: Pending\nDrop-When: sglang>=1\n"
                                                            "Drop-When: vllm\nCovered-By: t::t"),
                   {"vllm/mod.py": edit(MOD_V1, '16', '32')})
    problems = _verify_problems(project, [text])
    assert any("Drop-When names 'sglang'" in p for p in problems), problems
    assert any("Drop-When 'vllm'" in p and "no version bound" in p for p in problems), problems


def test_verify_patch_that_no_longer_applies(project):
    (text,) = _one(project, commit_msg("mod: wider"), {"vllm/mod.py": edit(MOD_V1, '16', '32')})
    stale = text.replace('     return getattr(config, "hidden_size", 16)', '     return getattr(config, "hidden", 16)')
    stale = stale.replace('-    return getattr(config, "hidden_size", 16)', '-    return getattr(config, "hidden", 16)')
    assert stale != text
    problems = _verify_problems(project, [stale])
    assert any("does not apply cleanly" in p and "0001-mod-wider.patch" in p for p in problems), problems


def test_verify_patched_python_that_does_not_compile(project):
    (text,) = _one(project, commit_msg("mod: broken"), {"vllm/mod.py": edit(MOD_V1, "def untouched():", "def untouched(:")})
    problems = _verify_problems(project, [text])
    assert any("vllm/mod.py:" in p and "does not compile" in p for p in problems), problems


def test_verify_all_pinned_stacks_without_argument(project, clean_stack):
    """Without a pin, verify fetches nothing and creates no checkout: it lints every stack and
    applies those whose tree is here; the rest are NOT VERIFIED (exit 6 when none could be)."""
    r = project.run("verify", "--json")
    assert r.rc == 6, r
    assert [s["ref"] for s in r.json()["stacks"]] == [REF1]  # v1.1.0 has no series: skipped
    assert r.json()["unverifiable"] == [REF1] and "--fetch" in r.json()["stacks"][0]["unverifiable"]
    assert not project.checkout().exists()  # nothing fetched, nothing for `status` to list
    st = project.run("status", "--json").json()
    assert [c["state"] for c in st["checkouts"]] == ["not fetched", "not fetched"]
    r = project.run("verify")
    assert r.rc == 6 and "NOT VERIFIED" in r.out and "lint clean" in r.out, r
    # --fetch fetches the tree (and so makes the checkout); then a plain verify applies it
    r = project.run("verify", "--fetch", "--json")
    assert r.rc == 0 and r.json()["ok"] is True and project.checkout().exists(), r
    r = project.run("verify", "--json")
    assert r.rc == 0 and r.json()["stacks"][0]["applied"] is True, r


def test_verify_without_argument_reports_an_unfetchable_pin_without_failing_the_others(project, clean_stack):
    """One pin verified here, another whose tree no source provides: the second is NOT VERIFIED,
    the exit code is the first's (0), and a broken stack still fails (1)."""
    from conftest import TAG2

    assert project.run("apply", REF1).rc == 0
    texts = make_patches(project.upstream, project.tmp / "mk2", TAG2, clean_stack_edits()[:1])
    project.write_stack(texts, tag=TAG2)
    r = project.run("verify", env={"DSADAPT_SOURCES": "mirror"})
    assert r.rc == 0, r
    assert f"{REF1}: ok" in r.out and f"vllm@{TAG2}: NOT VERIFIED" in r.out, r
    assert not project.checkout(TAG2).exists()
    (project.stack_dir(TAG2) / "0009-stray.patch").write_text("x")
    r = project.run("verify", "--junit", str(project.tmp / "verify.xml"), env={"DSADAPT_SOURCES": "mirror"})
    assert r.rc == 1 and "0009-stray.patch: not listed in series" in r.out, r
    xml = (project.tmp / "verify.xml").read_text()
    assert 'tests="2" failures="1"' in xml and "not listed in series" in xml


def test_verify_without_a_source_says_not_verified_never_ok(project, clean_stack, upstream, tmp_path):
    """A stack whose tree no source can provide is linted, then reported NOT VERIFIED with exit 6."""
    from conftest import lock_text

    project.write_lock(lock_text(upstream, git_url=str(tmp_path / "no-such-upstream")))
    r = project.run("verify", REF1, env={"DSADAPT_SOURCES": "git,mirror"})
    assert r.rc == 6, r
    assert "NOT VERIFIED" in r.out and "no source could provide" in r.out
    j = project.run("verify", REF1, "--json", env={"DSADAPT_SOURCES": "git,mirror"})
    assert j.rc == 6 and j.json()["ok"] is False and j.json()["unverifiable"] == [REF1]

"""verify's memories: what `git apply` made of a stack (.dsadapt/verified/) and the parsed patch files
(.dsadapt/parsed/). Whatever is in them -- nothing, a reworded stack, damage, a half-written file,
another process's entries -- a verify says exactly what a verify without them says."""

from __future__ import annotations

from conftest import MOD_V1, REF1, TAG1, commit_msg, edit, make_patches

from patcher.stack.verify import applied_text


def _verify(project, *args):
    r = project.run("verify", REF1, "--json", *args)
    (res,) = r.json()["stacks"]
    return r.rc, res


def _same(a: dict, b: dict) -> bool:
    keys = ("ok", "applied", "patches", "problems", "compiled", "source")
    return {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_an_unchanged_or_reworded_stack_is_verified_without_git_apply_and_says_the_same(project, clean_stack):
    rc, first = _verify(project)
    assert rc == 0 and first["ok"] and not first["apply_remembered"], first
    assert list((project.workdir / "verified").glob("*.json")) and (project.workdir / "parsed" / "patches.bin").is_file()
    rc, again = _verify(project)
    assert rc == 0 and again["apply_remembered"] and _same(first, again), again
    # a reword (messages only): the diffs git applies are the same, and so is the verdict
    d = project.stack_dir()
    names = sorted(p.name for p in d.glob("*.patch"))
    p = d / names[1]
    p.write_text(p.read_text().replace("\n\nUpstream-Status:", "\nWith a second reason.\n\nUpstream-Status:", 1))
    rc, reworded = _verify(project)
    assert rc == 0 and reworded["apply_remembered"] and _same(first, reworded), reworded
    # every check but the apply is made again: a reword that drops a trailer fails lint at once
    p.write_text(p.read_text().replace("Covered-By:", "Covered:", 1))
    rc, bad = _verify(project)
    assert rc == 1 and bad["apply_remembered"] and any("missing Covered-By" in x for x in bad["problems"]), bad


def test_a_changed_diff_is_applied_again_and_a_failure_is_never_remembered(project, clean_stack):
    assert _verify(project)[0] == 0
    (text,) = make_patches(project.upstream, project.tmp / "mk", TAG1,
                           [(commit_msg("mod: wider"), {"vllm/mod.py": edit(MOD_V1, "16", "32")})])
    stale = text.replace('     return getattr(config, "hidden_size", 16)', '     return getattr(config, "hidden", 16)')
    stale = stale.replace('-    return getattr(config, "hidden_size", 16)', '-    return getattr(config, "hidden", 16)')
    project.write_stack([stale])
    entries = set((project.workdir / "verified").glob("*.json"))
    for _ in range(2):
        rc, res = _verify(project)
        assert rc == 1 and not res["apply_remembered"] and any("does not apply cleanly" in x for x in res["problems"])
    assert set((project.workdir / "verified").glob("*.json")) == entries  # nothing remembered for it


def test_damaged_or_half_written_memories_are_misses_never_another_verdict(project, clean_stack):
    rc, first = _verify(project)
    assert rc == 0
    (entry,) = (project.workdir / "verified").glob("*.json")
    parsed = project.workdir / "parsed" / "patches.bin"
    good_entry, good_parsed = entry.read_bytes(), parsed.read_bytes()
    damages = [
        lambda b: b[: len(b) // 2],                               # killed mid-write (without the rename)
        lambda b: b.replace(b'"100644"', b'"100755"', 1),         # a changed value: its checksum no longer fits
        lambda b: b"",                                            # an empty file
        lambda b: bytes([b[0] ^ 1]) + b[1:],                      # one flipped bit
        lambda b: b"\x00\xff garbage \x80" * 10,                  # another program's bytes
    ]
    for damage in damages:
        entry.write_bytes(damage(good_entry))
        parsed.write_bytes(damage(good_parsed))
        rc, res = _verify(project)
        assert rc == 0 and _same(first, res) and not res["apply_remembered"], res
        assert entry.read_bytes() == good_entry  # remembered again, whole
    # what killed writers leave (temporary files) is never read as an entry
    (entry.parent / f".{entry.name}.tmp-99999-1").write_text("{")
    (parsed.parent / ".patches.bin.tmp-99999-ab").write_bytes(b"junk")
    rc, res = _verify(project)
    assert rc == 0 and res["apply_remembered"] and _same(first, res)


def test_a_remembered_apply_still_compiles_what_was_never_compiled(project):
    (text,) = make_patches(project.upstream, project.tmp / "mk", TAG1,
                           [(commit_msg("mod: broken"), {"vllm/mod.py": edit(MOD_V1, "def untouched():",
                                                                              "def untouched(:")})])
    project.write_stack([text])
    rc, res = _verify(project)
    assert rc == 1 and any("does not compile" in p for p in res["problems"]), res
    rc, again = _verify(project)  # applied from memory; the blob never compiled, so it is compiled again
    assert rc == 1 and any("does not compile" in p for p in again["problems"]), again
    for f in (project.workdir / "compiled").glob("*.txt"):
        f.unlink()  # a clean stack whose compile memory is gone: its blobs are read and compiled again
    project.write_stack([t for t in make_patches(project.upstream, project.tmp / "mk2", TAG1,
                                                 [(commit_msg("mod: wider"), {"vllm/mod.py": edit(MOD_V1, "16", "32")})])])
    assert _verify(project)[0] == 0
    for f in (project.workdir / "compiled").glob("*.txt"):
        f.unlink()
    rc, res = _verify(project)
    assert rc == 0 and res["compiled"] == 1 and res["compiled_now"] == 1 and not res["apply_remembered"], res


def test_concurrent_verifies_of_one_stack_agree(project, clean_stack):
    procs = [project.spawn("verify", REF1, "--json")
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    rc, res = _verify(project)
    assert rc == 0 and res["ok"] and res["apply_remembered"]


def test_status_list_and_report_say_the_same_with_a_damaged_parse_memory(project, clean_stack):
    project.run("apply", REF1)
    first = {c: project.run(c, "--json").out for c in ("status", "list", "report")}
    parsed = project.workdir / "parsed" / "patches.bin"
    assert parsed.is_file()
    parsed.write_bytes(parsed.read_bytes()[:-7])
    assert {c: project.run(c, "--json").out for c in ("status", "list", "report")} == first


def test_applied_text_is_the_diff_unless_the_message_could_be_read_as_one():
    msg = "From: A <a@b>\nSubject: [PATCH] x\n\nWhy.\n\nUpstream-Status: Pending\n---\n"
    diff = "diff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
    assert applied_text(msg + diff) == diff
    assert applied_text(msg.replace("Why.", "Reworded: why.") + diff) == diff
    sneaky = msg.replace("Why.", "Why:\n--- a/g\n+++ b/g\n@@ -1 +1 @@\n-x\n+y")
    assert applied_text(sneaky + diff) == sneaky + diff  # git apply would read that part too
    assert applied_text("no diff at all\n") == "no diff at all\n"

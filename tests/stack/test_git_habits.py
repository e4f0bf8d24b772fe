"""What git users type works: `rebase --continue|--skip|--abort` and `apply --continue|...`,
conflict stops that name the conflict as git does, a stop found from the other pin's name,
`rebase --onto TAG --force` over an existing stack (kept in a backup ref), and `refresh`/
`verify` on commit messages the patch format does not accept."""

from __future__ import annotations

import json

import pytest
import rebase_fixture as fx

from patcher.cli.main import main
from patcher.stack.transaction import conflict_kinds


@pytest.fixture
def proj(tmp_path, monkeypatch):
    up = fx.make_upstream(tmp_path)
    proj = fx.make_project(tmp_path, up)
    monkeypatch.setenv("DSADAPT_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("DSADAPT_SOURCES", "git")
    monkeypatch.delenv("DSADAPT_MIRRORS", raising=False)
    return proj


def run(capsys, proj, *argv):
    rc = main(["--project", str(proj), *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_conflict_kinds_in_gits_words():
    z = "\0".join([
        "100644 " + "a" * 40 + " 1\tboth.py", "100644 " + "b" * 40 + " 2\tboth.py", "100644 " + "c" * 40 + " 3\tboth.py",
        "100644 " + "a" * 40 + " 1\tgone.py", "100644 " + "c" * 40 + " 3\tgone.py",
        "100644 " + "a" * 40 + " 1\tdeleted.py", "100644 " + "b" * 40 + " 2\tdeleted.py",
        "100644 " + "b" * 40 + " 2\tnew.py", "100644 " + "c" * 40 + " 3\tnew.py", ""])
    assert conflict_kinds(z) == {"both.py": "content",
                                 "gone.py": "modify/delete: upstream deleted it, the patch changes it",
                                 "deleted.py": "modify/delete: the patch deletes it, upstream changed it",
                                 "new.py": "add/add"}
    assert conflict_kinds("") == {}


def test_rebase_flags_continue_skip_abort_like_git(proj, capsys):
    rc, out, err = run(capsys, proj, "rebase", "vllm@v1.0.0", "--onto", "v1.1.0")
    assert rc == 4 and "pkg/d.py (content)" in err, err
    # the stop is in NEW's checkout: asking OLD's never says "nothing in progress"
    rc, out, err = run(capsys, proj, "continue", "vllm@v1.0.0")
    assert rc == 4 and "stopped in vllm@v1.1.0's checkout" in err and "dsadapt continue vllm@v1.1.0" in err, err
    assert "no apply" not in err
    # options of a plain rebase do not mix with --abort; two of the flags do not either
    rc, out, err = run(capsys, proj, "rebase", "--abort", "--onto", "v1.1.0")
    assert rc == 2 and "--abort takes only" in err, err
    rc, out, err = run(capsys, proj, "rebase", "--continue", "--skip")
    assert rc == 2 and "pass one of" in err, err
    rc, out, err = run(capsys, proj, "rebase", "--abort")
    assert rc == 0 and "aborted" in out, (out, err)
    assert not (proj / "patches" / "vllm" / "v1.1.0").exists()
    # again, resolved, then `rebase --continue`
    assert run(capsys, proj, "rebase", "vllm@v1.0.0", "--onto", "v1.1.0")[0] == 4
    co = proj.parent / "work" / "checkouts" / "vllm" / "v1.1.0"
    (co / "pkg/d.py").write_text(fx.RESOLVED_D)
    fx.git(co, "add", "pkg/d.py")
    rc, out, err = run(capsys, proj, "rebase", "--continue", "--json")
    assert rc == 0 and json.loads(out)["schema"] == "dsadapt.apply/1", err
    assert (proj / "patches" / "vllm" / "v1.1.0" / "series").is_file()


def test_rebase_onto_a_tag_that_has_a_stack_offers_force_and_keeps_the_old_one(proj, capsys):
    assert run(capsys, proj, "rebase", "vllm@v1.0.0", "--onto", "v1.1.0")[0] == 4
    co = proj.parent / "work" / "checkouts" / "vllm" / "v1.1.0"
    (co / "pkg/d.py").write_text(fx.RESOLVED_D)
    fx.git(co, "add", "pkg/d.py")
    assert run(capsys, proj, "continue")[0] == 0
    new = proj / "patches" / "vllm" / "v1.1.0"
    before = fx.snapshot(new)
    rc, out, err = run(capsys, proj, "rebase", "vllm@v1.0.0", "--onto", "v1.1.0")
    assert rc == 4 and "already has a stack" in err and "--force" in err and "backup ref" in err, err
    assert fx.snapshot(new) == before  # refused: nothing changed
    # --force: the stack there is kept in a backup ref of NEW's checkout, named in the output
    rc, out, err = run(capsys, proj, "rebase", "vllm@v1.0.0", "--onto", "v1.1.0", "--force")
    assert rc == 4, err  # the same conflict as before
    (co / "pkg/d.py").write_text(fx.RESOLVED_D)
    fx.git(co, "add", "pkg/d.py")
    rc, out, err = run(capsys, proj, "rebase", "--continue")
    assert rc == 0 and "is kept as refs/dsadapt/backup/" in out, (out, err)
    refs = fx.git(co, "for-each-ref", "--format=%(refname)", "refs/dsadapt/backup/").split()
    assert any(fx.git(co, "show", f"{r}:series") == before["series"].decode().rstrip("\n") for r in refs
               if fx.git(co, "cat-file", "-t", r) == "commit" and "series" in fx.git(co, "ls-tree", "--name-only", r)), refs
    # --force and an abort: the replaced stack is put back exactly
    assert run(capsys, proj, "rebase", "vllm@v1.0.0", "--onto", "v1.1.0", "--force")[0] == 4
    after_first = fx.snapshot(new)
    assert run(capsys, proj, "abort")[0] == 0
    assert fx.snapshot(new) == after_first


def test_apply_flags_are_the_op_commands(proj, capsys):
    rc, out, err = run(capsys, proj, "apply", "--continue")
    assert rc == 4 and "no apply, rebase or refresh in progress" in err, err
    rc, out, err = run(capsys, proj, "apply", "--skip", "--force")
    assert rc == 2 and "--skip takes only" in err, err
    rc, out, err = run(capsys, proj, "apply")
    assert rc == 2 and "missing argument" in err and "apply --continue" in err, err


def test_refresh_warns_and_verify_fails_on_a_commit_without_body_or_trailers(proj, capsys):
    assert run(capsys, proj, "apply", "vllm@v1.0.0")[0] == 0
    co = proj.parent / "work" / "checkouts" / "vllm" / "v1.0.0"
    (co / "pkg" / "new.py").write_text("X = 1\n")
    fx.git(co, "add", "pkg/new.py")
    fx.git(co, "-c", "user.name=U", "-c", "user.email=u@example.org", "commit", "-q", "-m", "add a new module")
    rc, out, err = run(capsys, proj, "refresh", "vllm@v1.0.0")
    assert rc == 0 and "wrote" in out, (out, err)
    assert "warning:" in err and "no body saying why" in err and "missing Upstream-Status" in err, err
    assert "missing Covered-By" in err and "docs/patch-format.md#trailers" in err
    hint = next(ln for ln in err.splitlines() if ln.startswith("hint: "))
    rc, out, err = run(capsys, proj, "refresh", "vllm@v1.0.0", "--json")
    warnings = json.loads(out)["warnings"]
    assert rc == 0 and any("no body" in w for w in warnings) and "warning:" not in err
    rc, out, err = run(capsys, proj, "verify", "vllm@v1.0.0")
    assert rc == 1 and "no body saying why" in out and "  fix: reword the commit(s)" in out, (out, err)
    assert "dsadapt refresh vllm@v1.0.0" in out
    # the same fix in the same words from both; the rebase starts at the upstream base (no --root:
    # the todo lists the stack's own commits, never the upstream commit under them)
    fix = next(ln for ln in out.splitlines() if ln.startswith("  fix: "))
    assert fix.removeprefix("  fix: ") == hint.removeprefix("hint: "), (fix, hint)
    assert f"git -C {co} rebase -i refs/dsadapt/base" in fix and "--root" not in fix
    todo = fx.git(co, "log", "--format=%s", "refs/dsadapt/base..HEAD").split("\n")  # what the todo would list
    series = [ln for ln in (proj / "patches" / "vllm" / "v1.0.0" / "series").read_text().splitlines()
              if ln.strip() and not ln.lstrip().startswith("#")]
    assert todo[0] == "add a new module" and len(todo) == len(series), (todo, series)

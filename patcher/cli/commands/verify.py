"""verify: lint stacks and check that they apply, without touching the user's checkout."""

from __future__ import annotations

import sys

import click

from patcher.cli.commands import common
from patcher.formats.patchfile import is_message_problem


def reword_fix(ctx: common.Context, ref: str) -> str:
    """How to fix commit messages the patch format rejects, in the same words for `verify` and
    `refresh`: an interactive rebase onto the checkout's upstream base (its `refs/dsadapt/base`, so
    the todo lists the stack's commits only, never the upstream commit under them)."""
    from patcher.stack.checkout import BASE_REF

    engine, _, tag = ref.partition("@")
    co = ctx.cfg.checkout_dir(engine, tag)
    first = "" if (co / ".git").exists() else f"`dsadapt apply {ref}`, then "
    return (f"reword the commit(s): {first}`git -C {co} rebase -i {BASE_REF}` (mark them `reword`), give each a body "
            f"and the trailers docs/patch-format.md#trailers requires, then `dsadapt refresh {ref}` (`dsadapt verify "
            f"{ref}` fails until then)")


@click.command("verify")
@common.pinref_arg(required=False)
@click.option("--fetch", is_flag=True,
              help="Without ENGINE@TAG: also fetch the pinned tree of every pin that has no checkout here yet "
                   "(downloads release artifacts, creates checkouts), so that every stack is applied.")
@common.junit_option
@common.json_option
@common.pass_ctx
def verify_cmd(ctx: common.Context, pin: str | None, fetch: bool, junit, as_json: bool) -> None:
    """Lint one stack (or every pinned stack) and apply it in a temporary index.

    Without ENGINE@TAG every stack is linted, and applied where its pinned tree is here (a
    checkout exists): nothing is downloaded and no checkout is created unless --fetch says so.
    A stack not applied is reported NOT VERIFIED, never ok. Exit 0: every stack it applied is
    fine (the others are listed); 1: a stack has problems; 6: no stack could be applied here."""
    from patcher.base.workdir import workdir_lock
    from patcher.stack.verify import verify_pins

    refs = [common.ref_of(pin)] if pin else [p.ref for p in ctx.lock.sorted_pins()
                                             if (ctx.cfg.patches_root / p.engine / p.tag / "series").exists()]
    for ref in refs:
        ctx.lock.pin(ref)  # unknown pins fail before anything is created
    with workdir_lock(ctx.cfg):
        results = verify_pins(ctx.cfg, ctx.lock, refs, fetch=fetch or bool(pin), progress=common.progress_printer())
    _report_ci(results, junit)
    if as_json:
        common.emit_json({"schema": "dsadapt.verify/1", "ok": all(r.ok for r in results) if pin else
                          not any(r.problems for r in results) and any(r.ok for r in results),
                          "stacks": [r.to_json() for r in results], "unverifiable": [r.ref for r in results if r.unverifiable]})
    else:
        for r in results:
            _render(ctx, r)
    _exit(results, one=bool(pin))


def _report_ci(results, junit) -> None:
    from patcher.cli.ci import Case, write_junit

    write_junit(junit, "dsadapt verify", [
        Case(r.ref, "dsadapt.verify", failure="\n".join(r.problems) if r.problems else None,
             skipped=r.unverifiable if r.unverifiable and not r.problems else None,
             output=f"{common.plural(r.patches, 'patch')}, applies: "
                    f"{'yes' if r.applied else 'not checked' if r.unverifiable else 'no'}, source {r.source or '-'}")
        for r in results])


def _render(ctx: common.Context, r) -> None:
    """One stack's verdict, its problems, and the fix of those its commit messages cause."""
    if r.unverifiable and not r.problems:
        common.out(f"{r.ref}: NOT VERIFIED — {common.plural(r.patches, 'patch')} lint clean, not applied: "
                   f"{r.unverifiable}", verdict="NOT VERIFIED")
        return
    verdict = "ok" if r.ok else "FAILED"
    common.out(f"{r.ref}: {verdict} — {common.plural(r.patches, 'patch')}, applies: "
               f"{'yes' if r.applied else 'not checked' if r.unverifiable else 'no'}, {r.compiled} .py file(s) "
               f"compile, source {r.source or '-'}", verdict=verdict)
    for p in r.problems:
        common.out(f"  - {p}")
    if any(is_message_problem(p) for p in r.problems):
        common.out(f"  fix: {reword_fix(ctx, r.ref)}")


def _exit(results, one: bool) -> None:
    """Exit 1 when a stack has problems; 6 when the one stack asked for, or every stack, could not
    be applied here (could not verify is never "ok")."""
    from patcher.base.errors import EngineUnavailable

    if any(r.problems for r in results):
        sys.exit(1)
    if one and results[0].unverifiable:
        sys.exit(EngineUnavailable.exit_code)
    if not one and results and not any(r.ok for r in results):
        sys.exit(EngineUnavailable.exit_code)


COMMANDS = [verify_cmd]

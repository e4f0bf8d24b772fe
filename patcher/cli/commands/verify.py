"""verify: lint stacks and check that they apply, without touching the user's checkout."""

from __future__ import annotations

import sys

import click

from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    pass_ctx,
    pinref_arg,
    plural,
    progress_printer,
    ref_of,
    say,
)


@click.command("verify")
@pinref_arg(required=False)
@json_option
@pass_ctx
def verify_cmd(ctx: Context, pin: str | None, as_json: bool) -> None:
    """Lint one stack (or every pinned stack) and apply it in a temporary index."""
    from patcher.base.errors import EngineUnavailable
    from patcher.base.workdir import workdir_lock
    from patcher.stack.verify import verify_stack

    refs = [ref_of(pin)] if pin else [p.ref for p in ctx.lock.sorted_pins()
                                      if (ctx.cfg.patches_root / p.engine / p.tag / "series").exists()]
    for ref in refs:
        ctx.lock.pin(ref)  # unknown pins fail before anything is created
    results = []
    with workdir_lock(ctx.cfg):
        for ref in refs:
            results.append(verify_stack(ctx.cfg, ctx.lock, ref, progress_printer(not as_json)))
    if as_json:
        emit_json({"ok": all(r.ok for r in results), "stacks": [r.to_json() for r in results],
                   "unverifiable": [r.ref for r in results if r.unverifiable]})
    else:
        for r in results:
            if r.unverifiable and not r.problems:
                say(f"{r.ref}: NOT VERIFIED — {plural(r.patches, 'patch')} lint clean, but the pinned tree is not "
                    f"available here: {r.unverifiable}")
                continue
            verdict = "ok" if r.ok else "FAILED"
            say(f"{r.ref}: {verdict} — {plural(r.patches, 'patch')}, applies: {'yes' if r.applied else 'no'}, "
                f"{r.compiled} .py file(s) compile, source {r.source}")
            for p in r.problems:
                say(f"  - {p}")
    if any(r.problems for r in results):
        sys.exit(1)
    if any(r.unverifiable for r in results):
        sys.exit(EngineUnavailable.exit_code)  # could not verify is never "ok"


COMMANDS = [verify_cmd]

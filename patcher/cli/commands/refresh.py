"""refresh: export the checkout branch's commits back into the stack."""

from __future__ import annotations

import click

from patcher.cli.commands.common import Context, emit_json, json_option, out, pass_ctx, pinref_arg, ref_of, warn


@click.command("refresh")
@pinref_arg()
@click.option("--force", is_flag=True,
              help="Overwrite patches/ files changed since apply (the previous files are kept in a backup ref).")
@json_option
@pass_ctx
def refresh_cmd(ctx: Context, pin: str, force: bool, as_json: bool) -> None:
    """Write the branch's commits to patches/ENGINE/TAG in normalized form and rewrite series.

    Refuses (exit 4) when a file there changed since the stack was applied and the branch does
    not hold that change (a pull, a hand edit); --force overwrites it and keeps the old files."""
    from patcher.base.workdir import workdir_lock
    from patcher.stack.refresh import refresh_stack

    ref = ref_of(pin)
    ctx.lock.pin(ref)
    with workdir_lock(ctx.cfg):
        res = refresh_stack(ctx.cfg, ctx.lock, ref, force=force)
    warnings = message_problems(ctx, ref)
    if as_json:
        emit_json({"schema": "dsadapt.refresh/1", "ref": str(ref), "changed": res.changed, "removed": res.removed,
                   "backup": res.backup, "notes": res.notes, "warnings": warnings})
        return
    for n in res.notes:
        out(f"  note: {n}")
    if not res.changed and not res.removed:
        out(f"{ref}: stack unchanged")
    for n in res.changed:
        out(f"  wrote   patches/{ref.engine}/{ref.tag}/{n}")
    for n in res.removed:
        out(f"  removed patches/{ref.engine}/{ref.tag}/{n}")
    for w in warnings:
        warn(f"warning: {w}")
    if warnings:
        from patcher.cli.commands.verify import reword_fix

        warn(f"hint: {reword_fix(ctx, str(ref))}")


def message_problems(ctx: Context, ref) -> list[str]:
    """What the patch format asks of each commit message that the refreshed stack lacks (no body,
    missing or malformed trailers): `verify` fails on them, `refresh` warns."""
    from patcher.base.errors import DsadaptError
    from patcher.formats.parsecache import ParseCache
    from patcher.formats.patchfile import is_message_problem
    from patcher.formats.stackfiles import lint_stack, load_stack

    parsed = ParseCache.in_workdir(ctx.cfg.workdir)  # (the files refresh just wrote: parsed as exported)
    try:
        problems = lint_stack(load_stack(ctx.cfg.patches_root, ref, must_exist=False, cache=parsed), parsed)
    except DsadaptError as e:
        return [e.message]
    parsed.save()
    root = str(ctx.cfg.project) + "/"
    return [p.removeprefix(root) for p in problems if is_message_problem(p)]


COMMANDS = [refresh_cmd]

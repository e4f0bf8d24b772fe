"""refresh: export the checkout branch's commits back into the stack."""

from __future__ import annotations

import click

from patcher.cli.commands.common import Context, emit_json, json_option, pass_ctx, pinref_arg, ref_of, say


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
    if as_json:
        emit_json({"ref": str(ref), "changed": res.changed, "removed": res.removed, "backup": res.backup,
                   "notes": res.notes})
        return
    for n in res.notes:
        say(f"  note: {n}")
    if not res.changed and not res.removed:
        say(f"{ref}: stack unchanged")
    for n in res.changed:
        say(f"  wrote   patches/{ref.engine}/{ref.tag}/{n}")
    for n in res.removed:
        say(f"  removed patches/{ref.engine}/{ref.tag}/{n}")


COMMANDS = [refresh_cmd]

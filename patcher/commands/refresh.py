"""refresh: export the checkout branch's commits back into the stack."""

from __future__ import annotations

import click

from .. import workspace
from .common import Context, emit_json, json_option, pass_ctx, pinref_arg, ref_of, say


@click.command("refresh")
@pinref_arg()
@json_option
@pass_ctx
def refresh_cmd(ctx: Context, pin: str, as_json: bool) -> None:
    """Write the branch's commits to patches/ENGINE/TAG in normalized form and rewrite series."""
    ref = ref_of(pin)
    ctx.lock.pin(ref)
    with workspace.workdir_lock(ctx.cfg):
        changed, removed = workspace.refresh_stack(ctx.cfg, ctx.lock, ref)
    if as_json:
        emit_json({"ref": str(ref), "changed": changed, "removed": removed})
        return
    if not changed and not removed:
        say(f"{ref}: stack unchanged")
    for n in changed:
        say(f"  wrote   patches/{ref.engine}/{ref.tag}/{n}")
    for n in removed:
        say(f"  removed patches/{ref.engine}/{ref.tag}/{n}")


COMMANDS = [refresh_cmd]

"""pin: add or update a pin in upstream.lock."""

from __future__ import annotations

import click

from patcher.base.workdir import workdir_lock
from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    lock_for_new_pin,
    out,
    pass_ctx,
    pinref_arg,
    progress_printer,
    ref_of,
)
from patcher.formats.lock import write_lock
from patcher.upstream.resolve import resolve_pin


@click.command("pin")
@pinref_arg(pinned=False)
@click.option("--update", is_flag=True, help="Accept a moved tag (after you investigated it).")
@click.option("--no-lock", "no_lock", is_flag=True,
              help="Do not make the hash locks of the pin's environments (`dsadapt lock PIN` makes them later).")
@json_option
@pass_ctx
def pin_cmd(ctx: Context, pin: str, update: bool, no_lock: bool, as_json: bool) -> None:
    """Resolve the tag (git where reachable) and hash its release artifacts (PyPI) into upstream.lock.

    A new pin also gets the hash lock of each of its environments (`dsadapt lock`), unless
    --no-lock; where that cannot be done, one line says why and what to run."""
    ref = ref_of(pin)
    with workdir_lock(ctx.cfg):
        entry, notes = resolve_pin(ctx.cfg, ctx.lock, ref, update=update, progress=progress_printer())
        old = ctx.lock.pins.get(str(ref))
        changed = old != entry
        if changed:
            write_lock(ctx.lock.with_pin(entry), ctx.cfg.lock_path)
        if not as_json:
            for n in notes:
                out(f"  {n}")
            out(f"{ref}: {'pinned' if old is None else ('updated' if changed else 'unchanged')} in upstream.lock")
        locks = {} if no_lock else lock_for_new_pin(ctx, ref, as_json=as_json)
    if as_json:
        emit_json(schema="dsadapt.pin/1", data={"ref": str(ref), "changed": changed, "notes": notes,
                   "entry": {"version": entry.version, "commit": entry.commit, "tree": entry.tree,
                             "artifacts": [a.__dict__ for a in entry.artifacts]}, **locks})


COMMANDS = [pin_cmd]

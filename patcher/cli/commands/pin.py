"""pin: add or update a pin in upstream.lock."""

from __future__ import annotations

import click

from patcher.base.workdir import workdir_lock
from patcher.cli.commands import common
from patcher.formats.lock import write_lock
from patcher.upstream.resolve import resolve_pin


@click.command("pin")
@common.pinref_arg(pinned=False)
@click.option("--update", is_flag=True, help="Accept a moved tag (after you investigated it).")
@click.option("--no-lock", "no_lock", is_flag=True,
              help="Do not make the hash locks of the pin's environments (`dsadapt lock PIN` makes them later).")
@common.json_option
@common.pass_ctx
def pin_cmd(ctx: common.Context, pin: str, update: bool, no_lock: bool, as_json: bool) -> None:
    """Resolve the tag (git where reachable) and hash its release artifacts (PyPI) into upstream.lock.

    A new pin also gets the hash lock of each of its environments (`dsadapt lock`), unless
    --no-lock; where that cannot be done, one line says why and what to run."""
    ref = common.ref_of(pin)
    ctx.lock.engine(ref.engine)  # an engine upstream.lock does not declare: said before the work-dir lock
    with workdir_lock(ctx.cfg):
        entry, notes = resolve_pin(ctx.cfg, ctx.lock, ref, update=update, progress=common.progress_printer())
        old = ctx.lock.pins.get(str(ref))
        changed = old != entry
        if changed:
            write_lock(ctx.lock.with_pin(entry), ctx.cfg.lock_path)
        if not as_json:
            for n in notes:
                common.out(f"  {n}")
            common.out(f"{ref}: {'pinned' if old is None else ('updated' if changed else 'unchanged')} in upstream.lock")
        locks = {} if no_lock else common.lock_for_new_pin(ctx, ref, as_json=as_json)
    if as_json:
        common.emit_json(schema="dsadapt.pin/1", data={"ref": str(ref), "changed": changed, "notes": notes,
                         "entry": {"version": entry.version, "commit": entry.commit, "tree": entry.tree,
                                   "artifacts": [a.__dict__ for a in entry.artifacts]}, **locks})


COMMANDS = [pin_cmd]

"""lock: the hash lock of a pin's environment, made from PyPI into the project's env-locks/."""

from __future__ import annotations

import click

from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    note,
    out,
    pass_ctx,
    pinref_arg,
    ref_of,
    rel_path,
)


@click.command("lock")
@pinref_arg()
@click.option("--variant", default=None, help="The variant whose environment to lock (default: every variant the "
                                              "pin has a release wheel for).")
@click.option("--python", "python", default=None, metavar="X.Y",
              help="Lock for this Python (default: the pin's `python` in upstream.lock, else 3.11).")
@click.option("--update", is_flag=True,
              help="Resolve again even where a lock exists (its versions are kept where they still fit); the result "
                   "goes to the project's env-locks/.")
@json_option
@pass_ctx
def lock_cmd(ctx: Context, pin: str, variant: str | None, python: str | None, update: bool, as_json: bool) -> None:
    """Make the hash lock of the pin's environment (uv, wheels only, PyPI alone is enough) in env-locks/.

    A lock the project or dsadapt already has is kept (--update resolves it again). Nothing is
    written unless every lock asked for could be made."""
    from patcher.artifacts.envlocks import lock_pin, pin_envs
    from patcher.base.errors import UsageError
    from patcher.base.workdir import workdir_lock
    from patcher.cli.commands.common import progress_printer
    from patcher.engines.registry import engine

    ref = ref_of(pin)
    entry = ctx.lock.pin(ref)
    if variant is not None:
        engine(ref.engine).variant_for(entry, variant)  # a bad variant is bad input, before any work
    if python is not None:
        import re

        if not re.fullmatch(r"3\.\d{1,2}", python):
            raise UsageError(f"--python {python!r} is not a Python version X.Y", hint="e.g. --python 3.12")
    pin_envs(ctx.lock, ref, variant, python)  # a pin with nothing to lock is bad input, before any work
    with workdir_lock(ctx.cfg):
        done = lock_pin(ctx.cfg.project, ctx.lock, ref, variant, python=python, update=update,
                        progress=progress_printer())
    if as_json:
        emit_json({"pin": str(ref), "locks": [d.to_json() for d in done]}, schema="dsadapt.lock/1")
        return
    for d in done:
        if d.env is None:
            out(f"{d.pin} ({d.variant}): no lock needed: {d.note}")
            continue
        where = rel_path(d.path, ctx.cfg.project) if d.origin == "project" else f"{d.path} (shipped with dsadapt)"
        builds = " or ".join({"pypi": "PyPI's", "cpu": "the CPU"}[b] for b in d.torch_builds)
        out(f"{d.pin} ({d.variant}): {d.state} {where}: {d.packages} packages, Python {d.python}, {d.platform}"
            + (f"; torch: {builds} build" if builds else ""))
        if d.note:
            note(f"  note: {d.note}")



COMMANDS = [lock_cmd]


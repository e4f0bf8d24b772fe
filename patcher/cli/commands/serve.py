"""serve: the patched engine behind a server on 127.0.0.1, until Ctrl-C (engines that offer one)."""

from __future__ import annotations

import signal
import threading

import click

from patcher.cli.commands.common import Context, PinRefParam, note, out, pass_ctx, progress_printer, ref_of
from patcher.engines import engine
from patcher.engines.base import GateRun, NotSupported
from patcher.gate.check import resolve_model
from patcher.gate.hosts import RunHost
from patcher.stack.workspace import workdir_lock


@click.command("serve")
@click.argument("pin", metavar="ENGINE@TAG", type=PinRefParam())
@click.option("--model", default="v3", show_default=True, help="Built-in tiny model (v3, v2-lite, v2) or a model directory.")
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@click.option("--port", type=int, default=None, help="HTTP port on 127.0.0.1 (default: a free one).")
@click.option("--unpatched-engine", is_flag=True, help="Triton: serve the unpatched engine behind the patched backend.")
@pass_ctx
def serve_cmd(ctx: Context, pin: str, model: str, config_style: str | None, dtype: str, variant: str | None,
              port: int | None, unpatched_engine: bool) -> None:
    """Build and install the pin, start its server with the model, print how to query it (triton@TAG today)."""
    ref = ref_of(pin)
    entry = ctx.lock.pin(ref)
    eng = engine(ref.engine)
    if eng.serve_api is None:
        raise NotSupported(f"dsadapt has no serving recipe for {ref.engine} yet",
                           hint=f"engines it serves: {', '.join(_serving_engines()) or 'none'}")
    spec = eng.variant_for(entry, variant)
    progress = progress_printer()
    with workdir_lock(ctx.cfg):
        model_dir, label, _style = resolve_model(ctx.cfg, model, config_style, progress,
                                                   default_style=eng.model_config_style)
    run = GateRun(entry, spec, dtype, model_dir, unpatched_engine=unpatched_engine)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        # each preparation step takes the work-dir lock for itself; the server runs without it
        with eng.serve(run, RunHost(ctx.cfg, ctx.lock, progress, locked=True), port=port) as served:
            out(f"{ref}: serving {label} ({served.installed.get('served') or ref}, "
                f"{served.installed.get('artifact')}) at {served.url}")
            out(f"  model: {served.model}   log: {served.log_path}")
            for line in served.usage:
                out(f"  {line}")
            note("Ctrl-C to stop.")
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            note(f"stopping the {ref.engine} server …")
    finally:
        signal.signal(signal.SIGTERM, previous)
    note("stopped.")


def _serving_engines() -> list[str]:
    from patcher.engines import engine_names

    out = []
    for name in engine_names():
        try:
            if engine(name).serve_api:
                out.append(name)
        except Exception:  # a broken plugin does not serve
            continue
    return out


COMMANDS = [serve_cmd]

"""serve: the patched engine behind a server on 127.0.0.1, until Ctrl-C (engines that offer one)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

import click

from patcher.base.errors import ExitCode, MachineError, UsageError
from patcher.base.workdir import workdir_lock
from patcher.cli.commands.common import (
    Context,
    PinRefParam,
    emit_json,
    json_option,
    model_option,
    note,
    out,
    pass_ctx,
    progress_printer,
    ref_of,
)
from patcher.engines.base import GateRun
from patcher.engines.registry import engine
from patcher.gate.equivalence import resolve_model
from patcher.gate.hosts import RunHost
from patcher.gate.plan import choose_model, served_engine_of


@click.command("serve")
@click.argument("pin", metavar="ENGINE@TAG", type=PinRefParam())
@model_option
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None,
              help="config.json style of a built-in model (default: the engine's own; for a served vLLM, what "
                   "`dsadapt perf` serves: deepseek).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Serving dtype (default: float32, or the engine's first).")
@click.option("--variant", default=None, help="Engine build variant (default: the first this machine can run).")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="HTTP port on 127.0.0.1 (default: a free one).")
@click.option("--unpatched", is_flag=True, help="Serve the pristine upstream release instead of the stack.")
@click.option("--unpatched-engine", is_flag=True, help="For a pin that serves another pinned engine (`serves` in upstream.lock): that engine unpatched, this stack applied.")
@json_option
@pass_ctx
def serve_cmd(ctx: Context, pin: str, model: str, config_style: str | None, dtype: str | None, variant: str | None,
              port: int | None, unpatched: bool, unpatched_engine: bool, as_json: bool) -> None:
    """Build and install the pin, start its server with the model, print how to query it; Ctrl-C stops it.

    Engines with a serving recipe of their own (Triton) use it; the others are served as
    `dsadapt perf` serves them (vLLM: `vllm serve` from the pin's environment). With --json one
    document (url, model, log) is printed once the server answers."""
    from patcher.gate.serve import ServeRequest, recipe_for, serve_recipe

    ref = ref_of(pin)
    entry = ctx.lock.pin(ref)
    if unpatched_engine:
        served_engine_of(ctx.lock, ref)
    eng = engine(ref.engine)
    own = eng.serve_api is not None
    if not own:
        recipe_for(ctx.lock, ref, variant)  # no way to serve it: said before anything is made
        if unpatched_engine:
            raise UsageError("--unpatched-engine is for engines served behind a backend (Triton)",
                             hint="use --unpatched to serve the pristine release")
    elif unpatched:
        raise UsageError(f"{ref.engine} serves the patched backend; --unpatched-engine serves the pristine engine "
                         "behind it", hint=f"dsadapt serve {ref} --unpatched-engine")
    spec = eng.variant_for(entry, variant)
    choose_model(model)  # a --model that is none: said before the work-dir lock is taken
    progress = progress_printer()
    style_default = eng.model_config_style if own else "deepseek"
    with workdir_lock(ctx.cfg):
        model_dir, label, _style = resolve_model(ctx.cfg, model, config_style, progress, default_style=style_default)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if own:
            run = GateRun(entry, spec, dtype or "float32", model_dir, unpatched_engine=unpatched_engine)
            # each preparation step takes the work-dir lock for itself; the server runs without it
            server = eng.serve(run, RunHost(ctx.cfg, ctx.lock, progress, locked=True), port=port)
        else:
            server = serve_recipe(ctx.cfg, ctx.lock, ServeRequest(ref, model_dir, label, dtype=dtype, variant=variant,
                                                                  port=port, unpatched=unpatched), progress=progress)
        with server as served:
            if as_json:
                emit_json({"ref": str(ref), "variant": spec.name, "url": served.url, "model": served.model,
                           "api": served.api, "log": str(served.log_path), "pid_group": served.pid,
                           "installed": served.installed, "usage": list(served.usage)}, schema="dsadapt.serve/1")
                sys.stdout.flush()
            else:
                out(f"{ref}: serving {label} ({served.installed.get('served') or ref}, "
                    f"{served.installed.get('artifact')}) at {served.url}")
                out(f"  model: {served.model}   log: {served.log_path}")
                for line in served.usage:
                    out(f"  {line}")
            note("Ctrl-C to stop.")
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the way to stop it
                _wait(stop, served)
            note(f"stopping the {ref.engine} server …")
    finally:
        signal.signal(signal.SIGTERM, previous)
    note("stopped.")
    # it ends only when stopped (Ctrl-C, SIGTERM): the documented exit code of an interrupted command
    sys.exit(ExitCode.INTERRUPTED)


def _wait(stop: threading.Event, served) -> None:
    """Until `stop` is set (SIGTERM) or Ctrl-C; a server that exits on its own is an error (exit 7)
    naming its log, never a silent wait for nothing."""
    from patcher.base.procs import group_members

    while not stop.wait(1.0):
        if served.pid and not group_members(served.pid):
            raise MachineError(f"the server exited on its own; its log: {served.log_path}",
                               hint="read the log's last lines; rerun `dsadapt serve` once the cause is fixed")


def _serving_engines() -> list[str]:
    from patcher.engines.registry import engine_names

    out = []
    for name in engine_names():
        try:
            if engine(name).serve_api:
                out.append(name)
        except Exception:  # a broken plugin does not serve
            continue
    return out


COMMANDS = [serve_cmd]

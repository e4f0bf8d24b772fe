"""serve: a real tritonserver with the patched vLLM backend, on 127.0.0.1, until Ctrl-C."""

from __future__ import annotations

import json
import signal
import threading

import click

from ..check import resolve_model
from ..engines import adapter
from ..errors import UsageError
from ..workspace import workdir_lock
from .common import Context, PinRefParam, Progress, pass_ctx, ref_of, say


@click.command("serve")
@click.argument("pin", metavar="triton@TAG", type=PinRefParam())
@click.option("--model", default="v3", show_default=True, help="Built-in tiny model (v3, v2-lite, v2) or a model directory.")
@click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None)
@click.option("--port", type=int, default=None, help="HTTP port on 127.0.0.1 (default: a free one).")
@click.option("--unpatched-engine", is_flag=True, help="Serve the unpatched engine behind the patched backend.")
@pass_ctx
def serve_cmd(ctx: Context, pin: str, model: str, config_style: str | None, port: int | None,
              unpatched_engine: bool) -> None:
    """Assemble the backend and a model repository, start tritonserver, print how to query it."""
    from ..engines.triton import MODEL_NAME, export_src, server_venv
    from ..tritonserver import prepare, serve, vllm_model
    from ..workspace import Checkout, apply_stack

    ref = ref_of(pin)
    if adapter(ref.engine).build_kind != "backend":
        raise UsageError(f"{ref.engine} is not served through Triton", hint="serve triton@TAG pins (dsadapt list)")
    progress = Progress()
    entry = ctx.lock.pin(ref)
    with workdir_lock(ctx.cfg):
        model_dir, label, style = resolve_model(ctx.cfg, model, config_style, progress)
        apply_stack(ctx.cfg, ctx.lock, ref, progress=progress)
        co = Checkout(ctx.cfg, ref)
        root = ctx.cfg.workdir / "serve" / f"{ref.engine}-{ref.tag}"
        src = export_src(co, f"refs/heads/{co.branch}", root / "src")
        py, installed = server_venv(ctx.cfg, ctx.lock, entry, unpatched_engine, progress)
    layout = prepare(root, py.parent.parent, [vllm_model(MODEL_NAME, model_dir)], {"vllm": src})
    progress(f"starting tritonserver (model load takes about a minute on CPU); log: {root / 'tritonserver.log'}")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with serve(layout, port=port, log_path=root / "tritonserver.log") as server:
            body = {"text_input": "Hello", "parameters": {"temperature": 0, "max_tokens": 8, "logprobs": 3},
                    "exclude_input_in_output": True, "return_logprobs": True}
            say(f"{ref}: serving {label} ({installed.get('served')}, {installed.get('artifact')}) at {server.url}")
            say(f"  model: {MODEL_NAME}   log: {server.log_path}")
            say(f"  curl -s {server.url}/v2/models/{MODEL_NAME}/generate -d '{json.dumps(body)}'")
            say("  python: import tritonclient.http as h; h.InferenceServerClient('"
                f"{server.url.removeprefix('http://')}').is_model_ready('{MODEL_NAME}')")
            say("Ctrl-C to stop.")
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            say("stopping tritonserver …")
    finally:
        signal.signal(signal.SIGTERM, previous)
    say("stopped.")


COMMANDS = [serve_cmd]

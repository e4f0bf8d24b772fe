"""build / install / build-all: patched engines as installable artifacts."""

from __future__ import annotations

import sys
import time

import click

from ..build import build_pin, buildable_here
from ..engines import engine
from ..errors import DsadaptError, SourceError
from ..venvs import install_plan
from ..workspace import workdir_lock
from .common import Context, emit_json, json_option, pass_ctx, pinref_arg, progress_printer, ref_of, say, table


@click.command("build")
@pinref_arg()
@click.option("--variant", default=None, help="Build variant (vllm: cpu|cuda; lmdeploy: cuda|pytorch).")
@json_option
@pass_ctx
def build_cmd(ctx: Context, pin: str, variant: str | None, as_json: bool) -> None:
    """Build the patched engine into dist/ and print the artifact, its sha256 and how it was built."""
    ref = ref_of(pin)
    ctx.lock.pin(ref)  # bad input fails before the work-dir lock file is created
    if variant is not None:
        engine(ref.engine).variant(variant)
    with workdir_lock(ctx.cfg):
        res = build_pin(ctx.cfg, ctx.lock, ref, variant, progress=progress_printer(not as_json))
    if as_json:
        emit_json(res.to_json())
        return
    click.echo(res.artifact)
    say(f"  sha256 {res.sha256}")
    say(f"  {res.kind} build in {res.seconds:.1f} s: {res.how}")
    for p in res.replaced:
        say(f"  replaced {p}")
    for p in res.added:
        say(f"  added    {p}")
    for p in res.removed:
        say(f"  removed  {p}")
    if res.left_out:
        say(f"  left out {len(res.left_out)} member(s) for variant {res.variant}")
    eng = engine(ref.engine)
    blocker = eng.run_blocker(ctx.lock.pin(ref), eng.variant(res.variant))
    if blocker:
        say(f"  note: built here, but it cannot run here: {blocker}")


@click.command("install")
@pinref_arg()
@click.option("--variant", default=None)
@json_option
@pass_ctx
def install_cmd(ctx: Context, pin: str, variant: str | None, as_json: bool) -> None:
    """Create (or reuse) the environment the pin runs in and install the patched engine there.

    For most engines that is the pin's own virtual environment; a served engine (Triton's vLLM
    backend) gets the environment of the engine it serves, with its server added."""
    ref = ref_of(pin)
    entry = ctx.lock.pin(ref)
    eng = engine(ref.engine)
    plan = eng.env_plan(entry, eng.variant_for(entry, variant), ctx.lock)
    with workdir_lock(ctx.cfg):
        res = install_plan(ctx.cfg, ctx.lock, plan, progress=progress_printer(not as_json), stream=not as_json)
    if as_json:
        emit_json({**res.to_json(), "pin": str(ref), "note": plan.note or None})
        return
    say(f"{res.ref} ({res.variant}): {'already installed' if res.reused else 'installed'} in {res.venv} ({res.seconds:.0f} s)")
    if plan.note:
        say(f"  {plan.note}")
    if res.removed:
        say(f"  removed {', '.join(res.removed)} (their PyPI builds break imports next to this engine)")
    say(f"  activate: {res.activate}")


@click.command("build-all")
@json_option
@pass_ctx
def build_all_cmd(ctx: Context, as_json: bool) -> None:
    """Build every pin (and variant) that can be built on this machine; a table of the rest says why not."""
    rows, data, failed = [], [], False
    with workdir_lock(ctx.cfg):
        for entry in ctx.lock.sorted_pins():
            ad = engine(entry.engine)
            variants = [v.name for v in ad.pinned_variants(entry)]
            for v in variants or [ad.variants[0].name]:
                t0 = time.monotonic()
                reason = buildable_here(ctx.cfg, ctx.lock, entry, v)
                runs = ad.run_blocker(entry, ad.variant(v))
                row: dict[str, object] = {"pin": str(entry.ref), "variant": v, "kind": None, "artifact": None, "seconds": None,
                       "status": "skipped", "reason": reason, "runs_here": runs is None, "run_blocker": runs}
                if reason is None:
                    try:
                        res = build_pin(ctx.cfg, ctx.lock, entry.ref, v, progress=progress_printer(not as_json))
                        row.update(kind=res.kind, artifact=res.artifact, sha256=res.sha256,
                                   seconds=round(time.monotonic() - t0, 1), status="built")
                    except SourceError:  # no source reachable here: cannot be built here, not a failure
                        row.update(status="skipped", reason="no source reachable here (git unreachable, no mirror "
                                                            "in DSADAPT_MIRRORS, no release artifact)")
                    except DsadaptError as e:
                        row.update(status="failed", reason=e.message)
                        failed = True
                data.append(row)
                note = row["reason"] or ("" if row["runs_here"] else f"built; cannot run here: {runs}")
                rows.append([str(row["pin"]), v, str(row["kind"] or "-"), str(row["artifact"] or "-").rsplit("/", 1)[-1],
                             f"{row['seconds']:.1f}" if row["seconds"] is not None else "-", str(row["status"]),
                             str(note)])
    if as_json:
        emit_json({"builds": data, "ok": not failed})
    else:
        table("build-all", ["pin", "variant", "kind", "artifact", "s", "status", "note"], rows)
    if failed:
        sys.exit(1)


COMMANDS = [build_cmd, install_cmd, build_all_cmd]

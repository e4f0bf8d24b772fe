"""build / install / build-all: patched engines as installable artifacts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from patcher.artifacts.builder import build_pin, buildable_here
from patcher.artifacts.venvs import install_plan
from patcher.base.errors import DsadaptError, SourceError, UsageError
from patcher.base.workdir import workdir_lock
from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    out,
    pass_ctx,
    pinref_arg,
    progress_printer,
    ref_of,
    table,
)
from patcher.engines.registry import engine
from patcher.formats.bundle import default_variant


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
        res = build_pin(ctx.cfg, ctx.lock, ref, variant, progress=progress_printer())
    if as_json:
        emit_json(res.to_json(), schema="dsadapt.build/1")
        return
    click.echo(res.artifact)
    out(f"  sha256 {res.sha256}")
    out(f"  {res.kind} build in {res.seconds:.1f} s: {res.how}")
    for p in res.replaced:
        out(f"  replaced {p}")
    for p in res.added:
        out(f"  added    {p}")
    for p in res.removed:
        out(f"  removed  {p}")
    if res.left_out:
        out(f"  left out {len(res.left_out)} member(s) for variant {res.variant}")
    eng = engine(ref.engine)
    blocker = eng.run_blocker(ctx.lock.pin(ref), eng.variant(res.variant))
    if blocker:
        out(f"  note: built here, but it cannot run here: {blocker}")


@click.command("install")
@pinref_arg(required=False)
@click.option("--variant", default=None)
@click.option("--offline", "offline", type=click.Path(path_type=Path), default=None, metavar="BUNDLE",
              help="Install from a bundle (`dsadapt bundle`: a folder or .tar) with no network: pip --no-index.")
@click.option("--system-site-packages", is_flag=True,
              help="With --offline: the environments see the packages of the one dsadapt runs in (the host's "
                   "CUDA torch), which the bundle did not carry.")
@json_option
@pass_ctx
def install_cmd(ctx: Context, pin: str | None, variant: str | None, offline: Path | None, system_site_packages: bool,
                as_json: bool) -> None:
    """Create (or reuse) the environment the pin runs in and install the patched engine there.

    For most engines that is the pin's own virtual environment; a served engine (Triton's vLLM
    backend) gets the environment of the engine it serves, with its server added. With
    --offline BUNDLE: the pin's environments (patched and unpatched) from a bundle, on a machine
    without network; `check` then uses them."""
    if offline is not None:
        _install_offline(ctx, pin, variant, offline, system_site_packages, as_json)
        return
    if pin is None:
        raise UsageError("name the ENGINE@TAG to install, or pass --offline BUNDLE",
                         hint="e.g. dsadapt install vllm@v0.32.0, or dsadapt install --offline dist/bundle-...")
    if system_site_packages:
        raise UsageError("--system-site-packages goes with --offline",
                         hint="an engine's recipe decides whether its online environment sees the host's packages")
    ref = ref_of(pin)
    entry = ctx.lock.pin(ref)
    eng = engine(ref.engine)
    plan = eng.env_plan(entry, eng.variant_for(entry, default_variant(ctx.cfg, ref, variant)), ctx.lock)
    with workdir_lock(ctx.cfg):
        res = install_plan(ctx.cfg, ctx.lock, plan, progress=progress_printer(), stream=not as_json)
    if as_json:
        emit_json({**res.to_json(), "pin": str(ref), "note": plan.note or None}, schema="dsadapt.install/1")
        return
    out(f"{res.ref} ({res.variant}): {'already installed' if res.reused else 'installed'} in {res.venv} ({res.seconds:.0f} s)")
    if plan.note:
        out(f"  {plan.note}")
    if res.removed:
        out(f"  removed {', '.join(res.removed)} (their PyPI builds break imports next to this engine)")
    out(f"  activate: {res.activate}")


def _install_offline(ctx: Context, pin: str | None, variant: str | None, bundle: Path, system_site_packages: bool,
                     as_json: bool) -> None:
    from patcher.formats.bundle import read_manifest
    from patcher.offline.install import install_offline, open_bundle

    progress = progress_printer()
    with workdir_lock(ctx.cfg):
        directory = open_bundle(ctx.cfg, bundle, progress)
        m = read_manifest(directory)
        if pin is not None and str(ref_of(pin)) != m.pin:
            raise UsageError(f"the bundle holds {m.pin}, not {ref_of(pin)}", hint=f"dsadapt install --offline {bundle}")
        if variant is not None and variant != m.variant:
            raise UsageError(f"the bundle holds variant {m.variant} of {m.pin}, not {variant}",
                             hint=f"make a bundle with --variant {variant}")
        res = install_offline(ctx.cfg, ctx.lock, directory, system_site_packages=system_site_packages,
                              progress=progress, stream=not as_json)
    if as_json:
        emit_json(res.to_json(), schema="dsadapt.install-offline/1")
        return
    out(f"{res.pin} ({res.variant}) installed from {res.bundle}")
    for side, env in res.environments.items():
        out(f"  {side:9} {env['venv']} ({'reused' if env['reused'] else 'installed'}, {env['artifact']})")
    if res.host_packages:
        out("  from this host: " + ", ".join(f"{n} {v or '?'}" for n, v in sorted(res.host_packages.items())))
    for w in res.warnings:
        out(f"  note: {w}")
    out(f"next: dsadapt check {res.pin} --variant {res.variant} --model v3 --dtype {{bfloat16|float16|...}}"
        + (" [--unpatched]" if "unpatched" in res.environments else ""))


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
                        res = build_pin(ctx.cfg, ctx.lock, entry.ref, v, progress=progress_printer())
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
        emit_json({"builds": data, "ok": not failed}, schema="dsadapt.build-all/1")
    else:
        table("build-all", ["pin", "variant", "kind", "artifact", "s", "status", "note"], rows)
    if failed:
        sys.exit(1)


COMMANDS = [build_cmd, install_cmd, build_all_cmd]

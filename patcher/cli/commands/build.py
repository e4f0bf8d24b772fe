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
from patcher.cli.commands import common
from patcher.engines.registry import engine
from patcher.formats.bundle import default_variant


@click.command("build")
@common.pinref_arg()
@click.option("--variant", default=None, help="Build variant (vllm: cpu|cuda; lmdeploy: cuda|pytorch).")
@common.json_option
@common.pass_ctx
def build_cmd(ctx: common.Context, pin: str, variant: str | None, as_json: bool) -> None:
    """Build the patched engine into dist/ and print the artifact, its sha256 and how it was built."""
    ref = common.ref_of(pin)
    ctx.lock.pin(ref)  # bad input fails before the work-dir lock file is created
    if variant is not None:
        engine(ref.engine).variant(variant)
    with workdir_lock(ctx.cfg):
        res = build_pin(ctx.cfg, ctx.lock, ref, variant, progress=common.progress_printer())
    if as_json:
        common.emit_json(res.to_json(), schema="dsadapt.build/1")
        return
    click.echo(res.artifact)
    common.out(f"  sha256 {res.sha256}")
    common.out(f"  {res.kind} build in {res.seconds:.1f} s: {res.how}")
    for p in res.replaced:
        common.out(f"  replaced {p}")
    for p in res.added:
        common.out(f"  added    {p}")
    for p in res.removed:
        common.out(f"  removed  {p}")
    if res.left_out:
        common.out(f"  left out {len(res.left_out)} member(s) for variant {res.variant}")
    eng = engine(ref.engine)
    blocker = eng.run_blocker(ctx.lock.pin(ref), eng.variant(res.variant))
    if blocker:
        common.out(f"  note: built here, but it cannot run here: {blocker}")


@click.command("install")
@common.pinref_arg(required=False)
@click.option("--variant", default=None)
@click.option("--offline", "offline", type=click.Path(path_type=Path), default=None, metavar="BUNDLE",
              help="Install from a bundle (`dsadapt bundle`: a folder or .tar) with no network: pip --no-index.")
@click.option("--system-site-packages", is_flag=True,
              help="With --offline: the environments see the packages of the one dsadapt runs in (the host's "
                   "CUDA torch), which the bundle did not carry.")
@common.json_option
@common.pass_ctx
def install_cmd(ctx: common.Context, pin: str | None, variant: str | None, offline: Path | None,
                system_site_packages: bool, as_json: bool) -> None:
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
    ref = common.ref_of(pin)
    entry = ctx.lock.pin(ref)
    eng = engine(ref.engine)
    spec = eng.variant_for(entry, default_variant(ctx.cfg, ref, variant))
    plan = eng.env_plan(entry, spec, ctx.lock)
    from patcher.artifacts.envlocks import require_lock

    require_lock(ctx.cfg.project, ctx.lock, entry, spec)  # no lock: one line, before anything is made (exit 6)
    with workdir_lock(ctx.cfg):
        res = install_plan(ctx.cfg, ctx.lock, plan, progress=common.progress_printer(), stream=not as_json)
    if as_json:
        common.emit_json({**res.to_json(), "pin": str(ref), "note": plan.note or None}, schema="dsadapt.install/1")
        return
    common.out(f"{res.ref} ({res.variant}): {'already installed' if res.reused else 'installed'} in {res.venv} ({res.seconds:.0f} s)")
    if plan.note:
        common.out(f"  {plan.note}")
    if res.removed:
        common.out(f"  removed {', '.join(res.removed)} (their PyPI builds break imports next to this engine)")
    common.out(f"  activate: {res.activate}")


def _install_offline(ctx: common.Context, pin: str | None, variant: str | None, bundle: Path,
                     system_site_packages: bool, as_json: bool) -> None:
    from patcher.formats.bundle import read_manifest
    from patcher.offline.install import install_offline, open_bundle, precheck_bundle

    precheck_bundle(bundle)
    progress = common.progress_printer()
    with workdir_lock(ctx.cfg):
        directory = open_bundle(ctx.cfg, bundle, progress)
        m = read_manifest(directory)
        if pin is not None and str(common.ref_of(pin)) != m.pin:
            raise UsageError(f"the bundle holds {m.pin}, not {common.ref_of(pin)}", hint=f"dsadapt install --offline {bundle}")
        if variant is not None and variant != m.variant:
            raise UsageError(f"the bundle holds variant {m.variant} of {m.pin}, not {variant}",
                             hint=f"make a bundle with --variant {variant}")
        res = install_offline(ctx.cfg, ctx.lock, directory, system_site_packages=system_site_packages,
                              progress=progress, stream=not as_json)
    if as_json:
        common.emit_json(res.to_json(), schema="dsadapt.install-offline/1")
        return
    common.out(f"{res.pin} ({res.variant}) installed from {res.bundle}")
    for side, env in res.environments.items():
        common.out(f"  {side:9} {env['venv']} ({'reused' if env['reused'] else 'installed'}, {env['artifact']})")
    if res.host_packages:
        common.out("  from this host: " + ", ".join(f"{n} {v or '?'}" for n, v in sorted(res.host_packages.items())))
    for w in res.warnings:
        common.out(f"  note: {w}")
    common.out(f"next: dsadapt check {res.pin} --variant {res.variant} --model v3 --dtype {{bfloat16|float16|...}}"
               + (" [--unpatched]" if "unpatched" in res.environments else ""))


@click.command("build-all")
@common.json_option
@common.pass_ctx
def build_all_cmd(ctx: common.Context, as_json: bool) -> None:
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
                        res = build_pin(ctx.cfg, ctx.lock, entry.ref, v, progress=common.progress_printer())
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
        common.emit_json({"builds": data, "ok": not failed}, schema="dsadapt.build-all/1")
    else:
        common.table("build-all", ["pin", "variant", "kind", "artifact", "s", "status", "note"], rows)
    if failed:
        sys.exit(1)


COMMANDS = [build_cmd, install_cmd, build_all_cmd]

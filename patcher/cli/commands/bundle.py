"""bundle: everything an offline host needs to run `dsadapt check PIN` (patcher/offline/pack.py)."""

from __future__ import annotations

from pathlib import Path

import click

from patcher.base.workdir import workdir_lock
from patcher.cli.commands import common
from patcher.cli.commands.common import (
    Context,
    emit_json,
    json_option,
    pass_ctx,
    pinref_arg,
    progress_printer,
    ref_of,
)
from patcher.engines.registry import engine
from patcher.offline.pack import BundleRequest, check_request, make_bundle, parse_size, parse_stacks


@click.command("bundle", short_help="One folder (or .tar) with everything an offline machine needs to run `dsadapt check PIN` there.")
@pinref_arg()
@click.option("--variant", default=None, help="Build variant (lmdeploy: pytorch drops TurboMind; vllm: cpu|cuda).")
@click.option("--python", "python", default=None, metavar="X.Y",
              help="The target's Python (default: the pin's, else this one).")
@click.option("--platform", default=None, metavar="TAG",
              help="The target's platform tag (default: the one the environment's lock was made for, e.g. "
                   "manylinux_2_31_x86_64 for vLLM 0.32; manylinux_2_28_x86_64 without a lock).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where the bundle goes (default dist/bundle-ENGINE-TAG-VARIANT-pyX.Y).")
@click.option("--tar", is_flag=True, help="Write one .tar file (OUT.tar) instead of a folder.")
@click.option("--have", multiple=True, metavar="NAME[==VER]|FILE.json",
              help="What the target already has, not carried: a distribution, or a probe file "
                   "(`python3 -m pip list --format=json` run there). Repeatable.")
@click.option("--exclude", multiple=True, metavar="NAME",
              help="A dependency not to carry (nor what only it needs): the target needs it not. Repeatable.")
@click.option("--no-unpatched", is_flag=True,
              help="Leave the unpatched build out (smaller; `check --unpatched` and `perf` then cannot run there).")
@click.option("--max-size", default=None, metavar="SIZE", help="Refuse a bundle larger than this (e.g. 58MiB).")
@click.option("--stack", "stacks", multiple=True, metavar="NAME=DIR",
              help="Also carry another stack of this pin (DIR: a series file and its patches, e.g. the pin's stack "
                   "plus a planted bug) as an overlay build on the main one; `install --offline` makes its project "
                   "stacks/NAME/ and an environment seeded from the main one. Repeatable.")
@json_option
@pass_ctx
def bundle_cmd(ctx: Context, pin: str, variant: str | None, python: str | None, platform: str | None,
               out: Path | None, tar: bool, have: tuple[str, ...], exclude: tuple[str, ...], no_unpatched: bool,
               max_size: str | None, stacks: tuple[str, ...], as_json: bool) -> None:
    """Write one folder (or .tar) with everything a machine without network needs to run
    `dsadapt check PIN` there: dsadapt as a wheel, the patched and the unpatched engine builds,
    the dependencies the target lacks, each environment's hash lock, the pin's stack. On the
    target: `python3 bootstrap.py [--system-site-packages]`, then `dsadapt check` (README.txt)."""
    ref = ref_of(pin)
    ctx.lock.pin(ref)
    if variant is not None:
        engine(ref.engine).variant(variant)
    limit = parse_size(max_size)
    extra = parse_stacks(stacks)
    req = BundleRequest(ref, variant=variant, python=python, platform=platform, out=out, tar=tar, have=have,
                        exclude=exclude, unpatched=not no_unpatched, max_size=limit, stacks=extra)
    check_request(req)
    with workdir_lock(ctx.cfg):
        res = make_bundle(ctx.cfg, ctx.lock, req, progress=progress_printer())
    if as_json:
        emit_json(res.to_json(), schema="dsadapt.bundle-result/1")
        return
    click.echo(res.path)
    common.out(f"  {res.pin} ({res.variant}) for Python {res.python} {res.platform}: {res.size / 2**20:.1f} MiB, "
        f"{common.plural(res.files, 'file')}, {res.seconds:.0f} s")
    for side, b in res.builds.items():
        common.out(f"  {side:9} {Path(b['file']).name} ({b['kind']})")
    for name, st in res.stacks.items():
        common.out(f"  stack {name}: {Path(st['file']).name} ({common.plural(len(st['patches']), 'patch')}, {st['stack_hash'][:8]}): "
            f"project stacks/{name}/")
    for name, part in res.parts.items():
        common.out(f"  {name:9} {part['carried']} wheel(s) carried; from the target: {', '.join(part['host']) or 'nothing'}")
        if part["left_out"]:
            common.out(f"  {'':9} left out: {', '.join(part['left_out'])}")
    common.out("on the target, in the bundle's folder:")
    for c in res.commands:
        common.out(f"  {c}")


COMMANDS = [bundle_cmd]

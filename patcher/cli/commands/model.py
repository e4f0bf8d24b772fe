"""model: the checkpoints the gate runs on: built-in tiny models, released layouts, slices."""

from __future__ import annotations

from pathlib import Path

import click

from patcher.base.errors import size_words
from patcher.checkpoints import tiny
from patcher.cli.commands import common
from patcher.cli.commands.common import Context, emit_json, json_option, progress_printer

LIKE = ("deepseek-v2-lite", "deepseek-v2", "deepseek-v3")


def _cache() -> Path | None:
    """Where checkpoint digests are remembered: the project's cache (none outside a project)."""
    from patcher.base.errors import DsadaptError

    ctx = click.get_current_context().find_object(Context)
    if ctx is None:
        return None
    try:
        cfg = ctx.cfg
    except DsadaptError:  # no usable configuration here: digests are computed when a check needs them
        return None
    return cfg.cache if cfg.lock_path.is_file() else None


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
             "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        n = int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise click.BadParameter(f"{text!r} is not a size (e.g. 4GB, 512MiB)") from None
    if n <= 0:
        raise click.BadParameter(f"{text!r}: must be positive")
    return n


def _given(name: str) -> bool:
    """Whether the option `name` was given on the command line (not its default)."""
    return click.get_current_context().get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


@click.group("model")
def model() -> None:
    """Checkpoints for the equivalence gate: built-in tiny models, DeepSeek's released layouts, slices."""


@model.command("make")
@click.option("--variant", type=click.Choice(tiny.VARIANTS), default=None,
              help="A built-in tiny model: v3 (sigmoid + noaux_tc), v2-lite (softmax, greedy), v2 (group-limited). "
                   "Default v3 unless --like.")
@click.option("--like", type=click.Choice(LIKE), default=None,
              help="Instead: DeepSeek's released config.json and checkpoint layout (tensor names, dtypes, shards, "
                   "index; block-FP8 for deepseek-v3) with --layers decoder layers and seeded random weights.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="With --like: decoder layers to keep (from the first).")
@click.option("--mtp", type=click.IntRange(min=0), default=None,
              help="With --like deepseek-v3: MTP modules to write (default: as released, 1; each is a full MoE layer).")
@click.option("--config-style", type=click.Choice(tiny.CONFIG_STYLES), default="deepseek", show_default=True,
              help="Built-in models: deepseek (the keys DeepSeek's released config.json states) or transformers (what save_pretrained writes).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Weight seed.")
@click.option("--shard-size", default="4.3GB", show_default=True, help="With --like: shard size (DeepSeek's releases: about 4.3 GB).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="With --like: processes writing tensors (default: the CPU count less one, at most 16).")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder to write (a built-in model's files in it are overwritten; --like needs a new or empty folder).")
@json_option
def make_cmd(variant: str | None, like: str | None, layers: int | None, mtp: int | None,
             config_style: str, seed: int, shard_size: str, workers: int | None, out: Path, as_json: bool) -> None:
    """Write a checkpoint into OUT: a built-in tiny model (config.json, model.safetensors, tokenizer) or,
    with --like, a released DeepSeek layout at real shapes. Deterministic: the same arguments give the same bytes."""
    from patcher.base.errors import UsageError

    if like is None:
        given = [o for o, v in (("--layers", layers), ("--mtp", mtp), ("--workers", workers)) if v is not None]
        if _given("shard_size"):
            given.append("--shard-size")
        if given:
            raise UsageError(f"{given[0]} goes with --like (--layers, --mtp, --shard-size and --workers shape a "
                             "released layout)", hint="e.g. dsadapt model make --like deepseek-v3 --layers 4 --out DIR")
        info = tiny.make_model(out, variant=variant or "v3", config_style=config_style, seed=seed)
        data = info.to_json()
        if as_json:
            emit_json(data, schema="dsadapt.model/1")
        else:
            click.echo(f"{data['path']}: {info.variant} ({config_style} config), seed {seed}, "
                       f"{data['params']:,} params, fingerprint {data['fingerprint'][:16]}")
        return
    if variant is not None:
        raise UsageError("--variant names a built-in tiny model; --like a released one: pass one of them",
                         hint="e.g. dsadapt model make --like deepseek-v2-lite --layers 2 --out DIR")
    if layers is None:
        raise UsageError("--like needs --layers (how many decoder layers to make)",
                         hint=f"e.g. dsadapt model make --like {like} --layers 2 --out DIR")
    if config_style != "deepseek":
        raise UsageError("--config-style applies to built-in models; --like writes the released config.json",
                         hint="leave --config-style out")
    from patcher.checkpoints.fabricate import make_like

    size = _size(shard_size)
    progress = progress_printer(not as_json)
    made = make_like(out, like, layers, seed=seed, mtp=mtp, shard_bytes=size, workers=workers, cache=_cache(),
                     progress=progress)
    data = made.to_json()
    if as_json:
        emit_json(data, schema="dsadapt.model/1")
    else:
        common.out(f"{data['path']}: like {like}, {layers} layer(s)" + (f" + {made.mtp} MTP" if made.mtp else "")
            + f", seed {seed}, {made.params / 1e9:.2f} B params, {size_words(made.bytes)} in {len(made.files)} "
            f"file(s), {made.seconds:.0f} s with {made.workers} worker(s)")


@model.command("slice")
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--layers", type=click.IntRange(min=1), required=True, help="Decoder layers to keep (the first K).")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True, help="New folder for the slice.")
@json_option
def slice_cmd(src: Path, layers: int, out: Path, as_json: bool) -> None:
    """Write the first K decoder layers of the checkpoint SRC (embeddings, those layers, final norm, lm_head;
    MTP modules dropped; FP8 scales kept) into OUT, reading only the shards that hold them, one tensor at a
    time: memory stays at one 64 MiB chunk whatever the model's size."""
    from patcher.checkpoints.slicing import slice_checkpoint

    progress = progress_printer(not as_json)
    res = slice_checkpoint(src, layers, out, cache=_cache(), progress=progress)
    data = res.to_json()
    if as_json:
        emit_json(data, schema="dsadapt.model-slice/1")
    else:
        common.out(f"{data['path']}: layers 0-{layers - 1} of {res.source_layers}"
            + (f" ({res.dropped_mtp} MTP module(s) dropped)" if res.dropped_mtp else "")
            + f", {res.tensors} tensors, {size_words(res.bytes)} from {res.read_files} file(s), {res.seconds:.1f} s")


@model.command("inspect")
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(("bfloat16", "float16", "fp8")),
              help="Low-precision run(s) compared with float32 (default: what the gate judges the checkpoint in: "
                   "fp8 for block-FP8, else bfloat16 and float16). Repeatable.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the reference runs (auto: the GPU if this machine has one).")
@json_option
@common.pass_ctx
def inspect_cmd(ctx: Context, src: Path, dtypes: tuple[str, ...], device: str, as_json: bool) -> None:
    """Measure what decides whether a bug shows on the checkpoint SRC: outlier channels (massive activations),
    attention sinks, how confidently the router picks experts in low precision, logit peakedness, per-block
    weight magnitudes; each against its target (docs/models.md, "Structure"). Runs HF transformers (the gate's
    reference) on the gate's prompts; exit 0 whatever it finds (the targets are reported, not enforced)."""
    from patcher.base.errors import EngineUnavailable
    from patcher.engines.base import has_cuda
    from patcher.gate.inspect import inspect_model, render

    if device == "cuda" and not has_cuda():
        raise EngineUnavailable("--device cuda: no CUDA GPU on this machine", hint="use --device cpu")
    where = ("cuda" if has_cuda() else "cpu") if device == "auto" else device
    progress = progress_printer(not as_json)
    doc = inspect_model(ctx.cfg, src, list(dtypes) or None, where, progress=progress)
    if as_json:
        emit_json(doc, schema="dsadapt.model-structure/1")
    else:
        for line in render(doc):
            common.out(line)


COMMANDS = [model]

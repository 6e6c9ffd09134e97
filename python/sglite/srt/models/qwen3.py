"""Qwen3ForCausalLM: the Llama decoder with per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from sglite.srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: q_norm / k_norm over head_dim; biases only when attention_bias is set."""

    qkv_bias_default = False
    qk_norm = True

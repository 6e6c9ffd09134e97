"""Qwen2ForCausalLM: the Llama decoder with biases on q/k/v (not on o_proj)."""

from __future__ import annotations

from sglite.srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: always q/k/v bias."""

    qkv_bias_default = True
    qk_norm = False

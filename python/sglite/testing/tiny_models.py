"""Tiny random checkpoints of every served family for tests, built with transformers (no downloads).

``build_tiny_model`` saves an fp32 model with GQA (4 query / 2 KV heads), hidden 64, vocab 512 and a
wide init (``initializer_range=0.3``) so that greedy decoding does not collapse into one token, plus
(optionally) the tiny byte-level BPE tokenizer from ``tiny_tokenizer`` beside it so servers can use it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from sglite.testing.tiny_tokenizer import TINY_TOKENIZER_VOCAB, build_tiny_tokenizer

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
TINY_EOS_TOKEN_ID = 2  # <|im_end|> in the tiny tokenizer


def tiny_config(arch: str, **overrides: Any):
    """A transformers config of a tiny model of ``arch`` (one of ``TINY_ARCHITECTURES``); overrides win."""
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=TINY_TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        initializer_range=0.3,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=TINY_EOS_TOKEN_ID,
        bos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        cls = transformers.LlamaConfig
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        base["head_dim"] = 16
    elif arch == "qwen3_moe":  # 8 experts, top 2, every layer sparse
        cls = transformers.Qwen3MoeConfig
        base.update(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    elif arch == "deepseek_v3":  # MLA (q_lora 48, kv_lora 32, rope 8) + 8 experts in 2 groups, 1 shared, layer 0 dense
        cls = transformers.DeepseekV3Config
        base.update(
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
        )
        base["rope_parameters"] = {"rope_type": "default", "rope_theta": base.pop("rope_theta")}
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {TINY_ARCHITECTURES}")
    base.update(overrides)
    return cls(**base)


def build_tiny_model(
    path: str,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    with_tokenizer: bool = True,
    max_shard_size: Optional[str] = None,
    **config_overrides: Any,
) -> str:
    """Save a tiny random fp32 ``arch`` model (and optionally the tiny tokenizer) to ``path``; returns path.

    ``max_shard_size`` (e.g. ``"100KB"``) writes a sharded checkpoint with ``model.safetensors.index.json``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    _randomize_constant_init(model, config.initializer_range)
    os.makedirs(path, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        build_tiny_tokenizer(path)
    return path


@torch.no_grad()
def _randomize_constant_init(model, scale: float) -> None:
    # transformers initialises biases to 0 and norm scales to 1; random values make a swapped or
    # dropped bias / q_norm / k_norm visible in the equality tests instead of cancelling out.
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.normal_(0.0, scale)
        elif name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a zero bias would leave expert choice untested
            buf.normal_(0.0, 0.1)


def load_hf_model(path: str):
    """The saved checkpoint loaded back with transformers (fp32, eager attention and experts): the reference.

    Eager experts loop over experts in plain torch, which also runs in float64 (``float64_copy``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()

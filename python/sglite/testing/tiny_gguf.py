"""Write a saved HF checkpoint as a GGUF file the way llama.cpp's converter lays it out (for tests).

Names come from the ``gguf`` package's tensor name table, weights of 2 or more dimensions are quantized
with ``gguf.quants.quantize`` (norms, biases and MoE routers stay F32, and rows a quant's blocks do not
divide fall back to F16, as llama.cpp's converter does), ``llama`` Q/K rows get llama.cpp's rope
permutation, and the checkpoint's tokenizer (a byte-level BPE) and chat template go into the metadata,
so the file is self-contained like a real GGUF.

MoE files (``qwen3moe``, ``deepseek2``) follow llama.cpp's converter too: each layer's experts stacked into
one 3-D ``ffn_{gate,up,down}_exps`` tensor (expert-major), DeepSeek's ``e_score_correction_bias`` as
``exp_probs_b.bias``, and its MLA ``kv_b_proj`` split into ``attn_k_b`` (per head, transposed) and
``attn_v_b`` as converters since 2025 write it (``split_kv_b=False``: the earlier single ``attn_kv_b``).
Neither family's Q/K rows are permuted: Qwen rotates halves, and llama.cpp's deepseek2 rotates the
adjacent pairs the checkpoint already stores.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np
import torch

GGUF_ARCH_OF_MODEL_TYPE = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def permute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation: per head, halves (x.., y..) become interleaved pairs (x0, y0, ...)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer, model_dir: str) -> None:
    """The checkpoint's byte-level BPE as GGUF ``gpt2`` tokenizer metadata (tokens, merges, specials, template)."""
    import gguf

    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    added = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    size = max(list(vocab.values()) + list(added.values())) + 1
    tokens = [""] * size
    types = [gguf.TokenType.NORMAL] * size
    for text, i in vocab.items():
        tokens[i] = text
    for text, i in added.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    for key, add in (("eos_token", writer.add_eos_token_id), ("pad_token", writer.add_pad_token_id)):
        name = tcfg.get(key)
        if isinstance(name, dict):
            name = name.get("content")
        if name in added:
            add(added[name])
    writer.add_add_bos_token(False)
    template_file = os.path.join(model_dir, "chat_template.jinja")
    template = tcfg.get("chat_template")
    if template is None and os.path.isfile(template_file):
        with open(template_file) as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)


def _add_moe_metadata(writer, arch: str, cfg: dict) -> None:
    """The expert (and for deepseek2, MLA) keys llama.cpp's converter writes for ``arch``."""
    import gguf

    writer.add_expert_count(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch != "deepseek2":
        return
    rope_dim, kv_lora = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
    if cfg.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora)
    # MLA run as MQA over the latent: one KV head, key = latent + rope key, value = latent.
    writer.add_key_length(kv_lora + rope_dim)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    writer.add_value_length_mla(cfg["v_head_dim"])
    writer.add_rope_dimension_count(rope_dim)
    writer.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    if cfg.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if cfg.get("n_group") is not None:
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
    # DeepSeek-V3's config.json says "sigmoid" (transformers' DeepseekV3 always uses it and saves no key).
    scoring = cfg.get("scoring_func", "sigmoid")
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType[scoring.upper()])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(float(rope[key]))
        if rope.get("mscale_all_dim") is not None:  # llama.cpp's deepseek2 encoding of mscale_all_dim
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


def _gguf_tensors(state: dict, cfg: dict, arch: str, split_kv_b: bool):
    """(HF-style name the gguf name table knows, fp32 array) in llama.cpp's layout: experts stacked per layer,
    the router bias renamed, MLA's kv_b split; tied heads left out."""
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    n_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    for hf_name, tensor in state.items():
        data = tensor.to(torch.float32).numpy()
        m = _EXPERT.match(hf_name)
        if m is not None:
            key = (int(m.group(1)), m.group(3))
            experts.setdefault(key, {})[int(m.group(2))] = data
            if len(experts[key]) == n_experts:  # the whole layer's experts of this projection: one 3-D tensor
                parts = experts.pop(key)
                stacked = np.stack([parts[e] for e in range(n_experts)])
                yield f"model.layers.{key[0]}.mlp.experts.{key[1]}.weight", stacked
            continue
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if hf_name.endswith("e_score_correction_bias"):
            yield hf_name.replace("e_score_correction_bias", "e_score_correction.bias"), data
        elif hf_name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = data.reshape(heads, nope + v, data.shape[-1])
            yield hf_name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            yield hf_name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(kv_b[:, nope:])
        else:
            yield hf_name, data
    if experts:
        raise ValueError(f"incomplete experts in the checkpoint: {sorted(experts)}")


def write_gguf(
    model_dir: str, out_file: str, quant: str = "F32", tokenizer: Optional[bool] = None, split_kv_b: bool = True
) -> str:
    """Convert the HF checkpoint in ``model_dir`` to ``out_file`` with weights in ``quant`` (F32, F16, Q8_0, Q4_1, ...);
    ``split_kv_b=False`` writes a deepseek2 file's MLA kv_b unsplit, as converters before 2025 did."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = GGUF_ARCH_OF_MODEL_TYPE[cfg["model_type"]]
    n_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qtype = gguf.GGMLQuantizationType[quant]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_enum, n_layers)

    writer = gguf.GGUFWriter(out_file, arch)
    writer.add_name(os.path.basename(os.path.normpath(model_dir)))
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    if arch == "deepseek2":
        writer.add_head_count_kv(1)  # MLA as MQA; the key/value lengths come with the MLA keys
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if arch != "qwen3moe":
            writer.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    if arch in ("qwen3moe", "deepseek2"):
        _add_moe_metadata(writer, arch, cfg)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType[f"MOSTLY_{quant}"])
    with_tokenizer = os.path.isfile(os.path.join(model_dir, "tokenizer.json")) if tokenizer is None else tokenizer
    if with_tokenizer:
        _add_tokenizer(writer, model_dir)

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    for hf_name, data in _gguf_tensors(state, cfg, arch, split_kv_b):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name!r} in architecture {arch}")
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_rope_rows(data, heads if "q_proj" in hf_name else kv_heads)
        kind = qtype if data.ndim >= 2 and ".ffn_gate_inp." not in name else gguf.GGMLQuantizationType.F32
        if kind != gguf.GGMLQuantizationType.F32:
            try:
                data = gguf.quants.quantize(data, kind)
            except gguf.QuantError:  # rows the quant's blocks do not divide: llama.cpp writes those F16
                kind = gguf.GGMLQuantizationType.F16
                data = gguf.quants.quantize(data, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


__all__ = ["write_gguf", "permute_rope_rows"]

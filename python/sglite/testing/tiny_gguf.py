"""Write a saved HF checkpoint as a GGUF file the way llama.cpp's converter lays it out (for tests).

Names come from the ``gguf`` package's tensor name table, 2-D weights are quantized with
``gguf.quants.quantize`` (norms and biases stay F32, as llama.cpp keeps them), ``llama`` Q/K rows get
llama.cpp's rope permutation, and the checkpoint's tokenizer (a byte-level BPE) and chat template
go into the metadata, so the file is self-contained like a real GGUF.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import torch

GGUF_ARCH_OF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


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


def write_gguf(model_dir: str, out_file: str, quant: str = "F32", tokenizer: Optional[bool] = None) -> str:
    """Convert the HF checkpoint in ``model_dir`` to ``out_file`` with 2-D weights in ``quant`` (F32, F16, Q8_0, Q4_1, ...)."""
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
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType[f"MOSTLY_{quant}"])
    with_tokenizer = os.path.isfile(os.path.join(model_dir, "tokenizer.json")) if tokenizer is None else tokenizer
    if with_tokenizer:
        _add_tokenizer(writer, model_dir)

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name!r} in architecture {arch}")
        data = tensor.to(torch.float32).numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_rope_rows(data, heads if "q_proj" in hf_name else kv_heads)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


__all__ = ["write_gguf", "permute_rope_rows"]

"""GGUF tensor names -> the HF names (and layout) our models load: the one owner of that mapping.

One-to-one names come from the ``gguf`` package's own table (llama.cpp's names per architecture). Three
kinds of llama.cpp tensor have no one-to-one HF counterpart and are reshaped here:

- ``blk.N.ffn_{gate,up,down}_exps``: a layer's experts stacked expert-major into one 3-D tensor; read
  back one expert at a time as per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, which
  ``expert_params_mapping`` routes into ``FusedMoE`` (and skips on ranks that do not hold the expert) as
  it does for safetensors.
- ``blk.N.attn_k_b`` / ``attn_v_b`` (deepseek2 files converted since 2025): MLA's ``kv_b_proj`` split per
  head into its key part, transposed to ``[heads, kv_lora_rank, qk_nope]``, and its value part
  ``[heads, v_head_dim, kv_lora_rank]``; joined back into ``kv_b_proj.weight``. Earlier files store the
  unsplit ``attn_kv_b``, a plain one-to-one name.
- ``blk.N.exp_probs_b.bias``: DeepSeek's router ``e_score_correction_bias`` (llama.cpp gives it a
  ``.bias`` suffix; the HF name has none).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from sglite.srt.configs.gguf import GGUFError

# Architectures whose GGUF converter interleaves the rope halves of Q and K rows (deepseek2's converter
# leaves its rope rows as the checkpoint stores them, interleaved pairs that llama.cpp rotates in place).
PERMUTED_QK_ARCHS = ("llama",)
# Tensors llama.cpp stores but our models derive from the config (rope frequencies).
DERIVED_TENSORS = ("rope_freqs.weight",)
# HF per-layer module names (without .weight/.bias) our models load; the gguf table knows, per architecture,
# which of them it has a name for.
_LAYER_MODULES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "self_attn.q_a_proj",
    "self_attn.q_a_layernorm",
    "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_a_layernorm",
    "self_attn.kv_b_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "mlp.gate",
    "mlp.gate.e_score_correction",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
)
_STACKED_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_MLA_KV_B_PART = re.compile(r"^blk\.(\d+)\.attn_([kv])_b\.weight$")


def hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF tensor name, for the tensors that map one to one."""
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_enum, num_layers)
    hf = ["model.embed_tokens", "model.norm", "lm_head"]
    hf += [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _LAYER_MODULES]
    out: dict[str, str] = {}
    for base in hf:
        for suffix in (".weight", ".bias"):
            name = table.get_name(base + suffix, try_suffixes=(".weight", ".bias"))
            if name is not None:
                out[name] = (base + "_bias") if base.endswith(".e_score_correction") else base + suffix
    return out


def is_reshaped(gguf_name: str) -> bool:
    """Whether the tensor is one ``to_hf_tensors`` splits or joins (so it has no one-to-one HF name)."""
    return bool(_STACKED_EXPERTS.match(gguf_name) or _MLA_KV_B_PART.match(gguf_name))


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """``kv_b_proj.weight`` ``[heads * (qk_nope + v), kv_lora]`` from llama.cpp's ``attn_k_b`` and ``attn_v_b``."""
    kv_lora = k_b.shape[1]
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kv_lora)


def to_hf_tensors(
    tensors: Iterable[tuple[str, tuple[int, ...]]],
    names: dict[str, str],
    read: Callable[[str, Optional[int]], np.ndarray],
    source: str,
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, shape) in file order -> (HF name, array) in our models' layout, read as they are yielded.

    ``read(name, None)`` gives a whole tensor, ``read(name, e)`` its ``e``-th slice on the outermost axis: a stacked
    expert tensor is read one expert at a time. ``names`` is ``hf_names`` of the file (the caller checks first that
    it covers every other tensor); ``source`` names the file in errors.
    """
    kv_b_parts: dict[int, dict[str, np.ndarray]] = {}
    for name, shape in tensors:
        if m := _STACKED_EXPERTS.match(name):
            layer, proj = m.groups()
            for e in range(shape[0]):
                yield f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", read(name, e)
        elif m := _MLA_KV_B_PART.match(name):
            layer = int(m.group(1))
            parts = kv_b_parts.setdefault(layer, {})
            parts[m.group(2)] = read(name, None)
            if len(parts) == 2:
                del kv_b_parts[layer]
                yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", join_kv_b(parts["k"], parts["v"])
        else:
            yield names[name], read(name, None)
    if kv_b_parts:
        raise GGUFError(f"{source}: blk.{min(kv_b_parts)} has only one of attn_k_b / attn_v_b")


__all__ = ["DERIVED_TENSORS", "PERMUTED_QK_ARCHS", "hf_names", "is_reshaped", "join_kv_b", "to_hf_tensors"]

"""Reading GGUF weights: dequantize every tensor with the ``gguf`` package and give it its HF name.

The tensor table and bytes come from ``configs.gguf_header`` (one mmap), not the package's slow GGUFReader.

``attach_gguf_blocks`` then gives each CPU linear whose weight came from blocks the GGUF kernel reads (Q4_0, Q4_1,
Q8_0) those blocks too (``module.gguf_weight``), so decode-sized products read 0.6 bytes a weight instead of 4.

Tensors come out in HF layout and HF names, full size, so each model's ``load_weights`` shards them
for TP exactly as it shards a safetensors checkpoint. ``gguf_names`` maps the names (and splits MoE
files' stacked experts, joins MLA's split kv_b). llama.cpp's converter permutes the rows of the Q and K
projections of ``llama`` models (interleaved rope pairs); that permutation is undone here.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn

from sglite.srt.configs.gguf import GGUF_ARCHITECTURES, GGUFError
from sglite.srt.configs.gguf_header import GGUFHeader, GGUFTensorInfo, read_gguf_header
from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.default_model import DEFAULT_DRAFT_DIR
from sglite.srt.layers.cpu_gguf_linear import (
    GGUF_BLOCK,
    GGUF_LINEAR_TYPES,
    GGUFWeight,
    gguf_dequantize,
    gguf_kernel_available,
    gguf_weight_from_rows,
)
from sglite.srt.model_loader.gguf_names import DERIVED_TENSORS, PERMUTED_QK_ARCHS, hf_names, is_reshaped, to_hf_tensors

logger = logging.getLogger(__name__)


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved (x0,y0,x1,y1..) back to halves (x..,y..)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _in_hf_row_order(rows: np.ndarray, arch: str, model_config: ModelConfig, hf_name: str) -> np.ndarray:
    """A tensor's rows (dequantized weights, or their stored blocks) in HF order: llama's Q and K unpermuted."""
    if arch in PERMUTED_QK_ARCHS and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = model_config.num_attention_heads if "q_proj" in hf_name else model_config.num_key_value_heads
        return unpermute_rope_rows(rows, heads)
    return rows


def _dequantize(header: GGUFHeader, tensor: GGUFTensorInfo, index: Optional[int] = None) -> np.ndarray:
    """The tensor (or with ``index``, its ``index``-th slice on the outermost axis: one expert of a stacked tensor)
    as fp32 in numpy order, bit-equal to ``gguf.quants.dequantize`` on GGUFReader's data."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    try:
        kind = Q(tensor.ggml_type)
    except ValueError:
        raise GGUFError(f"{header.path}: tensor {tensor.name!r} has unknown GGML type id {tensor.ggml_type}") from None
    raw = header.tensor_bytes(tensor)  # (rows, bytes per row)
    shape = tensor.shape
    if index is not None:  # blocks never span rows, so a slice's rows dequantize on their own
        per_slice = raw.shape[0] // shape[0]
        raw, shape = raw[index * per_slice : (index + 1) * per_slice], shape[1:]
    # gguf.quants.dequantize walks a quantized tensor 16 rows at a time; one call over all its rows does
    # the same per-block arithmetic (so the same bits) with far fewer numpy calls.
    quant = getattr(gguf.quants, kind.name, None) if kind not in (Q.F32, Q.F16) else None
    try:
        if quant is not None and hasattr(quant, "dequantize_rows"):
            quant.init_grid()
            data = quant.dequantize_rows(raw)
        else:
            data = gguf.quants.dequantize(raw, kind)
    except NotImplementedError as e:
        raise GGUFError(
            f"{header.path}: tensor {tensor.name!r} uses GGUF quant type {kind.name}, which the gguf package cannot dequantize"
        ) from e
    return np.asarray(data, dtype=np.float32).reshape(shape)


def iterate_gguf(path: str, model_config: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, dequantized tensor in ``dtype``) for every tensor of the GGUF file at ``path`` (stacked
    experts dequantized and yielded one expert at a time, MLA's split kv_b joined: ``gguf_names``)."""
    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    names = hf_names(arch, model_config.num_hidden_layers)
    tensors = [t for t in header.tensors if t.name not in DERIVED_TENSORS]
    for tensor in tensors:  # every name checked before any tensor is read
        if tensor.name not in names and not is_reshaped(tensor.name):
            raise GGUFError(f"{path}: GGUF tensor {tensor.name!r} has no counterpart in {GGUF_ARCHITECTURES[arch]}")
    by_name = {t.name: t for t in tensors}

    def read(name: str, index: Optional[int]) -> np.ndarray:
        return _dequantize(header, by_name[name], index)

    for hf_name, data in to_hf_tensors(((t.name, t.shape) for t in tensors), names, read, path):
        weight = _in_hf_row_order(data, arch, model_config, hf_name)
        # F32 tensors are read-only views of the mapped file: torch needs its own writable copy of those.
        owned = weight if weight.flags.writeable and weight.flags.c_contiguous else np.array(weight, dtype=np.float32)
        yield hf_name, torch.from_numpy(owned).to(dtype)


def _checkpoint_parts(param_name: str, stacked_params_mapping) -> list[str]:
    """The checkpoint tensors a parameter is made of, in the order its rows hold them (fused q/k/v, gate/up)."""
    parts = [param_name.replace(fused, ckpt) for ckpt, fused, _ in stacked_params_mapping if fused + "." in param_name]
    return parts or [param_name]


def _unsharded_fp32_linears(model: nn.Module) -> Iterator[tuple[nn.Module, torch.Tensor]]:
    """(module, weight) of each CPU linear that opted into cpu_gemm with a whole (one-rank) 2-D fp32 weight: the
    linears GGUF blocks can serve."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed_weight") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() == 2 and weight.dtype == torch.float32 and getattr(module, "tp_size", 1) == 1:
            yield module, weight


def attach_gguf_blocks(model: nn.Module, path: str, model_config: ModelConfig) -> int:
    """Give every CPU linear of ``model`` whose loaded weight came from kernel-readable GGUF blocks those blocks
    (``module.gguf_weight``, read by cpu_gemm.pack_weights_for_cpu); returns how many got them.

    A fused weight (q/k/v, gate/up) gets its parts' block rows in its own row order, when all parts share one
    type. Each attached weight is checked to dequantize bit for bit to the fp32 weight the model loaded, so a
    wrong mapping is an error here, never wrong logits. A weight sharded for TP > 1 keeps reading its fp32 copy.
    """
    if not gguf_kernel_available():
        return 0
    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    names = hf_names(arch, model_config.num_hidden_layers)
    tensors = {names[t.name]: t for t in header.tensors if t.name in names}
    mapping = getattr(model, "stacked_params_mapping", ())
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    attached, types = 0, set()
    for module, weight in _unsharded_fp32_linears(model):
        for name in aliases.get(id(weight), []):
            parts = _checkpoint_parts(name, mapping)
            infos = [tensors.get(part) for part in parts]
            if any(t is None for t in infos) or len({t.ggml_type for t in infos}) != 1:
                continue
            if infos[0].ggml_type not in GGUF_LINEAR_TYPES:
                continue
            # np.array: owned rows, since the file's mapping may close before the model does
            blocks = torch.from_numpy(np.ascontiguousarray(np.concatenate(
                [_in_hf_row_order(np.array(header.tensor_bytes(t)), arch, model_config, hf) for t, hf in zip(infos, parts)]
            )))
            gguf = gguf_weight_from_rows(blocks, infos[0].ggml_type, weight.shape[1])
            if gguf.out_features != weight.shape[0]:
                break  # rows the file does not hold (a padded vocabulary): the fp32 copy serves
            if not torch.equal(gguf_dequantize(gguf), weight):
                raise GGUFError(f"{path}: the GGUF blocks of {name} do not dequantize to the weight the model loaded")
            module.gguf_weight = gguf
            attached += 1
            types.add(gguf.type_name)
            break
    logger.info("GGUF kernel: %d linear weights read their %s blocks at decode batch sizes", attached,
                "/".join(sorted(types)) or "(no)")
    return attached


def draft_model_quantization(flag: Optional[str], draft_path: str, device: torch.device) -> Optional[str]:
    """--speculative-draft-model-quantization, resolved: the flag ("none": the draft's own weights); unset, q8_0 for the
    bundled draft on a CPU whose GGUF kernel is built (its block streams a quarter of the fp32 bytes:
    docs/benchmarks.md, "A hot-token draft head and a Q8_0 draft"), else None. (A runtime fact, so it is resolved
    here, not with the other bundled-pair defaults in ``default_model``.)"""
    if flag is not None:
        return None if flag == "none" else flag
    bundled = os.path.realpath(draft_path) == os.path.realpath(DEFAULT_DRAFT_DIR)
    return "q8_0" if bundled and device.type == "cpu" and gguf_kernel_available() else None


def quantize_linears_to_q8_0(model: nn.Module) -> int:
    """Round each CPU linear of ``model`` to GGUF Q8_0 blocks the GGUF kernel reads (``module.gguf_weight``), and its
    fp32 weight to exactly what those blocks dequantize to, so every route (the kernel at decode sizes, the packs
    past them) computes with the same weights; returns how many (``--speculative-draft-model-quantization q8_0``).

    Only fp32 weights of one rank whose rows split into 32-weight blocks qualify; a linear that already reads GGUF
    blocks (a hot-token head gathered from a GGUF target's) keeps them.
    """
    if not gguf_kernel_available():
        raise GGUFError("--speculative-draft-model-quantization q8_0 needs the GGUF kernel, which is not built here "
                        "(an x86 host with a C++ compiler; SGLITE_CPU_GGUF_KERNEL=0 turns it off)")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    quantized = 0
    for module, weight in _unsharded_fp32_linears(model):
        if getattr(module, "gguf_weight", None) is not None or weight.shape[1] % GGUF_BLOCK:
            continue
        rows = quantize(weight.detach().cpu().numpy(), GGMLQuantizationType.Q8_0)
        gguf = gguf_weight_from_rows(
            torch.from_numpy(np.ascontiguousarray(rows)), int(GGMLQuantizationType.Q8_0), weight.shape[1]
        )
        with torch.no_grad():
            weight.copy_(gguf_dequantize(gguf))
        module.gguf_weight = gguf
        quantized += 1
    logger.info("Draft weights: %d linears rounded to Q8_0 blocks the GGUF kernel reads "
                "(--speculative-draft-model-quantization q8_0, the bundled draft's default on CPU)", quantized)
    return quantized


__all__ = ["attach_gguf_blocks", "draft_model_quantization", "iterate_gguf", "quantize_linears_to_q8_0", "unpermute_rope_rows"]

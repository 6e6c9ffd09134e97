"""Build a model from its config and fill it from a safetensors checkpoint, sharded for this TP rank."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from sglite.srt.configs.gguf import find_gguf_file
from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.layers.cpu_gemm import fp32_kernels_serve
from sglite.srt.model_loader.gguf_weights import attach_gguf_blocks, iterate_gguf
from sglite.srt.model_loader.weight_utils import (
    WeightLoadingError,
    describe_missing,
    expected_loads,
    iterate_safetensors,
)
from sglite.srt.models.registry import get_model_class


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_config: ModelConfig,
    model_path: str,
    device: torch.device,
    dtype: torch.dtype,
    show_progress: bool = True,
) -> nn.Module:
    """Instantiate the class ``config.architectures`` names and load every parameter (safetensors or GGUF)."""
    cls = get_model_class(model_config)
    with _default_dtype(dtype), torch.device(device):
        model = cls(model_config)
    mapping = getattr(model, "stacked_params_mapping", ())
    gguf_file = find_gguf_file(model_path)
    if gguf_file is not None:
        weights = iterate_gguf(gguf_file, model_config, dtype)
    else:
        weights = iterate_safetensors(model_path, show_progress=show_progress)
    loaded = model.load_weights(weights)
    missing = expected_loads(model, mapping) - loaded
    if missing:
        names = describe_missing(missing, mapping)
        raise WeightLoadingError(
            f"checkpoint {model_path!r} is missing {len(names)} tensor(s) the model needs: {names[:8]}"
            f"{' ...' if len(names) > 8 else ''}"
        )
    # Post-load hook (SGLang's name): modules derive what they compute from the loaded tensors, e.g. MLA's
    # absorbed W_UK / W_UV from kv_b_proj.
    for module in model.modules():
        post_load = getattr(module, "process_weights_after_loading", None)
        if post_load is not None:
            post_load()
    if gguf_file is not None and fp32_kernels_serve(device, dtype):
        attach_gguf_blocks(model, gguf_file, model_config)  # decode-sized CPU products read the blocks (cpu_gemm)
    return model.eval()


__all__ = ["load_model", "WeightLoadingError"]

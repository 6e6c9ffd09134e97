"""The one place a KV-cache dtype is resolved; the memory plan and the pool builders both call it.

Both must see the same dtype, or the plan prices one byte width and the pool allocates another.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# Flag value -> storage dtype. "auto" is resolved against the model below.
_NAMED_KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# Runtime (weight and activation) dtypes a model may run in; ModelConfig.dtype is always one of these names.
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def model_runtime_dtype(dtype_flag: Optional[str], model_config: Any) -> torch.dtype:
    """The dtype a model runs in: ``--dtype`` unless ``auto``, then the checkpoint's (the one owner of this rule)."""
    name = getattr(model_config, "dtype", None) if dtype_flag in (None, "auto") else dtype_flag
    if name not in MODEL_DTYPES:
        raise ValueError(f"--dtype {dtype_flag!r} resolves to {name!r}, which is not one of {sorted(MODEL_DTYPES)}")
    return MODEL_DTYPES[name]


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCacheDtypeError(ValueError):
    """A KV-cache dtype that cannot be resolved; the message names the flag to change."""


def _model_dtype_of(model_config: Any, model_dtype: Optional[torch.dtype], who: str) -> torch.dtype:
    if model_dtype is not None:
        return model_dtype
    try:
        return model_runtime_dtype("auto", model_config)
    except ValueError:
        raise KVCacheDtypeError(
            f"{who} KV cache dtype 'auto' needs the model dtype, but its config has "
            f"dtype={getattr(model_config, 'dtype', None)!r}; "
            f"set {'--speculative-draft-kv-cache-dtype' if who == 'draft' else '--kv-cache-dtype'} explicitly"
        ) from None


def configure_kv_cache_dtype(
    kv_cache_dtype: str,
    model_config: Any,
    *,
    is_draft: bool = False,
    draft_override: Optional[str] = None,
    model_dtype: Optional[torch.dtype] = None,
) -> torch.dtype:
    """Resolve the KV storage dtype for a target or draft pool from the flags and the model config.

    ``draft_override`` (``--speculative-draft-kv-cache-dtype``) wins for a draft. ``auto`` means FP8
    (e4m3) when the checkpoint declares an FP8 KV cache, else the model dtype: ``model_dtype`` (the
    runtime's ``--dtype``) when given, else the config's own dtype.
    """
    who = "draft" if is_draft else "target"
    name = draft_override if (is_draft and draft_override is not None) else kv_cache_dtype
    if name is None:
        raise KVCacheDtypeError(f"{who} KV cache dtype is None; pass --kv-cache-dtype (e.g. 'auto')")
    key = str(name).strip().lower()
    if key == "auto":
        if getattr(model_config, "kv_cache_quant_algo", None) == "FP8":
            return torch.float8_e4m3fn
        return _model_dtype_of(model_config, model_dtype, who)
    if key not in _NAMED_KV_DTYPES:
        flag = "--speculative-draft-kv-cache-dtype" if (is_draft and draft_override is not None) else "--kv-cache-dtype"
        raise KVCacheDtypeError(
            f"{who} KV cache dtype {name!r} is unknown; set {flag} to one of "
            f"['auto', {', '.join(repr(k) for k in ('bfloat16', 'float16', 'float32', 'fp8_e4m3', 'fp8_e5m2'))}]"
        )
    return _NAMED_KV_DTYPES[key]


def kv_dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a KV storage dtype."""
    return torch.empty((), dtype=dtype).element_size()


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the pool tensors are allocated with: FP8 is stored as uint8 (index_put on fp8 is not portable)."""
    return torch.uint8 if dtype in FP8_KV_DTYPES else dtype

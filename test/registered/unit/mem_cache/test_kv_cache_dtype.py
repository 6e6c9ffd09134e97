"""configure_kv_cache_dtype: the one KV dtype resolver shared by the plan and the pools."""

SUITE = "unit-cpu"
EST_TIME = 6

import pytest
import torch

from sglite.srt.configs.model_config import ModelConfig
from sglite.srt.mem_cache.kv_cache_dtype import KVCacheDtypeError, configure_kv_cache_dtype, kv_dtype_bytes


def _cfg(dtype="bfloat16", fp8_kv=False):
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "torch_dtype": dtype,
    }
    if fp8_kv:
        raw["quantization_config"] = {"quant_method": "fp8", "kv_cache_quant_algo": "FP8"}
    return ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.float32),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    ],
)
def test_named_dtypes(name, expected):
    assert configure_kv_cache_dtype(name, _cfg()) == expected


def test_auto_is_model_dtype_unless_checkpoint_declares_fp8():
    assert configure_kv_cache_dtype("auto", _cfg("float16")) == torch.float16
    assert configure_kv_cache_dtype("auto", _cfg("bfloat16")) == torch.bfloat16
    assert configure_kv_cache_dtype("auto", _cfg("bfloat16", fp8_kv=True)) == torch.float8_e4m3fn
    # The runtime dtype (--dtype) wins over the checkpoint's declared dtype for 'auto'.
    assert configure_kv_cache_dtype("auto", _cfg("bfloat16"), model_dtype=torch.float32) == torch.float32


def test_draft_override_applies_to_draft_only():
    cfg = _cfg("bfloat16")
    assert configure_kv_cache_dtype("bfloat16", cfg, is_draft=True, draft_override="fp8_e4m3") == torch.float8_e4m3fn
    assert configure_kv_cache_dtype("bfloat16", cfg, is_draft=False, draft_override="fp8_e4m3") == torch.bfloat16
    # No override: the draft follows --kv-cache-dtype.
    assert configure_kv_cache_dtype("fp8_e5m2", cfg, is_draft=True, draft_override=None) == torch.float8_e5m2


def test_unknown_dtype_names_the_flag():
    with pytest.raises(KVCacheDtypeError, match="--kv-cache-dtype"):
        configure_kv_cache_dtype("int3", _cfg())
    with pytest.raises(KVCacheDtypeError, match="--speculative-draft-kv-cache-dtype"):
        configure_kv_cache_dtype("auto", _cfg(), is_draft=True, draft_override="fp9")


def test_auto_without_a_model_dtype_is_an_error():
    class NoDtype:
        dtype = None
        kv_cache_quant_algo = None

    with pytest.raises(KVCacheDtypeError, match="dtype"):
        configure_kv_cache_dtype("auto", NoDtype(), is_draft=True)


def test_dtype_bytes_match_torch():
    for d in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        assert kv_dtype_bytes(d) == torch.tensor([], dtype=d).element_size()

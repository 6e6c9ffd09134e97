"""GGUF checkpoints: find the file, and turn its metadata into an HF-layout folder (config + tokenizer).

A ``--model-path`` may name a ``.gguf`` file or a folder holding exactly one (and no config.json). The
config and tokenizer are what transformers' GGUF conversion makes of the file's metadata (its key table,
config classes and tokenizer converter), but the metadata is read once by ``configs.gguf_header``: the
``gguf`` package's reader, which transformers uses for the config of these architectures, took ~5 s per
pass on SmolLM2's 49k vocabulary, and AutoTokenizer made a second pass. transformers has no conversion
for ``deepseek2``: that config is derived from the metadata here (``_deepseek2_config``). The result is
written once to a cache folder keyed by the file's path, size and mtime (rebuilt whenever it is missing,
written atomically under a lock so that the several processes of one server starting at once convert it
only once). The weights are read from the GGUF itself by ``model_loader.gguf_weights``; the cache holds no weights."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from sglite.srt.configs.cache_dir import sglite_cache_dir
from sglite.srt.configs.gguf_header import GGUFHeader, read_gguf_header

# GGUF ``general.architecture`` -> the HF architecture our registry builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
}
# llama.cpp architecture -> transformers' name for it, where they differ (as load_gguf_checkpoint renames them).
_TRANSFORMERS_ARCH = {"qwen3moe": "qwen3_moe"}
# Unquantized GGUF float types -> the checkpoint dtype ``--dtype auto`` resolves to.
_FLOAT_TYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_CACHE_VERSION = "2"


class GGUFError(ValueError):
    """A GGUF checkpoint sglite cannot serve (unknown architecture or quant type, ambiguous folder)."""


def find_gguf_file(path: Optional[str]) -> Optional[str]:
    """The GGUF file ``path`` names (a ``.gguf`` file, or a folder with exactly one and no config.json), else None."""
    if not path:
        return None
    if os.path.isfile(path):
        return os.path.abspath(path) if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(files) > 1:
        raise GGUFError(
            f"{path!r} holds {len(files)} GGUF files ({[os.path.basename(f) for f in files]}); "
            "pass --model-path the one to serve"
        )
    return os.path.abspath(files[0]) if files else None


def resolved_load_format(model_path: Optional[str], load_format: str = "auto") -> str:
    """--load-format with ``auto`` resolved: gguf when ``model_path`` names a GGUF checkpoint, else safetensors."""
    if load_format != "auto":
        return load_format
    return "gguf" if find_gguf_file(model_path) else "safetensors"


def _cache_root() -> str:
    return sglite_cache_dir("gguf")


def _cache_key(gguf_file: str) -> str:
    st = os.stat(gguf_file)
    ident = f"{_CACHE_VERSION}:{gguf_file}:{st.st_size}:{st.st_mtime_ns}"
    stem = os.path.basename(gguf_file)[: -len(".gguf")]
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(lock_path: str) -> Iterator[None]:
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_metadata_dir(gguf_file: str) -> str:
    """An HF-layout folder (config.json, tokenizer files, chat template) built from the GGUF's metadata."""
    root = _cache_root()
    os.makedirs(root, exist_ok=True)
    out = os.path.join(root, _cache_key(gguf_file))
    done = os.path.join(out, "config.json")
    if os.path.isfile(done):
        return out
    with _locked(out + ".lock"):
        if os.path.isfile(done):  # another process built it while we waited
            return out
        tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
        try:
            _write_metadata_dir(gguf_file, tmp)
            if os.path.isdir(out):
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


@dataclass(frozen=True)
class _FileFacts:
    """What sglite reads from a GGUF's metadata besides transformers' config mapping."""

    arch: str  # general.architecture
    dtype: str  # the widest unquantized float type in the file: the runtime dtype
    has_tokenizer: bool
    # Config fields transformers' mapping of this architecture leaves out, read from the metadata.
    extra: tuple[tuple[str, Any], ...] = ()


def _fields_transformers_lacks(arch: str, meta: dict) -> tuple[tuple[str, Any], ...]:
    """head_dim (transformers' qwen3 mapping ignores attention.key_length) and, for qwen3moe, the expert width
    (its mapping drops expert_feed_forward_length, so Qwen3MoeConfig's default 768 would stand). deepseek2's
    whole config is derived here (``_deepseek2_config``), so it needs none."""
    if arch == "deepseek2":
        return ()
    wanted = {"head_dim": "attention.key_length"}
    if arch == "qwen3moe":
        wanted["moe_intermediate_size"] = "expert_feed_forward_length"
    return tuple((field, int(meta[f"{arch}.{key}"])) for field, key in wanted.items() if f"{arch}.{key}" in meta)


def _file_facts(header: GGUFHeader) -> _FileFacts:
    """The architecture (a clear error when absent or unsupported), dtype, key head size and tokenizer presence."""
    from gguf import GGMLQuantizationType

    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{header.path}: no general.architecture in its metadata")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{header.path}: GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    kinds = set()
    for t in header.tensors:
        try:
            kinds.add(GGMLQuantizationType(t.ggml_type).name)
        except ValueError:  # a type this gguf package does not know: the weight loader names it
            pass
    dtype = next((v for k, v in _FLOAT_TYPES.items() if k in kinds), "float32")
    return _FileFacts(arch, dtype, "tokenizer.ggml.model" in meta, _fields_transformers_lacks(arch, meta))


def _served_config(hf_config: dict, facts: _FileFacts) -> dict:
    """transformers' config dict for the file, with what sglite serves it as (architecture, dtype) and the fields
    transformers' mapping lacks."""
    config = dict(hf_config)
    config["architectures"] = [GGUF_ARCHITECTURES[facts.arch]]
    config["dtype"] = facts.dtype
    config.update(facts.extra)
    config.pop("quantization_config", None)
    return config


def _hf_config_dict(header: GGUFHeader) -> dict:
    """The config dict transformers' ``load_gguf_checkpoint`` derives from this metadata (its llama / qwen2 /
    qwen3 / qwen3moe steps, over transformers' own key table), without its ``GGUFReader`` pass (~5 s on a 49k
    vocabulary); for deepseek2, which transformers cannot read, ``_deepseek2_config``."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    meta = header.metadata
    arch = meta["general.architecture"]
    if arch == "deepseek2":  # transformers has no GGUF conversion for it
        return _deepseek2_config(header)
    # llama.cpp files Mistral under llama; transformers tells them apart by an exact general.name.
    updated = _TRANSFORMERS_ARCH.get(arch, arch)
    if "llama" in arch and meta.get("general.name") == "mistral":
        updated = "mistral"
    config: dict = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(updated) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for gguf_key, value in meta.items():
        prefix, _, config_key = gguf_key.replace(arch, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:  # transformers unwraps one-element arrays
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if "vocab_size" not in config and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    return config


# llama.cpp's expert_gating_func values.
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def _deepseek2_config(header: GGUFHeader) -> dict:
    """A DeepseekV3Config dict from a deepseek2 file's metadata, as llama.cpp's converter wrote it (transformers
    has no GGUF mapping for this architecture). Optional keys absent from the file take llama.cpp's reading."""
    meta = header.metadata

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"deepseek2.{name}", default)

    def need(name: str, *fallbacks: str) -> int:
        for k in (name, *fallbacks):
            if key(k) is not None:
                return int(key(k))
        raise GGUFError(f"{header.path}: deepseek2.{name} is missing from its metadata")

    heads, rope_dim = need("attention.head_count"), need("rope.dimension_count")
    # Files converted since MLA support (2025) give the latent as key/value_length and the per-head sizes as
    # *_length_mla; earlier ones give the per-head sizes as key/value_length.
    qk_head_dim = need("attention.key_length_mla", "attention.key_length")
    gating = int(key("expert_gating_func", 1))  # absent: softmax, llama.cpp's reading of DeepSeek-V2 files
    if gating not in _GATING_FUNCS:
        raise GGUFError(f"{header.path}: deepseek2.expert_gating_func {gating} is not softmax (1) or sigmoid (2)")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise GGUFError(f"{header.path}: neither deepseek2.vocab_size nor a token list in its metadata")
    n_group = key("expert_group_count")  # absent: no group limit
    config: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "vocab_size": int(vocab),
        "hidden_size": need("embedding_length"),
        "intermediate_size": need("feed_forward_length"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # the file's head_count_kv 1 is MLA run as MQA, not the model's heads
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "q_lora_rank": None if key("attention.q_lora_rank") is None else int(key("attention.q_lora_rank")),
        "kv_lora_rank": need("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": need("attention.value_length_mla", "attention.value_length"),
        # The converter leaves the rope rows as the checkpoint stores them: interleaved pairs.
        "rope_interleave": True,
        "n_routed_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "scoring_func": _GATING_FUNCS[gating],
        "n_group": int(n_group) if n_group is not None else 1,
        "topk_group": int(key("expert_group_used_count", 1)) if n_group is not None else 1,
        "num_nextn_predict_layers": int(key("nextn_predict_layers", 0)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if key("rope.scaling.type") == "yarn":
        rope = config["rope_parameters"]
        rope.update(rope_type="yarn", factor=float(key("rope.scaling.factor")),
                    original_max_position_embeddings=int(key("rope.scaling.original_context_length")))
        for name in ("beta_fast", "beta_slow"):
            if key(f"rope.scaling.yarn_{name}") is not None:
                rope[name] = float(key(f"rope.scaling.yarn_{name}"))
        if key("rope.scaling.yarn_log_multiplier") is not None:
            # llama.cpp stores 0.1 * mscale_all_dim, and its attention assumes mscale == mscale_all_dim (as in
            # DeepSeek's released configs), so the rotation itself is unscaled.
            mscale = float(key("rope.scaling.yarn_log_multiplier")) / 0.1
            rope.update(mscale=mscale, mscale_all_dim=mscale)
    return config


def _gguf_tokenizer(folder: str, name: str, config_class: type) -> object:
    """The tokenizer ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds, without its second
    metadata pass: with no tokenizer files beside the GGUF it picks the class by the config's class."""
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls = TOKENIZER_MAPPING.get(config_class, TokenizersBackend)
    beside = any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer_config.json", "tokenizer.json"))
    if beside or not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)  # transformers' own choice, slower
    return cls.from_pretrained(folder, gguf_file=name, _from_auto=True)


def _write_metadata_dir(gguf_file: str, out: str) -> None:
    from transformers import CONFIG_MAPPING

    header = read_gguf_header(gguf_file)
    facts = _file_facts(header)
    folder, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    config_dict = _hf_config_dict(header)
    # As AutoConfig.from_pretrained(folder, gguf_file=name) builds it from that dict.
    hf_config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(dict(config_dict), name_or_path=folder)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(_served_config(hf_config.to_dict(), facts), f, indent=2, sort_keys=True)
    if facts.has_tokenizer:  # else --tokenizer-path must name one
        # AutoTokenizer picks the class by the config's class, the one hf_config already is.
        _gguf_tokenizer(folder, name, type(hf_config)).save_pretrained(out)


__all__ = ["GGUFError", "GGUF_ARCHITECTURES", "find_gguf_file", "gguf_metadata_dir", "resolved_load_format"]

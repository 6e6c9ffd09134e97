"""GGUF checkpoints: find the file, and turn its metadata into an HF-layout folder (config + tokenizer).

A ``--model-path`` may name a ``.gguf`` file or a folder holding exactly one (and no config.json). The
config and tokenizer are what transformers' GGUF conversion makes of the file's metadata (its key table,
config classes and tokenizer converter), but the metadata is read once by ``configs.gguf_header``: the
``gguf`` package's reader, which transformers uses for the config of these architectures, took ~5 s per
pass on SmolLM2's 49k vocabulary, and AutoTokenizer made a second pass. The result is written once to
a cache folder keyed by the file's path, size and mtime (rebuilt whenever it is missing, written
atomically under a lock so that the several processes of one server starting at once convert it only
once). The weights are read from the GGUF itself by ``model_loader.gguf_weights``; the cache holds no weights."""

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
from typing import Iterator, Optional

from sglite.srt.configs.cache_dir import sglite_cache_dir
from sglite.srt.configs.gguf_header import GGUFHeader, read_gguf_header

# GGUF ``general.architecture`` -> the HF architecture our registry builds.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
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
    head_dim: Optional[int]  # {arch}.attention.key_length, when present
    has_tokenizer: bool


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
    key_length = meta.get(f"{arch}.attention.key_length")
    head_dim = None if key_length is None else int(key_length)
    return _FileFacts(arch, dtype, head_dim, "tokenizer.ggml.model" in meta)


def _served_config(hf_config: dict, facts: _FileFacts) -> dict:
    """transformers' config dict for the file, with what sglite serves it as (architecture, dtype, head_dim)."""
    config = dict(hf_config)
    config["architectures"] = [GGUF_ARCHITECTURES[facts.arch]]
    config["dtype"] = facts.dtype
    if facts.head_dim is not None:  # transformers' qwen3 mapping ignores attention.key_length
        config["head_dim"] = facts.head_dim
    config.pop("quantization_config", None)
    return config


def _hf_config_dict(header: GGUFHeader) -> dict:
    """The config dict transformers' ``load_gguf_checkpoint`` derives from this metadata (its llama / qwen2 /
    qwen3 steps, over transformers' own key table), without its ``GGUFReader`` pass (~5 s on a 49k vocabulary)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    meta = header.metadata
    arch = meta["general.architecture"]
    # llama.cpp files Mistral under llama; transformers tells them apart by an exact general.name.
    updated = "mistral" if "llama" in arch and meta.get("general.name") == "mistral" else arch
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

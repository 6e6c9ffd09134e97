"""GGUF checkpoints: find the file, and turn its metadata into an HF-layout folder (config + tokenizer).

A ``--model-path`` may name a ``.gguf`` file or a folder holding exactly one (and no config.json). The
config and tokenizer come from the file's metadata through transformers' GGUF conversion; converting
the tokenizer takes seconds, so the result is written once to a cache folder keyed by the file's path,
size and mtime (rebuilt whenever it is missing, written atomically under a lock so that the several
processes of one server starting at once convert it only once). The weights are read from the GGUF
itself by ``model_loader.gguf_weights``; the cache holds no weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Optional

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
    # SGLITE_CACHE_DIR lets the test suite (and read-only homes) keep the metadata folders out of ~/.cache.
    base = os.environ.get("SGLITE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "sglite")
    return os.path.join(base, "gguf")


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


def _file_facts(gguf_file: str) -> tuple[str, str, Optional[int], bool]:
    """``general.architecture``, the widest unquantized float type (the runtime dtype), the key head size,
    and whether the file carries a tokenizer."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFError(f"{gguf_file}: no general.architecture in its metadata")
    arch = field.contents()
    kinds = {t.tensor_type.name for t in reader.tensors}
    dtype = next((v for k, v in _FLOAT_TYPES.items() if k in kinds), "float32")
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    has_tokenizer = "tokenizer.ggml.model" in reader.fields
    return arch, dtype, None if key_length is None else int(key_length.contents()), has_tokenizer


def _write_metadata_dir(gguf_file: str, out: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    arch, dtype, head_dim, has_tokenizer = _file_facts(gguf_file)
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{gguf_file}: GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    folder, name = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    config = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    config["architectures"] = [GGUF_ARCHITECTURES[arch]]
    config["dtype"] = dtype
    if head_dim is not None:  # transformers' qwen3 mapping ignores attention.key_length
        config["head_dim"] = head_dim
    config.pop("quantization_config", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if has_tokenizer:  # else --tokenizer-path must name one
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


__all__ = ["GGUFError", "GGUF_ARCHITECTURES", "find_gguf_file", "gguf_metadata_dir", "resolved_load_format"]

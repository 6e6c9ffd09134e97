"""Start-up checks against the host, run after flag validation and before any process starts or weight loads.

``ServerArgs.validate()`` checks the flags among themselves; these checks need the machine: the port
is free, the model and draft directories exist and are readable (sglite never downloads, so a Hub id
is a missing path), the ranks fit the devices or cores, and the context length fits the model. Each
failure is a ``ServerArgsError`` whose one-line message names the flag to change.
"""

from __future__ import annotations

import errno
import glob
import os
import socket
from typing import TYPE_CHECKING, Optional

from sglite.srt.configs.gguf import GGUFError, find_gguf_file
from sglite.srt.managers.template_manager import load_chat_template
from sglite.srt.server_args import ServerArgs, ServerArgsError

if TYPE_CHECKING:
    from sglite.srt.configs.model_config import ModelConfig


def run_preflight(args: ServerArgs) -> None:
    """Raise ServerArgsError on the first mistake found (cheapest checks first)."""
    if args.node_rank == 0:  # other nodes bind no port: no HTTP server, no bootstrap server
        check_port_free(args.host, args.port)
        if args.disaggregation_mode == "prefill":  # the prefill node's bootstrap server binds a second port
            check_port_free(args.host, args.disaggregation_bootstrap_port, flag="--disaggregation-bootstrap-port")
    check_model_dir("--model-path", args.model_path)
    check_model_dir("--speculative-draft-model-path", args.speculative_draft_model_path)
    check_model_dir("--tokenizer-path", args.tokenizer_path, needs_config=False)
    check_load_format(args)
    model_config = check_architecture("--model-path", args.model_path)
    check_architecture("--speculative-draft-model-path", args.speculative_draft_model_path)
    check_chat_template(args)
    check_context_length(args, model_config)
    check_ranks_fit(args)
    check_tokenizer(args)
    check_safetensors_headers("--model-path", args.model_path)
    check_safetensors_headers("--speculative-draft-model-path", args.speculative_draft_model_path)


def check_load_format(args: ServerArgs) -> None:
    """An explicit ``--load-format`` matches what ``--model-path`` is (a GGUF checkpoint or not)."""
    if args.load_format == "auto" or args.model_path is None:
        return
    try:
        is_gguf = find_gguf_file(args.model_path) is not None
    except GGUFError as e:
        raise ServerArgsError(f"--model-path: {e}") from None
    if is_gguf != (args.load_format == "gguf"):
        raise ServerArgsError(
            f"--load-format {args.load_format} does not match --model-path {args.model_path!r}, which "
            f"{'is' if is_gguf else 'is not'} a GGUF checkpoint"
        )


def check_chat_template(args: ServerArgs) -> None:
    """``--chat-template`` names a readable template file or a built-in template."""
    if args.chat_template is None:
        return
    try:
        load_chat_template(args.chat_template)
    except ValueError as e:
        raise ServerArgsError(str(e)) from None


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """``port`` can be bound on ``host`` now (found in milliseconds, not after the model loads)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # uvicorn binds with SO_REUSEADDR too, so a port in TIME_WAIT is not reported as busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ServerArgsError(f"{flag} {port} on --host {host} {why}; pick another {flag}") from e


def check_model_dir(flag: str, path: Optional[str], *, needs_config: bool = True) -> None:
    """``path`` is a readable local directory (with a config.json for a model), or a GGUF checkpoint."""
    if path is None:
        return
    if not os.path.exists(path):
        raise ServerArgsError(
            f"{flag} {path} does not exist; sglite loads local directories only and never downloads from "
            "the Hugging Face Hub (download it first, e.g. `huggingface-cli download <repo> --local-dir <dir>`)"
        )
    try:
        gguf_file = find_gguf_file(path) if needs_config else None
    except GGUFError as e:
        raise ServerArgsError(f"{flag}: {e}") from None
    if gguf_file is not None:  # its metadata is the config
        if not os.access(gguf_file, os.R_OK):
            raise ServerArgsError(f"{flag} {gguf_file} is not readable by this user; fix its permissions")
        return
    if not os.path.isdir(path):
        raise ServerArgsError(f"{flag} {path} is not a directory; pass the model's directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ServerArgsError(f"{flag} {path} is not readable by this user; fix its permissions or pass another {flag}")
    config = os.path.join(path, "config.json")
    if needs_config and not os.path.isfile(config):
        raise ServerArgsError(f"{flag} {path} has no config.json; pass a Hugging Face model directory")
    if needs_config and not os.access(config, os.R_OK):
        raise ServerArgsError(f"{flag} {config} is not readable by this user; fix its permissions")


def check_architecture(flag: str, path: Optional[str]) -> Optional[ModelConfig]:
    """The checkpoint's config (config.json or GGUF metadata) resolves and names an architecture sglite serves;
    returns it (None without ``path``)."""
    if path is None:
        return None
    from sglite.srt.configs.model_config import ModelConfig
    from sglite.srt.models.registry import resolve_architecture

    try:
        config = ModelConfig.from_path(path)
        resolve_architecture(config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ServerArgsError(f"{flag} {path}: {e}") from None
    return config


def check_safetensors_headers(flag: str, path: Optional[str]) -> None:
    """Every safetensors file of the checkpoint opens: its header parses and covers the file (a truncated or
    corrupt download is named here, in milliseconds, not when a scheduler loads it)."""
    if path is None or not os.path.isdir(path) or find_gguf_file(path) is not None:
        return
    from safetensors import SafetensorError, safe_open

    from sglite.srt.model_loader.weight_utils import WeightLoadingError, safetensors_files

    try:
        files = safetensors_files(path)
    except WeightLoadingError as e:
        raise ServerArgsError(f"{flag}: {e}") from None
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ServerArgsError(f"{flag}: {file} is not a readable safetensors file ({e})") from None


# Files one of which a Hugging Face tokenizer folder holds (a GGUF carries its tokenizer in its metadata).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_tokenizer(args: ServerArgs) -> None:
    """The tokenizer folder (--tokenizer-path, else --model-path) holds a tokenizer: without one every text
    request would fail, blaming the client."""
    flag, path = ("--tokenizer-path", args.tokenizer_path) if args.tokenizer_path else ("--model-path", args.model_path)
    if path is None or not os.path.isdir(path) or find_gguf_file(path) is not None:
        return
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ServerArgsError(
            f"{flag} {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the model's tokenizer files there or pass --tokenizer-path"
        )


def check_context_length(args: ServerArgs, model_config: Optional[ModelConfig]) -> None:
    """--context-length fits the model's positions (rope has no angles past them), as SGLang requires.

    ``model_config``: the --model-path config ``check_architecture`` read."""
    if args.context_length is None or model_config is None:
        return
    model_max = model_config.max_position_embeddings
    if args.context_length > model_max:
        raise ServerArgsError(
            f"--context-length {args.context_length} exceeds the model's max_position_embeddings {model_max}; "
            f"lower --context-length to at most {model_max}"
        )


def check_ranks_fit(args: ServerArgs) -> None:
    """One scheduler rank per device on CUDA, per core on CPU: more ranks than that cannot run."""
    ranks = args.ranks_per_node
    if ranks == 1:
        return
    flags = "--tp-size" if args.dp_size == 1 or args.enable_dp_attention else "--tp-size x --dp-size"
    if args.nnodes > 1:
        flags += " / --nnodes"
    if _device(args) == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "CUDA devices"
    else:
        have, what = len(os.sched_getaffinity(0)), "CPU cores"
    if ranks > have:
        raise ServerArgsError(f"{flags} asks for {ranks} scheduler ranks but this machine has {have} {what}; lower {flags}")


def _device(args: ServerArgs) -> str:
    """args.resolved_device(), without its torch import (2-6 s on a busy box) where no NVIDIA device node exists."""
    if args.device is None and not glob.glob("/dev/nvidia[0-9]*"):
        return "cpu"  # CUDA cannot be available without a device node
    return args.resolved_device()

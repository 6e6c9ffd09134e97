"""``create_attention_backend(name, runner)``: the one place ``--attention-backend`` becomes a backend."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch

from sglite.srt.layers.attention.base_attn_backend import AttentionBackend


class AttentionBackendError(ValueError):
    """The requested backend cannot run here; the message names the flag to change."""


def _device_type(runner: Any) -> str:
    return torch.device(getattr(runner, "device", "cpu")).type


def _create_torch_native(runner: Any) -> AttentionBackend:
    from sglite.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(runner)


def _create_triton(runner: Any) -> AttentionBackend:
    device = _device_type(runner)
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise AttentionBackendError(
            "--attention-backend triton on CPU needs TRITON_INTERPRET=1 set before sglite is imported "
            "(slow, meant for tests); use --attention-backend torch_native on CPU"
        )
    if device not in ("cpu", "cuda"):
        raise AttentionBackendError(f"--attention-backend triton does not run on device {device!r}; use torch_native")
    from sglite.srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(runner)


def _create_flashinfer(runner: Any) -> AttentionBackend:
    device = _device_type(runner)
    if device != "cuda":
        raise AttentionBackendError(
            f"--attention-backend flashinfer needs a CUDA device (this runner is on {device!r}); "
            "use --attention-backend triton or torch_native"
        )
    if importlib.util.find_spec("flashinfer") is None:
        raise AttentionBackendError(
            "--attention-backend flashinfer needs the flashinfer package (pip install 'sglite[gpu]'); "
            "or use --attention-backend triton"
        )
    from sglite.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(runner)


ATTENTION_BACKEND_FACTORIES: dict[str, Callable[[Any], AttentionBackend]] = {
    "torch_native": _create_torch_native,
    "triton": _create_triton,
    "flashinfer": _create_flashinfer,
}


def create_attention_backend(name: str, runner: Any) -> AttentionBackend:
    """Build the backend named by ``--attention-backend`` for a model runner (needs ``runner.device``)."""
    try:
        factory = ATTENTION_BACKEND_FACTORIES[name]
    except KeyError:
        raise AttentionBackendError(
            f"unknown --attention-backend {name!r}; choose one of {sorted(ATTENTION_BACKEND_FACTORIES)}"
        ) from None
    return factory(runner)

"""Model class lookup from ``config.architectures``."""

from __future__ import annotations

import importlib
from typing import Any

# architecture name -> (module, class); imported lazily so one broken model file cannot break others.
_MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("sglite.srt.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("sglite.srt.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("sglite.srt.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("sglite.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("sglite.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DFlashDraftModel": ("sglite.srt.models.dflash", "DFlashDraftModel"),
    "DSparkDraftModel": ("sglite.srt.models.dspark", "DSparkDraftModel"),
    "Qwen3DSparkModel": ("sglite.srt.models.dspark", "DSparkDraftModel"),
}


def register_model_class(architecture: str, module: str, class_name: str) -> None:
    """Add an architecture (e.g. a draft model defined elsewhere)."""
    _MODEL_CLASSES[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    """Architecture names this build can load."""
    return sorted(_MODEL_CLASSES)


def get_model_class(model_config: Any) -> type:
    """The class of the first supported entry of ``architectures``; none supported is a clear error."""
    archs = list(getattr(model_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODEL_CLASSES:
            module, name = _MODEL_CLASSES[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"config.json architectures {archs} has no supported model; supported: {supported_architectures()}"
    )

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


# config.json ``model_type`` -> architecture, for configs that name no ``architectures`` (as transformers falls back).
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}


def register_model_class(architecture: str, module: str, class_name: str) -> None:
    """Add an architecture (e.g. a draft model defined elsewhere)."""
    _MODEL_CLASSES[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    """Architecture names this build can load."""
    return sorted(_MODEL_CLASSES)


def resolve_architecture(model_config: Any) -> str:
    """The first served entry of ``architectures`` (else the one ``model_type`` implies); none is a clear error."""
    archs = list(getattr(model_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODEL_CLASSES:
            return arch
    if not archs and _MODEL_TYPES.get(getattr(model_config, "model_type", None) or "") in _MODEL_CLASSES:
        return _MODEL_TYPES[model_config.model_type]
    named = archs or f"model_type {getattr(model_config, 'model_type', None)!r}"
    raise ValueError(f"architecture {named} is not served by sglite; served: {', '.join(supported_architectures())}")


def get_model_class(model_config: Any) -> type:
    """The class of the architecture ``resolve_architecture`` picks."""
    module, name = _MODEL_CLASSES[resolve_architecture(model_config)]
    return getattr(importlib.import_module(module), name)

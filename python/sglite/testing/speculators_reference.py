"""The DSpark reference heads of vLLM's ``speculators`` (0.9.0), loaded without importing the package.

``speculators/models/dspark/model_definitions.py`` imports only torch, while the package's
``__init__`` pulls in heavy training dependencies; it is installed with ``pip install --no-deps
speculators==0.9.0`` (README command 2) and this file is loaded on its own.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

SPECULATORS_INSTALL = "pip install --no-deps speculators==0.9.0"


def load_dspark_model_definitions() -> ModuleType:
    """The reference module with ``MarkovHead`` and ``ConfidenceHead``; a clear error when not installed."""
    spec = importlib.util.find_spec("speculators")  # locates the package without executing its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the speculators reference is not installed; run `{SPECULATORS_INSTALL}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], "models", "dspark", "model_definitions.py")
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing; run `{SPECULATORS_INSTALL}`")
    module_spec = importlib.util.spec_from_file_location("speculators_dspark_model_definitions", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module

"""Import the repository's stand-alone scripts (benchmark/, scripts/, test/run_suite.py) in tests, by path."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional


def load_script(path: "str | os.PathLike[str]", name: Optional[str] = None) -> ModuleType:
    """The script at ``path`` as a module, registered in ``sys.modules`` under ``name`` (default: its file stem).

    Registered before it runs: a dataclass looks its module up in ``sys.modules`` while the class is built.
    """
    path = os.fspath(path)
    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

"""Where sglite keeps what it derives once per host: GGUF metadata folders, built CPU kernels."""

from __future__ import annotations

import os


def sglite_cache_dir(*parts: str) -> str:
    """``$SGLITE_CACHE_DIR``, else ``$XDG_CACHE_HOME/sglite``, else ``~/.cache/sglite``; joined with ``parts``."""
    # SGLITE_CACHE_DIR lets the test suite (and read-only homes) keep these out of ~/.cache.
    base = os.environ.get("SGLITE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "sglite")
    return os.path.join(base, *parts)

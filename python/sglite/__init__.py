"""sglite: an SGLang-style LLM serving engine for DFLASH/DSPARK speculative decoding."""

from sglite.version import __version__

__all__ = ["Engine", "__version__"]


def __getattr__(name):
    # Lazy so `import sglite` stays cheap (no torch) for the CLI and argument parsing.
    if name == "Engine":
        from sglite.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)

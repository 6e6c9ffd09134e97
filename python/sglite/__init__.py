"""sglite: an SGLang-style LLM serving engine for DFLASH/DSPARK speculative decoding."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so `import sglite` stays cheap (no torch) for the CLI and argument parsing.
    if name == "Engine":
        from sglite.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)

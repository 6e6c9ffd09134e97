"""The default-model choice: without ``--model-path`` the embedded model under ``sglite/assets/default_model``
is served, with speculative decoding on (DFLASH or DSPARK, from the draft's config) when the bundled
draft under ``sglite/assets/default_draft`` is present and no speculative flags were given.

Used by ``sglite serve`` (launch_server) and ``sglite.Engine`` alike.
"""

from __future__ import annotations

import dataclasses
import json
import os

from sglite.srt.server_args import ServerArgs, ServerArgsError

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEFAULT_MODEL_DIR = os.path.join(ASSETS_DIR, "default_model")
DEFAULT_DRAFT_DIR = os.path.join(ASSETS_DIR, "default_draft")
DEFAULT_SERVED_MODEL_NAME = "sglite-default"


def draft_algorithm(draft_dir: str) -> str:
    """DFLASH or DSPARK, from the draft checkpoint's ``architectures`` (a clear error otherwise)."""
    with open(os.path.join(draft_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    names = " ".join(archs).lower()
    if "dspark" in names:
        return "DSPARK"
    if "dflash" in names:
        return "DFLASH"
    raise ServerArgsError(
        f"cannot tell the speculative algorithm of the draft at {draft_dir} (architectures={archs}); "
        "pass --speculative-algorithm and --speculative-draft-model-path explicitly"
    )


def resolve_default_model(args: ServerArgs) -> ServerArgs:
    """args with model_path (and the bundled draft) filled in when --model-path is absent."""
    if args.model_path is not None:
        return args
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise ServerArgsError(
            f"no --model-path given and the embedded default model is not installed at {DEFAULT_MODEL_DIR}; "
            "pass --model-path <model directory>"
        )
    updates: dict[str, object] = {"model_path": DEFAULT_MODEL_DIR}
    if args.served_model_name is None:
        # Clients cannot guess the install path, so the bundled model answers to a fixed name.
        updates["served_model_name"] = DEFAULT_SERVED_MODEL_NAME
    has_draft = os.path.isfile(os.path.join(DEFAULT_DRAFT_DIR, "config.json"))
    if has_draft and args.speculative_algorithm is None and args.speculative_draft_model_path is None:
        updates["speculative_algorithm"] = draft_algorithm(DEFAULT_DRAFT_DIR)
        updates["speculative_draft_model_path"] = DEFAULT_DRAFT_DIR
    return dataclasses.replace(args, **updates)


def describe_model_choice(original: ServerArgs, resolved: ServerArgs) -> str:
    """A log line naming the model (and draft) being served and where the choice came from."""
    source = "--model-path" if original.model_path is not None else "the embedded default model"
    line = f"model: {resolved.model_path} (from {source})"
    if resolved.speculative_algorithm:
        draft_source = (
            "the bundled default draft" if original.speculative_draft_model_path is None else "--speculative-draft-model-path"
        )
        line += f"; speculative decoding {resolved.speculative_algorithm} with draft {resolved.speculative_draft_model_path} (from {draft_source})"
    else:
        line += "; speculative decoding off"
    return line

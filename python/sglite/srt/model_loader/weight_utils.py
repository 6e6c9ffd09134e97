"""Reading safetensors checkpoints (single file or sharded index) and routing tensors to parameters."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterable, Iterator, Sequence

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from sglite.srt.layers.utils import WeightShapeError

SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightLoadingError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's safetensors files: those named by the sharded index, else every *.safetensors."""
    index_path = os.path.join(model_path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadingError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        paths = [os.path.join(model_path, name) for name in files]
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise WeightLoadingError(f"{SAFETENSORS_INDEX} in {model_path} names shard files that do not exist: {absent}")
        return paths
    paths = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not paths:
        raise WeightLoadingError(
            f"no safetensors weights in {model_path!r} (expected model.safetensors or {SAFETENSORS_INDEX})"
        )
    return paths


def iterate_safetensors(model_path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, one shard file at a time."""
    files = safetensors_files(model_path)
    bar = tqdm(files, desc="Loading safetensors shards", unit="file", disable=not show_progress or len(files) == 0)
    for path in bar:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _load_one(param: nn.Parameter, name: str, tensor: torch.Tensor, shard_id: Any) -> None:
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            if tuple(param.shape) != tuple(tensor.shape):
                raise WeightShapeError(
                    f"checkpoint tensor has shape {tuple(tensor.shape)} but the parameter expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    except WeightShapeError as e:
        raise WeightLoadingError(f"checkpoint tensor {name!r}: {e}") from e


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: Sequence[tuple[str, str, Any]] = (),
    skip_suffixes: Sequence[str] = (),
    tied_names: Sequence[str] = (),
) -> set[str]:
    """Route each checkpoint tensor to its parameter (through fused-projection mappings); return filled names.

    A tensor the model has no parameter for is an error (a wrong checkpoint fails here, not later),
    except names ending in ``skip_suffixes`` and ``tied_names`` (a tied lm_head stored anyway).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip_suffixes and name.endswith(tuple(skip_suffixes)):
            continue
        if name in tied_names:
            continue
        target, shard_id = name, None
        for ckpt_part, param_part, sid in stacked_params_mapping:
            if ckpt_part in name:
                target, shard_id = name.replace(ckpt_part, param_part), sid
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        _load_one(param, name, tensor, shard_id)
        loaded.add(target if shard_id is None else f"{target}#{shard_id}")
    if unexpected:
        raise WeightLoadingError(
            f"checkpoint has {len(unexpected)} tensor(s) the model does not use: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} (wrong architecture in config.json?)"
        )
    return loaded


def expected_loads(model: nn.Module, stacked_params_mapping: Sequence[tuple[str, str, Any]] = ()) -> set[str]:
    """Every name ``load_named_weights`` must report for a complete checkpoint (fused parts counted separately)."""
    shards_of: dict[str, list[Any]] = {}
    for _, param_part, sid in stacked_params_mapping:
        shards_of.setdefault(param_part, []).append(sid)
    names: set[str] = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        # A fused module (``.qkv_proj``) is followed by its parameter name; a fused parameter (``.experts.w13_weight``)
        # ends the name.
        fused = next((part for part in shards_of if part + "." in name or name.endswith(part)), None)
        if fused is None:
            names.add(name)
        else:
            names.update(f"{name}#{sid}" for sid in shards_of[fused])
    return names


def describe_missing(missing: Iterable[str], stacked_params_mapping: Sequence[tuple[str, str, Any]] = ()) -> list[str]:
    """Checkpoint-style names of missing parameters (fused shards mapped back to q_proj, up_proj, ...)."""
    back = {(param_part, sid): ckpt_part for ckpt_part, param_part, sid in stacked_params_mapping}
    out = []
    for name in sorted(missing):
        if "#" in name:
            base, sid = name.split("#", 1)
            for (param_part, s), ckpt_part in back.items():
                if str(s) == sid and param_part + "." in base:
                    name = base.replace(param_part, ckpt_part)
                    break
        out.append(name)
    return out

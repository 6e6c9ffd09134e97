"""A draft LM head over a hot-token subset of the vocabulary (SGLang's ``--speculative-token-map``, FR-Spec).

A block-diffusion draft projects its rows through the target's full LM head, and on CPU that head is most
of a draft block's cost (SmolLM2: 49,152 x 576, ~9.5 of ~14.7 ms at 5 rows). Drafts only have to be
likely, not exact: the target verifies every one. So the draft may propose from the few thousand tokens
that make up almost all of a model's replies, through a head of just those rows. Output is unchanged
(greedy stays equal to plain decoding; sampling stays the target's distribution); only drafts of tokens
outside the set are lost.

The subset is read from a file of token ids (``torch.save`` of a 1-D integer tensor or a list, as
SGLang's FR-Spec maps are). Its rows are gathered from the vocabulary-parallel head once at start-up and
kept replicated on every rank, so drafting with it needs no collective (and no logits gather).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from sglite.srt.layers.cpu_gemm import PackedWeight, linear
from sglite.srt.layers.cpu_gguf_linear import GGUFWeight
from sglite.srt.layers.utils import new_weight_matrix
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead

TOKEN_MAP_FLAG = "--speculative-token-map"


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The hot token ids of a token-map file as an int64 tensor; any defect is a ValueError naming the flag."""
    where = f"{TOKEN_MAP_FLAG} {path}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file (sglite downloads nothing; pass a local .pt file of token ids)")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle that is not plain tensors/lists, a truncated file, ...
        raise ValueError(f"{where}: not a torch.save file of token ids ({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in loaded):
            raise ValueError(f"{where}: the list must hold integer token ids only")
        loaded = torch.tensor(loaded, dtype=torch.int64)
    if not isinstance(loaded, torch.Tensor) or loaded.dim() != 1:
        raise ValueError(f"{where}: expected a 1-D tensor or list of token ids, got {type(loaded).__name__}")
    if loaded.dtype.is_floating_point or loaded.dtype.is_complex or loaded.dtype == torch.bool:
        raise ValueError(f"{where}: token ids must be integers, got {loaded.dtype}")
    ids = loaded.to(torch.int64)
    if ids.numel() == 0:
        raise ValueError(f"{where}: the token map is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}) (the target's vocabulary), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{where}: token ids repeat")
    return ids


class HotVocabHead(nn.Module):
    """The rows ``token_ids`` of a (vocabulary-parallel) LM head, replicated; logits over those ids only.

    Invariant: ``forward(h)[:, i]`` equals the full head's logit of token ``token_ids[i]``.
    """

    def __init__(self, lm_head: ParallelLMHead, token_ids: torch.Tensor) -> None:
        super().__init__()
        weight = lm_head.weight
        ids = token_ids.to(device=weight.device, dtype=torch.int64)
        start, end = lm_head.vocab_start_index, lm_head.vocab_end_index
        # Rows of other ranks' shards contribute zeros (a clamped gather, masked: no data-dependent shapes).
        local = ((ids >= start) & (ids < end)).to(weight.dtype)
        shard_rows = (ids - start).clamp(0, weight.shape[0] - 1)
        rows = weight.index_select(0, shard_rows) * local[:, None]
        bias = lm_head.bias.index_select(0, shard_rows) * local if lm_head.bias is not None else None
        if lm_head.tp_size > 1:  # every rank contributes the rows of its vocabulary shard
            rows = lm_head.tp_group.all_reduce(rows)
            bias = lm_head.tp_group.all_reduce(bias) if bias is not None else None
        with torch.device(weight.device):
            self.weight = nn.Parameter(new_weight_matrix(ids.numel(), lm_head.embedding_dim, weight.dtype), requires_grad=False)
        self.weight.data.copy_(rows)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.register_buffer("token_ids", ids, persistent=False)
        # A head read from GGUF blocks (cpu_gemm): the same rows of them, which dequantize to exactly these weights.
        gguf: Optional[GGUFWeight] = getattr(lm_head, "gguf_weight", None)
        if gguf is not None and lm_head.tp_size == 1:
            self.gguf_weight = GGUFWeight(gguf.blocks.index_select(0, ids.cpu()).contiguous(), gguf.ggml_type, gguf.in_features)
        # cpu_gemm.pack_weights_for_cpu fills this (a module with the slot opts in).
        self.packed_weight: Optional[PackedWeight] = None

    @property
    def num_tokens(self) -> int:
        """How many token ids the head scores."""
        return int(self.token_ids.numel())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, num_tokens]``: column i is token ``token_ids[i]``."""
        return linear(hidden.to(self.weight.dtype), self.weight, self.bias, self.packed_weight).float()

    def to_vocab_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of column indices (argmax over this head's logits)."""
        return self.token_ids[index]

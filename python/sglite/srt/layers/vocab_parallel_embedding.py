"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocabulary.

The vocabulary is padded to ``tp_size * ceil(vocab / tp_size)`` rows; padding rows are zero and the
logits processor trims the gathered logits back to ``vocab_size``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.cpu_gemm import PackedWeight
from sglite.srt.layers.utils import bind_tp_group, check_full_shape, column_major_weights, new_weight_matrix


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over the TP group; lookups are all-reduced."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: Optional[torch.dtype] = None,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:
        super().__init__()
        bind_tp_group(self, tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype or torch.get_default_dtype()
            ),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        """Copy this rank's vocabulary rows; padding rows become zero."""
        check_full_shape(loaded, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        self._copy_vocab_rows(param, loaded)

    def _copy_vocab_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows (dim 0) of a shape-checked full tensor; padding rows become zero."""
        n = self.vocab_end_index - self.vocab_start_index
        param.data.zero_()
        param.data[:n].copy_(loaded[self.vocab_start_index : self.vocab_end_index])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` (each rank looks up its own ids, the rest are summed in)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start_index, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight)
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary-sharded like the embedding; applied by the LogitsProcessor."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        tp_group: Optional[GroupCoordinator] = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, tp_group)
        if column_major_weights():
            # Applied with F.linear, never looked up: take the layout linear layers use (utils.new_weight_matrix).
            self.weight = nn.Parameter(
                new_weight_matrix(self.num_embeddings_per_partition, embedding_dim, self.weight.dtype),
                requires_grad=False,
            )
            self.weight.weight_loader = self.weight_loader
        # cpu_gemm.pack_weights_for_cpu fills this after loading (never for a weight tied to the embedding).
        self.packed_weight: Optional[PackedWeight] = None
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype), requires_grad=False
            )
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        check_full_shape(loaded, (self.num_embeddings,), "ParallelLMHead bias")
        self._copy_vocab_rows(param, loaded)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie lm_head {tuple(self.weight.shape)} to embedding {tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # noqa: D401 - not a module to call
        """Not callable: logits come from LogitsProcessor (which also gathers the vocab shards)."""
        raise TypeError("ParallelLMHead is applied by LogitsProcessor, not called directly")

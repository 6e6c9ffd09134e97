"""Vocab-parallel embedding / LM head shards and the logits processor's row selection."""

import pytest
import torch
import torch.nn.functional as F

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.logits_processor import LogitsProcessor
from sglite.srt.layers.utils import WeightShapeError
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglite.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

SUITE = "unit-cpu"
EST_TIME = 2


def group(rank: int, size: int) -> GroupCoordinator:
    return GroupCoordinator(list(range(size)), rank, "tp", device_group=None if size == 1 else object())


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_embedding_shards_cover_the_vocab_once(tp):
    vocab, dim = 10, 4
    w = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 9, 3, 5, 5, 1])
    total = torch.zeros(len(ids), dim)
    for r in range(tp):
        emb = VocabParallelEmbedding(vocab, dim, params_dtype=torch.float32, tp_group=group(r, tp))
        emb.weight_loader(emb.weight, w)
        assert emb.weight.shape[0] == -(-vocab // tp)
        # What one rank contributes before the all-reduce (its forward minus the collective).
        in_shard = (ids >= emb.vocab_start_index) & (ids < emb.vocab_end_index)
        local = F.embedding(torch.where(in_shard, ids - emb.vocab_start_index, 0), emb.weight) * in_shard[:, None]
        total += local
    torch.testing.assert_close(total, w[ids], rtol=0, atol=0)


def test_embedding_shape_error():
    emb = VocabParallelEmbedding(10, 4, params_dtype=torch.float32, tp_group=group(0, 1))
    with pytest.raises(WeightShapeError, match=r"\(11, 4\)"):
        emb.weight_loader(emb.weight, torch.zeros(11, 4))


def _batch(mode, extend_lens):
    t = sum(extend_lens)
    lens = torch.tensor(extend_lens)
    return ForwardBatch(
        forward_mode=mode, batch_size=len(extend_lens), input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.zeros(t, dtype=torch.long), req_pool_indices=torch.arange(len(extend_lens)),
        seq_lens=lens, extend_prefix_lens=torch.zeros_like(lens), extend_seq_lens=lens,
        out_cache_loc=torch.zeros(t, dtype=torch.long), seq_lens_cpu=list(extend_lens),
        extend_prefix_lens_cpu=[0] * len(extend_lens), extend_seq_lens_cpu=list(extend_lens),
    )


def test_logits_rows_per_mode_and_tied_head():
    vocab, dim = 12, 6
    g = group(0, 1)
    emb = VocabParallelEmbedding(vocab, dim, params_dtype=torch.float32, tp_group=g)
    emb.weight_loader(emb.weight, torch.randn(vocab, dim))
    head = ParallelLMHead(vocab, dim, params_dtype=torch.float32, tp_group=g)
    head.tie_to(emb)
    assert head.weight is emb.weight
    proc = LogitsProcessor(vocab, tp_group=g)
    hidden = torch.randn(7, dim)
    full = hidden @ emb.weight.t()
    out = proc(hidden, head, _batch(ForwardMode.EXTEND, [3, 4]))
    torch.testing.assert_close(out.next_token_logits, full[[2, 6]])
    out = proc(hidden, head, _batch(ForwardMode.TARGET_VERIFY, [7]))
    torch.testing.assert_close(out.next_token_logits, full)
    out = proc(hidden[:2], head, _batch(ForwardMode.DECODE, [1, 1]))
    torch.testing.assert_close(out.next_token_logits, full[:2])
    assert out.next_token_logits.dtype == torch.float32
    with pytest.raises(TypeError):
        head(torch.tensor([1]))

"""The hot-token draft head (--speculative-token-map): the token-map file's checks, and logits equal to the
full head's columns of the mapped ids, on one rank and gathered from vocabulary shards."""

import pytest
import torch

from sglite.srt.distributed.parallel_state import GroupCoordinator
from sglite.srt.layers.cpu_gemm import PackedWeight, available_pack_layouts, pack_weight
from sglite.srt.layers.hot_vocab_head import HotVocabHead, load_token_map
from sglite.srt.layers.vocab_parallel_embedding import ParallelLMHead

SUITE = "unit-cpu"
EST_TIME = 2

VOCAB, DIM = 50, 8


class ContributionGroup(GroupCoordinator):
    """A TP group whose all_reduce returns the rank's own contribution (the test sums the ranks')."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(list(range(size)), rank, "tp", device_group=object())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def head(rank=0, size=1, bias=False, seed=0):
    group = ContributionGroup(rank, size) if size > 1 else GroupCoordinator([0], 0, "tp", device_group=None)
    h = ParallelLMHead(VOCAB, DIM, bias=bias, params_dtype=torch.float32, tp_group=group)
    g = torch.Generator().manual_seed(seed)
    h.weight_loader(h.weight, torch.randn(VOCAB, DIM, generator=g))
    if bias:
        h._bias_loader(h.bias, torch.randn(VOCAB, generator=g))
    return h


def full_logits(hidden, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(VOCAB, DIM, generator=g)
    b = torch.randn(VOCAB, generator=g) if bias else torch.zeros(VOCAB)
    return hidden @ w.t() + b


@pytest.mark.parametrize("bias", [False, True])
def test_columns_are_the_full_heads_columns_of_the_mapped_ids(bias):
    ids = torch.tensor([7, 0, 49, 13, 3])
    hot = HotVocabHead(head(bias=bias), ids)
    hidden = torch.randn(4, DIM)
    torch.testing.assert_close(hot(hidden), full_logits(hidden, bias=bias)[:, ids])
    assert hot.num_tokens == 5
    assert hot.to_vocab_ids(torch.tensor([[2, 0], [4, 1]])).tolist() == [[49, 7], [3, 0]]


@pytest.mark.parametrize("layout", available_pack_layouts())
def test_a_packed_copy_gives_the_same_logits(layout):
    hot = HotVocabHead(head(), torch.arange(VOCAB - 1, -1, -1))
    hidden = torch.randn(5, DIM)
    plain = hot(hidden)
    hot.packed_weight = PackedWeight(pack_weight(hot.weight, layout))
    torch.testing.assert_close(hot(hidden), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 3])
def test_each_rank_contributes_its_shards_rows_and_they_sum_to_the_full_rows(tp):
    ids = torch.tensor([48, 1, 25, 17, 33, 9, 40])
    rows = sum(HotVocabHead(head(r, tp, bias=True), ids).weight.detach() for r in range(tp))
    biases = sum(HotVocabHead(head(r, tp, bias=True), ids).bias.detach() for r in range(tp))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(VOCAB, DIM, generator=g), torch.randn(VOCAB, generator=g)
    torch.testing.assert_close(rows, w[ids], rtol=0, atol=0)
    torch.testing.assert_close(biases, b[ids], rtol=0, atol=0)


def test_token_map_files_load_as_int64_ids(tmp_path):
    for obj in (torch.tensor([5, 1, 9], dtype=torch.int32), [5, 1, 9]):
        path = tmp_path / "map.pt"
        torch.save(obj, path)
        ids = load_token_map(str(path), VOCAB)
        assert ids.dtype == torch.int64 and ids.tolist() == [5, 1, 9]


@pytest.mark.parametrize(
    "obj, message",
    [
        (torch.tensor([1.0, 2.0]), "must be integers"),
        (torch.tensor([[1, 2]]), "1-D"),
        (torch.tensor([], dtype=torch.int64), "empty"),
        (torch.tensor([3, VOCAB]), r"\[0, 50\)"),
        (torch.tensor([-1, 3]), r"\[0, 50\)"),
        (torch.tensor([4, 2, 4]), "repeat"),
        ([1, True], "integer token ids only"),
        ({"ids": [1]}, "1-D tensor or list"),
    ],
)
def test_a_bad_token_map_is_an_error_naming_the_flag(tmp_path, obj, message):
    path = tmp_path / "map.pt"
    torch.save(obj, path)
    with pytest.raises(ValueError, match=message) as err:
        load_token_map(str(path), VOCAB)
    assert str(err.value).startswith(f"--speculative-token-map {path}")


def test_missing_or_foreign_files_are_errors_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--speculative-token-map .*no such file"):
        load_token_map(str(tmp_path / "absent.pt"), VOCAB)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="--speculative-token-map .*not a torch.save file"):
        load_token_map(str(junk), VOCAB)


def test_a_head_read_from_gguf_blocks_gives_the_hot_rows_blocks():
    """The hot head of a GGUF target reads the same rows of the file's blocks, which dequantize to its weight."""
    import gguf

    from sglite.srt.layers.cpu_gguf_linear import gguf_dequantize, gguf_kernel_available, gguf_weight_from_rows

    if not gguf_kernel_available():
        pytest.skip("the GGUF kernel is not built here")
    full = ParallelLMHead(VOCAB, 64, params_dtype=torch.float32, tp_group=GroupCoordinator([0], 0, "tp", device_group=None))
    blocks = gguf.quants.quantize(torch.randn(VOCAB, 64).numpy(), gguf.GGMLQuantizationType.Q8_0)
    full.weight_loader(full.weight, torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
    full.gguf_weight = gguf_weight_from_rows(torch.from_numpy(blocks.copy()), int(gguf.GGMLQuantizationType.Q8_0), 64)
    hot = HotVocabHead(full, torch.tensor([7, 0, 42, 3]))
    assert hot.gguf_weight.out_features == 4 and torch.equal(gguf_dequantize(hot.gguf_weight), hot.weight)
    assert not hasattr(HotVocabHead(head(), torch.tensor([1, 2])), "gguf_weight")  # an fp32 head: none

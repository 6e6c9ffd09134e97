"""Sampler: greedy, temperature, top-k, top-p, min-p on a fixed distribution; seeded reproducibility."""

import math

import pytest
import torch

from sglite.srt.layers.sampler import Sampler
from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.srt.sampling.sampling_params import SamplingParams

SUITE = "unit-cpu"
EST_TIME = 10

PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
LOGITS = PROBS.log()
V = PROBS.numel()
N = 40000


def draw(params: SamplingParams, n: int = N, seed: int = 0) -> torch.Tensor:
    info = SamplingBatchInfo.from_sampling_params([params] * n, V)
    return Sampler(seed=seed)(LOGITS.expand(n, V).clone(), info)


def freqs(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def assert_matches(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Every token's frequency within 5 standard errors of its expected probability; zeros never drawn."""
    f = freqs(tokens)
    expected = expected.double() / expected.sum()
    se = torch.sqrt(expected * (1 - expected) / tokens.numel()).clamp_min(1e-12)
    assert torch.all(f[expected == 0] == 0), f"filtered tokens drawn: {f}"
    z = ((f - expected).abs() / se)[expected > 0]
    assert z.max() < 5, f"frequencies {f.tolist()} vs expected {expected.tolist()}"


def test_greedy_is_argmax_for_temperature_zero_and_top_k_one():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1)):
        info = SamplingBatchInfo.from_sampling_params([p] * 6, 50)
        assert info.all_greedy
        assert torch.equal(Sampler()(logits, info), logits.argmax(-1))


def test_plain_sampling_follows_the_distribution():
    assert_matches(draw(SamplingParams(temperature=1.0)), PROBS)


def test_temperature_reshapes_the_distribution():
    t = 0.5
    assert_matches(draw(SamplingParams(temperature=t)), torch.softmax(LOGITS / t, -1))


def test_top_k_keeps_only_the_k_most_likely():
    expected = PROBS.clone()
    expected[3:] = 0
    assert_matches(draw(SamplingParams(top_k=3)), expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Cumulative mass 0.30, 0.50, 0.65, 0.77 ...: top_p 0.6 keeps the first three (0.65 >= 0.6).
    expected = PROBS.clone()
    expected[3:] = 0
    assert_matches(draw(SamplingParams(top_p=0.6)), expected)


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    # 0.35 * 0.30 = 0.105 -> keeps 0.30, 0.20, 0.15, 0.12; drops 0.10 and below.
    expected = PROBS.clone()
    expected[4:] = 0
    assert_matches(draw(SamplingParams(min_p=0.35)), expected)


def test_top_k_and_top_p_combine():
    expected = PROBS.clone()
    expected[2:] = 0  # top_k 4 then top_p 0.45 -> 0.30, 0.20
    assert_matches(draw(SamplingParams(top_k=4, top_p=0.45)), expected)


def test_seeded_rows_reproduce_independently_of_the_batch():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (10, 11, 12, 13, 14)]
    a = Sampler(seed=0)(logits, SamplingBatchInfo.from_sampling_params(params, 64, seed_offsets=[0] * 5))
    b = Sampler(seed=99)(logits, SamplingBatchInfo.from_sampling_params(params, 64, seed_offsets=[0] * 5))
    assert torch.equal(a, b)
    # Row 2 alone, with unseeded neighbours, draws the same token.
    mixed = [SamplingParams(temperature=1.0), params[2], SamplingParams(temperature=1.0)]
    rows = logits[[0, 2, 4]]
    c = Sampler(seed=5)(rows, SamplingBatchInfo.from_sampling_params(mixed, 64, seed_offsets=[0, 0, 0]))
    assert int(c[1]) == int(a[2])


def test_seeded_draws_vary_with_the_step_and_follow_the_distribution():
    p = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler()
    tokens = []
    for step in range(2000):
        info = SamplingBatchInfo.from_sampling_params([p], V, seed_offsets=[step])
        tokens.append(int(sampler(LOGITS[None], info)))
    assert_matches(torch.tensor(tokens), PROBS)
    again = [int(sampler(LOGITS[None], SamplingBatchInfo.from_sampling_params([p], V, seed_offsets=[s]))) for s in range(50)]
    assert again == tokens[:50]


def test_unseeded_sampler_is_reproducible_from_its_seed():
    assert torch.equal(draw(SamplingParams(), 500, seed=3), draw(SamplingParams(), 500, seed=3))
    assert not torch.equal(draw(SamplingParams(), 500, seed=3), draw(SamplingParams(), 500, seed=4))


def test_mixed_greedy_and_sampled_rows():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)]
    logits = torch.stack([LOGITS, LOGITS])
    info = SamplingBatchInfo.from_sampling_params(params, V)
    for _ in range(50):
        out = Sampler()(logits, info)
        assert int(out[0]) == 0 and int(out[1]) in (0, 1)


def test_seed_without_offsets_is_an_error():
    with pytest.raises(ValueError, match="seed_offsets"):
        SamplingBatchInfo.from_sampling_params([SamplingParams(seed=1)], V)


def test_repeat_interleave_for_verify_rows():
    info = SamplingBatchInfo.from_sampling_params(
        [SamplingParams(top_k=2, seed=5), SamplingParams(temperature=0.0)], V, seed_offsets=[7, 0]
    )
    rep = info.repeat_interleave(3)
    assert rep.batch_size == 6
    assert rep.top_ks.tolist() == [2, 2, 2, V, V, V]
    assert rep.seed_offsets == [7, 8, 9, 0, 1, 2]
    assert rep.is_greedy.tolist() == [False] * 3 + [True] * 3


def test_top_p_one_rows_keep_the_whole_vocab_next_to_top_p_rows():
    """A float cumsum over a big vocab overshoots 1.0; a top_p=1 row must still keep every token."""
    probs = torch.softmax(torch.randn(2, 150000, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    info = SamplingBatchInfo.from_sampling_params([SamplingParams(top_p=1.0), SamplingParams(top_p=0.9)], 150000)
    assert info.need_top_p
    kept, _ = Sampler().filtered_probs(probs, info)
    assert int((kept[0] > 0).sum()) == int((probs[0] > 0).sum())
    assert int((kept[1] > 0).sum()) < int((probs[1] > 0).sum())


def test_greedy_ties_pick_the_first_index_like_argmax():
    """row_argmax (max().indices, faster on CPU) keeps torch.argmax's first-index rule on ties."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (64, 40), generator=gen).float()  # many tied maxima per row
    info = SamplingBatchInfo.from_sampling_params([SamplingParams(temperature=0.0)] * 64, 40)
    assert torch.equal(Sampler()(logits, info), torch.argmax(logits, dim=-1))


EXTREME_TEMPERATURES = (0.0, 1e-39, 1e-7, 9.99e-7, 1e-6, 1e-3, 1.0, 100.0, 1e30, 3e38)


def test_temperature_below_sampling_eps_is_greedy():
    """SGLang's _SAMPLING_EPS (1e-6): temperature 1e-39 once overflowed logits / t to inf, then NaN."""
    from sglite.srt.sampling.sampling_params import SAMPLING_EPS

    assert SAMPLING_EPS == 1e-6
    for t in (1e-39, 1e-7, 9.99e-7):
        assert SamplingParams(temperature=t).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy


def test_every_accepted_parameter_gives_finite_probabilities_and_valid_tokens():
    """Any temperature / top_p / top_k / min_p in the accepted range: no NaN or inf reaches a draw."""
    from sglite.srt.speculative.dflash_utils import sampling_verify, verify_probs

    vocab = 64
    gen = torch.Generator().manual_seed(0)
    # Large-magnitude logits with ties: the worst case for logits / t and for top-p/min-p cut-offs.
    logits = torch.cat([torch.randn(3, vocab, generator=gen) * 1e4, torch.zeros(1, vocab), torch.full((1, vocab), -3e4)])
    logits[0, :4] = logits[0].max()
    rows = logits.shape[0]
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m).verify(vocab)
        for t in EXTREME_TEMPERATURES
        for p in (1e-9, 0.5, 1.0)
        for k in (-1, 1, 2)
        for m in (0.0, 0.5, 1.0)
    ]
    sampler = Sampler(seed=0)
    for sp in params:
        info = SamplingBatchInfo.from_sampling_params([sp] * rows, vocab)
        ids = sampler(logits.clone(), info)
        assert ids.shape == (rows,) and bool(((ids >= 0) & (ids < vocab)).all()), sp
        probs = verify_probs(logits.clone(), info, sampler)
        assert bool(torch.isfinite(probs).all()), sp
        assert torch.allclose(probs.sum(-1), torch.ones(rows)), sp
        block = torch.zeros(1, rows, dtype=torch.int64)
        r = sampling_verify(block, probs[None], generator=torch.Generator().manual_seed(1))
        assert 0 <= int(r.bonus_ids[0]) < vocab

"""Block verification: greedy longest-prefix accept and lossless sampling verification."""

import torch

from sglite.srt.speculative.dflash_utils import (
    committed_tokens,
    greedy_verify,
    sampling_verify,
    verify_probs,
)
from sglite.srt.speculative.shadow_probe import shadow_committed_tokens
from sglite.srt.layers.sampler import Sampler
from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.srt.sampling.sampling_params import SamplingParams

SUITE = "unit-cpu"
EST_TIME = 10


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (upper regularised gamma), cells with expected count >= 5."""
    n = observed.sum()
    expected = expected_probs.double() * n
    keep = expected >= 5
    obs, exp = observed.double()[keep], expected[keep]
    # Fold the rare cells into one so the total still matches.
    obs = torch.cat([obs, (n - obs.sum()).reshape(1)])
    exp = torch.cat([exp, (n - exp.sum()).reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def test_greedy_verify_longest_prefix_and_bonus():
    block = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 3]])
    argmax = torch.tensor([[1, 2, 3, 9], [1, 7, 3, 9], [4, 2, 3, 9]])
    r = greedy_verify(block, argmax)
    assert r.accept_lens.tolist() == [3, 1, 0]
    assert r.bonus_ids.tolist() == [9, 7, 4]
    assert committed_tokens(block, r) == [[1, 2, 3, 9], [1, 7], [4]]


def test_greedy_verify_later_match_after_mismatch_not_accepted():
    block = torch.tensor([[0, 1, 2, 3]])
    argmax = torch.tensor([[1, 0, 3, 4]])  # draft 3 matches row 2, but draft 2 already failed
    r = greedy_verify(block, argmax)
    assert r.accept_lens.tolist() == [1]
    assert r.bonus_ids.tolist() == [0]


def test_verify_probs_filter_like_the_sampler():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0)]
    info = SamplingBatchInfo.from_sampling_params(params, vocab_size=4)
    p = verify_probs(logits, info, Sampler())
    torch.testing.assert_close(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(p[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(p[2], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_sampling_verify_is_lossless():
    """The committed first and second tokens follow the target's chain distribution exactly."""
    vocab, block, n = 6, 3, 60000
    g = torch.Generator().manual_seed(0)
    # Row 0: distribution of token 1; row 1 (given token 1 == draft d1): distribution of token 2.
    p0 = torch.softmax(torch.randn(vocab, generator=g), -1)
    p1 = torch.softmax(torch.randn(vocab, generator=g), -1)
    p2 = torch.softmax(torch.randn(vocab, generator=g), -1)
    drafts = [2, 4]
    block_ids = torch.tensor([[0] + drafts]).expand(n, -1)
    probs = torch.stack([p0, p1, p2])[None].expand(n, -1, -1)
    r = sampling_verify(block_ids, probs, generator=torch.Generator().manual_seed(1))
    toks = committed_tokens(block_ids[:1].expand(n, -1), r)
    first = torch.tensor([t[0] for t in toks])
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab), p0) > 1e-3
    # Given the first committed token equals d1, the second follows row 1 exactly.
    second = torch.tensor([t[1] for t in toks if t[0] == drafts[0]])
    assert chi_square_pvalue(torch.bincount(second, minlength=vocab), p1) > 1e-3
    assert set(r.accept_lens.tolist()) == {0, 1, 2}


def test_shadow_scores_are_what_a_verify_would_commit():
    """Drafts [5, 6, 7] against the tokens the target produced without them: the matching prefix plus the bonus,
    never past a stop; None while the verdict needs tokens not produced yet."""
    drafts = [5, 6, 7]
    cases = [
        ([9], False, 1),  # the first draft is wrong: the bonus only
        ([5, 9], False, 2),
        ([5, 6, 7], False, 4),  # every draft right: a verify adds its bonus, whatever comes next
        ([5, 6, 7, 8], True, 4),
        ([5, 6, 7], True, 3),  # the request stopped after the third token: a verify would stop there too
        ([5], True, 1),
        ([5, 6], True, 2),
        ([5], False, None),  # the second draft is not judged yet
        ([], False, None),
    ]
    for produced, done, want in cases:
        assert shadow_committed_tokens(drafts, produced, done) == want, (produced, done)

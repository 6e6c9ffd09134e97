"""Penalties, logit_bias and min_new_tokens against transformers' logits processors (and OpenAI's
frequency/presence formula by hand); a verify block's rows equal plain decoding's state after the drafts."""

import pytest
import torch

from sglite.srt.sampling.penaltylib import TokenHistory
from sglite.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglite.srt.sampling.sampling_params import SamplingParams, SamplingParamsError
from sglite.testing.penalty_reference import processed_reference_logits

SUITE = "unit-cpu"
EST_TIME = 5

V = 50
EOS = 3


def reference(logits, prompt, output, p: SamplingParams):
    return processed_reference_logits(logits, prompt, output, p, eos_ids=[EOS])


CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
    SamplingParams(logit_bias={"7": 5.0, "11": -100.0}),
    SamplingParams(min_new_tokens=9, stop_token_ids=[5]),
    SamplingParams(min_new_tokens=2, stop_token_ids=[5]),  # already reached: nothing masked
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={"1": 2.5}, min_new_tokens=9),
    SamplingParams(),  # neutral row: bit-identical
]


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in CASES]
    outputs = [torch.randint(0, V, (4,), generator=g).tolist() for _ in CASES]
    logits = torch.randn(len(CASES), V, generator=g) * 3
    return prompts, outputs, logits


def test_each_option_equals_transformers_processors():
    prompts, outputs, logits = _rows()
    params = [p.verify(V) for p in CASES]
    hist = [TokenHistory(p, o, (EOS,)) for p, o in zip(prompts, outputs)]
    info = SamplingBatchInfo.from_sampling_params(params, V, histories=hist)
    got = info.process_logits(logits)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], reference(logits[i], prompts[i], outputs[i], p), rtol=0, atol=1e-6, msg=f"case {i}")
    assert torch.equal(got[-1], logits[-1])
    assert not torch.equal(got[0], logits[0])


def test_verify_block_rows_equal_state_after_the_drafts():
    """Row j of a block [c, d1..d_{B-1}] is processed with d1..dj appended to the output (c is already in it)."""
    prompts, outputs, logits = _rows(1)
    params = [p.verify(V) for p in CASES]
    B = 4
    g = torch.Generator().manual_seed(2)
    block = torch.randint(0, V, (len(CASES), B), generator=g)
    block[:, 1] = block[:, 2]  # a repeated draft inside the block
    block[:, 0] = torch.tensor([o[-1] for o in outputs])
    hist = [TokenHistory(p, o, (EOS,)) for p, o in zip(prompts, outputs)]
    info = SamplingBatchInfo.from_sampling_params(params, V, histories=hist, seed_offsets=[4] * len(CASES))
    rows = torch.randn(len(CASES) * B, V, generator=g) * 3
    got = info.repeat_interleave(B, block).process_logits(rows)
    for i, p in enumerate(params):
        for j in range(B):
            out = outputs[i] + block[i, 1 : j + 1].tolist()
            torch.testing.assert_close(got[i * B + j], reference(rows[i * B + j], prompts[i], out, p), rtol=0, atol=1e-6)


def test_repeat_without_block_ids_is_refused():
    info = SamplingBatchInfo.from_sampling_params([SamplingParams(presence_penalty=1.0)], V, histories=[TokenHistory([1], [])])
    with pytest.raises(ValueError, match="block"):
        info.repeat_interleave(3)
    with pytest.raises(ValueError, match="token history"):
        SamplingBatchInfo.from_sampling_params([SamplingParams(presence_penalty=1.0)], V)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_new_tokens": 200}, "min_new_tokens"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 101.0}}, "logit_bias"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(SamplingParamsError, match=f"^{field}"):
        SamplingParams(**kw).verify(V)


def test_logit_bias_keys_normalised_and_n_allowed():
    p = SamplingParams(logit_bias={5: 1.0, "6": -2}, n=4).verify(V)
    assert p.logit_bias == {"5": 1.0, "6": -2.0} and p.needs_logits_processing
    assert not SamplingParams().verify(V).needs_logits_processing

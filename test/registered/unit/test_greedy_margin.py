"""sglite.testing.greedy_margin: the near-tie guard in front of exact greedy token comparisons."""

import pytest
import torch

from sglite.testing.greedy_margin import MIN_GREEDY_MARGIN, assert_clear_greedy_margins, greedy_margins
from sglite.testing.tiny_models import build_tiny_model, load_hf_model

SUITE = "unit-cpu"
EST_TIME = 5

PROMPT = [5, 17, 300, 41]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    torch.set_num_threads(1)
    d = build_tiny_model(str(tmp_path_factory.mktemp("m")), "qwen3", seed=7, with_tokenizer=False, eos_token_id=None)
    return load_hf_model(d)


def _greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]


def test_margins_equal_generate_scores(hf):
    ids, scores = _greedy(hf, PROMPT, 8)
    top2 = scores.topk(2, dim=-1).values
    # Teacher forcing in one forward vs cached decoding: same logits up to fp32 rounding.
    torch.testing.assert_close(greedy_margins(hf, PROMPT, ids), top2[:, 0] - top2[:, 1], atol=1e-4, rtol=0)
    assert_clear_greedy_margins(hf, [PROMPT], [ids])


def test_a_non_greedy_continuation_is_reported(hf):
    ids, scores = _greedy(hf, PROMPT, 4)
    second = int(scores[2].topk(2).indices[1])
    with pytest.raises(AssertionError, match="step 2 .* not the reference's greedy output"):
        greedy_margins(hf, PROMPT, ids[:2] + [second])


def test_an_exact_tie_is_refused(hf):
    ids, _ = _greedy(hf, PROMPT, 4)
    # Copy the step-1 winner's LM-head row onto another token: their logits tie exactly at every step.
    head = hf.get_output_embeddings().weight
    other = (ids[1] + 1) % head.shape[0]
    saved = head.data[other].clone()
    try:
        head.data[other] = head.data[ids[1]]
        with pytest.raises(AssertionError, match=r"prompt 0: .* margin at step \d+ is 0 < "):
            assert_clear_greedy_margins(hf, [PROMPT], [ids])
    finally:
        head.data[other] = saved
    assert MIN_GREEDY_MARGIN > 0

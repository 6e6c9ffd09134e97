"""SamplingParams.verify: the one rule set every route and the offline Engine share (types and ranges)."""

import pytest

from sglite.srt.sampling.sampling_params import MAX_STOP_STRINGS, SamplingParams, SamplingParamsError

SUITE = "unit-cpu"
EST_TIME = 1


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": True}, "temperature"),
        ({"top_k": 2.0}, "top_k"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": ["a", 5]}, "stop"),
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_verify_names_the_bad_field(params, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict(params).verify(vocab_size=100)
    assert str(info.value).startswith(field + " ")


def test_verify_accepts_the_limits():
    sp = SamplingParams.from_dict({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)], "skip_special_tokens": False,
                                   "ignore_eos": True, "seed": 2**63 - 1, "temperature": 0})
    assert sp.verify(vocab_size=100) is sp

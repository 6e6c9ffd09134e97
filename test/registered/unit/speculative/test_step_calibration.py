"""step_calibration: which batch sizes are timed, and how the timed steps reach the cost model (no model runs)."""

from types import SimpleNamespace

import pytest
import torch

from sglite.srt.speculative.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation, bucket_of
from sglite.srt.speculative.step_calibration import (
    CALIBRATION_KEYS,
    calibrate_step_costs,
    calibration_batch_size,
    calibration_batch_sizes,
    dummy_decode_batch,
)

SUITE = "unit-cpu"
EST_TIME = 1


def test_each_bucket_is_timed_inside_it_at_about_three_quarters_of_its_top():
    assert [calibration_batch_size(1 << i) for i in range(7)] == [1, 2, 3, 6, 12, 24, 48]
    for i in range(12):
        k = 1 << i
        assert bucket_of(calibration_batch_size(k)) == k


def test_the_timed_batch_sizes_stop_at_what_the_server_runs_and_the_bound():
    assert calibration_batch_sizes(16, 32) == [1, 2, 3, 6, 12]
    assert calibration_batch_sizes(256, 32) == [1, 2, 3, 6, 12, 24]
    assert calibration_batch_sizes(5, 32) == [1, 2, 3, 5]  # bucket 8 at the server's top, 5
    assert calibration_batch_sizes(1, 32) == [1]
    assert calibration_batch_sizes(64, 0) == []  # calibration off


def fake_worker(context_len=4096, width=3):
    return SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=object(), token_to_kv_pool_allocator=object(),
                           num_decode_tokens_per_req=width, context_len=context_len)


def test_a_dummy_batch_sits_on_the_padding_row_and_slot():
    batch = dummy_decode_batch(fake_worker(), 4, 3, 128)
    assert batch.batch_size == 4 and not batch.is_prefill and batch.extend_lens == [3] * 4
    assert batch.req_pool_indices == [0] * 4 and batch.prefix_lens == [128] * 4
    assert torch.equal(batch.out_cache_loc, torch.zeros(12, dtype=torch.int64))
    assert all(r.sampling_params.temperature == 0.0 and not r.return_logprob for r in batch.reqs)


def test_timed_steps_reach_the_policy_after_a_cold_one_with_the_flush_outside_the_drafted_step(monkeypatch):
    import sglite.srt.speculative.step_calibration as step_calibration

    calls = []
    seconds = {True: [9.0, 0.30, 0.32, 0.31], False: [9.0, 0.10, 0.11, 0.10]}  # the first of each kind is cold

    def decode(batch, drafted):
        calls.append(("decode", batch.batch_size, batch.extend_lens[0], drafted))
        return seconds[drafted].pop(0)

    # A step's "seconds" are what the fake decode returns: the flush runs before it, outside them.
    monkeypatch.setattr(step_calibration, "_step_seconds", lambda dec, batch, drafted: dec(batch, drafted))
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(), max_tokens_per_step=3)
    recorded = []
    monkeypatch.setattr(policy, "calibrate", lambda bs, d, p: recorded.append((bs, list(d), list(p))))
    calibrate_step_costs(policy, fake_worker(), decode, lambda: calls.append(("flush",)), [6], reps=3)
    assert recorded == [(6, [0.30, 0.32, 0.31], [0.10, 0.11, 0.10])]
    # Each drafted step is preceded by a flush, and a last one leaves no deferred rows behind.
    assert calls[:3] == [("flush",), ("decode", 6, 3, True), ("decode", 6, 1, False)]
    assert calls[-1] == ("flush",) and calls.count(("flush",)) == 4 + 1


def test_the_context_fits_a_short_context_length():
    captured = []
    policy = AdaptiveSpeculation(AdaptiveSpecConfig())
    decode = lambda batch, drafted: captured.append(batch.prefix_lens[0])  # noqa: E731
    calibrate_step_costs(policy, fake_worker(context_len=64, width=3), decode, lambda: None, [1], reps=1)
    assert set(captured) == {61} and 61 < CALIBRATION_KEYS
    assert policy.buckets[1].warm()
    with pytest.raises(ValueError, match="reps"):
        calibrate_step_costs(policy, fake_worker(), decode, lambda: None, [1], reps=0)

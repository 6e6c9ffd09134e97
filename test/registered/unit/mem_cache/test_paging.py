"""mem_cache/paging: page rounding, and the one admission formula that the tokenizer manager and the
scheduler both apply (a request the front end admits is one the scheduler can hold, and vice versa)."""

import pytest

from sglite.srt.managers.io_struct import GenerateReqInput, PortArgs, SchedulerReady, TokenizedGenerateReqInput
from sglite.srt.managers.scheduler import Scheduler
from sglite.srt.managers.tokenizer_manager import RequestValidationError, TokenizerManager
from sglite.srt.mem_cache.paging import (
    ceil_div,
    floor_to_page,
    pages_needed,
    request_kv_slots,
    round_up_to_page,
)
from sglite.srt.sampling.sampling_params import SamplingParams
from sglite.srt.server_args import ServerArgs
from sglite.testing.fake_model_worker import FakeModelWorker

SUITE = "unit-cpu"
EST_TIME = 3


def test_rounding():
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [round_up_to_page(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [floor_to_page(n, 4) for n in (-3, 0, 3, 4, 7)] == [0, 0, 0, 4, 4]
    assert pages_needed(3, 5, 4) == 4  # 1 slot left in the page of position 3, 4 more in a fresh page
    assert pages_needed(0, 0, 4) == 0


def test_request_kv_slots():
    # The last decode step holds prompt + max_new - 1 tokens plus its block of slots.
    assert request_kv_slots(10, 5, 1) == 15
    assert request_kv_slots(10, 5, 4) == 16
    assert request_kv_slots(10, 5, 1, decode_tokens_per_step=4) == 18
    assert request_kv_slots(10, 5, 4, decode_tokens_per_step=4, prefill_only=True) == 12


@pytest.mark.parametrize("page,block", [(1, 1), (4, 1), (1, 4), (4, 4)])
def test_front_end_and_scheduler_admit_the_same_requests(page, block):
    """At the boundary need == capacity both admit; one token more and both refuse."""
    capacity, context = 64, 256
    worker = FakeModelWorker(max_total_num_tokens=capacity, page_size=page, block_size=block, context_len=context)
    sched = Scheduler(ServerArgs(model_path="x", page_size=page), worker)
    pa = PortArgs.create()
    info = SchedulerReady(max_total_num_tokens=sched.initial_free_slots, max_running_requests=8, context_len=context,
                          vocab_size=512, num_decode_tokens_per_req=block)
    tm = TokenizerManager(ServerArgs(model_path="x", page_size=page), pa, None, info)  # token ids in: no tokenizer
    try:
        prompt = 10
        fits = max(m for m in range(1, capacity) if request_kv_slots(prompt, m, page, block) <= sched.initial_free_slots)
        for max_new, admitted in ((fits, True), (fits + 1, False)):
            if not admitted:
                assert request_kv_slots(prompt, max_new, page, block) > sched.initial_free_slots
            obj = GenerateReqInput(input_ids=[5] * prompt, sampling_params={"max_new_tokens": max_new})
            if admitted:
                tm.tokenize_request(obj)
            else:
                with pytest.raises(RequestValidationError, match="KV pool"):
                    tm.tokenize_request(obj)
            sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
            sched.add_request(TokenizedGenerateReqInput(rid=f"r{max_new}", input_text=None, input_ids=[5] * prompt,
                                                        sampling_params=sp))
            rejected = [r for r in sched._touched.values() if r.finished]
            assert bool(rejected) == (not admitted)
            sched.run_until_idle()
    finally:
        tm.close()

"""TokenizerManager without a scheduler: validation/tokenization, output assembly, and abort-on-cancel.

A PULL socket stands in for the scheduler's input so the messages the manager sends are observed.
"""

import asyncio

import pytest
import zmq

from sglite.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenizedGenerateReqInput,
    GenerateReqInput,
    PortArgs,
    SchedulerReady,
    TokenizedGenerateReqInput,
    finish_length,
    finish_stop,
)
from sglite.srt.managers.tokenizer_manager import (
    DEFAULT_MAX_NEW_TOKENS,
    RequestValidationError,
    TokenizerManager,
)
from sglite.srt.mem_cache.paging import request_kv_slots
from sglite.srt.server_args import ServerArgs

SUITE = "unit-cpu"
EST_TIME = 4

CONTEXT = 64
CAPACITY = 50


@pytest.fixture
def tm_and_sched(tiny_tokenizer):
    pa = PortArgs.create()
    info = SchedulerReady(max_total_num_tokens=CAPACITY, max_running_requests=8, context_len=CONTEXT, vocab_size=512)
    tm = TokenizerManager(ServerArgs(model_path="x"), pa, tiny_tokenizer, info)
    ctx = zmq.Context()
    sched = ctx.socket(zmq.PULL)
    sched.bind(pa.scheduler_input_ipc_name)
    yield tm, sched
    tm.close()
    ctx.destroy(linger=0)


def recv_all(sock, timeout_ms=500):
    out = []
    while sock.poll(timeout_ms):
        out.append(sock.recv_pyobj())
        timeout_ms = 50
    return out


def test_tokenize_text_and_defaults(tm_and_sched, tiny_tokenizer):
    tm, _ = tm_and_sched
    [t] = tm.tokenize_request(GenerateReqInput(text="hello world"))
    assert t.input_ids == tiny_tokenizer.encode("hello world") and t.input_text == "hello world"
    room = min(CONTEXT, CAPACITY) - len(t.input_ids)
    assert t.sampling_params.max_new_tokens == min(DEFAULT_MAX_NEW_TOKENS, room)
    [f] = tm.tokenize_request(GenerateReqInput(input_ids=[5, 6]), fill_context=True)
    assert f.sampling_params.max_new_tokens == min(CONTEXT, CAPACITY) - 2
    [e] = tm.tokenize_request(GenerateReqInput(input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "stop": "x"}))
    assert e.sampling_params.max_new_tokens == 3 and e.sampling_params.stop == ["x"]


@pytest.mark.parametrize("decode_slots", [1, 5])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_without_max_tokens_fits_the_pool_under_speculation(tiny_tokenizer, decode_slots, page_size):
    # A DFLASH step holds a block of 5 slots per request beyond its last token: the default max_new_tokens leaves
    # room for it, so a chat request with no max_tokens is served, not refused by the pool check (it was, on the
    # default pair: "needs 4061 KV slots but the server's KV pool holds 4057").
    pa = PortArgs.create()
    info = SchedulerReady(max_total_num_tokens=CAPACITY, max_running_requests=8, context_len=CONTEXT, vocab_size=512,
                          num_decode_tokens_per_req=decode_slots)
    tm = TokenizerManager(ServerArgs(model_path="x", page_size=page_size), pa, tiny_tokenizer, info)
    try:
        [f] = tm.tokenize_request(GenerateReqInput(input_ids=[5, 6, 7]), fill_context=True)
        need = request_kv_slots(3, f.sampling_params.max_new_tokens, page_size, decode_slots)
        assert need <= CAPACITY < request_kv_slots(3, f.sampling_params.max_new_tokens + 1, page_size, decode_slots)
    finally:
        tm.close()


@pytest.mark.parametrize(
    "obj, param, fragment",
    [
        (GenerateReqInput(input_ids=[5] * CONTEXT), "prompt", "longer than the model's context length"),
        (GenerateReqInput(input_ids=[5] * 10, sampling_params={"max_new_tokens": CONTEXT - 5}), "max_tokens", "exceeds"),
        (GenerateReqInput(input_ids=[5] * 10, sampling_params={"max_new_tokens": CAPACITY}), "max_tokens", "KV pool"),
        (GenerateReqInput(input_ids=[512]), "input_ids", "outside the vocabulary"),
        (GenerateReqInput(input_ids=[1], sampling_params={"top_p": 0}), "top_p", "top_p"),
        (GenerateReqInput(input_ids=[1], sampling_params={"temperature": float("nan")}), "temperature", "finite"),
        (GenerateReqInput(text=""), "prompt", "empty"),
        (GenerateReqInput(text=["a", "b"], rid=["x"]), None, "rid"),
    ],
)
def test_invalid_requests(tm_and_sched, obj, param, fragment):
    tm, _ = tm_and_sched
    with pytest.raises(RequestValidationError, match=fragment) as ei:
        tm.tokenize_request(obj)
    assert ei.value.param == param


def test_prompt_positional_error_uses_messages_for_ids(tm_and_sched):
    tm, _ = tm_and_sched
    with pytest.raises(RequestValidationError) as ei:
        tm.tokenize_request(GenerateReqInput(input_ids=[5] * CONTEXT))
    assert "64 tokens" in str(ei.value)


def test_chat_template_rendered_by_tokenizer(tm_and_sched, tiny_tokenizer):
    tm, _ = tm_and_sched
    msgs = [{"role": "user", "content": "hi"}]
    assert tm.apply_chat_template(msgs) == tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


async def test_outputs_accumulate_and_finish(tm_and_sched):
    tm, sched = tm_and_sched
    obj = GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3}, rid="r1", stream=True)
    agen = tm.generate_request(obj).__aiter__()
    first = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0.05)
    [sent] = recv_all(sched)
    assert isinstance(sent, TokenizedGenerateReqInput) and sent.rid == "r1" and sent.input_ids == [5, 6, 7]

    def out(text, ids, reason, n):
        return BatchStrOut(rids=["r1"], output_strs=[text], output_ids=[ids], finished_reasons=[reason],
                           prompt_tokens=[3], completion_tokens=[n], cached_tokens=[2], spec_verify_ct=[1])

    tm._handle_batch_str_out(out("ab", [10, 11], None, 2))
    a = await first
    assert (a["delta_text"], a["text"], a["output_ids"]) == ("ab", "ab", [10, 11])
    tm._handle_batch_str_out(out("c", [12], finish_length(3), 3))
    b = await agen.__anext__()
    assert (b["delta_text"], b["text"], b["output_ids"]) == ("c", "abc", [10, 11, 12])
    meta = b["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 3, 2)
    assert meta["spec_verify_ct"] == 1 and meta["spec_accept_length"] == 3.0
    with pytest.raises(StopAsyncIteration):
        await agen.__anext__()
    assert tm.rid_to_state == {} and recv_all(sched, 100) == []


async def test_a_stream_yields_every_step_with_tokens_and_no_empty_one(tm_and_sched):
    """A token whose text is held back (a partial UTF-8 byte) is still an output: clients time tokens by
    chunks. A wake-up with neither tokens nor text is not (the serving layer sends what it gets)."""
    tm, sched = tm_and_sched
    obj = GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}, rid="r1", stream=True)
    agen = tm.generate_request(obj).__aiter__()
    first = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0.05)
    recv_all(sched)

    def out(text, ids, reason, n):
        return BatchStrOut(rids=["r1"], output_strs=[text], output_ids=[ids], finished_reasons=[reason],
                           prompt_tokens=[3], completion_tokens=[n], cached_tokens=[0], spec_verify_ct=[0])

    tm._handle_batch_str_out(out("", [10], None, 1))
    a = await first
    assert (a["delta_text"], a["delta_output_ids"]) == ("", [10])
    second = asyncio.ensure_future(agen.__anext__())
    tm._handle_batch_str_out(out("", [], None, 1))
    await asyncio.sleep(0.05)
    assert not second.done()
    tm._handle_batch_str_out(out("é", [11], finish_length(2), 2))
    b = await second
    assert (b["delta_text"], b["delta_output_ids"], b["text"]) == ("é", [11], "é")


async def test_cancelled_request_is_aborted(tm_and_sched):
    tm, sched = tm_and_sched
    obj = GenerateReqInput(input_ids=[5], sampling_params={"max_new_tokens": 4}, rid="gone")

    async def consume():
        async for _ in tm.generate_request(obj):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    msgs = recv_all(sched)
    assert [type(m) for m in msgs] == [TokenizedGenerateReqInput, AbortReq]
    assert msgs[1].rid == "gone" and tm.num_aborted == 1 and "gone" not in tm.rid_to_state


async def test_stop_string_finish_tells_scheduler_to_stop(tm_and_sched):
    tm, sched = tm_and_sched
    obj = GenerateReqInput(input_ids=[5], sampling_params={"max_new_tokens": 4, "stop": ["x"]}, rid="s")
    task = asyncio.ensure_future(tm.generate_request(obj).__anext__())
    await asyncio.sleep(0.05)
    tm._handle_batch_str_out(BatchStrOut(rids=["s"], output_strs=["a"], output_ids=[[9]], finished_reasons=[finish_stop("x")],
                                         prompt_tokens=[1], completion_tokens=[1], cached_tokens=[0], spec_verify_ct=[0]))
    final = await task
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": "x"}
    msgs = recv_all(sched)
    assert isinstance(msgs[-1], AbortReq) and msgs[-1].rid == "s"


async def test_batch_is_validated_before_anything_is_sent(tm_and_sched):
    tm, sched = tm_and_sched
    obj = GenerateReqInput(input_ids=[[5], [5] * CONTEXT])
    with pytest.raises(RequestValidationError):
        async for _ in tm.generate_request(obj):
            pass
    assert recv_all(sched, 100) == []


async def test_a_batch_reaches_the_scheduler_as_one_message(tm_and_sched):
    # One message, so the scheduler admits the whole batch in one prefill instead of across its polls.
    tm, sched = tm_and_sched
    task = asyncio.ensure_future(tm.generate_request(GenerateReqInput(input_ids=[[5], [6, 7], [8]], rid=["a", "b", "c"])).__anext__())
    await asyncio.sleep(0.05)
    [sent] = recv_all(sched)
    assert isinstance(sent, BatchTokenizedGenerateReqInput)
    assert [(r.rid, r.input_ids) for r in sent.batch] == [("a", [5]), ("b", [6, 7]), ("c", [8])]
    assert set(tm.rid_to_state) == {"a", "b", "c"}
    task.cancel()


async def test_rid_clash_is_rejected_before_sending(tm_and_sched):
    tm, sched = tm_and_sched
    task = asyncio.ensure_future(tm.generate_request(GenerateReqInput(input_ids=[5], rid="dup")).__anext__())
    await asyncio.sleep(0.05)
    assert len(recv_all(sched)) == 1
    with pytest.raises(RequestValidationError, match="already in use"):
        tm.tokenize_request(GenerateReqInput(input_ids=[[5], [6]], rid=["new", "dup"]))
    with pytest.raises(RequestValidationError, match="already in use"):
        tm.tokenize_request(GenerateReqInput(input_ids=[[5], [6]], rid=["same", "same"]))
    assert recv_all(sched, 100) == [] and set(tm.rid_to_state) == {"dup"}
    task.cancel()


def test_return_logprob_reaches_the_scheduler_with_and_without_speculation(tm_and_sched):
    tm, _ = tm_and_sched
    [t] = tm.tokenize_request(GenerateReqInput(input_ids=[5, 6], return_logprob=True))
    assert t.return_logprob is True
    tm.server_args.speculative_algorithm = "DFLASH"  # the DFLASH worker scores every returned token too
    [spec] = tm.tokenize_request(GenerateReqInput(input_ids=[5, 6], return_logprob=True))
    assert spec.return_logprob is True
    [plain] = tm.tokenize_request(GenerateReqInput(input_ids=[5, 6]))
    assert plain.return_logprob is False


async def test_output_token_logprobs_pair_each_token(tm_and_sched):
    tm, sched = tm_and_sched
    obj = GenerateReqInput(input_ids=[5, 6], sampling_params={"max_new_tokens": 3}, rid="lp", return_logprob=True)
    agen = tm.generate_request(obj).__aiter__()
    final = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0.05)
    assert recv_all(sched)[0].return_logprob is True

    def out(ids, lps, reason, n):
        return BatchStrOut(rids=["lp"], output_strs=["x"], output_ids=[ids], finished_reasons=[reason],
                           prompt_tokens=[2], completion_tokens=[n], cached_tokens=[0], spec_verify_ct=[0],
                           output_token_logprobs=[lps])

    tm._handle_batch_str_out(out([10, 11], [-0.5, -1.25], None, 2))
    tm._handle_batch_str_out(out([12], [-2.0], finish_length(3), 3))
    meta = (await final)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 10, None], [-1.25, 11, None], [-2.0, 12, None]]

"""The completions stream over a tokenizer-manager double: one chunk per step that produced tokens."""

import asyncio
import json

from sglite.srt.entrypoints.openai.protocol import CompletionRequest
from sglite.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

SUITE = "unit-cpu"
EST_TIME = 1


class StepsTM:
    """Yields the given (delta_text, delta_output_ids, finish) steps for one choice."""

    def __init__(self, steps):
        self.steps = steps

    async def generate_request(self, obj, tokenized):
        done = 0
        for text, ids, finish in self.steps:
            done += len(ids)
            meta = {"finish_reason": finish, "prompt_tokens": 3, "completion_tokens": done, "cached_tokens": 0}
            yield {"index": 0, "delta_text": text, "delta_output_ids": ids, "meta_info": meta}


def stream(steps):
    serving = OpenAIServingCompletion(StepsTM(steps), "m")
    req = CompletionRequest(model="m", prompt="abc", stream=True, stream_options={"include_usage": True})

    async def collect():
        return [c async for c in serving.stream_chunks(req, serving.convert(req), [None])]

    return [json.loads(c[len("data: "):]) for c in asyncio.run(collect())]


def test_steps_whose_text_is_held_back_still_stream_a_chunk():
    # A partial UTF-8 byte (token 7, then 8 completes "é") and a token with no text at all (9).
    steps = [("a", [5], None), ("", [7], None), ("é", [8], None), ("", [9], None), ("b", [6], {"type": "length"})]
    chunks = stream(steps)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["text"] for c in choices] == ["a", "", "é", "", "b"]
    assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_a_shed_request_is_a_503_with_retry_after():
    from sglite.srt.entrypoints.openai.serving_base import abort_error_response
    from sglite.srt.managers.io_struct import finish_abort

    reason = finish_abort("the server's request queue is full (3 waiting, --max-queued-requests); retry later", 503)
    response = abort_error_response([{"finish_reason": reason}])
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert b"ServiceUnavailableError" in response.body and b"--max-queued-requests" in response.body
    assert abort_error_response([{"finish_reason": finish_abort("transfer failed", 500)}]).status_code == 500

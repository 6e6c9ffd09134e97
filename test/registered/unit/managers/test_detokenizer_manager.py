"""Incremental detokenization and stop strings against transformers' full decode (brute force)."""

import random

import pytest

from sglite.srt.managers.detokenizer_manager import DetokenizerManager, IncrementalDetokenizer
from sglite.srt.managers.io_struct import BatchTokenIDOut, finish_length

SUITE = "unit-cpu"
EST_TIME = 6

TEXTS = [
    "Hello world! The quick brown fox.",
    "café naïve 日本語 🙂 end",
    "def f(x):\n    return x + 1\n",
    "🙂🙂 ünïcödé ßtraße",
]


def _chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)  # speculative steps emit several tokens at once
        yield ids[i : i + n]
        i += n


def _run(detok, rid, ids, rng, stop=None, skip=True):
    text, out_ids, matched = "", [], None
    chunks = list(_chunks(ids, rng))
    for j, ch in enumerate(chunks):
        d = detok.feed(rid, ch, finished=(j == len(chunks) - 1), skip_special_tokens=skip, stop_strs=stop)
        text += d.text
        out_ids += d.ids
        if d.stop_matched is not None:
            matched = d.stop_matched
            break
    assert rid not in detok.states
    return text, out_ids, matched


def _reference_stop(tok, ids, stops):
    """First token count k whose full decode contains a stop string; text cut at the earliest one."""
    for k in range(1, len(ids) + 1):
        t = tok.decode(ids[:k], skip_special_tokens=True)
        hits = [(t.find(s), s) for s in stops if s in t]
        if hits:
            pos, s = min(hits)
            return t[:pos], ids[:k], s
    return tok.decode(ids, skip_special_tokens=True), ids, None


@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_equals_full_decode(tiny_tokenizer, seed):
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    for t in TEXTS:
        ids = tiny_tokenizer.encode(t)
        text, out_ids, matched = _run(detok, f"r{seed}", ids, rng)
        assert text == tiny_tokenizer.decode(ids) == t
        assert out_ids == ids and matched is None
    # Random token soup (broken UTF-8 included) still concatenates to the full decode.
    ids = [rng.randrange(3, 512) for _ in range(60)]
    text, _, _ = _run(detok, "soup", ids, rng)
    assert text == tiny_tokenizer.decode(ids)


def test_partial_utf8_is_held_back_until_complete(tiny_tokenizer):
    ids = tiny_tokenizer.encode("a🙂")
    assert len(ids) > 2  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tiny_tokenizer)
    seen = [detok.feed("r", [i], finished=False).text for i in ids]
    assert all("\ufffd" not in s for s in seen)
    assert "".join(seen) == "a🙂"


def test_special_tokens_skipped_or_kept(tiny_tokenizer):
    ids = tiny_tokenizer.encode("hi") + [tiny_tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert _run(detok, "a", ids, random.Random(0), skip=True)[0] == "hi"
    assert _run(detok, "b", ids, random.Random(0), skip=False)[0] == "hi<|im_end|>"


@pytest.mark.parametrize(
    "text, stops",
    [
        ("Hello world! The quick brown fox.", ["world"]),
        ("Hello world! The quick brown fox.", ["quick", "o w"]),
        ("def f(x):\n    return x + 1\n", ["\n"]),
        ("café naïve 日本語 🙂 end", ["🙂"]),
        ("café naïve 日本語 🙂 end", ["日本"]),
        ("Hello world!", ["zzz"]),
        ("aaaaab", ["aab"]),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_match_brute_force(tiny_tokenizer, text, stops, seed):
    ids = tiny_tokenizer.encode(text)
    ref_text, ref_ids, ref_matched = _reference_stop(tiny_tokenizer, ids, stops)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    got_text, got_ids, matched = _run(detok, "r", ids, random.Random(seed), stop=stops)
    assert (got_text, got_ids, matched) == (ref_text, ref_ids, ref_matched)


def test_streamed_text_never_contains_a_partial_stop(tiny_tokenizer):
    ids = tiny_tokenizer.encode("Hello world! Hello there")
    detok = IncrementalDetokenizer(tiny_tokenizer)
    sent = ""
    for i in ids:
        d = detok.feed("r", [i], finished=False, stop_strs=["Hello there"])
        sent += d.text
        if d.stop_matched:
            break
    assert d.stop_matched == "Hello there"
    assert sent == "Hello world! "


def test_manager_trims_counts_and_drops_late_outputs(tiny_tokenizer):
    mgr = DetokenizerManager.__new__(DetokenizerManager)  # no sockets needed for handle()
    mgr.detok = IncrementalDetokenizer(tiny_tokenizer)
    mgr.ended_here = set()
    ids = tiny_tokenizer.encode("one two three four")
    stop_k = len(_reference_stop(tiny_tokenizer, ids, [" three"])[1])

    def out(new_ids, total, reason=None):
        return BatchTokenIDOut(
            rids=["r"], output_ids=[new_ids], finished_reasons=[reason], prompt_tokens=[5],
            completion_tokens=[total], cached_tokens=[2], spec_verify_ct=[0],
            skip_special_tokens=[True], stop_strs=[[" three"]],
        )

    res = mgr.handle(out(ids, len(ids)))
    assert res.output_strs == ["one two"]
    assert res.finished_reasons == [{"type": "stop", "matched": " three"}]
    assert res.completion_tokens == [stop_k] and res.output_ids == [ids[:stop_k]]
    assert res.prompt_tokens == [5] and res.cached_tokens == [2]
    # The scheduler has not seen the stop yet: its later tokens are dropped, its final entry clears the rid.
    assert mgr.handle(out([7], len(ids) + 1)) is None
    assert mgr.handle(out([], len(ids) + 1, finish_length(len(ids) + 1))) is None
    assert mgr.ended_here == set() and mgr.detok.states == {}


def test_a_decode_fault_fails_that_request_only(tiny_tokenizer):
    """Regression: skip_special_tokens "no" (a TypeError in the tokenizer's decode) killed the detokenizer.

    The HTTP layer now refuses that type; the fault is injected below it. The faulty request ends with
    an internal-error abort (status 500); the other request of the same batch is decoded as before.
    """
    mgr = DetokenizerManager.__new__(DetokenizerManager)  # no sockets needed for handle()
    mgr.detok = IncrementalDetokenizer(tiny_tokenizer)
    mgr.ended_here = set()
    ids = tiny_tokenizer.encode("one two")

    def out(new_ids, reason=None):
        return BatchTokenIDOut(
            rids=["bad", "good"], output_ids=[new_ids, new_ids], finished_reasons=[reason, reason], prompt_tokens=[3, 3],
            completion_tokens=[len(ids)] * 2, cached_tokens=[0, 0], spec_verify_ct=[0, 0],
            skip_special_tokens=["no", True], stop_strs=[[], []],
        )

    res = mgr.handle(out(ids))
    assert res.rids == ["bad", "good"] and res.output_strs[0] == ""
    bad = res.finished_reasons[0]
    assert bad["type"] == "abort" and bad["status_code"] == 500 and "TypeError" in bad["message"]
    assert res.finished_reasons[1] is None and mgr.ended_here == {"bad"}
    good_text = res.output_strs[1]
    # The scheduler's later outputs for the failed rid are dropped; the other request finishes normally.
    res = mgr.handle(out([], finish_length(len(ids))))
    assert res.rids == ["good"] and good_text + res.output_strs[0] == "one two"
    assert mgr.ended_here == set() and mgr.detok.states == {}

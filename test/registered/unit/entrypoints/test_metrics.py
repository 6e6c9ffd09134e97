"""token_usage as SGLang defines it: radix-cached (evictable) slots count as free."""

import pytest

from sglite.srt.entrypoints.metrics import ServerMetrics, token_usage

SUITE = "unit-cpu"
EST_TIME = 1


def gauge_value(text: str, name: str) -> float:
    [line] = [l for l in text.splitlines() if l.startswith(f"sglite:{name}{{")]
    return float(line.rsplit(" ", 1)[1])


def test_token_usage_counts_evictable_as_free():
    # 100 slots: 30 free, 50 held only by the radix cache, 20 held by running requests.
    state = {"initial_free_slots": 100, "max_total_num_tokens": 101, "available_kv_slots": 30, "tree_cache_evictable": 50}
    assert token_usage(state) == pytest.approx(0.2)
    body, _ = ServerMetrics("tiny").render(state, num_waiting_front_end=0)
    assert gauge_value(body.decode(), "token_usage") == pytest.approx(0.2)


def test_token_usage_idle_pool_is_zero_and_missing_counts_give_none():
    assert token_usage({"initial_free_slots": 64, "available_kv_slots": 64, "tree_cache_evictable": 0}) == 0.0
    assert token_usage({"initial_free_slots": 64, "available_kv_slots": 64}) is None
    assert token_usage({}) is None


def test_spec_counters_give_the_accept_length():
    import time

    from sglite.srt.managers.tokenizer_manager import ReqState

    metrics = ServerMetrics("tiny")
    now = time.time()
    for completion, verify in ((12, 4), (9, 3), (5, 0)):  # the last request ran without speculation
        st = ReqState(rid=f"r{completion}", prompt_tokens=3, stream=False, created_time=now,
                      finished_reason={"type": "length"}, completion_tokens=completion, spec_verify_ct=verify)
        metrics.observe_finished(st)
    text = metrics.render({}, num_waiting_front_end=0)[0].decode()

    def counter(name: str) -> float:
        [line] = [l for l in text.splitlines() if l.startswith(f"sglite:{name}_total{{")]
        return float(line.rsplit(" ", 1)[1])

    assert counter("spec_verify_steps") == 7
    assert counter("spec_generation_tokens") == 21  # speculative requests only
    assert counter("spec_generation_tokens") / counter("spec_verify_steps") == pytest.approx(3.0)


def test_aborted_requests_are_counted():
    """SGLang's num_aborted_requests: every request that ends with an abort (client, refusal, fault)."""
    from types import SimpleNamespace

    from sglite.srt.entrypoints.metrics import ServerMetrics
    from sglite.srt.managers.io_struct import finish_abort, finish_length

    m = ServerMetrics("tiny")
    for reason in (finish_abort("aborted by the client"), finish_abort("internal error", status_code=500), finish_length(3)):
        m.observe_finished(SimpleNamespace(
            prompt_tokens=2, completion_tokens=1, cached_tokens=0, finished_reason=reason, spec_verify_ct=0,
            created_time=0.0, first_token_time=None,
        ))
    body, _ = m.render({}, num_waiting_front_end=0)
    text = body.decode()
    assert 'sglite:num_aborted_requests_total{model_name="tiny"} 2.0' in text
    assert 'sglite:num_requests_total{finish_reason="abort",model_name="tiny"} 2.0' in text


def test_drafted_and_draft_free_step_counters_follow_the_scheduler_totals():
    """The scheduler's step totals become Prometheus counters, advanced by what each scrape adds."""
    m = ServerMetrics("tiny")

    def counters(state):
        text = m.render(state, num_waiting_front_end=0)[0].decode()
        return [float(l.rsplit(" ", 1)[1]) for name in ("spec_drafted_steps", "spec_draft_free_steps")
                for l in text.splitlines() if l.startswith(f"sglite:{name}_total{{")]

    assert counters({}) == [0.0, 0.0]
    assert counters({"spec_drafted_steps": 3, "spec_draft_free_steps": 5}) == [3.0, 5.0]
    assert counters({"spec_drafted_steps": 4, "spec_draft_free_steps": 9}) == [4.0, 9.0]
    assert counters({"spec_drafted_steps": 4, "spec_draft_free_steps": 9}) == [4.0, 9.0]  # a repeat scrape adds nothing

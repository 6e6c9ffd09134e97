"""Runtime context: attention-width arithmetic, live-field errors, publish-once and scoped bags."""

import pytest

from sglite.srt import runtime_context as rc
from sglite.srt.distributed.bootstrap import simulate_rank
from sglite.srt.runtime_context import (
    AttentionWidths,
    ParallelNotInitializedError,
    ParallelState,
    derive_attention_widths,
    get_parallel,
    scoped,
)

SUITE = "unit-cpu"
EST_TIME = 2


# Expected widths from SGLang's DP-attention rule (docs/parallelism.md):
# attn_dp = dp if DP attention else 1, attn_tp = tp // attn_dp // attn_cp.
@pytest.mark.parametrize(
    "tp,dp,dp_attn,cp,attn_dp,attn_tp",
    [
        (16, 16, True, 1, 16, 1),
        (16, 16, False, 1, 1, 16),
        (16, 8, True, 2, 8, 1),
        (8, 2, True, 1, 2, 4),
        (8, 1, False, 2, 1, 4),
        (1, 1, False, 1, 1, 1),
    ],
)
def test_derive_attention_widths(tp, dp, dp_attn, cp, attn_dp, attn_tp):
    assert derive_attention_widths(tp, dp, dp_attn, cp) == AttentionWidths(
        attn_tp_size=attn_tp, attn_dp_size=attn_dp, attn_cp_size=cp
    )


@pytest.mark.parametrize("tp,dp,dp_attn,cp", [(6, 4, True, 1), (4, 1, False, 3), (8, 4, True, 4), (0, 1, False, 1)])
def test_derive_attention_widths_rejects_non_dividing(tp, dp, dp_attn, cp):
    with pytest.raises(ValueError, match="tp"):
        derive_attention_widths(tp, dp, dp_attn, cp)


def test_configured_leaves_readable_at_once_live_fields_not():
    state = ParallelState(tp_size=4, dp_size=2, enable_dp_attention=True)
    assert (state.tp_size, state.dp_size, state.enable_dp_attention, state.attn_cp_size) == (4, 2, True, 1)
    for name, step in [
        ("attn_tp_size", "initialize_model_parallel"),
        ("tp_group", "initialize_model_parallel"),
        ("attn_dp_size", "initialize_dp_attention"),
        ("world_size", "init_distributed_environment"),
    ]:
        with pytest.raises(ParallelNotInitializedError, match=step):
            getattr(state, name)
    with pytest.raises(AttributeError):
        state.no_such_field


def test_get_parallel_attn_tp_size_before_and_after_stamp():
    state = ParallelState(tp_size=16, dp_size=16, enable_dp_attention=True)
    with scoped(parallel=state):
        with pytest.raises(ParallelNotInitializedError, match="attn_tp_size.*initialize_model_parallel"):
            get_parallel().attn_tp_size
        simulate_rank(state, 3)
        assert get_parallel().attn_tp_size == 1
        assert get_parallel().attn_dp_size == 16
        assert get_parallel().attn_dp_rank == 3


def test_stamp_rejects_unknown_field():
    with pytest.raises(KeyError):
        ParallelState().stamp(attn_tp_sise=2)


def test_summary_omits_groups():
    state = ParallelState(tp_size=2)
    state.stamp(attn_tp_size=2, tp_group=object())
    summary = state.summary()
    assert summary["attn_tp_size"] == 2 and "tp_group" not in summary


def test_publish_once_and_scoped_restores(monkeypatch):
    monkeypatch.setattr(rc, "_CTX", rc._Context())
    with pytest.raises(RuntimeError, match="has not been published"):
        get_parallel()
    first = ParallelState(tp_size=2)
    rc.publish(parallel=first)
    with pytest.raises(RuntimeError, match="already published"):
        rc.publish(parallel=ParallelState())
    other = ParallelState(tp_size=8)
    with scoped(parallel=other):
        assert get_parallel() is other
    assert get_parallel() is first

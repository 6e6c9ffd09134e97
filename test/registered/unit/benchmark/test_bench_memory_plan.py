"""bench_memory_plan on the seeds' topology: sglite prices the draft at attn_tp, the wrong rules OOM."""

import os

import pytest

SUITE = "unit-cpu"
EST_TIME = 10

SCRIPT = "bench_memory_plan"
# The repo's copies of shared/model_configs (identical files), so a fresh clone anywhere finds them.
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "model_configs")


@pytest.fixture(scope="module", autouse=True)
def _configs_present():
    if not os.path.isdir(CONFIGS):
        pytest.fail(f"model configs not found at {CONFIGS}")


def test_dp_attention_case_prices_draft_at_attn_tp(bench):
    row = bench.compare(os.path.join(CONFIGS, "qwen3-8b.json"), os.path.join(CONFIGS, "qwen3-8b-dflash-b16.json"),
                        "DFLASH", ("tp16 dp16 dpattn", 16, 16, True, 1), 141.0, 0.9)
    assert row.attn_tp_size == 1
    assert row.draft_cell_bytes == 8 * 256 * 5 * 2  # all 8 KV heads on every rank
    assert row.raw_tp_draft_undercount == 8.0
    assert row.planned_equals_allocated
    assert row.ratio >= 0.99
    # pricing the draft at tp 16 plans more tokens than fit: start-up OOM by gigabytes
    assert row.raw_tp_tokens > row.sglite_tokens
    assert row.raw_tp_overcommit_bytes > 2**30


def test_without_dp_attention_raw_tp_equals_attn_tp(bench):
    row = bench.compare(os.path.join(CONFIGS, "qwen3-8b.json"), os.path.join(CONFIGS, "qwen3-8b-dflash-b16.json"),
                        "DFLASH", ("tp16", 16, 1, False, 1), 141.0, 0.9)
    assert row.attn_tp_size == 16 and row.draft_cell_bytes == 1 * 256 * 5 * 2
    assert row.raw_tp_tokens == row.ideal_tokens and row.raw_tp_overcommit_bytes <= 0

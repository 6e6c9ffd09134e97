"""The compiled step's paged attention (decode, verify blocks, prefills and mixed prefill + decode steps), run eagerly,
against plain SDPA on unpaged K/V."""

SUITE = "unit-cpu"
EST_TIME = 5

import pytest
import torch

from attention_cases import build_case, dense_reference
from sglite.srt.layers.attention.compiled_decode import CompiledDecodeAttention, TracedDecodeBatch
from sglite.srt.model_executor.compiled_decode_runner import decode_slots
from sglite.srt.model_executor.forward_batch_info import ForwardMode


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(
    "mode,new_tokens",
    [
        (ForwardMode.DECODE, [1, 1, 1, 1]),
        (ForwardMode.TARGET_VERIFY, [3, 3, 3, 3]),
        (ForwardMode.EXTEND, [5, 1, 9, 1]),  # a mixed step: two prompt chunks, two decode rows
    ],
)
def test_paged_causal_attention_equals_dense_sdpa(page_size, sliding_window, group, mode, new_tokens):
    case = build_case(
        mode, [0, 7, 33, 2], new_tokens, page_size=page_size, num_kv_heads=2, group=group,
        head_dim=32, v_head_dim=16, sliding_window=sliding_window, seed=page_size + group,
    )
    fb = case.forward_batch
    backend = CompiledDecodeAttention(fb.token_to_kv_pool, use_kernel=False)  # the kernel: test_cpu_paged_attention
    batch = TracedDecodeBatch(attn_backend=backend, slots=decode_slots(fb))
    out = backend.forward(case.q, case.k, case.v, case.layer, batch)
    torch.testing.assert_close(out, dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)
    # The new tokens' K/V went to their slots.
    pool, i = fb.token_to_kv_pool, case.layer.layer_id
    k_new = case.k.reshape(sum(new_tokens), case.layer.num_kv_heads, case.layer.head_dim)
    torch.testing.assert_close(pool.get_key_buffer(i)[fb.out_cache_loc.long()], k_new)

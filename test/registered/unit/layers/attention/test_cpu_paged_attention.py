"""cpu_paged_attention: the C++ kernel gives the torch formulation's attention (and dense SDPA's) on paged K/V, inside a
compiled graph too, and declines what it does not serve."""

SUITE = "unit-cpu"
EST_TIME = 20  # one build of the kernel (~3 s), one small compile, ~50 small cases

import pytest
import torch

from attention_cases import build_case, dense_reference
from sglite.srt.layers.attention import cpu_paged_attention
from sglite.srt.layers.attention.compiled_decode import (
    CompiledDecodeAttention,
    TracedDecodeBatch,
    paged_causal_attention,
)
from sglite.srt.layers.attention.cpu_paged_attention import MAX_GROUP, kernel_serves
from sglite.srt.layers.cpu_kernel_build import cxx_compiler
from sglite.srt.model_executor.compiled_decode_runner import decode_slots
from sglite.srt.model_executor.forward_batch_info import ForwardMode

pytestmark = pytest.mark.skipif(
    cxx_compiler() is None or not torch.backends.mkldnn.is_available(), reason="needs a C++ compiler and an x86 torch build"
)


def _kernel(case, slots, sliding_window=None):
    """The kernel's output for a case whose new K/V are already in the pool."""
    layer, tokens = case.layer, case.q.shape[0]
    k_cache, v_cache = case.forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    q = case.q.reshape(tokens, layer.num_heads, layer.head_dim)
    return torch.ops.sglite.paged_attention(
        q, k_cache, v_cache, slots.kv_indices, slots.seq_lens, slots.token_rows, slots.token_key_index,
        layer.scaling, sliding_window or 0,
    )


def test_the_kernel_builds_and_serves_fp32_heads_it_was_built_for():
    assert kernel_serves(torch.float32, 9, 3, 64, 64)  # SmolLM2
    assert kernel_serves(torch.float32, 16, 4, 64, 64) and kernel_serves(torch.float32, 32, 8, 128, 128)
    assert kernel_serves(torch.float32, 4, 2, 32, 16)  # V heads of another size
    assert not kernel_serves(torch.bfloat16, 9, 3, 64, 64)  # fp32 only (a bf16 pool's rows are widened first)
    assert not kernel_serves(torch.float32, 9, 3, 48, 48)  # no instantiation for 48
    assert not kernel_serves(torch.float32, 9, 2, 64, 64)  # heads not a multiple of the KV heads
    assert not kernel_serves(torch.float32, 2 * MAX_GROUP, 1, 64, 64)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("group,head_dim,v_head_dim", [(1, 32, 16), (4, 32, 32), (3, 64, 64), (2, 128, 128)])
@pytest.mark.parametrize(
    "mode,new_tokens",
    [
        (ForwardMode.DECODE, [1, 1, 1, 1]),
        (ForwardMode.TARGET_VERIFY, [3, 3, 3, 3]),
        (ForwardMode.EXTEND, [5, 1, 9, 1]),  # a mixed step: two prompt chunks, two decode rows
        (ForwardMode.EXTEND, [17, 40, 2, 33]),  # prompts past a 16-key vector, with and without a tail
    ],
)
def test_kernel_equals_the_torch_formulation_and_dense_sdpa(page_size, sliding_window, group, head_dim, v_head_dim, mode, new_tokens):
    case = build_case(
        mode, [0, 7, 33, 2], new_tokens, page_size=page_size, num_kv_heads=2, group=group, head_dim=head_dim,
        v_head_dim=v_head_dim, sliding_window=sliding_window, seed=page_size + group + head_dim,
    )
    fb = case.forward_batch
    slots = decode_slots(fb)
    CompiledDecodeAttention(fb.token_to_kv_pool, use_kernel=False).forward(
        case.q, case.k, case.v, case.layer, TracedDecodeBatch(attn_backend=None, slots=slots)
    )  # writes the new tokens' K/V; its output is the torch formulation's
    layer, tokens = case.layer, case.q.shape[0]
    k_cache, v_cache = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    q = case.q.reshape(tokens, layer.num_heads, layer.head_dim)
    torch_out = paged_causal_attention(q, k_cache, v_cache, slots, layer.scaling, sliding_window)
    got = _kernel(case, slots, sliding_window)
    torch.testing.assert_close(got, torch_out, atol=1e-5, rtol=1e-5)
    dense = dense_reference(case, causal=True).reshape(tokens, layer.num_heads, layer.v_head_dim)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


def test_softmax_weights_are_accurate_over_the_whole_exp_range():
    """The kernel's own exp: one query against 4,000 keys whose scores span [-80, 0], against float64."""
    n = 4000
    k = torch.zeros(n, 1, 16)
    k[:, 0, 0] = torch.linspace(-80, 0, n)
    v = torch.randn(n, 1, 16, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 1.0
    got = torch.ops.sglite.paged_attention(q, k, v, torch.arange(n)[None], torch.tensor([n]), None, None, 1.0, 0)
    weights = torch.softmax(k[:, 0, 0].double(), 0)
    ref = (weights[:, None] * v[:, 0].double()).sum(0)
    torch.testing.assert_close(got[0, 0].double(), ref, rtol=2e-6, atol=1e-7)


def test_the_backend_sends_forwards_of_several_new_tokens_to_the_kernel(monkeypatch):
    """Prefill, mixed and verify forwards go through the kernel; decode steps keep the torch formulation, which
    Inductor fuses as well as the kernel runs there."""
    calls = []
    real = torch.ops.sglite.paged_attention

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    monkeypatch.setattr(torch.ops.sglite, "paged_attention", Spy())
    for mode, new_tokens in [(ForwardMode.DECODE, [1, 1]), (ForwardMode.EXTEND, [4, 1])]:
        case = build_case(mode, [3, 5], new_tokens, page_size=1, num_kv_heads=2, group=2, head_dim=32, seed=1)
        fb = case.forward_batch
        backend = CompiledDecodeAttention(fb.token_to_kv_pool, use_kernel=True)
        out = backend.forward(case.q, case.k, case.v, case.layer, TracedDecodeBatch(attn_backend=backend, slots=decode_slots(fb)))
        torch.testing.assert_close(out, dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)
    assert calls == [5]  # the EXTEND's five new tokens; the decode step did not call it


def test_the_kernel_runs_inside_a_compiled_graph():
    case = build_case(ForwardMode.EXTEND, [0, 4], [6, 1], page_size=1, num_kv_heads=2, group=3, head_dim=64, seed=5)
    fb = case.forward_batch
    backend = CompiledDecodeAttention(fb.token_to_kv_pool, use_kernel=True)
    batch = TracedDecodeBatch(attn_backend=backend, slots=decode_slots(fb))
    compiled = torch.compile(lambda q, k, v: backend.forward(q, k, v, case.layer, batch), fullgraph=True)
    torch.testing.assert_close(compiled(case.q, case.k, case.v), dense_reference(case, causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_bf16_pool_reaches_the_kernel_as_widened_rows_and_equals_the_torch_formulation(compiled):
    """bf16 K/V: the forward's rows widened to fp32 (exactly), the kernel's fp32 attention, one rounding to bf16 at
    the end, as the torch formulation computes it; the pool is left as it was, bar the new tokens' K/V."""
    case = build_case(ForwardMode.EXTEND, [0, 7, 33, 2], [17, 1, 9, 1], page_size=16, num_kv_heads=3, group=3,
                      head_dim=64, dtype=torch.bfloat16, seed=11)
    fb = case.forward_batch
    slots = decode_slots(fb)
    reference = CompiledDecodeAttention(fb.token_to_kv_pool, use_kernel=False)
    batch = TracedDecodeBatch(attn_backend=reference, slots=slots)
    want = reference.forward(case.q, case.k, case.v, case.layer, batch)  # writes the new tokens' K/V
    pool_after_write = [b.clone() for b in fb.token_to_kv_pool.get_kv_buffer(case.layer.layer_id)]
    backend = CompiledDecodeAttention(fb.token_to_kv_pool, use_kernel=True)
    run = lambda q, k, v: backend.forward(q, k, v, case.layer, TracedDecodeBatch(attn_backend=backend, slots=slots))
    got = (torch.compile(run, fullgraph=True) if compiled else run)(case.q, case.k, case.v)
    assert got.dtype == torch.bfloat16
    # Both attend in fp32 from the same bf16 rows; their sums differ in order only, so at most one bf16 ulp apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
    for buf, before in zip(fb.token_to_kv_pool.get_kv_buffer(case.layer.layer_id), pool_after_write):
        assert buf.dtype == torch.bfloat16 and torch.equal(buf, before)


def test_the_kernel_refuses_tokens_that_are_not_request_major():
    case = build_case(ForwardMode.EXTEND, [0, 0], [2, 2], page_size=1, num_kv_heads=1, group=1, head_dim=16, seed=2)
    slots = decode_slots(case.forward_batch)
    slots.token_rows = torch.tensor([0, 1, 0, 1])  # the kernel walks each request's consecutive tokens
    with pytest.raises(ValueError, match="status 2"):
        _kernel(case, slots)


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(cpu_paged_attention.ENV_SWITCH, "0")
    cpu_paged_attention._load_library.cache_clear()
    try:
        assert not kernel_serves(torch.float32, 9, 3, 64, 64)
    finally:
        monkeypatch.delenv(cpu_paged_attention.ENV_SWITCH)
        cpu_paged_attention._load_library.cache_clear()
    assert kernel_serves(torch.float32, 9, 3, 64, 64)
